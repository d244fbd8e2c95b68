"""GraVAC's trace: the compression factor, what was sent, the gain and the step time at every step of a run.

    mpirun -np 2 .venv/bin/hvdcomp train --workload digits --compression gravac --json perf/results/gravac_trace.json
    .venv/bin/python perf/training/gravac_trace.py perf/results/gravac_trace.json  # writes gravac_trace.png there

Reads the JSON summary of ``hvdcomp train`` (its ``trace``: per step rank 0's step time and, per tensor, the CF
in force, what was sent and the gain) and plots, per tensor, the CF in force and the CF sent (dense as 1x), the
gain with GraVAC's epsilon, and the step time. Prints the phases: the steps at each CF.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", type=Path, help="the --json file of hvdcomp train")
    parser.add_argument("--epsilon", type=float, default=0.75, help="the run's epsilon, drawn on the gain plot")
    args = parser.parse_args()
    runs = [run for run in json.loads(args.summary.read_text()) if run.get("trace")]
    if not runs:
        sys.exit(f"{args.summary}: no run with a trace (train with --compression gravac)")
    trace = runs[0]["trace"]
    tensors = sorted(trace[0]["tensors"])
    steps = [entry["step"] for entry in trace]
    for name in tensors:
        cfs = [entry["tensors"][name][0] for entry in trace]
        spans = [(cf, len(list(group))) for cf, group in itertools.groupby(cfs)]
        print(f"{name}: " + ", ".join(f"{cf:g}x for {n} steps" for cf, n in spans))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cf_axis, gain_axis, time_axis) = plt.subplots(3, 1, figsize=(7, 6.5), sharex=True)
    for name in tensors:
        cfs = [entry["tensors"][name][0] for entry in trace]
        sent = [1.0 if entry["tensors"][name][1] == "dense" else entry["tensors"][name][1] for entry in trace]
        gains = [entry["tensors"][name][2] for entry in trace]
        (line,) = cf_axis.step(steps, cfs, where="post", label=f"{name}: CF in force")
        cf_axis.plot(steps, sent, ".", markersize=3, color=line.get_color(), label=f"{name}: sent (dense = 1x)")
        gain_axis.plot(steps, gains, linewidth=0.8, color=line.get_color(), label=name)
    gain_axis.axhline(args.epsilon, color="black", linewidth=0.7, linestyle="--", label="epsilon")
    time_axis.plot(steps, [entry["step_time"] * 1e3 for entry in trace], linewidth=0.8, color="gray")
    cf_axis.set_yscale("log")
    cf_axis.set_ylabel("compression factor")
    gain_axis.set_ylabel("gain ||C(p)|| / ||p||")
    time_axis.set_ylabel("step time (ms, agreed)")
    time_axis.set_xlabel("step")
    cf_axis.legend(fontsize=7)
    gain_axis.legend(fontsize=7)
    run = runs[0]
    cf_axis.set_title(f"GraVAC on {run['workload']}, {run['ranks']} ranks: test accuracy {run['test_accuracy']:.3f}",
                      fontsize=9)
    figure.tight_layout()
    out = args.summary.with_suffix(".png")
    figure.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
