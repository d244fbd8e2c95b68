"""The sparsifiers' top-k selection on a GPU, over the whole tensor against over gathered candidates.

    python perf/gpu/selection.py [--repeats 20] [--numel 262144 ...] [--density 0.01 0.001]

``hvdcomp.kernels.gpu.select.topk`` runs its four digit passes over candidates gathered at a sampled bound from
``_GATHER_MIN`` entries on, where k is small enough (its module docstring). This times both ways on Gaussian float32
tensors of each size and density (k = density x n), the gathering included, beside a copy of the tensor
(``x.clone()``), with ``hvdcomp.tools.bench.timed`` (CUDA events, L2 flushed, interleaved rounds): where the
gathered way is the faster one is where ``_GATHER_MIN`` belongs. Both ways must select the same entries in the same
order; the script checks that first. One JSON line per size and density goes to perf/results/selection.jsonl. It needs
a CUDA device: on CPU the kernels run only in Triton's interpreter, whose times say nothing of a GPU's.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hvdcomp.kernels.gpu import select
from hvdcomp.tools.bench import timed

RESULTS = Path(__file__).resolve().parents[1] / "results" / "selection.jsonl"
SIZES = (1 << 18, 1 << 20, 1 << 22, 1 << 24, 25_000_000)


def _gathered(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor,
              plan: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    return select._select_blocks(x, k, values, indices, None, select._gather(x, k, None, plan))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--density", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (on CPU the kernels run only in Triton's interpreter)")
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    for n in args.numel:
        x = torch.randn(n, generator=generator).to(device)
        for density in args.density:
            k = max(1, int(density * n))
            plan = select._gathering(n, k)
            if plan is None:
                print(json.dumps({"numel": n, "k": k, "skipped": "the plan would gather more than n / 8"}))
                continue
            values, indices = torch.empty(k, device=device), torch.empty(k, dtype=torch.int64, device=device)

            whole = partial(select._select_blocks, x, k, values, indices, None, None)
            gathered = partial(_gathered, x, k, values, indices, plan)
            expected = [t.clone() for t in whole()]
            got = gathered()
            if not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)):
                raise SystemExit(f"n {n}, k {k}: the gathered selection differs from the whole tensor's")
            candidates = int(select._gather(x, k, None, plan).found[-1])  # (a host read, outside the timing)
            timings = timed({"whole": whole, "gathered": gathered, "copy": x.clone}, device, args.repeats)
            row: dict[str, Any] = {
                "numel": n, "k": k, "density": density, "rank": plan[0], "capacity": plan[1],
                "candidates": candidates, "gathered": k <= candidates <= plan[1],
                "device_name": torch.cuda.get_device_name(device), "clock": "cuda events, L2 flushed",
                "repeats": args.repeats,
                **{f"{name}_us": round(1e6 * t.median, 2) for name, t in timings.items()},
                **{f"{name}_spread_us": [round(1e6 * min(t.times), 2), round(1e6 * max(t.times), 2)]
                   for name, t in timings.items()},
                "gathered_over_whole": round(timings["gathered"].median / timings["whole"].median, 3),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            print(json.dumps(row))
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
