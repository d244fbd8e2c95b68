"""Triton kernels for TernGrad (Wen et al., NeurIPS 2017) and the tensor-wide statistics of the sign family:
the GPU counterparts of ``hvdcomp/kernels/ternary.cpp``.

Compression is one statistics pass and one clip-draw-pack pass, with the scaler agreement between them:

* :func:`ternary_statistics` reads the tensor once (per-block partial sums, then one small program adds them in a
  fixed order, so the result is deterministic) and returns the clip bound c * sigma and the local scaler
  min(max |g|, c * sigma) as a device tensor: no host sync;
* :func:`ternarize_pack` reads the (agreed) scaler from device memory and writes 2-bit codes, 4 per byte:
  a_k = min(|g_k|, c * sigma); the code is sign(g_k) where u_k * s < a_k, else 0 (eq. 5 with clipping, eq. 12);
* :func:`unpack_sum` decodes the ranks' payloads and adds them in rank order, in one pass.

The draws are the CPU kernels' (:mod:`hvdcomp.kernels.gpu.common`), so the codes equal the CPU's for the same
scaler and seed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import power_scale, seed_key, uniforms

#: the entries one program of the moments' first pass sums (``finish_moments`` takes rows of this many)
STATS_BLOCK = 4096
_PACK_BLOCK = 4096
_FINAL_BLOCK = 1024
#: what the finalizing program computes from the moments
_TERNARY, ABS_MEAN = 0, 1


@triton.jit(do_not_specialize=["n"])
def _moments_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    """Per block, a row of ``partial`` (float32): the sum and the sum of squared deviations from the block's own
    mean, both of x times the block's :func:`power_scale`, then max |x| and sum |x| times that scale. Deviations, not
    sum(x^2): in float32, sum(x^2) - sum(x)^2 / n cancels where the mean is far above the spread; scaled (exactly, by
    a power of two), so that neither the sums (|x| above ~1e34) nor the squares overflow (~1.8e19) or underflow
    (~1e-19)."""
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n
    x = tl.load(x_ptr + offsets, mask=valid, other=0.0)
    top = tl.max(tl.abs(x))
    scaled = x * power_scale(top)
    total = tl.sum(scaled)
    deviation = tl.where(valid, scaled - tl.div_rn(total, tl.minimum(n - pid * BLOCK, BLOCK).to(tl.float32)), 0.0)
    tl.store(partial_ptr + pid * 4 + 0, total)
    tl.store(partial_ptr + pid * 4 + 1, tl.sum(deviation * deviation))
    tl.store(partial_ptr + pid * 4 + 2, top)
    tl.store(partial_ptr + pid * 4 + 3, tl.sum(tl.abs(scaled)))


@triton.jit(do_not_specialize=["blocks", "n"])
def _finish_kernel(partial_ptr, out_ptr, blocks, n, clip: tl.float64, MODE: tl.constexpr, ROW: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One program: merges the rows of blocks of ``ROW`` entries (their scaled sums and deviations back in x's
    units: :func:`power_scale` of the row's max) in float64 in a fixed order, then writes [bound, scaler] (TernGrad:
    c * sigma, and min(max |x|, c * sigma); clip < 0 means no clipping) or [sum |x| / n] (the sign family, which
    reads only the rows' max and sum |x|). Sigma merges the blocks' deviations as Chan et al. (1979) do: M2 =
    sum_b M2_b + sum_b n_b (mean_b - mean)^2."""
    if MODE == 0:
        total = tl.zeros([BLOCK], dtype=tl.float64)
        absmax = tl.zeros([BLOCK], dtype=tl.float32)
        start = 0
        while start < blocks:  # (while, not range: Triton 3.6's interpreter fails on range(runtime value), numpy 2.4)
            rows = start + tl.arange(0, BLOCK)
            mask = rows < blocks
            top = tl.load(partial_ptr + rows * 4 + 2, mask=mask, other=0.0)
            total += tl.load(partial_ptr + rows * 4 + 0, mask=mask, other=0.0).to(tl.float64) / power_scale(top)
            absmax = tl.maximum(absmax, top)
            start += BLOCK
        mean = tl.sum(total) / n
        deviations = tl.zeros([BLOCK], dtype=tl.float64)
        start = 0
        while start < blocks:
            rows = start + tl.arange(0, BLOCK)
            mask = rows < blocks
            count = tl.maximum(tl.minimum(n - rows.to(tl.int64) * ROW, ROW), 1).to(tl.float64)
            scale = power_scale(tl.load(partial_ptr + rows * 4 + 2, mask=mask, other=0.0)).to(tl.float64)
            offset = tl.load(partial_ptr + rows * 4 + 0, mask=mask, other=0.0).to(tl.float64) / (scale * count) - mean
            spread = tl.load(partial_ptr + rows * 4 + 1, mask=mask, other=0.0).to(tl.float64) / (scale * scale)
            deviations += tl.where(mask, spread + count * offset * offset, 0.0)
            start += BLOCK
        bound = (clip * tl.sqrt(tl.sum(deviations) / n)).to(tl.float32)
        bound = tl.where(clip < 0, float("inf"), bound)
        tl.store(out_ptr, bound)
        tl.store(out_ptr + 1, tl.minimum(tl.max(absmax), bound))
    else:
        absolute = tl.zeros([BLOCK], dtype=tl.float64)
        start = 0
        while start < blocks:
            rows = start + tl.arange(0, BLOCK)
            mask = rows < blocks
            scale = power_scale(tl.load(partial_ptr + rows * 4 + 2, mask=mask, other=0.0)).to(tl.float64)
            absolute += tl.load(partial_ptr + rows * 4 + 3, mask=mask, other=0.0).to(tl.float64) / scale
            start += BLOCK
        tl.store(out_ptr, (tl.sum(absolute) / n).to(tl.float32))


def _moments(x: torch.Tensor, mode: int, clip: float, results: int) -> torch.Tensor:
    """The ``results`` values of ``mode`` (float32, on x's device). One allocation holds them and, after them, the
    per-block partial rows; zeros for an empty tensor."""
    n = x.numel()
    if n == 0:
        return torch.zeros(results, dtype=torch.float32, device=x.device)
    blocks = triton.cdiv(n, STATS_BLOCK)
    buffer = torch.empty(results + 4 * blocks, dtype=torch.float32, device=x.device)
    _moments_kernel[(blocks,)](x, buffer[results:], n, BLOCK=STATS_BLOCK, enable_fp_fusion=False)
    return finish_moments(buffer, blocks, n, mode, clip, results)


def finish_moments(buffer: torch.Tensor, blocks: int, n: int, mode: int, clip: float, results: int) -> torch.Tensor:
    """The ``results`` values of ``mode`` from the partial rows of ``blocks`` blocks of ``STATS_BLOCK`` entries (sum,
    sum of squared deviations from the block's mean, max |x|, sum |x|, the sums times :func:`power_scale` of the max;
    ``ABS_MEAN`` reads only the max and sum |x|) that follow them in ``buffer``: one program."""
    _finish_kernel[(1,)](buffer[results:], buffer, blocks, n, clip, MODE=mode, ROW=STATS_BLOCK, BLOCK=_FINAL_BLOCK,
                         enable_fp_fusion=False)
    return buffer[:results]


def ternary_statistics(x: torch.Tensor, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound, scaler) of a flat float32 tensor, each a float32 tensor [1] on its device: the clip bound
    ``clip`` * sigma (inf for ``clip=None``) and the local scaler min(max |x|, bound). Zeros for an empty tensor."""
    out = _moments(x, _TERNARY, -1.0 if clip is None else float(clip), 2)
    return out[:1], out[1:]


def abs_mean(x: torch.Tensor) -> torch.Tensor:
    """||x||_1 / n of a flat float32 tensor as a float32 tensor [1, 1] on its device (0 when empty)."""
    return _moments(x, ABS_MEAN, 0.0, 1).view(1, 1)


@triton.jit(do_not_specialize=["n", "nbytes", "key"])
def _ternarize_kernel(x_ptr, scaler_ptr, bound_ptr, out_ptr, n, nbytes, key, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    scaler = tl.load(scaler_ptr)
    magnitude = tl.abs(x)
    bound = tl.load(bound_ptr)
    # std::min's rule, as the CPU kernel: a NaN stays NaN, and sends 0 (tl.minimum compiles to min.f32, which
    # returns the other operand: NaN was kept, as +scaler, where the bound is infinite)
    kept = tl.where(bound < magnitude, bound, magnitude)
    u = tl.reshape(uniforms(key, pid * (BLOCK // 2), 1, BLOCK, 0), [BLOCK])
    keep = ((u * scaler < kept) & (tl.zeros_like(u) + scaler > 0)).to(tl.uint8)  # a zero scaler sends zeros
    codes = keep << (x < 0).to(tl.uint8)  # 0, 1 (+1) or 2 (-1)
    quads = tl.reshape(codes, [BLOCK // 4, 4]).to(tl.int32)
    packed = tl.sum(quads << (tl.arange(0, 4) * 2)[None, :], axis=1).to(tl.uint8)
    bytes_ = pid * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    tl.store(out_ptr + bytes_, packed, mask=bytes_ < nbytes)


def ternarize_pack(x: torch.Tensor, scaler: torch.Tensor, bound: torch.Tensor, seed: int) -> torch.Tensor:
    """TernGrad's 2-bit codes of a flat float32 tensor, 4 per byte, with ``scaler`` and ``bound`` read on the
    device (float32 tensors of one element); the same codes as ``ternarize_pack`` of the CPU kernels."""
    n = x.numel()
    nbytes = -(-n // 4)
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        _ternarize_kernel[(triton.cdiv(n, _PACK_BLOCK),)](x, scaler, bound, out, n, nbytes, seed_key(seed),
                                                         BLOCK=_PACK_BLOCK, enable_fp_fusion=False)
    return out


@triton.jit(do_not_specialize=["ranks", "n", "row_stride", "scale_stride"])
def _unpack_sum_kernel(packed_ptr, scales_ptr, out_ptr, ranks, n, row_stride, scale_stride, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    total = tl.zeros([BLOCK], dtype=tl.float32)
    rank = 0
    while rank < ranks:  # in rank order, the same bits on every rank
        byte = tl.load(packed_ptr + rank.to(tl.int64) * row_stride + offsets // 4, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offsets % 4) * 2).to(tl.int32)) & 3
        total += tl.load(scales_ptr + rank.to(tl.int64) * scale_stride) * ((code & 1) - (code >> 1)).to(tl.float32)
        rank += 1
    tl.store(out_ptr + offsets, total, mask=mask)


def unpack_sum(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """Sum over ranks of scale_r times the decoded ternary codes: ``packed`` uint8 [R, ceil(n / 4)] (rows at any
    stride), ``scales`` [R] (at any stride: gathered scalars lie at a step); float32 [n], added in rank order."""
    ranks, nbytes = packed.shape
    if nbytes != -(-n // 4) or scales.dim() != 1 or scales.numel() != ranks or (nbytes > 1 and packed.stride(1) != 1):
        raise ValueError(f"unpack_sum: {ranks} payloads of {nbytes} bytes and {scales.numel()} scales cannot hold "
                         f"{n} elements (expected {-(-n // 4)} contiguous bytes and {ranks} scales)")
    out = torch.empty(n, dtype=torch.float32, device=packed.device)
    if n:
        block = min(_PACK_BLOCK, max(triton.next_power_of_2(n), 16))
        scales = scales.to(torch.float32)
        _unpack_sum_kernel[(math.ceil(n / block),)](packed, scales, out, ranks, n, packed.stride(0), scales.stride(0),
                                                    BLOCK=block, enable_fp_fusion=False)
    return out
