"""Validation of ``hvdcomp predict`` on the emulated cluster (issue 4, section 3): measured vs predicted step time.

    .venv/bin/python perf/perfmodel/perfmodel_validate.py     # 2 and 4 hosts x 100mbit, 1gbit, 10gbit x 4 methods

For each host count it brings up an emulated cluster (:mod:`hvdcomp.tools.cluster`, one rank per host) and
measures the model profile there (``hvdcomp profile --model synthetic`` on every host at once: the hosts share
this machine's cores, as the training ranks do). For each link rate it runs ``hvdcomp probe`` across the
hosts (ping-pong and Horovod collective fits: the only network inputs), then ``hvdcomp train --workload
synthetic --epochs 2`` once per method through the cluster's launch command, and compares the measured
median step time (after the first step; the model predicts the steady state) with
:func:`hvdcomp.perfmodel.timeline.simulate` on the probed cluster and the profile. Run it
on an otherwise idle machine: the hosts share its cores. Writes perf/results/perfmodel/*.yaml (inputs),
perf/results/perfmodel_validation.json and a Markdown table on stdout. Inputs already in
perf/results/perfmodel/ (profile, probe, train summaries) are reused: delete them to measure again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hvdcomp.perfmodel import schema, timeline
from hvdcomp.tools import cluster as emulated

REPO = Path(__file__).resolve().parents[2]
HVDCOMP = str(REPO / ".venv" / "bin" / "hvdcomp")
RESULTS = REPO / "perf" / "results"


def run(argv: list[str], timeout: float) -> str:
    done = subprocess.run(["timeout", str(int(timeout)), *argv], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[-12:])} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--rates", default="100mbit,1gbit,10gbit")
    parser.add_argument("--methods", default="none,fp16,terngrad,topk")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2, help="of 2048 samples: 2048 / hosts / batch steps each")
    parser.add_argument("--name", default="hvdpm", help="the emulated cluster's name")
    parser.add_argument("--out", default=str(RESULTS / "perfmodel_validation.json"))
    args = parser.parse_args()
    inputs = RESULTS / "perfmodel"
    inputs.mkdir(parents=True, exist_ok=True)
    rows = []
    model = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty=+"], capture_output=True,
                           text=True).stdout.strip()  # the model that predicted (the inputs may be older: reused)
    complete = False
    try:
        for hosts in (int(h) for h in args.hosts.split(",")):
            rates = args.rates.split(",")
            profile_path = inputs / f"profile-synthetic-b{args.batch_size}-{hosts}hosts.yaml"
            for rate in rates:
                net = emulated.up(hosts, rate, name=args.name)
                if not profile_path.exists():
                    run(net.launch_command([HVDCOMP, "profile", "--model", "synthetic", "--batch-size",
                                            str(args.batch_size), "--repeats", "5", "--out", str(profile_path)]),
                        900)
                profile = schema.load(profile_path, "profile")
                cluster_path = inputs / f"cluster-{hosts}hosts-{rate}.yaml"
                if not cluster_path.exists():
                    run(net.launch_command([HVDCOMP, "probe", "--out", str(cluster_path)]), 900)
                probed = schema.load(cluster_path, "cluster")
                for method in args.methods.split(","):
                    summary_path = inputs / f"train-{hosts}hosts-{rate}-{method}.json"
                    if not summary_path.exists():
                        run(net.launch_command([HVDCOMP, "train", "--workload", "synthetic", "--compression",
                                                method, "--epochs", str(args.epochs), "--batch-size",
                                                str(args.batch_size), "--no-progress", "--json", str(summary_path)]),
                            900)
                    measured = json.loads(summary_path.read_text())[0]
                    predicted = timeline.simulate(profile, probed, method, hosts)
                    error = predicted.step_s / measured["median_step_s"] - 1
                    rows.append({"hosts": hosts, "rate": rate, "method": method, "collective": predicted.collective,
                                 "steps": measured["steps"], "measured_ms": measured["median_step_s"] * 1e3,
                                 "measured_mean_ms": measured["mean_step_s"] * 1e3,
                                 "predicted_ms": predicted.step_s * 1e3, "error": error,
                                 "predicted_exposed_ms": predicted.exposed_s * 1e3,
                                 "predicted_communication_ms": predicted.communication_s * 1e3,
                                 "measured_mb_per_rank": measured["bytes_per_rank_per_step"] / 1e6,
                                 "predicted_mb_per_rank": predicted.bytes_per_rank / 1e6,
                                 "predicted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                 "model_commit": model, "measured_in": summary_path.name})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        complete = True
    finally:
        emulated.down(args.name)
        # a run cut short keeps its rows apart, not over the last complete run's
        Path(args.out if complete else f"{args.out}.partial").write_text(json.dumps(rows, indent=1) + "\n")
    errors = [abs(r["error"]) for r in rows]
    print("| hosts | rate | method | collective | measured ms | predicted ms | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['hosts']} | {r['rate']} | {r['method']} | {r['collective']} | {r['measured_ms']:.0f} | "
              f"{r['predicted_ms']:.0f} | {r['error'] * 100:+.1f}% |")
    if errors:
        print(f"\nmedian |error| {statistics.median(errors) * 100:.1f}%, worst {max(errors) * 100:.1f}% "
              f"over {len(errors)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
