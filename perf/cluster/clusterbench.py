"""Shared by the benchmarks on the emulated cluster (perf/cluster_*.py): the settings swept, launching one
worker rank per host, the link's byte counters, and the results files.

Each benchmark script is both the driver (run as root on the machine: it brings up each cluster with
:func:`hvdcomp.tools.cluster.up`, measures the TCP goodput one stream reaches on it, and starts the ranks with
:meth:`hvdcomp.tools.cluster.Cluster.launch_command`) and, with ``--worker``, the rank program. Rank 0 prints one
``RESULT {json}`` line per measurement; the driver adds the setting and the machine and appends the rows
to ``perf/results/<benchmark>.jsonl``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hvdcomp.tools import cluster

RESULTS = Path(__file__).resolve().parents[1] / "results"
HOSTS = (2, 4)
RATES = ("100mbit", "1gbit", "10gbit")
NAME = "hvdbench"
PREFIX = "RESULT "


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"host": platform.node(), "cpu": model, "cores": os.cpu_count(), "kernel": platform.release()}


def link_bytes(interface: str = cluster.INTERFACE) -> tuple[int, int]:
    """(received, sent) bytes so far on this rank's host link: the eth0 counters of its namespace."""
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no {interface} in this network namespace: run the worker on the emulated cluster")


def time_calls(run: Callable[[str], Any], tag: str, repeats: int) -> tuple[list[float], list[float]]:
    """Runs the collective ``run(name)`` ``repeats`` times, each after a barrier, in a Horovod worker: per call
    the slowest rank's seconds and the bytes of the busiest link direction of the busiest host."""
    import horovod.torch as hvd
    import torch

    def slowest(value: float, name: str) -> float:
        return hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max, name=name).item()

    times, wire = [], []
    for r in range(repeats):
        hvd.allreduce(torch.zeros(1), name=f"{tag}.barrier.{r}")
        received, sent = link_bytes()
        start = time.perf_counter()
        run(f"{tag}.{r}")
        elapsed = time.perf_counter() - start
        after = link_bytes()
        times.append(slowest(elapsed, f"{tag}.time.{r}"))
        wire.append(slowest(max(after[0] - received, after[1] - sent), f"{tag}.wire.{r}"))
    return times, wire


def serialized(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A DDP communication hook that completes each bucket before the next one starts. PowerSGD's hook chains
    its second allreduce in a callback; with several buckets in flight, ranks then issue Gloo collectives in
    different orders (seen here: gloo "op.preamble.length <= op.nbytes ... collective mismatch", an abort)."""

    import torch
    import torch.distributed as dist

    def run(state: Any, bucket: Any) -> Any:
        future = hook(state, bucket)
        future.wait()
        return future

    # DDP checks the annotations as objects (this module's are strings, from the __future__ import).
    run.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return run


def emit(row: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(row), flush=True)


def run_settings(script: str, worker_args: Iterable[str], hosts: Iterable[int], rates: Iterable[str],
                 timeout: float, results: str, controller: str = "mpi") -> list[dict[str, Any]]:
    """Runs ``script --worker ARGS`` on a fresh cluster per (hosts, rate); returns and appends the rows."""
    rows: list[dict[str, Any]] = []
    for size in hosts:
        for rate in rates:
            setting = cluster.up(size, rate, name=NAME)
            try:
                goodput = cluster.throughput(setting, 0, 1, nbytes=int(min(setting.rate_bps / 8 * 2, 1e9)))
                argv = setting.launch_command([sys.executable, script, "--worker", *worker_args],
                                              env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                                              controller=controller)
                start = time.perf_counter()
                process = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
                wall = time.perf_counter() - start
                if process.returncode != 0:
                    raise RuntimeError(f"{script} on {size} hosts at {rate} failed:\n{process.stdout[-3000:]}\n"
                                       f"{process.stderr[-3000:]}")
            finally:
                cluster.down(NAME)
            common = {"hosts": size, "rate": rate, "controller": controller, "rate_bps": setting.rate_bps,
                      "goodput_bps": goodput, "run_wall_s": wall, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      **machine()}
            found = [{**json.loads(line[len(PREFIX):]), **common}
                     for line in process.stdout.splitlines() if line.startswith(PREFIX)]
            for row in found:
                print(json.dumps(row), flush=True)
            RESULTS.mkdir(exist_ok=True)
            with open(RESULTS / results, "a") as stream:
                stream.writelines(json.dumps(row) + "\n" for row in found)
            rows += found
    return rows


def reached(row: dict[str, Any], target: float) -> str:
    """When a training row's accuracy curve ([[seconds, step, accuracy], ...]) first reached ``target``, as text."""
    time_s = next((point[0] for point in row["curve"] if point[2] >= target), None)
    return "-" if time_s is None else f"{time_s:.1f} s"


def load(results: str, since: str | None = None) -> list[dict[str, Any]]:
    """The rows of a results file, only those of runs at or after ``since`` (an ISO time) if given. Rows of the
    first runs did not record the controller: they ran over MPI."""
    path = RESULTS / results
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [{"controller": "mpi", **row} for row in rows if since is None or row["time"] >= since]


def save_figure(figure: Any, legend_axis: Any, path: Path) -> None:
    """The benchmarks' common finish: a small legend on ``legend_axis``, tight layout, a PNG at ``path``."""
    legend_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def latest(rows: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    """For each combination of ``keys``, the rows of the most recent run only."""
    newest: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        newest[tuple(row[key] for key in keys)] = row
    return list(newest.values())
