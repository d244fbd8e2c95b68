"""BinGrad: biased binary gradient quantization with the optimal levels for the gradient's own distribution
(Xu, Huo, Huang, "Optimal Gradient Quantization Condition for Communication-Efficient Distributed Training",
arXiv:2002.11082).

Per bucket of ``bucket_size`` elements, two levels b1 < b2 and a threshold t, Q(g_k) = b1 if g_k < t else b2.
The squared error sum_k (g_k - Q(g_k))^2 is minimal when (the optimality condition of binary quantization)

    b1 = mean{g_k : g_k < t},    b2 = mean{g_k : g_k >= t},    t = (b1 + b2) / 2,

a two-level Lloyd-Max quantizer, found by fixed-point iteration from t = mean(g) (``iterations`` partitions at
most; it stops at the fixed point). The codes use the partition the levels were computed from, so each level is
the exact mean of the values it stands for and the bucket's sum is preserved. (methods.md marks these details
as reconstructed from the paper's statement of the condition.)

Biased, so it runs with error feedback by default. Wire: 1 bit per element plus two float32 levels per bucket
(1.125 bits per element at the default 512).
"""

from __future__ import annotations

from typing import Any

import torch

from hvdcomp import check
from hvdcomp.packing import pack_bits
from hvdcomp.quantization import BucketQuantizer, buckets, check_bucket_size


class BinGrad(BucketQuantizer):
    """Optimal binary quantization per bucket (module docstring), with error feedback by default.

    Args:
        bucket_size: elements per bucket, each with its own two levels (a multiple of 8).
        iterations: fixed-point iterations of the threshold at most (1: threshold at the bucket's mean).
    """

    name = "bingrad"
    unbiased = False
    bits = 1

    def __init__(self, bucket_size: int = 512, iterations: int = 4) -> None:
        self.bucket_size = check_bucket_size(self.name, bucket_size)
        self.iterations = check.integer(self.name, "iterations", iterations, ge=1, le=1000)

    def quantize_kernel(self, kernels: Any, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        tables, packed = kernels.quantize_binary(x, self.bucket(x.numel()), 0, self.iterations)
        return tables, packed

    def quantize_torch(self, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb, valid = buckets(x, self.bucket(x.numel()))
        count = valid.sum(dim=1)
        # the sums in float64, as the kernels where float32's overflow (|x| above ~1e36); the means are float32's
        total = xb.sum(dim=1, dtype=torch.float64)
        threshold = (total / count.clamp(min=1)).float()
        levels = xb.new_zeros(xb.shape[0], 2)
        for iteration in range(self.iterations):
            under = (xb < threshold.unsqueeze(1)) & valid
            count_under = under.sum(dim=1)
            sum_under = torch.where(under, xb, 0).sum(dim=1, dtype=torch.float64)
            count_over = count - count_under
            levels[:, 0] = torch.where(count_under > 0, sum_under / count_under.clamp(min=1), threshold)
            levels[:, 1] = torch.where(count_over > 0, (total - sum_under) / count_over.clamp(min=1), threshold)
            cut = threshold
            if iteration + 1 < self.iterations:  # the levels' midpoint, halved first where their sum overflows
                summed = levels.sum(dim=1)
                halves = 0.5 * levels[:, 0] + 0.5 * levels[:, 1]
                threshold = torch.where(summed.isinf() & levels.isfinite().all(dim=1), halves, 0.5 * summed)
        codes = (xb >= cut.unsqueeze(1)).reshape(-1)[:x.numel()].to(torch.uint8)
        return levels, pack_bits(codes, 1)
