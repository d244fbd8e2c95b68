"""Error feedback (the "memory" of GRACE): a wrapper that makes any biased compressor converge.

Seide et al. (1-bit SGD, 2014) and Karimireddy et al. (EF-SGD, ICML 2019): each rank keeps the residual e of
what its compressor dropped and adds it back before the next compression,

    p_t = g_t + e_{t-1},    payload = C(p_t),    e_t = p_t - D(C(p_t)),

so every coordinate is eventually sent. The invariant ``e_t + D(C(p_t)) == p_t`` holds exactly (up to the
float rounding of one subtraction).

Momentum correction (Lin et al., DGC, ICLR 2018, Section 3.2): methods with a ``momentum`` option (top-k,
threshold, random-k, EF-signSGD, signSGD; 0.9 by default) apply the momentum on each rank, before error feedback
and compression, and the wrapped optimizer applies none to their parameters (checked, as for DGC),

    u_t = m u_{t-1} + g_t,    p_t = u_t + e_{t-1},    payload = C(p_t),    e_t = p_t - D(C(p_t)),

because error feedback delays what it holds back, and a delayed gradient acts as momentum of its own (Mitliagkas
et al., "Asynchrony begets momentum", 2016): the optimizer's heavy-ball momentum applied after the sum amplifies
each late burst again. On the glyphs workload (2 ranks, SGD lr 0.1 with momentum 0.9, 3 epochs, seed 0;
perf/accuracy/README.md) random-k and EF-signSGD under the optimizer's momentum collapsed to about 10% test
accuracy, while dense reached 97.7%. Random-k and EF-signSGD keep only the momentum's gain, u_t = g_t / (1 - m)
(``momentum_averages = False``): their error feedback holds entries back over many steps (random-k each entry about
d/k steps; EF-signSGD, with one scale per tensor, the entries far above the tensor's mean magnitude), an average
over more steps than the momentum's own, which with the gain alone trained (EF-signSGD 0.3 points below dense,
random-k at 1% 5.0 below: it warns). ``ErrorFeedback(inner, momentum)`` does both; :class:`MomentumCorrection`
applies the momentum to a method without error feedback: signSGD's majority vote on the sign of u is Signum
(Bernstein et al., ICLR 2019, Algorithm 1; the sign ignores Signum's (1 - m) dampening, and the undampened u keeps
the scale of dense momentum SGD's step, so the same learning rate applies). Top-k and threshold keep the running
average, as DGC does: 1.2 and 1.6 points below dense under the optimizer's momentum, 0.3 and 0.5 with it.
"""

from __future__ import annotations

from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import Compressor, Context, State
from hvdcomp.kernels import kernels_for
from hvdcomp.requests import Agree
from hvdcomp.wire import Payload


def _forwarded(trait: str) -> Any:
    """A property that reads ``trait`` of the wrapped method."""
    return property(lambda self: getattr(self.inner, trait), doc=f"The wrapped method's ``{trait}``.")


class _Wrapper(Compressor):
    """What a memory wrapper forwards to the method it wraps: every trait a caller reads (what the method is, how its
    payloads travel, its warm-up, accuracy risk and options), decoding, plan and decisions; callers never reach
    through it. Its own are its state, :meth:`compress` and :meth:`agree` (and ``unbiased`` for error feedback)."""

    name = _forwarded("name")
    unbiased = _forwarded("unbiased")
    summable = _forwarded("summable")
    fixed_size = _forwarded("fixed_size")
    recompressible = _forwarded("recompressible")
    sparse_payload = _forwarded("sparse_payload")
    reduction = _forwarded("reduction")
    keeps_nonfinite = _forwarded("keeps_nonfinite")
    epoch_options = _forwarded("epoch_options")
    dense_edges = _forwarded("dense_edges")
    agrees = _forwarded("agrees")

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner

    @property
    def applies_momentum(self) -> bool:  # type: ignore[override]
        """The wrapper's momentum correction applies momentum (or the method does): the optimizer's must not."""
        return self.momentum > 0 or self.inner.applies_momentum

    def compresses(self, shape: torch.Size) -> bool:
        return self.inner.compresses(shape)

    def why_dense(self, shape: torch.Size) -> str:
        return self.inner.why_dense(shape)

    def fixed_size_on(self, device: torch.device) -> bool:
        return self.inner.fixed_size_on(device)

    def steady_from(self) -> int:
        return self.inner.steady_from()

    def accuracy_risk(self) -> str | None:
        return self.inner.accuracy_risk()

    def settings(self) -> dict[str, Any]:
        return self.inner.settings()

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        return self.inner.decompress(payload, meta)

    def subtract(self, residual: torch.Tensor, payload: Payload, meta: Any) -> None:
        self.inner.subtract(residual, payload, meta)

    def aggregate(self, payloads: list[Payload], meta: Any) -> torch.Tensor:
        return self.inner.aggregate(payloads, meta)

    def plan(self, state: State) -> str:
        return self.inner.plan(state["inner"])

    def decisions(self, state: State) -> list[Any] | None:
        return self.inner.decisions(state["inner"])

    def unwrapped(self) -> Compressor:
        return self.inner


def corrected(tensor: torch.Tensor, u: torch.Tensor | None, momentum: float, average: bool) -> torch.Tensor:
    """u_t (momentum correction, module docstring) from the gradient ``tensor`` and u_{t-1} in ``u``, which is updated
    in place and returned: m u + g where ``average`` (``u`` needed), else g / (1 - m) (written to ``u`` where given),
    in float32 (a float16 gradient times the gain would overflow from |g| = 6,550 at m = 0.9)."""
    if average:
        return u.mul_(momentum).add_(tensor)
    return torch.mul(tensor.to(torch.float32), 1 / (1 - momentum), out=u)


def momentum_step(tensor: torch.Tensor, u: torch.Tensor | None, residual: torch.Tensor | None, momentum: float,
                  average: bool) -> None:
    """The memory's update, in place: u_t = :func:`corrected` (kept in ``u`` where given: the running average needs
    it), then ``residual`` += u_t where given. Where the fused kernels apply (a float32 contiguous gradient) one pass
    over the three tensors, where PyTorch takes three (``mul_``, ``add_``, ``add_``); the same bits either way."""
    kernels = kernels_for(tensor.device)
    if kernels is not None and tensor.dtype == torch.float32 and tensor.is_contiguous():
        kernels.momentum_step(tensor, u, residual, momentum if average else 1 / (1 - momentum), average)
        return
    value = corrected(tensor, u, momentum, average)
    if residual is not None:
        residual.add_(value)


def _unaliased(payload: Payload, buffer: torch.Tensor) -> Payload:
    """``payload`` with copies of the parts that share ``buffer``'s storage: a payload may be reduced in place."""
    storage = buffer.untyped_storage().data_ptr()
    return [part.clone() if part.untyped_storage().data_ptr() == storage else part for part in payload]


class ErrorFeedback(_Wrapper):
    """Wraps ``inner`` with a per-parameter residual (float32, the tensor's shape and device); with ``momentum`` > 0,
    with momentum correction before it (module docstring; ``average=False``: the momentum's gain alone)."""

    unbiased = False

    def __init__(self, inner: Compressor, momentum: float = 0.0, average: bool = True) -> None:
        if isinstance(inner, _Wrapper):
            raise ValueError(f"{inner!r} already has error feedback or momentum correction")
        if inner.own_memory:
            raise ValueError(f"{inner.name} keeps its own memory: it takes no generic error feedback")
        super().__init__(inner)
        self.momentum = check.number("error feedback", "momentum", momentum, ge=0, lt=1)
        self.average = average

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        # contiguous whatever the parameter's memory format (channels-last): compressors view it flat
        state = {"residual": torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device),
                 "inner": self.inner.init_state(tensor, ctx)}
        if self.momentum and self.average:  # the gain alone keeps nothing from step to step
            state["momentum"] = torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device)
        return state

    def agree(self, tensor: torch.Tensor, state: State, ctx: Context) -> Agree | None:
        if not self.inner.agrees:
            return None
        if self.momentum:  # u_t as compress() will compute it, leaving the state to the step's compress()
            tensor = corrected(tensor, state["momentum"].clone() if self.average else None, self.momentum,
                               self.average)
        return self.inner.agree(tensor + state["residual"], state["inner"], ctx)

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        residual = state["residual"]
        if self.momentum:
            momentum_step(tensor, state["momentum"] if self.average else None, residual, self.momentum, self.average)
        else:
            residual.add_(tensor)
        compensated = residual  # p_t, built in the residual's buffer: no allocation
        payload, meta = self.inner.compress(compensated, state["inner"], ctx, agreed)
        payload = _unaliased(payload, residual)
        self.inner.subtract(residual, payload, meta)  # e_t = p_t - D(C(p_t))
        return payload, meta

    def __repr__(self) -> str:
        momentum = f", momentum={self.momentum!r}, average={self.average!r}" if self.momentum else ""
        return f"ErrorFeedback({self.inner!r}{momentum})"


class MomentumCorrection(_Wrapper):
    """Wraps ``inner``, a method without error feedback (signSGD's majority vote: Signum), with the momentum
    u <- m u + g applied on each rank before it (module docstring).

    The parameters it reduces need an optimizer group with ``momentum`` 0 (``applies_momentum``: the optimizer
    checks it), as DGC's do."""

    def __init__(self, inner: Compressor, momentum: float) -> None:
        if isinstance(inner, _Wrapper) or inner.own_memory:
            raise ValueError(f"{inner!r} has a memory already: momentum correction wraps a bare method")
        super().__init__(inner)
        self.momentum = check.number("momentum correction", "momentum", momentum, gt=0, lt=1)

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        return {"momentum": torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device),
                "inner": self.inner.init_state(tensor, ctx)}

    def agree(self, tensor: torch.Tensor, state: State, ctx: Context) -> Agree | None:
        if not self.inner.agrees:
            return None
        u = corrected(tensor, state["momentum"].clone(), self.momentum, True)  # the state is compress()'s to advance
        return self.inner.agree(u, state["inner"], ctx)

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        u = state["momentum"]
        momentum_step(tensor, u, None, self.momentum, True)
        payload, meta = self.inner.compress(u, state["inner"], ctx, agreed)
        return _unaliased(payload, u), meta

    def __repr__(self) -> str:
        return f"MomentumCorrection({self.inner!r}, momentum={self.momentum!r})"


def with_memory(compressor: Compressor, error_feedback: bool | None = None) -> Compressor:
    """The memory policy: ``compressor`` wrapped in error feedback where it needs it, with momentum correction
    before it where the method has a ``momentum`` (module docstring); a method without error feedback
    gets momentum correction alone (:class:`MomentumCorrection`, Signum), unless it keeps
    only the momentum's gain (``momentum_averages = False``), which stands in for momentum only with error feedback.

    ``error_feedback=None`` (the default): the method's ``default_error_feedback``, which unless it says
    otherwise is on for biased methods without a memory of their own and off for the others; ``False``: the bare
    method, without momentum correction either (the optimizer's momentum applies). A method with its own memory
    (PowerSGD, DGC) takes no generic error feedback: its own is a method option. An already wrapped compressor is
    returned as it is.
    """
    if isinstance(compressor, ErrorFeedback | MomentumCorrection):
        has = isinstance(compressor, ErrorFeedback)
        if error_feedback is not None and error_feedback != has:
            raise ValueError(f"{compressor!r} {'has' if has else 'has no'} error feedback, but error_feedback: "
                             f"{str(error_feedback).lower()} was asked for")
        return compressor
    check.boolean("", "error_feedback", error_feedback, optional=True)
    if compressor.own_memory:
        if error_feedback:
            raise ValueError(f"{compressor.name} keeps its own memory: set its own option (e.g. error_feedback in "
                             "options) instead of the generic error_feedback key")
        return compressor
    if error_feedback is False:  # no memory at all: the bare method, under the optimizer's momentum
        return compressor
    if error_feedback is None:
        error_feedback = compressor.default_error_feedback
        if error_feedback is None:
            error_feedback = not compressor.unbiased
    if error_feedback:
        return ErrorFeedback(compressor, compressor.momentum, average=compressor.momentum_averages)
    if compressor.momentum and compressor.momentum_averages:
        return MomentumCorrection(compressor, compressor.momentum)
    return compressor
