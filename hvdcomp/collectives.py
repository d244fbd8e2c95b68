"""How Horovod carries out the requests a reduction yields (:mod:`hvdcomp.requests`): NCCL for CUDA tensors, MPI or
Gloo for CPU.

:func:`start` starts a request as Horovod async collectives and returns it :class:`Pending`; :func:`start_vote`
fuses many :class:`~hvdcomp.requests.Agree` requests into one vote (max and min in one max-allreduce, sums
gathered and added in rank order, so every rank holds the same bits; the values the host decides from,
``Agree.host``, are copied by :func:`hvdcomp.requests.to_host` in one transfer); :func:`run_alone` drives one
reduction by itself (benchmarks, tests). Each wait is bounded by a deadline (:func:`hvdcomp.deadlines.synchronize`).

Payloads of gathered and exchanged requests travel as one aligned byte buffer (:mod:`hvdcomp.wire`): any mix
of dtypes in one Horovod collective, and uint8 is accepted by allgather, alltoall and broadcast on every
controller.

Names: Horovod matches collectives by name, so each request is named after its parameter and its index in
the reduction's sequence; the same sequence on every rank gives the same names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import horovod.torch as hvd
import torch

from hvdcomp import wire
from hvdcomp.deadlines import synchronize
from hvdcomp.requests import Agree, Allgather, Allreduce, Alltoall, Broadcast, Read, Reduction, Request, to_host
from hvdcomp.wire import Payload

#: Horovod's reduce ops by the names requests use (:data:`hvdcomp.requests.ALLREDUCE_OPS`)
OPS = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min, "product": hvd.Product}


@dataclass
class Pending:
    """A started request: Horovod handles and how to turn their outputs into the request's result."""

    handles: list[int]
    finish: Callable[[list[Any]], Any]
    nbytes: int  # bytes this rank hands to the collective (the traffic compression cuts)
    name: str = ""
    result: Any = field(default=None)
    done: bool = False

    def ready(self) -> bool:
        """Whether waiting would return at once: every collective is done (``hvd.poll``; no wait)."""
        return self.done or all(hvd.poll(handle) for handle in self.handles)

    def wait(self, deadline_s: float | None = None, context: Callable[[], str] = lambda: "") -> Any:
        """The request's result, waiting at most ``deadline_s`` for each collective (:func:`synchronize`)."""
        if not self.done:
            self.result = self.finish([synchronize(handle, self.name, deadline_s, context)
                                       for handle in self.handles])
            self.done = True
        return self.result


def host_values(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device`` without a host sync: on CUDA each value is a fill kernel
    (copying a host tensor over would synchronize the stream, inside backward)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int64)
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    for index, value in enumerate(values):
        out[index].fill_(value)
    return out


def start(request: Request, name: str, process_set: hvd.ProcessSet = hvd.global_process_set) -> Pending:
    """Starts ``request`` as Horovod async collectives (not :class:`Agree`: see :func:`start_vote`; not :class:`Read`:
    see :func:`hvdcomp.requests.to_host`)."""
    size, rank = process_set.size(), process_set.rank()
    if isinstance(request, Allreduce):
        groups: dict[str, list[int]] = {}
        for index, op in enumerate(request.ops):
            groups.setdefault(op, []).append(index)
        # Horovod reduces contiguous tensors only (a channels_last convolution's gradient is not): a copy of the others
        tensors = [tensor if tensor.is_contiguous() else tensor.contiguous() for tensor in request.tensors]
        handles = [hvd.grouped_allreduce_async_([tensors[i] for i in indices], name=f"{name}.{op}",
                                                op=OPS[op], process_set=process_set)
                   for op, indices in groups.items()]

        def finish_allreduce(outputs: list[Any]) -> Payload:
            result: list[torch.Tensor] = list(tensors)
            for indices, reduced in zip(groups.values(), outputs, strict=True):
                for index, tensor in zip(indices, reduced, strict=True):
                    result[index] = tensor
            return result

        nbytes = sum(t.numel() * t.element_size() for t in request.tensors)
        return Pending(handles, finish_allreduce, nbytes, name)
    if isinstance(request, Allgather):
        layout = wire.layout_of(request.payload)
        buffer = wire.pack(request.payload)
        known = request.layouts if request.layouts is not None else [layout] * size if request.fixed_size else None
        if known is not None:  # every rank knows every rank's layout: one allgather, split by them
            if len(known) != size or wire.nbytes(known[rank]) != buffer.numel():
                raise ValueError(f"Allgather: layouts must be one per rank, this rank's matching its payload; got "
                                 f"{len(known)} for {size} ranks")
            handle = hvd.allgather_async(buffer, name=name, process_set=process_set)
            return Pending([handle], lambda outputs: [
                wire.unpack(segment, rank_layout) for segment, rank_layout in
                zip(outputs[0].split([wire.nbytes(rank_layout) for rank_layout in known]), known, strict=True)],
                buffer.numel(), name)
        sizes = host_values([numel for _, numel in layout], buffer.device)
        handle = hvd.grouped_allgather_async([sizes.view(torch.uint8), buffer], name=name, process_set=process_set)

        def finish_variable(outputs: list[Any]) -> list[Payload]:
            all_sizes, gathered = outputs[0]
            # Sizes differ per rank, so splitting needs them on the host: one sync, as in hvd.allgather itself.
            layouts = [tuple((dtype, numel) for (dtype, _), numel in zip(layout, rank_sizes, strict=True))
                       for rank_sizes in all_sizes.view(torch.int64).view(size, -1).tolist()]
            segments = gathered.split([wire.nbytes(rank_layout) for rank_layout in layouts])
            return [wire.unpack(segment, rank_layout) for segment, rank_layout in zip(segments, layouts, strict=True)]

        return Pending([handle], finish_variable, buffer.numel() + sizes.numel() * 8, name)
    if isinstance(request, Alltoall):
        if len(request.payloads) != size:
            raise ValueError(f"Alltoall: {len(request.payloads)} payloads for {size} ranks")
        layouts = [wire.layout_of(payload) for payload in request.payloads]
        if request.fixed_size:
            buffers = [wire.pack(payload) for payload in request.payloads]
        else:  # a header of int64 part sizes in front of each destination's payload
            buffers = [torch.cat([host_values([n for _, n in layout], payload[0].device).view(torch.uint8),
                                  wire.pack(payload)])
                       for payload, layout in zip(request.payloads, layouts, strict=True)]
        splits = torch.tensor([b.numel() for b in buffers], dtype=torch.int32)
        handle = hvd.alltoall_async(torch.cat(buffers), splits=splits, name=name, process_set=process_set)
        own = layouts[rank]

        def finish_alltoall(outputs: list[Any]) -> list[Payload]:
            received, received_splits = outputs[0]
            if request.fixed_size:
                return [wire.unpack(segment, own) for segment in received.view(size, -1)]
            payloads = []
            for segment in received.split(received_splits.tolist()):
                header = len(own) * 8
                numels = segment[:header].view(torch.int64).tolist()
                layout = tuple((dtype, n) for (dtype, _), n in zip(own, numels, strict=True))
                payloads.append(wire.unpack(segment[header:], layout))
            return payloads

        return Pending([handle], finish_alltoall, int(splits.sum()) - int(splits[rank]), name)
    if isinstance(request, Broadcast):
        layout = wire.layout_of(request.payload)
        buffer = wire.pack(request.payload)
        ranks = process_set.ranks  # Horovod's root_rank is a global rank, also within a process set
        root = ranks[request.root] if ranks else request.root
        handle = hvd.broadcast_async_(buffer, root_rank=root, name=name, process_set=process_set)
        return Pending([handle], lambda outputs: wire.unpack(outputs[0], layout),
                       buffer.numel() if rank == request.root else 0, name)
    if isinstance(request, Agree):
        raise TypeError("Agree requests are fused into the step's vote: use start_vote")
    if isinstance(request, Read):
        raise TypeError("Read requests need no collective: copy their values with to_host")
    raise TypeError(f"a reduction yielded {request!r}; valid requests: Allreduce, Allgather, Alltoall, Broadcast, "
                    "Agree, Read")


def start_vote(agreements: Sequence[Agree], name: str,
               process_set: hvd.ProcessSet = hvd.global_process_set) -> Pending:
    """Starts one fused agreement of many :class:`Agree` requests; its result is the agreed values of each.

    Max and min travel in one max-allreduce (a min as the max of the negated values); sums are gathered in
    float64 and added in rank order, so that every rank computes the same bits (an allreduce's summation
    order may differ per rank). The requests' values read on the host (``Agree.host``) come back on the CPU, copied
    in one transfer.
    """
    if not agreements:
        raise ValueError("start_vote needs at least one Agree request")
    device = agreements[0].values.device
    flat = [a.values.reshape(-1).to(device=device) for a in agreements]
    extreme = [v.float() if a.op == "max" else -v.float() for a, v in zip(agreements, flat, strict=True)
               if a.op != "sum"]
    summed = [v.double() for a, v in zip(agreements, flat, strict=True) if a.op == "sum"]
    handles, nbytes = [], 0
    if extreme:
        values = torch.cat(extreme)
        handles.append(hvd.allreduce_async(values, name=f"{name}.max", op=hvd.Max, process_set=process_set))
        nbytes += values.numel() * 4
    if summed:
        values = torch.cat(summed)
        handles.append(hvd.allgather_async(values.unsqueeze(0), name=f"{name}.sum", process_set=process_set))
        nbytes += values.numel() * 8

    def finish(outputs: list[Any]) -> list[torch.Tensor]:
        maxima = outputs[0] if extreme else None
        sums = None
        if summed:
            gathered = outputs[-1]
            sums = gathered[0].clone()
            for row in gathered[1:]:  # rank order
                sums += row
        results: list[torch.Tensor | None] = []
        on_host: dict[int, torch.Tensor] = {}  # the requests read on the host: their parts, on the vote's device
        max_at, sum_at = 0, 0
        for agreement, values in zip(agreements, flat, strict=True):
            n = values.numel()
            if agreement.op == "sum":
                part = sums[sum_at:sum_at + n].float()
                sum_at += n
            else:
                part = maxima[max_at:max_at + n] if agreement.op == "max" else -maxima[max_at:max_at + n]
                max_at += n
            if agreement.host:
                on_host[len(results)] = part
                results.append(None)
            else:
                results.append(part.view_as(agreement.values).to(agreement.values.device))
        for i, part in zip(on_host, to_host(list(on_host.values())), strict=True):
            results[i] = part.view_as(agreements[i].values)
        return results

    return Pending(handles, finish, nbytes, name)


def run_alone(reduction: Reduction, name: str, process_set: hvd.ProcessSet = hvd.global_process_set) -> torch.Tensor:
    """Runs one reduction to completion by itself, each Agree in a vote of its own, each Read copied on its own.

    For benchmarks and tests of a single tensor; the optimizer drives many reductions at once and fuses
    their agreements into one vote per step.
    """
    try:
        request = next(reduction)
        index = 0
        while True:
            label = f"{name}.{index}"
            if isinstance(request, Agree):
                (result,) = start_vote([request], label, process_set).wait()
            elif isinstance(request, Read):
                (result,) = to_host([request.values])
            else:
                result = start(request, label, process_set).wait()
            index += 1
            request = reduction.send(result)
    except StopIteration as done:
        return done.value
