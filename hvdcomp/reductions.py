"""Reductions: how a compressed gradient's payloads travel and are summed across ranks.

A reduction is a generator (:data:`hvdcomp.requests.Reduction`) that yields typed requests and finally
returns the *sum* over the ranks of the process set (float32 or the payload's dtype, the tensor's shape). The
registry is open: defining a :class:`ReductionMethod` subclass with a ``name`` registers it, and a method that
owns its reduction (PowerSGD) names it in ``Compressor.reduction``.

The three default reductions:

* :class:`AllreduceReduction` for summable payloads (fp16, random-k, sketches): Horovod sums them in
  compressed form.
* :class:`AllgatherReduction` for payloads with per-rank scales or indices (TernGrad, QSGD, top-k): every rank
  receives every payload and sums the decoded values (:meth:`Compressor.aggregate`). Receive volume grows as
  (N-1) x the payload.
* :class:`TwoPhaseReduction`, the scalable compressed allreduce of DeepSpeed's 1-bit Adam (Tang et al., 2021):
  the tensor is cut into N chunks; an alltoall sends chunk j of every rank to rank j, which decodes and sums
  them, re-compresses the sum (with its own error feedback by default), and an allgather returns every owner's
  chunk to every rank. Each rank sends and receives about 2 x the payload at any N. Fixed-size payloads only.

A method's module may add a selectable reduction (the homomorphic sketch, :mod:`hvdcomp.methods.sketch`, sums
sparse payloads in compressed form). Which reductions a method may use, and which ``collective: auto`` picks, is
decided here alone (:func:`allowed`, :func:`choose`): the optimizer and the performance model both read it. Each
reduction also states its traffic (:meth:`ReductionMethod.phases`), from which the performance model prices it.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from hvdcomp import check, wire
from hvdcomp.compressor import Compressor, Context, State, register
from hvdcomp.error_feedback import ErrorFeedback
from hvdcomp.requests import Agree, Allgather, Allreduce, Alltoall, Reduction
from hvdcomp.wire import Payload

if TYPE_CHECKING:
    from hvdcomp.perfmodel.schema import Encoded

#: With ``collective: auto``, fixed-size gathered payloads switch to the two-phase scheme from this many
#: ranks on: allgather receives (N-1) payloads per rank, two-phase about 2 at any N.
TWO_PHASE_MIN_RANKS = 5
#: the key of a bucket's state that holds one state per member (:meth:`ReductionMethod.init_member_states`)
MEMBERS = "members"


class Traits(Protocol):
    """What the choice of a reduction depends on: a Compressor, or a method's measured profile."""

    summable: bool
    fixed_size: bool
    recompressible: bool
    sparse_payload: bool
    reduction: str | None


@dataclass(frozen=True)
class Phase:
    """One collective of a reduction, for the performance model: its kind (allreduce, allgather, alltoall),
    the bytes each rank hands to it, and the computation (ms) that runs between the previous phase's end and
    its start (0 for the first phase: its encoding runs in the backward hook, :meth:`ReductionMethod.hook_ms`)."""

    collective: str
    nbytes: float
    compute_ms: float = 0.0


#: every ReductionMethod subclass with a ``name`` of its own
REDUCTIONS: dict[str, type[ReductionMethod]] = {}


class ReductionMethod(ABC):
    """How ``compressor``'s payloads travel; options come from the config's ``collective_options``."""

    name: ClassVar[str]
    #: the reductions the config's ``collective:`` may name (method-owned ones are picked by their method)
    selectable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register(REDUCTIONS, cls, "reduction")

    def __init__(self, compressor: Compressor) -> None:
        reason = self.rejects(compressor)
        if reason:
            raise ValueError(reason)
        self.compressor = compressor

    @classmethod
    def rejects(cls, traits: Traits) -> str | None:
        """Why payloads with these traits cannot travel this way, or None if they can."""
        return None

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        return self.compressor.init_state(tensor, ctx)

    def plan(self, state: State) -> str:
        """The changing part of the plan (:meth:`Compressor.plan`) of the state this reduction made; of a bucket's
        members' states (:meth:`init_member_states`), theirs, joined."""
        if MEMBERS in state:
            plans = [self.compressor.plan(member) for member in state[MEMBERS]]
            return ";".join(plans) if any(plans) else ""
        return self.compressor.plan(state)

    def decisions(self, state: State) -> list[Any] | None:
        """The last step's decisions (:meth:`Compressor.decisions`) of the state this reduction made; of a bucket's
        members' states, each member's, where any decides something."""
        if MEMBERS in state:
            decided = [self.compressor.decisions(member) for member in state[MEMBERS]]
            return None if all(d is None for d in decided) else decided
        return self.compressor.decisions(state)

    @abstractmethod
    def reduce(self, tensor: torch.Tensor, state: State, ctx: Context) -> Reduction:
        """Generator returning the sum over ranks of ``tensor``."""

    def batch_key(self, tensor: torch.Tensor) -> Hashable | None:
        """Parameters whose reductions give equal keys (not None) are reduced together, once all their gradients
        of the step are ready, by one ``reduce_batch(tensors, states, contexts)`` generator that returns their sums
        in the order given (the optimizer's: by name, the same on every rank). None (the default): alone."""
        return None

    def init_bucket_state(self, tensors: Sequence[torch.Tensor], ctx: Context) -> State:
        """The state of a bucket of ``tensors`` (the config's ``bucket_cap_mb``), which :meth:`reduce_bucket` reduces
        and its members share: by default :meth:`init_state`'s for their concatenation, with ``ctx``."""
        template = torch.empty(sum(tensor.numel() for tensor in tensors), dtype=tensors[0].dtype,
                               device=tensors[0].device)
        return self.init_state(template, ctx)

    def init_member_states(self, tensors: Sequence[torch.Tensor], ctx: Context) -> State:
        """A bucket's state where :meth:`reduce_bucket` reduces each member on its own (PowerSGD's matrices, the sketch
        method's gradients): ``{MEMBERS: [...]}``, each member's :meth:`init_state` with its :meth:`member_contexts`
        context."""
        return {MEMBERS: [self.init_state(tensor, member)
                          for tensor, member in zip(tensors, self.member_contexts(ctx, len(tensors)), strict=True)]}

    @staticmethod
    def member_contexts(ctx: Context, count: int) -> list[Context]:
        """The contexts of a bucket's ``count`` members reduced each on its own: the bucket's ``ctx``, derived per
        member."""
        return [ctx.derive("member", i) for i in range(count)]

    def reduce_bucket(self, tensors: Sequence[torch.Tensor], state: State, ctx: Context) -> Reduction:
        """Generator returning the sums over ranks of ``tensors`` (a bucket: the config's ``bucket_cap_mb``, in the
        same order on every rank), with the bucket's ``state`` (:meth:`init_bucket_state`) and ``ctx``. By default
        reduced as one tensor, their concatenation; each sum is a flat view of the bucket's."""
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
        total = yield from self.reduce(flat, state, ctx)
        return list(total.reshape(-1).split([tensor.numel() for tensor in tensors]))

    # The costs the performance model prices this reduction with (hvdcomp.perfmodel.timeline), from a method's
    # measured costs on one gradient (hvdcomp profile): a new reduction states them here, nowhere else.

    @classmethod
    def parts(cls, workers: int) -> int:
        """How many calls of the compressor one gradient takes, each on an equal chunk of it (``e`` below sums the
        calls' costs: :func:`hvdcomp.perfmodel.timeline.in_parts`)."""
        return 1

    @classmethod
    def hook_ms(cls, e: Encoded) -> float:
        """Encoding done in the backward hook, before the first phase is started."""
        return e.encode_ms

    @classmethod
    def phases(cls, e: Encoded, workers: int) -> list[Phase]:
        """The collectives one reduction runs, in order, on ``workers`` ranks."""
        return [Phase(cls.name, e.wire_bytes)]

    @classmethod
    def decode_ms(cls, e: Encoded, workers: int) -> float:
        """Decoding after the last phase (the averaged write into the gradient is charged apart)."""
        return e.aggregate_ms(workers)

    def _agreed(self, tensor: torch.Tensor, state: State, ctx: Context) -> Any:
        """Generator: the compressor's agreed values (None if it needs none)."""
        request = self.compressor.agree(tensor, state, ctx)
        if request is None:
            return None
        return (yield request)

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in sorted(vars(self).items())
                          if k != "compressor" and not k.startswith("_"))
        return f"{self.name}({self.compressor!r}{options})"


class AllreduceReduction(ReductionMethod):
    """Summable payloads, summed in compressed form by Horovod's (fused) allreduce, in place."""

    name = "allreduce"

    @classmethod
    def rejects(cls, traits: Traits) -> str | None:
        return None if traits.summable else f"{traits!r} is not summable: use the allgather or two_phase collective"

    @classmethod
    def decode_ms(cls, e: Encoded, workers: int) -> float:
        return e.decode_ms

    def reduce(self, tensor: torch.Tensor, state: State, ctx: Context) -> Reduction:
        agreed = yield from self._agreed(tensor, state, ctx)
        payload, meta = self.compressor.compress(tensor, state, ctx, agreed)
        summed = yield Allreduce(payload)
        return self.compressor.decompress(summed, meta)


class AllgatherReduction(ReductionMethod):
    """Every rank gathers every payload and sums the decoded values in rank order."""

    name = "allgather"
    selectable = True

    def reduce(self, tensor: torch.Tensor, state: State, ctx: Context) -> Reduction:
        agreed = yield from self._agreed(tensor, state, ctx)
        payload, meta = self.compressor.compress(tensor, state, ctx, agreed)
        payloads = yield Allgather(payload, self.compressor.fixed_size_on(tensor.device))
        return self.compressor.aggregate(payloads, meta)


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """``numel`` split into ``parts`` contiguous chunks whose sizes differ by at most one."""
    base, extra = divmod(numel, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


class TwoPhaseReduction(ReductionMethod):
    """Alltoall of compressed chunks, owner-side sum and re-compression, allgather of the sums.

    Args:
        owner_error_feedback: the owner re-compresses its chunk's sum with error feedback of its own (the
            1-bit Adam scheme); ``False`` re-compresses it bare (unbiased methods stay unbiased).
    """

    name = "two_phase"
    selectable = True

    def __init__(self, compressor: Compressor, owner_error_feedback: bool = True) -> None:
        super().__init__(compressor)
        check.boolean(self.name, "owner_error_feedback", owner_error_feedback)
        self.owner_error_feedback = owner_error_feedback
        inner = compressor.unwrapped()  # the owner's sum takes a memory of its own, not the ranks' momentum
        self._owner = ErrorFeedback(inner) if owner_error_feedback else inner

    @classmethod
    def rejects(cls, traits: Traits) -> str | None:
        if not traits.fixed_size:
            return (f"{traits!r} has payloads whose size differs per rank; two_phase needs fixed-size payloads: use "
                    "the allgather collective")
        if not traits.recompressible:
            return (f"{traits!r} cannot compress the ranks' sum again (its payload cannot carry the sum's magnitude); "
                    "two_phase's owners must: use the allgather collective")
        return None

    @classmethod
    def parts(cls, workers: int) -> int:
        return workers  # each rank's chunk is compressed, summed by its owner and decoded in a call of its own

    @classmethod
    def phases(cls, e: Encoded, workers: int) -> list[Phase]:
        owner_ms = (e.aggregate_ms(workers) + e.encode_ms) / workers  # sum one chunk of every rank, re-encode it
        return [Phase("alltoall", e.wire_bytes), Phase("allgather", e.wire_bytes / workers, owner_ms)]

    @classmethod
    def decode_ms(cls, e: Encoded, workers: int) -> float:
        return e.decode_ms

    @staticmethod
    def _chunks(tensor: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        return tensor.reshape(-1).split(chunk_sizes(tensor.numel(), parts))

    def plan(self, state: State) -> str:
        return ";".join(self.compressor.plan(chunk) for chunk in state["chunks"])

    def decisions(self, state: State) -> list[Any] | None:
        return None  # the chunks' methods (quantizers) decide nothing

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        chunks = self._chunks(tensor, ctx.size)
        return {"chunks": [self.compressor.init_state(chunk, ctx.derive("chunk", j)) for j, chunk in enumerate(chunks)],
                "owner": self._owner.init_state(chunks[ctx.rank], ctx.derive("owner"))}

    def reduce(self, tensor: torch.Tensor, state: State, ctx: Context) -> Reduction:
        chunks = self._chunks(tensor, ctx.size)
        contexts = [ctx.derive("chunk", j) for j in range(ctx.size)]
        requests = [self.compressor.agree(chunk, chunk_state, chunk_ctx)
                    for chunk, chunk_state, chunk_ctx in zip(chunks, state["chunks"], contexts, strict=True)]
        agreed: list[Any] = [None] * ctx.size
        if requests[0] is not None:
            values = yield Agree(torch.cat([r.values.reshape(-1) for r in requests]), requests[0].op, requests[0].host)
            agreed = list(values.split([r.values.numel() for r in requests]))
        compressed: list[tuple[Payload, Any]] = [
            self.compressor.compress(chunk, chunk_state, chunk_ctx, chunk_agreed)
            for chunk, chunk_state, chunk_ctx, chunk_agreed in zip(chunks, state["chunks"], contexts, agreed,
                                                                   strict=True)]
        received = yield Alltoall([payload for payload, _ in compressed])
        # Phase 2: this rank owns chunk `rank`: sum every rank's copy, re-compress the sum.
        own_meta = compressed[ctx.rank][1]
        own_sum = self.compressor.aggregate(received, own_meta)
        own_payload, _ = self._owner.compress(own_sum, state["owner"], ctx.derive("owner"))
        # Owner j's payload has the layout of this rank's chunk j: chunks differ by an element, so sizes may too.
        sums = yield Allgather(own_payload, layouts=[wire.layout_of(payload) for payload, _ in compressed])
        decoded = [self.compressor.decompress(payload, meta).reshape(-1)
                   for payload, (_, meta) in zip(sums, compressed, strict=True)]
        return torch.cat(decoded).view(tensor.shape)


def allowed(traits: Traits) -> tuple[str, ...]:
    """The reductions a method with ``traits`` may use, the one ``auto`` prefers at small N first."""
    if traits.reduction is not None:
        return (traits.reduction,)
    if traits.summable:
        return ("allreduce",)
    # registration order: allgather, two_phase, then those of methods (the homomorphic sketch)
    return tuple(name for name, cls in REDUCTIONS.items() if cls.selectable and cls.rejects(traits) is None)


def choose(traits: Traits, requested: str, world_size: int) -> str:
    """The reduction for ``requested`` (``auto`` or a selectable reduction's name) at ``world_size`` ranks.

    Summable methods always use allreduce and methods with a reduction of their own always use it, whatever
    ``requested`` says; gathered methods use two-phase from TWO_PHASE_MIN_RANKS ranks on under ``auto``.
    """
    if traits.reduction is not None:
        return traits.reduction
    options = allowed(traits)
    if not any(REDUCTIONS[name].selectable for name in options):
        return options[0]
    if requested == "auto":
        return "two_phase" if "two_phase" in options and world_size >= TWO_PHASE_MIN_RANKS else options[0]
    if requested not in options:
        reason = REDUCTIONS[requested].rejects(traits) if requested in REDUCTIONS else None
        raise ValueError(reason or f"{traits!r} cannot use the {requested} collective; valid: auto, "
                         f"{', '.join(options)}")
    return requested


def selectable() -> tuple[str, ...]:
    """What the config's ``collective:`` accepts."""
    return ("auto", *sorted(name for name, cls in REDUCTIONS.items() if cls.selectable))


def _options(name: str) -> list[str]:
    return [p for p in inspect.signature(REDUCTIONS[name]).parameters if p != "compressor"]


def automatic(traits: Traits) -> tuple[str, ...]:
    """The reductions ``collective: auto`` resolves to at some rank count (never the sketch: it is asked for)."""
    if traits.reduction is not None:
        return (traits.reduction,)
    options = allowed(traits)
    return tuple(dict.fromkeys([options[0], *(name for name in options if name == "two_phase")]))


def resolved(traits: Traits, requested: str) -> tuple[str, ...]:
    """The reductions ``requested`` (``auto`` or a selectable reduction's name) may resolve to at some rank count."""
    return automatic(traits) if requested == "auto" else (choose(traits, requested, 2),)


def check_options(traits: Traits, options: Mapping[str, Any], requested: str = "auto", named: bool = False) -> None:
    """Raises if an option is taken by none of the reductions ``requested`` may resolve to (:func:`resolved`), or,
    with ``named``, by ``requested`` itself (the configuration's top level, whose collective and options carry over
    to overrides whose methods may take it where the default method does not: ``none``, ``fp16``)."""
    names = resolved(traits, requested)
    if named and requested != "auto" and requested not in names:
        names = (*names, requested)
    valid = sorted({key for name in names for key in _options(name)})
    for key in options:
        if key not in valid:
            raise ValueError(f"unknown option {key!r} for the {'/'.join(names)} collective; valid: "
                             f"{', '.join(valid) or '(none)'}")


def make(name: str, compressor: Compressor, options: Mapping[str, Any] | None = None) -> ReductionMethod:
    """The reduction ``name`` for ``compressor``, with the options (checked by :func:`check_options`) it takes."""
    taken = _options(name)
    return REDUCTIONS[name](compressor, **{key: value for key, value in (options or {}).items() if key in taken})
