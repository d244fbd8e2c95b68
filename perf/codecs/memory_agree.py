"""A step's ``agree`` + ``compress`` through the memory wrappers, skipping agree's input or building it, on CPU.

    .venv/bin/python perf/codecs/memory_agree.py [--numel 4000000] [--rounds 15] [--methods efsignsgd signsgd topk]

Error feedback and momentum correction build the gradient with the residual (or the momentum) added for the
method's ``agree`` only where the method ``agrees`` (``hvdcomp.compressor.Compressor.agrees``); before, they built
it for every method, whose ``agree`` then asked nothing. This times one step both ways in interleaved rounds in one
process, "before" by making the wrapped method claim it agrees (its ``agree`` still returns None), on a Gaussian
tensor, each method with its default memory. Medians and ranges in ms; one JSON line per method to
perf/results/memory_agree.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from hvdcomp import Context, make_compressor
from hvdcomp.tools.bench import record

RESULTS = Path(__file__).resolve().parents[1] / "results" / "memory_agree.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--methods", nargs="+", default=["efsignsgd", "signsgd", "topk"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    for method in args.methods:
        compressor = make_compressor(method)
        method_class = type(compressor.unwrapped())
        if compressor.agrees or "agrees" in vars(method_class):
            parser.error(f"{method} agrees on values: both ways build agree's input")
        ctx = Context.local(x, seed=1)
        state = compressor.init_state(x, ctx)
        times: dict[str, list[float]] = {"skipped": [], "built": []}
        try:
            for way in times:  # a warm-up of each way, untimed: the first call's allocations and lazy set-up
                method_class.agrees = property(lambda _self, way=way: way == "built")  # type: ignore[attr-defined]
                grad = x.clone()
                compressor.agree(grad, state, ctx)
                compressor.compress(grad, state, ctx)
            for round_ in range(args.rounds):
                for way in sorted(times, reverse=bool(round_ % 2)):  # each way first in every other round
                    method_class.agrees = property(lambda _self, way=way: way == "built")  # type: ignore[attr-defined]
                    grad = x.clone()
                    start = time.perf_counter()
                    compressor.agree(grad, state, ctx)
                    compressor.compress(grad, state, ctx)
                    times[way].append(time.perf_counter() - start)
        finally:
            if "agrees" in vars(method_class):
                del method_class.agrees
        row = {"method": method, "numel": args.numel, "rounds": args.rounds, "threads": torch.get_num_threads(),
               **{f"{way}_ms": round(1e3 * statistics.median(t), 2) for way, t in times.items()},
               **{f"{way}_range_ms": [round(1e3 * min(t), 2), round(1e3 * max(t), 2)] for way, t in times.items()}}
        record(row, args.out)


if __name__ == "__main__":
    main()
