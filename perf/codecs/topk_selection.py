"""Top-k's selection on a model's own gradients: how often the sampled threshold falls back, and its cost.

    .venv/bin/python perf/codecs/topk_selection.py [--steps 40] [--stride prime|quotient]

The training loop of ``hvdcomp train --workload synthetic`` in one process, with every gradient compressed
as DistributedOptimizer would (top-k 1% with error feedback) and its decoded value put back in ``p.grad``.
For each selection on the fast path (:func:`hvdcomp.methods.topk.largest`) it records whether the candidate
threshold kept fewer than k entries, so that selection fell back to the full ``torch.topk``, and how long
selection took. ``--stride quotient`` samples every (n // 65536)-th entry, the stride before the prime one,
for comparison. Appends one JSON line per tensor size to perf/results/topk_selection.jsonl.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hvdcomp.compressor import Context
from hvdcomp.config import CompressionConfig
from hvdcomp.methods import topk
from hvdcomp.workloads import WORKLOADS

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--stride", choices=["prime", "quotient"], default="prime")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.stride == "quotient":
        topk.sample_stride = lambda n: n // topk._SAMPLE
    select = topk.largest
    records: dict[int, list[tuple[bool, float]]] = {}

    def recorded(x: torch.Tensor, k: int) -> torch.Tensor:
        start = time.perf_counter()
        chosen = select(x, k)
        elapsed = time.perf_counter() - start
        if topk.sampled(x, k):
            kept = int((x.abs() >= topk.candidate_threshold(x, k)).sum())
            records.setdefault(x.numel(), []).append((kept < k, elapsed))
        return chosen

    topk.largest = recorded
    workload = WORKLOADS["synthetic"](0)
    model, data = workload.model, workload.data
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    config = CompressionConfig.parse("topk")
    states: dict[str, Any] = {}
    for step in range(args.steps):
        start = step * args.batch_size % (len(data.train_x) - args.batch_size)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data.train_x[start:start + args.batch_size]),
                                          data.train_y[start:start + args.batch_size]).backward()
        for name, p in model.named_parameters():
            compressor = config.choose(name, p.shape, 2).compressor
            if compressor is None:
                continue
            ctx = Context.local(p.grad, name=name)
            if name not in states:
                states[name] = compressor.init_state(p.grad, ctx)
            payload, meta = compressor.compress(p.grad, states[name], ctx)
            p.grad.copy_(compressor.aggregate([payload], meta).view_as(p.grad))
        optimizer.step()
    with (RESULTS / "topk_selection.jsonl").open("a") as out:
        for numel, rows in sorted(records.items()):
            line = json.dumps({"numel": numel, "stride": args.stride, "sample_stride": topk.sample_stride(numel),
                               "selections": len(rows), "fallbacks": sum(fell for fell, _ in rows),
                               "median_ms": round(statistics.median(t for _, t in rows) * 1e3, 2),
                               "max_ms": round(max(t for _, t in rows) * 1e3, 2), "steps": args.steps,
                               "torch": str(torch.__version__), "host": platform.node(),
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())})
            print(line)
            out.write(line + "\n")


if __name__ == "__main__":
    main()
