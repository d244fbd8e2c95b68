"""Top-k sparsification (Aji & Heafield, EMNLP 2017; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018).

Each rank sends the k = ceil(ratio * d) entries of largest magnitude, as values and int32 indices
(int64 beyond 2^31 elements):

    Q(g) = g * 1{|g_k| >= |g|_(k)},

biased, so it runs with error feedback by default (:mod:`hvdcomp.error_feedback`): with memory it converges
at the rate of SGD (Stich et al., Theorem 2.4). On CPU, selected entries that are exactly zero are not sent,
so a rank whose gradient is sparse (unused embedding rows, a parameter that got no gradient) sends less:
payload sizes differ per rank, and the allgather collective gathers the sizes too (one host sync per tensor
in ``synchronize()``, as ``hvd.allgather`` itself does). On CUDA all k entries travel: dropping the zeros
would need the count on the host, a sync inside backward.

Decoding adds each rank's payload in rank order (an index is unique within one payload), so the sum has the
same bits on every rank and every device: one ``index_add_`` over all ranks' indices at once would add
duplicates in an order CUDA does not fix.

Momentum (``momentum``, 0.9 by default) is applied on each rank before error feedback, DGC's momentum correction
(Lin et al., ICLR 2018, Section 3.2; :class:`hvdcomp.error_feedback.ErrorFeedback` with a momentum), and the
optimizer applies none to these parameters (they need a group with ``momentum`` 0, as DGC's do; ``hvdcomp train``
sets it): error feedback holds the small entries back for many steps, and the optimizer's momentum applied after
the sum then amplifies each late burst again. On the glyphs workload (2 ranks, SGD lr 0.1, momentum 0.9, 3 epochs,
seed 0) top-k at 1% under the optimizer's momentum ended 1.2 points below dense, and with momentum correction 0.3
below (perf/accuracy/README.md). ``momentum: 0`` gives the optimizer's momentum back. Unlike DGC, nothing is masked.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import MEASURED, Compressor, Context, State
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.wire import Payload

#: entries in the sample that sets the candidate threshold (tensors under 4x this go straight to torch.topk)
_SAMPLE = 65536


@functools.lru_cache(maxsize=64)
def sample_stride(n: int) -> int:
    """The step between sampled entries of an ``n``-entry tensor: the smallest prime >= n / 65536.

    A gradient's magnitudes differ by column (a linear layer's is the outer product of its output errors and
    its inputs), and rows are usually a power of two (or a multiple of 9, for 3x3 convolutions) wide: a step
    of 256 over 4096-wide rows would sample the same 16 of the 4096 columns in every row. A prime step walks
    across all of them.
    """
    step = max(2, n // _SAMPLE)
    while any(step % d == 0 for d in range(2, math.isqrt(step) + 1)):
        step += 1
    return step


def candidate_threshold(x: torch.Tensor, k: int) -> torch.Tensor:
    """A magnitude a few standard deviations below the ``k``-th largest of ``|x|``, from a sample of ``x``."""
    sample = x[::sample_stride(x.numel())].abs()
    expected = k * sample.numel() / x.numel()  # sampled entries expected above the k-th largest
    rank = min(sample.numel(), math.ceil(expected + 4 * math.sqrt(expected) + 1))
    return sample.topk(rank, sorted=False).values.min()


def sampled(x: torch.Tensor, k: int) -> bool:
    """Whether :func:`largest` selects through a sampled threshold: on CPU, for at least 4 x 65536 entries
    and k at most an eighth of them."""
    return x.device.type == "cpu" and x.numel() >= 4 * _SAMPLE and 8 * k <= x.numel()


def largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` entries of the 1-D ``x`` with the largest magnitude, in no particular order.

    On CPU ``torch.topk`` over millions of elements is slow (0.3 s for 16.8 M elements on one thread), and so
    is a full-size ``x.abs()`` (36 ms: a fresh 67 MB buffer's page faults). The same set comes faster from a
    candidate threshold t (:func:`candidate_threshold`): one pass gathers the entries with x >= t or x <= -t
    (slightly more than k) and topk runs on those only. A threshold that keeps fewer than k (a sample unlike
    the rest) falls back to the full topk, so the result is the exact top-k either way. On CUDA, where counting
    the candidates would need a host sync, the Triton kernels' radix select finds the exact k-th magnitude on the
    device and compacts the entries at or above it (:mod:`hvdcomp.kernels.gpu.select`: deterministic, ties broken
    by index); without Triton ``torch.topk`` runs directly.
    """
    kernels = kernels_for(x.device)
    if is_triton(kernels):
        return kernels.topk(x, k)[1]
    if not sampled(x, k):
        return x.abs().topk(k, sorted=False).indices
    threshold = candidate_threshold(x, k)
    candidates = (x >= threshold).logical_or_(x <= -threshold).nonzero().view(-1)
    if candidates.numel() < k:
        return x.abs().topk(k, sorted=False).indices
    return candidates[x[candidates].abs().topk(k, sorted=False).indices]


def top_entries(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` entries of the 1-D ``x`` with the largest magnitude, the indices of
    :func:`index_dtype`: on CUDA as the Triton selection writes them (those above the k-th largest magnitude in index
    order, then the first of those equal to it), elsewhere :func:`largest`'s indices and the values gathered at
    them."""
    kernels = kernels_for(x.device)
    if is_triton(kernels):
        return kernels.topk(x, k, index_dtype(x.numel()))
    indices = largest(x, k)
    return x[indices], indices.to(index_dtype(x.numel()))


def cuda_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take CUDA's path, where nothing may wait for the device: off the CPU (on CUDA),
    or under the Triton kernels (in their interpreter on CPU tensors, which stands in for CUDA in tests and counts)."""
    return device.type != "cpu" or is_triton(kernels_for(device))


def without_zeros(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected entries worth sending: on CUDA's path all k of them, as finding the zeros would make the host
    wait for the device; elsewhere those that are not exactly zero."""
    if cuda_path(values.device):
        return values, indices
    nonzero = values != 0
    return values[nonzero], indices[nonzero]


def add_index(indices: torch.Tensor) -> torch.Tensor:
    """Payload indices as ``index_add_`` takes them: on CUDA's path as the selection wrote them (int32 or int64,
    not converted here: a launch saved), elsewhere int64 (PyTorch's CPU ``index_add_`` is slower with int32)."""
    return indices if cuda_path(indices.device) else indices.long()


class Sparse(Compressor):
    """Payloads of (values, indices) with indices unique within a payload: top-k's decoding, shared by the
    sparsifiers (top-k, threshold, DGC) and the homomorphic sketch. Decoding adds each rank's payload in rank
    order (module docstring).

    ``meta`` is ``(shape, items, dtype)``: an index names one of ``items`` blocks of ``shape.numel() // items``
    consecutive values (single entries for the sparsifiers, rows for the sketch of an embedding's gradient).
    """

    unbiased = False
    fixed_size = False
    sparse_payload = True

    def fixed_size_on(self, device: torch.device) -> bool:
        """On CUDA's path every rank sends its k (or capacity) entries, zeros too (:func:`without_zeros`)."""
        return cuda_path(device)

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        return self.aggregate([payload], meta)

    def subtract(self, residual: torch.Tensor, payload: Payload, meta: Any) -> None:
        values, indices = payload
        shape, items, _ = meta
        width = block(shape, items)
        residual.view(items, width).index_add_(0, add_index(indices), values.to(residual.dtype).view(-1, width),
                                               alpha=-1)

    def aggregate(self, payloads: list[Payload], meta: Any) -> torch.Tensor:
        """The ranks' payloads added in rank order, in float32 at least (as every method sums): half-precision
        values (a bare method on a half gradient) would round in the sum, or overflow before the average."""
        shape, items, dtype = meta
        width = block(shape, items)
        dtype = torch.promote_types(dtype, torch.float32)
        total = torch.zeros(items, width, dtype=dtype, device=payloads[0][0].device)
        for values, indices in payloads:  # rank order; indices unique within a payload: deterministic
            total.index_add_(0, add_index(indices), values.to(dtype).view(-1, width))
        return total.view(shape)


def block(shape: torch.Size, items: int) -> int:
    """Values per index of a sparse payload of ``items`` blocks over ``shape``."""
    return math.prod(shape) // items if items else 1


def index_dtype(n: int) -> torch.dtype:
    """int32 indices for tensors under 2^31 entries, int64 beyond."""
    return torch.int32 if n < 2**31 else torch.int64


class TopK(Sparse):
    """Keeps the ``ratio`` fraction of entries with the largest magnitude (at least one).

    Args:
        ratio: fraction of entries sent, in (0, 1]; 0.01 sends 1% (about 64x less than float32 with indices).
        momentum: the momentum applied before error feedback in place of the optimizer's (momentum correction,
            module docstring); 0: the optimizer's momentum applies.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, momentum: float = 0.9) -> None:
        check.number(self.name, "ratio", ratio, gt=0, le=1)
        self.ratio = float(ratio)
        self.momentum = check.number(self.name, "momentum", momentum, ge=0, lt=1)  # the memory policy reads it

    def accuracy_risk(self) -> str | None:
        if self.momentum:
            return None
        return (f"top-k under the optimizer's momentum ended 1.2 points below dense {MEASURED}, 0.3 below with "
                "momentum: 0.9 (the default; its parameters then need momentum 0 in the optimizer)")

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        x = tensor.detach().reshape(-1)
        n = x.numel()
        k = min(n, max(1, math.ceil(self.ratio * n)))
        values, indices = without_zeros(*top_entries(x, k))
        return [values, indices], (tensor.shape, n, x.dtype)
