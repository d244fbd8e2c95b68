"""The compressor interface: how one gradient tensor is encoded for the wire and decoded back.

A compressor turns a tensor into a *payload* (a list of tensors) plus *meta* that stays on the rank, and back.
How payloads travel is a *reduction* (:mod:`hvdcomp.reductions`): by default the compressor's traits pick one,

* ``summable``: payloads add elementwise (fp16, random-k with a shared seed, sketches), so Horovod's
  allreduce sums them in compressed form;
* otherwise payloads are gathered and every rank decodes and sums them (:meth:`Compressor.aggregate`; a
  method may combine them otherwise, as signSGD's majority vote does, returning what the optimizer averages);
  ``fixed_size`` says whether a payload's size depends only on the tensor's shape (TernGrad, QSGD, sign) or
  differs per rank (top-k dropping zeros, threshold, DGC). Fixed-size payloads may also use the two-phase
  compressed allreduce, where ``recompressible`` (the owner of a chunk compresses the ranks' sum again);

and a method whose communication is more than one collective (PowerSGD's two allreduces with computation
between them) names its own reduction in ``reduction``.

Memory (error feedback) is a policy, decided in one place above this interface
(:func:`hvdcomp.error_feedback.with_memory`): biased methods get :class:`hvdcomp.error_feedback.ErrorFeedback`
unless they keep a memory of their own (``own_memory``: PowerSGD, DGC), whether they are given by name, config or
object.

Contracts every method keeps (the optimizer and the reductions rely on them):

* Compressors hold no per-tensor state: :meth:`Compressor.init_state` makes a dict for one parameter, which
  the optimizer keeps and checkpoints (``state_dict()``); everything that changes over training (residuals,
  PowerSGD's Q, a ratio, a phase) lives there.
* ``meta`` must not depend on the rank (shape, dtype, shared seeds): a rank decodes every other rank's
  payload with its own meta. A method that needs rank-dependent decoding owns its reduction and says so.
* Payload tensors may be reduced in place (Horovod's in-place allreduce): a payload must not alias anything
  the method reads afterwards, except where the method wants the sum written there.
* Whatever a method decides that changes the plan (ratio, phase) comes from values agreed across ranks
  (:class:`hvdcomp.requests.Agree`) or from the step counter, so every rank changes in the same step;
  :meth:`Compressor.plan` states it, and the optimizer checks every step that all ranks hold the same plan.
* The sequence of requests a reduction yields (kinds, sizes of agreed values) depends only on the plan and on
  agreed values (GraVAC's dense fallback), never on the rank's own data: ranks match collectives by name and
  order.
* Randomness comes from the context's seeds (``ctx.seed`` per rank, ``ctx.shared_seed`` the same on every
  rank) and ``ctx.step``, never from global generators: runs are reproducible and resume exactly.
* Hot paths make no host-device syncs on CUDA tensors (no ``.item()``, ``.tolist()``, boolean indexing). A
  method that decides from agreed values (GraVAC) reads them on the host once per step, after the vote.

This mirrors ``horovod/torch/compression.py`` and GRACE's compressor/memory/communicator split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from hvdcomp.requests import Agree
from hvdcomp.wire import Payload

#: a method's per-parameter state (:meth:`Compressor.init_state`), which the optimizer keeps and checkpoints
State = dict[str, Any]

#: every Compressor subclass with a ``name`` of its own, by that name (the names configs use)
METHODS: dict[str, type[Compressor]] = {}


#: where the accuracy of :meth:`Compressor.accuracy_risk`'s warnings was measured
MEASURED = ("on the glyphs workload (2 ranks, SGD lr 0.1 with momentum 0.9 for dense, 3 epochs, seed 0; "
            "perf/accuracy/README.md)")


class AccuracyWarning(UserWarning):
    """A method chosen with options that were measured to lose accuracy against dense SGD at dense's learning rate
    (:meth:`Compressor.accuracy_risk`): ``DistributedOptimizer`` warns once per such method, on rank 0."""


def register(registry: dict[str, Any], cls: type, kind: str) -> None:
    """Registers ``cls`` under the ``name`` it defines itself (not one it inherits); a second class of the same
    name is an error, naming both (the same class again, from a module imported anew, replaces it)."""
    name = cls.__dict__.get("name")
    if isinstance(name, str):
        if name in registry and (registry[name].__module__, registry[name].__qualname__) != (cls.__module__,
                                                                                             cls.__qualname__):
            raise ValueError(f"{kind} {name!r} is defined twice: {registry[name]} and {cls}")
        registry[name] = cls


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


#: a step past every method's warm-up (DGC's sparsity stages, PowerSGD's start_iter): what benchmarks and
#: profiles measure, the steady state of training
STEADY_STEP = 1_000_000


@dataclasses.dataclass(frozen=True)
class Context:
    """What a method knows about the parameter it reduces.

    ``seed`` differs per parameter and rank (TernGrad's and QSGD's draws); ``shared_seed`` differs per
    parameter but is the same on every rank (random-k's positions, PowerSGD's initial Q, hash functions).
    ``step`` counts this parameter's reductions (checkpointed with the state).
    """

    name: str
    rank: int
    size: int
    device: torch.device
    seed: int
    shared_seed: int
    step: int = 0

    @classmethod
    def local(cls, tensor: torch.Tensor, seed: int = 0, name: str = "tensor", step: int = 0) -> Context:
        """A one-rank context, for using a compressor outside a job (benchmarks, tests); ``step=STEADY_STEP``
        measures a method past its warm-up."""
        return cls(name, 0, 1, tensor.device, derive_seed(seed, name, 0), derive_seed(seed, name, "shared"), step)

    def derive(self, *parts: object) -> Context:
        """The context of a part of this tensor (a two-phase chunk, an owner's re-compression): new seeds."""
        return dataclasses.replace(self, seed=derive_seed(self.seed, *parts),
                                   shared_seed=derive_seed(self.shared_seed, *parts))


class Compressor(ABC):
    """Encodes one tensor for the wire (:meth:`compress`) and decodes it (:meth:`decompress`)."""

    #: The name used in configs (``compression="terngrad"``); defining it registers the class in METHODS.
    name: ClassVar[str]
    #: E[decompress(compress(x))] = x. Biased compressors get error feedback by default.
    unbiased: ClassVar[bool] = True
    #: Payloads of different ranks add elementwise: the sum is reduced by allreduce.
    summable: ClassVar[bool] = False
    #: A payload's sizes depend only on the input's shape and dtype, the same on every rank.
    fixed_size: ClassVar[bool] = True
    #: The ranks' decoded sum compresses again as a gradient does (two-phase's owner): not where a payload cannot
    #: carry the sum's magnitude (unscaled signSGD's bare signs).
    recompressible: ClassVar[bool] = True
    #: The method keeps its own memory (PowerSGD, DGC): never wrapped in generic error feedback.
    own_memory: ClassVar[bool] = False
    #: Error feedback when the config leaves it unset; None: on exactly for biased methods (signSGD with
    #: majority vote is biased but runs without it, as in its paper).
    default_error_feedback: ClassVar[bool | None] = None
    #: The registered reduction this method owns (hvdcomp.reductions), or None for the default ones.
    reduction: ClassVar[str | None] = None
    #: Every entry of the input reaches the sum, so a NaN/Inf shows in the result (none, fp16); otherwise the
    #: optimizer also checks the input, which an encoding could hide it in (TernGrad's draw, a sparsifier).
    keeps_nonfinite: ClassVar[bool] = False
    #: compress() depends on the tensor alone: no state, seeds or step (what Horovod's own hook can carry).
    stateless: ClassVar[bool] = False
    #: Payloads are (values, indices) of unique indices (the sparsifiers): the homomorphic sketch collective can
    #: sum them in compressed form (:mod:`hvdcomp.methods.sketch`).
    sparse_payload: ClassVar[bool] = False
    #: compress() takes a sparse COO gradient as it is (an embedding's with ``sparse=True``); the optimizer
    #: densifies sparse gradients for the other methods.
    accepts_sparse: ClassVar[bool] = False
    #: The method applies momentum itself (DGC's momentum correction): the wrapped optimizer must not (checked).
    applies_momentum: ClassVar[bool] = False
    #: The momentum the memory policy applies on each rank before error feedback and compression, in place of the
    #: optimizer's (momentum correction, :mod:`hvdcomp.error_feedback`), for methods with a ``momentum`` option (per
    #: instance; DGC, with a memory of its own, applies its own); 0: none, the optimizer's applies.
    momentum: float = 0.0
    #: Momentum correction keeps the momentum's running average (u <- m u + g); False: only its gain, u = g / (1 - m),
    #: and only with error feedback, whose delays already average over more steps than the momentum (random-k).
    momentum_averages: ClassVar[bool] = True
    #: Options the method's paper counts in epochs (DGC's warm-up stage, GraVAC's exploration interval), in
    #: steps here: ``hvdcomp train`` sets them to the job's steps per epoch unless the config does.
    epoch_options: ClassVar[tuple[str, ...]] = ()
    #: The model's first and last layers stay dense (LGC, as its paper keeps them): the optimizer tells
    #: :meth:`hvdcomp.config.CompressionConfig.choose` which parameters those are.
    dense_edges: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register(METHODS, cls, "compression method")

    def compresses(self, shape: torch.Size) -> bool:
        """Whether this method compresses a tensor of ``shape``; other tensors go Horovod's dense way."""
        return True

    def fixed_size_on(self, device: torch.device) -> bool:
        """Whether payloads made on ``device`` have the same sizes on every rank: where ``fixed_size``, or where a
        method sends a fixed count there (the sparsifiers on CUDA's path). Their gathering then needs no sizes, and
        no host read of them."""
        return self.fixed_size

    def steady_from(self) -> int:
        """The step from which the method runs as in its steady state (:data:`STEADY_STEP`, what profiles measure):
        0, or the end of its warm-up (PowerSGD's ``start_iter``, DGC's sparsity stages, LGC's first two stages).
        ``compression: auto`` measures a plan only from there."""
        return 0

    def accuracy_risk(self) -> str | None:
        """Why this method, with these options, trains to a lower accuracy than dense SGD at the learning rate and
        momentum tuned for dense, and what to do instead (a lower learning rate, another option, another method);
        None where it was not measured to. ``DistributedOptimizer`` warns with it (:class:`AccuracyWarning`), once
        per method, when the method is chosen. What each says was measured on the glyphs workload
        (perf/accuracy/README.md)."""
        return None

    def why_dense(self, shape: torch.Size) -> str:
        """Why :meth:`compresses` declines ``shape`` (the optimizer logs it on rank 0 when it plans the parameters)."""
        return f"{self.name} does not compress a tensor of shape {tuple(shape)}"

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        """Per-parameter state for ``tensor`` (shape, dtype and device as the gradient's)."""
        return {}

    def agree(self, tensor: torch.Tensor, state: State, ctx: Context) -> Agree | None:
        """Values all ranks must agree on before compressing, or None.

        The optimizer fuses the requests of all parameters into one small collective per step and passes
        the agreed values to :meth:`compress` as ``agreed`` (TernGrad's scaler sharing: a max).
        """
        return None

    @property
    def agrees(self) -> bool:
        """Whether :meth:`agree` may ask for values (it is overridden): where not, the memory wrappers skip building
        its input (the gradient with the residual or the momentum added: passes over the tensor, launches on CUDA)."""
        return type(self).agree is not Compressor.agree

    @abstractmethod
    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        """Returns the payload to send and rank-independent meta for decoding."""

    @abstractmethod
    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        """Decodes one payload to a tensor of the original shape (not necessarily its dtype: callers cast)."""

    def subtract(self, residual: torch.Tensor, payload: Payload, meta: Any) -> None:
        """``residual -= decompress(payload)`` in place (error feedback's update); sparse payloads override it
        to touch only the entries they carry."""
        residual.sub_(self.decompress(payload, meta).view_as(residual))

    def aggregate(self, payloads: list[Payload], meta: Any) -> torch.Tensor:
        """The sum of the decoded payloads of all ranks, added in rank order (the same bits on every rank).
        Compressors override it to sum in compressed form."""
        total = self.decompress(payloads[0], meta).float()
        for payload in payloads[1:]:
            total += self.decompress(payload, meta)
        return total

    def plan(self, state: State) -> str:
        """The part of this parameter's plan that may change during training (a ratio, a phase), as text.

        The optimizer checks each step that every rank holds the same plan: a method changes it only from
        agreed values or the step counter."""
        return ""

    def decisions(self, state: State) -> list[Any] | None:
        """What the last step decided for this tensor (GraVAC's CF, LGC's stage), as JSON values for ``hvdcomp
        train``'s per-step trace; None for methods that decide nothing. It may read the device (not a hot path)."""
        return None

    def settings(self) -> dict[str, Any]:
        """The method's options as it holds them (its public attributes): what its repr and profiles show."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def unwrapped(self) -> Compressor:
        """The method itself, without a memory wrapper (error feedback, momentum correction), which forwards every
        trait: only a caller that must wrap the bare method anew needs it (two-phase's owner re-compression)."""
        return self

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in sorted(self.settings().items()))
        return f"{type(self).__name__}({options})"


class NoneCompressor(Compressor):
    """No compression: the gradient travels as it is (Horovod's ``Compression.none``)."""

    name = "none"
    summable = True
    keeps_nonfinite = True
    stateless = True

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        return [tensor], None

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        return payload[0]


class HorovodCompression:
    """Adapts a summable hvdcomp compressor to ``hvd.DistributedOptimizer(compression=...)``.

    Horovod's hook allreduces the one tensor that ``compress`` returns, so only stateless, summable,
    single-tensor compressors fit (e.g. ``HorovodCompression(FP16Compressor())``)::

        opt = hvd.DistributedOptimizer(opt, compression=HorovodCompression(hvdcomp.FP16Compressor()))
    """

    def __init__(self, compressor: Compressor) -> None:
        if not (compressor.summable and compressor.stateless) or compressor.reduction is not None:
            raise ValueError(
                f"{compressor!r} does not fit Horovod's compression hook: it allreduces the compressed tensor and "
                "keeps no state, seeds or steps, so only stateless summable compressors (none, fp16) fit; use "
                "hvdcomp.DistributedOptimizer instead")
        self.compressor = compressor

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        payload, meta = self.compressor.compress(tensor, {}, Context.local(tensor))
        if len(payload) != 1:
            raise ValueError(f"{self.compressor!r} sends {len(payload)} tensors; Horovod's hook carries one")
        return payload[0], (meta, tensor.dtype)

    def decompress(self, tensor: torch.Tensor, ctx: tuple[Any, torch.dtype]) -> torch.Tensor:
        meta, dtype = ctx
        return self.compressor.decompress([tensor], meta).to(dtype)


def nonfinite(tensors: Sequence[torch.Tensor], mark: float = 1.0) -> torch.Tensor:
    """``mark`` for each of ``tensors`` that holds a NaN or an Inf, else 0: float32, ``[len(tensors)]``, on their
    device, with no host sync.

    On CUDA one multi-tensor operator takes every tensor's L1 norm in float64 (a NaN or an Inf reaches the sum, which
    finite float32, bfloat16 or float16 entries cannot overflow in float64), and three small operators finish, however
    many the tensors: a step's check of every gradient costs a few launches, not several per gradient. Elsewhere (CPU
    tensors, where PyTorch's norms run slower, perf/gpu/checks.py; float64 tensors, whose sums could overflow; empty
    tensors, which some PyTorch versions' multi-tensor norm mishandles) one pass per tensor that allocates nothing of
    its size: its min and max, which propagate NaN and show an Inf (``isfinite(t).all()`` would write a full-size
    mask).

    Tensors on several devices (a model split across GPUs, or across a GPU and the CPU) are checked per device; the
    flags come back on the first tensor's device, in the tensors' order.
    """
    if not tensors:
        return torch.zeros(0)
    devices = {tensor.device for tensor in tensors}
    if len(devices) > 1:
        first = tensors[0].device
        flags = {device: iter(nonfinite([t for t in tensors if t.device == device], mark).to(first))
                 for device in devices}
        return torch.stack([next(flags[tensor.device]) for tensor in tensors])
    by_norms = all(tensor.is_cuda and tensor.numel() and tensor.dtype != torch.float64 for tensor in tensors)
    finite = _finite_by_norms(tensors) if by_norms else _finite_by_range(tensors)
    return torch.where(finite, 0.0, float(mark))


def _finite_by_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    # below infinity: neither NaN nor Inf (one operator, where isfinite takes four)
    return torch.stack(torch._foreach_norm(list(tensors), 1, dtype=torch.float64)) < math.inf


def _finite_by_range(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.stack(torch.aminmax(tensor)).isfinite().all() if tensor.numel()
                        else torch.ones((), dtype=torch.bool, device=tensor.device) for tensor in tensors])
