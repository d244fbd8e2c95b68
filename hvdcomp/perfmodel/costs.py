"""Alpha-beta costs of the collectives hvdcomp uses (p ranks, alpha seconds per step, beta seconds per byte).

Hockney's model, with the per-algorithm step and volume counts of Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005) and Patarasuk and Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations" (JPDC 2009):

* ring allreduce of n bytes: 2(p-1) alpha + 2(p-1)/p n beta;
* ring allgather of m bytes per rank: (p-1) alpha + (p-1) m beta;
* pairwise alltoall of n bytes per rank: (p-1) alpha + (p-1)/p n beta;
* two-phase compressed allreduce (DeepSpeed 1-bit Adam, Tang et al. 2021;
  :class:`hvdcomp.reductions.TwoPhaseReduction`): alltoall of the m-byte payload's chunks, then allgather of one
  m/p chunk per rank;
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


def fit_line(xs: list[float], ys: list[float], tail: int = 3) -> tuple[float, float]:
    """(alpha, beta) of y = alpha + beta x from measured points: beta is the least-squares slope over the
    ``tail`` largest x, alpha the smallest x's time less its beta part (both clamped at 0). Fitting one line
    through all points would let small transfers set the slope, and they run faster than the sustained rate
    (a token bucket's burst, socket buffers, caches), so large messages would be predicted too fast."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need at least 2 points to fit a line; got {len(xs)}")
    points = sorted(zip(xs, ys, strict=True))
    large = points[-max(2, min(tail, len(points))):]
    mean_x = sum(x for x, _ in large) / len(large)
    mean_y = sum(y for _, y in large) / len(large)
    spread = sum((x - mean_x) ** 2 for x, _ in large)
    if spread <= 0:
        raise ValueError("cannot fit a line: all sizes are equal")
    slope = max(sum((x - mean_x) * (y - mean_y) for x, y in large) / spread, 0.0)
    return max(points[0][1] - points[0][0] * slope, 0.0), slope
