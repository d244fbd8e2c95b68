"""LGC (hvdcomp.methods.lgc): its autoencoder's cost on CPU; training on the emulated cluster beside top-k and dense.

    .venv/bin/python perf/cluster/lgc.py autoencoder [--repeats 9]
    .venv/bin/python perf/cluster/lgc.py cluster [--hosts 2 4] [--rates 100mbit 1gbit]
    .venv/bin/python perf/cluster/lgc.py report

``autoencoder``: the autoencoder's work per step and tensor, on one CPU thread (a rank's share of this machine), at the
defaults (16 channels, 2 code channels, 4 halvings), for k top-k values from N ranks: a stage-2 training step (one
Adam step on the N x k batch) and the stage-3 work of a rank (ring: encode, decode the summed code; ps: the leader's
encode and the N decoders; both, the guard's projections). k = 492 is digits' compressed layer at ratio 0.01;
16,777 and 167,773 a 4096 x 4096 layer at 0.001 and 0.01. Median of ``--repeats`` after two warm-ups, with the
range. Rows go to perf/results/lgc_autoencoder.jsonl.

``cluster``: ``hvdcomp train``'s digits workload (20 epochs, batch 32 per rank) on the emulated cluster, with dense,
``topk`` at LGC's ratio (0.01) on the same layers (the first and last stay dense, as LGC keeps them), and LGC's
ring and ps variants at their defaults (stage lengths one epoch each, as ``hvdcomp train`` sets them); then the same
with the first layer compressed too (``-all``: ``dense_edges: false``; the last layer, 960 values, is under
``min_numel`` and stays dense). Per step: the stage of the middle layer (compressed in every setting), the step
time, the bytes rank 0 handed to collectives (a broadcast counts at its root: the leader, every N-th step), the
middle layer's relative reconstruction error (fallbacks are counted over every layer); every 8 steps each rank
evaluates the test set (outside the timed training time). A row holds, per stage, the steps, median step time and
mean bytes per step, and the median error in stage 3; the time to 90% and 95% accuracy; the final accuracy. Rows go
to perf/results/lgc_cluster.jsonl. ``report`` prints both as markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import clusterbench

RESULTS = "lgc_cluster.jsonl"
AUTOENCODER_RESULTS = "lgc_autoencoder.jsonl"
METHODS = {"dense": "none",
           "topk": {"method": "topk", "options": {"ratio": 0.01}, "dense": ["0.*", "4.*"]},
           "lgc-ring": {"method": "lgc", "options": {"variant": "ring"}},
           "lgc-ps": {"method": "lgc", "options": {"variant": "ps"}},
           "topk-all": {"method": "topk", "options": {"ratio": 0.01}},
           "lgc-ring-all": {"method": "lgc", "options": {"variant": "ring", "dense_edges": False}},
           "lgc-ps-all": {"method": "lgc", "options": {"variant": "ps", "dense_edges": False}}}
LAYER = "2.weight"  # digits' middle layer, which LGC compresses in every setting: its stage and error are recorded


def median_ms(work: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    """The median and range (ms) of ``repeats`` calls after two warm-ups."""
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        work()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), [min(times), max(times)]


def autoencoder_costs(variant: str, ranks: int, k: int, repeats: int) -> dict:
    """One row: a stage-2 training step and a rank's stage-3 autoencoder work, for k values from ``ranks`` ranks."""
    import torch

    from hvdcomp.methods.lgc import LGC, Projection

    method = LGC(variant=variant)
    weights = method.init_weights(ranks, 0)
    state = {"ae": weights, "last": {}, "adam": {"t": 0, "m": {n: torch.zeros_like(w) for n, w in weights.items()},
                                                 "v": {n: torch.zeros_like(w) for n, w in weights.items()}}}
    batch = torch.randn(ranks, k)
    train_ms, train_range = median_ms(lambda: method.train_step(state, batch, 0), repeats)
    x = method.pad(batch[:1])

    def stage3() -> None:
        code = method.encode(weights, x)
        projection = Projection(0)
        exact = projection(batch[0])  # the guard's projection of this rank's values
        if variant == "ring":  # the summed code, and the guard's error of what it decodes to
            projection.error(exact, method.decode(weights, code)[0, 0, :k])
            return
        values, positions = method.innovation(batch)
        innovations = method.scatter(values, positions, x.shape[-1])
        for r in range(ranks):
            projection.error(exact, method.decode(weights, code, r, innovations[r:r + 1])[0, 0, :k])

    with torch.no_grad():
        use_ms, use_range = median_ms(stage3, repeats)
    return {"variant": variant, "ranks": ranks, "k": k, "train_ms": train_ms, "train_range_ms": train_range,
            "stage3_ms": use_ms, "stage3_range_ms": use_range, "repeats": repeats,
            "weights": sum(w.numel() for w in weights.values()), **clusterbench.machine()}


def autoencoder(repeats: int) -> None:
    import torch

    torch.set_num_threads(1)
    clusterbench.RESULTS.mkdir(exist_ok=True)
    for variant in ("ring", "ps"):
        for ranks in (2, 4):
            for k in (492, 16_777, 167_773):
                row = autoencoder_costs(variant, ranks, k, repeats)
                print(json.dumps(row), flush=True)
                with open(clusterbench.RESULTS / AUTOENCODER_RESULTS, "a") as stream:
                    stream.write(json.dumps(row) + "\n")


def cluster_worker() -> None:
    import horovod.torch as hvd
    import torch
    from torch import nn

    import hvdcomp
    from hvdcomp.tools.train import evaluate, sgd, with_epochs
    from hvdcomp.workloads import WORKLOADS

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    for label, setting in METHODS.items():
        workload = WORKLOADS["digits"](0)
        model, data = workload.model, workload.data
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        shard = len(data.train_x) // size
        steps_per_epoch = shard // workload.batch_size
        compression = with_epochs(setting, steps_per_epoch)
        optimizer = hvdcomp.DistributedOptimizer(sgd(model, compression, workload.lr, size),
                                                 named_parameters=model.named_parameters(), compression=compression)
        loss_fn = nn.CrossEntropyLoss()
        elapsed, curve, steps = 0.0, [], []
        for epoch in range(workload.epochs):
            order = torch.randperm(len(data.train_x), generator=torch.Generator().manual_seed(epoch))
            mine = order[rank * shard:(rank + 1) * shard]
            for step in range(steps_per_epoch):
                batch = mine[step * workload.batch_size:(step + 1) * workload.batch_size]
                sent = optimizer.bytes_sent
                start = time.perf_counter()
                optimizer.zero_grad()
                loss_fn(model(data.train_x[batch]), data.train_y[batch]).backward()
                optimizer.step()
                took = time.perf_counter() - start
                elapsed += took
                decided = optimizer.decisions().get(LAYER, ["all", None, 0])  # dense and top-k: no stages
                steps.append((str(decided[0]), took, optimizer.bytes_sent - sent, decided[1]))
                done = epoch * steps_per_epoch + step + 1
                if done % 8 == 0:
                    curve.append([round(elapsed, 3), done, evaluate(model, data)])
        slowest = hvd.allreduce(torch.tensor([elapsed]), op=hvd.Max, name=f"{label}.elapsed").item()
        if rank == 0:
            stages = {}
            for stage in sorted({s[0] for s in steps}):
                mine = [s for i, s in enumerate(steps) if s[0] == stage and i > 0]  # the first step warms up
                times = [s[1] for s in mine]
                errors = [s[3] for s in mine if s[3] is not None]
                stages[stage] = {"steps": sum(s[0] == stage for s in steps), "median_step_s": statistics.median(times),
                                      "step_range_s": [min(times), max(times)],
                                      "bytes_per_step": statistics.mean(s[2] for s in mine),
                                      "median_error": statistics.median(errors) if errors else None}
            clusterbench.emit({"kind": "training", "method": label, "ranks": size, "steps": len(steps),
                               "train_time_s": slowest, "stages": stages,
                               "median_step_s": statistics.median(s[1] for s in steps[1:]),
                               "dense_bytes_per_step": 4 * sum(p.numel() for p in model.parameters()),
                               "final_accuracy": curve[-1][2], "curve": curve,
                               "fallbacks": sum(d[2] for d in optimizer.decisions().values())})


def report() -> str:
    lines = ["| variant | ranks | k | training step (stage 2) | stage-3 work | autoencoder weights |",
             "| --- " * 6 + "|"]
    for r in clusterbench.latest(clusterbench.load(AUTOENCODER_RESULTS), "variant", "ranks", "k"):
        lines.append(f"| {r['variant']} | {r['ranks']} | {r['k']:,} | {r['train_ms']:.2f} ms "
                     f"[{r['train_range_ms'][0]:.2f}-{r['train_range_ms'][1]:.2f}] | {r['stage3_ms']:.2f} ms "
                     f"[{r['stage3_range_ms'][0]:.2f}-{r['stage3_range_ms'][1]:.2f}] | {r['weights']:,} |")
    lines += ["", "| hosts | rate | method | median step (stage 1 / 2 / 3) | bytes handed/step (1 / 2 / 3) | "
              "stage-3 steps | stage-3 error | fallbacks | to 90% | to 95% | final |", "| --- " * 11 + "|"]
    for r in clusterbench.latest(clusterbench.load(RESULTS), "hosts", "rate", "method"):
        stages = r["stages"]

        def per_stage(key: str, scale: float, fmt: str, stages: dict = stages) -> str:
            if "all" in stages:
                return format(stages["all"][key] * scale, fmt)
            return " / ".join(format(stages[s][key] * scale, fmt) if s in stages else "-" for s in ("1", "2", "3"))

        error = stages.get("3", {}).get("median_error")
        lines.append(f"| {r['hosts']} | {r['rate']} | {r['method']} | {per_stage('median_step_s', 1e3, '.1f')} ms | "
                     f"{per_stage('bytes_per_step', 1e-3, '.0f')} kB | {stages.get('3', {}).get('steps', 0)} | "
                     f"{'-' if error is None else f'{error:.2f}'} | {r['fallbacks']} | "
                     f"{clusterbench.reached(r, 0.9)} | {clusterbench.reached(r, 0.95)} | "
                     f"{r['final_accuracy'] * 100:.2f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["autoencoder", "cluster", "report"])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        cluster_worker()
    elif args.what == "autoencoder":
        autoencoder(args.repeats)
    elif args.what == "report":
        print(report())
    else:
        clusterbench.run_settings(__file__, ["cluster"], args.hosts, args.rates, timeout=3000, results=RESULTS)


if __name__ == "__main__":
    sys.exit(main())
