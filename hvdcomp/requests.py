"""The requests a reduction yields, and what it receives for each: plain data that any backend can carry out.

A reduction (:mod:`hvdcomp.reductions`) is a generator: it yields typed requests and receives each one's
result, so the optimizer can interleave many parameters and overlap their communication with backward:

* :class:`Allreduce`: tensors summed (or max/min/product) across ranks, an op per tensor, in place;
  receives the reduced tensors;
* :class:`Allgather`: a payload from every rank, of fixed or per-rank sizes; receives every rank's payload;
* :class:`Alltoall`: a payload for each rank; receives the payload each rank sent here;
* :class:`Broadcast`: the root's payload on every rank (same layout everywhere); receives it;
* :class:`Agree`: a few values agreed across ranks by sum, max or min. The optimizer fuses every
  parameter's agreements of a step into one small collective per op family (the *vote*): max and min ride
  one max-allreduce, sums are gathered and added in rank order, so every rank holds the same bits;
* :class:`Read`: values the host decides from, no collective: the optimizer copies every parameter's reads of a step
  to the host in one transfer, once the step's collectives are done; receives them on the CPU.

The requests check, when made, what Horovod (which runs them: :mod:`hvdcomp.collectives`) accepts: an
:class:`Allreduce` names ops of :data:`ALLREDUCE_OPS`, one per tensor, and holds tensors of
:data:`ALLREDUCE_DTYPES` only (Horovod's allreduce accepts int32, int64, float16, float32 and float64); an
:class:`Agree` names an op of :data:`AGREE_OPS`. Gathered, exchanged and broadcast payloads may mix any dtypes:
they travel packed into one byte buffer.

This module imports no backend: methods and reductions build requests without Horovod installed, and
:func:`run_one_rank` runs a reduction as a job of one rank would (benchmarks, profiles, tests of one process), and
:func:`run_one_rank_step` a step's reductions together.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hvdcomp import wire
from hvdcomp.wire import Payload

#: the reduce ops an :class:`Allreduce` may name (:data:`hvdcomp.collectives.OPS` maps them to Horovod's)
ALLREDUCE_OPS = ("sum", "max", "min", "product")
#: the ops an :class:`Agree` may name
AGREE_OPS = ("sum", "max", "min")
#: the dtypes Horovod's allreduce accepts
ALLREDUCE_DTYPES = (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Allreduce:
    """Reduce each tensor across ranks with its op (``ops``: one name for all, or one per tensor), in place."""

    tensors: Payload
    ops: str | tuple[str, ...] = "sum"

    def __post_init__(self) -> None:
        ops = (self.ops,) * len(self.tensors) if isinstance(self.ops, str) else tuple(self.ops)
        if len(ops) != len(self.tensors):
            raise ValueError(f"Allreduce: {len(ops)} ops for {len(self.tensors)} tensors")
        for op in ops:
            if op not in ALLREDUCE_OPS:
                raise ValueError(f"Allreduce: unknown op {op!r}; valid: {', '.join(ALLREDUCE_OPS)}")
        for tensor in self.tensors:
            if tensor.dtype not in ALLREDUCE_DTYPES:
                raise ValueError(f"Allreduce: Horovod's allreduce does not accept {tensor.dtype}; valid: "
                                 f"{', '.join(map(str, ALLREDUCE_DTYPES))} (gather other dtypes with Allgather)")
        object.__setattr__(self, "ops", ops)


@dataclass(frozen=True)
class Allgather:
    """Every rank's ``payload``: of this rank's layout on every rank (``fixed_size``), of per-rank sizes that
    travel too (``fixed_size=False``), or of layouts every rank knows beforehand (``layouts``, one per rank:
    two-phase's owners, whose chunks differ by an element)."""

    payload: Payload
    fixed_size: bool = True
    layouts: Sequence[wire.Layout] | None = None


@dataclass(frozen=True)
class Alltoall:
    """``payloads[j]`` goes to rank j; receives what each rank sent here, in rank order.

    With ``fixed_size`` the payload rank j sends here has the layout of ``payloads[rank]`` (a chunk's layout
    depends only on the chunk); otherwise part sizes travel in a small header.
    """

    payloads: Sequence[Payload]
    fixed_size: bool = True


@dataclass(frozen=True)
class Broadcast:
    """Rank ``root``'s ``payload`` on every rank; every rank passes tensors of the same layout. ``root`` is a rank
    within the process set (as ``process_set.rank()``)."""

    payload: Payload
    root: int = 0


@dataclass(frozen=True)
class Agree:
    """Small float values agreed across ranks by ``op`` (sum, max or min): fused into the step's vote. With ``host``
    they come back on the host (a CPU tensor), for a decision the host makes from them: the vote copies every such
    request's values in one transfer, where a read of each (``tolist``, ``float``) would wait for the device once
    per request, each time behind the work issued since."""

    values: torch.Tensor
    op: str = "max"
    host: bool = False

    def __post_init__(self) -> None:
        if self.op not in AGREE_OPS:
            raise ValueError(f"Agree: unknown op {self.op!r}; valid: {', '.join(AGREE_OPS)}")


@dataclass(frozen=True)
class Read:
    """Values the host decides from that need no agreement (every rank computed the same bits from a collective's
    result: LGC's guard). The optimizer copies every such request of a step to the host in one transfer, once no
    compressed reduction has a collective left to wait for, where a read of each (``tolist``) would wait for the
    device once per request, each time behind the work issued since. Receives them as a CPU tensor. Yield it last:
    what a reduction does after it runs once every other reduction's collectives are done, with nothing left to
    overlap."""

    values: torch.Tensor


Request = Allreduce | Allgather | Alltoall | Broadcast | Agree | Read
#: what a reduction is: yields requests, receives their results, returns the sum over ranks
Reduction = Generator[Request, Any, torch.Tensor]


def dense_concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as an :class:`Allreduce` sends gradients densely: their concatenation, flat, in a float32 tensor of
    its own (sparse ones densified). Horovod reduces in place and in the background: a gradient sent itself could
    change under a reader before ``synchronize()``."""
    parts = [(t.detach().to_dense() if t.is_sparse else t.detach()).reshape(-1) for t in tensors]
    out = torch.empty(sum(part.numel() for part in parts), dtype=torch.float32, device=parts[0].device)
    return torch.cat(parts, out=out)  # converted as it is copied


def dense_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as an :class:`Allreduce` sends a gradient densely (as :func:`dense_concat`), in its shape."""
    dense = tensor.detach().to_dense() if tensor.is_sparse else tensor.detach()
    return dense.to(torch.float32, memory_format=torch.contiguous_format, copy=not tensor.is_sparse)


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``tensors``, in one transfer per device and dtype: one wait for the device, where a read of each
    would wait once per tensor, each time behind the work issued since."""
    copies: list[torch.Tensor] = list(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(i)
    for members in groups.values():
        parts = [tensors[i].reshape(-1) for i in members]
        joined = torch.cat(parts).cpu()
        for i, part in zip(members, joined.split([part.numel() for part in parts]), strict=True):
            copies[i] = part.view(tensors[i].shape)
    return copies


def one_rank(request: Request) -> Any:
    """What a job of one rank receives for ``request``: every sum, gather and agreement over this rank alone."""
    if isinstance(request, Allreduce):
        return list(request.tensors)
    if isinstance(request, Allgather):
        return [request.payload]
    if isinstance(request, Alltoall):
        return [request.payloads[0]]
    if isinstance(request, Broadcast):
        return request.payload
    if isinstance(request, Read) or (isinstance(request, Agree) and request.host):
        return request.values.cpu()
    if isinstance(request, Agree):
        return request.values
    raise TypeError(f"unknown request {request!r}")


def run_one_rank(steps: Generator[Request, Any, Any]) -> Any:
    """Runs a reduction (or any generator of requests) to its end as a job of one rank would (:func:`one_rank`), with
    no backend: benchmarks, profiles and tests of one process."""
    (result,) = run_one_rank_step([steps])
    return result


def run_one_rank_step(reductions: Sequence[Generator[Request, Any, Any]]) -> list[Any]:
    """Runs a step's ``reductions`` (one per gradient or bucket) to their ends as a job of one rank would, each request
    answered by :func:`one_rank`; the host agreements they open with (the sketch's vote) are answered together, in one
    copy to the host, as the optimizer's vote answers them, where a copy each would wait for the device each time."""
    results: list[Any] = [None] * len(reductions)
    first: dict[int, Request] = {}
    for i, steps in enumerate(reductions):
        try:
            first[i] = next(steps)
        except StopIteration as done:
            results[i] = done.value
    host = {i: request for i, request in first.items() if isinstance(request, Agree) and request.host}
    answers = {i: one_rank(request) for i, request in first.items() if i not in host}
    answers.update(zip(host, to_host([agree.values for agree in host.values()]), strict=True))
    for i in first:
        answer = answers[i]
        while True:
            try:
                request = reductions[i].send(answer)
            except StopIteration as done:
                results[i] = done.value
                break
            answer = one_rank(request)
    return results
