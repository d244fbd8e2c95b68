"""Triton kernels for the squared norms of a few tensors at once (GraVAC's agreed inputs,
:mod:`hvdcomp.methods.gravac`): two launches for up to three tensors, where PyTorch takes a ``pow`` and a ``sum`` per
tensor and a ``stack`` after them.

The first launch sums the squares of each block of 1,024 entries of every tensor (one program per block, the tensors'
blocks one after the other); the second, one program, adds each tensor's block sums in float64 (block i in lane
i mod 1,024, the lanes then summed) and writes the sums as float32. Deterministic: no atomics, the same order every
run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import float64_total

_BLOCK = 1024
_CHUNK = 1024
#: the most tensors one call takes
MAX_NORMS = 3


@triton.jit
def _block_squares(x_ptr, n, block, BLOCK: tl.constexpr):
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    return tl.sum(x * x)


@triton.jit(do_not_specialize=["n0", "n1", "n2", "b0", "b1"])
def _partial_kernel(x0_ptr, x1_ptr, x2_ptr, partial_ptr, n0, n1, n2, b0, b1, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < b0:
        total = _block_squares(x0_ptr, n0, pid, BLOCK)
    elif pid < b0 + b1:
        total = _block_squares(x1_ptr, n1, pid - b0, BLOCK)
    else:
        total = _block_squares(x2_ptr, n2, pid - b0 - b1, BLOCK)
    tl.store(partial_ptr + pid, total)


@triton.jit(do_not_specialize=["b0", "b1", "b2"])
def _finish_kernel(partial_ptr, out_ptr, b0, b1, b2, COUNT: tl.constexpr, CHUNK: tl.constexpr):
    start = 0
    for t in tl.static_range(COUNT):
        blocks = b0 if t == 0 else (b1 if t == 1 else b2)
        tl.store(out_ptr + t, float64_total(partial_ptr + start, blocks, 1, CHUNK).to(tl.float32))
        start += blocks


def squared_norms(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """Writes sum(t^2) of each of ``tensors`` (one to three, contiguous, float32 or a half type) to ``out[i]``
    (float32, on their device), in two launches."""
    if not 1 <= len(tensors) <= MAX_NORMS or out.dtype != torch.float32 or out.numel() < len(tensors) \
            or not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"squared_norms: 1 to {MAX_NORMS} contiguous tensors into a float32 out of at least as many "
                         f"entries, got {len(tensors)} tensors and a {out.dtype} out of {out.numel()}")
    sizes = [t.numel() for t in tensors] + [0] * (MAX_NORMS - len(tensors))
    blocks = [triton.cdiv(n, _BLOCK) for n in sizes]
    pointers = [*tensors, *[tensors[0]] * (MAX_NORMS - len(tensors))]  # (past COUNT: never read)
    partial = torch.empty(max(1, sum(blocks)), dtype=torch.float32, device=out.device)
    if sum(blocks):
        _partial_kernel[(sum(blocks),)](*pointers, partial, *sizes, blocks[0], blocks[1], BLOCK=_BLOCK,
                                        enable_fp_fusion=False)
    _finish_kernel[(1,)](partial, out, *blocks, COUNT=len(tensors), CHUNK=_CHUNK, enable_fp_fusion=False)
