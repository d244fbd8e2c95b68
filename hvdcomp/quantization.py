"""What the bucketed quantizers share (BinGrad, ORQ, QSGD, 1-bit SGD, the sign family): codes of ``bits``
bits per element, and per bucket of ``bucket_size`` elements a table of levels the codes index.

A payload is ``[tables, packed]``: ``tables`` float32 [buckets, T] and ``packed`` the codes as a b-bit stream
(:mod:`hvdcomp.packing`). Either the table holds the bucket's levels (T = 2^bits: BinGrad, ORQ, 1-bit SGD), or
one scale per bucket multiplies a fixed grid of levels that both sides know (T = 1: QSGD's norm, the sign
family's magnitude); :meth:`BucketQuantizer.grid` says which. Every payload has the same sizes for a given
shape on every rank (``fixed_size``): they travel by allgather or two-phase, and a rank decodes and sums all
ranks' payloads in one pass (:func:`decode_sum`).

The fused kernels compute the levels, draw, round and pack each bucket while it is in cache (CPU:
``hvdcomp/kernels/quant.cpp``) or in registers (CUDA: :mod:`hvdcomp.kernels.gpu`, buckets of up to
``MAX_BUCKET`` elements), with the same draws, so both give the same codes; without them (no compiler, no
Triton, a larger bucket on CUDA) each method's PyTorch path runs the same algorithm on a [buckets, bucket_size]
view. No path synchronizes with the device.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from hvdcomp import check
from hvdcomp.compressor import Compressor, Context, State, derive_seed
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.packing import unpack_bits
from hvdcomp.wire import Payload

_generators: dict[torch.device, torch.Generator] = {}
_grids: dict[tuple[str, int, torch.device], torch.Tensor] = {}


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A per-device generator reseeded for one draw (the PyTorch paths' randomness, TernGrad's too)."""
    found = _generators.get(device)
    if found is None:
        found = _generators[device] = torch.Generator(device=device)
    return found.manual_seed(seed)


def check_bucket_size(method: str, bucket_size: Any) -> int:
    """``bucket_size`` of ``method``: whole groups of 8 codes, which fill whole bytes whatever the bits."""
    return check.integer(method, "bucket_size", bucket_size, ge=1, multiple_of=8,
                         expected="a positive multiple of 8 (a group of 8 codes fills whole bytes)")


def buckets(x: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat) as [buckets, bucket] zero-padded, and the mask of real entries."""
    rows = -(-x.numel() // bucket)
    padded = x.new_zeros(rows * bucket)
    padded[:x.numel()] = x
    valid = torch.ones(rows * bucket, dtype=torch.bool, device=x.device)
    valid[x.numel():] = False
    return padded.view(rows, bucket), valid.view(rows, bucket)


def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' parts as one [R, ...] tensor for the decoding kernels, which take rows at any stride: a view where
    the parts lie at equal steps in one buffer (one part; gathered payloads, each rank's segment after the last),
    else a copy."""
    first = parts[0]
    if len(parts) == 1:
        return first.unsqueeze(0)
    step = parts[1].data_ptr() - first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    if step > 0 and step % first.element_size() == 0 and all(
            part.shape == first.shape and part.dtype == first.dtype and part.is_contiguous()
            and part.untyped_storage().data_ptr() == storage and part.data_ptr() == first.data_ptr() + index * step
            for index, part in enumerate(parts)):
        return first.as_strided((len(parts), *first.shape), (step // first.element_size(), *first.stride()))
    return torch.stack(parts)


def stacked_scalars(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' one-element parts (a scale per payload) as one [R] tensor for the decoding kernels: a view at a
    stride where gathered, as :func:`stacked` takes them."""
    return stacked([part.reshape(1) for part in parts])[:, 0]


def decode_sum(packed: list[torch.Tensor], tables: list[torch.Tensor], grid: torch.Tensor | None, bits: int,
               bucket: int, n: int) -> torch.Tensor:
    """Sum over payloads of their decoded values, float32 [n], added in payload (rank) order. Tables may arrive
    flattened (gathered payloads travel as flat parts)."""
    device = packed[0].device
    rows = -(-n // bucket)
    if rows == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    tables = [table.reshape(rows, -1) for table in tables]
    kernels = kernels_for(device)
    if kernels is not None:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return kernels.decode_sum(stacked(packed), stacked(tables).float(), empty if grid is None else grid,
                                  bits, bucket, n)
    total = torch.zeros(n, dtype=torch.float32, device=device)
    for part, table in zip(packed, tables, strict=True):
        codes = torch.zeros(rows * bucket, dtype=torch.int64, device=device)
        codes[:n] = unpack_bits(part, bits, n)
        codes = codes.view(rows, bucket)
        values = table[:, :1] * grid[codes] if grid is not None else torch.gather(table, 1, codes)
        total += values.reshape(-1)[:n]
    return total


class BucketQuantizer(Compressor):
    """Base of the quantizers whose payload is per-bucket tables plus ``bits``-bit codes (module docstring).

    Subclasses set ``bits`` and ``bucket_size`` (None: the whole tensor is one bucket) and implement
    :meth:`quantize_kernel` (the fused CPU kernels) and :meth:`quantize_torch` (any device).
    """

    fixed_size = True
    bits: int
    bucket_size: int | None

    def bucket(self, n: int) -> int:
        """The bucket length for an n-element tensor."""
        return max(n, 1) if self.bucket_size is None else self.bucket_size

    def grid(self, device: torch.device) -> torch.Tensor | None:
        """The levels a table's one scale multiplies (indexed by the code), or None if tables hold the levels."""
        return None

    def bits_per_element(self) -> float:
        """What a payload spends per element: the code's bits and each bucket's float32 table (2^bits levels, or one
        scale of a grid) spread over the bucket; a tensor in one bucket (``bucket_size`` None) spends its bits."""
        if self.bucket_size is None:
            return float(self.bits)
        table = 1 if self.grid(torch.device("cpu")) is not None else 1 << self.bits
        return self.bits + 32 * table / self.bucket_size

    @staticmethod
    def cached_grid(kind: str, bits: int, device: torch.device,
                    make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A grid made once per device (on the device: no host copy, no sync)."""
        key = (kind, bits, device)
        if key not in _grids:
            _grids[key] = make(torch.arange(1 << bits, dtype=torch.float32, device=device))
        return _grids[key]

    def rounding_levels(self, payload: Payload) -> torch.Tensor:
        """The sorted levels [buckets, L] each bucket of ``payload`` rounds between (for :func:`rounding_variance`)."""
        grid = self.grid(payload[0].device)
        return payload[0] if grid is None else payload[0] * grid

    def fused_kernels(self, x: torch.Tensor) -> ModuleType | None:
        """The fused kernels for ``x`` (:func:`hvdcomp.kernels.kernels_for`), or None where they do not apply: the
        Triton kernels hold a bucket in registers, up to ``MAX_BUCKET`` elements."""
        kernels = kernels_for(x.device)
        if is_triton(kernels) and self.bucket_size is not None \
                and self.bucket_size > kernels.MAX_BUCKET:
            return None
        return kernels

    @abstractmethod
    def quantize_kernel(self, kernels: Any, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tables, packed) of a flat float32 tensor, by the fused kernels (the C++ extension on CPU, the Triton
        kernels on CUDA: the same functions)."""

    @abstractmethod
    def quantize_torch(self, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tables, packed) of a flat float32 tensor on any device, by PyTorch ops without host syncs."""

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        x = tensor.detach().reshape(-1).to(torch.float32).contiguous()
        seed = derive_seed(ctx.seed, ctx.step)
        kernels = self.fused_kernels(x)
        tables, packed = (self.quantize_kernel(kernels, x, seed) if kernels is not None
                          else self.quantize_torch(x, seed))
        return [tables, packed], (tensor.shape, x.numel())

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        return self.aggregate([payload], meta)

    def subtract(self, residual: torch.Tensor, payload: Payload, meta: Any) -> None:
        """Error feedback's ``residual -= decompress(payload)``: where the fused kernels apply (the residual float32
        and contiguous, as error feedback keeps it), in one pass, without the decoded tensor."""
        _, n = meta
        kernels = kernels_for(residual.device)
        if kernels is None or n == 0 or residual.dtype != torch.float32 or not residual.is_contiguous():
            super().subtract(residual, payload, meta)
            return
        bucket = self.bucket(n)
        grid = self.grid(residual.device)
        tables = payload[0].reshape(1, -(-n // bucket), -1).float()
        kernels.decode_subtract(residual.view(-1), payload[1].unsqueeze(0), tables,
                                torch.empty(0, dtype=torch.float32, device=residual.device) if grid is None else grid,
                                self.bits, bucket)

    def aggregate(self, payloads: list[Payload], meta: Any) -> torch.Tensor:
        shape, n = meta
        device = payloads[0][1].device
        return decode_sum([payload[1] for payload in payloads], [payload[0] for payload in payloads],
                          self.grid(device), self.bits, self.bucket(n), n).view(shape)


def rounding_variance(x: torch.Tensor, levels: torch.Tensor, bucket: int) -> torch.Tensor:
    """Per element of ``x`` (flat), the variance of rounding it stochastically between the neighbouring levels
    of its bucket (``levels`` [buckets, L], sorted): (l_{j+1} - g)(g - l_j), float64. The quantity ORQ
    minimizes, for comparing it with QSGD's and uniform levels' (tests, ``perf/codecs/quantizer_variance.py``)."""
    xb, _ = buckets(x.double(), bucket)
    levels = levels.double()
    j = (torch.searchsorted(levels, xb, right=True) - 1).clamp_(0, levels.shape[1] - 2)
    low, high = torch.gather(levels, 1, j), torch.gather(levels, 1, j + 1)
    return ((high - xb) * (xb - low)).clamp_(min=0).reshape(-1)[:x.numel()]
