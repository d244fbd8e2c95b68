"""Threshold sparsification: keep the entries with |g| > t (Strom, Interspeech 2015; the threshold fitted to a
target density as in SIDCo, Abdelmoniem et al., MLSys 2021).

    Q(g)_i = g_i * 1{|g_i| > t}

with either a fixed ``threshold`` t, or t fitted each step so that about a ``density`` fraction d of entries pass.
The fit is SIDCo's multi-stage exponential model of |g|: if |g| - t_j, over the entries above t_j, is exponential
with mean mu_j, then P(|g| > t_j + x) = P(|g| > t_j) exp(-x / mu_j). Each of S stages keeps d^(1/S) of what the
last one kept:

    t_0 = 0,    t_{j+1} = t_j + mu_j * ln(1/d) / S,    mu_j = mean of |g| - t_j over the entries above t_j,

with S = ceil(log10(1/d)) + 1 stages (each keeps about a tenth or more). A single exponential fits Laplace-like
gradients; the later stages refit the tail, where it is poor for Gaussian-like ones. Measured on 10^6 entries at
d = 0.1, 0.01, 0.001, the fraction kept over d: Gaussian 1.23, 1.09, 0.96; Laplace 1.00, 1.00, 0.99; Student-t
with 3 degrees of freedom 0.79, 0.63, 0.54 (``tests/test_sparsifiers.py`` bounds it). The count that
passes differs per rank and per step (payloads of different sizes, gathered with their sizes), and at most
``max_density`` of the entries are sent (the largest of those above t): a bounded payload, and on CUDA a fixed one.

On CPU the entries above t are found with one mask and ``nonzero`` (their number is known on the host: the
payload is exactly those entries). On CUDA that count would be a host sync inside backward, so the payload is
the ``max_density`` capacity, filled with the largest entries above t by the Triton kernels' selection
(:mod:`hvdcomp.kernels.gpu.select`; ``topk`` of the masked magnitudes without Triton): entries at or below t travel
as zeros, and both devices send the same nonzero values. Biased: error feedback by default. Decoding is top-k's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import MEASURED, Context, State
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.methods.topk import Sparse, index_dtype
from hvdcomp.wire import Payload


def fitted_threshold(x: torch.Tensor, density: float) -> torch.Tensor:
    """The multi-stage exponential fit of t for ``density`` (module docstring) from the flat ``x``: a float32 tensor
    of one element on x's device (no host sync). Each stage's mean excess is one pass of the fused kernels
    (``excess_moments`` in C++ on CPU; on CUDA ``threshold_fit``, which also moves t on the device), else of PyTorch
    ops on |x|."""
    stages = math.ceil(math.log10(1 / density)) + 1
    step = math.log(1 / density) / stages
    kernels = kernels_for(x.device)
    if is_triton(kernels):  # every stage on the device, at most two launches a stage
        return kernels.threshold_fit(x.float().contiguous(), stages, step)
    t = torch.zeros(1, dtype=torch.float32, device=x.device)
    if kernels is not None:
        x = x.float().contiguous()
        for _ in range(stages):
            excess, count = kernels.excess_moments(x, t)
            t = t + (excess / count.clamp(min=1) * step).float()
        return t
    magnitudes = x.abs().float()  # the fit's sums in float32 (fp16 overflows)
    for _ in range(stages):
        above = magnitudes.gt(t)  # (a NaN is not above t, and adds nothing: as the kernels)
        mean_excess = torch.where(above, magnitudes - t, 0).sum() / above.sum().clamp_(min=1)
        t = t + mean_excess * step
    return t


class Threshold(Sparse):
    """Sends the entries with |g| above a threshold: fixed (``threshold``) or fitted per step (``density``).

    Args:
        threshold: a fixed t > 0; exclusive with ``density``.
        density: the fraction of entries to aim at, in (0, 1) (default 0.01 when no threshold is given); t is
            fitted per step from |g| (module docstring), so the fraction sent varies around it.
        max_density: the most that is sent, as a fraction in (0, 1] (default: 4 x density, or 0.1 with a fixed
            threshold): the largest entries above t up to that count.
        momentum: the momentum applied before error feedback in place of the optimizer's, as top-k's
            (:mod:`hvdcomp.methods.topk`; a fixed ``threshold`` then applies to the momentum-corrected gradient);
            0: the optimizer's momentum applies. On glyphs (2 ranks, SGD lr 0.1, 3 epochs, seed 0) threshold
            under the optimizer's momentum ended 1.6 points below dense, with momentum correction 0.5 below
            (perf/accuracy/README.md).
    """

    name = "threshold"

    def __init__(self, threshold: float | None = None, density: float | None = None,
                 max_density: float | None = None, momentum: float = 0.9) -> None:
        self.momentum = check.number(self.name, "momentum", momentum, ge=0, lt=1)  # the memory policy reads it
        check.number(self.name, "threshold", threshold, gt=0, optional=True)
        check.number(self.name, "density", density, gt=0, lt=1, optional=True)
        check.number(self.name, "max_density", max_density, gt=0, le=1, optional=True)
        if threshold is not None and density is not None:
            raise ValueError("threshold: give either threshold (a fixed t) or density (t fitted per step), not both")
        if threshold is None and density is None:
            density = 0.01
        if max_density is None:
            max_density = 0.1 if density is None else min(1.0, 4 * density)
        if density is not None and max_density < density:
            raise check.invalid(self.name, "max_density", f"at least density ({density:g})", max_density)
        self.threshold = None if threshold is None else float(threshold)
        self.density = None if density is None else float(density)
        self.max_density = float(max_density)

    def accuracy_risk(self) -> str | None:
        if self.momentum:
            return None
        return (f"threshold under the optimizer's momentum ended 1.6 points below dense {MEASURED}, 0.5 below with "
                "momentum: 0.9 (the default; its parameters then need momentum 0 in the optimizer)")

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        x = tensor.detach().reshape(-1)
        n = x.numel()
        capacity = min(n, max(1, math.ceil(self.max_density * n)))
        # t as a float32 tensor, fitted or fixed: a half gradient is compared with it in float32 (a Python float
        # would be rounded to half first), as the kernels compare
        t = (fitted_threshold(x, self.density) if self.density is not None
             else torch.full((1,), self.threshold, dtype=torch.float32, device=x.device))
        kernels = kernels_for(x.device)
        if is_triton(kernels):
            # fixed capacity, no host sync: the largest entries above t, then entries at or below t sent as zeros
            values, indices = kernels.topk(x, capacity, index_dtype(n), threshold=t)
            return [values, indices], (tensor.shape, n, x.dtype)
        magnitudes = x.abs()
        if x.device.type == "cpu":
            indices = magnitudes.gt(t).nonzero().view(-1)
            if indices.numel() > capacity:  # (decoding does not depend on the order of unique indices)
                indices = indices[magnitudes[indices].topk(capacity, sorted=False).indices]
        else:  # the same by torch.topk: entries not above t (NaN too) are zeroed, the largest above t kept
            masked = magnitudes.masked_fill_(magnitudes.gt(t).logical_not_(), 0)
            indices = masked.topk(capacity, sorted=False).indices
        values = x[indices]
        if x.device.type != "cpu":
            values = values.masked_fill(values.abs().gt(t).logical_not_(), 0)
        return [values, indices.to(index_dtype(n))], (tensor.shape, n, x.dtype)
