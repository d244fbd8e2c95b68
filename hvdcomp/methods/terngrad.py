"""TernGrad: ternary gradients (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning", NeurIPS 2017, arXiv:1705.07878).

Per layer (here: per parameter tensor, or per two-phase chunk) and per rank, eq. (5) of the paper:

    s = max_k |g_k|,    b_k ~ Bernoulli(|g_k| / s),    Q(g)_k = s * sign(g_k) * b_k,

which is unbiased, E[Q(g)] = g, with per-element variance |g_k| (s - |g_k|). Two refinements of section 3:

* gradient clipping (eq. 12): g_k <- clamp(g_k, -c*sigma, c*sigma), sigma the tensor's standard deviation,
  c = 2.5 in every experiment of the paper. Outliers then no longer inflate s and the variance;
  ``clip=None`` turns it off. Clipping makes Q unbiased for the clipped gradient. The bound is about zero, as in the
  paper, and sigma about the mean: a tensor whose entries share a mean far above their spread (|mean| > c*sigma) is
  clipped to +-c*sigma, most of its mean lost (a constant tensor to 0); such a layer needs ``clip=None`` (an
  override) or stays dense.
* scaler sharing (eq. 11): all ranks use s = max over ranks of their own s_i, one fused max-allreduce of all
  layers' scalers per step, so the sum over ranks is an integer in [-N, N] times s.

Encoding: 2 bits per element, 4 per byte (:mod:`hvdcomp.packing`), plus the float32 scaler: 2.00006 bits per
element at 1 M elements. Decoding sums the ranks' ternary codes times their scalers in one pass.

The fused kernels of :mod:`hvdcomp.kernels` (C++ on CPU, Triton on CUDA) do the statistics in one pass and
clip-ternarize-pack in another, with the same counter-based random numbers, so both give the same codes; on CUDA
the scaler and the clip bound stay on the device between the passes and through the scaler agreement. Without
them (no compiler, no Triton) the same operations run as PyTorch ops with ``torch.rand``. Every path draws from a
seed derived from the per-parameter seed and the step (the context's), so a run resumed from a checkpoint
continues exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import Compressor, Context, State, derive_seed
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.packing import pack_bits, unpack_bits
from hvdcomp.quantization import generator, stacked, stacked_scalars
from hvdcomp.requests import Agree
from hvdcomp.wire import Payload


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (0b00 = 0, 0b01 = +1, 0b10 = -1) to float32 values in {-1, 0, 1}."""
    return (codes & 1).float() - (codes >> 1).float()


class TernGrad(Compressor):
    """Stochastic ternarization with clipping and scaler sharing, gathered (see module docstring).

    Args:
        clip: clip each tensor at ``clip`` standard deviations before ternarizing (the paper's c = 2.5);
            ``None`` turns clipping off.
        scaler_sharing: all ranks use the largest scaler of any rank for each tensor (one fused
            collective per step); ``False`` lets each rank send its own.
    """

    name = "terngrad"
    unbiased = True
    fixed_size = True

    def __init__(self, clip: float | None = 2.5, scaler_sharing: bool = True) -> None:
        check.number(self.name, "clip", clip, gt=0, optional=True, noun="number of standard deviations")
        check.boolean(self.name, "scaler_sharing", scaler_sharing)
        self.clip = None if clip is None else float(clip)
        self.scaler_sharing = scaler_sharing


    @staticmethod
    def _flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().reshape(-1).to(torch.float32).contiguous()

    def _statistics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(clip bound c*sigma, local scaler max_k |clip(g)_k|) as float32 tensors of shape [1]."""
        n = x.numel()
        if n == 0:
            zero = x.new_zeros(1)
            return zero, zero
        kernels = kernels_for(x.device)
        if is_triton(kernels):  # one pass, the results on the device
            return kernels.ternary_statistics(x, self.clip)
        if kernels is not None:  # one pass, and these are host values anyway: no device sync
            _, deviations, absmax, _ = kernels.moments(x).tolist()
            bound = math.inf if self.clip is None else self.clip * math.sqrt(deviations / n)
            return torch.tensor([bound], dtype=torch.float32), torch.tensor([min(absmax, bound)],
                                                                             dtype=torch.float32)
        absmax = x.abs().amax().reshape(1)
        if self.clip is None:
            return torch.full_like(absmax, math.inf), absmax
        # in float64, as the kernels merge their blocks: float32's std is off from |x| ~ 1e35 (its sums overflow)
        bound = (self.clip * x.double().std(correction=0)).float().reshape(1)
        return bound, torch.minimum(absmax, bound)

    @property
    def agrees(self) -> bool:
        return self.scaler_sharing

    def agree(self, tensor: torch.Tensor, state: State, ctx: Context) -> Agree | None:
        if not self.scaler_sharing:
            return None
        # Kept for the compress() call of this same step, which would otherwise read the tensor again.
        state["statistics"] = self._statistics(self._flat(tensor))
        return Agree(state["statistics"][1], "max")

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        x = self._flat(tensor)
        seed = derive_seed(ctx.seed, ctx.step)
        statistics = state.pop("statistics", None)
        bound, scaler = self._statistics(x) if statistics is None else statistics
        if agreed is not None:
            scaler = agreed.reshape(1).to(torch.float32)
        kernels = kernels_for(x.device)
        if is_triton(kernels):
            packed = kernels.ternarize_pack(x, scaler, bound, seed)
        elif kernels is not None:
            packed = kernels.ternarize_pack(x, float(scaler), float(bound), seed)
        else:
            kept = x.abs().clamp_(max=bound)  # a_k = min(|g_k|, c*sigma) <= scaler
            draw = torch.rand(x.numel(), generator=generator(x.device, seed), device=x.device).mul_(scaler)
            codes = draw.lt_(kept).to(torch.uint8) << (x < 0).to(torch.uint8)  # 0, 1 (+1) or 2 (-1)
            packed = pack_bits(codes, 2)
        return [scaler, packed], (tensor.shape, x.numel())

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        return self.aggregate([payload], meta)

    def aggregate(self, payloads: list[Payload], meta: Any) -> torch.Tensor:
        shape, n = meta
        scales = stacked_scalars([payload[0] for payload in payloads])
        packed = [payload[1] for payload in payloads]
        kernels = kernels_for(scales.device)
        if kernels is not None:
            return kernels.unpack_sum(stacked(packed), scales, n).view(shape)
        total = torch.zeros(n, dtype=torch.float32, device=scales.device)
        for scale, codes in zip(scales, packed, strict=True):
            total.add_(decode_codes(unpack_bits(codes, 2, n)).mul_(scale))
        return total.view(shape)
