"""Triton kernels for LGC's guard (:mod:`hvdcomp.methods.lgc`): the signed projection S x of k values onto 64 sums in
one launch, where PyTorch draws the signs, pads, multiplies and sums, and the error of a reconstruction's projection
against an exact one in two.

Value i of x counts in sum i // w (w = ceil(k / 64); the values padded with zeros to 64 w) with the sign of bit 0 of
splitmix64(key + i), the counter-based draw of :mod:`hvdcomp.kernels.gpu.common`, which the PyTorch path
(:meth:`hvdcomp.methods.lgc.LGC.projection`) computes bit for bit: both paths project with the same signs. One program
per sum walks its w values, COLS at a time; the error's second launch, one program, adds the 64 sums' squared
differences and squares. Each adds in a fixed order, another than PyTorch's, so the two paths agree to float rounding
and each is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import random_bits

_COLS = 1024


@triton.jit(do_not_specialize=["n", "width", "key"])
def _projection_kernel(x_ptr, out_ptr, n, width, key, COLS: tl.constexpr):
    """out[j] = the signed sum of x[j w : (j + 1) w] (x read as zero from n on)."""
    first = tl.program_id(0).to(tl.int64) * width
    col = tl.arange(0, COLS)
    sums = tl.zeros([COLS], dtype=tl.float32)
    start = 0
    while start < width:  # (while, not range: Triton 3.6's interpreter fails on range(runtime value))
        index = first + start + col
        x = tl.load(x_ptr + index, mask=(start + col < width) & (index < n), other=0.0)
        sums += tl.where((random_bits(key, index) & 1) == 0, x, -x)
        start += COLS
    tl.store(out_ptr + tl.program_id(0), tl.sum(sums, axis=0))


@triton.jit
def _error_kernel(exact_ptr, projected_ptr, out_ptr, BUCKETS: tl.constexpr):
    """out = (||exact - projected||^2, ||exact||^2)."""
    exact = tl.load(exact_ptr + tl.arange(0, BUCKETS))
    difference = exact - tl.load(projected_ptr + tl.arange(0, BUCKETS))
    tl.store(out_ptr, tl.sum(difference * difference, axis=0))
    tl.store(out_ptr + 1, tl.sum(exact * exact, axis=0))


def projection(x: torch.Tensor, key: int, buckets: int) -> torch.Tensor:
    """S x: the ``buckets`` signed sums of ``x`` (float32, contiguous, 1-D; signs from ``key``, in [0, 2^62)), one
    launch."""
    if x.dim() != 1 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"projection: a contiguous 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if buckets < 1 or buckets & (buckets - 1) or not 0 <= key < 2**62:
        raise ValueError(f"projection: a power of 2 of sums and a key in [0, 2^62), got {buckets} and {key}")
    out = torch.empty(buckets, dtype=torch.float32, device=x.device)
    _projection_kernel[(buckets,)](x, out, x.numel(), -(-x.numel() // buckets), key, COLS=_COLS)
    return out


def projection_error(exact: torch.Tensor, x: torch.Tensor, key: int) -> torch.Tensor:
    """(||exact - S x||^2, ||exact||^2), float32 [2], for S x as :func:`projection` makes it over as many sums as
    ``exact`` holds (float32, contiguous), in two launches."""
    if exact.dtype != torch.float32 or not exact.is_contiguous() or exact.dim() != 1:
        raise ValueError(f"projection_error: a contiguous 1-D float32 exact projection, got {exact.dtype} of shape "
                         f"{tuple(exact.shape)}")
    out = torch.empty(2, dtype=torch.float32, device=x.device)
    _error_kernel[(1,)](exact, projection(x, key, exact.numel()), out, BUCKETS=exact.numel(), enable_fp_fusion=False)
    return out
