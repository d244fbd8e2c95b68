"""The homomorphic sketch on the emulated cluster: sparse collectives as supports overlap, and training the sparse
workload.

    .venv/bin/python perf/cluster/cluster_sketch.py collectives [--hosts 2 4] [--rates 100mbit 1gbit]
    .venv/bin/python perf/cluster/cluster_sketch.py training [--hosts 2 4] [--rates 100mbit] [--epochs 2]
    .venv/bin/python perf/cluster/cluster_sketch.py report

``collectives``: every rank holds a row-sparse gradient of 250,000 rows x 16 (16 MB of float32), 1% of its rows
nonzero, of which a fraction ``overlap`` (0, 0.5, 0.9) is the same on every rank and the rest is the rank's own.
Each method sums it across the ranks: ``dense`` (Horovod's allreduce of the 16 MB), ``topk`` (top-k at the same
density, 1% of the entries, gathered: every nonzero entry), ``sketch`` (the sketch method on the rows) and
``topk-sketch`` (the same top-k payloads summed by the sketch collective, entries as items); and two variants of
the sketch, ``sketch-float64`` (lossless cells) and ``sketch-filter-allreduce`` (the filter as float16 flags summed,
instead of gathered bits). Time is the slowest
rank's, median of 3 repetitions after a warm-up; wire bytes are the busiest link direction's (the hosts' eth0
counters). Rows go to perf/results/cluster_sketch.jsonl.

``training``: ``hvdcomp train``'s bow workload (an EmbeddingBag of 100,000 x 32 with sparse gradients) with dense,
top-k at the sparse gradient's density (1.1% of the table's entries) and the sketch; every 8 steps each rank
evaluates the test set (outside the timed training time). A row holds the accuracy curve against training time, the
median step time (with the interquartile range) and the time at which accuracy first reached ``--target``;
``report`` reads the times to 80% and 85% off the curves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import clusterbench

RESULTS = "cluster_sketch.jsonl"
TRAIN_METHODS = {"dense": "none", "topk": {"method": "topk", "options": {"ratio": 0.011}},
                 "sketch": "sketch"}
ROWS, WIDTH, DENSITY = 250_000, 16, 0.01


def collectives_worker() -> None:
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

    def reduce_with(reduction_name: str, compressor: hvdcomp.Compressor, x: torch.Tensor, **options: object
                    ) -> object:
        reduction = reductions.make(reduction_name, compressor, options)
        ctx = Context("x", rank, size, x.device, derive_seed("x", rank), derive_seed("x", "shared"))
        state = reduction.init_state(x, ctx)
        steps = itertools.count()
        return lambda name: run_alone(reduction.reduce(x, state, dataclasses.replace(ctx, step=next(steps))), name)

    k = int(ROWS * DENSITY)
    for overlap in (0.0, 0.5, 0.9):
        pool = torch.randperm(ROWS, generator=torch.Generator().manual_seed(7))
        shared = pool[:round(k * overlap)]
        rows = torch.cat([shared, pool[k + rank * k:k + rank * k + k - shared.numel()]])
        x = torch.zeros(ROWS, WIDTH)
        x[rows] = torch.randn(rows.numel(), WIDTH, generator=torch.Generator().manual_seed(rank))
        exact = hvd.allreduce(x, op=hvd.Sum, name=f"exact.{overlap}")
        union = int(hvd.allreduce((x != 0).any(1).float(), op=hvd.Max, name=f"union.{overlap}").sum())
        runs = {"dense": lambda name, x=x: hvd.allreduce(x, op=hvd.Sum, name=name),
                "topk": reduce_with("allgather", hvdcomp.TopK(DENSITY), x),
                "sketch": reduce_with("sketch", hvdcomp.Sketch(), x),
                "sketch-float64": reduce_with("sketch", hvdcomp.Sketch(), x, dtype="float64"),
                "sketch-filter-allreduce": reduce_with("sketch", hvdcomp.Sketch(), x, filter_collective="allreduce"),
                "topk-sketch": reduce_with("sketch", hvdcomp.TopK(DENSITY), x)}
        for method, run in runs.items():
            tag = f"{method}.{overlap}"
            error = (run(f"{tag}.warmup") - exact).abs().max().item()
            times, wire = clusterbench.time_calls(run, tag, 3)
            if rank == 0:
                clusterbench.emit({"kind": "collective", "method": method, "overlap": overlap, "ranks": size,
                                   "union_rows": union, "rows_per_rank": k, "time_s": statistics.median(times),
                                   "times_s": times, "wire_bytes": statistics.median(wire),
                                   "max_abs_error": error})


def training_worker(epochs: int, target: float) -> None:
    import horovod.torch as hvd
    import torch
    from torch import nn

    import hvdcomp
    from hvdcomp.tools.train import evaluate, sgd
    from hvdcomp.workloads import WORKLOADS

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    for label, compression in TRAIN_METHODS.items():
        workload = WORKLOADS["bow"](0)
        model, data = workload.model, workload.data
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvdcomp.DistributedOptimizer(sgd(model, compression, workload.lr, size),
                                                 named_parameters=model.named_parameters(), compression=compression)
        shard = len(data.train_x) // size
        steps_per_epoch = shard // workload.batch_size
        loss_fn = nn.CrossEntropyLoss()
        elapsed, curve, step_times, reached = 0.0, [], [], None
        for epoch in range(epochs):
            order = torch.randperm(len(data.train_x), generator=torch.Generator().manual_seed(epoch))
            mine = order[rank * shard:(rank + 1) * shard]
            for step in range(steps_per_epoch):
                batch = mine[step * workload.batch_size:(step + 1) * workload.batch_size]
                start = time.perf_counter()
                optimizer.zero_grad()
                loss_fn(model(data.train_x[batch]), data.train_y[batch]).backward()
                optimizer.step()
                step_times.append(time.perf_counter() - start)
                elapsed += step_times[-1]
                done = epoch * steps_per_epoch + step + 1
                if done % 8 == 0:
                    accuracy = evaluate(model, data)
                    curve.append([round(elapsed, 3), done, accuracy])
                    if reached is None and accuracy >= target:
                        reached = elapsed
        slowest = hvd.allreduce(torch.tensor([elapsed]), op=hvd.Max, name=f"{label}.elapsed").item()
        quartiles = statistics.quantiles(step_times[1:], n=4)
        if rank == 0:
            clusterbench.emit({"kind": "training", "method": label, "ranks": size, "epochs": epochs,
                               "steps": epochs * steps_per_epoch, "median_step_s": quartiles[1],
                               "step_iqr_s": [quartiles[0], quartiles[2]], "train_time_s": slowest,
                               "target": target, "time_to_target_s": reached, "final_accuracy": curve[-1][2],
                               "bytes_per_step": optimizer.bytes_sent / (epochs * steps_per_epoch),
                               "curve": curve})


def report(rows: list[dict]) -> str:
    """Markdown tables of the newest rows: the collectives, then the training runs."""
    collective = clusterbench.latest([r for r in rows if r.get("kind") == "collective"],
                                     "hosts", "rate", "overlap", "method")
    methods = list(dict.fromkeys(r["method"] for r in collective))
    lines = ["| hosts | rate | overlap | union rows | " + " | ".join(methods) + " |",
             "| --- " * (4 + len(methods)) + "|"]
    for key in sorted({(r["hosts"], r["rate_bps"], r["rate"], r["overlap"]) for r in collective}):
        chosen = {r["method"]: r for r in collective if (r["hosts"], r["rate"], r["overlap"]) == (key[0], *key[2:])}
        cells = [f"{chosen[m]['time_s'] * 1e3:.0f} ms [{min(chosen[m]['times_s']) * 1e3:.0f}-"
                 f"{max(chosen[m]['times_s']) * 1e3:.0f}], {chosen[m]['wire_bytes'] / 1e3:.0f} kB" if m in chosen
                 else "-" for m in methods]
        union = next(iter(chosen.values()))["union_rows"]
        lines.append(f"| {key[0]} | {key[2]} | {key[3]} | {union} | " + " | ".join(cells) + " |")
    training = clusterbench.latest([r for r in rows if r.get("kind") == "training"], "hosts", "rate", "method")
    lines += ["", "| hosts | rate | method | median step [IQR] | 2 epochs | bytes handed/step | to 80% | to 85% | "
              "final accuracy |", "| --- " * 9 + "|"]
    for r in training:
        lines.append(f"| {r['hosts']} | {r['rate']} | {r['method']} | {r['median_step_s'] * 1e3:.0f} ms "
                     f"[{r['step_iqr_s'][0] * 1e3:.0f}-{r['step_iqr_s'][1] * 1e3:.0f}] | {r['train_time_s']:.1f} s | "
                     f"{r['bytes_per_step'] / 1e3:.0f} kB | {clusterbench.reached(r, 0.8)} | "
                     f"{clusterbench.reached(r, 0.85)} | {r['final_accuracy'] * 100:.2f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["collectives", "training", "report"], nargs="?",
                        help="report: markdown tables of the newest rows of the results file")
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        if args.worker[0] == "collectives":
            collectives_worker()
        else:
            training_worker(int(args.worker[1]), float(args.worker[2]))
        return
    if args.what == "report":
        print(report(clusterbench.load(RESULTS)))
        return
    worker_args = ["collectives"] if args.what == "collectives" else ["training", str(args.epochs), str(args.target)]
    clusterbench.run_settings(__file__, worker_args, args.hosts, args.rates, timeout=3000, results=RESULTS)


if __name__ == "__main__":
    sys.exit(main())
