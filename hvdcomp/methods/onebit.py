"""1-bit SGD (Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014).

Each value is quantized to one bit by its sign (threshold 0), and each bucket (a column in the paper) sends
two reconstruction values, the means of the values that fell on either side:

    Q(g_k) = mean{g : g < 0}  if g_k < 0,    Q(g_k) = mean{g : g >= 0}  otherwise (0 for an empty side),

with the quantization error fed back into the next step (error feedback, on by default: the paper's method
depends on it). Wire: 1 bit per element plus two float32 values per bucket.
"""

from __future__ import annotations

from typing import Any

import torch

from hvdcomp.packing import pack_bits
from hvdcomp.quantization import BucketQuantizer, buckets, check_bucket_size


class OneBit(BucketQuantizer):
    """1-bit SGD: sign bits and two reconstruction values per bucket, with error feedback by default.

    Args:
        bucket_size: elements per bucket, each with its own two values (a multiple of 8).
    """

    name = "onebit"
    unbiased = False
    bits = 1

    def __init__(self, bucket_size: int = 512) -> None:
        self.bucket_size = check_bucket_size(self.name, bucket_size)

    def quantize_kernel(self, kernels: Any, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        tables, packed = kernels.quantize_binary(x, self.bucket(x.numel()), 1, 0)
        return tables, packed

    def quantize_torch(self, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb, valid = buckets(x, self.bucket(x.numel()))
        negative = (xb < 0) & valid
        count = negative.sum(dim=1)
        # as the CPU kernel: the negative side's sum and the bucket's, in float64 (float32's overflow from |x| ~ 1e36;
        # the means are float32's); the other side's the difference
        total = xb.sum(dim=1, dtype=torch.float64)
        below = torch.where(negative, xb, 0).sum(dim=1, dtype=torch.float64)
        levels = torch.stack([below / count.clamp(min=1), (total - below) / (valid.sum(dim=1) - count).clamp(min=1)],
                             dim=1).float()
        return levels, pack_bits((xb >= 0).reshape(-1)[:x.numel()].to(torch.uint8), 1)  # NaN: 0, as the kernels
