"""The homomorphic sketch's decoding on one CPU process: throughput, and how often peeling completes vs sketch size.

    .venv/bin/python perf/codecs/sketch_decode.py [--threads 1]

``throughput``: 4 ranks' row-sparse gradients (1% of the rows each, half of them shared) over tables of 1 M to
16 M float32 entries (rows of 16): the filter's candidates plus peeling, fused C++ and the PyTorch path (what CUDA
runs), median of 5 runs with the spread. GB/s counts the dense gradient's float32 bytes (what the sum covers).
``success``: the fraction of sketches that peel completely, for C candidates (100 to 100,000) and sketch sizes of
``margin`` x 1.222 C + ``slack`` cells, from 2,000 (C <= 1,000) down to 50 (C = 100,000) random draws each.
Rows go to perf/results/sketch_decode.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hvdcomp.methods import sketch

RESULTS = Path(__file__).resolve().parents[1] / "results" / "sketch_decode.jsonl"


def throughput(rows: int, width: int = 16, ranks: int = 4, repeats: int = 5) -> list[dict]:
    k = rows // 100
    pool = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    supports = [torch.cat([pool[:k // 2], pool[k + r * k:k + r * k + k - k // 2]]) for r in range(ranks)]
    values = [torch.randn(s.numel(), width, generator=torch.Generator().manual_seed(r)) for r, s in enumerate(supports)]
    bits, hashes = sketch.filter_size(ranks * k, rows, ranks, None)
    union = sketch.bloom(supports[0], 1, bits, hashes)
    for support in supports[1:]:
        union |= sketch.bloom(support, 1, bits, hashes)
    found = sketch.candidates(union, rows, 1, hashes)
    c3 = sketch.sketch_cells(found.numel(), 1.1, 24)
    table = sum(sketch.encode(v, s, 2, c3, torch.float32) for v, s in zip(values, supports, strict=True))
    out = []
    for path in ("kernels", "torch"):
        saved = sketch.cpu_kernels
        if path == "torch":
            sketch.cpu_kernels = lambda: None
        try:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                decoded = sketch.candidates(union, rows, 1, hashes)
                _, resolved = sketch.peel(decoded, table, 2)
                times.append(time.perf_counter() - start)
        finally:
            sketch.cpu_kernels = saved
        assert resolved == found.numel()
        median = statistics.median(times)
        out.append({"kind": "throughput", "path": path, "rows": rows, "width": width, "ranks": ranks,
                    "candidates": found.numel(), "cells": 3 * c3, "median_s": median, "min_s": min(times),
                    "max_s": max(times), "dense_GBps": rows * width * 4 / median / 1e9,
                    "threads": torch.get_num_threads()})
    return out


def success(candidates: int, margin: float, slack: int) -> dict:
    trials = 2000 if candidates <= 1000 else 300 if candidates <= 10_000 else 50
    c3 = sketch.sketch_cells(candidates, margin, slack)
    table = torch.zeros(3 * c3, 1, dtype=torch.float64)  # completion depends on the hypergraph alone
    complete = 0
    for trial in range(trials):
        items = torch.arange(candidates, dtype=torch.int64) * 7 + trial
        _, resolved = sketch.peel(items, table, 1_000_003 * trial + candidates)
        complete += resolved == candidates
    return {"kind": "success", "candidates": candidates, "margin": margin, "slack": slack, "cells": 3 * c3,
            "trials": trials, "completed": complete, "rate": complete / trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for n in (62_500, 250_000, 1_000_000) for row in throughput(n)]
    rows += [success(c, margin, slack) for c in (100, 1000, 10_000, 100_000)
             for margin, slack in ((1.0, 0), (1.1, 0), (1.1, 24), (1.25, 24), (1.5, 24))]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    RESULTS.parent.mkdir(exist_ok=True)
    with open(RESULTS, "a") as stream:
        for row in rows:
            row["time"] = stamp
            print(json.dumps(row), flush=True)
            stream.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
