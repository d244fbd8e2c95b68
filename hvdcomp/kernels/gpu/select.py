"""Triton kernels for the sparsifiers' selection on CUDA tensors: the exact k entries of largest magnitude, by radix
select and compaction, deterministic and without a host sync (top-k, and DGC, GraVAC and LGC through it; threshold's
capped selection), and threshold's fit (:func:`excess_moments`, one pass; :func:`threshold_fit`, every stage).

A float's magnitude orders as its bit pattern read as an integer, so the k-th largest magnitude is found digit by
digit, 8 bits at a time from the top: each pass histograms the digit of the entries whose higher digits match the
prefix found so far (one local histogram per program, added into the pass's 256 counters with integer atomics, whose
sum does not depend on their order). Every program finds that prefix itself from the earlier passes' counters (the
digit where the count from the top reaches k, pass by pass: a few scans of 256 counters), so a pass is one launch.
The keys are float32's: float64 entries are ranked by their magnitudes rounded to float32 (of those that round
alike the lower indices first; under a threshold it is the rounded magnitude that is compared), and sent in their
own dtype.
After 4 passes the k-th largest key T is exact, with r, how many entries equal to T belong to the top k. Compaction then
writes the entries above T, in index order, then the first r equal to T: per-block counts, an exclusive scan, and
each block's entries at its offset. Every step's result lives on the device: the count of entries is k by
construction, so nothing waits for the host. The digit passes, the counts and the compaction run a fixed number of
programs (:func:`_programs`: 4 an SM), each taking every so-many-th block and computing the prefix once: a program
holds a block's keys, so its registers limit how many an SM runs, and a program per block would spend most of a
launch starting programs where there are few entries to read (over gathered candidates).

On a large tensor with a small k the digit passes run over candidates, not over the whole tensor, as DGC's paper
samples to estimate its threshold: one program takes a bound from a sample of the keys, one in each stretch of
n / _SAMPLE entries (a rank a few standard deviations past where the top k's share of the sample falls), one pass
counts per block the entries at or above it, and one more gathers those (keys and indices, in index order, by the
counts' scan) into a buffer of fixed capacity. Every entry of the top k is at or above the bound when at least k
entries are, so the passes over the candidates select the same entries in the same order. Where the sample misled
(fewer than k candidates, or more than the capacity), the kernels read the whole tensor instead: each decides so on
the device from the candidates' count, and the programs then loop over x's blocks instead of the candidates'.

With a ``threshold`` (a device scalar), entries whose magnitude is not above it take key 0: they are selected only to
fill the k slots (lowest indices first), and their values are sent as 0. There the candidates are the entries above
the threshold (no sample: threshold's fit is the estimate), at most 2k of them. Where fewer than k are, which is
threshold's usual case, the digit passes have nothing to do: the compaction places the candidates, then the first
entries not above the threshold, reading of x only the blocks that hold those (:func:`_fill`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import float64_total

_BLOCK = 4096  # at most 2^16 - 1 entries: _placed packs two in-block counts into one int32
#: warps a program for the kernels that hold a block's keys, indices and slots at once: at 4 warps (32 entries a
#: thread) ptxas gave them 96 to 255 registers a thread (2 to 5 programs resident an SM), the one-block selection and
#: threshold's compaction over candidates spilling 60 and 536 bytes; at 16 warps 30 to 110, no spill
#: (perf/gpu/registers.py, perf/results/registers.jsonl). Their time at 16 is not measured on a GPU yet.
_WARPS = 16
_DIGITS = 256
#: threshold's fit: the blocks' sums one program adds per iteration; up to this many blocks each stage's programs
#: move t themselves (one launch a stage)
_CHUNK = 1024
#: the keys the gathering's bound is taken from, one in each stretch of n / _SAMPLE entries: one program's block
_SAMPLE = 4096
#: tensors of at least this many entries (64 MiB of float32) gather candidates first: on an H100 the gathering took
#: 0.61 to 0.72 of the whole tensor's selection time from 2^24 entries on, and 1.4 to 1.9 times it at 2^22 and below
#: (perf/gpu/selection.py; docs/gpu.md)
_GATHER_MIN = 1 << 24
#: ... where the candidates' buffer holds at most 1 / _GATHER_SHARE of them (top-k's k up to about 41% of the entries,
#: threshold's up to n / 4; the buffer, 12 bytes a candidate, then up to 1.5 times x's float32): over the whole tensor
#: every digit pass, the counts and the compaction take each entry, where the gathering reads each twice and the
#: passes then take the candidates alone: the gathered way was the faster at every share measured, to 0.8 n
#: (perf/gpu/selection.py; docs/gpu.md)
_GATHER_SHARE = 2
#: programs an SM for the kernels that loop over the blocks: at _WARPS warps (512 threads) an SM's threads hold at most
#: 4; where registers hold fewer (the compaction's 99 to 110 a thread: 1), the others wait their turn
_PROGRAMS_PER_SM = 4


@triton.jit
def _keys(x_ptr, threshold_ptr, offsets, n, THRESHOLD: tl.constexpr):
    """The magnitude's bits as int32 keys (0 where not above the threshold), and the values."""
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    key = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if THRESHOLD:
        key = tl.where(tl.abs(x) > tl.load(threshold_ptr), key, 0)
    return tl.where(mask, key, -1), x, mask


@triton.jit
def _blocks(count, BLOCK: tl.constexpr):
    """ceil(count / BLOCK), in int64: an int32 count + BLOCK - 1 would wrap within BLOCK of 2^31."""
    return (count.to(tl.int64) + BLOCK - 1) // BLOCK


@triton.jit
def _source(found_ptr, n, k, capacity, THRESHOLD: tl.constexpr, GATHERED: tl.constexpr, BLOCK: tl.constexpr):
    """(size, gathered): how many entries the selection reads, and how many of them are the gathered candidates (all
    or none). With GATHERED, ``found_ptr`` holds the scan of the candidates' counts per block of x, and their count
    decides: from k to ``capacity``, the candidates; more, x's entries; fewer, x's entries too, but under a THRESHOLD
    none (:func:`_fill` then places them all)."""
    size = n
    gathered = 0
    if GATHERED:
        total = tl.load(found_ptr + _blocks(n, BLOCK) - 1).to(tl.int64)
        whole = total > capacity
        if not THRESHOLD:
            whole = whole | (total < k)
        gathered = tl.where((total >= k) & (total <= capacity), total, 0)
        size = tl.where(whole, n, gathered)
    return size, gathered


@triton.jit
def _entries(x_ptr, threshold_ptr, keys_ptr, index_ptr, block, n, size, gathered, THRESHOLD: tl.constexpr,
             GATHERED: tl.constexpr, BLOCK: tl.constexpr):
    """The keys (-1 past the end) and indices of the selection's entries in block ``block``: the gathered candidates'
    (in ``keys_ptr`` and ``index_ptr``) where there are ``gathered`` of them, else x's (:func:`_source`)."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if GATHERED:
        x_key, _, _ = _keys(x_ptr, threshold_ptr, offsets, tl.where(gathered > 0, 0, size), THRESHOLD)
        candidate = offsets < gathered
        key = tl.where(candidate, tl.load(keys_ptr + offsets, mask=candidate, other=0), x_key)
        index = tl.where(candidate, tl.load(index_ptr + offsets, mask=candidate, other=0), offsets)
    else:
        key, _, _ = _keys(x_ptr, threshold_ptr, offsets, n, THRESHOLD)
        index = offsets
    return key, index


@triton.jit
def _before(scan_ptr, pid):
    """What the blocks before block ``pid`` hold, from the blocks' inclusive scan at ``scan_ptr``."""
    return tl.load(scan_ptr + pid - 1, mask=pid > 0, other=0).to(tl.int64)


@triton.jit
def _placed(key, kth, wanted, above_before, equal_before, above_total):
    """Compaction's slots: entries above the k-th key ``kth`` at their exclusive-scan offset (index order), then the
    first ``wanted`` equal to it after all ``above_total`` of those; and which entries are placed. Both in-block
    counts come from one int32 scan, the entries above in its low 16 bits and those equal in its high 16 (a block
    holds at most 2^16 - 1 entries)."""
    is_above = key > kth
    is_equal = key == kth
    both = tl.cumsum(is_above.to(tl.int32) | (is_equal.to(tl.int32) << 16), axis=0)
    slot_above = above_before + (both & 0xFFFF).to(tl.int64) - 1
    rank_equal = equal_before + ((both >> 16) & 0xFFFF).to(tl.int64) - 1
    slot = tl.where(is_above, slot_above, above_total + rank_equal)
    return slot, is_above | (is_equal & (rank_equal < wanted))


@triton.jit
def _fill(x_ptr, threshold_ptr, index_ptr, found_ptr, values_ptr, indices_ptr, n, k, BLOCK: tl.constexpr):
    """Threshold's selection where fewer than k entries are above it, all of them gathered: each program takes every
    so-many-th block b and places the candidates' b-th block (in index order, from slot 0) and, after them, those of
    x's b-th block that are among the first k - (candidates) entries not above the threshold, with the value 0. Those
    lie in x's first k entries (at most all the candidates are among them), so blocks from k on are not read. The
    same entries in the same order as the selection over x, where the k-th key is 0."""
    total = tl.load(found_ptr + _blocks(n, BLOCK) - 1).to(tl.int64)
    if total < k:
        block = tl.program_id(0)
        while block < _blocks(k, BLOCK):  # (while, not range: Triton 3.6's interpreter fails on range(runtime value))
            offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            placed = offsets < total
            index = tl.load(index_ptr + offsets, mask=placed, other=0)
            value = tl.load(x_ptr + index, mask=placed, other=0.0)
            tl.store(values_ptr + offsets, value.to(values_ptr.dtype.element_ty), mask=placed)
            tl.store(indices_ptr + offsets, index.to(indices_ptr.dtype.element_ty), mask=placed)
            below_before = block.to(tl.int64) * BLOCK - _before(found_ptr, block)  # not above the threshold, earlier
            if below_before < k - total:
                below = _keys(x_ptr, threshold_ptr, offsets, n, True)[0] == 0
                rank = below_before + tl.cumsum(below.to(tl.int32), axis=0).to(tl.int64) - 1
                take = below & (rank < k - total)
                tl.store(values_ptr + total + rank, tl.zeros([BLOCK], dtype=values_ptr.dtype.element_ty), mask=take)
                tl.store(indices_ptr + total + rank, offsets.to(indices_ptr.dtype.element_ty), mask=take)
            block += tl.num_programs(0)


@triton.jit
def _next_digit(counts, rank):
    """The digit (of 256 ``counts``, int64) in which the ``rank``-th largest falls, counted from the top, and the rank
    left within that digit's entries."""
    digits = tl.arange(0, 256)
    above = tl.cumsum(counts, axis=0, reverse=True) - counts  # entries of higher digits
    chosen = (above < rank) & (above + counts >= rank)
    digit = tl.max(tl.where(chosen, digits, -1))
    return digit, rank - tl.sum(tl.where(digits == digit, above, 0))


@triton.jit
def _prefix(counts_ptr, k, PASSES: tl.constexpr):
    """The top PASSES digits of the k-th largest key, from those passes' counters (256 each), and the rank of the k-th
    largest among the entries that share them."""
    digits = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.int32)
    rank = k.to(tl.int64)
    for i in tl.static_range(PASSES):
        digit, rank = _next_digit(tl.load(counts_ptr + i * 256 + digits).to(tl.int64), rank)
        prefix = (prefix << 8) | digit
    return prefix, rank


@triton.jit
def _kth_key(key, mask, k):
    """The k-th largest of one program's ``key`` (where ``mask``) by the four digit passes in registers, and the rank
    of the k-th largest among the keys equal to it."""
    prefix = tl.zeros([], dtype=tl.int32)
    rank = k.to(tl.int64)
    for i in tl.static_range(4):  # digits from the top: key bits 24-31, 16-23, 8-15, 0-7
        selected = mask
        if i > 0:
            selected = mask & ((key >> (32 - 8 * i)) == prefix)
        counts = tl.histogram((key >> (24 - 8 * i)) & 255, 256, mask=selected).to(tl.int64)
        digit, rank = _next_digit(counts, rank)
        prefix = (prefix << 8) | digit
    return prefix, rank


@triton.jit(do_not_specialize=["n", "stride", "rank"])
def _bound_kernel(x_ptr, bound_ptr, n, stride, rank, SAMPLE: tl.constexpr):
    """One program: the ``rank``-th largest key of SAMPLE entries, the gathering's bound. Entry i of the sample lies
    in the i-th stretch of ``stride`` entries, at a position in it that a multiplicative hash of i picks: at a fixed
    position it would meet the same columns of every row of a matrix whose rows' length divides ``stride``."""
    i = tl.arange(0, SAMPLE).to(tl.int64)
    offsets = i * stride + (i * 2654435761) % stride
    key, _, mask = _keys(x_ptr, x_ptr, offsets, n, False)
    bound, _ = _kth_key(key, mask, rank)
    tl.store(bound_ptr, bound)


@triton.jit
def _candidate(key, bound_ptr, THRESHOLD: tl.constexpr):
    """Whether an entry is a candidate: its key at or above the sampled bound, or under a THRESHOLD above it (key
    at least 1: the bound is not read)."""
    if THRESHOLD:
        return key >= 1
    return key >= tl.load(bound_ptr)


@triton.jit(do_not_specialize=["n"])
def _candidates_kernel(x_ptr, threshold_ptr, bound_ptr, found_ptr, n, THRESHOLD: tl.constexpr, BLOCK: tl.constexpr):
    """Each block's count of candidates (:func:`_candidate`)."""
    pid = tl.program_id(0)
    key, _, _ = _keys(x_ptr, threshold_ptr, pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), n, THRESHOLD)
    tl.store(found_ptr + pid, tl.sum(_candidate(key, bound_ptr, THRESHOLD).to(tl.int32)))


@triton.jit(do_not_specialize=["n", "capacity"])
def _gather_kernel(x_ptr, threshold_ptr, bound_ptr, found_ptr, keys_ptr, index_ptr, n, capacity,
                   THRESHOLD: tl.constexpr, BLOCK: tl.constexpr):
    """The candidates, keys and indices in index order at their block's offset (``found_ptr`` holds the blocks'
    inclusive scan), where there are at most ``capacity`` of them."""
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    key, _, _ = _keys(x_ptr, threshold_ptr, offsets, n, THRESHOLD)
    total = tl.load(found_ptr + tl.num_programs(0) - 1).to(tl.int64)
    candidate = _candidate(key, bound_ptr, THRESHOLD)
    slot = _before(found_ptr, pid) + tl.cumsum(candidate.to(tl.int32), 0).to(tl.int64) - 1
    keep = candidate & (total <= capacity)
    tl.store(keys_ptr + slot, key, mask=keep)
    tl.store(index_ptr + slot, offsets, mask=keep)


@triton.jit(do_not_specialize=["n", "k", "capacity"])
def _histogram_kernel(x_ptr, threshold_ptr, keys_ptr, index_ptr, found_ptr, counts_ptr, n, k, capacity,
                      PASS: tl.constexpr, THRESHOLD: tl.constexpr, GATHERED: tl.constexpr, BLOCK: tl.constexpr):
    """Pass PASS (0 to 3, from the top digit): the digit's histogram of the entries whose higher digits are the prefix
    the earlier passes found, each program's over its blocks added into the pass's counters."""
    pid = tl.program_id(0)
    size, gathered = _source(found_ptr, n, k, capacity, THRESHOLD, GATHERED, BLOCK)
    if pid.to(tl.int64) * BLOCK < size:
        shift: tl.constexpr = 24 - 8 * PASS
        prefix = tl.zeros([], dtype=tl.int32)
        if PASS > 0:  # only the entries whose higher digits are the prefix found so far
            prefix = _prefix(counts_ptr, k, PASS)[0]
        counts = tl.zeros([256], dtype=tl.int32)
        block = pid
        while block < _blocks(size, BLOCK):
            key = _entries(x_ptr, threshold_ptr, keys_ptr, index_ptr, block, n, size, gathered, THRESHOLD, GATHERED,
                           BLOCK)[0]
            mask = key >= 0
            if PASS > 0:
                mask = mask & ((key >> (shift + 8)) == prefix)
            counts += tl.histogram((key >> shift) & 255, 256, mask=mask)
            block += tl.num_programs(0)
        tl.atomic_add(counts_ptr + PASS * 256 + tl.arange(0, 256), counts.to(tl.int64), mask=counts > 0)


@triton.jit(do_not_specialize=["n", "k", "capacity"])
def _count_kernel(x_ptr, threshold_ptr, keys_ptr, index_ptr, found_ptr, counts_ptr, n, k, capacity, scans_ptr,
                  THRESHOLD: tl.constexpr, GATHERED: tl.constexpr, BLOCK: tl.constexpr):
    """Each block b of the entries (x's, or the gathered candidates'; ``blocks`` blocks of x in all): how many of
    its entries are above the k-th key into scans[b], how many equal to it into scans[blocks + b] (0 for the blocks
    past the entries)."""
    pid = tl.program_id(0)
    blocks = _blocks(n, BLOCK)
    size, gathered = _source(found_ptr, n, k, capacity, THRESHOLD, GATHERED, BLOCK)
    kth = _prefix(counts_ptr, k, 4)[0]
    block = pid
    while block < _blocks(size, BLOCK):
        key = _entries(x_ptr, threshold_ptr, keys_ptr, index_ptr, block, n, size, gathered, THRESHOLD, GATHERED,
                       BLOCK)[0]
        tl.store(scans_ptr + block, tl.sum((key > kth).to(tl.int32)))
        tl.store(scans_ptr + blocks + block, tl.sum((key == kth).to(tl.int32)))
        block += tl.num_programs(0)
    while block < blocks:  # past the entries (of the candidates, where they were gathered)
        tl.store(scans_ptr + block, 0)
        tl.store(scans_ptr + blocks + block, 0)
        block += tl.num_programs(0)


@triton.jit(do_not_specialize=["n", "k", "capacity"])
def _compact_kernel(x_ptr, threshold_ptr, keys_ptr, index_ptr, found_ptr, counts_ptr, n, k, capacity, scans_ptr,
                    values_ptr, indices_ptr, THRESHOLD: tl.constexpr, GATHERED: tl.constexpr, BLOCK: tl.constexpr):
    """The selected entries at their slots (:func:`_placed`). ``scans_ptr`` holds one inclusive scan of
    :func:`_count_kernel`'s counts, those above the k-th key, then those equal to it: the entries above it in all
    blocks are scans[blocks - 1], and those equal to it in the blocks before b are scans[blocks + b - 1] -
    scans[blocks - 1]."""
    pid = tl.program_id(0)
    blocks = _blocks(n, BLOCK)
    size, gathered = _source(found_ptr, n, k, capacity, THRESHOLD, GATHERED, BLOCK)
    if pid.to(tl.int64) * BLOCK < size:
        kth, wanted = _prefix(counts_ptr, k, 4)
        above_total = tl.load(scans_ptr + blocks - 1)
        block = pid
        while block < _blocks(size, BLOCK):
            key, index = _entries(x_ptr, threshold_ptr, keys_ptr, index_ptr, block, n, size, gathered, THRESHOLD,
                                  GATHERED, BLOCK)
            equal_before = tl.load(scans_ptr + blocks + block - 1) - above_total
            slot, keep = _placed(key, kth, wanted, _before(scans_ptr, block), equal_before, above_total)
            value = tl.load(x_ptr + index, mask=keep, other=0.0)
            if THRESHOLD:
                value = tl.where(key > 0, value, 0.0)
            tl.store(values_ptr + slot, value.to(values_ptr.dtype.element_ty), mask=keep)
            tl.store(indices_ptr + slot, index.to(indices_ptr.dtype.element_ty), mask=keep)
            block += tl.num_programs(0)
    if GATHERED and THRESHOLD:  # where fewer than k are above the threshold (and nothing was placed above)
        _fill(x_ptr, threshold_ptr, index_ptr, found_ptr, values_ptr, indices_ptr, n, k, BLOCK)


@triton.jit(do_not_specialize=["n", "k"])
def _one_block_kernel(x_ptr, threshold_ptr, values_ptr, indices_ptr, n, k, THRESHOLD: tl.constexpr,
                      BLOCK: tl.constexpr):
    """The whole selection of a tensor of at most BLOCK entries in one program: the four digit passes on its keys in
    registers, then the compaction, as the kernels above do across blocks (the same entries, in the same order)."""
    offsets = tl.arange(0, BLOCK)
    key, _, mask = _keys(x_ptr, threshold_ptr, offsets, n, THRESHOLD)
    kth, rank = _kth_key(key, mask, k)
    slot, keep = _placed(key, kth, rank, 0, 0, tl.sum((key > kth).to(tl.int64)))
    value = tl.load(x_ptr + offsets, mask=keep, other=0.0)  # in x's dtype: the keys' float32 would round float64
    if THRESHOLD:
        value = tl.where(key > 0, value, 0.0)
    tl.store(values_ptr + slot, value.to(values_ptr.dtype.element_ty), mask=keep)
    tl.store(indices_ptr + slot, offsets.to(indices_ptr.dtype.element_ty), mask=keep)


def topk(x: torch.Tensor, k: int, index_dtype: torch.dtype = torch.int64,
         threshold: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` entries of the flat ``x`` with the largest magnitude: those above the k-th
    largest in index order, then the first of those equal to it. With ``threshold`` (a device scalar), entries not
    above it rank lowest and their values are 0. A tensor of at most one block's entries takes one launch; a larger
    one 6 of Triton (four digit passes, the counts, the compaction) and 2 of PyTorch (the counters' zeros, the
    counts' scans), and from :data:`_GATHER_MIN` entries, where k is small enough, 4 more for the gathering (3
    under a threshold): the bound, the candidates' counts and their gathering (Triton) and the counts' scan
    (PyTorch)."""
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"topk: k must be in [0, n] = [0, {n}], got {k}")
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    indices = torch.empty(k, dtype=index_dtype, device=x.device)
    if k == 0:
        return values, indices
    x = x.contiguous()
    limit = threshold if threshold is not None else values  # (any pointer when there is no threshold)
    if n <= _BLOCK:
        _one_block_kernel[(1,)](x, limit, values, indices, n, k, THRESHOLD=threshold is not None, BLOCK=_BLOCK,
                                num_warps=_WARPS)
        return values, indices
    plan = _gathering(n, k, threshold is not None) if n >= _GATHER_MIN else None
    return _select_blocks(x, k, values, indices, threshold, _gather(x, k, threshold, plan) if plan else None)


class _Gathered(NamedTuple):
    """The candidates :func:`_gather` found: their keys and indices (int32, int64; the first ``found[-1]`` of
    ``capacity`` are written where that count is at most ``capacity``) and the blocks' inclusive scan of their
    counts."""

    keys: torch.Tensor
    index: torch.Tensor
    found: torch.Tensor
    capacity: int


def _plan(n: int, k: int, threshold: bool = False) -> tuple[int, int]:
    """(rank, capacity) of the candidates' gathering for the top ``k`` of ``n`` entries. The bound is the sample's
    rank-th largest key: of its :data:`_SAMPLE` keys, s = k _SAMPLE / n are expected among the top k, and rank = s + 4
    sqrt(s) + 4 (a binomial's mean and 4 standard deviations, and some), so that fewer than k entries reach the bound
    only in that far a tail. The capacity holds the n rank / _SAMPLE entries expected at or above it, with the same
    margin. With a ``threshold`` the candidates are the entries above it (rank 0: no sample), 2k of them at most:
    threshold's fit aims below k."""
    if threshold:
        return 0, 2 * k
    expected = _SAMPLE * k / n
    rank = math.ceil(expected + 4 * math.sqrt(expected) + 4)
    return rank, math.ceil(n * (rank + 4 * math.sqrt(rank) + 4) / _SAMPLE)


def _gathering(n: int, k: int, threshold: bool = False) -> tuple[int, int] | None:
    """:func:`_plan`'s (rank, capacity), None where the capacity would pass n / :data:`_GATHER_SHARE`."""
    rank, capacity = _plan(n, k, threshold)
    return (rank, capacity) if n >= _SAMPLE and capacity <= n // _GATHER_SHARE else None


def _gather(x: torch.Tensor, k: int, threshold: torch.Tensor | None, plan: tuple[int, int]) -> _Gathered:
    """The entries of ``x`` at or above the bound that ``plan`` ((rank, capacity), from :func:`_gathering`) takes
    from the sample, or above the ``threshold``: 3 launches of Triton (the bound, none under a threshold; the counts;
    the gathering) and 1 of PyTorch (the scan)."""
    n = x.numel()
    rank, capacity = plan
    blocks = triton.cdiv(n, _BLOCK)
    bound = torch.empty(1, dtype=torch.int32, device=x.device)  # (not read under a threshold)
    if threshold is None:
        _bound_kernel[(1,)](x, bound, n, n // _SAMPLE, rank, SAMPLE=_SAMPLE, num_warps=_WARPS)
    limit = threshold if threshold is not None else bound  # (any pointer when there is no threshold)
    found = torch.empty(blocks, dtype=torch.int64, device=x.device)
    _candidates_kernel[(blocks,)](x, limit, bound, found, n, THRESHOLD=threshold is not None, BLOCK=_BLOCK)
    found.cumsum_(0)
    keys = torch.empty(capacity, dtype=torch.int32, device=x.device)
    index = torch.empty(capacity, dtype=torch.int64, device=x.device)
    _gather_kernel[(blocks,)](x, limit, bound, found, keys, index, n, capacity, THRESHOLD=threshold is not None,
                              BLOCK=_BLOCK, num_warps=_WARPS)
    return _Gathered(keys, index, found, capacity)


def _select_blocks(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor,
                   threshold: torch.Tensor | None, gathered: _Gathered | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk` across blocks, into ``values`` and ``indices``: over the ``gathered`` candidates where their count
    is in [k, capacity], else over the whole of ``x``."""
    n = x.numel()
    blocks = triton.cdiv(n, _BLOCK)
    programs = _programs(x.device, blocks)
    # each digit pass's counters, int64: from 2^31 entries on, more than int32 holds can share a digit
    counts = torch.zeros(4, _DIGITS, dtype=torch.int64, device=x.device)
    limit = threshold if threshold is not None else counts  # (any pointer when there is no threshold)
    if gathered is None:
        source = (x, limit, counts, counts, counts, counts, n, k, 0)  # (any pointers for the candidates)
    else:
        source = (x, limit, gathered.keys, gathered.index, gathered.found, counts, n, k, gathered.capacity)
    flags = {"THRESHOLD": threshold is not None, "GATHERED": gathered is not None, "BLOCK": _BLOCK,
             "num_warps": _WARPS}
    for digit_pass in range(4):
        _histogram_kernel[(programs,)](*source, PASS=digit_pass, **flags)
    scans = torch.empty(2 * blocks, dtype=torch.int64, device=x.device)  # per block: above the k-th key, then equal
    _count_kernel[(programs,)](*source, scans, **flags)
    # both inclusive scans in one 1-D launch: on an H200 PyTorch's scan of [2, 6104] counts took 10.5 us, of 6,104 3.3
    scans.cumsum_(0)
    _compact_kernel[(programs,)](*source, scans, values, indices, **flags)
    return values, indices


def _programs(device: torch.device, blocks: int) -> int:
    """Programs for the kernels that loop over ``blocks`` blocks: :data:`_PROGRAMS_PER_SM` an SM on CUDA, at most
    one a block; 2 elsewhere (Triton's interpreter runs programs one after another: any count gives the same result,
    and 2 has tensors of a few blocks looping, as a GPU's large ones do)."""
    if device.type == "cuda":
        return min(blocks, _PROGRAMS_PER_SM * _multiprocessors(device.index))
    return min(blocks, 2)


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _block_excess(x_ptr, t, block, n, BLOCK: tl.constexpr):
    """(sum of max(|x| - t, 0), count of |x| > t) over one block of x, float32."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    over = tl.abs(x) - t
    return tl.sum(tl.where(over > 0, over, 0.0)), tl.sum((over > 0).to(tl.float32))


@triton.jit(do_not_specialize=["n"])
def _excess_kernel(x_ptr, threshold_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    excess, count = _block_excess(x_ptr, tl.load(threshold_ptr), pid, n, BLOCK)
    tl.store(partial_ptr + 2 * pid, excess)
    tl.store(partial_ptr + 2 * pid + 1, count)


@triton.jit
def _moved(partial_ptr, t, blocks, step, CHUNK: tl.constexpr):
    """t moved by one stage's mean excess times ``step``: the blocks' sums added in float64 (in chunks of the block
    order), t + float32(excess / max(count, 1) * step)."""
    excess = float64_total(partial_ptr, blocks, 2, CHUNK)
    count = float64_total(partial_ptr + 1, blocks, 2, CHUNK)
    return t + (excess / tl.maximum(count, 1.0) * step).to(tl.float32)


@triton.jit(do_not_specialize=["blocks", "step"])
def _fit_step_kernel(partial_ptr, t_ptr, blocks, step: tl.float64, CHUNK: tl.constexpr):
    """One program: t[0] moved by the stage whose blocks' sums are in ``partial``, into t[1]."""
    tl.store(t_ptr + 1, _moved(partial_ptr, tl.load(t_ptr), blocks, step, CHUNK))


@triton.jit(do_not_specialize=["n", "blocks", "step", "stage"])
def _fit_stage_kernel(x_ptr, ts_ptr, previous_ptr, partial_ptr, n, blocks, step: tl.float64, stage,
                      BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Stage ``stage`` of the fit over at most CHUNK blocks: every program finds the stage's t, 0 at first, else the
    last stage's (ts[stage - 1]) moved by that stage's sums (``previous``), then sums its block's excess over it;
    program 0 keeps t in ts[stage]. Each program finds the same t: the same sums, added in the same order."""
    pid = tl.program_id(0)
    t = tl.zeros([], dtype=tl.float32)
    if stage > 0:
        t = _moved(previous_ptr, tl.load(ts_ptr + stage - 1), blocks, step, CHUNK)
    if pid == 0:
        tl.store(ts_ptr + stage, t)
    excess, count = _block_excess(x_ptr, t, pid, n, BLOCK)
    tl.store(partial_ptr + 2 * pid, excess)
    tl.store(partial_ptr + 2 * pid + 1, count)


@triton.jit(do_not_specialize=["n", "stages", "step"])
def _fit_one_block_kernel(x_ptr, t_ptr, n, stages, step: tl.float64, BLOCK: tl.constexpr):
    """Every stage of the fit of a tensor of one block, in one program: the sums as the stage kernels take them."""
    t = tl.zeros([], dtype=tl.float32)
    stage = 0
    while stage < stages:
        excess, count = _block_excess(x_ptr, t, tl.program_id(0), n, BLOCK)
        mean = excess.to(tl.float64) / tl.maximum(count.to(tl.float64), 1.0)
        t = t + (mean * step).to(tl.float32)
        stage += 1
    tl.store(t_ptr, t)


def _fit_way(blocks: int) -> str:
    """How :func:`threshold_fit` runs over ``blocks`` blocks: "one program", "a launch a stage" or "two a stage"."""
    return "one program" if blocks == 1 else "a launch a stage" if blocks <= _CHUNK else "two a stage"


def threshold_fit(x: torch.Tensor, stages: int, step: float) -> torch.Tensor:
    """Threshold's multi-stage fit (:func:`hvdcomp.methods.threshold.fitted_threshold`) of the flat float32 ``x``
    on the device, from t = 0. Returns t, float32 [1]. Each stage is one pass over x (:func:`excess_moments`' blocks)
    and a move of t by its sums: a tensor of one block takes one launch for every stage; up to 1,024 blocks, one
    launch a stage (each moves t by the last stage's sums, then passes over x) and one to move t at the end; beyond,
    two a stage. The blocks' sums are added in another order than :func:`excess_moments`' ``sum``: t agrees with it to
    float rounding, and with itself, bit for bit, whichever way it was found."""
    n = x.numel()
    blocks = max(1, triton.cdiv(n, _BLOCK))
    way = _fit_way(blocks)
    if stages < 1:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    if way == "one program":
        t = torch.empty(1, dtype=torch.float32, device=x.device)
        _fit_one_block_kernel[(1,)](x, t, n, stages, float(step), BLOCK=_BLOCK, enable_fp_fusion=False)
        return t
    # t of each stage (t_0 = 0: written by the first stage's kernel, or filled for two a stage)
    ts = (torch.empty if way == "a launch a stage" else torch.zeros)(stages + 1, dtype=torch.float32, device=x.device)
    partial = torch.empty(2, blocks, 2, dtype=torch.float32, device=x.device)  # this stage's sums and the last's
    for stage in range(stages):
        sums = partial[stage % 2]
        if way == "a launch a stage":
            _fit_stage_kernel[(blocks,)](x, ts, partial[(stage + 1) % 2], sums, n, blocks, float(step), stage,
                                         BLOCK=_BLOCK, CHUNK=_CHUNK, enable_fp_fusion=False)
        else:
            _excess_kernel[(blocks,)](x, ts[stage:], sums, n, BLOCK=_BLOCK, enable_fp_fusion=False)
            if stage + 1 < stages:
                _fit_step_kernel[(1,)](sums, ts[stage:], blocks, float(step), CHUNK=_CHUNK, enable_fp_fusion=False)
    _fit_step_kernel[(1,)](partial[(stages - 1) % 2], ts[stages - 1:], blocks, float(step), CHUNK=_CHUNK,
                           enable_fp_fusion=False)
    return ts[stages:]


def excess_moments(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``excess_moments`` of the CPU kernels (threshold's fit): float64 [sum of max(|x| - t, 0), count of |x| > t]
    of the flat ``x``, t a float32 tensor of one element; one pass, per-block sums added in a fixed order."""
    n = x.numel()
    blocks = max(1, triton.cdiv(n, _BLOCK))
    partial = torch.empty(blocks, 2, dtype=torch.float32, device=x.device)
    _excess_kernel[(blocks,)](x.contiguous(), threshold, partial, n, BLOCK=_BLOCK, enable_fp_fusion=False)
    return partial.double().sum(0)
