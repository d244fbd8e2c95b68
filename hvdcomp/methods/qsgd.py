"""QSGD: stochastic quantization onto s levels of the bucket's norm (Alistarh, Grubic, Li, Tomioka, Vojnovic,
"QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding", NeurIPS 2017, arXiv:1610.02132).

Per bucket v of ``bucket_size`` elements, eq. (4) of the paper:

    Q_s(v)_i = ||v|| * sign(v_i) * xi_i(v, s),

where xi_i rounds s |v_i| / ||v|| stochastically to a neighbouring integer l / s (up with probability
s |v_i| / ||v|| - l), so E[Q_s(v)] = v; the norm is max |v_i| by default (``norm: max``, the common variant), or L2
as in the paper (``norm: l2``). Under the L2 norm a typical entry of a 512-element bucket is about ||v|| / sqrt(512),
a third of the first level ||v|| / 7 at 4 bits, so most entries round to 0 or to a level several times their size:
the paper's variance bound, min(d / s^2, sqrt(d) / s) ||v||^2, is 3.2 ||v||^2 there, and on the glyphs workload
(2 ranks, SGD lr 0.1, momentum 0.9, 3 epochs, seed 0) QSGD with the L2 norm ended 1.9 points below dense, with the
max norm level with it (perf/accuracy/README.md). With ``bits`` b, s = 2^(b-1) - 1 levels per sign: the code is
s + sign * level in [0, 2s] (b = 2: s = 1, ternary; b = 4: s = 7). The paper's Elias coding of the levels is
not used: fixed-width codes keep payloads the same size on every rank (two-phase, allgather without sizes).
Wire: ``bits`` per element plus one float32 norm per bucket (4.0625 bits per element at the defaults).
"""

from __future__ import annotations

from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import MEASURED
from hvdcomp.packing import pack_bits
from hvdcomp.quantization import BucketQuantizer, buckets, check_bucket_size, generator

NORMS = ("l2", "max")


class QSGD(BucketQuantizer):
    """Unbiased stochastic quantization onto 2s+1 levels of each bucket's norm (module docstring).

    Args:
        bits: bits per element, 2 to 8 (s = 2^(bits-1) - 1 levels per sign).
        bucket_size: elements per bucket, each with its own norm (a multiple of 8; the paper's 512).
        norm: ``"max"`` (the default: a smaller variance, module docstring) or ``"l2"`` (the paper's).
    """

    name = "qsgd"
    unbiased = True

    def __init__(self, bits: int = 4, bucket_size: int = 512, norm: str = "max") -> None:
        self.bits = check.integer(self.name, "bits", bits, ge=2, le=8)
        self.bucket_size = check_bucket_size(self.name, bucket_size)
        self.norm = check.choice(self.name, "norm", norm, NORMS)

    def accuracy_risk(self) -> str | None:
        if self.norm != "l2" or self.bits > 4:
            return None
        return (f"QSGD with the L2 norm at 4 bits ended 1.9 points below dense {MEASURED}: most entries round to 0 "
                "or to a level several times their size. Use norm: max (the default, level with dense there) or more "
                "bits")

    @property
    def levels(self) -> int:
        """s, the number of nonzero levels per sign."""
        return (1 << (self.bits - 1)) - 1

    def grid(self, device: torch.device) -> torch.Tensor:
        s = self.levels
        return self.cached_grid("qsgd", self.bits, device,
                                lambda codes: torch.where(codes <= 2 * s, (codes - s) / s, 0))

    def rounding_levels(self, payload: list[torch.Tensor]) -> torch.Tensor:
        return payload[0] * self.grid(payload[0].device)[:2 * self.levels + 1]  # without the unused code

    def quantize_kernel(self, kernels: Any, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        tables, packed = kernels.quantize_levels(x, self.bucket(x.numel()), self.bits, NORMS.index(self.norm) + 1,
                                                 0, 1, seed)
        return tables, packed

    def quantize_torch(self, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb, _ = buckets(x, self.bucket(x.numel()))
        if self.norm == "l2":  # in float64, as the kernels where float32's squares overflow (|x| above ~1.8e19)
            wide = torch.linalg.vector_norm(xb, dim=1, keepdim=True, dtype=torch.float64)
            norms = wide.clamp_(max=torch.finfo(torch.float32).max).float()  # float32's largest is >= every |x|
        else:
            norms = xb.abs().amax(dim=1, keepdim=True)
        s = self.levels
        inverse = s / norms  # 0 for a zero bucket, and where a subnormal norm overflows it, as the kernels
        inverse = torch.where(torch.isfinite(inverse), inverse, 0)
        ratio = (xb.abs() * inverse).nan_to_num_(nan=s).clamp_(max=s)  # in [0, s], a NaN input at s as the kernels
        floor = ratio.floor().clamp_(max=s - 1)
        draw = torch.rand(xb.shape, generator=generator(x.device, seed), device=x.device)
        level = floor + (draw < ratio - floor)
        codes = torch.where(xb < 0, s - level, s + level).to(torch.uint8)
        return norms, pack_bits(codes.reshape(-1)[:x.numel()], self.bits)
