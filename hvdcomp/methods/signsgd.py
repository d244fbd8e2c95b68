"""The sign family: signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD with
Majority Vote is Communication Efficient and Fault Tolerant", ICLR 2019, arXiv:1810.05291) and EF-signSGD
(Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
ICML 2019, arXiv:1901.09847). One bit per element, the sign, plus one float32 scale per tensor.

``signsgd``, Algorithm 3 of Bernstein et al.: each rank sends sign(g_m); the aggregate is the majority vote

    sign(sum_m sign(g_m)),

added to ``p.grad`` scaled by the mean over ranks of ||g_m||_1 / d (``scaled=True``, the default: the same
learning rate as for dense SGD lands in the right range) or unscaled (``scaled=False``: the paper's update,
where the learning rate is the step per coordinate). Ties (an even number of ranks split evenly) give 0: the
coordinate does not move. An exact zero votes on a fair coin drawn from the rank's seed, so zero gradients (a
dead unit, an unused row) push no direction. No error feedback by default, as in the paper. Under
``collective: two_phase`` each owner takes the vote of its chunk and re-sends it as signs, with its own error
feedback: a tie (0) then goes out as the sign of the owner's residual (a coin where that is 0 too), and the
error is made good in later steps.

``efsignsgd``, Algorithm 1 of Karimireddy et al.: with p = g + e (e the residual), send
Delta = (||p||_1 / d) sign(p) and keep e <- p - Delta; the ranks' Deltas are averaged.
"""

from __future__ import annotations

from typing import Any

import torch

from hvdcomp.compressor import Payload
from hvdcomp.kernels import gpu_kernels
from hvdcomp.packing import pack_bits
from hvdcomp.quantization import BucketQuantizer, decode_sum, generator


class EFSignSGD(BucketQuantizer):
    """Scaled sign, ||p||_1 / d * sign(p), with error feedback by default (module docstring)."""

    name = "efsignsgd"
    unbiased = False
    bits = 1
    bucket_size = None  # one scale per tensor

    def grid(self, device: torch.device) -> torch.Tensor:
        return self.cached_grid("sign", 1, device, lambda codes: codes * 2 - 1)

    def scale_kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        if kernels is gpu_kernels():  # on the device: no sync
            return kernels.abs_mean(x)
        return torch.tensor([[kernels.moments(x)[3].item() / max(x.numel(), 1)]], dtype=torch.float32)

    def scale_torch(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs().sum() / max(x.numel(), 1)).reshape(1, 1)

    def quantize_kernel(self, kernels: Any, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale_kernel(kernels, x), kernels.pack_signs(x, seed)

    def quantize_torch(self, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        coin = torch.rand(x.shape, generator=generator(x.device, seed), device=x.device) < 0.5
        return self.scale_torch(x), pack_bits(((x > 0) | ((x == 0) & coin)).to(torch.uint8), 1)


class SignSGD(EFSignSGD):
    """signSGD with majority vote, no error feedback by default (module docstring).

    Args:
        scaled: scale the vote by the ranks' mean ||g||_1 / d; ``False``: the bare sign, as in the paper.
    """

    name = "signsgd"
    default_error_feedback = False

    def __init__(self, scaled: bool = True) -> None:
        if not isinstance(scaled, bool):
            raise ValueError(f"signsgd: scaled must be true or false; got {scaled!r}")
        self.scaled = scaled

    def scale_kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        return super().scale_kernel(kernels, x) if self.scaled else x.new_ones(1, 1)

    def scale_torch(self, x: torch.Tensor) -> torch.Tensor:
        return super().scale_torch(x) if self.scaled else x.new_ones(1, 1)

    def aggregate(self, payloads: list[Payload], meta: Any) -> torch.Tensor:
        """The majority vote, sign(sum of the ranks' signs), times the sum of their scales (the optimizer's
        average then applies the mean scale)."""
        shape, n = meta
        device = payloads[0][1].device
        ones = torch.ones(1, 1, device=device)
        votes = decode_sum([payload[1] for payload in payloads], [ones] * len(payloads), self.grid(device), 1,
                           self.bucket(n), n)
        scale = torch.cat([payload[0].reshape(1) for payload in payloads]).sum()
        return votes.sign_().mul_(scale).view(shape)
