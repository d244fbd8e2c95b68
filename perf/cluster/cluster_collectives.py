"""Collectives on the emulated cluster, in the manner of nccl-tests: time, algorithm and bus bandwidth, link use.

    .venv/bin/python perf/cluster/cluster_collectives.py [--hosts 2 4]
        [--rates 100mbit 1gbit 10gbit] [--methods dense fp16 ...]

For each cluster (hosts x rate) and each size from 1 KB up by factors of 4, every method reduces (sums) one float32
tensor of that size across all ranks: ``dense`` (Horovod's allreduce, fp32), ``hvd-fp16`` (Horovod's own
``hvd.Compression.fp16``), and hvdcomp's compressed collectives as the optimizer runs them
(:mod:`hvdcomp.reductions`): ``fp16`` (allreduce of float16), ``terngrad`` (allgather), ``terngrad-two-phase``,
``topk`` (1%, allgather) and ``randomk`` (1%, allreduce). Time is the slowest rank's, median of the repetitions
after one warm-up, encoding and decoding included. As in nccl-tests (doc/PERFORMANCE.md), with S the float32 bytes
reduced and n the ranks: algbw = S / t and busbw = algbw x 2(n-1)/n, the bandwidth a dense ring allreduce would need
on each link to finish in t; for compressed methods these are *effective* figures (the reduction delivered per
second), and link utilization = the bytes that really crossed the busiest link direction (the hosts' eth0 counters,
headers included) / (t x rate). The largest size is cut per rate (16 MB at 100 Mbit/s, 64 MB at 1 Gbit/s; a dense
256 MB allreduce on 4 hosts at 100 Mbit/s alone takes half a minute per repetition) to keep a sweep within minutes;
``--sizes`` measures given sizes only. ``--controller gloo`` runs the ranks under Horovod's Gloo controller instead
of MPI (the plot shows MPI rows). Rows go to perf/results/cluster_collectives.jsonl; the plot to
perf/results/cluster_collectives.png. """

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import clusterbench

RESULTS = "cluster_collectives.jsonl"
METHODS = ("dense", "hvd-fp16", "fp16", "terngrad", "terngrad-two-phase", "topk", "randomk")
MAX_BYTES = {"100mbit": 16 << 20, "1gbit": 64 << 20, "10gbit": 256 << 20}
MIN_BYTES = 1 << 10


def sizes(max_bytes: int) -> list[int]:
    out, size = [], MIN_BYTES
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out


def worker(methods: list[str], all_sizes: list[int]) -> None:
    import dataclasses
    import itertools

    import horovod.torch as hvd
    import torch

    import hvdcomp
    from hvdcomp import reductions
    from hvdcomp.collectives import run_alone
    from hvdcomp.compressor import Context, derive_seed

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()

    def compressed(reduction_name: str, compressor: hvdcomp.Compressor, x: torch.Tensor
                   ) -> Callable[[str], torch.Tensor]:
        reduction = reductions.make(reduction_name, compressor)
        ctx = Context("x", rank, size, x.device, derive_seed("x", rank), derive_seed("x", "shared"))
        state = reduction.init_state(x, ctx)
        steps = itertools.count()
        return lambda name: run_alone(reduction.reduce(x, state, dataclasses.replace(ctx, step=next(steps))), name)

    def make(method: str, x: torch.Tensor) -> Callable[[str], torch.Tensor]:
        if method == "dense":
            return lambda name: hvd.allreduce(x, op=hvd.Sum, name=name)
        if method == "hvd-fp16":
            return lambda name: hvd.allreduce(x, op=hvd.Sum, name=name, compression=hvd.Compression.fp16)
        if method == "fp16":
            return compressed("allreduce", hvdcomp.FP16Compressor(), x)
        if method == "terngrad":
            return compressed("allgather", hvdcomp.TernGrad(), x)
        if method == "terngrad-two-phase":
            return compressed("two_phase", hvdcomp.TernGrad(), x)
        if method == "topk":
            return compressed("allgather", hvdcomp.TopK(0.01), x)
        if method == "randomk":
            return compressed("allreduce", hvdcomp.RandomK(0.01), x)
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")

    for nbytes in all_sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        repeats = 3 if nbytes <= 1 << 20 else 2
        for method in methods:
            run = make(method, x)
            tag = f"{method}.{nbytes}"
            run(f"{tag}.warmup")
            times, wire = clusterbench.time_calls(run, tag, repeats)
            t = statistics.median(times)
            algbw = nbytes / t
            if rank == 0:
                clusterbench.emit({"method": method, "bytes": nbytes, "ranks": size, "time_s": t,
                                   "algbw_Bps": algbw, "busbw_Bps": algbw * 2 * (size - 1) / size,
                                   "wire_bytes": statistics.median(wire), "repeats": repeats})


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(row["hosts"], row["rate_bps"], row["rate"]) for row in rows})
    figure, axes = plt.subplots(2, len(settings), figsize=(3.3 * len(settings), 6.2), squeeze=False)
    for column, (hosts, rate_bps, rate) in enumerate(settings):
        mine = [row for row in rows if row["hosts"] == hosts and row["rate"] == rate]
        top, bottom = axes[0][column], axes[1][column]
        for method in METHODS:
            points = sorted((row["bytes"], row) for row in mine if row["method"] == method)
            if not points:
                continue
            x = [b for b, _ in points]
            top.plot(x, [row["busbw_Bps"] * 8 / 1e9 for _, row in points], marker=".", label=method)
            bottom.plot(x, [row["wire_bytes"] * 8 / (row["time_s"] * rate_bps) for _, row in points],
                        marker=".", label=method)
        top.axhline(rate_bps / 1e9, color="black", linestyle="--", linewidth=0.8)
        top.set_title(f"{hosts} hosts, {rate}", fontsize=9)
        for axis in (top, bottom):
            axis.set_xscale("log", base=2)
            axis.set_xlabel("float32 bytes reduced", fontsize=8)
            axis.tick_params(labelsize=7)
        top.set_yscale("log")
        bottom.set_ylim(0, 1.1)
    axes[0][0].set_ylabel("effective busbw (Gbit/s)\n(dashed: link rate)", fontsize=8)
    axes[1][0].set_ylabel("link utilization", fontsize=8)
    clusterbench.save_figure(figure, axes[0][-1], path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=list(clusterbench.HOSTS))
    parser.add_argument("--rates", nargs="+", default=list(clusterbench.RATES), choices=list(MAX_BYTES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--sizes", type=int, nargs="+", metavar="BYTES",
                        help="these sizes only (default: 1 KB up by 4x to the rate's largest size)")
    parser.add_argument("--controller", choices=["mpi", "gloo"], default="mpi", help="Horovod's controller")
    parser.add_argument("--plot-only", action="store_true", help="re-plot the newest rows of the results file")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker[1:], [int(size) for size in args.worker[0].split(",")])
        return
    if not args.plot_only:
        for rate in args.rates:
            chosen = args.sizes or sizes(MAX_BYTES[rate])
            clusterbench.run_settings(__file__, [",".join(map(str, chosen)), *args.methods], args.hosts, [rate],
                                      timeout=1200, results=RESULTS, controller=args.controller)
    rows = clusterbench.latest([row for row in clusterbench.load(RESULTS) if row["controller"] == "mpi"],
                               "hosts", "rate", "method", "bytes")
    plot(rows, clusterbench.RESULTS / "cluster_collectives.png")


if __name__ == "__main__":
    sys.exit(main())
