"""Fused Triton kernels: the CUDA path of the quantizers and of random-k, with the same functions, arguments, wire
format and draws as the CPU kernels of ``hvdcomp/kernels/*.cpp`` (``ternary.py`` for TernGrad and the tensor-wide
moments, ``quant.py`` for the bucketed quantizers, ``randomk.py`` for random-k's selection, ``common.py`` for the
generator and the bit packing), the sparsifiers' exact top-k selection on the device (``select.py``), the homomorphic
sketch's rows, deterministic encoding and peeling (``sketch.py``), PowerSGD's orthogonalization and its products
of several matrices in one launch (``lowrank.py``), the memory's update, momentum correction with error feedback's
accumulation, and DGC's release (``memory.py``), GraVAC's squared norms of several tensors at once (``norms.py``),
and LGC's guard's projection (``projection.py``).

Scalars the CPU kernels take or return as host values (TernGrad's scaler and clip bound, the sign family's scale)
stay on the device here, so nothing waits for the GPU. Sizes, seeds and counts are not specialized on
(``do_not_specialize``): a kernel compiles once per bit width and kind, not once per tensor size or step.
Each floating-point operation rounds as the CPU kernels' does: every launch where a multiply feeds an add passes
``enable_fp_fusion=False`` (the compiler would otherwise fuse the two into one FMA, rounded once), and float32
divisions and square roots are the correctly rounded ``tl.div_rn`` and ``tl.sqrt_rn`` (Triton's ``/`` and
``tl.sqrt`` on float32 compile to approximations, ``div.full.f32`` and ``sqrt.approx.f32``; on float64 they round
correctly). Sums are another matter: the GPU adds in a tree, the CPU in its own order (or in float64), so codes and
levels are the same bits on both where the sums are exact (the tests' dyadic inputs), and differ by rounding
elsewhere.
Each function runs with its tensors' GPU as the current CUDA device (:func:`_on_their_device`).
Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before this package is imported) runs the same
kernels on CPU tensors: that is how they are tested without a GPU, and tests/test_triton.py puts a covering set of
the launches those tests made through Triton's compiler front end for a Hopper GPU (sm_90), which needs no GPU either.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch

from hvdcomp.kernels.gpu.lowrank import (
    MAX_PRODUCT_RANK,
    MAX_PRODUCT_SIDE,
    approximations,
    orthogonalize,
    orthogonalize_parts,
    products,
)
from hvdcomp.kernels.gpu.memory import momentum_step, release
from hvdcomp.kernels.gpu.norms import MAX_NORMS, squared_norms
from hvdcomp.kernels.gpu.projection import projection, projection_error
from hvdcomp.kernels.gpu.quant import (
    MAX_BUCKET,
    decode_subtract,
    decode_sum,
    pack_signs,
    pack_signs_abs_mean,
    quantize_binary,
    quantize_levels,
    sign_vote,
)
from hvdcomp.kernels.gpu.randomk import randomk_select
from hvdcomp.kernels.gpu.select import excess_moments, threshold_fit, topk
from hvdcomp.kernels.gpu.sketch import (
    sketch_bucket_counts,
    sketch_candidates,
    sketch_encode,
    sketch_peel,
    sketch_rows,
)
from hvdcomp.kernels.gpu.ternary import abs_mean, ternarize_pack, ternary_statistics, unpack_sum

__all__ = ["MAX_BUCKET", "MAX_NORMS", "MAX_PRODUCT_RANK", "MAX_PRODUCT_SIDE", "abs_mean", "approximations",
           "decode_subtract", "decode_sum", "excess_moments", "momentum_step", "orthogonalize", "orthogonalize_parts",
           "pack_signs", "pack_signs_abs_mean", "products", "projection", "projection_error", "quantize_binary",
           "quantize_levels", "randomk_select", "release", "sign_vote", "sketch_bucket_counts", "sketch_candidates",
           "sketch_encode", "sketch_peel", "sketch_rows", "squared_norms", "ternarize_pack", "ternary_statistics",
           "threshold_fit", "topk", "unpack_sum"]


def _on_their_device(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run with the GPU of its first tensor argument as the current CUDA device. Triton launches on the
    current device and its stream, where PyTorch's operators take their tensors' device: in a process whose tensors
    are on several GPUs (a model split across them) a kernel would otherwise run on another GPU than its tensors',
    unordered with their stream. Where the device is current already (one GPU per rank), one check and no switch."""
    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None  # a tensor, or a list of them followed by one
        tensor = first if isinstance(first, torch.Tensor) else next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        index = -1 if tensor is None else tensor.get_device()  # -1 on CPU (the interpreter)
        if index < 0 or index == torch.cuda.current_device():
            return function(*args, **kwargs)
        with torch.cuda.device(index):
            return function(*args, **kwargs)
    return guarded


for _name in __all__:  # every function of this package's interface (not its constants)
    if callable(globals()[_name]):
        globals()[_name] = _on_their_device(globals()[_name])
