"""``hvdcomp probe``: measure a cluster's GPUs and links, written as the cluster YAML ``hvdcomp predict`` reads.

    launch/mpirun.sh -np 2 -H host1,host2 hvdcomp probe --out cluster.yaml

* GPUs through NVML (nvidia-ml-py, ``import pynvml``): identity, memory, clocks, power, utilization, PCIe,
  NVLink, topology and P2P status. Every field is read on its own: a call the GPU or driver does not support
  leaves that field out and records the reason under ``unavailable``. Without a driver the GPU section is
  empty and says why; the rest still runs.
* NICs from sysfs: ``/sys/class/net/*/speed`` (Mbit/s) and ``/sys/class/infiniband/*/ports/*/rate``
  (NVML does not see NICs).
* Links, when run under mpirun with 2 or more ranks: an mpi4py ping-pong between rank 0 and every other rank
  over message sizes from 8 B to 4 MiB, fitted to t = alpha + n beta (one-way); and Horovod's own allreduce,
  allgather and alltoall from 16 KiB to 64 MiB, fitted the same way and stated as per-step latency and bus
  bandwidth (nccl-tests' busbw, see :mod:`hvdcomp.perfmodel.costs`). Bandwidth comes from the largest sizes
  (:func:`hvdcomp.perfmodel.costs.fit_line`): gradients are megabytes, and a shaped or congested link is
  faster for small bursts than sustained. Before them, Horovod's negotiation round (``horovod.round_us``:
  :func:`horovod_round`), which the collectives negotiated together share; the collectives' latencies exclude it.
  Ranks on the same host (same hostname and network namespace) measure the ``intra_node`` tier, ranks on different
  hosts ``inter_node``.
  ``--device cuda`` times Horovod's collectives on CUDA tensors, each rank on its local GPU: NCCL where Horovod was
  built with it, the path training's gradients take on GPUs (``collectives_device`` in the document says which
  ran). NCCL takes one rank per GPU: on one GPU there is nothing to time.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from itertools import combinations
from pathlib import Path
from typing import Any

from hvdcomp import extras
from hvdcomp.perfmodel import costs
from hvdcomp.perfmodel.schema import dump

PINGPONG_BYTES = [8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20]
COLLECTIVE_BYTES = [16384, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
#: horovod_round's allreduces: this many bytes each, in these dtypes (Horovod fuses only tensors of one dtype; NCCL,
#: MPI and Gloo all reduce these four)
ROUND_BYTES = 16384
ROUND_DTYPES = ("float32", "float64", "int32", "int64")
TOPOLOGY_LEVELS = {0: "internal", 10: "single", 20: "multiple", 30: "hostbridge", 40: "node", 50: "system"}
#: /sys/class/net/*/type (linux/if_arp.h)
ARPHRD = {"1": "ethernet", "32": "infiniband (IPoIB)", "772": "loopback"}
P2P_STATUS = {0: "ok", 1: "chipset_not_supported", 2: "gpu_not_supported", 3: "ioh_topology_not_supported",
              4: "disabled_by_regkey", 5: "not_supported", 6: "unknown"}


# -------------------------------------------------------------------------------------------------- GPUs


def _reader(nvml: Any, record: dict[str, Any]) -> Callable[[str, Callable[[], Any]], Any]:
    """``read(field, call)``: stores call() under field, or the NVML error under record['unavailable']."""

    def read(key: str, call: Callable[[], Any]) -> Any:
        try:
            value = call()
        except nvml.NVMLError as error:
            record.setdefault("unavailable", {})[key] = f"{type(error).__name__}: {error}"
            return None
        record[key] = value
        return value

    return read


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _gpu(nvml: Any, handle: Any) -> dict[str, Any]:
    record: dict[str, Any] = {}
    read = _reader(nvml, record)
    read("name", lambda: _text(nvml.nvmlDeviceGetName(handle)))
    read("pci_bus_id", lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId))
    read("compute_capability", lambda: "{}.{}".format(*nvml.nvmlDeviceGetCudaComputeCapability(handle)))
    read("memory_total_bytes", lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total))
    read("memory_bus_width_bits", lambda: int(nvml.nvmlDeviceGetMemoryBusWidth(handle)))
    for clock, label in ((nvml.NVML_CLOCK_SM, "sm"), (nvml.NVML_CLOCK_MEM, "memory")):
        read(f"{label}_clock_mhz", lambda c=clock: int(nvml.nvmlDeviceGetClockInfo(handle, c)))
        read(f"{label}_clock_max_mhz", lambda c=clock: int(nvml.nvmlDeviceGetMaxClockInfo(handle, c)))
    read("power_draw_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000)
    read("power_limit_w", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000)
    read("utilization_percent", lambda: {"gpu": int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                                         "memory": int(nvml.nvmlDeviceGetUtilizationRates(handle).memory)})
    read("pcie_generation", lambda: int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)))
    read("pcie_generation_max", lambda: int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)))
    read("pcie_width", lambda: int(nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)))
    read("pcie_width_max", lambda: int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)))
    read("pcie_speed_mbps_per_lane", lambda: int(nvml.nvmlDeviceGetPcieSpeed(handle)))
    read("pcie_tx_kb_s", lambda: int(nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES)))
    read("pcie_rx_kb_s", lambda: int(nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES)))
    links = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        entry: dict[str, Any] = {"link": link}
        state = _reader(nvml, entry)("active", lambda i=link: nvml.nvmlDeviceGetNvLinkState(handle, i) == 1)
        if state is None:  # no such link, or NVLink not supported: say so once, for link 0
            if link == 0:
                record.setdefault("unavailable", {})["nvlink"] = entry["unavailable"]["active"]
            break
        if state:
            link_read = _reader(nvml, entry)
            link_read("version", lambda i=link: _nvlink_version(nvml.nvmlDeviceGetNvLinkVersion(handle, i)))
            link_read("remote_pci_bus_id",
                      lambda i=link: _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, i).busId))
            link_read("speed_mbps", lambda i=link: _nvlink_speed(nvml, handle, i))
        links.append(entry)
    if links:
        record["nvlink"] = links
    return record


def _nvlink_version(value: Any) -> int:
    """Older drivers return the version number, newer ones an enum whose value is the version (map both)."""
    return int(getattr(value, "value", value))


def _nvlink_speed(nvml: Any, handle: Any, link: int) -> int:
    field = getattr(nvml, f"NVML_FI_DEV_NVLINK_SPEED_MBPS_L{link}", None)
    if field is None:
        raise nvml.NVMLError_NotSupported()  # this nvidia-ml-py has no field id for the link
    (value,) = nvml.nvmlDeviceGetFieldValues(handle, [field])
    if value.nvmlReturn != 0:
        raise nvml.NVMLError(value.nvmlReturn)
    return int(value.value.uiVal)


def gpus(nvml: Any = None) -> tuple[list[dict[str, Any]], str]:
    """(one record per GPU in NVML's order, a status line); an empty list and the reason without a driver."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as error:
            return [], f"no GPU section: nvidia-ml-py is not installed ({error}; pip install 'hvdcomp[perf]')"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        return [], f"no GPU section: NVML could not start ({type(error).__name__}: {error}); no NVIDIA driver here?"
    try:
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        records = [{"index": i, **_gpu(nvml, handle)} for i, handle in enumerate(handles)]
        for (i, a), (j, b) in combinations(enumerate(handles), 2):
            pair: dict[str, Any] = {"gpus": [i, j]}
            read = _reader(nvml, pair)
            read("common_ancestor", lambda a=a, b=b: TOPOLOGY_LEVELS.get(
                int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)), "unknown"))
            read("p2p_read", lambda a=a, b=b: P2P_STATUS.get(
                int(nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_READ)), "unknown"))
            records[i].setdefault("topology", []).append(pair)
        driver = _text(nvml.nvmlSystemGetDriverVersion()) if hasattr(nvml, "nvmlSystemGetDriverVersion") else "?"
        return records, f"{count} GPU(s) seen by NVML, driver {driver}"
    except nvml.NVMLError as error:
        return [], f"no GPU section: NVML failed listing GPUs ({type(error).__name__}: {error})"
    finally:
        nvml.nvmlShutdown()


# -------------------------------------------------------------------------------------------------- NICs


def nics(sysfs: Path = Path("/sys/class")) -> list[dict[str, Any]]:
    """Ethernet and InfiniBand ports from sysfs: name, speed (or why it is unknown), state."""
    found: list[dict[str, Any]] = []
    for device in sorted((sysfs / "net").glob("*")):
        kind = (device / "type").read_text().strip() if (device / "type").exists() else "?"
        entry: dict[str, Any] = {"name": device.name, "kind": ARPHRD.get(kind, f"arphrd {kind}")}
        operstate = device / "operstate"
        entry["state"] = operstate.read_text().strip() if operstate.exists() else "unknown"
        try:
            speed = int((device / "speed").read_text().strip())
            entry["speed_gbps"] = speed / 1000 if speed > 0 else None
            if speed <= 0:
                entry["unavailable"] = {"speed_gbps": f"sysfs speed is {speed} (link down or virtual)"}
        except (OSError, ValueError) as error:
            entry["unavailable"] = {"speed_gbps": f"sysfs speed unreadable: {getattr(error, 'strerror', error)} "
                                                  "(loopback, or a virtual interface)"}
        found.append(entry)
    for port in sorted((sysfs / "infiniband").glob("*/ports/*")):
        entry = {"name": f"{port.parent.parent.name}/{port.name}", "kind": "infiniband"}
        try:
            rate = (port / "rate").read_text().strip()  # e.g. "400 Gb/sec (4X NDR)"
            entry["rate"] = rate
            entry["speed_gbps"] = float(rate.split()[0])
        except (OSError, ValueError, IndexError) as error:
            entry["unavailable"] = {"speed_gbps": f"sysfs rate unreadable: {error}"}
        found.append(entry)
    return found


def host_id() -> str:
    """The host a rank runs on: hostname plus network namespace (emulated hosts share a hostname)."""
    return f"{socket.gethostname()}/netns:{os.stat('/proc/self/ns/net').st_ino}"


# ------------------------------------------------------------------------------------------------- links


def _repeat(fn: Callable[[], Any], budget_s: float = 0.5, agree: Callable[[float], float] | None = None,
            at_least: int = 3, at_most: int = 30) -> float:
    """Median seconds of ``fn`` over a number of runs fixed by one timed warm-up: about ``budget_s`` in all,
    at least ``at_least`` (2 if the warm-up alone took longer than the budget), at most ``at_most``. For a
    collective, ``agree`` makes every rank use the same warm-up time (e.g. the max over ranks), so that all
    ranks make the same number of calls."""
    start = time.perf_counter()
    fn()
    warm_up = time.perf_counter() - start
    if agree is not None:
        warm_up = agree(warm_up)
    runs = 2 if warm_up > budget_s else min(at_most, max(at_least, math.ceil(budget_s / max(warm_up, 1e-6))))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pingpong(comm: Any, peer: int, sizes: list[int]) -> list[tuple[int, float]]:
    """(bytes, one-way seconds) between rank 0 and ``peer``; other ranks return []."""
    import numpy as np
    from mpi4py import MPI

    rank = comm.Get_rank()
    points = []
    for size in sizes:
        buffer = np.zeros(size, dtype=np.uint8)
        if rank == 0:
            def exchange(buffer: Any = buffer) -> None:
                comm.Send(buffer, dest=peer, tag=7)
                comm.Recv(buffer, source=peer, tag=7)

            points.append((size, _repeat(exchange) / 2))
            comm.Send(buffer[:0], dest=peer, tag=7)  # an empty message ends this size
        elif rank == peer:
            status = MPI.Status()
            while True:
                comm.Probe(source=0, tag=7, status=status)
                if status.Get_count(MPI.BYTE) == 0:
                    comm.Recv(buffer[:0], source=0, tag=7)
                    break
                comm.Recv(buffer, source=0, tag=7)
                comm.Send(buffer, dest=0, tag=7)
    return points


def fit_tier(points: list[tuple[int, float]]) -> dict[str, float]:
    alpha, beta = costs.fit_line([float(n) for n, _ in points], [t for _, t in points])
    return {"latency_us": round(alpha * 1e6, 3), "bandwidth_gbps": round(8 / beta / 1e9, 4) if beta > 0 else 1e6}


def _finished(device: Any) -> Callable[[Any], Any]:
    """``done(result)``: returns ``result`` once ``device``'s work has finished (Horovod's completion may be
    asynchronous on GPUs)."""
    import torch

    def done(result: Any) -> Any:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result

    return done


def horovod_round(ranks: Any, device: Any = None, process_set: Any = None, budget_s: float = 0.5,
                  prefix: str = "probe") -> float:
    """Seconds of a negotiation round of Horovod's background thread (its wait for the next cycle, the ranks'
    coordination), which every collective negotiated in the round shares: one ``ROUND_BYTES`` allreduce takes a round
    and c, ``len(ROUND_DTYPES)`` of them in distinct dtypes submitted at once (they cannot fuse) a round and that many
    c, so the round is the first time less c (at least 0). Arguments as
    :func:`horovod_collectives`'; every rank returns the same (the slowest rank's times)."""
    import horovod.torch as hvd
    import torch

    device = device or torch.device("cpu")
    done = _finished(device)
    process_set = process_set or hvd.global_process_set
    tensors = [done(torch.ones(ROUND_BYTES // getattr(torch, dtype).itemsize, dtype=getattr(torch, dtype),
                               device=device)) for dtype in ROUND_DTYPES]

    def together(count: int) -> None:
        names = [f"{prefix}.round.{count}.{i}" for i in range(count)]
        handles = [hvd.allreduce_async(tensor, name=name, op=hvd.Sum, process_set=process_set)
                   for name, tensor in zip(names, tensors[:count], strict=True)]
        done([ranks.wait(handle, name) for handle, name in zip(handles, names, strict=True)])

    times = {}
    for count in (1, len(tensors)):
        ranks.barrier()
        times[count] = ranks.slowest(_repeat(lambda count=count: together(count), budget_s=budget_s,
                                             agree=ranks.slowest))
    alone = times[1]
    each = max(times[len(tensors)] - alone, 0.0) / (len(tensors) - 1)
    return max(alone - each, 0.0)


def horovod_collectives(ranks: Any, sizes: list[int], device: Any = None, process_set: Any = None,
                        budget_s: float = 1.0, prefix: str = "probe",
                        round_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Horovod's allreduce, allgather and alltoall on ``device``'s tensors (CPU: MPI or Gloo; CUDA: NCCL) among
    ``process_set``'s ranks (default: all), fitted per collective; ``ranks`` (:class:`hvdcomp.perfmodel.profile.Ranks`:
    the same ranks) synchronizes the timing and waits for each collective (its ``wait``), and every rank returns the
    same (the slowest rank's times). About ``budget_s`` per size and collective; the collectives are named under
    ``prefix``. ``round_s``, a negotiation round's seconds (:func:`horovod_round`), is taken off each fitted latency:
    what remains is the collective's own."""
    import horovod.torch as hvd
    import torch

    process_set = process_set or hvd.global_process_set
    p = process_set.size()
    on = {"device": device or torch.device("cpu")}
    # (the input for n bytes, the collective on it); the input is made once per size, outside the timed calls
    # (at 64 MiB its allocation and fill took 40 to 50 ms, a third of the allreduce, on the emulated cluster)
    done = _finished(on["device"])

    def waited(start: Callable[..., int], x: Any, name: str, **options: Any) -> Any:
        return done(ranks.wait(start(x, name=name, process_set=process_set, **options), name))

    calls = {
        "allreduce": (lambda n: done(torch.ones(n // 4, **on)),
                      lambda x, n: waited(hvd.allreduce_async, x, f"{prefix}.ar.{n}", op=hvd.Sum)),
        "allgather": (lambda n: done(torch.ones(n // p, dtype=torch.uint8, **on)),
                      lambda x, n: waited(hvd.allgather_async, x, f"{prefix}.ag.{n}")),
        "alltoall": (lambda n: done(torch.ones(n // p * p, dtype=torch.uint8, **on)),
                     lambda x, n: waited(hvd.alltoall_async, x, f"{prefix}.a2a.{n}")),
    }
    result = {}
    for collective, (make, call) in calls.items():
        points = []
        for size in sizes:
            tensor = make(size)
            ranks.barrier()
            seconds = ranks.slowest(_repeat(lambda call=call, tensor=tensor, size=size: call(tensor, size),
                                            budget_s=budget_s, agree=ranks.slowest))
            points.append((size, seconds))
        # the formulas' variables: allgather takes bytes per rank, the others bytes per rank's buffer
        xs = [n / p if collective == "allgather" else n for n, _ in points]
        a, b = costs.fit_line(xs, [t for _, t in points])
        volume = {"allreduce": 2 * (p - 1) / p, "allgather": p - 1, "alltoall": (p - 1) / p}[collective]
        result[collective] = {
            "latency_us": round(max(a - round_s, 0.0) / costs.steps(collective, p) * 1e6, 3),
            "busbw_gbps": round(8 * volume / b / 1e9, 4) if b > 0 else 1e6,
            "ranks": p,
            "points": [{"bytes": int(n), "time_ms": round(t * 1e3, 4)} for n, t in points],
        }
    return result


def probe(comm: Any = None, device: str = "cpu") -> dict[str, Any]:
    """The cluster document (rank 0's copy is complete; see the module docstring); Horovod's collectives are timed
    on ``device``'s tensors (cpu, or cuda: each rank's local GPU)."""
    gpu_records, gpu_status = gpus()
    mine = {"host": host_id(), "gpus": gpu_records, "gpu_status": gpu_status, "nics": nics()}
    everyone = comm.allgather(mine) if comm is not None else [mine]
    hosts: dict[str, list[int]] = {}
    for rank, seen in enumerate(everyone):
        hosts.setdefault(seen["host"], []).append(rank)
    document: dict[str, Any] = {
        "kind": "cluster",
        "name": f"probed: {len(hosts)} host(s), {len(everyone)} rank(s)",
        "nominal": False,
        "source": f"hvdcomp probe, {datetime.date.today().isoformat()}",
        "ranks_per_node": max(len(ranks) for ranks in hosts.values()),
    }
    if comm is not None and comm.Get_size() > 1:
        home = everyone[0]["host"]
        tiers: dict[str, list[dict[str, Any]]] = {"intra_node": [], "inter_node": []}
        for peer in range(1, comm.Get_size()):
            points = pingpong(comm, peer, PINGPONG_BYTES)
            if comm.Get_rank() == 0:
                tier = "intra_node" if everyone[peer]["host"] == home else "inter_node"
                tiers[tier].append({"ranks": [0, peer], **fit_tier(points),
                                    "points": [{"bytes": n, "time_us": round(t * 1e6, 3)} for n, t in points]})
        tiers = comm.bcast(tiers, root=0)
        import horovod.torch as hvd
        import torch

        from hvdcomp.perfmodel.profile import Ranks, local_device

        hvd.init()
        on = local_device(device)
        ranks = Ranks(comm)
        round_s = horovod_round(ranks, on)
        measured = horovod_collectives(ranks, COLLECTIVE_BYTES, on, round_s=round_s)
        document["horovod"] = {"round_us": round(round_s * 1e6, 3)}
        # CUDA tensors go through NCCL only where Horovod was built with it; otherwise through host memory
        document["collectives_device"] = "cpu" if on.type == "cpu" else (
            f"cuda ({torch.cuda.get_device_name(on)}), "
            f"{'NCCL' if hvd.nccl_built() else 'staged through host memory: Horovod was built without NCCL'}")
        # the collectives cross the slowest tier the ranks span
        spans = "inter_node" if len(hosts) > 1 else "intra_node"
        for tier, pairs in tiers.items():
            if pairs:
                document[tier] = {
                    "latency_us": round(statistics.median(p["latency_us"] for p in pairs), 3),
                    "bandwidth_gbps": round(statistics.median(p["bandwidth_gbps"] for p in pairs), 4),
                    **(measured if tier == spans else {}),
                    "pairs": pairs,
                }
    else:
        document["network_status"] = "links not measured: run under mpirun with 2 or more ranks"
    document["hosts"] = [{"host": host, "ranks": ranks} for host, ranks in hosts.items()]
    document["gpus"] = [{"host": seen["host"], "rank": rank, "status": seen["gpu_status"], "devices": seen["gpus"]}
                        for rank, seen in enumerate(everyone) if hosts[seen["host"]][0] == rank]
    document["nics"] = [{"host": seen["host"], "ports": seen["nics"]}
                        for rank, seen in enumerate(everyone) if hosts[seen["host"]][0] == rank]
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdcomp probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="cluster.yaml")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="the tensors Horovod's collectives are timed on (cuda: NCCL, each rank's local GPU)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        from hvdcomp.perfmodel.profile import local_device

        try:
            local_device("cuda")
        except ValueError as error:
            parser.error(str(error))
    comm = None
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1:
        with extras.required("perf", "hvdcomp probe across ranks"):
            from mpi4py import MPI

        comm = MPI.COMM_WORLD
    try:
        document = probe(comm, args.device)
    except Exception:
        if comm is None:
            raise
        traceback.print_exc()
        comm.Abort(1)  # the other ranks would wait forever in the exchange
    if comm is None or comm.Get_rank() == 0:
        dump(document, args.out, "hvdcomp probe: measured, not nominal. bandwidth_gbps in Gbit/s; latency_us is "
                                 "one-way (ping-pong) or per collective step (nccl-tests busbw convention)")
        tiers = [f"{tier}: {document[tier]['latency_us']:.1f} us, {document[tier]['bandwidth_gbps']:.3g} Gbit/s"
                 for tier in ("intra_node", "inter_node") if tier in document]
        statuses = sorted({g["status"] for g in document["gpus"]})
        print(f"hvdcomp probe: wrote {args.out}; {'; '.join(tiers) or document.get('network_status')}; GPUs: "
              f"{'; '.join(statuses)}")
    return 0
