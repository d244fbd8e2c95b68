"""Triton kernel for PowerSGD's orthogonalization (:func:`hvdcomp.methods.powersgd.orthogonalize`): Gram-Schmidt on
the r <= 2 columns of each matrix of a batch, or of every matrix of a step laid back to back in one buffer (a bucket's
Ps or Qs, of any numbers of rows), in one launch, where the PyTorch path takes 14 a matrix (a norm, a guard and a
division per column, a projection between them).

One program per matrix (n x r, float32, rows contiguous; where it starts and its n read from a small table of the
layout, made once per layout and device and kept), in three passes over its rows: the sums of squares and the
columns' dot product, the second column's norm once the first is projected out, then the writes. Column 0 becomes
c0 / |c0|, column 1 becomes (c1 - (c1 . q0) q0) / |c1 - (c1 . q0) q0|, with (c1 . q0) = (c1 . c0) / |c0|; each
norm with epsilon added, as on the PyTorch path. A zero column (column 1: once column 0 is projected out) is
replaced, as on the PyTorch path, by its spare vector of signs (:func:`hvdcomp.methods.powersgd.spare_columns`), so
projected (for column 1, an extra pass finds that norm) and normalized. The sums run in another order than PyTorch's,
so the results agree to float rounding, not bit for bit.
The matrices PowerSGD orthogonalizes are its factors P (n x r) and Q (m x r): small beside the gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import kept_table

_BLOCK = 1024


@triton.jit
def _spare(rows, column: tl.constexpr):
    """Column ``column``'s spare vector at ``rows``: +-1 (:func:`hvdcomp.methods.powersgd.spare_columns`)."""
    rows = rows.to(tl.int64)
    bits = (rows * 2654435761) >> (16 + column // 2)
    if column % 2 == 1:
        bits = bits ^ rows
    return 1.0 - 2.0 * (bits & 1).to(tl.float32)


@triton.jit
def _q0(base, rows, mask, spare0, norm0, R: tl.constexpr):
    """The orthonormalized column 0 at ``rows``: the column, or its spare where it is zero (``spare0``), over
    ``norm0``."""
    return tl.div_rn(tl.where(spare0, _spare(rows, 0), tl.load(base + rows * R, mask=mask, other=0.0)), norm0)


@triton.jit(do_not_specialize=["count", "epsilon"])
def _gram_schmidt_kernel(x_ptr, layout_ptr, count, epsilon, R: tl.constexpr, BLOCK: tl.constexpr):
    matrix = tl.program_id(0)
    base = x_ptr + tl.load(layout_ptr + matrix)  # its first element, then its rows
    n = tl.load(layout_ptr + count + matrix)
    offsets = tl.arange(0, BLOCK)
    squares0 = tl.zeros([BLOCK], dtype=tl.float32)
    dots = tl.zeros([BLOCK], dtype=tl.float32)
    spare_dots = tl.zeros([BLOCK], dtype=tl.float32)  # s0 . c1, where column 0 is zero and s0 stands in for it
    start = 0
    while start < n:  # (while, not range: Triton 3.6's interpreter fails on range(runtime value))
        rows = start + offsets
        mask = rows < n
        c0 = tl.load(base + rows * R, mask=mask, other=0.0)
        squares0 += c0 * c0
        if R == 2:
            c1 = tl.load(base + rows * R + 1, mask=mask, other=0.0)
            dots += c0 * c1
            spare_dots += tl.where(mask, _spare(rows, 0), 0.0) * c1
        start += BLOCK
    sum0 = tl.sum(squares0, axis=0)
    spare0 = sum0 == 0  # column 0 is zero: its spare s0 / sqrt(n) instead
    root = tl.sqrt_rn(tl.maximum(n, 1).to(tl.float32))  # |s0| (an empty matrix's: 1, so that nothing divides by 0)
    norm0 = tl.where(spare0, root, tl.sqrt_rn(sum0) + epsilon)
    projection = tl.div_rn(tl.where(spare0, tl.sum(spare_dots, axis=0), tl.sum(dots, axis=0)), norm0)  # c1 . q0
    norm1 = 1.0
    spare1 = False
    if R == 2:
        squares1 = tl.zeros([BLOCK], dtype=tl.float32)
        spare_squares = tl.zeros([BLOCK], dtype=tl.float32)  # |s1 - (s1 . q0) q0|^2, where column 1 is zero then
        spare_projections = tl.zeros([BLOCK], dtype=tl.float32)  # s1 . q0
        start = 0
        while start < n:
            rows = start + offsets
            mask = rows < n
            q0 = _q0(base, rows, mask, spare0, norm0, R)
            q0 = tl.where(mask, q0, 0.0)
            c1 = tl.load(base + rows * R + 1, mask=mask, other=0.0) - projection * q0
            squares1 += c1 * c1
            spare_projections += tl.where(mask, _spare(rows, 1), 0.0) * q0
            start += BLOCK
        sum1 = tl.sum(squares1, axis=0)
        spare1 = sum1 == 0  # column 1 is zero once column 0 is projected out: its spare s1, so projected, instead
        spare_projection = tl.sum(spare_projections, axis=0)
        if spare1:
            start = 0
            while start < n:
                rows = start + offsets
                mask = rows < n
                q0 = _q0(base, rows, mask, spare0, norm0, R)
                s1 = tl.where(mask, _spare(rows, 1) - spare_projection * q0, 0.0)
                spare_squares += s1 * s1
                start += BLOCK
            norm1 = tl.where(tl.sum(spare_squares, axis=0) > 0, tl.sqrt_rn(tl.sum(spare_squares, axis=0)), 1.0)
        else:
            norm1 = tl.sqrt_rn(sum1) + epsilon
    start = 0
    while start < n:
        rows = start + offsets
        mask = rows < n
        q0 = _q0(base, rows, mask, spare0, norm0, R)
        if R == 2:  # (column 1 read before column 0 is written)
            if spare1:
                c1 = _spare(rows, 1) - spare_projection * q0
            else:
                c1 = tl.load(base + rows * R + 1, mask=mask, other=0.0) - projection * q0
            tl.store(base + rows * R + 1, tl.div_rn(c1, norm1), mask=mask)
        tl.store(base + rows * R, q0, mask=mask)
        start += BLOCK


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalizes in place the columns of ``matrix`` (float32, contiguous, n x r or a batch b x n x r, r <= 2),
    as Gram-Schmidt with ``epsilon`` added to each column's norm, a zero column replaced by its spare signs; returns
    it."""
    if matrix.dim() not in (2, 3):
        raise ValueError(f"orthogonalize: a matrix or a batch of matrices of 1 or 2 columns, got shape "
                         f"{tuple(matrix.shape)}")
    batch = matrix.shape[0] if matrix.dim() == 3 else 1
    orthogonalize_parts(matrix, (matrix.shape[-2],) * batch, matrix.shape[-1], epsilon)
    return matrix


def orthogonalize_parts(flat: torch.Tensor, rows: Sequence[int], rank: int, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalizes in place, in one launch, the columns of each matrix of ``flat`` (float32, contiguous): matrices
    of ``rows[i]`` x ``rank`` (r <= 2) back to back, covering it; as :func:`orthogonalize` does each. Returns
    ``flat``."""
    if rank not in (1, 2):
        raise ValueError(f"orthogonalize: matrices of 1 or 2 columns, got {rank}")
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        raise ValueError(f"orthogonalize: a contiguous float32 tensor, got {flat.dtype}"
                         f"{'' if flat.is_contiguous() else ', not contiguous'}")
    if sum(rows) * rank != flat.numel():
        raise ValueError(f"orthogonalize: matrices of {sum(rows)} rows of {rank} do not cover {flat.numel()} elements")
    if flat.numel():
        _gram_schmidt_kernel[(len(rows),)](flat, _layout(flat.device, tuple(rows), rank), len(rows), float(epsilon),
                                           R=rank, BLOCK=_BLOCK, enable_fp_fusion=False)
    return flat


@lru_cache(maxsize=256)
def _layout(device: torch.device, rows: tuple[int, ...], rank: int) -> torch.Tensor:
    """The kernel's table of ``rows``' matrices: each one's first element, then each one's rows (int64), on
    ``device``. A step's layouts repeat, so each is made once, its copy to a GPU from pinned memory: no wait."""
    starts = [0]
    for n in rows[:-1]:
        starts.append(starts[-1] + n * rank)
    return kept_table(starts + list(rows), device)
