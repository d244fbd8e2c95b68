"""A model trained longer runs slower on a CPU: its momentum decays into denormal floats. Two digits models, dense
(``compression="none"``), SGD with momentum 0.9, one trained ``--steps`` steps more than the other, timed in turn
(30 rounds of 20 steps each, the order alternated; a step's time is its slowest rank's), with and without
``torch.set_flush_denormal(True)``.

    launch/mpirun.sh -np 2 .venv/bin/python perf/training/denormals.py --steps 8000
    launch/mpirun.sh -np 2 .venv/bin/python perf/training/denormals.py --steps 8000 --flush

Why it matters: ``compression: auto`` trains while it tunes (thousands of steps at millisecond steps), so in
perf/cluster/auto.py auto's model is that much older than the fresh model of each method it is compared with. A weight
whose gradient stays 0 (a dead ReLU unit) keeps a momentum buffer that shrinks by 0.9 a step, through the denormal
range (below 1.2e-38), where x86 arithmetic takes a slow path. Rank 0 prints one JSON line: the old model's step
over the young one's (the median over the rounds of the ratio of their round means; rounds it was slower in) and
each model's momentum entries that are denormal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.torch as hvd
import torch
from torch import nn

import hvdcomp
from hvdcomp.workloads import WORKLOADS

ROUNDS = 30
BLOCK = 20


def denormal_entries(optimizer: torch.optim.Optimizer) -> int:
    tiny = torch.finfo(torch.float32).tiny
    return sum(int(((b != 0) & (b.abs() < tiny)).sum()) for b in
               (state.get("momentum_buffer") for state in optimizer.state.values()) if b is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8000, help="the steps the old model trains more")
    parser.add_argument("--flush", action="store_true", help="torch.set_flush_denormal(True)")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.set_flush_denormal(args.flush)
    rank, size = hvd.rank(), hvd.size()
    data = WORKLOADS["digits"](0).data
    loss_fn = nn.CrossEntropyLoss()

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = WORKLOADS["digits"](0).model
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression="none")

    def step(run: tuple[nn.Module, torch.optim.Optimizer], k: int) -> None:
        model, optimizer = run
        start = ((k * size + rank) * 32) % (len(data.train_x) - 32)
        optimizer.zero_grad()
        loss_fn(model(data.train_x[start:start + 32]), data.train_y[start:start + 32]).backward()
        optimizer.step()

    runs = {"old": make(), "young": make()}
    for k in range(args.steps):
        step(runs["old"], k)
    for k in range(10):
        step(runs["young"], k)
    ratios = []
    k = args.steps
    for turn in range(ROUNDS):
        means = {}
        for name in ("old", "young") if turn % 2 == 0 else ("young", "old"):
            hvd.allreduce(torch.zeros(1), name=f"denormals.{name}.barrier")
            times = []
            for _ in range(BLOCK):
                began = time.perf_counter()
                step(runs[name], k)
                times.append(time.perf_counter() - began)
                k += 1
            slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name=f"denormals.{name}")
            means[name] = statistics.fmean(slowest.tolist())
        ratios.append(means["old"] / means["young"])
    if rank == 0:
        print(json.dumps({"steps": args.steps, "flush_denormal": args.flush,
                          "old_vs_young": round(statistics.median(ratios), 4),
                          "old_slower_rounds": sum(r > 1 for r in ratios), "rounds": ROUNDS,
                          "denormal_momentum": {name: denormal_entries(run[1]) for name, run in runs.items()}}),
              flush=True)


if __name__ == "__main__":
    main()
