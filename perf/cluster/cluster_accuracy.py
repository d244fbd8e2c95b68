"""Time to accuracy on the emulated cluster: the digits classifier, dense against compressed, same hyperparameters.

    .venv/bin/python perf/cluster/cluster_accuracy.py [--hosts 2 4] [--rates 100mbit 10gbit]

The real-data workload of ``hvdcomp train --workload digits`` (scikit-learn's handwritten digits, an MLP of 83 k
parameters) with its defaults (20 epochs, batch 32 per rank, SGD lr 0.05, momentum 0.9, the same data shards per
epoch as ``hvdcomp train``) for every method of perf/cluster/cluster_training.py: hvdcomp's ``dense``, ``fp16``,
``terngrad``, ``topk``, ``randomk``, ``powersgd`` (rank 4 from the 3rd step), the quantizers (``bingrad``, ``orq``,
``qsgd``, ``signsgd``, ``efsignsgd``, ``onebit``), top-k at GraVAC's candidate CFs (``topk-10x`` to
``topk-10000x``), ``dgc``, ``threshold``, ``gravac`` (their epoch-counted options set to the steps per epoch, as
``hvdcomp train`` does) and the peers ``hvd-fp16``, ``ddp``, ``ddp-powersgd`` (PyTorch's hook, rank 4 from the 3rd
step). After each epoch every rank evaluates the test set (360
images, outside the timed training time); the row of a method holds its accuracy curve against training time and the
time (and epoch) at which test accuracy first reached ``--target`` (default 0.95). Rows go to
perf/results/cluster_accuracy.jsonl, the plot to perf/results/cluster_accuracy.png.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import clusterbench

RESULTS = "cluster_accuracy.jsonl"
HVDCOMP = {"dense": "none", "fp16": "fp16", "terngrad": "terngrad", "topk": "topk", "randomk": "randomk",
           "powersgd": {"method": "powersgd", "options": {"rank": 4, "start_iter": 2}}, "bingrad": "bingrad",
           "orq": "orq", "qsgd": "qsgd", "signsgd": "signsgd", "efsignsgd": "efsignsgd", "onebit": "onebit",
           # issue 13: top-k at each of GraVAC's default candidate CFs (static), DGC, threshold and GraVAC
           **{f"topk-{cf}x": {"method": "topk", "options": {"ratio": 1 / cf}} for cf in (10, 100, 1000, 10000)},
           "dgc": "dgc", "threshold": "threshold", "gravac": "gravac"}
METHODS = (*HVDCOMP, "hvd-fp16", "ddp", "ddp-powersgd")


def worker(target: float, methods: list[str]) -> None:
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import hvdcomp
    from hvdcomp.tools.train import sgd as make_sgd
    from hvdcomp.tools.train import with_epochs
    from hvdcomp.workloads import WORKLOADS

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    master = socket.gethostbyname(f"{clusterbench.NAME}-h0")  # the hosts file of the rank's namespace
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29512", rank=rank, world_size=size)
    loss_fn = nn.CrossEntropyLoss()
    seed = 0
    for method in methods:
        workload = WORKLOADS["digits"](seed)
        model, data = workload.model, workload.data
        shard = len(data.train_x) // size
        steps = shard // workload.batch_size
        sgd = torch.optim.SGD(model.parameters(), lr=workload.lr, momentum=0.9)
        if method in HVDCOMP:  # as hvdcomp train: epoch-counted options in steps, DGC's momentum in DGC alone
            compression = with_epochs(HVDCOMP[method], steps)
            optimizer = hvdcomp.DistributedOptimizer(make_sgd(model, compression, workload.lr, size),
                                                     named_parameters=model.named_parameters(),
                                                     compression=compression)
            forward: nn.Module = model
        elif method == "hvd-fp16":
            optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                 compression=hvd.Compression.fp16)
            forward = model
        else:
            optimizer = sgd
            forward = nn.parallel.DistributedDataParallel(model, init_sync=False)
            if method == "ddp-powersgd":
                state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                               start_powerSGD_iter=2)
                forward.register_comm_hook(state, clusterbench.serialized(powersgd.powerSGD_hook))
        elapsed, curve = 0.0, []
        hvd.allreduce(torch.zeros(1), name=f"{method}.barrier")
        for epoch in range(workload.epochs):
            order = torch.randperm(len(data.train_x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
            mine = order[rank * shard:(rank + 1) * shard]
            start = time.perf_counter()
            for step in range(steps):
                batch = mine[step * workload.batch_size:(step + 1) * workload.batch_size]
                optimizer.zero_grad()
                loss_fn(forward(data.train_x[batch]), data.train_y[batch]).backward()
                optimizer.step()
            elapsed += time.perf_counter() - start
            slowest = hvd.allreduce(torch.tensor([elapsed], dtype=torch.float64), op=hvd.Max,
                                    name=f"{method}.time.{epoch}").item()
            model.eval()
            with torch.no_grad():
                accuracy = (model(data.test_x).argmax(dim=1) == data.test_y).float().mean().item()
            model.train()
            curve.append((epoch + 1, slowest, accuracy))
        reached = next(((epoch, t) for epoch, t, accuracy in curve if accuracy >= target), (None, None))
        if rank == 0:
            clusterbench.emit({"method": method, "ranks": size, "target": target, "epochs_to_target": reached[0],
                               "time_to_target_s": reached[1], "final_accuracy": curve[-1][2],
                               "train_time_s": curve[-1][1], "curve": curve})
    dist.destroy_process_group()


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(row["hosts"], row["rate_bps"], row["rate"]) for row in rows})
    figure, axes = plt.subplots(1, len(settings), figsize=(3.6 * len(settings), 3.4), squeeze=False)
    for axis, (hosts, _, rate) in zip(axes[0], settings, strict=True):
        for row in rows:
            if row["hosts"] == hosts and row["rate"] == rate:
                _, times, accuracies = zip(*row["curve"], strict=True)
                axis.plot(times, accuracies, marker=".", label=row["method"],
                          linestyle="--" if row["method"] not in HVDCOMP else "-")
        axis.axhline(rows[0]["target"], color="black", linewidth=0.7)
        axis.set_xscale("log")
        axis.set_ylim(0.8, 1.0)
        axis.set_title(f"digits, {hosts} hosts, {rate}", fontsize=9)
        axis.set_xlabel("training time (s)", fontsize=8)
        axis.tick_params(labelsize=7)
    axes[0][0].set_ylabel("test accuracy", fontsize=8)
    clusterbench.save_figure(figure, axes[0][-1], path)


def summary(rows: list[dict[str, Any]], methods: list[str]) -> None:
    """Per setting and method, over the runs in ``rows``: the median time to target (min-max; a run that never
    reached it counts as infinite) and the median final accuracy."""
    settings = sorted({(row["hosts"], row["rate_bps"], row["rate"]) for row in rows})
    for hosts, _, rate in settings:
        for method in methods:
            mine = [row for row in rows if (row["hosts"], row["rate"], row["method"]) == (hosts, rate, method)]
            if not mine:
                continue
            times = sorted(math.inf if row["time_to_target_s"] is None else row["time_to_target_s"] for row in mine)
            final = statistics.median(row["final_accuracy"] for row in mine)
            print(f"{hosts} hosts {rate:>7} {method:>13}: {statistics.median(times):.2f} s ({times[0]:.2f}-"
                  f"{times[-1]:.2f}) over {len(mine)} runs; final accuracy {final:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=list(clusterbench.HOSTS))
    parser.add_argument("--rates", nargs="+", default=["100mbit", "10gbit"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--since", help="also summarize every run of --methods since this time (ISO, as the rows' "
                        "'time'): median time to target and its range")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(float(args.worker[0]), args.worker[1:])
        return
    if not args.plot_only:
        clusterbench.run_settings(__file__, [str(args.target), *args.methods], args.hosts, args.rates,
                                  timeout=1200, results=RESULTS)
    rows = clusterbench.latest(clusterbench.load(RESULTS), "hosts", "rate", "method")
    for row in rows:
        reached = (f"{row['target']:.0%} at {row['time_to_target_s']:.2f} s (epoch {row['epochs_to_target']})"
                   if row["time_to_target_s"] is not None else f"{row['target']:.0%} not reached")
        print(f"{row['hosts']} hosts {row['rate']:>7} {row['method']:>13}: {reached}; final "
              f"{row['final_accuracy']:.3f} after {row['train_time_s']:.2f} s")
    plot(rows, clusterbench.RESULTS / "cluster_accuracy.png")
    if args.since:
        summary([row for row in clusterbench.load(RESULTS) if row["time"] >= args.since], args.methods)


if __name__ == "__main__":
    sys.exit(main())
