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
``collective: two_phase`` (scaled only) each owner takes the vote of its chunk and re-sends it as signs, with its
own error feedback: a tie (0) then goes out as the sign of the owner's residual (a coin where that is 0 too), and
the error is made good in later steps. Unscaled signs cannot carry the vote's sum over N ranks (the owner would
send it N times too small), so ``scaled=False`` is gathered.

``efsignsgd``, Algorithm 1 of Karimireddy et al.: with p = g + e (e the residual), send
Delta = (||p||_1 / d) sign(p) and keep e <- p - Delta; the ranks' Deltas are averaged.

Momentum (``momentum``, 0.9 by default; :class:`hvdcomp.error_feedback.MomentumCorrection`) is applied on each
rank before the sign, and the optimizer applies none to these parameters (they need a group with ``momentum`` 0,
as DGC's do; ``hvdcomp train`` sets it):

* ``signsgd`` votes on the sign of u <- m u + g: Signum with majority vote, Algorithm 1 of Bernstein et al.,
  the form their experiments train with. The momentum averages the noise out before the sign is taken, where
  the optimizer's momentum after the vote only adds up signs already decided: on the glyphs workload (2 ranks,
  SGD lr 0.1, momentum 0.9 for dense, 3 epochs, seed 0) signSGD under the optimizer's momentum turned unstable (92.9%,
  65.4%, 77.5% test accuracy after each epoch, dense 97.7%), and Signum ended level with dense
  (perf/accuracy/README.md). The undampened u (Signum's is (1 - m) u) has the same signs, and its scale,
  ||u||_1 / d, that of dense momentum SGD's step.
* ``efsignsgd`` takes only the momentum's gain, g / (1 - m), into its error feedback: one scale per tensor sends
  the entries far above the tensor's mean magnitude at that mean, so they are held back over many steps, and that
  delay already averages as momentum does (as random-k's, :mod:`hvdcomp.methods.randomk`). With the optimizer's
  momentum it collapsed to 10.5% test accuracy on glyphs; with the gain it ended 0.3 points below dense.

``momentum: 0`` gives the optimizer's momentum back (the methods as their papers' Algorithms 3 and 1 state them).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import MEASURED
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.packing import pack_bits
from hvdcomp.quantization import BucketQuantizer, decode_sum, generator, stacked, stacked_scalars
from hvdcomp.wire import Payload


class EFSignSGD(BucketQuantizer):
    """Scaled sign, ||p||_1 / d * sign(p), with error feedback by default (module docstring).

    Args:
        momentum: the momentum whose gain 1 / (1 - m) is applied before error feedback, in place of the optimizer's
            momentum (module docstring); 0: the optimizer's momentum applies.
    """

    name = "efsignsgd"
    unbiased = False
    momentum_averages = False

    def __init__(self, momentum: float = 0.9) -> None:
        self.momentum = check.number(self.name, "momentum", momentum, ge=0, lt=1)  # the memory policy reads it
    bits = 1
    bucket_size = None  # one scale per tensor
    scaled = True  # (signSGD's option; EF-signSGD always scales)

    def accuracy_risk(self) -> str | None:
        if self.momentum:
            return None
        return (f"EF-signSGD under the optimizer's momentum collapsed {MEASURED}: 10.5% test accuracy, dense 97.7%. "
                "Use momentum: 0.9 (the default, 0.3 points below dense; its parameters then need momentum 0 in the "
                "optimizer)")

    def grid(self, device: torch.device) -> torch.Tensor:
        return self.cached_grid("sign", 1, device, lambda codes: codes * 2 - 1)

    def scale_kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        """||x||_1 / d by the CPU kernels (the Triton kernels take it in :meth:`quantize_kernel`'s pass)."""
        return torch.tensor([[kernels.moments(x)[3].item() / max(x.numel(), 1)]], dtype=torch.float32)

    def scale_torch(self, x: torch.Tensor) -> torch.Tensor:
        # summed in float64, as the kernels merge their blocks: float32's sum overflows from |x| ~ 1e36
        return (x.abs().sum(dtype=torch.float64) / max(x.numel(), 1)).float().reshape(1, 1)

    def quantize_kernel(self, kernels: Any, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if is_triton(kernels):  # the scale on the device (no sync), its sums in the pass that packs the signs
            return kernels.pack_signs_abs_mean(x, seed) if self.scaled else (x.new_ones(1, 1),
                                                                            kernels.pack_signs(x, seed))
        return self.scale_kernel(kernels, x), kernels.pack_signs(x, seed)

    def quantize_torch(self, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        coin = torch.rand(x.shape, generator=generator(x.device, seed), device=x.device) < 0.5
        return self.scale_torch(x), pack_bits(((x > 0) | ((x == 0) & coin)).to(torch.uint8), 1)


class SignSGD(EFSignSGD):
    """signSGD with majority vote, no error feedback by default; with momentum by default, Signum (module
    docstring).

    Args:
        scaled: scale the vote by the ranks' mean ||g||_1 / d; ``False``: the bare sign, as in the paper.
        momentum: the momentum m of u <- m u + g, whose sign each rank sends (Signum); 0: the gradient's sign
            (signSGD), and the optimizer's momentum applies.
    """

    name = "signsgd"
    default_error_feedback = False
    momentum_averages = True

    def __init__(self, scaled: bool = True, momentum: float = 0.9) -> None:
        check.boolean(self.name, "scaled", scaled)
        self.scaled = scaled
        super().__init__(momentum)

    def accuracy_risk(self) -> str | None:
        if self.momentum:
            return None
        return ("signSGD without momentum (the vote on the gradients' signs, under the optimizer's momentum) turned "
                f"unstable {MEASURED}: 92.9%, 65.4%, 77.5% test accuracy after epochs 1, 2, 3, dense 97.7%. Use "
                "momentum: 0.9 (the default: Signum, level with dense there; its parameters then need momentum 0 in "
                "the optimizer)")

    @property
    def recompressible(self) -> bool:  # type: ignore[override]
        """Scaled only: bare signs cannot carry a sum of N ranks' votes (two-phase would send it N times too small)."""
        return self.scaled

    def scale_kernel(self, kernels: Any, x: torch.Tensor) -> torch.Tensor:
        return super().scale_kernel(kernels, x) if self.scaled else x.new_ones(1, 1)

    def scale_torch(self, x: torch.Tensor) -> torch.Tensor:
        return super().scale_torch(x) if self.scaled else x.new_ones(1, 1)

    def aggregate(self, payloads: list[Payload], meta: Any) -> torch.Tensor:
        """The majority vote, sign(sum of the ranks' signs), times the sum of their scales added in rank order (the
        optimizer's average then applies the mean scale): one pass of the fused kernels where they apply."""
        shape, n = meta
        device = payloads[0][1].device
        scales = stacked_scalars([payload[0] for payload in payloads])
        kernels = kernels_for(device)
        if kernels is not None:
            return kernels.sign_vote(stacked([payload[1] for payload in payloads]), scales, n).view(shape)
        ones = torch.ones(1, 1, device=device)
        votes = decode_sum([payload[1] for payload in payloads], [ones] * len(payloads), self.grid(device), 1,
                           self.bucket(n), n)
        scale = functools.reduce(torch.add, scales.unbind())
        return votes.sign_().mul_(scale).view(shape)
