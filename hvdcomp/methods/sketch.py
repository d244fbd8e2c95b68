"""Lossless homomorphic compression: sparse gradients summed in compressed form and decoded exactly (Li et al.,
"Accelerating Distributed Deep Learning using Lossless Homomorphic Compression", arXiv:2402.07529, 2024).

Each rank holds a sparse gradient: items (an embedding's rows, or single entries) with their values. Its
compressed form has two parts that aggregate across ranks without decoding (Section 3 of the paper):

* a **count sketch** Y of 3 sub-tables of c cells: item i lands in one cell h_j(i) of each sub-table j with a sign
  s_j(i) in {-1, +1}, and Y[h_j(i)] += s_j(i) x_i. Y is linear, Y(sum_r X_r) = sum_r Y(X_r): Horovod's allreduce
  sums it (float32, or float64 with ``dtype``);
* a **Bloom filter** of the nonzero items, aggregated by OR. Horovod has no bitwise OR: ``filter_collective``
  ``allgather`` gathers the packed filters (bits/8 bytes per rank) and ORs them; ``allreduce`` sums one float16
  flag per bit and tests > 0 (2 bytes per bit, but an allreduce's traffic does not grow with the ranks). ``auto``
  takes the fewer bytes a rank receives: allgather below 32 ranks.

Decoding: the candidates are the items that pass the aggregated filter (every true item and a few false positives);
**peeling** repeatedly takes a cell covered by exactly one unresolved candidate, reads the candidate's value
(x = s_j Y[h_j]) and subtracts it from its other cells. A false positive is in no rank's sketch and decodes to 0. It
succeeds when the sketch has more than 1.222 cells per candidate (the peeling threshold of random 3-uniform
hypergraphs) with a margin for finite sizes; whether it completes depends only on the candidates and the hash
functions, never on the values, so every rank (all decode the same sums) reaches the same verdict.

The sizes follow each step's data, from values every rank holds:

* T, the items summed over ranks (an agreed sum in the step's vote), bounds the union. The filter has
  ln(1/p) / ln(2)^2 bits per item of T and round(ln 2 x bits / T) hash functions; its false-positive rate p
  (``fp_rate``; default: the rate that minimizes the bytes of filter plus sketch, 0.024 N T / n for N ranks and n
  items) is capped at 1/4. If even T / N items (the least the union can be) would make a sketch no smaller in bytes
  than the dense tensor, the step goes dense at once.
* C, the candidates, the same on every rank: the sketch gets 3 ceil((1.222 ``margin`` C + ``slack``) / 3) cells;
  if those are not fewer bytes than the dense float32 tensor, the tensor is summed dense (exact) instead.
* If peeling does not complete (with the defaults, perf/codecs/sketch_decode.py measured it in 4% of sketches of 100
  candidates, 0.7% at 1,000, none of 300 at 10,000 and of 50 at 100,000: small 2-cores, two candidates sharing all
  three cells; ``margin`` < 1 forces it), every rank knows it and that tensor falls back, for that step, to
  gathering the sparse payloads and adding them in rank order (top-k's exact allgather path).

Hash functions are drawn from the parameter's rank-independent seed and the step, so a support that peels badly in
one step does not repeat the failure in the next. Decoding is exact up to float rounding: residuals are float64,
so with ``dtype: float64`` the sum of all ranks' values is exact wherever every partial sum of the m float32 values
meeting in one cell (ranks x rows) fits float64's 53 bits, that is where they are within 2^(29 - ceil(log2 m)) of
each other in magnitude (2^26 for 8 values); false positives then decode to exactly 0: lossless. The default
float32 cells halve the sketch's bytes but are not lossless: a cell's sum is rounded to float32, so an entry sharing
a cell with larger ones keeps only the bits left to it (an absolute error of about 2^-24 of the cell's magnitude: up
to 8.5e-6 on unit Gaussian rows summed over 8 ranks in docs/cluster.md), and a false positive may decode to such a
residue instead of 0.

Two ways to use it:

* ``method: sketch``: the gradient as it is, losslessly. A natively sparse gradient (``nn.Embedding(...,
  sparse=True)``) is taken as its rows, without densifying it; a dense one as its nonzero rows (entries, for 1-D
  tensors; counted on the device for the vote, whose sum comes back on the host, then found, on CUDA by the Triton
  kernels with one host sync, after it; a sparse CUDA gradient is coalesced to count its rows, one host sync in the
  backward hook, and again to encode them, one more after the vote).
* ``collective: sketch`` for the sparsifiers (top-k, threshold, DGC; their error feedback as usual): their payloads
  are summed in compressed form instead of gathered, so a rank receives about the union of the supports rather
  than N x k entries.

In a bucket (``bucket_cap_mb``) the sketch method sums each gradient as it would alone (its own rows, sizes, hash
functions and path; its context is the bucket's, derived per member), with one vote for the bucket and each round's
requests as one: one filter collective, one allreduce of the dense gradients (concatenated), the payloads that go
dense and the sketches, one gather of the payloads whose peeling did not complete. On the Triton kernels (CUDA) the
bare method's bucket of dense float32 (or half) gradients that went dense in the last step is concatenated first and
its rows counted on the concatenation in two launches. The sparsifiers' payloads (``collective: sketch``) bucket as
their methods do: the bucket's concatenation is compressed as one tensor.

Options (``collective_options``): ``margin`` (default 1.1), ``slack`` (cells added for small sketches, default 24),
``fp_rate``, ``dtype`` (float32 or float64), ``filter_collective`` (auto, allgather or allreduce).

Every device computes the same bits. On CPU tensors decoding runs in fused C++ (``hvdcomp/kernels/sketch.cpp``:
the candidates, then sequential peeling), and the sketch is encoded by a sequential ``index_add_``. On CUDA tensors
the Triton kernels (:mod:`hvdcomp.kernels.gpu.sketch`) do all three on the device without float atomics: each
cell's sum is added in item order, and peeling runs in rounds that reproduce the C++ queue's order, so the table and
the decoded values equal the CPU's to the last bit, float32 cells included; the host waits once for the
candidates' count and once per 20 rounds of peeling (about 16 at the default sizes). Without Triton, CUDA tensors
are decoded by the C++ kernels on the host (the filter and the sketch are copied over; the decoded rows come back),
and encoded by ``index_add_``, whose float64 atomics agree across ranks only where the sums are exact (as above).
Where the C++ kernels cannot be built either, the PyTorch path here decodes on the tensors' device, peeling in
rounds (on CUDA its float64 scatter-adds are likewise deterministic only where they are exact). It peels in another
order than the kernels, so with float32 cells its decoded values may differ from theirs in the last bits; every
rank's plan names its kernels, and ranks that would mix paths are refused.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch

from hvdcomp import check
from hvdcomp.compressor import Context, State, derive_seed
from hvdcomp.kernels import cpu_kernels, is_triton, kernels_for
from hvdcomp.methods.topk import Sparse, block, index_dtype
from hvdcomp.reductions import MEMBERS, Phase, ReductionMethod
from hvdcomp.requests import Agree, Allgather, Allreduce, Reduction, Request, dense_concat
from hvdcomp.wire import Payload

if TYPE_CHECKING:
    from hvdcomp.perfmodel.schema import Encoded

#: cells per item at which peeling a random 3-uniform hypergraph succeeds with high probability (1 / 0.8185)
PEELING_THRESHOLD = 1.222
#: below this many ranks a gathered filter (bits / 8 bytes each) is smaller than an allreduce of float16 flags
FILTER_ALLGATHER_MAX_RANKS = 32
_MASK32 = 0xFFFFFFFF
_CHUNK = 1 << 20  # items tested against the filter at once on the PyTorch path


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (as uint64) values."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors, bit for bit as ``common.h`` (int64 products wrap as uint64's)."""
    z = z + _GOLDEN
    z = (z ^ _shift(z, 30)) * _MIX1
    z = (z ^ _shift(z, 27)) * _MIX2
    return z ^ _shift(z, 31)


def cells_of(items: torch.Tensor, seed: int, c3: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sketch cells ([k, 3], one per sub-table of ``c3`` cells) and signs ([k, 3], float64) of ``items``."""
    h = mix(items.long() ^ seed)
    g = mix(h)
    hashes = torch.stack([h & _MASK32, _shift(h, 32), g & _MASK32], dim=1)
    offsets = torch.arange(3, device=items.device) * c3
    cells = offsets + ((hashes * c3) >> 32)
    signs = 1.0 - 2.0 * ((_shift(g, 32).unsqueeze(1) >> torch.arange(3, device=items.device)) & 1).double()
    return cells, signs


def filter_bits(items: torch.Tensor, seed: int, bits: int, hashes: int) -> torch.Tensor:
    """The Bloom filter's bit positions ([k, hashes]) of ``items`` (double hashing: h1 + j h2 mod bits)."""
    f = mix(items.long() ^ seed)
    h1, h2 = f & _MASK32, _shift(f, 32) | 1
    return (h1.unsqueeze(1) + torch.arange(hashes, device=items.device) * h2.unsqueeze(1)) % bits


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """A bool vector (length a multiple of 8) as bytes, bit b at byte b // 8, bit b % 8."""
    weights = torch.ones(8, dtype=torch.uint8, device=flags.device) << torch.arange(8, dtype=torch.uint8,
                                                                                     device=flags.device)
    return (flags.view(-1, 8).to(torch.uint8) * weights).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).bool().view(-1)


def bloom(items: torch.Tensor, seed: int, bits: int, hashes: int) -> torch.Tensor:
    """The packed Bloom filter (bits / 8 bytes) of ``items``."""
    flags = torch.zeros(bits, dtype=torch.bool, device=items.device)
    flags[filter_bits(items, seed, bits, hashes).view(-1)] = True
    return pack_bits(flags)


def filter_size(total: int, items: int, ranks: int, fp_rate: float | None) -> tuple[int, int]:
    """Bits (a multiple of 64) and hash functions of a Bloom filter for ``total`` items out of ``items``."""
    p = fp_rate if fp_rate is not None else 0.024 * ranks * total / items
    p = min(0.25, max(p, 1e-9))
    bits = 64 * math.ceil(total * math.log(1 / p) / math.log(2) ** 2 / 64)
    return bits, max(1, round(math.log(2) * bits / total))


def _triton_kernels(device: torch.device) -> ModuleType | None:
    """The Triton kernels where they serve ``device``'s sketches (CUDA, or any device under ``HVDCOMP_KERNELS=triton``:
    :func:`hvdcomp.kernels.kernels_for`), else None."""
    kernels = kernels_for(device)
    return kernels if is_triton(kernels) else None


def candidates(packed: torch.Tensor, items: int, seed: int, hashes: int) -> torch.Tensor:
    """Every item of [0, ``items``) that passes the packed filter, ascending (int64)."""
    device_kernels = _triton_kernels(packed.device)
    if device_kernels is not None:  # CUDA: tested on the device, the C++ scan's items
        return device_kernels.sketch_candidates(packed, items, seed, hashes)
    kernels = cpu_kernels()
    if kernels is not None:  # CUDA without Triton too: the filter is small, and the host's scan gives the same bits
        return kernels.sketch_candidates(packed.cpu(), items, seed, hashes).to(packed.device)
    flags = unpack_bits(packed)
    found = []
    for start in range(0, items, _CHUNK):
        chunk = torch.arange(start, min(items, start + _CHUNK), device=packed.device)
        found.append(chunk[flags[filter_bits(chunk, seed, flags.numel(), hashes)].all(1)])
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64, device=packed.device)


def encode(values: torch.Tensor, items: torch.Tensor, seed: int, c3: int, dtype: torch.dtype) -> torch.Tensor:
    """The count sketch ([3 c3, block] of ``dtype``) of ``values`` ([k, block]) at ``items``: each cell's sum in
    float64 in item order (``index_add_`` on CPU; on CUDA the Triton kernel's fixed order, the same bits, where the
    order of float atomics would vary), rounded to ``dtype`` once."""
    device_kernels = _triton_kernels(values.device)
    if device_kernels is not None:
        return device_kernels.sketch_encode(values, items, seed, c3, dtype)
    cells, signs = cells_of(items, seed, c3)
    width = values.shape[1]
    table = torch.zeros(3 * c3, width, dtype=torch.float64, device=values.device)
    table.index_add_(0, cells.view(-1), (signs.unsqueeze(-1) * values.double().unsqueeze(1)).view(-1, width))
    return table.to(dtype)


def peel(found: torch.Tensor, table: torch.Tensor, seed: int) -> tuple[torch.Tensor, int]:
    """Decodes the summed sketch over the candidates ``found``: their values ([C, block], float64) and how many
    were resolved (all of them when peeling completes)."""
    device_kernels = _triton_kernels(table.device)
    if device_kernels is not None:  # CUDA: in rounds on the device, the C++ kernel's order and bits
        values, resolved = device_kernels.sketch_peel(found, table, seed)
        return values, int(resolved)
    kernels = cpu_kernels()
    if kernels is not None:  # CUDA without Triton too: sequential peeling on the host is deterministic
        values, resolved = kernels.sketch_peel(found.cpu(), table.cpu().contiguous(), seed)
        return values.to(table.device), int(resolved)
    # PyTorch path: peel in rounds. Each round every unresolved candidate that is alone in one of its cells (the
    # first such, in sub-table order) reads its value there; then all of them leave their cells at once.
    count, width = found.numel(), table.shape[1]
    cells, signs = cells_of(found, seed, table.shape[0] // 3)
    residual = table.to(torch.float64, copy=True)
    values = torch.zeros(count, width, dtype=torch.float64, device=table.device)
    active = torch.arange(count, device=table.device)
    while active.numel():
        where = cells[active]
        covered = torch.zeros(table.shape[0], dtype=torch.int64, device=table.device)
        covered.index_add_(0, where.view(-1), torch.ones_like(where.view(-1)))
        alone = covered[where] == 1
        ready = alone.any(1)
        if not bool(ready.any()):
            break
        picked, first = active[ready], alone[ready].int().argmax(1, keepdim=True)
        cell = where[ready].gather(1, first).view(-1)
        value = signs[picked].gather(1, first) * residual[cell]
        values[picked] = value
        contributions = (signs[picked].unsqueeze(-1) * value.unsqueeze(1)).view(-1, width)
        residual.index_add_(0, cells[picked].view(-1), contributions, alpha=-1)
        active = active[~ready]
    return values, count - active.numel()


def sketch_cells(found: int, margin: float, slack: int) -> int:
    """Cells per sub-table for ``found`` candidates."""
    return max(1, math.ceil((PEELING_THRESHOLD * margin * found + slack) / 3))


class Sketch(Sparse):
    """A gradient as it is (natively sparse, or its nonzero rows), summed losslessly by the homomorphic sketch
    (:class:`SketchReduction`, whose ``collective_options`` set its sizes)."""

    name = "sketch"
    unbiased = True
    accepts_sparse = True
    reduction = "sketch"

    def fixed_size_on(self, device: torch.device) -> bool:
        """Each rank sends the rows it has: sizes differ per rank on every device."""
        return False

    @staticmethod
    def items(shape: torch.Size) -> int:
        """Rows for tensors of 2 or more dimensions, entries for 1-D ones."""
        return shape[0] if len(shape) > 1 else math.prod(shape)

    def agree(self, tensor: torch.Tensor, state: State, ctx: Context) -> Agree:
        """The rows this rank sends, summed over ranks (the sizes are set from it): counted on the device, so that
        finding them (on CUDA a host sync) waits until after the step's vote."""
        if tensor.is_sparse and (tensor.sparse_dim() == 1 or tensor.dim() == 1):
            count = torch.full((1,), float(tensor.detach().coalesce()._nnz()), device=tensor.device)
        else:
            dense = tensor.to_dense() if tensor.is_sparse else tensor.detach()
            items = self.items(tensor.shape)
            count = dense.reshape(items, block(tensor.shape, items)).any(1).sum(dtype=torch.float32).reshape(1)
        return Agree(count, "sum", host=True)

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        shape = tensor.shape
        n = self.items(shape)
        if tensor.is_sparse:
            if tensor.sparse_dim() != 1 and len(shape) > 1:
                tensor = tensor.to_dense()  # element-sparse over a matrix: take its rows
            else:
                coalesced = tensor.detach().coalesce()
                rows = coalesced.indices()[0]
                return [coalesced.values().reshape(-1), rows.to(index_dtype(n))], (shape, n, coalesced.dtype)
        x = tensor.detach().reshape(n, block(shape, n))
        device_kernels = _triton_kernels(x.device)
        if device_kernels is not None:  # CUDA: two passes and a scan (its total read on the host)
            values, rows = device_kernels.sketch_rows(x, index_dtype(n))
            return [values.reshape(-1), rows], (shape, n, x.dtype)
        rows = x.any(1).nonzero().view(-1)
        return [x[rows].reshape(-1), rows.to(index_dtype(n))], (shape, n, x.dtype)


class SketchReduction(ReductionMethod):
    """Sparse payloads summed as a count sketch plus a Bloom filter (see the module docstring for the options).

    Requests, the same sequence on every rank: Agree(sum of items; a compressor that makes its own request, the
    sketch method, must ask for exactly that sum); none more if it is 0; then, unless dense pays from the start, the
    filter (Allgather or Allreduce); then Allreduce of the sketch, or of the dense tensor when the sketch would
    be no smaller; and, if peeling did not complete, Allgather of the payloads. Each rank's last step is kept in
    ``state["sketch"]`` (items, candidates, cells, path). A bucket of the sketch method's gradients
    (:meth:`reduce_bucket`) makes one such sequence for all of them: one Agree of every gradient's items, then each
    round's requests as one; each gradient's last step is kept in its member's state (``state[MEMBERS][i]``).
    """

    name = "sketch"
    selectable = True

    def __init__(self, compressor: Any, margin: float = 1.1, slack: int = 24, fp_rate: float | None = None,
                 dtype: str = "float32", filter_collective: str = "auto") -> None:
        super().__init__(compressor)
        check.number(self.name, "margin", margin, gt=0)
        check.integer(self.name, "slack", slack, ge=0)
        check.number(self.name, "fp_rate", fp_rate, gt=0, lt=1, optional=True)
        check.choice(self.name, "dtype", dtype, ("float32", "float64"))
        check.choice(self.name, "filter_collective", filter_collective, ("auto", "allgather", "allreduce"))
        self.margin, self.slack, self.fp_rate = float(margin), slack, fp_rate
        self.dtype, self.filter_collective = dtype, filter_collective
        self._members_alone = isinstance(compressor.unwrapped(), Sketch)  # a bucket's gradients each as alone

    @classmethod
    def rejects(cls, traits: Any) -> str | None:
        if traits.sparse_payload:
            return None
        return (f"{traits!r} does not send (values, indices) payloads; the sketch collective sums sparse payloads "
                "(topk, threshold, dgc, sketch)")

    def reduce(self, tensor: torch.Tensor, state: State, ctx: Context) -> Reduction:
        request = self.compressor.agree(tensor, state, ctx)  # the sketch method counts rows on the device
        compressed = None
        if request is None:  # a sparsifier: its payload's size is known on the host once it is compressed
            compressed = self.compressor.compress(tensor, state, ctx)
            entries = compressed[0][1].numel()  # the payload's indices
            request = Agree(torch.full((1,), float(entries), device=tensor.device), "sum", host=True)
        totals = yield request  # on the host: the vote's transfer (Agree.host)
        (total,) = yield from self._sum([tensor], [compressed], [state], [ctx], totals)
        return total

    def init_bucket_state(self, tensors: Sequence[torch.Tensor], ctx: Context) -> State:
        """The sketch method's bucket: each gradient's own state; a sparsifier's: its concatenation's."""
        if self._members_alone:
            return self.init_member_states(tensors, ctx)
        return super().init_bucket_state(tensors, ctx)

    def reduce_bucket(self, tensors: Sequence[torch.Tensor], state: State, ctx: Context) -> Reduction:
        """The sketch method's bucket: each gradient summed as alone (its own rows, sizes and path), with one vote
        for the bucket and each round's collectives as one request (:meth:`_sum`). A sparsifier's bucket is its
        concatenation, compressed as one tensor (the default). Each sum is flat.

        On the Triton kernels (CUDA), a bucket of the bare method's dense gradients (float32 or a half type, which
        float32 holds exactly) that all went dense at once in the last step (or have no last step) is concatenated
        first and its rows counted on the concatenation in two launches
        (:func:`hvdcomp.kernels.gpu.sketch.sketch_bucket_counts`), where each gradient's count took two; the
        concatenation is what the allreduce sends where they go dense at once again (where one is sketched instead,
        it was copied for nothing, and the next step counts gradient by gradient)."""
        if not self._members_alone:
            return (yield from super().reduce_bucket(tensors, state, ctx))
        states, contexts = state[MEMBERS], self.member_contexts(ctx, len(tensors))
        device_kernels = _triton_kernels(tensors[0].device)
        concatenated = None
        exact_in_float32 = (torch.float32, torch.float16, torch.bfloat16)
        if device_kernels is not None and self.compressor.unwrapped() is self.compressor \
                and all(not t.is_sparse and t.dtype in exact_in_float32 for t in tensors) \
                and all(member.get("sketch", {}).get("path", "dense") == "dense" for member in states):
            concatenated = dense_concat(tensors)
            items = [Sketch.items(tensor.shape) for tensor in tensors]
            counts = device_kernels.sketch_bucket_counts(
                concatenated, items, [block(tensor.shape, n) for tensor, n in zip(tensors, items, strict=True)])
        else:
            counts = torch.cat([self.compressor.agree(tensor, member_state, member).values
                                for tensor, member_state, member in zip(tensors, states, contexts, strict=True)])
        totals = yield Agree(counts, "sum", host=True)
        sums = yield from self._sum(tensors, [None] * len(tensors), states, contexts, totals, concatenated)
        return [total.reshape(-1) for total in sums]

    def _sum(self, tensors: Sequence[torch.Tensor], compressed: list[tuple[Payload, Any] | None],
             states: Sequence[State], contexts: Sequence[Context], totals: torch.Tensor,
             concatenated: torch.Tensor | None = None) -> Generator[Request, Any, list[torch.Tensor]]:
        """The sums over ranks of ``tensors`` (one, or a bucket's), from each one's payload items summed over ranks
        (``totals``, the vote's, on the host) and its payload (``compressed``: a sparsifier's, made before the vote;
        None: the sketch method's, whose rows are found now and written into ``compressed``). Each takes its own path
        (the class docstring); their requests of one round go as one: the filters, then the dense tensors and the
        sketches, then the payloads whose peeling did not complete. ``concatenated``: the tensors' dense
        concatenation, already made, sent as it is where every one of them goes dense at once."""
        bare = self.compressor.unwrapped() is self.compressor
        results: list[torch.Tensor | None] = [None] * len(tensors)
        as_they_are: list[int] = []  # the gradients sent dense at once, in one concatenation
        densified: dict[int, torch.Tensor] = {}  # payloads sent as the dense tensors they came from
        filters: dict[int, tuple[int, int, int]] = {}  # the filter's seed, bits and hashes
        for i, (tensor, state, ctx) in enumerate(zip(tensors, states, contexts, strict=True)):
            summed = round(float(totals[i]))
            stats = state["sketch"] = {"items": summed, "candidates": 0, "cells": 0, "path": "empty"}
            if compressed[i] is None:  # the sketch method: its rows are found once the vote has its sum
                if bare and self._dense_at_once(summed, Sketch.items(tensor.shape), ctx):
                    # the bare method, where no sketch can pay: its gradient as it is, not its rows found first (a
                    # memory wrapper's compress updates its state: a wrapped method compresses as below)
                    stats["path"] = "dense"
                    as_they_are.append(i)
                    continue
                compressed[i] = self.compressor.compress(tensor, state, ctx, totals[i])
            (values, items), (shape, n, _) = compressed[i]
            if summed == 0:
                results[i] = torch.zeros(shape, dtype=torch.float32, device=values.device)
            elif self._dense_at_once(summed, n, ctx):  # the sparsifiers' payloads, or a wrapped method's rows
                stats["path"] = "dense"
                densified[i] = self._densified(values, items, n, shape)
            else:
                bits, hashes = filter_size(summed, n, ctx.size, self.fp_rate)
                filters[i] = derive_seed(ctx.shared_seed, "filter", ctx.step), bits, hashes
        unions = yield from self._unions([bloom(compressed[i][0][1], *filters[i]) for i in filters], contexts[0].size)
        sketched: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # candidates, hash seed, sketch
        for i, union in zip(filters, unions, strict=True):
            (values, items), (shape, n, _) = compressed[i]
            found = candidates(union, n, filters[i][0], filters[i][2])
            c3 = sketch_cells(found.numel(), self.margin, self.slack)
            states[i]["sketch"].update(candidates=found.numel(), cells=3 * c3)
            if self._larger_than_dense(c3, n):
                states[i]["sketch"]["path"] = "dense"
                densified[i] = self._densified(values, items, n, shape)
            else:
                seed = derive_seed(contexts[i].shared_seed, "sketch", contexts[i].step)
                rows = values.view(-1, block(shape, n))
                sketched[i] = found, seed, encode(rows, items, seed, c3, getattr(torch, self.dtype))
        if concatenated is None or len(as_they_are) < len(tensors):
            concatenated = dense_concat([tensors[i] for i in as_they_are]) if as_they_are else None
        dense = [] if concatenated is None else [concatenated]
        if dense or densified or sketched:
            reduced = yield Allreduce([*dense, *densified.values(), *(table for *_, table in sketched.values())])
            if dense:
                sizes = [tensors[i].numel() for i in as_they_are]
                for i, total in zip(as_they_are, reduced[0].split(sizes), strict=True):
                    results[i] = total.view(tensors[i].shape)
            tables = reduced[len(dense) + len(densified):]
            for i, total in zip(densified, reduced[len(dense):len(dense) + len(densified)], strict=True):
                results[i] = total.view(compressed[i][1][0])
            fallback = []
            for i, table in zip(sketched, tables, strict=True):
                found, seed, _ = sketched[i]
                decoded, resolved = peel(found, table, seed)
                if resolved < found.numel():  # the same verdict on every rank
                    states[i]["sketch"]["path"] = "fallback"
                    fallback.append(i)
                    continue
                states[i]["sketch"]["path"] = "sketch"
                shape, n, _ = compressed[i][1]
                result = torch.zeros(n, block(shape, n), dtype=torch.float32, device=table.device)
                results[i] = result.index_copy_(0, found, decoded.float()).view(shape)
            if fallback:  # gather the payloads, add them in rank order (top-k's exact path)
                parts = [part for i in fallback for part in compressed[i][0]]
                gathered = yield Allgather(parts, fixed_size=self.compressor.fixed_size_on(parts[0].device))
                for j, i in enumerate(fallback):
                    payloads = [payload[2 * j:2 * j + 2] for payload in gathered]
                    results[i] = self.compressor.aggregate(payloads, compressed[i][1]).float()
        return cast("list[torch.Tensor]", results)  # each path above has set its tensors' results

    def _unions(self, owns: list[torch.Tensor], ranks: int) -> Generator[Request, Any, list[torch.Tensor]]:
        """The packed filters ``owns`` ORed over ranks, in one collective (none if there are none)."""
        if not owns:
            return []
        if self._filter_collective(ranks) == "allgather":
            gathered = yield Allgather(owns)
            unions = [own.clone() for own in gathered[0]]
            for other in gathered[1:]:
                for union, bits in zip(unions, other, strict=True):
                    union.bitwise_or_(bits)
            return unions
        flags = yield Allreduce([unpack_bits(own).to(torch.float16) for own in owns])
        return [pack_bits(summed > 0) for summed in flags]

    def _dense_at_once(self, summed: int, items: int, ctx: Context) -> bool:
        """Whether ``summed`` payload items over ranks (the vote's) make even the smallest union's sketch, summed // N
        items, no smaller than the dense tensor of ``items`` (at least one: none takes the empty path)."""
        return summed > 0 and self._larger_than_dense(sketch_cells(summed // ctx.size, self.margin, self.slack), items)

    def _larger_than_dense(self, c3: int, items: int) -> bool:
        """Whether a sketch of 3 ``c3`` cells is no smaller in bytes than the dense float32 tensor."""
        return 3 * c3 * getattr(torch, self.dtype).itemsize >= 4 * items

    def _filter_collective(self, ranks: int) -> str:
        if self.filter_collective != "auto":
            return self.filter_collective
        return "allgather" if ranks < FILTER_ALLGATHER_MAX_RANKS else "allreduce"

    @staticmethod
    def _densified(values: torch.Tensor, items: torch.Tensor, n: int, shape: torch.Size) -> torch.Tensor:
        """A payload's rows as the dense float32 tensor [n, block] they came from."""
        dense = torch.zeros(n, block(shape, n), dtype=torch.float32, device=values.device)
        return dense.index_add_(0, items.long(), values.float().view(-1, dense.shape[1]))

    # Costs for the performance model, from a payload of 4-byte values and 4-byte indices measured on one rank:
    # disjoint supports (the union is N payloads, the model's upper bound), a filter of about 10 bits per item,
    # gathered packed or, from FILTER_ALLGATHER_MAX_RANKS ranks (filter_collective: auto), summed as float16 flags.

    @classmethod
    def phases(cls, e: Encoded, workers: int) -> list[Phase]:
        union = workers * e.wire_bytes / 8
        bits = union * 10
        gathered = workers < FILTER_ALLGATHER_MAX_RANKS
        return [Phase("allgather", bits / 8) if gathered else Phase("allreduce", bits * 2),
                Phase("allreduce", 4 * (PEELING_THRESHOLD * 1.1 * union + 24))]

    @classmethod
    def decode_ms(cls, e: Encoded, workers: int) -> float:
        return e.aggregate_ms(workers)
