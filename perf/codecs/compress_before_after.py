"""Compression speed on CPU of this working tree against a base commit, alternating: ``bench compress`` per method.

    .venv/bin/python perf/codecs/compress_before_after.py --base COMMIT [--methods terngrad qsgd] [--numel 4000000]
        [--alternations 5] [--repeats 5] [--step] [--out compress_before_after.jsonl]

For a change that must not move CPU speed (a new device path beside the CPU kernels): the base commit is checked
out into a temporary git worktree with its own kernel build folder; then, ``--alternations`` times, each method runs
``hvdcomp bench compress`` (``--repeats`` rounds, median) in the base and in this tree, one after the other, the
base first in even alternations and last in odd ones, so that a change of load on the shared cores hits both alike.
Rows, tagged ``before: COMMIT`` or ``after`` (with this tree's commit, ``+`` where it has uncommitted changes, the
date and the machine), are appended to perf/results/OUT; per method the medians of compress + decompress GB/s on
each side, their ranges and the ratio after / before are printed. One timing run at a time on this 2-core machine.
``HVDCOMP_KERNELS=0`` in the environment times the PyTorch path instead of the CPU kernels (rows say which).

``--step`` times a training step's work on one gradient instead (:data:`STEP`, through the public API, so that any
base runs it): with the method's default memory (error feedback, momentum correction), ``agree``, ``compress`` (the
memory's update included) and ``aggregate`` of the payload, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "perf" / "results"
BENCH = ("import json, sys; from hvdcomp.tools.bench import bench_compress; "
         "print(json.dumps(bench_compress(sys.argv[1], int(sys.argv[2]), 'cpu', int(sys.argv[3]))))")

STEP = """
import json, statistics, sys, time
from dataclasses import replace
import torch
from hvdcomp import Context, make_compressor
from hvdcomp.compressor import STEADY_STEP
method, numel, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
compressor = make_compressor(method)
ctx = replace(Context.local(x, seed=1), step=STEADY_STEP)
state = compressor.init_state(x, ctx)
times = []
for _ in range(repeats + 1):  # the first: warm-up
    grad = x.clone()
    start = time.perf_counter()
    compressor.agree(grad, state, ctx)
    payload, meta = compressor.compress(grad, state, ctx)
    compressor.aggregate([payload], meta)
    times.append(time.perf_counter() - start)
print(json.dumps({"method": method, "numel": numel, "repeats": repeats, "step_ms": 1e3 * statistics.median(times[1:]),
                  "threads": torch.get_num_threads()}))
"""


def run(tree: Path, method: str, numel: int, repeats: int, step: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", STEP if step else BENCH, method, str(numel), str(repeats)], cwd=tree,
                          env=env, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--methods", nargs="+", default=["terngrad", "qsgd", "signsgd", "efsignsgd", "onebit",
                                                         "bingrad", "orq"])
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--alternations", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step", action="store_true", help="time a step's agree + compress + aggregate (ms)")
    parser.add_argument("--out", default="compress_before_after.jsonl")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.base], check=True,
                            capture_output=True, text=True).stdout.strip()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), commit], check=True,
                       capture_output=True)
        try:
            for tree in (base, REPO):  # the kernels built before any timed run
                subprocess.run([sys.executable, "-m", "hvdcomp.kernels", "--build"], cwd=tree, check=True,
                               env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True)
            after = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True,
                                   capture_output=True, text=True).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   check=True, capture_output=True, text=True).stdout.strip() != ""
            for alternation in range(args.alternations):
                for method in args.methods:
                    sides = ((f"before: {commit}", base), ("after", REPO))
                    for side, tree in sides if alternation % 2 == 0 else sides[::-1]:  # a drift hits both sides
                        row = {"side": side, "alternation": alternation, "after_commit": after + "+" * dirty,
                               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                               "kernels": os.environ.get("HVDCOMP_KERNELS", "default"),
                               **run(tree, method, args.numel, args.repeats, args.step)}
                        rows.append(row)
                        with open(RESULTS / args.out, "a") as out:
                            out.write(json.dumps(row) + "\n")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    field, unit = ("step_ms", "ms") if args.step else ("compress_decompress_gbps", "GB/s")
    print(f"{'method':<10} {f'before {unit} (range)':>24} {f'after {unit} (range)':>24} {'after/before':>13}")
    for method in args.methods:
        sides = [[r[field] for r in rows if r["method"] == method and r["side"] == side]
                 for side in (f"before: {commit}", "after")]
        before, after = (statistics.median(values) for values in sides)
        ranges = [f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for v in sides]
        print(f"{method:<10} {ranges[0]:>24} {ranges[1]:>24} {after / before:>13.3f}")


if __name__ == "__main__":
    main()
