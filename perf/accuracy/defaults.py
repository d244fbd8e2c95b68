"""Every method at its defaults against dense on the glyphs workload, 2 ranks, SGD with momentum 0.9 (issue #40).

    .venv/bin/python perf/accuracy/defaults.py                          # every row, seed 0
    .venv/bin/python perf/accuracy/defaults.py --rows randomk signsgd --seeds 0 1
    .venv/bin/python perf/accuracy/defaults.py --table                  # the markdown tables of the results file

Each row is one job, run alone (one training job at a time): ``launch/mpirun.sh -np 2 .venv/bin/hvdcomp train
--workload glyphs --config JOB --target 0.97 --no-progress --json OUT``, the job file holding the row's compression
setting (and its learning rate, where the row sets one: dense's, 0.1, otherwise). ``hvdcomp train`` sets the options
the papers count in epochs (DGC's warm-up stage, GraVAC's interval, LGC's stages) to one epoch of steps, and gives
momentum 0 to the parameters of methods that apply momentum themselves (DGC; top-k, threshold, random-k and the
sign family at their defaults: momentum correction, :mod:`hvdcomp.error_feedback`). Dense's own learning rate is the
best of 0.02, 0.05, 0.07, 0.1, 0.14 and 0.2 (``--rows`` of the ``dense-lr`` group): 0.1.

Rows: ``defaults``, every registered method at its defaults; ``previous``, the defaults before issue #40 (top-k,
threshold, random-k, signSGD and EF-signSGD under the optimizer's momentum, DGC with factor masking, QSGD with the
L2 norm), which the same tree runs through their options; ``advice``, what random-k's warning suggests instead (a
ratio of 10%, or half the learning rate); ``buckets``, methods compressing in buckets of 25 MiB (``bucket_cap_mb``:
the model's gradients of a method as one tensor); ``dense-lr``, dense at other learning rates. Each result is
appended to the results file as a JSON line: the row, its setting, seed, learning rate, the test accuracy at the end of
each epoch, the compression ratio, the mean step, the AccuracyWarning the run printed, the commit, UTC date and
machine.
``--table`` gives the points against dense at the same seed (dense's row at lr 0.1 must be in the file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "perf" / "results" / "accuracy_defaults.jsonl"
WORKLOAD = "glyphs"
#: dense's best learning rate on glyphs (the ``dense-lr`` rows), the workload's default
LR = 0.1
METHODS = ("none", "fp16", "terngrad", "topk", "randomk", "powersgd", "bingrad", "orq", "qsgd", "signsgd", "efsignsgd",
           "onebit", "threshold", "dgc", "gravac", "sketch", "lgc")
#: the ``buckets`` rows: methods whose statistics become the bucket's with ``bucket_cap_mb`` (a scaler, a norm, k)
BUCKETED = ("terngrad", "topk", "qsgd", "efsignsgd", "dgc")
#: label -> (group, compression setting, learning rate or None for the workload's)
ROWS: dict[str, tuple[str, Any, float | None]] = {
    **{method: ("defaults", method, None) for method in METHODS},
    "randomk (momentum 0)": ("previous", {"method": "randomk", "options": {"momentum": 0.0}}, None),
    "signsgd (momentum 0)": ("previous", {"method": "signsgd", "options": {"momentum": 0.0}}, None),
    "efsignsgd (momentum 0)": ("previous", {"method": "efsignsgd", "options": {"momentum": 0.0}}, None),
    "dgc (momentum masking)": ("previous", {"method": "dgc", "options": {"momentum_masking": True}}, None),
    "topk (momentum 0)": ("previous", {"method": "topk", "options": {"momentum": 0.0}}, None),
    "threshold (momentum 0)": ("previous", {"method": "threshold", "options": {"momentum": 0.0}}, None),
    "qsgd (norm l2)": ("previous", {"method": "qsgd", "options": {"norm": "l2"}}, None),
    "randomk (ratio 0.1)": ("advice", {"method": "randomk", "options": {"ratio": 0.1}}, None),
    "randomk (lr 0.05)": ("advice", "randomk", 0.05),
    **{f"none (lr {lr:g})": ("dense-lr", "none", lr) for lr in (0.02, 0.05, 0.07, 0.14, 0.2)},
    **{f"{method} (buckets 25 MiB)": ("buckets", {"method": method, "bucket_cap_mb": 25}, None)
       for method in BUCKETED},
}


def commit() -> str:
    """HEAD, marked where tracked files differ from it (the results files aside: the runs append to them)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)perf/results"], cwd=REPO, capture_output=True, text=True).stdout
    return head.strip() + ("+uncommitted" if dirty.strip() else "")


def run_row(label: str, seed: int) -> dict[str, Any]:
    """Trains one row on 2 ranks; its summary as a results line (without the points against dense)."""
    group, compression, lr = ROWS[label]
    with tempfile.TemporaryDirectory() as folder:
        job, out = Path(folder) / "job.yaml", Path(folder) / "summary.json"
        job.write_text(yaml.safe_dump({"workload": WORKLOAD, "seed": seed, "compression": compression,
                                       **({"lr": lr} if lr is not None else {})}))
        command = [str(REPO / "launch" / "mpirun.sh"), "-np", "2", str(REPO / ".venv" / "bin" / "hvdcomp"), "train",
                   "--config", str(job), "--target", "0.97", "--no-progress", "--json", str(out)]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"{label}: hvdcomp train failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        (summary,) = json.loads(out.read_text())
    warned = sorted({line.split("AccuracyWarning: ", 1)[1].strip() for line in result.stderr.splitlines()
                     if "AccuracyWarning: " in line})
    return {"row": label, "group": group, "compression": compression, "seed": seed, "lr": lr or LR,
            "epoch_accuracy": [round(a, 4) for a in summary["epoch_accuracy"]],
            "test_accuracy": round(summary["test_accuracy"], 4),
            "compression_ratio": summary["compression_ratio"] and round(summary["compression_ratio"], 1),
            "mean_step_s": round(summary["mean_step_s"], 4), "warning": warned,
            "command": f"hvdcomp train --workload {WORKLOAD} --compression {json.dumps(compression)}"
                       + (f" --lr {lr:g}" if lr is not None else "") + f" --seed {seed} --target 0.97 (2 ranks)",
            "commit": commit(), "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
            "machine": f"this 2-core CPU machine ({platform.processor() or platform.machine()})"}


def latest(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The last result of each (row, seed) in the results file."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                rows[(entry["row"], entry["seed"])] = entry
    return rows


def table(path: Path) -> str:
    """Markdown tables, one per group: each row's test accuracy per epoch, and the points against dense (the same
    seed) after the last epoch; means over the seeds measured."""
    rows = latest(path)
    lines = []
    for group in ("defaults", "previous", "advice", "buckets", "dense-lr"):
        labels = [label for label, (g, _, _) in ROWS.items() if g == group and any(r == label for r, _ in rows)]
        if not labels:
            continue
        lines += [f"\n**{group}**\n", "| row | seeds | lr | test accuracy after epoch 1, 2, 3 (%) | vs dense (points) "
                  "| compression | warns |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for label in labels:
            entries = [entry for (r, _), entry in sorted(rows.items()) if r == label]
            seeds = [entry["seed"] for entry in entries]
            epochs = [sum(e["epoch_accuracy"][i] for e in entries) / len(entries) * 100
                      for i in range(len(entries[0]["epoch_accuracy"]))]
            dense = [rows[("none", seed)]["test_accuracy"] for seed in seeds if ("none", seed) in rows]
            points = ((sum(e["test_accuracy"] for e in entries) - sum(dense)) / len(entries) * 100
                      if len(dense) == len(entries) else None)
            ratio = entries[0]["compression_ratio"]
            lines.append(f"| {label} | {', '.join(map(str, seeds))} | {entries[0]['lr']:g} | "
                         f"{', '.join(f'{a:.2f}' for a in epochs)} | "
                         f"{'-' if points is None else f'{points:+.2f}'} | {'-' if ratio is None else f'{ratio:g}x'} | "
                         f"{'yes' if entries[0]['warning'] else ''} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), metavar="ROW",
                        help=f"rows to run (default: defaults, previous and advice); one of: {', '.join(ROWS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file (appended to)")
    parser.add_argument("--table", action="store_true", help="print the results file's tables and run nothing")
    args = parser.parse_args()
    if args.table:
        print(table(args.out))
        return 0
    labels = args.rows or [label for label, (group, _, _) in ROWS.items() if group not in ("dense-lr", "buckets")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for label in labels:
            entry = run_row(label, seed)
            with args.out.open("a") as stream:
                stream.write(json.dumps(entry) + "\n")
            print(f"{label} seed {seed}: {entry['epoch_accuracy']}{' (warns)' if entry['warning'] else ''}",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
