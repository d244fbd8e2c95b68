"""The optimizer's check of a step's gradients for NaN and Inf, both ways, on ResNet-50's gradients.

    .venv/bin/python perf/gpu/checks.py [--device cuda] [--repeats 20]

``hvdcomp.compressor.nonfinite`` checks every gradient after the step's reduction (and each compressed one before
it). It takes each tensor's min and max on CPU (``_finite_by_range``: 7 operators a tensor, then a stack) and every
tensor's L1 norm in one multi-tensor operator on CUDA (``_finite_by_norms``: 3 operators for all of them; the flags'
``torch.where`` adds one to either). This
times both on the device given (``hvdcomp.tools.bench.timed``: CUDA events with L2 flushed, or the host clock, in
interleaved rounds) and counts the PyTorch operators each issues (through a ``TorchDispatchMode``; on CUDA each is at
least one launch), on torchvision's ResNet-50's 161 parameters (Gaussian values). One JSON line per device goes to
perf/results/checks.jsonl.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from buckets import resnet50_shapes  # perf/gpu/, the script's folder
from torch.utils._python_dispatch import TorchDispatchMode

from hvdcomp.compressor import _finite_by_norms, _finite_by_range
from hvdcomp.tools.bench import clock_fields, record, timed, timing_fields

RESULTS = Path(__file__).resolve().parents[1] / "results" / "checks.jsonl"


class _Operators(TorchDispatchMode):
    """Counts the PyTorch operators run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator).to(device) for _, shape in resnet50_shapes()]
    ways = {"by_range": lambda: _finite_by_range(grads), "by_norms": lambda: _finite_by_norms(grads)}
    assert torch.equal(ways["by_range"](), ways["by_norms"]())
    operators = {}
    for name, way in ways.items():
        with _Operators() as counted:
            way()
        operators[name] = counted.count
    timings = timed(ways, device, args.repeats)
    row: dict[str, Any] = {
        "model": "resnet50", "tensors": len(grads), **clock_fields(device), "repeats": args.repeats,
        "operators": operators, **timing_fields(timings),
    }
    record(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
