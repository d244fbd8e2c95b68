"""Error feedback (the "memory" of GRACE): a wrapper that makes any biased compressor converge.

Seide et al. (1-bit SGD, 2014) and Karimireddy et al. (EF-SGD, ICML 2019): each rank keeps the residual e of
what its compressor dropped and adds it back before the next compression,

    p_t = g_t + e_{t-1},    payload = C(p_t),    e_t = p_t - D(C(p_t)),

so every coordinate is eventually sent. The invariant ``e_t + D(C(p_t)) == p_t`` holds exactly (up to the
float rounding of one subtraction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hvdcomp.compressor import Compressor, Context, Payload, State

if TYPE_CHECKING:
    from hvdcomp.requests import Agree


class ErrorFeedback(Compressor):
    """Wraps ``inner`` with a per-parameter residual (float32, the tensor's shape and device)."""

    unbiased = False

    def __init__(self, inner: Compressor) -> None:
        if isinstance(inner, ErrorFeedback):
            raise ValueError(f"{inner!r} already has error feedback")
        if inner.own_memory:
            raise ValueError(f"{inner.name} keeps its own memory: it takes no generic error feedback")
        self.inner = inner

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.inner.summable

    @property
    def fixed_size(self) -> bool:  # type: ignore[override]
        return self.inner.fixed_size

    @property
    def sparse_payload(self) -> bool:  # type: ignore[override]
        return self.inner.sparse_payload

    @property
    def reduction(self) -> str | None:  # type: ignore[override]
        return self.inner.reduction

    @property
    def keeps_nonfinite(self) -> bool:  # type: ignore[override]
        return self.inner.keeps_nonfinite

    def compresses(self, shape: torch.Size) -> bool:
        return self.inner.compresses(shape)

    def why_dense(self, shape: torch.Size) -> str:
        return self.inner.why_dense(shape)

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        # contiguous whatever the parameter's memory format (channels-last): compressors view it flat
        return {"residual": torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device),
                "inner": self.inner.init_state(tensor, ctx)}

    def agree(self, tensor: torch.Tensor, state: State, ctx: Context) -> Agree | None:
        return self.inner.agree(tensor + state["residual"], state["inner"], ctx)

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        residual = state["residual"]
        compensated = residual.add_(tensor)  # p_t, built in the residual's buffer: no allocation
        payload, meta = self.inner.compress(compensated, state["inner"], ctx, agreed)
        storage = residual.untyped_storage().data_ptr()
        payload = [part.clone() if part.untyped_storage().data_ptr() == storage else part for part in payload]
        self.inner.subtract(residual, payload, meta)  # e_t = p_t - D(C(p_t))
        return payload, meta

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        return self.inner.decompress(payload, meta)

    def aggregate(self, payloads: list[Payload], meta: Any) -> torch.Tensor:
        return self.inner.aggregate(payloads, meta)

    def plan(self, state: State) -> str:
        return self.inner.plan(state["inner"])

    def decisions(self, state: State) -> list[Any] | None:
        return self.inner.decisions(state["inner"])

    def unwrapped(self) -> Compressor:
        return self.inner

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"
