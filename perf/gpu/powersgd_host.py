"""The host's part of a step of PowerSGD's buckets on the Triton path, measured without a GPU.

    .venv/bin/python perf/gpu/powersgd_host.py [--repeats 30] [--cap-mb 25] [--out powersgd_host.jsonl]

On a GPU, PowerSGD's buckets of ResNet-50's 54 matrices cost more than any other method's (docs/gpu.md) and the host,
issuing, sets that time. This times the host's part alone, on CPU: ``perf/gpu/buckets.py``'s buckets (ResNet-50's
shapes, Gaussian values, the steady state) reduced as one rank's step runs them, down the Triton path
(``HVDCOMP_KERNELS=triton``), with the kernels (the products, the approximations, the orthogonalization) and the
residual's multi-tensor add replaced by stand-ins that allocate their outputs and compute nothing: what is left is the
Python and PyTorch bookkeeping a GPU's host runs before and between its launches, not the launches themselves. The
figures are this machine's host, not a GPU host's; compare two commits by running this at each, alternately, in one
sitting (``PYTHONPATH=WORKTREE`` runs another checkout's hvdcomp: a ``git worktree`` of the other commit). One JSON
line per run goes to perf/results/OUT, with the commit of the hvdcomp it ran (``+`` where that tree has changes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # (nothing runs in it: the kernels are stood in for; the path needs it set)
os.environ["HVDCOMP_KERNELS"] = "triton"

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

import buckets  # noqa: E402

import hvdcomp  # noqa: E402
from hvdcomp.kernels import gpu  # noqa: E402
from hvdcomp.requests import run_one_rank_step  # noqa: E402
from hvdcomp.tools.bench import record  # noqa: E402


def _stand_ins() -> None:
    """The kernels' outputs, allocated and not computed; the residual's add (a compute on CPU tensors, a launch on a
    GPU) skipped."""
    def products(matrices: list[torch.Tensor], factors: torch.Tensor, rank: int,
                 transpose: bool = False) -> torch.Tensor:
        return factors.new_empty(sum(m.shape[1 if transpose else 0] for m in matrices) * rank)

    def approximations(matrices: list[torch.Tensor], ps: torch.Tensor, qs: torch.Tensor, rank: int,
                       residual_scale: float | None = None) -> torch.Tensor:
        return ps.new_empty(sum(m.numel() for m in matrices))

    # each wrapped as the kernels' interface wraps its functions (its device check is the host's too)
    gpu.products, gpu.approximations = gpu._on_their_device(products), gpu._on_their_device(approximations)
    gpu.orthogonalize_parts = gpu._on_their_device(lambda flat, rows, rank, epsilon=0.0: flat)
    gpu.orthogonalize = gpu._on_their_device(lambda matrix, epsilon=0.0: matrix)
    torch._foreach_add_ = lambda *args, **kwargs: None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cap-mb", type=float, default=25.0)
    parser.add_argument("--out", default="powersgd_host.jsonl")
    args = parser.parse_args(argv)
    _stand_ins()
    compressed, bucketed = buckets.planned("powersgd", torch.device("cpu"), args.cap_mb)
    units = []
    for bucket in bucketed:
        grads = [compressed[position][1] for position in bucket]
        units.append((grads, buckets._reducer(compressed[bucket[0]][2], grads, compressed[bucket[0]][0])))

    def step() -> None:
        run_one_rank_step([run(grads) for grads, run in units])

    for _ in range(3):  # warm-up: the layouts' tables, the caches
        step()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    times.sort()
    tree = Path(hvdcomp.__file__).resolve().parents[1]  # the checkout whose hvdcomp ran
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                            check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "hvdcomp"], cwd=tree,
                           capture_output=True, text=True, check=False).stdout.strip()
    row = {"method": "powersgd", "model": "resnet50", "matrices": len(compressed), "buckets": len(units),
           "commit": commit + ("+" if dirty else ""), "repeats": args.repeats, "clock": "host",
           "host_ms": round(times[len(times) // 2], 3), "host_spread_ms": [round(times[0], 3), round(times[-1], 3)],
           "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record(row, REPO / "perf" / "results" / args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
