"""Deep Gradient Compression (Lin, Han, Mao, Wang and Dally, "Deep Gradient Compression: Reducing the
Communication Bandwidth for Distributed Training", ICLR 2018, arXiv:1712.01887).

Top-k sparsification made to keep SGD with momentum's accuracy, with a memory of its own (Algorithm 1 with
Section 3.2's momentum correction and, as an option, factor masking): for each rank's gradient g of one tensor,

    g <- g * min(1, (clip_norm * sqrt(N)) / ||g||)     local gradient clipping (when clip_norm is set)
    u <- m u + g                                         momentum correction: momentum is accumulated locally
    v <- v + u                                           accumulation (DGC's error feedback)
    send v_i for i in top-k(|v|)                         k = density(step) * d
    v_i <- 0 for the i sent                              what was sent leaves the accumulation
    u_i <- 0 for the i sent                              factor masking (``momentum_masking: true``)

and every rank applies w <- w - lr * (1/N) * sum of the sent v: the momentum is already in v, so the wrapped
optimizer must not apply momentum again. ``hvdcomp.DistributedOptimizer`` checks it: a parameter reduced by DGC
with ``momentum > 0`` in an optimizer group whose ``momentum`` is not 0 is an error. Put the parameters DGC
compresses in a param group with ``momentum=0`` and leave the others (small tensors, those kept dense) their
momentum, as ``hvdcomp train`` does (on digits, without it: 94.6% mean test accuracy over three seeds; with it:
95.6%; dense 96.1%). A ``weight_decay`` of the optimizer still applies, to the averaged gradient, but without
momentum (the group's is 0): its pull is 1 / (1 - m) times weaker than in dense momentum SGD at the same setting
(10x at m = 0.9; the reference code keeps a momentum of its own for it). Scale it by 1 / (1 - m) to match.

Knobs:

* ``density``: the fraction sent after the warm-up (the paper's 99.9% sparsity: 0.001).
* ``momentum``: m, as the optimizer's momentum would be (0.9). 0 gives top-k with DGC's accumulation.
* ``warmup_densities`` and ``warmup_steps``: the sparsity warm-up (Section 3.3): the paper raises sparsity
  exponentially over the first four epochs, 75%, 93.75%, 98.4375%, 99.6%, then 99.9% (densities 0.25, 0.0625,
  0.015625, 0.004, then ``density``); each stage lasts ``warmup_steps`` steps (one epoch in the paper: set it to
  the job's steps per epoch). ``warmup_densities: []`` switches the warm-up off. The stage comes from the step
  counter, so every rank changes density in the same step.
* ``clip_norm``: local gradient clipping (Section 3.2), the threshold of the averaged gradient's norm: the paper
  clips each node's share of the summed gradient (here g / N) to the threshold times N^-1/2, its share if the N
  ranks' gradients were independent and alike, so each rank clips its gradient of this tensor to
  ``clip_norm * sqrt(N)``: the average of N such gradients then has a norm of about ``clip_norm`` (at most
  ``clip_norm * sqrt(N)``, where they are all alike). The paper clips the norm of the whole model's gradient; here
  it is per tensor (the unit hvdcomp reduces). Off by default.
* ``momentum_masking``: the paper's factor masking (Section 3.2), off by default. Masking zeroes the momentum of
  every entry sent, so an entry sent in every step gets no momentum at all: a step 1 / (1 - m) = 10 times smaller
  than dense momentum SGD gives it. The entries sent most often are the largest, and in the warm-up's first stage
  (a quarter of the entries sent) they are most of the gradient: on the glyphs workload (2 ranks, SGD lr 0.1,
  3 epochs, seed 0) DGC with masking ended 1.6 points below dense, without it 0.6 (perf/accuracy/README.md).
  Without masking, DGC at density 1 is momentum SGD exactly; the stale momentum the paper masks is what the
  momentum of an entry sent late still adds after it was sent (the reference code, synxlin/deep-gradient-
  compression, has the same switch, ``momentum_masking``).

The top-k is top-k's (:func:`hvdcomp.methods.topk.largest`): a threshold from a sample (on CPU, about 65 k
entries) picks candidates and an exact top-k runs on them, falling back to the full top-k when the sample's
threshold keeps fewer than k; the paper sends everything above the sampled threshold (an approximate k). Decoding
is top-k's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import MEASURED, Context, State
from hvdcomp.error_feedback import momentum_step
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.methods.topk import Sparse, top_entries, without_zeros
from hvdcomp.wire import Payload

#: the paper's warm-up: sparsity 75%, 93.75%, 98.4375%, 99.6% over the first four epochs
PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)


class DGC(Sparse):
    """Deep Gradient Compression with momentum correction, local clipping, sparsity warm-up and optionally factor
    masking (see the module docstring for each knob)."""

    name = "dgc"
    own_memory = True
    epoch_options = ("warmup_steps",)

    def __init__(self, density: float = 0.001, momentum: float = 0.9,
                 warmup_densities: Sequence[float] = PAPER_WARMUP, warmup_steps: int = 100,
                 clip_norm: float | None = None, momentum_masking: bool = False) -> None:
        self.density = check.number(self.name, "density", density, gt=0, le=1)
        check.number(self.name, "momentum", momentum, ge=0, lt=1)
        self.momentum = float(momentum)
        self.warmup_densities = check.numbers(self.name, "warmup_densities", warmup_densities, gt=0, le=1,
                                              noun="densities")
        check.integer(self.name, "warmup_steps", warmup_steps, ge=1)
        self.warmup_steps = warmup_steps
        check.number(self.name, "clip_norm", clip_norm, gt=0, optional=True)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.momentum_masking = check.boolean(self.name, "momentum_masking", momentum_masking)

    def accuracy_risk(self) -> str | None:
        if not self.momentum_masking:
            return None
        return (f"DGC with factor masking ended 1.6 points below dense {MEASURED}: masking takes all momentum from "
                "the entries sent most often. Without it (momentum_masking: false, the default) DGC ended 0.6 points "
                "below")

    def steady_from(self) -> int:
        return len(self.warmup_densities) * self.warmup_steps

    def density_at(self, step: int) -> float:
        """The fraction sent at ``step``: the warm-up's stage, then ``density``."""
        stage = step // self.warmup_steps
        return self.warmup_densities[stage] if stage < len(self.warmup_densities) else self.density

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        zeros = torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device)
        return {"momentum": zeros, "accumulated": zeros.clone()}

    @property
    def applies_momentum(self) -> bool:  # type: ignore[override]
        return self.momentum > 0

    def accumulate(self, tensor: torch.Tensor, state: State, ctx: Context) -> torch.Tensor:
        """Clipping, momentum correction and accumulation: returns v (flat float32, the state's buffer)."""
        g = tensor.detach().reshape(-1)
        u, v = state["momentum"], state["accumulated"]
        if self.clip_norm is not None:  # scale = min(1, c / ||g||), without a host sync
            norm = torch.linalg.vector_norm(g.float())
            scale = (self.clip_norm * math.sqrt(ctx.size)) / norm.clamp(min=torch.finfo(torch.float32).tiny)
            g = g * scale.clamp(max=1)
        momentum_step(g, u, v, self.momentum, True)
        return v

    def release(self, state: State, indices: torch.Tensor | None) -> None:
        """v zeroed where sent (``None``: everywhere, after a dense send), and u too with factor masking."""
        masked = (state["momentum"], state["accumulated"]) if self.momentum_masking else (state["accumulated"],)
        kernels = kernels_for(masked[0].device)
        if indices is not None and is_triton(kernels):  # one launch, the indices as the selection wrote them
            kernels.release(list(masked), indices)
            return
        for buffer in masked:
            if indices is None:
                buffer.zero_()
            else:  # index_fill_, not buffer[indices] = 0: the latter synchronizes with the GPU
                buffer.index_fill_(0, indices.long(), 0)

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        v = self.accumulate(tensor, state, ctx)
        n = v.numel()
        k = min(n, max(1, math.ceil(self.density_at(ctx.step) * n)))
        values, indices = top_entries(v, k)  # values a copy: v is zeroed next
        self.release(state, indices)  # every selected entry, as on CUDA, also those not sent for being zero
        values, indices = without_zeros(values, indices)  # as top-k's
        return [values, indices], (tensor.shape, n, torch.float32)
