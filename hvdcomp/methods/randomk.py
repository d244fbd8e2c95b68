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
  the gradient's variance by about 100: on digits at lr 0.05 (docs/methods.md) training diverged to NaN,
  which is why it is not the default; it suits milder ratios or smaller learning rates.

With error feedback, random-k sends each entry about once in d/k steps (100 at 1%), carrying every step's gradient
since its last draw: in expectation a gradient reaches the model after a delay drawn from a geometric law of mean
d/k, a running average over d/k steps, which acts as momentum (Mitliagkas et al., "Asynchrony begets momentum",
2016). The optimizer's heavy-ball momentum on top of it overshoots: on the glyphs workload (2 ranks, SGD lr 0.1
with momentum 0.9, 3 epochs, seed 0) random-k at 1% under the optimizer's momentum stayed at chance level, 10.8% test
accuracy (perf/accuracy/README.md). Stich et al. ran random-k with memory on plain SGD. So by default
(``momentum: 0.9``) its parameters take no momentum from the optimizer (they need a group with ``momentum`` 0, as
DGC's do; ``hvdcomp train`` sets it) and random-k keeps only the momentum's gain, g / (1 - m), so that the learning
rate tuned for momentum SGD applies (:class:`hvdcomp.error_feedback.ErrorFeedback` with ``momentum_averages =
False``: the delays already average). ``momentum: 0`` gives the optimizer's momentum back. Even so, at 1% the
delays cost accuracy at the learning rate dense momentum SGD trains best with: 5.0 points below dense on glyphs,
0.6 at a ratio of 10% (:meth:`RandomK.accuracy_risk`: the optimizer warns when it is chosen).

The draw, gather and scaling run in one fused kernel (:mod:`hvdcomp.kernels`: C++ on CPU, Triton on CUDA, with
the same counter-based random numbers, so both draw the same positions); without one, as PyTorch ops with
``torch.rand`` on the tensor's device (no host sync), which draw other positions from the same seed: which path
draws is part of the plan every rank shares.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import MEASURED, Compressor, Context, State, derive_seed
from hvdcomp.kernels import kernels_for
from hvdcomp.wire import Payload

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
        momentum: with error feedback, the momentum m whose gain 1 / (1 - m) random-k applies in place of the
            optimizer's momentum (module docstring); 0: the optimizer's momentum applies. Without error feedback
            (``unbiased``) the optimizer's momentum applies whatever it is.
    """

    name = "randomk"
    summable = True
    momentum_averages = False

    def __init__(self, ratio: float = 0.01, unbiased: bool = False, momentum: float = 0.9) -> None:
        check.number(self.name, "ratio", ratio, gt=0, le=1)
        check.boolean(self.name, "unbiased", unbiased)
        self.ratio = float(ratio)
        self.unbiased = unbiased  # type: ignore[misc] # per instance: the memory policy reads it
        self.momentum = check.number(self.name, "momentum", momentum, ge=0, lt=1)  # the memory policy reads it

    def accuracy_risk(self) -> str | None:
        if self.unbiased:
            return (f"unbiased random-k scales what it sends by d/k, which multiplies the gradient's variance by about "
                    f"{1 / self.ratio - 1:.0f}: at 1% on digits (lr 0.05) training diverged (docs/methods.md). Use the "
                    "default (error feedback), a ratio near 1 or a lower learning rate")
        if not self.momentum:
            return ("random-k with error feedback under the optimizer's momentum diverges: each entry sent late "
                    f"carries many steps of gradient, which the momentum amplifies again; {MEASURED} it stayed at "
                    "10.8% test accuracy, dense 97.7%. Use momentum: 0.9 (the default; its parameters then need "
                    "momentum 0 in the optimizer)")
        if self.ratio < 0.1:
            return (f"random-k at ratio {self.ratio:g} sends each entry about once in {1 / self.ratio:.0f} steps, "
                    f"with every step's gradient since its last draw: {MEASURED} random-k at 0.01 ended 5.0 points "
                    "below dense, 1.7 below at lr 0.05, and at ratio 0.1 0.6 below. Use a larger ratio, a lower "
                    "learning rate, or top-k or threshold (0.3 and 0.5 points below at 1%)")
        return None

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
