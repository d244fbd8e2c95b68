"""Triton kernel for random-k's selection (:mod:`hvdcomp.methods.randomk`): the GPU counterpart of
``hvdcomp/kernels/randomk.cpp``, drawing the same positions from the same seed.

Stratum b of k covers [floor(b n / k), floor((b + 1) n / k)); its position is start + floor(u length), u the top 53
bits of splitmix64(seed xor b * 0xD6E8FEB86659FD93) over 2^53. One program draws, gathers and scales a block of
strata: a pass over the k kept entries, none over the n.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hvdcomp.kernels.gpu.common import splitmix64

_BLOCK = 1024


@triton.jit(do_not_specialize=["n", "k", "seed"])
def _select_kernel(x_ptr, values_ptr, indices_ptr, n, k, seed, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    strata = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = strata < k
    n64 = n.to(tl.int64)
    k64 = k.to(tl.int64)
    quotient = n64 // k64
    remainder = n64 % k64
    # floor(b n / k) without the product b n, which could pass 2^63
    start = strata * quotient + strata * remainder // k64
    end = (strata + 1) * quotient + (strata + 1) * remainder // k64
    length = end - start
    key = seed.to(tl.int64).to(tl.uint64, bitcast=True) ^ (strata.to(tl.uint64, bitcast=True) * 0xD6E8FEB86659FD93)
    bits = splitmix64(key)
    u = (bits >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)  # 53 bits, in [0, 1)
    index = start + tl.minimum(length - 1, (u * length.to(tl.float64)).to(tl.int64))
    value = tl.load(x_ptr + index, mask=mask, other=0.0)
    if SCALE:
        value = value * length.to(tl.float32)
    tl.store(values_ptr + strata, value, mask=mask)
    tl.store(indices_ptr + strata, index, mask=mask)


def randomk_select(x: torch.Tensor, k: int, seed: int, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``randomk_select`` of the CPU kernels: (values float32 [k], positions int64 [k]) of one stratified draw from
    the flat float32 ``x``, values times their stratum's length if ``scale``."""
    n = x.numel()
    if not 1 <= k <= n:
        raise ValueError(f"randomk_select: k must be in [1, n] = [1, {n}], got {k}")
    values = torch.empty(k, dtype=torch.float32, device=x.device)
    indices = torch.empty(k, dtype=torch.int64, device=x.device)
    _select_kernel[(triton.cdiv(k, _BLOCK),)](x, values, indices, n, k, seed, SCALE=scale, BLOCK=_BLOCK)
    return values, indices
