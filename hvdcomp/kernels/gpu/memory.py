"""Triton kernel for the memory's update (:mod:`hvdcomp.error_feedback`, DGC's memory): momentum correction and error
feedback's accumulation in one pass, the GPU counterpart of ``hvdcomp/kernels/memory.cpp``.

u <- m u + g (``average``) or u = m g (m the momentum's gain 1 / (1 - momentum)), then residual <- residual + u: one
launch where PyTorch takes three (``mul_``, ``add_``, ``add_``), and the gradient, u and the residual read once. The
multiply and the add round apart (``enable_fp_fusion=False``), as PyTorch's separate operations do. And DGC's
release of the entries it sent (:func:`release`), in one launch for its one or two buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit(do_not_specialize=["n", "momentum"])
def _momentum_kernel(g_ptr, u_ptr, residual_ptr, n, momentum, AVERAGE: tl.constexpr, STORE_U: tl.constexpr,
                     RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offsets, mask=mask, other=0.0) * momentum + g if AVERAGE else g * momentum
    if STORE_U:
        tl.store(u_ptr + offsets, u, mask=mask)
    if RESIDUAL:
        tl.store(residual_ptr + offsets, tl.load(residual_ptr + offsets, mask=mask, other=0.0) + u, mask=mask)


def momentum_step(g: torch.Tensor, u: torch.Tensor | None, residual: torch.Tensor | None, momentum: float,
                  average: bool) -> None:
    """``momentum_step`` of the CPU kernels, in place: u <- momentum u + g where ``average`` (u needed), else
    u = momentum g (``momentum`` the gain; u stored where given); then ``residual`` += u where given. The gradient
    ``g`` contiguous (float32, or a half type converted on load), the buffers float32, contiguous, of g's size."""
    n = g.numel()
    buffers = [buffer for buffer in (u, residual) if buffer is not None]
    if (average and u is None) or not g.is_contiguous() or any(
            buffer.dtype != torch.float32 or not buffer.is_contiguous() or buffer.numel() != n for buffer in buffers):
        raise ValueError(f"momentum_step: a contiguous gradient of {n} elements and float32 contiguous buffers of its "
                         f"size (u needed to average), got u {None if u is None else tuple(u.shape)} and residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    if n:
        _momentum_kernel[(triton.cdiv(n, _BLOCK),)](g, u if u is not None else g, residual if residual is not None
                                                    else g, n, momentum, AVERAGE=average, STORE_U=u is not None,
                                                    RESIDUAL=residual is not None, BLOCK=_BLOCK,
                                                    enable_fp_fusion=False)


@triton.jit(do_not_specialize=["k"])
def _release_kernel(first_ptr, second_ptr, indices_ptr, k, SECOND: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < k
    index = tl.load(indices_ptr + offsets, mask=mask, other=0).to(tl.int64)
    tl.store(first_ptr + index, 0.0, mask=mask)
    if SECOND:
        tl.store(second_ptr + index, 0.0, mask=mask)


def release(buffers: list[torch.Tensor], indices: torch.Tensor) -> None:
    """DGC's release of the sent entries: zeros at ``indices`` (int32 or int64, as the selection wrote them: in range,
    which is not checked, as that would read them on the host) in one or two flat float32 buffers of one size, in one
    launch, where PyTorch's ``index_fill_`` takes one per buffer and int64 indices (a conversion)."""
    if not 1 <= len(buffers) <= 2 or any(b.dtype != torch.float32 or not b.is_contiguous() or b.numel() !=
                                         buffers[0].numel() for b in buffers):
        raise ValueError(f"release: one or two float32 contiguous buffers of one size, got "
                         f"{[(b.dtype, tuple(b.shape)) for b in buffers]}")
    if indices.dim() != 1 or not indices.is_contiguous() or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"release: indices must be a contiguous 1-D int32 or int64 tensor, got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    k = indices.numel()
    if k:
        _release_kernel[(triton.cdiv(k, _BLOCK),)](buffers[0], buffers[-1], indices, k, SECOND=len(buffers) == 2,
                                                   BLOCK=_BLOCK)
