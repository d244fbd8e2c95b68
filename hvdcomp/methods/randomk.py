"""Random-k sparsification with positions shared by all ranks (Stich, Cordonnier and Jaggi, "Sparsified SGD
with Memory", NeurIPS 2018, random-k; Wangni et al., "Gradient Sparsification for Communication-Efficient
Distributed Optimization", NeurIPS 2018, unbiased scaling).

Each step, k = ceil(ratio * d) positions are drawn from the parameter's rank-independent seed and the step,
so every rank picks the same positions: payloads add elementwise and travel by one allreduce of k values,
with no indices on the wire (32 bits per kept element, against 64 for top-k). Positions are stratified: the
d entries are cut into k strata of d/k (rounded) consecutive entries and one position is drawn uniformly in
each. Entry i of stratum b is sent with probability 1 / |b|, so

* ``unbiased=False`` (default) sends g_i unscaled, a biased compressor (E[Q(g)] = g k/d), which gets error
  feedback by default (Stich et al.'s random-k with memory): every entry is sent, late, with all it accumulated;
* ``unbiased=True`` sends g_i |b|: E[Q(g)] = g, variance sum_i g_i^2 (|b| - 1) (Wangni et al.'s unbiased
  sparsification, with stratified rather than independent draws), no error feedback. At 1% that multiplies
  the gradient's variance by about 100: on digits at lr 0.05 (perf/RESULTS.md) training diverged to NaN,
  which is why it is not the default; it suits milder ratios or smaller learning rates.

The draw, gather and scaling run in one fused kernel (:mod:`hvdcomp.kernels`: C++ on CPU, Triton on CUDA, with
the same counter-based random numbers, so both draw the same positions); without one, as PyTorch ops with
``torch.rand`` on the tensor's device (no host sync), which draw other positions from the same seed: which path
draws is part of the plan every rank shares.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hvdcomp.compressor import Compressor, Context, Payload, State, derive_seed
from hvdcomp.kernels import kernels_for

_generators: dict[torch.device, torch.Generator] = {}


def strata(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, length) of each of the k strata of ``n`` entries: stratum b is [b n / k, (b + 1) n / k)."""
    bounds = torch.arange(k + 1, device=device, dtype=torch.int64) * n // k
    return bounds[:-1], bounds[1:] - bounds[:-1]


def backend(device: torch.device) -> str:
    """Which path draws the positions on ``device``: the two draw different positions from one seed, so it is
    part of the plan every rank must share (a rank whose kernels failed to build would send other entries)."""
    return "kernel" if kernels_for(device) is not None else "torch"


def select(x: torch.Tensor, k: int, seed: int, scale: bool, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 positions) of one stratified draw of k entries of the 1-D float32 ``x`` by ``path`` (see
    :func:`backend`); values times the stratum's length if ``scale``."""
    if k == 0:  # an empty tensor
        return x.new_empty(0), torch.empty(0, dtype=torch.int64, device=x.device)
    kernels = kernels_for(x.device) if path == "kernel" else None
    if kernels is not None:
        values, indices = kernels.randomk_select(x.contiguous(), k, seed, scale)  # seeds are 63-bit
        return values, indices
    start, length = strata(x.numel(), k, x.device)
    generator = _generators.get(x.device)
    if generator is None:
        generator = _generators[x.device] = torch.Generator(device=x.device)
    u = torch.rand(k, generator=generator.manual_seed(seed), device=x.device, dtype=torch.float64)
    indices = start + torch.minimum((u * length).long(), length - 1)
    values = x[indices]
    return (values * length.to(values.dtype) if scale else values), indices


class RandomK(Compressor):
    """Sends the entries at k seeded positions (the same on every rank); summable.

    Args:
        ratio: fraction of entries sent, in (0, 1].
        unbiased: scale sent values by d/k (per stratum) so that E[Q(g)] = g, without error feedback; the default
            ``False`` sends them as they are, with error feedback.
    """

    name = "randomk"
    summable = True

    def __init__(self, ratio: float = 0.01, unbiased: bool = False) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"randomk: ratio must be a number in (0, 1]; got {ratio!r}")
        if not isinstance(unbiased, bool):
            raise ValueError(f"randomk: unbiased must be true or false; got {unbiased!r}")
        self.ratio = float(ratio)
        self.unbiased = unbiased  # type: ignore[misc] # per instance: the memory policy reads it

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        return {"positions": backend(tensor.device)}

    def plan(self, state: State) -> str:
        return f"positions by {state['positions']}"

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        x = tensor.detach().reshape(-1)
        n = x.numel()
        k = min(n, max(1, math.ceil(self.ratio * n)))
        path = state.get("positions") or backend(x.device)  # the plan's, so that all ranks draw alike
        values, indices = select(x.float(), k, derive_seed(ctx.shared_seed, ctx.step), self.unbiased, path)
        return [values], (tensor.shape, n, indices)

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        shape, n, indices = meta
        (values,) = payload
        return values.new_zeros(n).index_copy_(0, indices, values).view(shape)

    def subtract(self, residual: torch.Tensor, payload: Payload, meta: Any) -> None:
        residual.view(-1).index_add_(0, meta[2], payload[0].to(residual.dtype), alpha=-1)
