"""Serialization of a payload (a list of 1-D tensors of any dtype) into one byte buffer.

Gathered payloads travel as one uint8 tensor per parameter: one Horovod collective, any mix of dtypes, and
uint8 is accepted by allgather and alltoall on every controller (allreduce is not: see platform notes).
Each part is padded to a multiple of 8 bytes so that every part of every rank's segment can be viewed in its
own dtype without a copy.

The module is the bottom layer: it defines :data:`Payload`, which the compressors, the requests and the collectives
share, and imports nothing of hvdcomp.
"""

from __future__ import annotations

import torch

#: what a compressor sends for one tensor and a collective carries: a list of tensors of any dtypes (the bottom of
#: the layers: the compressors, the requests and the collectives all speak it)
Payload = list[torch.Tensor]

ALIGN = 8

Layout = tuple[tuple[torch.dtype, int], ...]


def layout_of(payload: Payload) -> Layout:
    """The (dtype, numel) of each part: what a receiver needs to split a buffer."""
    return tuple((part.dtype, part.numel()) for part in payload)


def part_nbytes(dtype: torch.dtype, numel: int) -> int:
    """Bytes one part takes on the wire, padding included."""
    raw = numel * dtype.itemsize
    return -(-raw // ALIGN) * ALIGN


def nbytes(layout: Layout) -> int:
    return sum(part_nbytes(dtype, numel) for dtype, numel in layout)


def pack(payload: Payload) -> torch.Tensor:
    """One contiguous uint8 buffer holding every part, each padded to ``ALIGN`` bytes."""
    if not payload:
        raise ValueError("cannot pack an empty payload")
    device = payload[0].device
    out = torch.zeros(nbytes(layout_of(payload)), dtype=torch.uint8, device=device)
    offset = 0
    for part in payload:
        if part.device != device:
            raise ValueError(f"payload parts on different devices: {device} and {part.device}")
        raw = part.reshape(-1).contiguous().view(torch.uint8)
        out[offset:offset + raw.numel()] = raw
        offset += part_nbytes(part.dtype, part.numel())
    return out


def unpack(buffer: torch.Tensor, layout: Layout) -> Payload:
    """Views of the parts inside ``buffer`` (no copy); ``buffer`` is one rank's segment."""
    parts = []
    offset = 0
    for dtype, numel in layout:
        size = numel * dtype.itemsize
        parts.append(buffer[offset:offset + size].view(dtype))
        offset += part_nbytes(dtype, numel)
    if offset != buffer.numel():
        raise ValueError(f"payload buffer of {buffer.numel()} bytes does not match its layout ({offset} bytes)")
    return parts
