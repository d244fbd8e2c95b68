"""Bulk transfers between 2 emulated hosts, with and without Horovod: where link time goes before any compression.

    .venv/bin/python perf/cluster/cluster_transport.py [--rate 100mbit]

On a fresh 2-host cluster (:mod:`hvdcomp.tools.cluster`), 50 MB (12.5 M float32) per rank, each test twice:

* under mpirun (Open MPI's TCP transport, as every hvdcomp run over MPI): a one-way ``MPI_Send``, a two-way
  ``MPI_Sendrecv`` (both link directions at once) before ``hvd.init()``, the same ``MPI_Sendrecv`` after it
  (Horovod's background thread now runs beside it, polling MPI every cycle), then ``hvd.allreduce`` and
  ``hvd.allgather`` of the tensor;
* under Horovod's Gloo controller: ``hvd.allreduce`` and ``hvd.allgather``.

Each row gives the time and the wire time of the bytes one link direction must carry (50 MB x 8 / rate; every
test moves 50 MB each way on each host's link, plus headers), so ``time / wire`` is 1.05 for a link used at
its goodput. Rows go to perf/results/cluster_transport.jsonl, the plot to perf/results/cluster_transport.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import clusterbench

RESULTS = "cluster_transport.jsonl"
NUMEL = 12_500_000  # 50 MB of float32


def worker(controller: str) -> None:
    import numpy as np

    def run(name: str, fn: Any, barrier: Any, slowest: Any, rank: int) -> None:
        for repeat in range(2):
            barrier()
            start = time.perf_counter()
            fn()
            seconds = slowest(time.perf_counter() - start)
            if rank == 0:
                clusterbench.emit({"test": name, "repeat": repeat, "seconds": seconds, "bytes_each_way": NUMEL * 4})

    if controller == "mpi":
        from mpi4py import MPI  # initializes MPI; Horovod, started below, uses it

        comm = MPI.COMM_WORLD
        rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
        send, receive = np.ones(NUMEL, np.float32), np.empty(NUMEL, np.float32)

        def one_way() -> None:
            if rank == 0:
                comm.Send(send, 1)
            else:
                comm.Recv(receive, 0)

        def two_way() -> None:
            comm.Sendrecv(send, peer, recvbuf=receive, source=peer)

        def slowest_mpi(seconds: float) -> float:
            return comm.allreduce(seconds, op=MPI.MAX)

        run("mpi-send", one_way, comm.Barrier, slowest_mpi, rank)
        run("mpi-sendrecv", two_way, comm.Barrier, slowest_mpi, rank)
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)

    def barrier() -> None:
        hvd.allreduce(torch.zeros(1), name="barrier")

    def slowest(seconds: float) -> float:
        return hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="slowest").item()

    if controller == "mpi":
        run("mpi-sendrecv-beside-horovod", two_way, comm.Barrier, slowest_mpi, rank)
    tensor = torch.ones(NUMEL)
    run(f"hvd-allreduce-{controller}", lambda: hvd.allreduce(tensor, name="allreduce"), barrier, slowest, hvd.rank())
    run(f"hvd-allgather-{controller}", lambda: hvd.allgather(tensor, name="allgather"), barrier, slowest, hvd.rank())


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row['test']} #{row['repeat']}" for row in rows]
    ratios = [row["seconds"] / row["wire_s"] for row in rows]
    figure, axis = plt.subplots(figsize=(7, 3.8))
    axis.barh(labels, ratios, color="tab:blue")
    axis.axvline(1 / 0.956, color="black", linestyle="--", linewidth=0.8, label="TCP goodput (95.6% of rate)")
    axis.set_xlabel(f"time / wire time of 50 MB each way, 2 hosts at {rows[0]['rate']}", fontsize=8)
    axis.tick_params(labelsize=7)
    axis.invert_yaxis()
    clusterbench.save_figure(figure, axis, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker[0])
        return
    if not args.plot_only:
        for controller in ("mpi", "gloo"):
            clusterbench.run_settings(__file__, [controller], [2], [args.rate], timeout=600, results=RESULTS,
                                      controller=controller)
    rows = clusterbench.load(RESULTS)
    newest = max(row["time"] for row in rows if row["controller"] == "mpi")
    rows = [{**row, "wire_s": row["bytes_each_way"] * 8 / row["rate_bps"]} for row in rows if row["time"] >= newest]
    for row in rows:
        print(f"{row['controller']:>4} {row['test']:>34} #{row['repeat']}: {row['seconds']:6.2f} s, "
              f"{row['seconds'] / row['wire_s']:.2f}x the wire time")
    plot(rows, clusterbench.RESULTS / "cluster_transport.png")


if __name__ == "__main__":
    sys.exit(main())
