"""Triton kernel for PowerSGD's orthogonalization (:func:`hvdcomp.methods.powersgd.orthogonalize`): Gram-Schmidt on
the r <= 2 columns of each matrix of a batch, or of every matrix of a step laid back to back in one buffer (a bucket's
Ps or Qs, of any numbers of rows), in one launch, where the PyTorch path takes 14 a matrix (a norm, a guard and a
division per column, a projection between them).

One program per matrix (n x r, float32, rows contiguous; where it starts and its n read from a small table of the
layout, made once per layout and device and kept), in four passes over its rows: the sums of squares and the
columns' dot product, what is left of column 1 along q0 once column 0 is projected out, the norm of column 1 with
both projected out, then the writes. Column 0 becomes q0 = c0 / |c0|, column 1 c1' = c1 - (c1 . q0) q0, with
(c1 . q0) = (c1 . c0) / |c0|, then c1'' = c1' - (c1' . q0) q0 (projected twice, as on the PyTorch path: where c1
lies nearly along c0, c1' is mostly rounding, in any direction), c1'' / |c1''|; each norm with epsilon added, as on
the PyTorch path. A zero column (column 1: once column 0 is projected out) is
replaced, as on the PyTorch path, by its spare vector of signs (:func:`hvdcomp.methods.powersgd.spare_columns`), so
projected (for column 1, an extra pass finds that norm) and normalized. The sums run in another order than PyTorch's,
so the results agree to float rounding, not bit for bit (but where column 1 lies along column 0 to rounding, its
direction is that rounding's, another on each path: both orthonormal, which is what the product P P^T M needs).
The matrices PowerSGD orthogonalizes are its factors P (n x r) and Q (m x r): small beside the gradient.

The products of a step whose matrices are several (a bucket's, a batch's) are one launch each, whatever the
matrices' shapes, where PyTorch takes one ``matmul`` a matrix (and on a GPU the host's time issuing them is the
step's time: about 100 us a matrix): P = M Q (:func:`products`), Q = M^T P (``transpose``), and the approximation
M_hat = P Q^T with the residual's update E <- M - M_hat / ranks fused in (:func:`approximations`). The matrices stay
where they are (each its own tensor: its address is in the launch's table), their factors and products lie back to
back in one buffer each, as the allreduces take them. Each program takes a block of one matrix's rows (or of its
columns, for M^T P) and sums in a fixed order, so every rank computes the same bits; the order is not PyTorch's, so
the results agree with its products to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import kept_table

_BLOCK = 1024
_ROWS = 32  # the products' tiles: 32 rows of a matrix by 128 / r columns (r rounded up to a power of 2)
#: the factors' largest rank the products take (orthogonalization here takes 1 or 2)
MAX_PRODUCT_RANK = 4
#: the products' largest matrix side (rows or columns): a program walks a whole side of its matrix alone (M Q a block
#: of rows across every column, M^T P a block of columns down every row), up to 4 MiB at this bound; a longer side,
#: whose few programs would each read more, takes PyTorch's matmul (:func:`hvdcomp.methods.powersgd.power_step`)
MAX_PRODUCT_SIDE = 1 << 14


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
        again = tl.zeros([BLOCK], dtype=tl.float32)  # (c1 - (c1 . q0) q0) . q0: rounding, projected out too
        spare_squares = tl.zeros([BLOCK], dtype=tl.float32)  # |s1 - (s1 . q0) q0|^2, where column 1 is zero then
        spare_projections = tl.zeros([BLOCK], dtype=tl.float32)  # s1 . q0
        start = 0
        while start < n:
            rows = start + offsets
            mask = rows < n
            q0 = _q0(base, rows, mask, spare0, norm0, R)
            q0 = tl.where(mask, q0, 0.0)
            c1 = tl.load(base + rows * R + 1, mask=mask, other=0.0) - projection * q0
            again += c1 * q0
            spare_projections += tl.where(mask, _spare(rows, 1), 0.0) * q0
            start += BLOCK
        projection_again = tl.sum(again, axis=0)
        start = 0
        while start < n:
            rows = start + offsets
            mask = rows < n
            q0 = tl.where(mask, _q0(base, rows, mask, spare0, norm0, R), 0.0)
            c1 = (tl.load(base + rows * R + 1, mask=mask, other=0.0) - projection * q0) - projection_again * q0
            squares1 += c1 * c1
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
                c1 = (tl.load(base + rows * R + 1, mask=mask, other=0.0) - projection * q0) - projection_again * q0
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


@triton.jit
def _matrix(table_ptr, count, matrix):
    """Matrix ``matrix`` of the table (:func:`_matrices_table`): its first element, rows and columns, and where its
    factor of m rows (Q), its factor of n rows (P) and its product (n x m) start in their buffers."""
    m_ptr = tl.load(table_ptr + matrix).to(tl.pointer_type(tl.float32))
    return (m_ptr, tl.load(table_ptr + count + matrix), tl.load(table_ptr + 2 * count + matrix),
            tl.load(table_ptr + 3 * count + matrix), tl.load(table_ptr + 4 * count + matrix),
            tl.load(table_ptr + 5 * count + matrix))


@triton.jit(do_not_specialize=["count"])
def _products_kernel(table_ptr, count, factor_ptr, out_ptr, R: tl.constexpr, RP: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """P = M Q: program (i, j) takes rows [j BLOCK_R, (j + 1) BLOCK_R) of matrix i, over its columns in blocks."""
    m_ptr, n, m, q_start, p_start, _ = _matrix(table_ptr, count, tl.program_id(0))
    first = tl.program_id(1) * BLOCK_R
    if first < n:
        rows = first + tl.arange(0, BLOCK_R).to(tl.int64)
        ranks = tl.arange(0, RP)
        acc = tl.zeros([BLOCK_R, RP], dtype=tl.float32)
        start = 0
        while start < m:  # (while, not range: Triton 3.6's interpreter fails on range(runtime value))
            columns = start + tl.arange(0, BLOCK_C)
            tile = tl.load(m_ptr + rows[:, None] * m + columns[None, :],
                           mask=(rows[:, None] < n) & (columns[None, :] < m), other=0.0)
            q = tl.load(factor_ptr + q_start + columns[:, None] * R + ranks[None, :],
                        mask=(columns[:, None] < m) & (ranks[None, :] < R), other=0.0)
            acc += tl.sum(tile[:, :, None] * q[None, :, :], axis=1)
            start += BLOCK_C
        tl.store(out_ptr + p_start + rows[:, None] * R + ranks[None, :], acc,
                 mask=(rows[:, None] < n) & (ranks[None, :] < R))


@triton.jit(do_not_specialize=["count"])
def _transposed_products_kernel(table_ptr, count, factor_ptr, out_ptr, R: tl.constexpr, RP: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Q = M^T P: program (i, j) takes columns [j BLOCK_C, (j + 1) BLOCK_C) of matrix i, over its rows in blocks."""
    m_ptr, n, m, q_start, p_start, _ = _matrix(table_ptr, count, tl.program_id(0))
    first = tl.program_id(1) * BLOCK_C
    if first < m:
        columns = first + tl.arange(0, BLOCK_C).to(tl.int64)
        ranks = tl.arange(0, RP)
        acc = tl.zeros([BLOCK_C, RP], dtype=tl.float32)
        start = 0
        while start < n:
            rows = start + tl.arange(0, BLOCK_R)
            tile = tl.load(m_ptr + rows[:, None] * m + columns[None, :],
                           mask=(rows[:, None] < n) & (columns[None, :] < m), other=0.0)
            p = tl.load(factor_ptr + p_start + rows[:, None] * R + ranks[None, :],
                        mask=(rows[:, None] < n) & (ranks[None, :] < R), other=0.0)
            acc += tl.sum(tile[:, :, None] * p[:, None, :], axis=0)
            start += BLOCK_R
        tl.store(out_ptr + q_start + columns[:, None] * R + ranks[None, :], acc,
                 mask=(columns[:, None] < m) & (ranks[None, :] < R))


@triton.jit(do_not_specialize=["count", "scale"])
def _approximations_kernel(table_ptr, count, p_ptr, q_ptr, out_ptr, scale, R: tl.constexpr, RP: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, RESIDUAL: tl.constexpr):
    """M_hat = P Q^T, and with RESIDUAL M <- M + scale M_hat: program (i, j) takes rows [j BLOCK_R, (j + 1) BLOCK_R)
    of matrix i, over its columns in blocks."""
    m_ptr, n, m, q_start, p_start, out_start = _matrix(table_ptr, count, tl.program_id(0))
    first = tl.program_id(1) * BLOCK_R
    if first < n:
        rows = first + tl.arange(0, BLOCK_R).to(tl.int64)
        ranks = tl.arange(0, RP)
        p = tl.load(p_ptr + p_start + rows[:, None] * R + ranks[None, :],
                    mask=(rows[:, None] < n) & (ranks[None, :] < R), other=0.0)
        start = 0
        while start < m:
            columns = start + tl.arange(0, BLOCK_C)
            q = tl.load(q_ptr + q_start + columns[:, None] * R + ranks[None, :],
                        mask=(columns[:, None] < m) & (ranks[None, :] < R), other=0.0)
            approximation = tl.sum(p[:, None, :] * q[None, :, :], axis=2)
            at = rows[:, None] * m + columns[None, :]
            mask = (rows[:, None] < n) & (columns[None, :] < m)
            tl.store(out_ptr + out_start + at, approximation, mask=mask)
            if RESIDUAL:
                matrix = tl.load(m_ptr + at, mask=mask, other=0.0)
                tl.store(m_ptr + at, matrix + scale * approximation, mask=mask)
            start += BLOCK_C


def _checked(matrices: Sequence[torch.Tensor], factors: Sequence[torch.Tensor], rank: int, what: str) -> None:
    """Refuses, naming what is wrong, a rank past MAX_PRODUCT_RANK, a matrix that is not a contiguous float32 matrix on
    the factors' device with sides up to MAX_PRODUCT_SIDE, and factors that are not contiguous float32."""
    if not 1 <= rank <= MAX_PRODUCT_RANK:
        raise ValueError(f"{what}: factors of 1 to {MAX_PRODUCT_RANK} columns, got {rank}")
    device = factors[0].device
    for matrix in matrices:
        if max(matrix.shape, default=0) > MAX_PRODUCT_SIDE:
            raise ValueError(f"{what}: matrices of at most {MAX_PRODUCT_SIDE} rows and columns, got shape "
                             f"{tuple(matrix.shape)}")
        if matrix.dim() != 2 or matrix.dtype != torch.float32 or not matrix.is_contiguous() or matrix.device != device:
            raise ValueError(f"{what}: contiguous float32 matrices on {device}, got {matrix.dtype} of shape "
                             f"{tuple(matrix.shape)} on {matrix.device}"
                             f"{'' if matrix.is_contiguous() else ', not contiguous'}")
    for tensor in factors:
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device != device:
            raise ValueError(f"{what}: factors in a contiguous float32 tensor on {device}, got {tensor.dtype} on "
                             f"{tensor.device}")


def _launch(kernel: triton.JITFunction, matrices: Sequence[torch.Tensor], rank: int, blocks: int, *args: object,
            **constants: object) -> None:
    """``kernel`` over ``matrices``, one program per block of ``blocks`` of each matrix's rows (``blocks`` 0) or
    columns (1) and one row of the grid per matrix, with the tiles the rank gives."""
    padded = triton.next_power_of_2(rank)
    columns = max(16, 128 // padded)
    largest = max(matrix.shape[blocks] for matrix in matrices)
    block = _ROWS if blocks == 0 else columns
    if largest:
        kernel[(len(matrices), triton.cdiv(largest, block))](
            _matrices_table(matrices[0].device, tuple((m.data_ptr(), *m.shape) for m in matrices), rank),
            len(matrices), *args, R=rank, RP=padded, BLOCK_R=_ROWS, BLOCK_C=columns, enable_fp_fusion=False,
            **constants)


def products(matrices: Sequence[torch.Tensor], factors: torch.Tensor, rank: int,
             transpose: bool = False) -> torch.Tensor:
    """P_i = M_i Q_i for every matrix M_i (n_i x m_i, float32, contiguous) of ``matrices``, their Q_i (m_i x
    ``rank``) back to back in ``factors``, in one launch; with ``transpose``, Q_i = M_i^T P_i, their P_i (n_i x
    ``rank``) back to back in ``factors``. Returns the products back to back in a new buffer."""
    what = "products"
    _checked(matrices, [factors], rank, what)
    given, made = (1, 0) if not transpose else (0, 1)
    if factors.numel() != sum(m.shape[given] for m in matrices) * rank:
        raise ValueError(f"{what}: the factors ({rank} columns) of {len(matrices)} matrices hold "
                         f"{sum(m.shape[given] for m in matrices) * rank} elements, got {factors.numel()}")
    out = factors.new_empty(sum(m.shape[made] for m in matrices) * rank)
    if matrices:
        _launch(_transposed_products_kernel if transpose else _products_kernel, matrices, rank, made, factors, out)
    return out


def approximations(matrices: Sequence[torch.Tensor], ps: torch.Tensor, qs: torch.Tensor, rank: int,
                   residual_scale: float | None = None) -> torch.Tensor:
    """M_hat_i = P_i Q_i^T for every matrix M_i (n_i x m_i, float32, contiguous) of ``matrices``, their P_i (n_i x
    ``rank``) back to back in ``ps``, their Q_i (m_i x ``rank``) in ``qs``, in one launch; returns them back to back
    in a new buffer. With ``residual_scale`` s, each M_i <- M_i + s M_hat_i in the same launch (PowerSGD's residual,
    s = -1 / ranks)."""
    what = "approximations"
    _checked(matrices, [ps, qs], rank, what)
    for factors, dim, name in ((ps, 0, "ps"), (qs, 1, "qs")):
        if factors.numel() != sum(m.shape[dim] for m in matrices) * rank:
            raise ValueError(f"{what}: the {name} ({rank} columns) of {len(matrices)} matrices hold "
                             f"{sum(m.shape[dim] for m in matrices) * rank} elements, got {factors.numel()}")
    out = ps.new_empty(sum(m.numel() for m in matrices))
    if matrices:
        _launch(_approximations_kernel, matrices, rank, 0, ps, qs, out, 0.0 if residual_scale is None
                else float(residual_scale), RESIDUAL=residual_scale is not None)
    return out


@lru_cache(maxsize=256)
def _matrices_table(device: torch.device, matrices: tuple[tuple[int, int, int], ...], rank: int) -> torch.Tensor:
    """The products' table of ``matrices`` (address, rows, columns each): those three, then where each one's Q, P and
    product start in their buffers (back to back), six rows of int64 on ``device``. A bucket's matrices (its members'
    residuals) are the same tensors every step, so its table is made once and kept; a batch's stack, or gradients
    copied to float32, are new tensors each step, whose table is made again unless they land where the last did."""
    starts, q, p, product = [], 0, 0, 0
    for _, n, m in matrices:
        starts.append((q, p, product))
        q, p, product = q + m * rank, p + n * rank, product + n * m
    fields = range(3)
    return kept_table([entry[f] for f in fields for entry in matrices] + [entry[f] for f in fields for entry in starts],
                      device)
