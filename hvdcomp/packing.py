"""Bit packing of small integer codes into uint8, vectorized for CPU and CUDA tensors.

Codes of ``bits`` bits (1 to 8) form a little-endian bit stream: element i occupies bits [i*bits, (i+1)*bits)
of the byte string, so 8 elements take exactly ``bits`` bytes and a payload of n codes takes
ceil(n * bits / 8) bytes. At 2 bits this is TernGrad's encoding (element j of a byte at bits 2j..2j+1). The
fused CPU kernels in :mod:`hvdcomp.kernels` read and write the same format.
"""

from __future__ import annotations

import torch


def packed_bytes(n: int, bits: int) -> int:
    return -(-n * bits // 8)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs a 1-D uint8 tensor of codes in [0, 2^bits) into ceil(n * bits / 8) bytes (padding codes are 0)."""
    _check_bits(bits)
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise ValueError(f"pack_bits expects a 1-D uint8 tensor, got {codes.dtype} of shape {tuple(codes.shape)}")
    n = codes.numel()
    groups = codes.new_zeros(-(-n // 8) * 8, dtype=torch.int64)
    groups[:n] = codes
    # Shifts made on the device: no host copy, no sync.
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=codes.device)
    words = (groups.view(-1, 8) << shifts).sum(dim=1)  # disjoint bits: the sum is the OR
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=codes.device)
    return ((words.unsqueeze(1) >> byte_shifts) & 255).to(torch.uint8).reshape(-1)[:packed_bytes(n, bits)]


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` for the last dimension: ``[..., ceil(n * bits / 8)]`` bytes to ``[..., n]``."""
    _check_bits(bits)
    if packed.shape[-1] != packed_bytes(n, bits):
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold {n} codes of {bits} bits "
                         f"(expected {packed_bytes(n, bits)})")
    groups = -(-n // 8)
    padded = packed.new_zeros((*packed.shape[:-1], groups * bits), dtype=torch.int64)
    padded[..., :packed.shape[-1]] = packed
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=packed.device)
    words = (padded.view(*packed.shape[:-1], groups, bits) << byte_shifts).sum(dim=-1)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=packed.device)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).flatten(-2)[..., :n]
