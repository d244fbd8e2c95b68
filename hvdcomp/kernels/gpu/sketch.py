"""Triton kernels for the homomorphic sketch (:mod:`hvdcomp.methods.sketch`) on CUDA tensors: the filter's
candidates, encoding the count sketch and peeling it, deterministic and bit for bit those of the CPU
(``sketch_candidates`` and ``sketch_peel`` of ``hvdcomp/kernels/sketch.cpp``, ``index_add_`` for the encoding), with
the same hashes (``splitmix64`` of :mod:`hvdcomp.kernels.gpu.common`).

Every rank must decode the same bits, so no float sum may depend on the order of atomics. Encoding and peeling
therefore start from each cell's list of entries: a stable sort of the (item, sub-table) entries by cell keeps
them in item order, and a search of the sorted cells gives each cell's range (deterministic torch ops on CUDA).

* A rank's rows: the nonzero rows of its gradient and their values, compacted in row order by per-program counts,
  their scan and a second pass that places each program's rows at its offset (one host sync: their count sizes
  the payload).
* A bucket's rows counted for its vote: one program per 64 rows of one of its gradients (more rows, about 4,096 values,
  where rows are narrower than 64 values), over their concatenation, then one per gradient adds its programs' counts
  (two launches for the whole bucket, no host sync).
* Candidates: one thread per item tests its filter bits; the passing items are compacted in order
  (``nonzero``, one host sync: their count sizes the sketch).
* Encoding: one thread per cell (and column) adds its entries' signed values in float64 in item order, which is
  the order in which the CPU's sequential ``index_add_`` adds them, so the sums are the same to the last bit.
* Decoding peels in rounds. The CPU's queue processes the cells in layers: first the cells covered by one candidate,
  ascending; then those that dropped to one during the previous layer, in the order they dropped. A candidate's
  layer is therefore the round in which it is first alone in one of its cells, and everything the CPU does within
  a layer is fixed by a key per queued cell: the cell itself in round 0; later 3 s + j, where s is the global
  position (in the CPU's order) of the last candidate whose removal left the cell with one, and j the cell's
  sub-table. Each round, every unresolved candidate alone in a cell takes its cell of least key; ranking those
  keys (flags and a cumulative sum) gives its position s; it reads its value from the table's cell minus the
  cell's other candidates' contributions, subtracted in order of s as the CPU's residual had them subtracted;
  then every cell recounts its unresolved candidates and sets its key. Values, verdict and order are the CPU's, so
  they are equal even where float rounding is not exact (float32 tables). Both stop at the same set when peeling
  does not complete: the hypergraph's 2-core stays unresolved, whatever the order.

Each round is four launches and no host sync; the host reads how many candidates are resolved once per
:data:`ROUNDS` rounds (peeling at the default 1.34 cells per candidate takes about 16 rounds from 1,000 to
1,000,000 candidates), so a decode syncs once where it completes in time, and never once per element.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import kept_table, splitmix64

#: rounds of peeling between two reads of the progress on the host
ROUNDS = 20
_BLOCK = 1024
#: values a program reads at once when finding a gradient's nonzero rows, in _ROWS_WARPS warps (8 a thread: at 4
#: warps ptxas gave the kernels 163 to 255 registers a thread, the placing spilling; perf/gpu/registers.py)
_ROWS_BLOCK = 4096
_ROWS_WARPS = 16
_MAX_COLS = 32
#: rows a program of :func:`sketch_bucket_counts` reads at once (_MAX_COLS values of each at a time), and about how
#: many values it reads in all: narrow gradients (1-D ones are rows of one entry) get more rows a program
_BUCKET_ROWS = 64
_BUCKET_VALUES = 4096
_NONE = tl.constexpr(2**63 - 1)  # no key: larger than any


@triton.jit(do_not_specialize=["k", "seed", "c3"])
def _hash_kernel(items_ptr, cells_ptr, signs_ptr, k, seed, c3, BLOCK: tl.constexpr):
    """Each item's cell (j c3 + (hash32_j c3 >> 32)) and sign (1 - 2 bit 32 + j of G) in sub-table j, as
    ``cells_of`` in ``sketch.cpp``: H = splitmix64(item ^ seed), G = splitmix64(H)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < k
    items = tl.load(items_ptr + offsets, mask=mask, other=0).to(tl.int64)
    h = splitmix64(items.to(tl.uint64, bitcast=True) ^ seed.to(tl.int64).to(tl.uint64, bitcast=True))
    g = splitmix64(h)
    size = c3.to(tl.uint64)
    for j in tl.static_range(3):
        if j == 0:
            hash32 = h & 0xFFFFFFFF
        elif j == 1:
            hash32 = h >> 32
        else:
            hash32 = g & 0xFFFFFFFF
        cell = (j * size + ((hash32 * size) >> 32)).to(tl.int64)
        sign = 1 - 2 * ((g >> (32 + j)) & 1).to(tl.int8)
        tl.store(cells_ptr + offsets * 3 + j, cell, mask=mask)
        tl.store(signs_ptr + offsets * 3 + j, sign, mask=mask)


@triton.jit(do_not_specialize=["n", "seed", "bits", "hashes"])
def _filter_kernel(filter_ptr, passed_ptr, n, seed, bits, hashes, BLOCK: tl.constexpr):
    """Whether each item of [0, n) passes the packed Bloom filter of ``bits`` bits, as ``passes`` in
    ``sketch.cpp``: F = splitmix64(item ^ seed); bits h1 + j h2 mod ``bits`` for j < ``hashes`` (h1 the low 32 bits
    of F, h2 the high ones | 1; h1 + j h2 stays below 2^64)."""
    items = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = items < n
    f = splitmix64(items.to(tl.uint64, bitcast=True) ^ seed.to(tl.int64).to(tl.uint64, bitcast=True))
    position = f & 0xFFFFFFFF
    stride = (f >> 32) | 1
    size = bits.to(tl.int64).to(tl.uint64)
    passed = live
    j = 0
    while j < hashes:
        bit = position % size
        byte = tl.load(filter_ptr + (bit >> 3).to(tl.int64), mask=passed, other=0)
        passed = passed & (((byte >> (bit & 7).to(tl.uint8)) & 1) != 0)
        position += stride
        j += 1
    tl.store(passed_ptr + items, passed.to(tl.int8), mask=live)


@triton.jit
def _nonzero(x_ptr, row, items, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Which of the ``row`` ([ROWS]) rows of x ([items, width]) hold a value other than 0 (NaN included, -0 not), as
    ``any`` finds them ([ROWS]). One-dimensional, as the scan over it must be: compiled for a GPU, a scan of
    [ROWS, 1] numbered a row once per column (it passed in the interpreter)."""
    found = tl.zeros([ROWS], dtype=tl.int1)
    col = tl.arange(0, COLS)[None, :]
    start = 0
    while start < width:  # (while, not range: Triton 3.6's interpreter fails on range(runtime value))
        tile = (row[:, None] < items) & (start + col < width)
        x = tl.load(x_ptr + row[:, None] * width + start + col, mask=tile, other=0.0)
        found = found | (tl.max((x != 0).to(tl.int32), axis=1) > 0)
        start += COLS
    return found


@triton.jit(do_not_specialize=["items", "width"])
def _row_counts_kernel(x_ptr, counts_ptr, items, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Each program's count of nonzero rows among its ROWS."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(_nonzero(x_ptr, row, items, width, ROWS, COLS).to(tl.int32)))


@triton.jit(do_not_specialize=["items", "width"])
def _place_rows_kernel(x_ptr, found_ptr, values_ptr, rows_ptr, items, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The nonzero rows of each program's ROWS in row order, from the programs' inclusive scan of their counts
    (``found``): each row's index into ``rows`` and its values into ``values`` ([count, width]). A program without
    such rows reads nothing."""
    pid = tl.program_id(0)
    before = tl.load(found_ptr + pid - 1, mask=pid > 0, other=0).to(tl.int64)
    if tl.load(found_ptr + pid).to(tl.int64) > before:
        row = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        nonzero = _nonzero(x_ptr, row, items, width, ROWS, COLS)
        slot = before + tl.cumsum(nonzero.to(tl.int32), axis=0).to(tl.int64) - 1
        tl.store(rows_ptr + slot, row.to(rows_ptr.dtype.element_ty), mask=nonzero)
        col = tl.arange(0, COLS)[None, :]
        start = 0
        while start < width:
            tile = nonzero[:, None] & (start + col < width)
            x = tl.load(x_ptr + row[:, None] * width + start + col, mask=tile, other=0.0)
            tl.store(values_ptr + slot[:, None] * width + start + col, x, mask=tile)
            start += COLS


@triton.jit
def _tile_of(col_blocks, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A program's rows and columns, and whether they are its rows' first columns: programs run along the rows'
    ``col_blocks`` column blocks, then to the next rows, all on grid axis 0 (axis 1, which CUDA caps at 65,535
    programs, would cap a row at 2 M values)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = (pid // col_blocks) * ROWS + tl.arange(0, ROWS)
    return rows, (pid % col_blocks) * COLS + tl.arange(0, COLS), pid % col_blocks == 0


def _programs(rows: int, row_block: int, width: int, cols: int) -> tuple[int, int]:
    """(programs, column blocks) of a launch over :func:`_tile_of`'s tiles: at least one column block, even for
    empty rows."""
    col_blocks = max(1, triton.cdiv(width, cols))
    return triton.cdiv(rows, row_block) * col_blocks, col_blocks


@triton.jit(do_not_specialize=["cells", "width", "col_blocks"])
def _encode_kernel(values_ptr, signs_ptr, order_ptr, starts_ptr, table_ptr, cells, width, col_blocks,
                   CELLS: tl.constexpr, COLS: tl.constexpr):
    """Each cell's entries (``order`` from ``starts[cell]`` to ``starts[cell + 1]``, item-major entry numbers
    3 item + j) added in float64 in that order, from 0."""
    # [CELLS, 1] columns throughout: Triton 3.6 fails to compile a 1-D load in the loop broadcast to the tile
    # ("mask type matches ptr type" in its layout pass)
    cells_of, cols_of, _ = _tile_of(col_blocks, CELLS, COLS)
    cell = cells_of[:, None]
    col = cols_of[None, :]
    live = cell < cells
    tile = live & (col < width)
    start = tl.load(starts_ptr + cell, mask=live, other=0)
    count = tl.load(starts_ptr + cell + 1, mask=live, other=0) - start
    longest = tl.max(count)
    total = tl.zeros([CELLS, COLS], dtype=tl.float64)
    t = 0
    while t < longest:  # (while, not range: Triton 3.6's interpreter fails on range(runtime value))
        has = t < count
        entry = tl.load(order_ptr + start + t, mask=has, other=0)
        sign = tl.load(signs_ptr + entry, mask=has, other=0).to(tl.float64)
        row = tl.load(values_ptr + entry // 3 * width + col, mask=has & tile, other=0.0).to(tl.float64)
        total = tl.where(has, total + sign * row, total)
        t += 1
    tl.store(table_ptr + cell * width + col, total.to(table_ptr.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["count"])
def _pick_kernel(where_ptr, covered_ptr, key_ptr, position_ptr, least_ptr, pick_ptr, flags_ptr, count,
                 BLOCK: tl.constexpr):
    """Each unresolved candidate alone in one of its cells: the cell of least key (``pick``) and that key
    (``least``; -1 for the others), flagged in ``flags``."""
    candidate = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = candidate < count
    unresolved = live & (tl.load(position_ptr + candidate, mask=live, other=0) < 0)
    least = tl.full([BLOCK], _NONE, dtype=tl.int64)
    pick = tl.zeros([BLOCK], dtype=tl.int64)
    for j in tl.static_range(3):
        cell = tl.load(where_ptr + candidate * 3 + j, mask=unresolved, other=0)
        alone = unresolved & (tl.load(covered_ptr + cell, mask=unresolved, other=0) == 1)
        key = tl.load(key_ptr + cell, mask=alone, other=_NONE)
        better = alone & (key < least)
        least = tl.where(better, key, least)
        pick = tl.where(better, cell, pick)
    ready = least != _NONE
    tl.store(least_ptr + candidate, tl.where(ready, least, -1), mask=live)
    tl.store(pick_ptr + candidate, pick, mask=live)
    tl.store(flags_ptr + tl.where(ready, least, 0), tl.full([BLOCK], 1, dtype=tl.int32), mask=ready)


@triton.jit(do_not_specialize=["count", "width", "c3", "step", "col_blocks"])
def _read_kernel(table_ptr, order_ptr, starts_ptr, signs_ptr, position_ptr, least_ptr, pick_ptr, flags_ptr, rank_ptr,
                 bases_ptr, values_ptr, count, width, c3, step, col_blocks, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The candidates picked this round: position = the round's base + the rank of their key; value = sign times
    the cell's table value minus the cell's other candidates' signed values, subtracted in order of position (all
    of them were resolved in earlier rounds). Clears the flags it read, for the next round."""
    candidate, col, first_columns = _tile_of(col_blocks, ROWS, COLS)
    columns = col < width
    least = tl.load(least_ptr + candidate, mask=candidate < count, other=-1)
    ready = least >= 0
    cell = tl.load(pick_ptr + candidate, mask=ready, other=0)
    j = cell // c3
    start = tl.load(starts_ptr + cell, mask=ready, other=0)
    members = tl.load(starts_ptr + cell + 1, mask=ready, other=0) - start
    tile = ready[:, None] & columns[None, :]
    residual = tl.load(table_ptr + cell[:, None] * width + col[None, :], mask=tile, other=0.0).to(tl.float64)
    longest = tl.max(members)
    previous = tl.full([ROWS], -1, dtype=tl.int64)
    t = 1
    while t < longest:  # the t-th of the others in order of position: the least above the previous one
        has = t < members
        following = tl.full([ROWS], _NONE, dtype=tl.int64)
        other = tl.zeros([ROWS], dtype=tl.int64)
        u = 0
        while u < longest:
            inside = has & (u < members)
            member = tl.load(order_ptr + start + u, mask=inside, other=0) // 3
            position = tl.load(position_ptr + member, mask=inside & (member != candidate), other=_NONE)
            take = (position > previous) & (position < following)
            following = tl.where(take, position, following)
            other = tl.where(take, member, other)
            u += 1
        sign = tl.load(signs_ptr + other * 3 + j, mask=has, other=0).to(tl.float64)
        value = tl.load(values_ptr + other[:, None] * width + col[None, :], mask=has[:, None] & columns[None, :],
                        other=0.0)
        residual = tl.where(has[:, None], residual - sign[:, None] * value, residual)
        previous = following
        t += 1
    sign = tl.load(signs_ptr + candidate * 3 + j, mask=ready, other=0).to(tl.float64)
    tl.store(values_ptr + candidate[:, None] * width + col[None, :], sign[:, None] * residual, mask=tile)
    if first_columns:
        base = tl.load(bases_ptr + step)
        tl.store(position_ptr + candidate, base + tl.load(rank_ptr + least, mask=ready, other=0) - 1, mask=ready)
        tl.store(flags_ptr + tl.where(ready, least, 0), tl.zeros([ROWS], dtype=tl.int32), mask=ready)


@triton.jit(do_not_specialize=["cells", "c3", "keys", "step"])
def _recount_kernel(order_ptr, starts_ptr, position_ptr, covered_ptr, key_ptr, rank_ptr, bases_ptr, cells, c3, keys,
                    step, BLOCK: tl.constexpr):
    """Each cell's unresolved candidates, and its key for the next round: 3 s + j, s the last position resolved in
    it this round (where one candidate is left, the CPU queued the cell at that candidate's removal). Program 0
    writes the next round's base."""
    cell = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = cell < cells
    start = tl.load(starts_ptr + cell, mask=live, other=0)
    members = tl.load(starts_ptr + cell + 1, mask=live, other=0) - start
    base = tl.load(bases_ptr + step)
    longest = tl.max(members)
    unresolved = tl.zeros([BLOCK], dtype=tl.int32)
    last = tl.full([BLOCK], -1, dtype=tl.int64)
    u = 0
    while u < longest:
        inside = u < members
        member = tl.load(order_ptr + start + u, mask=inside, other=0) // 3
        position = tl.load(position_ptr + member, mask=inside, other=-1)
        unresolved += (inside & (position < 0)).to(tl.int32)
        last = tl.where(position >= base, tl.maximum(last, position), last)
        u += 1
    tl.store(covered_ptr + cell, unresolved, mask=live)
    tl.store(key_ptr + cell, 3 * last + cell // c3, mask=live & (last >= 0))
    if tl.program_id(0) == 0:
        tl.store(bases_ptr + step + 1, base + tl.load(rank_ptr + keys - 1))


@triton.jit(do_not_specialize=["programs"])
def _bucket_counts_kernel(x_ptr, table_ptr, counts_ptr, programs, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Each program's count of nonzero rows among its rows of one gradient of a bucket's concatenation, ROWS at a
    time, as the table's columns give them: the gradient's first element and width, the program's first row and the
    row after its last."""
    pid = tl.program_id(0)
    start = tl.load(table_ptr + pid)
    width = tl.load(table_ptr + programs + pid)
    first = tl.load(table_ptr + 2 * programs + pid)
    end = tl.load(table_ptr + 3 * programs + pid)
    found = tl.zeros([ROWS], dtype=tl.int32)
    while first < end:
        row = first + tl.arange(0, ROWS)
        found += _nonzero(x_ptr + start, row, end, width, ROWS, COLS).to(tl.int32)
        first += ROWS
    tl.store(counts_ptr + pid, tl.sum(found))


@triton.jit
def _member_sums_kernel(counts_ptr, bounds_ptr, out_ptr, BLOCK: tl.constexpr):
    """Each gradient's count: the sum of its programs' counts (bounds[m] to bounds[m + 1]), in order."""
    member = tl.program_id(0)
    first, end = tl.load(bounds_ptr + member), tl.load(bounds_ptr + member + 1)
    offsets = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    start = first
    while start < end:
        total += tl.load(counts_ptr + start + offsets, mask=start + offsets < end, other=0)
        start += BLOCK
    tl.store(out_ptr + member, tl.sum(total, axis=0).to(tl.float32))


def sketch_bucket_counts(flat: torch.Tensor, items: Sequence[int], widths: Sequence[int]) -> torch.Tensor:
    """The nonzero rows (as :func:`sketch_rows` finds them) of each gradient of a bucket's concatenation ``flat``
    (contiguous; gradient m is ``items[m]`` rows of ``widths[m]`` values, back to back), float32 [gradients], in two
    launches, with no host sync: the sketch method's vote for a bucket."""
    if flat.dim() != 1 or not flat.is_contiguous() or sum(n * w for n, w in zip(items, widths, strict=True)) != \
            flat.numel():
        raise ValueError(f"sketch_bucket_counts: a contiguous 1-D concatenation of the gradients' {sum(items)} rows, "
                         f"got shape {tuple(flat.shape)}")
    table, bounds = _bucket_table(flat.device, tuple(items), tuple(widths))
    programs = table.shape[1]
    counts = torch.empty(programs, dtype=torch.int32, device=flat.device)
    out = torch.empty(len(items), dtype=torch.float32, device=flat.device)
    if programs:
        _bucket_counts_kernel[(programs,)](flat, table, counts, programs, ROWS=_BUCKET_ROWS, COLS=_MAX_COLS)
    if len(items):
        _member_sums_kernel[(len(items),)](counts, bounds, out, BLOCK=_BLOCK)
    return out


@lru_cache(maxsize=256)
def _bucket_table(device: torch.device, items: tuple[int, ...], widths: tuple[int, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sketch_bucket_counts`' tables for a bucket's layout, on ``device``: per program (columns) its gradient's
    first element and width, its own first row and the row after its last (int64 [4, programs]: _BUCKET_ROWS rows a
    program, or as many whole tiles of them as hold about _BUCKET_VALUES values where rows are narrower); per gradient
    its first program and, last, the programs' count (int64 [gradients + 1]). A bucket's layout repeats every step:
    each is made once and kept, its copy to a GPU from pinned memory, with no wait, on the stream of the step that
    made it (the optimizer's work runs on one)."""
    columns: list[list[int]] = [[], [], [], []]
    bounds, start = [0], 0
    for n, width in zip(items, widths, strict=True):
        per_program = max(1, _BUCKET_VALUES // max(width, 1) // _BUCKET_ROWS) * _BUCKET_ROWS
        for first in range(0, n if width else 0, per_program):
            for column, value in zip(columns, (start, width, first, min(n, first + per_program)), strict=True):
                column.append(value)
        bounds.append(len(columns[0]))
        start += n * width
    flat = [value for column in columns for value in column]
    return kept_table(flat, device).view(4, len(columns[0])), kept_table(bounds, device)


def _hash(items: torch.Tensor, seed: int, c3: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cells ([k, 3] int64) and signs ([k, 3] int8, +-1) of ``items``."""
    k = items.numel()
    cells = torch.empty(k, 3, dtype=torch.int64, device=items.device)
    signs = torch.empty(k, 3, dtype=torch.int8, device=items.device)
    if k:
        _hash_kernel[(triton.cdiv(k, _BLOCK),)](items.contiguous(), cells, signs, k, seed, c3, BLOCK=_BLOCK)
    return cells, signs


def _by_cell(cells: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries (3 item + j) sorted by cell, items in order within a cell (a stable sort), and where each of the
    ``total`` cells starts among them (``total`` + 1 offsets). Sort and search are deterministic on CUDA."""
    ordered, order = torch.sort(cells.view(-1), stable=True)
    starts = torch.searchsorted(ordered, torch.arange(total + 1, device=cells.device))
    return order, starts


def _tile(width: int, block: int = _BLOCK) -> tuple[int, int]:
    """Rows and columns of a program's tile of ``block`` values for rows of ``width`` values."""
    cols = min(_MAX_COLS, triton.next_power_of_2(max(width, 1)))
    return block // cols, cols


def sketch_rows(x: torch.Tensor, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``x`` ([items, width]) that hold a value other than 0 (NaN included, -0 not), ascending: their
    values ([count, width], x's dtype) and indices (``index_dtype``), as ``x[x.any(1).nonzero()]`` gives them. Two
    passes over x and a scan of the programs' counts, whose total sizes the outputs: one host sync."""
    items, width = x.shape
    x = x.contiguous()
    rows, cols = _tile(width, _ROWS_BLOCK)
    programs = triton.cdiv(items, rows)
    found = torch.empty(programs, dtype=torch.int64, device=x.device)
    if programs and width:
        _row_counts_kernel[(programs,)](x, found, items, width, ROWS=rows, COLS=cols, num_warps=_ROWS_WARPS)
    count = int(found.cumsum_(0)[-1]) if programs and width else 0  # the host sync
    values = torch.empty(count, width, dtype=x.dtype, device=x.device)
    indices = torch.empty(count, dtype=index_dtype, device=x.device)
    if count:
        _place_rows_kernel[(programs,)](x, found, values, indices, items, width, ROWS=rows, COLS=cols,
                                        num_warps=_ROWS_WARPS)
    return values, indices


def sketch_candidates(packed: torch.Tensor, items: int, seed: int, hashes: int) -> torch.Tensor:
    """``sketch_candidates`` of the CPU kernels on the device: every item of [0, ``items``) that passes the packed
    filter (uint8), ascending (int64). Their count sizes the sketch, so it is read on the host: one sync."""
    passed = torch.empty(items, dtype=torch.int8, device=packed.device)
    if items:
        _filter_kernel[(triton.cdiv(items, _BLOCK),)](packed.contiguous(), passed, items, seed, packed.numel() * 8,
                                                      hashes, BLOCK=_BLOCK)
    return passed.nonzero().view(-1)


def sketch_encode(values: torch.Tensor, items: torch.Tensor, seed: int, c3: int, dtype: torch.dtype) -> torch.Tensor:
    """The count sketch ([3 ``c3``, block] of ``dtype``) of ``values`` ([k, block]) at ``items``: each cell's sum
    in float64 in item order, then rounded to ``dtype``, as ``encode`` computes it on the CPU."""
    width = values.shape[1]
    table = torch.zeros(3 * c3, width, dtype=dtype, device=values.device)
    if items.numel() == 0 or width == 0:
        return table
    cells, signs = _hash(items, seed, c3)
    order, starts = _by_cell(cells, 3 * c3)
    rows, cols = _tile(width)
    programs, col_blocks = _programs(3 * c3, rows, width, cols)
    _encode_kernel[(programs,)](values.contiguous(), signs, order, starts, table, 3 * c3, width, col_blocks,
                                CELLS=rows, COLS=cols, enable_fp_fusion=False)
    return table


def sketch_peel(candidates: torch.Tensor, table: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sketch_peel`` of the CPU kernels on the device: the candidates' values ([C, block] float64; 0 where not
    resolved) and how many were resolved (a 0-d int64 CPU tensor), bit for bit the CPU's."""
    count, cells, width = candidates.numel(), table.shape[0], table.shape[1]
    device = table.device
    values = torch.zeros(count, width, dtype=torch.float64, device=device)
    if count == 0:
        return values, torch.tensor(0)
    c3 = cells // 3
    where, signs = _hash(candidates, seed, c3)
    order, starts = _by_cell(where, cells)
    covered = (starts[1:] - starts[:-1]).to(torch.int32)
    key = torch.arange(cells, device=device)  # round 0: the cells covered once, ascending
    position = torch.full((count,), -1, dtype=torch.int64, device=device)
    least = torch.empty(count, dtype=torch.int64, device=device)
    pick = torch.empty(count, dtype=torch.int64, device=device)
    keys = max(cells, 3 * count)  # round 0's keys are cells, later ones 3 s + j
    flags = torch.zeros(keys, dtype=torch.int32, device=device)
    rank = torch.empty(keys, dtype=torch.int64, device=device)
    bases = torch.zeros(ROUNDS + 1, dtype=torch.int64, device=device)  # resolved before each round of a batch
    table = table.contiguous()
    rows, cols = _tile(width)
    programs, col_blocks = _programs(count, rows, width, cols)
    while True:
        for step in range(ROUNDS):
            _pick_kernel[(triton.cdiv(count, _BLOCK),)](where, covered, key, position, least, pick, flags, count,
                                                        BLOCK=_BLOCK)
            torch.cumsum(flags, 0, dtype=torch.int64, out=rank)
            _read_kernel[(programs,)](table, order, starts, signs, position, least, pick, flags, rank, bases, values,
                                      count, width, c3, step, col_blocks, ROWS=rows, COLS=cols,
                                      enable_fp_fusion=False)
            _recount_kernel[(triton.cdiv(cells, _BLOCK),)](order, starts, position, covered, key, rank, bases, cells,
                                                           c3, keys, step, BLOCK=_BLOCK)
        before, resolved = bases[-2:].tolist()  # the batch's one host sync
        if resolved in (before, count):  # stuck (at the 2-core) or complete
            return values, torch.tensor(resolved)
        bases[0] = resolved
