"""Triton kernels for the bucketed quantizers (:mod:`hvdcomp.quantization`): QSGD, ORQ, BinGrad, 1-bit SGD and the
sign family, the GPU counterparts of ``hvdcomp/kernels/quant.cpp`` with the same arguments, wire format and draws.

Each program holds ``ROWS`` whole buckets in registers (a [ROWS, BUCKET] block, BUCKET the bucket size rounded up to
a power of two): it computes each bucket's statistics and levels there, then draws, rounds and packs the codes and
writes them with the bucket's table, so the gradient is read once and every step after the load stays on chip. ORQ's
level search (coordinate descent on the optimality condition over ``bins`` bins per bucket, as ``orq_levels`` in
quant.cpp) runs on the block too: the count and the sum of the values below a bin are reductions over the bucket's
row, and the bin holding the r-th smallest value is found by bisection on such counts. :func:`decode_sum` decodes
and adds every rank's payload, in rank order, in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import load_codes, power_scale, random_bits, seed_key, store_packed, uniforms
from hvdcomp.kernels.gpu.ternary import ABS_MEAN, STATS_BLOCK, abs_mean, finish_moments

#: the largest bucket a program holds in registers; larger buckets take the PyTorch path
MAX_BUCKET = 8192
_ELEMENTS_PER_PROGRAM = 2048
_DECODE_BLOCK = 2048
_SIGN_GROUPS = STATS_BLOCK // 8  # bytes of signs a program packs: its block is a block of the moments
_KIND_ORQ, _KIND_QSGD_L2, _KIND_QSGD_MAX = 0, 1, 2
_KIND_BINGRAD, _KIND_ONEBIT = 0, 1
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
#: the max |x| (2^64) from which BinGrad and 1-bit SGD take a bucket in scaled units (``_binary_kernel``)
_SCALED_FROM = tl.constexpr(18446744073709551616.0)
_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)  # 2^-126


def _check_bucket(bucket: int, what: str) -> None:
    if bucket < 8 or bucket % 8:
        raise ValueError(f"{what}: bucket must be a positive multiple of 8, got {bucket}")
    if bucket > MAX_BUCKET:
        raise ValueError(f"{what}: buckets of up to {MAX_BUCKET} elements fit a program's registers, got {bucket}")


def _layout(n: int, bucket: int) -> tuple[int, int, int]:
    """(buckets, BLOCK: the bucket padded to a power of two, ROWS: buckets per program)."""
    block = triton.next_power_of_2(bucket)
    return -(-n // bucket), block, max(1, _ELEMENTS_PER_PROGRAM // block)


@triton.jit
def _bucket_block(x_ptr, n, bucket, buckets, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's buckets: (first row, row indices [ROWS], values [ROWS, BLOCK] (0 outside), valid mask, count
    per row)."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    rows = first + tl.arange(0, ROWS)
    columns = tl.arange(0, BLOCK)
    elements = rows[:, None] * bucket + columns[None, :]
    valid = (columns[None, :] < bucket) & (elements < n) & (rows[:, None] < buckets)
    x = tl.load(x_ptr + elements, mask=valid, other=0.0)
    return first, rows, x, valid, tl.sum(valid.to(tl.int32), axis=1)


@triton.jit
def _column(matrix, index, j):
    """matrix[:, j] of a small [ROWS, L] register tensor (``index`` the column numbers [L])."""
    return tl.sum(tl.where(index[None, :] == j, matrix, 0), axis=1)


@triton.jit
def _set_column(matrix, index, j, values, where):
    return tl.where((index[None, :] == j) & where[:, None], values[:, None], matrix)


@triton.jit
def _below(bins, x, bound):
    """(count, sum) of the values whose bin is below ``bound`` [ROWS]; the padding's bin is past every bound."""
    under = bins < bound[:, None]
    return tl.sum(under.to(tl.int32), axis=1), tl.sum(tl.where(under, x, 0.0), axis=1)


@triton.jit
def _bin_mean(bins, x, b):
    inside = bins == b[:, None]
    return tl.div_rn(tl.sum(tl.where(inside, x, 0.0), axis=1),
                     tl.maximum(tl.sum(inside.to(tl.int32), axis=1), 1).to(tl.float32))


@triton.jit
def _orq_levels(x, valid, count, low, high, iterations, NBINS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                LEVELS: tl.constexpr, ROWS: tl.constexpr):
    """ORQ's levels [ROWS, LEVELS] of each row (``orq_levels`` in quant.cpp): uniform from min to max, then each
    interior level on the bin that the optimality condition #{g in [l_j, l_{j+1})} = K_j picks, sweep after sweep
    (Gauss-Seidel, as the CPU) until no level moves or ``iterations`` sweeps are done. Level j is the mean of its
    bin; ``index`` holds its bin and ``weight``/``mass`` the count and sum of the values in lower bins."""
    TOP: tl.constexpr = LEVELS - 1
    lcol = tl.arange(0, LEVELS)
    levels = low[:, None] + tl.div_rn((high - low)[:, None] * lcol[None, :].to(tl.float32), TOP * 1.0)
    levels = tl.where(lcol[None, :] == 0, low[:, None], tl.where(lcol[None, :] == TOP, high[:, None], levels))
    spread = high > low
    if LEVELS > 2:
        scale = tl.div_rn(tl.full([ROWS], NBINS, tl.float32), high - low)
        position = (x - low[:, None]) * scale[:, None]
        bins = tl.where(position >= 0, tl.where(position < NBINS, position.to(tl.int32), NBINS - 1), 0)
        bins = tl.where(valid, bins, NBINS)  # padding: past every bin
        total = tl.sum(x, axis=1)
        index = tl.where(lcol[None, :] == TOP, NBINS, 0) + tl.zeros([ROWS, LEVELS], dtype=tl.int32)
        weight = tl.where(lcol[None, :] == TOP, count[:, None], 0)
        mass = tl.where(lcol[None, :] == TOP, total[:, None], 0.0)
        searching = spread & (iterations > 0)
        for j in range(1, TOP):  # a loop, not unrolled: at 5 bits unrolled, ptxas took minutes and GBs
            # the first non-empty bin at or above the uniform level's
            start = _column(levels, lcol, j)
            first = (start - low) * scale
            first = tl.where(first >= 0, tl.where(first < NBINS, first.to(tl.int32), NBINS - 1), 0)
            b = tl.min(tl.where(bins >= first[:, None], bins, NBINS), axis=1)
            w, m = _below(bins, x, b)
            levels = _set_column(levels, lcol, j, _bin_mean(bins, x, b), searching)
            index = _set_column(index, lcol, j, b, searching)
            weight = _set_column(weight, lcol, j, w, searching)
            mass = _set_column(mass, lcol, j, m, searching)
        sweep = 0
        moved = tl.max(searching.to(tl.int32))
        while (sweep < iterations) & (moved > 0):
            moved_rows = tl.zeros([ROWS], dtype=tl.int1)
            for j in range(1, TOP):
                first = _column(index, lcol, j - 1)
                end = _column(index, lcol, j + 1)
                lower = _column(levels, lcol, j - 1)
                upper = _column(levels, lcol, j + 1)
                w_first = _column(weight, lcol, j - 1)
                w_end = _column(weight, lcol, j + 1)
                between = w_end - w_first
                k = tl.div_rn(_column(mass, lcol, j + 1) - _column(mass, lcol, j - 1) - lower * between.to(tl.float32),
                              tl.where(upper > lower, upper - lower, 1.0))
                # the largest non-empty bin i in [first, end) with weight(i) < w_end - k is the bin of the value
                # of rank r = ceil(w_end - k) - 1 (0-based; at most w_end - 1), or ``first`` when r < w_first
                # (clamped to [0, w_end] as a float: a NaN or infinite k, from bin sums beyond float32, then converts
                # as the CPU kernel's search takes it, where converting it would saturate on a GPU, wrap elsewhere)
                rank = w_end.to(tl.float32) - k
                rank = tl.minimum(tl.maximum(tl.where(rank == rank, rank, 0.0), 0.0), w_end.to(tl.float32))
                r = tl.ceil(rank).to(tl.int32) - 1
                lo = first
                hi = end - 1
                for _ in tl.static_range(SEARCH_STEPS):  # bisection: the first bin with > r values at or below it
                    middle = (lo + hi) // 2
                    above = tl.sum((bins <= middle[:, None]).to(tl.int32), axis=1) > r
                    hi = tl.where(above, middle, hi)
                    lo = tl.where(above, lo, middle + 1)
                i = tl.where(r >= w_first, lo, first)
                move = searching & (between > 0) & (upper > lower) & (i != _column(index, lcol, j))
                w, m = _below(bins, x, i)
                levels = _set_column(levels, lcol, j, _bin_mean(bins, x, i), move)
                index = _set_column(index, lcol, j, i, move)
                weight = _set_column(weight, lcol, j, w, move)
                mass = _set_column(mass, lcol, j, m, move)
                moved_rows = moved_rows | move
            moved = tl.max(moved_rows.to(tl.int32))
            sweep += 1
    return levels


@triton.jit(do_not_specialize=["n", "nbytes", "buckets", "key", "iterations"])
def _levels_kernel(x_ptr, tables_ptr, packed_ptr, n, nbytes, bucket, buckets, key, iterations,
                   KIND: tl.constexpr, BITS: tl.constexpr, NBINS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr):
    LEVELS: tl.constexpr = 1 << BITS
    first, rows, x, valid, count = _bucket_block(x_ptr, n, bucket, buckets, ROWS, BLOCK)
    u = uniforms(key, first * (bucket // 2), ROWS, BLOCK, bucket // 2)
    live = rows < buckets
    if KIND == 0:  # ORQ: the levels, then stochastic rounding between the two around each value
        low = tl.min(tl.where(valid, x, float("inf")), axis=1)
        high = tl.max(tl.where(valid, x, float("-inf")), axis=1)
        levels = _orq_levels(x, valid, count, low, high, iterations, NBINS, SEARCH_STEPS, LEVELS, ROWS)
        lcol = tl.arange(0, LEVELS)
        tl.store(tables_ptr + rows[:, None] * LEVELS + lcol[None, :], levels, mask=live[:, None])
        tl.debug_barrier()  # the table is read back below by other threads of this program
        table = tables_ptr + rows[:, None] * LEVELS
        i = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
        for s in tl.static_range(BITS):  # bisection: the largest i with levels[i] <= x (levels[0] is the minimum)
            step = LEVELS >> (s + 1)
            i += step * (tl.load(table + i + step, mask=valid, other=float("inf")) <= x).to(tl.int32)
        i = tl.minimum(i, LEVELS - 2)
        below = tl.load(table + i, mask=valid, other=0.0)
        gap = tl.load(table + i + 1, mask=valid, other=0.0) - below
        codes = i + (u * gap < x - below).to(tl.int32)
    else:  # QSGD: one norm per bucket scales the grid of levels l / s, l in [-s, s] (code s + l)
        S: tl.constexpr = (LEVELS >> 1) - 1
        if KIND == 1:
            norm = tl.sqrt_rn(tl.sum(x * x, axis=1))
            top = tl.max(tl.abs(x), axis=1)
            # squares over float32 (|x| > ~1.8e19) or below its normal range (every |x| < 2^-60, not all 0): those
            # rows again in float64, as the CPU kernel
            redo = (norm == float("inf")) | ((top > 0) & (top < 8.673617379884035e-19))
            if tl.max(redo.to(tl.int32)) > 0:
                wide = x.to(tl.float64)
                again = tl.minimum(tl.sqrt(tl.sum(wide * wide, axis=1)), _FLOAT32_MAX).to(tl.float32)
                norm = tl.where(redo, again, norm)  # at most float32's largest: >= every |x|
        else:
            norm = tl.max(tl.abs(x), axis=1)
        tl.store(tables_ptr + rows, norm, mask=live)
        inverse = tl.where(norm == 0, 0.0, tl.div_rn(tl.full([ROWS], S, tl.float32), norm))
        inverse = tl.where(inverse < float("inf"), inverse, 0.0)  # a subnormal norm's overflow: zeros, as the CPU's
        ratio = tl.abs(x) * inverse[:, None]
        ratio = tl.where(ratio <= S, ratio, S)  # in [0, s]: a NaN or infinite input at s, as on the CPU
        floor = tl.minimum(ratio.to(tl.int32), S - 1)
        level = floor + (u < ratio - floor.to(tl.float32)).to(tl.int32)
        codes = S + level - 2 * level * (x < 0).to(tl.int32)
    codes = tl.where(valid, codes, 0)
    store_packed(packed_ptr, codes, first * (bucket // 8), ROWS, BLOCK, bucket // 8, (count[:, None] + 7) // 8,
                 nbytes, BITS)


def quantize_levels(x: torch.Tensor, bucket: int, bits: int, kind: int, iterations: int, bins: int,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_levels`` of the CPU kernels on any device Triton runs on: (tables, packed) of a flat float32 tensor.
    kind 0 is ORQ (tables [buckets, 2^bits], ``iterations`` sweeps over ``bins`` bins), 1 and 2 QSGD with the L2 or
    max norm (tables [buckets, 1], s = 2^(bits - 1) - 1)."""
    _check_bucket(bucket, "quantize_levels")
    if not 1 <= bits <= 8 or kind not in (_KIND_ORQ, _KIND_QSGD_L2, _KIND_QSGD_MAX) or (kind != _KIND_ORQ and bits < 2):
        raise ValueError(f"quantize_levels: kind {kind} with {bits} bits (ORQ: 1 to 8, QSGD: 2 to 8)")
    n = x.numel()
    buckets, block, rows = _layout(n, bucket)
    nbytes = -(-n * bits // 8)
    tables = torch.empty(buckets, (1 << bits) if kind == _KIND_ORQ else 1, dtype=torch.float32, device=x.device)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        _levels_kernel[(triton.cdiv(buckets, rows),)](
            x, tables, packed, n, nbytes, bucket, buckets, seed_key(seed), iterations, KIND=kind, BITS=bits,
            NBINS=bins, SEARCH_STEPS=max(1, (bins - 1).bit_length()), ROWS=rows, BLOCK=block,
            enable_fp_fusion=False)
    return tables, packed


@triton.jit(do_not_specialize=["n", "nbytes", "buckets", "iterations"])
def _binary_kernel(x_ptr, tables_ptr, packed_ptr, n, nbytes, bucket, buckets, iterations, KIND: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr):
    first, rows, x, valid, count = _bucket_block(x_ptr, n, bucket, buckets, ROWS, BLOCK)
    # A bucket whose finite max |x| is 2^64 or more is taken times a power of two that brings the max below 2^66
    # (float32's sums of x would overflow from |x| ~ 1e36, where the CPU kernel sums in float64): its levels, threshold
    # and partitions are those of x in these units, each level divided back at the store. That is exact but for
    # values over 2^190 below the max, which would fall below float32's normal range: they are taken as +-2^-126,
    # their signs (1-bit SGD's codes) kept. Other buckets are taken as they are (scale 1): the bits of unscaled sums.
    top = tl.max(tl.abs(x), axis=1)
    scale = tl.where((top >= _SCALED_FROM) & (top <= _FLOAT32_MAX), power_scale(top) * _SCALED_FROM, 1.0)
    scaled = x * scale[:, None]
    lost = (scale < 1.0)[:, None] & (tl.abs(scaled) < _MIN_NORMAL) & (x != 0)  # (a subnormal x unscaled stays)
    x = tl.where(lost, tl.where(x < 0, -_MIN_NORMAL, _MIN_NORMAL), scaled)
    if KIND == 0:  # BinGrad: the 2-level Lloyd-Max fixed point from the mean, at most ``iterations`` partitions
        threshold = tl.div_rn(tl.sum(x, axis=1), tl.maximum(count, 1).to(tl.float32))
    else:  # 1-bit SGD: the sign, levels the means of the negative and the non-negative values
        threshold = tl.zeros([ROWS], dtype=tl.float32)
    low = tl.zeros([ROWS], dtype=tl.float32)
    high = tl.zeros([ROWS], dtype=tl.float32)
    previous = tl.full([ROWS], -1, dtype=tl.int32)
    active = rows < buckets
    sweep = 0
    while tl.max(active.to(tl.int32)) > 0:
        under = (x < threshold[:, None]) & valid
        below = tl.sum(under.to(tl.int32), axis=1)
        above = count - below
        empty = threshold if KIND == 0 else tl.zeros([ROWS], dtype=tl.float32)  # an empty side's level
        sum_under = tl.sum(tl.where(under, x, 0.0), axis=1)
        # The upper side is the rest of the bucket, a NaN included (the padding is 0), as the CPU kernel takes it
        # (the bucket's sum less the lower side's); which makes it NaN also where the lower side's sum is -Inf.
        sum_over = tl.where(sum_under > float("-inf"), tl.sum(tl.where(under, 0.0, x), axis=1), float("nan"))
        low = tl.where(active, tl.where(below > 0, tl.div_rn(sum_under, tl.maximum(below, 1).to(tl.float32)), empty),
                       low)
        high = tl.where(active, tl.where(above > 0, tl.div_rn(sum_over, tl.maximum(above, 1).to(tl.float32)), empty),
                        high)
        # the sets {g < t} are nested, so an unchanged count is an unchanged partition: a fixed point
        go_on = active & (below != previous) & (sweep + 1 < iterations)
        previous = below
        threshold = tl.where(go_on, 0.5 * (low + high), threshold)
        active = go_on
        sweep += 1
    live = rows < buckets
    tl.store(tables_ptr + rows * 2, tl.where(scale == 1.0, low, tl.div_rn(low, scale)), mask=live)
    tl.store(tables_ptr + rows * 2 + 1, tl.where(scale == 1.0, high, tl.div_rn(high, scale)), mask=live)
    codes = tl.where(valid & (x >= threshold[:, None]), 1, 0)
    store_packed(packed_ptr, codes, first * (bucket // 8), ROWS, BLOCK, bucket // 8, (count[:, None] + 7) // 8,
                 nbytes, 1)


def quantize_binary(x: torch.Tensor, bucket: int, kind: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_binary`` of the CPU kernels: (tables [buckets, 2], 1-bit codes) of a flat float32 tensor; kind 0
    is BinGrad (``iterations`` partitions at most), 1 is 1-bit SGD."""
    _check_bucket(bucket, "quantize_binary")
    if kind not in (_KIND_BINGRAD, _KIND_ONEBIT) or (kind == _KIND_BINGRAD and iterations < 1):
        raise ValueError(f"quantize_binary: kind must be 0 (BinGrad, iterations >= 1) or 1 (1-bit SGD); got kind "
                         f"{kind}, iterations {iterations}")
    n = x.numel()
    buckets, block, rows = _layout(n, bucket)
    nbytes = -(-n // 8)
    tables = torch.empty(buckets, 2, dtype=torch.float32, device=x.device)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        _binary_kernel[(triton.cdiv(buckets, rows),)](x, tables, packed, n, nbytes, bucket, buckets,
                                                      1 if kind == _KIND_ONEBIT else iterations, KIND=kind,
                                                      ROWS=rows, BLOCK=block, enable_fp_fusion=False)
    return tables, packed


@triton.jit(do_not_specialize=["n", "key"])
def _signs_kernel(x_ptr, packed_ptr, partial_ptr, n, key, COIN: tl.constexpr, MOMENTS: tl.constexpr,
                  GROUPS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    groups = pid * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, 8)
    elements = groups[:, None] * 8 + lane[None, :]
    x = tl.load(x_ptr + elements, mask=elements < n, other=1.0)
    if MOMENTS:  # the block's max |x| and scaled sum |x| in its row of the moments (ternary._moments_kernel's)
        magnitude = tl.abs(tl.reshape(tl.where(elements < n, x, 0.0), [GROUPS * 8]))
        top = tl.max(magnitude)
        tl.store(partial_ptr + pid * 4 + 2, top)
        tl.store(partial_ptr + pid * 4 + 3, tl.sum(magnitude * power_scale(top)))
    if COIN:  # an exact zero votes on a fair coin: bit j of splitmix64(key + group)
        coins = ((random_bits(key, groups)[:, None] >> lane[None, :].to(tl.uint64)) & 1).to(tl.int1)
    else:
        coins = tl.full([GROUPS, 8], 1, dtype=tl.int1)
    bits = ((x > 0) | ((x == 0) & coins)) & (elements < n)
    byte = tl.sum(bits.to(tl.int32) << lane[None, :], axis=1).to(tl.uint8)
    tl.store(packed_ptr + groups, byte, mask=groups * 8 < n)


def pack_signs(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``pack_signs`` of the CPU kernels: 1 bit per element, 1 for positive; an exact zero takes a fair coin from
    ``seed`` (positive when seed < 0)."""
    n = x.numel()
    packed = torch.empty(-(-n // 8), dtype=torch.uint8, device=x.device)
    if n:
        _signs_kernel[(triton.cdiv(packed.numel(), _SIGN_GROUPS),)](x, packed, packed, n, seed_key(max(seed, 0)),
                                                                    COIN=seed >= 0, MOMENTS=False, GROUPS=_SIGN_GROUPS)
    return packed


def pack_signs_abs_mean(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sign family's payload, (||x||_1 / n as float32 [1, 1], :func:`pack_signs`), in two launches where
    ``abs_mean`` and ``pack_signs`` take three: the pass that packs the signs also sums each block's magnitudes."""
    n = x.numel()
    if n == 0:
        return abs_mean(x), pack_signs(x, seed)
    packed = torch.empty(-(-n // 8), dtype=torch.uint8, device=x.device)
    blocks = triton.cdiv(packed.numel(), _SIGN_GROUPS)
    buffer = torch.empty(1 + 4 * blocks, dtype=torch.float32, device=x.device)
    _signs_kernel[(blocks,)](x, packed, buffer[1:], n, seed_key(max(seed, 0)), COIN=seed >= 0, MOMENTS=True,
                             GROUPS=_SIGN_GROUPS, enable_fp_fusion=False)
    return finish_moments(buffer, blocks, n, ABS_MEAN, 0.0, 1).view(1, 1), packed


@triton.jit(do_not_specialize=["ranks", "n", "nbytes", "packed_stride", "tables_stride"])
def _decode_kernel(packed_ptr, tables_ptr, grid_ptr, out_ptr, ranks, n, nbytes, packed_stride, tables_stride, bucket,
                   BITS: tl.constexpr, GRID: tl.constexpr, SUBTRACT: tl.constexpr, BLOCK: tl.constexpr):
    elements = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = elements < n
    row = elements // bucket
    width: tl.constexpr = 1 if GRID else 1 << BITS
    total = tl.zeros([BLOCK], dtype=tl.float32)
    rank = 0
    while rank < ranks:  # in rank order, the same bits on every rank (while: see ternary._finish_kernel)
        codes = load_codes(packed_ptr + rank.to(tl.int64) * packed_stride, elements, mask, nbytes, BITS).to(tl.int32)
        entry = tables_ptr + rank.to(tl.int64) * tables_stride + row * width
        if GRID:
            value = tl.load(entry, mask=mask, other=0.0) * tl.load(grid_ptr + codes, mask=mask, other=0.0)
        else:
            value = tl.load(entry + codes, mask=mask, other=0.0)
        total += value
        rank += 1
    if SUBTRACT:  # error feedback's residual, in place (one payload: total is its value, up to a zero's sign)
        total = tl.load(out_ptr + elements, mask=mask, other=0.0) - total
    tl.store(out_ptr + elements, total, mask=mask)


def _decode(packed: torch.Tensor, tables: torch.Tensor, grid: torch.Tensor, bits: int, bucket: int, n: int,
            out: torch.Tensor, subtract: bool, what: str) -> None:
    """Decodes the payloads into ``out``: their sum, or with ``subtract`` (one payload) ``out`` minus it."""
    ranks, nbytes = packed.shape
    buckets = -(-n // bucket) if n else 0
    width = 1 if grid.numel() else 1 << bits
    rows_contiguous = (nbytes < 2 or packed.stride(1) == 1) and (width < 2 or tables.stride(2) == 1) \
        and (buckets < 2 or tables.stride(1) == width)
    if nbytes != -(-n * bits // 8) or tuple(tables.shape) != (ranks, buckets, width) or not rows_contiguous:
        raise ValueError(f"{what}: payloads uint8 {tuple(packed.shape)} and tables {tuple(tables.shape)} do not "
                         f"hold {n} elements of {bits} bits in buckets of {bucket} (expected [{ranks}, "
                         f"{-(-n * bits // 8)}] and [{ranks}, {buckets}, {width}], each rank's row contiguous)")
    if n:
        block = min(_DECODE_BLOCK, max(triton.next_power_of_2(n), 16))
        steps = grid if grid.numel() else tables  # (not read without a grid: any valid pointer)
        _decode_kernel[(triton.cdiv(n, block),)](packed, tables, steps, out, ranks, n, nbytes, packed.stride(0),
                                                 tables.stride(0), bucket, BITS=bits, GRID=grid.numel() > 0,
                                                 SUBTRACT=subtract, BLOCK=block,
                                                 enable_fp_fusion=False)


def decode_sum(packed: torch.Tensor, tables: torch.Tensor, grid: torch.Tensor, bits: int, bucket: int,
               n: int) -> torch.Tensor:
    """``decode_sum`` of the CPU kernels: the sum over R payloads (``packed`` uint8 [R, nbytes], ``tables`` float32
    [R, buckets, T], each rank's row contiguous, the rows at any stride) of their decoded values, float32 [n], added
    in rank order. An empty ``grid`` means the tables hold the levels (T = 2^bits); else value =
    tables[r, bucket, 0] * grid[code]."""
    out = torch.empty(n, dtype=torch.float32, device=packed.device)
    _decode(packed, tables, grid, bits, bucket, n, out, False, "decode_sum")
    return out


def decode_subtract(residual: torch.Tensor, packed: torch.Tensor, tables: torch.Tensor, grid: torch.Tensor, bits: int,
                    bucket: int) -> None:
    """``decode_subtract`` of the CPU kernels: error feedback's ``residual -= decode(payload)`` in place, in one
    launch, for one payload (``packed`` [1, nbytes], ``tables`` [1, buckets, T]) and a float32 contiguous
    ``residual``."""
    if packed.shape[0] != 1 or residual.dtype != torch.float32 or not residual.is_contiguous():
        raise ValueError(f"decode_subtract: subtracts one payload from a float32 contiguous residual, got "
                         f"{packed.shape[0]} payloads and a {residual.dtype} residual")
    _decode(packed, tables, grid, bits, bucket, residual.numel(), residual, True, "decode_subtract")


@triton.jit(do_not_specialize=["ranks", "n", "nbytes", "packed_stride", "scales_stride"])
def _vote_kernel(packed_ptr, scales_ptr, out_ptr, ranks, n, nbytes, packed_stride, scales_stride,
                 BLOCK: tl.constexpr):
    elements = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = elements < n
    votes = tl.zeros([BLOCK], dtype=tl.int32)
    scale = tl.zeros([1], dtype=tl.float32)
    rank = 0
    while rank < ranks:  # the scales in rank order, as the CPU kernel adds them
        bits = load_codes(packed_ptr + rank.to(tl.int64) * packed_stride, elements, mask, nbytes, 1).to(tl.int32)
        votes += 2 * bits - 1
        scale += tl.load(scales_ptr + rank.to(tl.int64) * scales_stride + tl.zeros([1], dtype=tl.int64))
        rank += 1
    sign = tl.where(votes > 0, 1.0, tl.where(votes < 0, -1.0, 0.0))
    tl.store(out_ptr + elements, sign * scale, mask=mask)


def sign_vote(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """``sign_vote`` of the CPU kernels: signSGD's majority vote over R ranks' signs (``packed`` uint8
    [R, ceil(n / 8)], rows at any stride; bit 1: positive), sign(sum_r (2 b_r - 1)) times the ranks' ``scales``
    (float32 [R], any stride) added in rank order, in one launch; a tie gives 0. float32 [n]."""
    ranks, nbytes = packed.shape
    if nbytes != -(-n // 8) or (nbytes > 1 and packed.stride(1) != 1) or scales.dim() != 1 \
            or scales.numel() != ranks or scales.dtype != torch.float32:
        raise ValueError(f"sign_vote: {ranks} payloads uint8 {tuple(packed.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} do not hold {n} signs (expected [{ranks}, {-(-n // 8)}] with "
                         f"contiguous rows and float32 [{ranks}])")
    out = torch.empty(n, dtype=torch.float32, device=packed.device)
    if n:
        block = min(_DECODE_BLOCK, max(triton.next_power_of_2(n), 16))
        _vote_kernel[(triton.cdiv(n, block),)](packed, scales, out, ranks, n, nbytes, packed.stride(0),
                                               scales.stride(0), BLOCK=block, enable_fp_fusion=False)
    return out
