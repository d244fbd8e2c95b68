"""Alpha-beta costs of the collectives hvdcomp uses (p ranks, alpha seconds per step, beta seconds per byte).

Hockney's model, with the per-algorithm step and volume counts of Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005) and Patarasuk and Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations" (JPDC 2009):

* ring allreduce of n bytes: 2(p-1) alpha + 2(p-1)/p n beta;
* ring allgather of m bytes per rank: (p-1) alpha + (p-1) m beta;
* pairwise alltoall of n bytes per rank: (p-1) alpha + (p-1)/p n beta;
* two-phase compressed allreduce (DeepSpeed 1-bit Adam, Tang et al. 2021; :class:`hvdcomp.communicator.TwoPhase`):
  alltoall of the m-byte payload's chunks, then allgather of one m/p chunk per rank;
* parameter server (TernGrad's setting, Wen et al. 2017): p workers push m bytes to one server and pull m bytes
  back, through the server's link: 2 alpha + 2 p m beta;
* hierarchical allreduce (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, NCCL's tree/ring over nodes): reduce-scatter
  inside each node of g ranks, allreduce of each 1/g shard across the k nodes (the g shards share the node's
  NIC), allgather inside the node.

The nccl-tests convention relates a measured time to a link's bandwidth: busbw = algbw x 2(p-1)/p for
allreduce, x (p-1)/p for allgather and alltoall (algbw = p m / t for allgather); :func:`bus_factor` gives the
factor, so a measured collective can be stated as the (alpha, beta) these formulas take.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One tier of the network as the formulas see it: alpha in seconds, beta in seconds per byte."""

    alpha: float
    beta: float


def ring_allreduce(nbytes: float, p: int, link: Link) -> float:
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def ring_allgather(nbytes_per_rank: float, p: int, link: Link) -> float:
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) * nbytes_per_rank * link.beta


def alltoall(nbytes_per_rank: float, p: int, link: Link) -> float:
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * nbytes_per_rank * link.beta


def two_phase(nbytes_per_rank: float, p: int, alltoall_link: Link, allgather_link: Link) -> float:
    """Communication of the two-phase scheme only (the owner's decode/re-encode is computation)."""
    if p <= 1:
        return 0.0
    return alltoall(nbytes_per_rank, p, alltoall_link) + ring_allgather(nbytes_per_rank / p, p, allgather_link)


def parameter_server(nbytes_per_rank: float, p: int, server_link: Link) -> float:
    """Push then pull through one server's link (the server re-encodes the sum to the same size)."""
    if p <= 1:
        return 0.0
    return 2 * server_link.alpha + 2 * p * nbytes_per_rank * server_link.beta


def hierarchical_allreduce(nbytes: float, local: int, nodes: int, intra: Link, inter_node: Link) -> float:
    """``inter_node.beta`` is per byte through one node's NICs (all of them together)."""
    inside = 2 * ((local - 1) * intra.alpha + (local - 1) / local * nbytes * intra.beta) if local > 1 else 0.0
    if nodes <= 1:
        return inside
    across = 2 * (nodes - 1) * inter_node.alpha + 2 * (nodes - 1) / nodes * nbytes * inter_node.beta
    return inside + across


def bus_factor(collective: str, p: int) -> float:
    """busbw / algbw for ``collective`` on ``p`` ranks (nccl-tests, doc/PERFORMANCE.md)."""
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("allgather", "alltoall"):
        return (p - 1) / p
    raise ValueError(f"unknown collective {collective!r}; valid: allreduce, allgather, alltoall")


def steps(collective: str, p: int) -> int:
    """Latency terms (alpha) of ``collective`` on ``p`` ranks in the formulas above."""
    if collective == "allreduce":
        return 2 * (p - 1)
    if collective in ("allgather", "alltoall"):
        return p - 1
    raise ValueError(f"unknown collective {collective!r}; valid: allreduce, allgather, alltoall")


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of y = a + b x, least squares in relative error (weights 1/y^2), so that small
    sizes pin the latency and large ones the bandwidth. Negative parts are clamped to 0."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need at least 2 points to fit a line; got {len(xs)}")
    weights = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    sw = sum(weights)
    sx = sum(w * x for w, x in zip(weights, xs, strict=True))
    sy = sum(w * y for w, y in zip(weights, ys, strict=True))
    sxx = sum(w * x * x for w, x in zip(weights, xs, strict=True))
    sxy = sum(w * x * y for w, x, y in zip(weights, xs, ys, strict=True))
    denominator = sw * sxx - sx * sx
    if denominator <= 0:
        raise ValueError("cannot fit a line: all sizes are equal")
    slope = (sw * sxy - sx * sy) / denominator
    intercept = (sy - slope * sx) / sw
    if slope <= 0:  # no bandwidth term visible: everything is latency
        return max(sy / sw, 0.0), 0.0
    return max(intercept, 0.0), slope
