"""Bit packing of small integer codes into uint8, vectorized for CPU and CUDA tensors.

2-bit codes, 4 per byte, element j of a byte at bits 2j..2j+1 (TernGrad's encoding: 0b00 = 0, 0b01 = +1,
0b10 = -1). The fused CPU kernels in :mod:`hvdcomp.kernels` use the same format.
"""

from __future__ import annotations

import torch


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Packs a 1-D uint8 tensor of codes in [0, 3] into ceil(n / 4) bytes (padding codes are 0)."""
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise ValueError(f"pack_2bit expects a 1-D uint8 tensor, got {codes.dtype} of shape {tuple(codes.shape)}")
    n = codes.numel()
    padded = codes.new_zeros(-(-n // 4) * 4)
    padded[:n] = codes
    quads = padded.view(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def unpack_2bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_2bit` for the last dimension: ``[..., ceil(n/4)]`` bytes to ``[..., n]`` codes."""
    if packed.shape[-1] != -(-n // 4):
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold {n} 2-bit codes (expected {-(-n // 4)})")
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device)  # made on the device: no copy, no sync
    codes = (packed.unsqueeze(-1) >> shifts) & 3
    return codes.flatten(-2)[..., :n]
