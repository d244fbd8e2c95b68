"""Triton kernel for LGC's guard (:mod:`hvdcomp.methods.lgc`): the signed projection S x of k values onto 64 sums, and
the error of a reconstruction's projection against an exact one, in one launch each, where PyTorch takes six launches
(the signs' draw, scaling and shift, the padding, the product, the sums) and eleven (another projection, a difference,
two squares, two sums and a stack).

Value i of x counts in sum i // w (w = ceil(k / 64); the values padded with zeros to 64 w) with the sign of bit 0 of
splitmix64(key + i), the counter-based draw of :mod:`hvdcomp.kernels.gpu.common`, which the PyTorch path
(:meth:`hvdcomp.methods.lgc.LGC.projection`) computes bit for bit: both paths project with the same signs. One program
holds the 64 sums as a [64, COLS] tile and walks the w columns; it adds in another order than PyTorch, so the two paths
agree to float rounding, and each is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import random_bits

_COLS = 64


@triton.jit(do_not_specialize=["n", "width", "key"])
def _projection_kernel(x_ptr, exact_ptr, out_ptr, n, width, key, BUCKETS: tl.constexpr, COLS: tl.constexpr,
                       ERROR: tl.constexpr):
    """S x into out[0:BUCKETS]; with ERROR, (||exact - S x||^2, ||exact||^2) into out[0:2] instead."""
    bucket = tl.arange(0, BUCKETS)[:, None].to(tl.int64)
    col = tl.arange(0, COLS)[None, :]
    sums = tl.zeros([BUCKETS, COLS], dtype=tl.float32)
    start = 0
    while start < width:  # (while, not range: Triton 3.6's interpreter fails on range(runtime value))
        index = bucket * width + start + col
        mask = (start + col < width) & (index < n)
        x = tl.load(x_ptr + index, mask=mask, other=0.0)
        sums += tl.where((random_bits(key, index) & 1) == 0, x, -x)
        start += COLS
    projected = tl.sum(sums, axis=1)
    if ERROR:
        exact = tl.load(exact_ptr + tl.arange(0, BUCKETS))
        difference = exact - projected
        tl.store(out_ptr, tl.sum(difference * difference))
        tl.store(out_ptr + 1, tl.sum(exact * exact))
    else:
        tl.store(out_ptr + tl.arange(0, BUCKETS), projected)


def _launch(x: torch.Tensor, exact: torch.Tensor | None, key: int, buckets: int) -> torch.Tensor:
    if x.dim() != 1 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"projection: a contiguous 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if buckets & (buckets - 1) or not 0 <= key < 2**62:
        raise ValueError(f"projection: a power of 2 of sums and a key in [0, 2^62), got {buckets} and {key}")
    out = torch.empty(buckets if exact is None else 2, dtype=torch.float32, device=x.device)
    _projection_kernel[(1,)](x, out if exact is None else exact, out, x.numel(), -(-x.numel() // buckets), key,
                             BUCKETS=buckets, COLS=_COLS, ERROR=exact is not None, enable_fp_fusion=False)
    return out


def projection(x: torch.Tensor, key: int, buckets: int) -> torch.Tensor:
    """S x: the ``buckets`` signed sums of ``x`` (float32, contiguous, 1-D; signs from ``key``, in [0, 2^62)), one
    launch."""
    return _launch(x, None, key, buckets)


def projection_error(exact: torch.Tensor, x: torch.Tensor, key: int) -> torch.Tensor:
    """(||exact - S x||^2, ||exact||^2), float32 [2], for S x as :func:`projection` makes it over as many sums as
    ``exact`` holds (float32, contiguous), in one launch."""
    if exact.dtype != torch.float32 or not exact.is_contiguous() or exact.dim() != 1:
        raise ValueError(f"projection_error: a contiguous 1-D float32 exact projection, got {exact.dtype} of shape "
                         f"{tuple(exact.shape)}")
    return _launch(x, exact, key, exact.numel())
