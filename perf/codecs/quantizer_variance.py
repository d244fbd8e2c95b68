"""Quantization error of ORQ, QSGD, uniform levels, BinGrad, 1-bit SGD and EF-signSGD at 1 to 4 bits per element,
on the same inputs: appended to perf/results/quantizer_variance.jsonl, and printed as a Markdown table.

    .venv/bin/python perf/codecs/quantizer_variance.py [--numel 1000000] [--bucket 512]

The inputs: standard Gaussian, Laplace, Student t with 2 degrees of freedom (heavy-tailed), and the real gradient
of the synthetic workload's model (``hvdcomp train --workload synthetic``: its three largest weight matrices, one
backward pass on 64 training samples at initialization, the first ``--numel`` entries). Each entry is
E||Q(g) - g||^2 / ||g||^2: for the stochastic methods (ORQ, QSGD, uniform) the exact expectation over the draw,
sum of (l_{j+1} - g)(g - l_j) with the levels each method chose (``hvdcomp.quantization.rounding_variance``); for
the deterministic ones (BinGrad, 1-bit SGD, EF-signSGD) the squared error itself. Same bucket size for all bucketed
methods; "uniform" is ORQ's levels before optimization (``iterations=0``: 2^bits levels evenly from min to max).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from hvdcomp import ORQ, QSGD, Context, make_compressor
from hvdcomp.quantization import rounding_variance
from hvdcomp.workloads import synthetic

RESULTS = Path(__file__).resolve().parents[1] / "results"


def inputs(numel: int) -> dict[str, torch.Tensor]:
    workload = synthetic(seed=0, train_samples=64, test_samples=1)
    nn.functional.cross_entropy(workload.model(workload.data.train_x), workload.data.train_y).backward()
    weights = sorted((p for p in workload.model.parameters() if p.dim() == 2), key=lambda p: -p.numel())[:3]
    torch.manual_seed(0)
    return {"gaussian": torch.randn(numel), "laplace": torch.distributions.Laplace(0.0, 1.0).sample((numel,)),
            "student-t(2)": torch.distributions.StudentT(2.0).sample((numel,)),
            "synthetic gradient": torch.cat([p.grad.reshape(-1) for p in weights])[:numel]}


def relative_error(method: str, bits: int, bucket: int, x: torch.Tensor) -> float | None:
    """E||Q(x) - x||^2 / ||x||^2 of one method at ``bits`` per element, or None where it has no such setting."""
    ctx = Context.local(x)
    if method in ("orq", "uniform", "qsgd-l2", "qsgd-max"):
        if method.startswith("qsgd") and bits < 2:
            return None
        compressor = (ORQ(bits=bits, bucket_size=bucket, iterations=0 if method == "uniform" else 8)
                      if method in ("orq", "uniform") else QSGD(bits=bits, bucket_size=bucket, norm=method[5:]))
        payload, _ = compressor.compress(x, {}, ctx)
        error = rounding_variance(x, compressor.rounding_levels(payload), bucket).sum()
    else:
        if bits != 1:
            return None
        options = {} if method == "efsignsgd" else {"bucket_size": bucket}
        compressor = make_compressor(method, options, error_feedback=False)
        payload, meta = compressor.compress(x, {}, ctx)
        error = (compressor.decompress(payload, meta).double() - x.double()).pow(2).sum()
    return (error / x.double().pow(2).sum()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--bucket", type=int, default=512)
    args = parser.parse_args()
    methods = ["orq", "uniform", "qsgd-l2", "qsgd-max", "bingrad", "onebit", "efsignsgd"]
    rows = []
    for name, x in inputs(args.numel).items():
        for bits in (1, 2, 3, 4):
            row = {"input": name, "bits": bits, "numel": x.numel(), "bucket": args.bucket,
                   **{method: relative_error(method, bits, args.bucket, x) for method in methods},
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "quantizer_variance.jsonl", "a") as stream:
        stream.writelines(json.dumps(row) + "\n" for row in rows)
    print("| input | bits | " + " | ".join(methods) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in methods) + " |")
    for row in rows:
        cells = ["" if row[m] is None else f"{row[m]:.4g}" for m in methods]
        print(f"| {row['input']} | {row['bits']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
