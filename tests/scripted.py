"""Scripted clusters and profiles for the performance model's and auto's tests: one link of a given speed, and a
toy model of two gradients (one of 250,000 elements ready at ``ready_ms``, one of a single element at the end of
backward)."""

from __future__ import annotations

from hvdcomp.perfmodel import schema


def cluster_of(gbps: float, latency_us: float = 0.0) -> schema.Cluster:
    return schema.Cluster("test", True, 1, None, schema.Tier(latency_us, gbps))


def profile_of(ready_ms: float, compressors: dict[str, schema.CompressorProfile] | None = None) -> schema.Profile:
    gradients = (schema.Gradient("a", 250_000, 1_000_000, ready_ms), schema.Gradient("b", 1, 4, 100.0))
    return schema.Profile("toy", 8, "cpu", forward_ms=10, backward_ms=100, optimizer_ms=5,
                          gradients=tuple(sorted(gradients, key=lambda g: g.ready_ms)),
                          compressors=compressors or {})
