"""What the Triton kernels share: the counter-based generator of the CPU kernels, ported, and the b-bit packing.

Draws are splitmix64 of a key (the seed times a constant, as ``seed_key`` in ``hvdcomp/kernels/quant.cpp``) plus a
counter: element i takes the low (i even) or high (i odd) 32 bits of splitmix64(key + i // 2), and a uniform in
[0, 1) is its top 24 bits times 2^-24, exactly as ``uniform24`` in ``common.h``. The CPU and GPU paths therefore
draw the same numbers for the same seed, whatever the launch grid: their codes are bit-identical wherever their
statistics are.

Packing follows :mod:`hvdcomp.packing`: codes of ``bits`` bits form a little-endian bit stream, so 8 codes fill
exactly ``bits`` bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SEED_MULTIPLIER = 0xD1B54A32D192ED03
_MASK64 = (1 << 64) - 1


def seed_key(seed: int) -> int:
    """The generator's key for ``seed`` as a signed 64-bit value (kernels reinterpret it as unsigned)."""
    key = (seed * _SEED_MULTIPLIER) & _MASK64
    return key - (1 << 64) if key >= 1 << 63 else key


@triton.jit
def splitmix64(z):
    """splitmix64's finalizer of ``z + golden gamma`` (uint64, wrapping): ``hvdcomp::splitmix64``."""
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def random_bits(key, counter):
    """splitmix64(key + counter) for an int64 counter tensor; ``key`` is the signed form of :func:`seed_key`."""
    return splitmix64(key.to(tl.int64).to(tl.uint64, bitcast=True) + counter.to(tl.uint64, bitcast=True))


@triton.jit
def uniforms(key, first_pair, ROWS: tl.constexpr, COLS: tl.constexpr, ROW_PAIRS):
    """Uniforms in [0, 1) of a [ROWS, COLS] block whose row r starts at the even element 2 (first_pair + r
    ROW_PAIRS): one splitmix64 per pair of elements, its low half for the even one."""
    pairs = first_pair + tl.arange(0, ROWS)[:, None].to(tl.int64) * ROW_PAIRS + tl.arange(0, COLS // 2)[None, :]
    r = random_bits(key, pairs)
    low = (r & 0xFFFFFFFF).to(tl.uint32)
    high = (r >> 32).to(tl.uint32)
    words = tl.reshape(tl.join(low, high), [ROWS, COLS])
    return (words >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def power_scale(top):
    """2^-k for a block's max |x| = f 2^k, f in [0.5, 1) (``frexp``'s k, as the CPU kernels), k kept in [-125, 126]
    so that 2^-k is a normal float32: from the max's exponent bits. x times it is below 1 in magnitude (below 4 where
    k is kept at 126), and exact (a power of two) but for values over 2^125 times smaller than the max, which lose
    bits: a block's sums of it do not overflow (|x| above ~1e34 in float32) nor, squared, underflow."""
    biased = (top.to(tl.int32, bitcast=True) >> 23) & 0xFF
    k = tl.minimum(tl.maximum(biased - 126, -125), 126)
    return ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def float64_total(ptr, count, STRIDE: tl.constexpr, CHUNK: tl.constexpr):
    """The float64 sum of the ``count`` float32 values at ``ptr``, ``ptr + STRIDE``, ... (per-block partial sums), in
    one program and a fixed order: value i in lane i mod CHUNK, the lanes then summed."""
    offsets = tl.arange(0, CHUNK)
    total = tl.zeros([CHUNK], dtype=tl.float64)
    start = 0
    while start < count:  # (while, not range: Triton 3.6's interpreter fails on range(runtime value))
        mask = start + offsets < count
        total += tl.load(ptr + (start + offsets) * STRIDE, mask=mask, other=0.0).to(tl.float64)
        start += CHUNK
    return tl.sum(total, axis=0)


@triton.jit
def store_packed(dst_ptr, codes, first_group, ROWS: tl.constexpr, COLS: tl.constexpr, ROW_GROUPS, valid_groups,
                 nbytes, BITS: tl.constexpr):
    """Packs ``codes`` [ROWS, COLS] (values < 2^BITS; padding codes 0) as BITS bytes per group of 8 and stores
    them: row r's groups start at group first_group + r ROW_GROUPS; groups at or past ``valid_groups`` [ROWS, 1]
    (within the row) and bytes at or past ``nbytes`` are not written."""
    groups = tl.reshape(codes.to(tl.uint64), [ROWS, COLS // 8, 8])
    shifts = (tl.arange(0, 8) * BITS).to(tl.uint64)
    words = tl.sum(groups << shifts[None, None, :], axis=2)  # disjoint bits: the sum is the OR
    byte = tl.arange(0, 8)
    values = ((words[:, :, None] >> (byte * 8).to(tl.uint64)[None, None, :]) & 255).to(tl.uint8)
    group = tl.arange(0, COLS // 8)
    groups_at = first_group + tl.arange(0, ROWS)[:, None].to(tl.int64) * ROW_GROUPS + group[None, :]
    offsets = (groups_at * BITS)[:, :, None] + byte[None, None, :]
    mask = (byte[None, None, :] < BITS) & (group[None, :] < valid_groups)[:, :, None] & (offsets < nbytes)
    tl.store(dst_ptr + offsets, values, mask=mask)


@triton.jit
def load_codes(src_ptr, element, mask, nbytes, BITS: tl.constexpr):
    """The BITS-bit codes of elements ``element`` (int64) of a packed stream of ``nbytes`` bytes."""
    bit = element * BITS
    offset = bit >> 3
    low = tl.load(src_ptr + offset, mask=mask, other=0).to(tl.uint32)
    high = tl.load(src_ptr + offset + 1, mask=mask & (offset + 1 < nbytes), other=0).to(tl.uint32)
    return (((high << 8) | low) >> (bit & 7).to(tl.uint32)) & ((1 << BITS) - 1)


def kept_table(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, for a table a kernel reads that is made once and kept (a layout
    that repeats every step): copied to a GPU from pinned memory, without a wait, on the current stream."""
    table = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)
