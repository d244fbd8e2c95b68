"""Half precision on the wire: the baseline of every compression study (Horovod's ``Compression.fp16``).

Floating-point gradients (float32, float64, bfloat16) travel as float16 and are summed in float16 by
allreduce: 2x less traffic than float32, at the cost of float16's range (|x| < 65504; a sum that overflows
becomes inf, which the optimizer reports). Other dtypes travel unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from hvdcomp.compressor import Compressor, Context, State
from hvdcomp.wire import Payload


class FP16Compressor(Compressor):
    """Casts floating-point tensors to float16 for the wire; summable."""

    name = "fp16"
    summable = True
    keeps_nonfinite = True  # an overflow to inf, or a NaN, survives the cast and the sum
    stateless = True

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        if tensor.dtype.is_floating_point:
            return [tensor.to(torch.float16)], tensor.dtype
        return [tensor], tensor.dtype

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        # No cast: whoever stores the result casts on the way (the optimizer writes into p.grad with out=),
        # which saves a full-size temporary.
        return payload[0]
