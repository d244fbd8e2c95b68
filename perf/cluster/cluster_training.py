"""Training step time on the emulated cluster: hvdcomp's compressors against dense and against the peers.

    .venv/bin/python perf/cluster/cluster_training.py [--hosts 2 4] [--rates 100mbit 1gbit 10gbit] [--batch-size 32]
        [--controller mpi|gloo]

The communication-heavy workload of ``hvdcomp train --workload synthetic`` (:mod:`hvdcomp.workloads`: an MLP of
25.2 M parameters, 101 MB of float32 gradient per step), trained with the same loop as ``hvdcomp train``
(zero_grad, forward, backward, step; SGD with momentum) for a few steps per method, all methods in one
launch on the same links:

* hvdcomp (:func:`hvdcomp.DistributedOptimizer`): ``dense`` (``compression="none"``, exactly stock
  Horovod), ``fp16``, ``terngrad`` (allgather), ``terngrad-two-phase``, ``topk`` (1%, error feedback),
  ``randomk`` (1%, unbiased), ``powersgd`` (rank 4 from the 3rd step, as the ddp-powersgd peer), and the
  quantizers at their defaults (``bingrad``, ``orq``, ``qsgd``, ``signsgd``, ``efsignsgd``, ``onebit``: allgather
  on 2 and 4 hosts);
* peers: ``hvd`` and ``hvd-fp16`` (stock ``hvd.DistributedOptimizer``, without compression and with
  ``compression=hvd.Compression.fp16``), ``ddp`` (PyTorch
  DistributedDataParallel over torch.distributed's Gloo backend) and ``ddp-powersgd`` (the same with
  PyTorch's PowerSGD communication hook, rank 4, compressing from the 3rd step on).

One warm-up step per method (three for powersgd and ddp-powersgd, whose first two steps are dense), then 3 timed steps
at 100 Mbit/s (a dense step on 4 hosts takes over 10 s there) and 6 on faster links.

Per method: the slowest rank's mean step time over the timed steps (after warm-up), samples/s, the bytes
that crossed the busiest host link direction per step (eth0 counters), the lower bound
compute + wire bytes / rate, where compute is the same forward/backward/update without any communication,
measured on all ranks at once in the same launch (so it includes the CPU sharing of the ranks on this
machine), and the time spent in ``optimizer.step()`` (where Horovod and hvdcomp wait for the reductions
started during backward; DDP waits at the end of backward instead). ``--controller gloo`` runs Horovod (and
so hvdcomp) over its Gloo controller and collectives instead of MPI. Rows go to
perf/results/cluster_training.jsonl, the plot (one panel per hosts, rate and controller) to
perf/results/cluster_training.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import clusterbench

RESULTS = "cluster_training.jsonl"
HVDCOMP = {"dense": "none", "fp16": "fp16", "terngrad": {"method": "terngrad", "collective": "allgather"},
           "terngrad-two-phase": {"method": "terngrad", "collective": "two_phase"}, "topk": "topk",
           "randomk": "randomk", "powersgd": {"method": "powersgd", "options": {"rank": 4, "start_iter": 2}},
           "bingrad": "bingrad", "orq": "orq", "qsgd": "qsgd", "signsgd": "signsgd", "efsignsgd": "efsignsgd",
           "onebit": "onebit"}
PEERS = ("hvd", "hvd-fp16", "ddp", "ddp-powersgd")
METHODS = (*HVDCOMP, *PEERS)


def worker(batch_size: int, steps: int, methods: list[str]) -> None:
    import socket

    import horovod.torch as hvd
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import hvdcomp
    from hvdcomp.workloads import WORKLOADS

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    master = socket.gethostbyname(f"{clusterbench.NAME}-h0")  # the hosts file of the rank's namespace
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29511", rank=rank, world_size=size)
    data = WORKLOADS["synthetic"](0).data
    loss_fn = nn.CrossEntropyLoss()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = ((step * size + rank) * batch_size) % (len(data.train_x) - batch_size)
        return data.train_x[start:start + batch_size], data.train_y[start:start + batch_size]

    def slowest(value: float, name: str) -> float:
        return hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max, name=name).item()

    def timed(model: nn.Module, optimizer: torch.optim.Optimizer, label: str, warmup: int = 1) -> dict[str, float]:
        in_step = 0.0
        for step in range(warmup + steps):
            if step == warmup:
                hvd.allreduce(torch.zeros(1), name=f"{label}.barrier")
                before = clusterbench.link_bytes()
                sent = getattr(optimizer, "bytes_sent", 0)  # hvdcomp's count, from the first timed step on
                start = time.perf_counter()
                in_step = 0.0
            x, y = batch(step)
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            stepping = time.perf_counter()
            optimizer.step()
            in_step += time.perf_counter() - stepping
        elapsed = time.perf_counter() - start
        after = clusterbench.link_bytes()
        wire = max(after[0] - before[0], after[1] - before[1]) / steps
        return {"step_s": slowest(elapsed / steps, f"{label}.time"), "wire_bytes": slowest(wire, f"{label}.wire"),
                "optimizer_step_s": slowest(in_step / steps, f"{label}.in_step"),
                "sent_bytes": hvd.allreduce(torch.tensor([(getattr(optimizer, "bytes_sent", 0) - sent) / steps],
                                                         dtype=torch.float64), op=hvd.Average,
                                            name=f"{label}.sent").item()}  # the mean over ranks

    def fresh() -> nn.Module:
        return WORKLOADS["synthetic"](0).model  # the same initial parameters on every rank

    # Compute alone: the same steps with a plain optimizer, all ranks at once.
    model = fresh()
    compute = timed(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), "compute")["step_s"]
    for method in methods:
        model = fresh()
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        payload: float | None = None
        if method in HVDCOMP:
            optimizer = hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                     compression=HVDCOMP[method])
            warmup = 3 if method == "powersgd" else 1
            result = timed(model, optimizer, method, warmup=warmup)
            payload = result["sent_bytes"]  # the timed steps' (PowerSGD's warm-up steps send dense)
        elif method in ("hvd", "hvd-fp16"):
            optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                 compression=hvd.Compression.fp16 if method == "hvd-fp16"
                                                 else hvd.Compression.none)
            result = timed(model, optimizer, method)
        else:
            ddp = nn.parallel.DistributedDataParallel(model, init_sync=False)
            if method == "ddp-powersgd":
                state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                               start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
                ddp.register_comm_hook(state, clusterbench.serialized(powersgd.powerSGD_hook))
            result = timed(ddp, sgd, method, warmup=3 if method == "ddp-powersgd" else 1)
        if rank == 0:
            result.pop("sent_bytes")
            clusterbench.emit({"method": method, "ranks": size, "batch_size": batch_size, "steps": steps,
                               "compute_s": compute, **result, "samples_per_s": batch_size * size / result["step_s"],
                               "payload_bytes": payload})
    dist.destroy_process_group()


def derived(row: dict[str, Any], dense: dict[str, Any] | None) -> dict[str, Any]:
    bound = row["compute_s"] + row["wire_bytes"] * 8 / row["rate_bps"]
    return {"bound_s": bound, "over_bound": row["step_s"] / bound,
            "speedup_over_dense": dense["step_s"] / row["step_s"] if dense else None}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(row["controller"], row["hosts"], row["rate_bps"], row["rate"]) for row in rows})
    columns = (len(settings) + 1) // 2
    figure, axes = plt.subplots(2, columns, figsize=(3.4 * columns, 7.6), squeeze=False)
    for axis in axes.flat[len(settings):]:
        axis.set_visible(False)
    for axis, (controller, hosts, _, rate) in zip(axes.flat, settings, strict=False):
        mine = {row["method"]: row for row in rows
                if (row["controller"], row["hosts"], row["rate"]) == (controller, hosts, rate)}
        names = [method for method in METHODS if method in mine]
        axis.bar(names, [mine[name]["step_s"] for name in names],
                 color=["tab:gray" if name in PEERS else "tab:blue" for name in names])
        axis.scatter(names, [mine[name]["bound_s"] for name in names], color="black", marker="_", s=200, zorder=3,
                     label="compute + wire bytes / rate")
        axis.set_yscale("log")
        axis.set_title(f"{hosts} hosts, {rate}, Horovod over {controller.upper()}", fontsize=9)
        axis.tick_params(axis="x", labelrotation=70, labelsize=7)
        axis.tick_params(axis="y", labelsize=7)
    axes[0][0].set_ylabel("step time (s), log scale\nblue: hvdcomp, gray: peers", fontsize=8)
    clusterbench.save_figure(figure, axes[0][0], path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=list(clusterbench.HOSTS))
    parser.add_argument("--rates", nargs="+", default=list(clusterbench.RATES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--controller", choices=["mpi", "gloo"], default="mpi", help="Horovod's controller")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        batch_size, steps, *methods = args.worker
        worker(int(batch_size), int(steps), methods)
        return
    if not args.plot_only:
        for rate in args.rates:
            steps = 3 if rate == "100mbit" else 6  # a dense step on 4 hosts at 100 Mbit/s takes over 10 s
            clusterbench.run_settings(__file__, [str(args.batch_size), str(steps), *args.methods], args.hosts,
                                      [rate], timeout=1500, results=RESULTS, controller=args.controller)
    every = clusterbench.load(RESULTS)
    rows = clusterbench.latest(every, "controller", "hosts", "rate", "method")
    # each method against dense of its own launch (the same "time"), where that launch ran dense; else the latest
    # dense, and the row says so
    launch = {(row["controller"], row["hosts"], row["rate"], row["time"]): row for row in every
              if row["method"] == "dense"}
    latest = {(row["controller"], row["hosts"], row["rate"]): row for row in rows if row["method"] == "dense"}
    paired = []
    for row in rows:
        setting = (row["controller"], row["hosts"], row["rate"])
        dense = launch.get((*setting, row["time"]))
        paired.append({**row, **derived(row, dense or latest.get(setting)),
                       "dense_from_another_launch": dense is None and setting in latest})
    rows = paired
    for row in rows:
        print(f"{row['controller']:>4} {row['hosts']} hosts {row['rate']:>7} {row['method']:>18}: "
              f"step {row['step_s'] * 1e3:8.0f} ms, "
              f"{row['samples_per_s']:7.1f} samples/s, bound {row['bound_s'] * 1e3:7.0f} ms "
              f"(x{row['over_bound']:.2f}), speedup over dense x{row['speedup_over_dense'] or 0:.2f}")
    plot(rows, clusterbench.RESULTS / "cluster_training.png")


if __name__ == "__main__":
    sys.exit(main())
