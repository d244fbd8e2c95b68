"""The compressor interface: how one gradient tensor is encoded for the wire and decoded back.

A compressor turns a tensor into a *payload* (a list of tensors) plus a *context* that stays on the rank,
and back. It says how its payloads can be combined across ranks, which decides the collective that
carries them (see :mod:`hvdcomp.communicator`):

* ``summable``: payloads add elementwise (fp16, random-k with a shared seed, sketches), so Horovod's
  allreduce sums them in compressed form;
* otherwise payloads are gathered and every rank decodes and sums them (:meth:`Compressor.aggregate`);
  ``fixed_size`` says whether a payload's size depends only on the tensor's shape (TernGrad, QSGD, sign) or
  differs per rank (top-k dropping zeros, threshold, DGC). Fixed-size payloads may also use the two-phase
  compressed allreduce.

Compressors hold no per-tensor state themselves: :meth:`Compressor.init_state` creates a dict for one
parameter (error-feedback residuals, PowerSGD's Q, step counters for seeded draws), the optimizer keeps it
and checkpoints it. Contexts must not depend on the rank (shape, dtype, shared seeds), because a rank decodes
every other rank's payload with its own context.

This mirrors ``horovod/torch/compression.py`` and GRACE's compressor/memory split; the error-feedback
"memory" is :class:`hvdcomp.error_feedback.ErrorFeedback`.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

Payload = list[torch.Tensor]
State = dict[str, Any]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Compressor(ABC):
    """Encodes one tensor for the wire (:meth:`compress`) and decodes it (:meth:`decompress`)."""

    #: The name used in configs (``compression="terngrad"``).
    name: ClassVar[str]
    #: E[decompress(compress(x))] = x. Biased compressors get error feedback by default.
    unbiased: ClassVar[bool] = True
    #: Payloads of different ranks add elementwise: the sum is reduced by allreduce.
    summable: ClassVar[bool] = False
    #: A payload's sizes depend only on the input's shape and dtype, the same on every rank.
    fixed_size: ClassVar[bool] = True

    def init_state(self, tensor: torch.Tensor, seed: int) -> State:
        """Per-parameter state for ``tensor``; ``seed`` is distinct per parameter, rank and role."""
        return {}

    def shared_max(self, tensor: torch.Tensor, state: State) -> torch.Tensor | None:
        """Values that all ranks must agree on before compressing, reduced by max across ranks.

        Returns a small 1-D float32 tensor or ``None``. The optimizer fuses the values of all parameters into
        one collective per step and passes the reduced values to :meth:`compress` as ``shared``
        (TernGrad's scaler sharing).
        """
        return None

    @abstractmethod
    def compress(self, tensor: torch.Tensor, state: State, shared: torch.Tensor | None = None) -> tuple[
            Payload, Any]:
        """Returns the payload to send and a rank-independent context for decoding."""

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Decodes one payload to a tensor of the original shape (not necessarily its dtype: callers cast)."""

    def subtract(self, residual: torch.Tensor, payload: Payload, ctx: Any) -> None:
        """``residual -= decompress(payload)`` in place (error feedback's update); sparse payloads override it
        to touch only the entries they carry."""
        residual.sub_(self.decompress(payload, ctx).view_as(residual))

    def aggregate(self, payloads: list[Payload], ctx: Any) -> torch.Tensor:
        """The sum of the decoded payloads of all ranks. Compressors override it to sum in compressed form."""
        total = self.decompress(payloads[0], ctx).float()
        for payload in payloads[1:]:
            total += self.decompress(payload, ctx)
        return total

    def unwrapped(self) -> Compressor:
        """The compressor without wrappers such as error feedback."""
        return self

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items()))
        return f"{type(self).__name__}({options})"


class NoneCompressor(Compressor):
    """No compression: the gradient travels as it is (Horovod's ``Compression.none``)."""

    name = "none"
    summable = True

    def compress(self, tensor: torch.Tensor, state: State, shared: torch.Tensor | None = None) -> tuple[
            Payload, Any]:
        return [tensor], None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0]


class HorovodCompression:
    """Adapts a summable hvdcomp compressor to ``hvd.DistributedOptimizer(compression=...)``.

    Horovod's hook allreduces the one tensor that ``compress`` returns, so only stateless, summable,
    single-tensor compressors fit (e.g. ``HorovodCompression(FP16Compressor())``)::

        opt = hvd.DistributedOptimizer(opt, compression=HorovodCompression(hvdcomp.FP16Compressor()))
    """

    def __init__(self, compressor: Compressor) -> None:
        if not compressor.summable:
            raise ValueError(
                f"{compressor!r} is not summable: Horovod's compression hook allreduces the compressed tensor, "
                "so only summable compressors (none, fp16) fit; use hvdcomp.DistributedOptimizer instead")
        self.compressor = compressor

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        payload, ctx = self.compressor.compress(tensor, {})
        if len(payload) != 1:
            raise ValueError(f"{self.compressor!r} sends {len(payload)} tensors; Horovod's hook carries one")
        return payload[0], (ctx, tensor.dtype)

    def decompress(self, tensor: torch.Tensor, ctx: tuple[Any, torch.dtype]) -> torch.Tensor:
        inner, dtype = ctx
        return self.compressor.decompress([tensor], inner).to(dtype)
