"""A running job's own numbers for the performance model: its links measured with Horovod's collectives among its
ranks, and documents agreed across the ranks (every number the slowest rank's), so that every rank predicts from the
same inputs and ranks plans alike. ``compression: auto`` (:mod:`hvdcomp.auto`) measures the job with these."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hvdcomp.perfmodel import probe
from hvdcomp.perfmodel.profile import ProcessSetRanks
from hvdcomp.perfmodel.schema import HOROVOD_FUSION_THRESHOLD_BYTES, Cluster, parse_cluster

#: what the links are timed at (bytes): from the first, up to a step's dense bytes within the other two
LINK_BYTES = (1 << 14, 1 << 20, 1 << 24)


def link_sizes(largest: int) -> list[int]:
    """16 KiB, then powers of 4 from 64 KiB up to ``largest`` bytes, but up to 1 MiB at least and 16 MiB at most."""
    smallest, least, most = LINK_BYTES
    top = min(max(largest, least), most)
    return [smallest, *(1 << bits for bits in range(16, top.bit_length(), 2))]


def fusion_bytes() -> int:
    """Horovod's tensor-fusion threshold in this job (HOROVOD_FUSION_THRESHOLD, else Horovod's default)."""
    return int(os.environ.get("HOROVOD_FUSION_THRESHOLD", HOROVOD_FUSION_THRESHOLD_BYTES))


def cluster(process_set: Any, device: torch.device, largest: int, fusion: int, wait: Callable[[int, str], Any],
            prefix: str) -> tuple[Cluster, dict[str, dict[str, float]]]:
    """The links as the job's collectives see them: Horovod's negotiation round
    (:func:`hvdcomp.perfmodel.probe.horovod_round`), then its allreduce, allgather and alltoall among the process
    set's ranks on ``device``, at sizes up to ``largest`` bytes (:func:`link_sizes`), fitted (the slowest rank's
    times), with Horovod's tensor fusion up to ``fusion`` bytes; and, for the report, the round's latency and each
    collective's latency and bus bandwidth. Each collective is named under ``prefix`` and waited for with ``wait`` (a
    running job's deadline)."""
    group = ProcessSetRanks(process_set, f"{prefix}.probe", wait)
    round_s = probe.horovod_round(group, device, process_set, budget_s=0.2, prefix=f"{prefix}.probe")
    links = probe.horovod_collectives(group, link_sizes(largest), device, process_set, budget_s=0.2,
                                      prefix=f"{prefix}.probe", round_s=round_s)
    tier = {"latency_us": links["allreduce"]["latency_us"], "bandwidth_gbps": links["allreduce"]["busbw_gbps"],
            **links}
    round_us = round(round_s * 1e6, 3)
    # one rank per node: every collective is priced with what it measured among exactly these ranks
    cluster = parse_cluster({"kind": "cluster", "name": f"this job ({process_set.size()} ranks)",
                                    "nominal": False, "ranks_per_node": 1, "inter_node": tier,
                                    "horovod": {"fusion_threshold_bytes": fusion, "round_us": round_us}}, "auto")
    return cluster, {"round": {"latency_us": round_us},
                     **{name: {"latency_us": link["latency_us"], "busbw_gbps": link["busbw_gbps"]}
                        for name, link in links.items()}}


def agreed(document: Any, process_set: Any, op: str, wait: Callable[[int, str], Any], prefix: str) -> Any:
    """``document`` with every number replaced by its maximum (or minimum) over the ranks, in one allreduce
    named under ``prefix``, waited for with ``wait`` (a running job's deadline); integers stay integers. The rest of it
    (keys, strings, booleans, lengths) must be the same on every rank: a fingerprint of it travels along, and a
    difference raises."""
    import horovod.torch as hvd

    numbers: list[float] = []
    shape: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, Mapping):
            shape.append(f"{{{len(value)}")
            for key, item in value.items():
                shape.append(str(key))
                collect(item)
        elif isinstance(value, list):
            shape.append(f"[{len(value)}")
            for item in value:
                collect(item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers.append(float(value))
            shape.append("#")
        else:
            shape.append(repr(value))

    collect(document)
    digest = float(int.from_bytes(hashlib.blake2b("\x00".join(shape).encode(), digest_size=6).digest(), "little"))
    # the fingerprint's extremes both ways (it and its negation): they match only if it is the same everywhere
    values = torch.tensor([*numbers, digest, -digest], dtype=torch.float64)
    name = f"{prefix}.agree.{op}"
    *agreed, high, low = wait(hvd.allreduce_async(values, name=name, op=hvd.Max if op == "max" else hvd.Min,
                                                  process_set=process_set), name).tolist()
    if high != -low:
        raise ValueError("hvdcomp auto: the ranks measured different things (their documents differ in keys, "
                         "candidates or plans); every rank must use the same model, config and registered methods")
    found = iter(agreed)

    def rebuild(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: rebuild(item) for key, item in value.items()}
        if isinstance(value, list):
            return [rebuild(item) for item in value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = next(found)
            return int(number) if isinstance(value, int) else number
        return value

    return rebuild(document)
