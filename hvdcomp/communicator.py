"""Compressed collectives over Horovod's public async API (NCCL for CUDA tensors, MPI or Gloo for CPU).

A collective reduces one parameter's gradient in compressed form and returns the *sum* over the ranks of the
process set. It is written as a generator, so that the optimizer can interleave many parameters and
overlap their communication with backward computation. The generator yields either

* a Horovod handle: the optimizer sends back ``hvd.synchronize(handle)``; or
* :class:`SharedMax`: values all ranks must agree on before compressing (TernGrad's scaler). The optimizer
  fuses the requests of all parameters into one small max-allreduce per step and sends back this
  parameter's slice of the result.

and finally returns the summed gradient (float32 or the payload's dtype, the tensor's shape).

Three collectives:

* :class:`Allreduce` for summable payloads (fp16, sketches): Horovod sums them in compressed form.
* :class:`Allgather` for payloads with per-rank scales or indices (TernGrad, QSGD, top-k): every rank
  receives every payload and sums the decoded values (:meth:`Compressor.aggregate`). Receive volume grows
  as (N-1) x the payload. Variable-size payloads also gather their part sizes.
* :class:`TwoPhase`, the scalable compressed allreduce of DeepSpeed's 1-bit Adam (Tang et al., 2021):
  the tensor is cut into N chunks; an alltoall sends chunk j of every rank to rank j, which decodes and sums
  them, re-compresses the sum with its own error feedback, and an allgather returns every owner's chunk to
  every rank. Each rank sends and receives about 2 x the payload at any N. Fixed-size compressors only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

import horovod.torch as hvd
import torch

from hvdcomp import wire
from hvdcomp.compressor import Compressor, Payload, State, derive_seed
from hvdcomp.error_feedback import ErrorFeedback


@dataclass(frozen=True)
class SharedMax:
    """A request for values reduced by max across ranks (see module docstring)."""

    values: torch.Tensor


Reduction = Generator[Any, Any, torch.Tensor]


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """``numel`` split into ``parts`` contiguous chunks whose sizes differ by at most one."""
    base, extra = divmod(numel, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


class Collective(ABC):
    """How a compressor's payloads travel between the ranks of ``process_set``."""

    name: ClassVar[str]

    def __init__(self, process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        self.process_set = process_set
        self.size: int = process_set.size()
        self.rank: int = process_set.rank()
        #: payload bytes this rank has handed to collectives (the traffic that compression cuts)
        self.bytes_sent = 0

    def check(self, compressor: Compressor) -> None:  # noqa: B027 (accepts every compressor)
        """Raises ValueError if ``compressor``'s payloads cannot travel by this collective."""

    def init_state(self, compressor: Compressor, tensor: torch.Tensor, seed: int) -> State:
        return compressor.init_state(tensor, seed)

    def shared_max(self, compressor: Compressor, tensor: torch.Tensor, state: State) -> torch.Tensor | None:
        return compressor.shared_max(tensor, state)

    @abstractmethod
    def reduce(self, compressor: Compressor, tensor: torch.Tensor, state: State, name: str) -> Reduction:
        """Generator returning the sum over ranks of ``tensor``, compressed by ``compressor``."""

    def _shared(self, compressor: Compressor, tensor: torch.Tensor, state: State) -> Generator[
            Any, Any, torch.Tensor | None]:
        request = self.shared_max(compressor, tensor, state)
        if request is None:
            return None
        return (yield SharedMax(request))


class Allreduce(Collective):
    """Summable payloads, summed in compressed form by Horovod's (fused) allreduce."""

    name = "allreduce"

    def check(self, compressor: Compressor) -> None:
        if not compressor.summable:
            raise ValueError(f"{compressor!r} is not summable: use the allgather or two_phase collective")

    def reduce(self, compressor: Compressor, tensor: torch.Tensor, state: State, name: str) -> Reduction:
        shared = yield from self._shared(compressor, tensor, state)
        payload, ctx = compressor.compress(tensor, state, shared)
        self.bytes_sent += sum(part.numel() * part.element_size() for part in payload)
        # In place: payloads are the compressor's own tensors (or the gradient, which the result replaces).
        summed = yield hvd.grouped_allreduce_async_(payload, name=f"hvdcomp.allreduce.{name}", op=hvd.Sum,
                                                    process_set=self.process_set)
        return compressor.decompress(summed, ctx)


class Allgather(Collective):
    """Every rank gathers every payload and sums the decoded values."""

    name = "allgather"

    def reduce(self, compressor: Compressor, tensor: torch.Tensor, state: State, name: str) -> Reduction:
        shared = yield from self._shared(compressor, tensor, state)
        payload, ctx = compressor.compress(tensor, state, shared)
        layout = wire.layout_of(payload)
        buffer = wire.pack(payload)
        self.bytes_sent += buffer.numel()
        if compressor.fixed_size:
            gathered = yield hvd.allgather_async(buffer, name=f"hvdcomp.allgather.{name}",
                                                 process_set=self.process_set)
            payloads = [wire.unpack(segment, layout) for segment in gathered.view(self.size, -1)]
        else:
            sizes = torch.tensor([numel for _, numel in layout], dtype=torch.int64).to(buffer.device)
            self.bytes_sent += sizes.numel() * sizes.element_size()
            all_sizes, gathered = yield hvd.grouped_allgather_async(
                [sizes.view(torch.uint8), buffer], name=f"hvdcomp.allgather.{name}", process_set=self.process_set)
            # Sizes differ per rank, so splitting needs them on the host: one sync, as in hvd.allgather itself.
            layouts = [tuple((dtype, numel) for (dtype, _), numel in zip(layout, rank_sizes, strict=True))
                       for rank_sizes in all_sizes.view(torch.int64).view(self.size, -1).tolist()]
            segments = gathered.split([wire.nbytes(rank_layout) for rank_layout in layouts])
            payloads = [wire.unpack(segment, rank_layout) for segment, rank_layout in zip(segments, layouts,
                                                                                          strict=True)]
        return compressor.aggregate(payloads, ctx)


class TwoPhase(Collective):
    """Alltoall of compressed chunks, owner-side sum and re-compression, allgather of the sums."""

    name = "two_phase"

    def check(self, compressor: Compressor) -> None:
        if not compressor.fixed_size:
            raise ValueError(f"{compressor!r} has payloads whose size differs per rank; two_phase needs "
                             "fixed-size payloads: use the allgather collective")

    def _chunks(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensor.reshape(-1).split(chunk_sizes(tensor.numel(), self.size))

    def init_state(self, compressor: Compressor, tensor: torch.Tensor, seed: int) -> State:
        chunks = self._chunks(tensor)
        owner = ErrorFeedback(compressor.unwrapped())
        return {"chunks": [compressor.init_state(chunk, derive_seed(seed, "chunk", j))
                           for j, chunk in enumerate(chunks)],
                "owner": owner.init_state(chunks[self.rank], derive_seed(seed, "owner"))}

    def shared_max(self, compressor: Compressor, tensor: torch.Tensor, state: State) -> torch.Tensor | None:
        requests = [compressor.shared_max(chunk, chunk_state)
                    for chunk, chunk_state in zip(self._chunks(tensor), state["chunks"], strict=True)]
        return None if requests[0] is None else torch.cat(requests)

    def reduce(self, compressor: Compressor, tensor: torch.Tensor, state: State, name: str) -> Reduction:
        shared = yield from self._shared(compressor, tensor, state)
        chunks = self._chunks(tensor)
        shared_chunks = [None] * self.size if shared is None else shared.chunk(self.size)
        compressed: list[tuple[Payload, Any]] = [
            compressor.compress(chunk, chunk_state, chunk_shared)
            for chunk, chunk_state, chunk_shared in zip(chunks, state["chunks"], shared_chunks, strict=True)]
        layouts = [wire.layout_of(payload) for payload, _ in compressed]
        splits = torch.tensor([wire.nbytes(layout) for layout in layouts], dtype=torch.int32)
        outgoing = torch.cat([wire.pack(payload) for payload, _ in compressed])
        self.bytes_sent += outgoing.numel() - int(splits[self.rank])  # the own chunk stays here
        received, _ = yield hvd.alltoall_async(outgoing, splits=splits, name=f"hvdcomp.alltoall.{name}",
                                               process_set=self.process_set)
        # Phase 2: this rank owns chunk `rank`: sum every rank's copy, re-compress with error feedback.
        own_layout, own_ctx = layouts[self.rank], compressed[self.rank][1]
        own_sum = compressor.aggregate([wire.unpack(segment, own_layout)
                                        for segment in received.view(self.size, -1)], own_ctx)
        owner = ErrorFeedback(compressor.unwrapped())
        own_payload, _ = owner.compress(own_sum, state["owner"])
        own_buffer = wire.pack(own_payload)
        self.bytes_sent += own_buffer.numel()
        gathered = yield hvd.allgather_async(own_buffer, name=f"hvdcomp.twophase.{name}",
                                             process_set=self.process_set)
        segments = gathered.split([int(n) for n in splits.tolist()])
        sums = [compressor.decompress(wire.unpack(segment, layout), ctx).reshape(-1)
                for segment, layout, (_, ctx) in zip(segments, layouts, compressed, strict=True)]
        return torch.cat(sums).view(tensor.shape)


COLLECTIVES: dict[str, type[Collective]] = {c.name: c for c in (Allreduce, Allgather, TwoPhase)}


def run_alone(reduction: Reduction, name: str,
              process_set: hvd.ProcessSet = hvd.global_process_set) -> torch.Tensor:
    """Runs one collective to completion by itself, answering a SharedMax request with its own max-allreduce.

    For benchmarks and tests of a single tensor; the optimizer drives many collectives at once and fuses all
    their SharedMax requests into one vote per step.
    """
    request = next(reduction)
    while True:
        if isinstance(request, SharedMax):
            output = hvd.allreduce(request.values, op=hvd.Max, name=f"{name}.shared", process_set=process_set)
        else:
            output = hvd.synchronize(request)
        try:
            request = reduction.send(output)
        except StopIteration as done:
            return done.value
