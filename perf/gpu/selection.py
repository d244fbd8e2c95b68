"""The sparsifiers' top-k selection on a GPU, over the whole tensor against over gathered candidates, and with its
programs looping over the blocks against one program a block.

    python perf/gpu/selection.py [--repeats 20] [--numel 262144 ...] [--density 0.01 0.001]

``hvdcomp.kernels.gpu.select.topk`` runs its four digit passes over candidates gathered at a sampled bound, or above
threshold's t, from ``_GATHER_MIN`` entries on, where k is small enough (its module docstring). This times both ways
on Gaussian float32 tensors of each size and density, the gathering included, beside a copy of the tensor
(``x.clone()``), with ``hvdcomp.tools.bench.timed`` (CUDA events, L2 flushed, interleaved rounds): top-k with k =
density x n, and threshold as its defaults have it (k = 4 x density x n, t passed by density x n entries), at any
density (``topk_gathers``: whether ``topk`` itself gathers there). Where the gathered way is the faster one is where
``_GATHER_MIN`` (the size) and ``_GATHER_SHARE`` (the candidates' share of the entries) belong. Each way runs twice
more with one program a block (the grid before the digit passes, the counts and the compaction looped over the blocks
with 4 programs an SM): ``looped_over_one_a_block`` is the looping programs' time over that. Every way must select the
same entries in the same order; the script checks that first. One JSON line per selection, size and density goes to
perf/results/selection.jsonl. It needs a CUDA device: on CPU the kernels run only in Triton's interpreter
(``TRITON_INTERPRET=1`` runs the script there, to check it; its times say nothing of a GPU's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hvdcomp.kernels.gpu import select
from hvdcomp.tools.bench import clock_fields, record, timed, timing_fields

RESULTS = Path(__file__).resolve().parents[1] / "results" / "selection.jsonl"
SIZES = (1 << 18, 1 << 20, 1 << 22, 1 << 24, 25_000_000)


def _gathered(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor, threshold: torch.Tensor | None,
              plan: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    return select._select_blocks(x, k, values, indices, threshold, select._gather(x, k, threshold, plan))


def _one_a_block(selection: Callable[[], Any]) -> Callable[[], Any]:
    """``selection`` run with one program a block (``select._programs`` replaced for the call)."""

    def run() -> Any:
        programs = select._programs
        select._programs = lambda device, blocks: blocks
        try:
            return selection()
        finally:
            select._programs = programs

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--density", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpreted:
        parser.error("needs a CUDA device (or TRITON_INTERPRET=1 to check the script on CPU, where its times say "
                     "nothing of a GPU's)")
    device = torch.device("cpu" if interpreted else "cuda")
    generator = torch.Generator().manual_seed(0)
    for n in args.numel:
        x = torch.randn(n, generator=generator).to(device)
        for density, selection in itertools.product(args.density, ("topk", "threshold")):
            # threshold as its defaults have it: capacity 4 x density, t passed by density x n entries
            k = max(1, int(density * n)) * (4 if selection == "threshold" else 1)
            threshold = None
            if selection == "threshold":
                threshold = x.abs().kthvalue(n - max(1, int(density * n))).values.reshape(1)
            plan = select._plan(n, k, threshold is not None)
            if plan[1] > n or n < select._SAMPLE:
                print(json.dumps({"numel": n, "k": k, "selection": selection,
                                  "skipped": f"the candidates' capacity {plan[1]} passes n, or n is under the sample's "
                                             f"{select._SAMPLE}"}))
                continue
            values, indices = torch.empty(k, device=device), torch.empty(k, dtype=torch.int64, device=device)
            whole = partial(select._select_blocks, x, k, values, indices, threshold, None)
            gathered = partial(_gathered, x, k, values, indices, threshold, plan)
            ways = {"whole": whole, "gathered": gathered, "whole_one_a_block": _one_a_block(whole),
                    "gathered_one_a_block": _one_a_block(gathered)}
            expected = [t.clone() for t in whole()]
            for name, way in ways.items():
                if not all(torch.equal(a, b) for a, b in zip(expected, way(), strict=True)):
                    raise SystemExit(f"{selection}, n {n}, k {k}: {name} differs from the whole tensor's selection")
            candidates = int(select._gather(x, k, threshold, plan).found[-1])  # (a host read, outside the timing)
            timings = timed({**ways, "copy": x.clone}, device, args.repeats)
            row: dict[str, Any] = {
                "selection": selection, "numel": n, "k": k, "density": density, "rank": plan[0],
                "capacity": plan[1], "candidates": candidates,
                "topk_gathers": n >= select._GATHER_MIN and select._gathering(n, k, threshold is not None) is not None,
                **clock_fields(device), "interpreted": interpreted, "repeats": args.repeats,
                **timing_fields(timings, "us"),
                "gathered_over_whole": round(timings["gathered"].median / timings["whole"].median, 3),
                "looped_over_one_a_block": {way: round(timings[way].median / timings[f"{way}_one_a_block"].median, 3)
                                            for way in ("whole", "gathered")},
            }
            record(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
