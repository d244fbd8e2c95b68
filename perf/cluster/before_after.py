"""Training step time of this working tree against a base commit, alternating, on the emulated cluster.

    .venv/bin/python perf/cluster/before_after.py --base COMMIT [--alternations 3] [--steps 12] [--hosts 2]
        [--rates 100mbit] [--methods terngrad topk] [--out api_v2_before_after.jsonl]

A change that is not meant to move speed (a refactoring, a new interface) is checked with this: the base commit is
checked out into a temporary git worktree; then, ``--alternations`` times, the base and this tree each run
perf/cluster/cluster_training.py's worker (the synthetic model, batch 32 per rank, ``--steps`` timed steps after one
warm-up step) on a fresh emulated cluster per setting, one after the other (the base first in even alternations,
last in odd ones), so that load changes hit both alike.
Each tree imports its own ``hvdcomp`` (``PYTHONPATH``) and builds its own fused kernels (a base whose kernels
share one build folder per environment gets a folder of its own). Rows, tagged ``before: COMMIT`` or ``after``,
are appended to perf/results/OUT; the medians per side, their ranges and their ratio are printed. Root and
iproute2 needed, as for every cluster benchmark; one timing run at a time on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "perf" / "results"
#: the kernels' build folder of commits before it was keyed by the sources (one per environment)
SHARED_KERNELS = 'directory = pathlib.Path(sys.prefix) / "hvdcomp-kernels"\n'


def checkout(base: str, into: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), base], check=True,
                   capture_output=True, text=True)
    kernels = into / "hvdcomp" / "kernels" / "__init__.py"
    source = kernels.read_text()
    if SHARED_KERNELS in source:  # it would share, and fight over, this tree's build folder
        kernels.write_text(source.replace(SHARED_KERNELS, f"directory = pathlib.Path({str(into / '.kernels')!r})\n"))
    # built now, not in the first timed run's warm-up
    subprocess.run([sys.executable, "-m", "hvdcomp.kernels", "--build"], cwd=into, check=True,
                   env={**os.environ, "PYTHONPATH": str(into)})


def run(tree: Path, args: argparse.Namespace) -> list[dict]:
    """One run of the training benchmark's worker from ``tree``, on fresh clusters; its rows."""
    # the cluster benchmarks are in perf/cluster/, in commits before they moved there in perf/
    folder = tree / "perf" / "cluster" if (tree / "perf" / "cluster" / "clusterbench.py").exists() else tree / "perf"
    program = ("import clusterbench; clusterbench.run_settings("
               f"{str(folder / 'cluster_training.py')!r}, ['32', '{args.steps}', *{args.methods!r}], "
               f"{args.hosts!r}, {args.rates!r}, timeout=1500, results='before_after.scratch.jsonl')")
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", program], cwd=folder, env=environment, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the benchmark failed in {tree}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{") and '"method"' in line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--alternations", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--hosts", type=int, nargs="+", default=[2])
    parser.add_argument("--rates", nargs="+", default=["100mbit"])
    parser.add_argument("--methods", nargs="+", default=["terngrad", "topk"])
    parser.add_argument("--out", default="api_v2_before_after.jsonl", help="file under perf/results")
    args = parser.parse_args()
    if args.alternations < 1 or args.steps < 1:
        parser.error("--alternations and --steps must be >= 1")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hvdcomp-base-") as scratch:
        base_tree = Path(scratch) / "base"
        checkout(args.base, base_tree)
        try:
            sides = ((f"before: {args.base}", base_tree), ("after", REPO))
            for alternation in range(args.alternations):
                for code, tree in sides if alternation % 2 == 0 else sides[::-1]:  # a drift hits both sides
                    for row in run(tree, args):
                        rows.append({**row, "code": code, "series": f"{args.steps} timed steps per run"})
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / args.out, "a") as stream:
        stream.writelines(json.dumps(row) + "\n" for row in rows)
    (REPO / "perf" / "results" / "before_after.scratch.jsonl").unlink(missing_ok=True)
    for key in sorted({(row["hosts"], row["rate"], row["method"]) for row in rows}):
        sides = {code: [row["step_s"] for row in rows if (row["hosts"], row["rate"], row["method"]) == key
                        and row["code"] == code] for code in (f"before: {args.base}", "after")}
        before, after = (statistics.median(values) for values in sides.values())
        spans = [f"{min(v):.3f}-{max(v):.3f}" for v in sides.values()]
        print(f"{key[0]} hosts {key[1]:>8} {key[2]:>10}: before {before:.3f} s ({spans[0]}), after {after:.3f} s "
              f"({spans[1]}), after/before {after / before:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
