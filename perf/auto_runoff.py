"""``compression: auto``'s runoff against steady-state timing in one job, on the emulated cluster: does auto measure
two plans as a benchmark that runs them for longer does? (Launches Y and AB of perf/auto.py kept fp16 on 2 hosts at
10 Gbit/s, digits, where fp16 alone then ran 1.10x and 1.18x dense's step by throughput, and auto 1.22x and 1.14x.)

    .venv/bin/python perf/auto_runoff.py [--hosts 2] [--rates 10gbit]

One job per (hosts, rate), digits, 32 samples per rank, SGD with momentum 0.9 (as perf/auto.py), in turn:

1. ``auto`` with fp16 its only candidate and a runoff of 8 rounds forced (``runoff: 8``, both bands wide,
   ``runoff_s: 0``: the two fastest plans tried and dense, and no final; the plans ranked may include a per-tensor
   mix of fp16 and dense, and the report names what ran off), tuned 3 times (``retune()``); each tuning's plans run
   off, their judged steps and rounds won, and the plan kept.
2. The same optimizer, settled, switched between fp16 as auto applies it (``Tuner._apply``, the plan auto ranked) and
   dense (its base config) in ROUNDS rounds, the order drawn each round, each plan 2 steps to settle and then 50
   steps timed by auto's own measure (``hvdcomp.auto.step_ms`` of the intervals between step ends, the slowest
   rank's) and by perf/auto.py's (each step's slowest rank's time: their mean; and their ``step_ms``).
3. Separate models, one dense and one fp16 (``compression="fp16"``), interleaved the same way, each round as
   perf/auto.py times its runs after its first (one untimed step, a barrier, then each step's slowest rank's time),
   by the same three figures.
4. ``auto`` with every default candidate and perf/auto.py's options, tuned 4 times: the plan kept (and the final's
   rounds won, where there was a final).

Rows go to perf/results/auto_runoff.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from typing import Any

import clusterbench
from auto import AUTO, BATCH, CANDIDATE_OPTIONS

RESULTS = "auto_runoff.jsonl"
ROUNDS = 20
FORCED = {"candidates": {"fp16": {}}, "runoff": 8, "runoff_s": 0, "runoff_band": 1.0, "dense_band": 1.0}


def worker() -> None:
    import horovod.torch as hvd
    import torch
    from torch import nn

    import hvdcomp
    from hvdcomp.auto import MAX_GUARD_STEPS, step_ms
    from hvdcomp.tools.workloads import WORKLOADS

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    data = WORKLOADS["digits"](0).data
    loss_fn = nn.CrossEntropyLoss()
    taken = [0]  # steps so far (each takes the next batch)

    def step_once(model: nn.Module, optimizer: Any) -> None:
        start = ((taken[0] * size + rank) * BATCH) % (len(data.train_x) - BATCH)
        taken[0] += 1
        optimizer.zero_grad()
        loss_fn(model(data.train_x[start:start + BATCH]), data.train_y[start:start + BATCH]).backward()
        optimizer.step()

    def make(compression: Any) -> tuple[nn.Module, Any]:
        model = WORKLOADS["digits"](0).model
        return model, hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                                   named_parameters=model.named_parameters(), compression=compression)

    def slowest(value: float, name: str) -> float:
        return hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max, name=name).item()

    def timed(model: nn.Module, optimizer: Any, label: str) -> dict[str, float]:
        """MAX_GUARD_STEPS steps (as auto's guard measures a millisecond step): auto's measure (step_ms of the
        intervals between step ends, the slowest rank's) and perf/auto.py's (each step's slowest rank's time: their
        mean, and their step_ms)."""
        ends, took = [time.perf_counter()], []
        for _ in range(MAX_GUARD_STEPS):
            began = time.perf_counter()
            step_once(model, optimizer)
            ends.append(time.perf_counter())
            took.append(ends[-1] - began)
        intervals = [b - a for a, b in itertools.pairwise(ends)]
        steps = hvd.allreduce(torch.tensor(took, dtype=torch.float64), op=hvd.Max, name=f"{label}.steps").tolist()
        return {"auto_ms": slowest(step_ms(intervals), f"{label}.auto"), "mean_ms": 1e3 * statistics.fmean(steps),
                "trimmed_ms": step_ms(steps)}

    def tunings(model: nn.Module, optimizer: Any, count: int) -> list[dict[str, Any]]:
        found = []
        for tuning in range(count):
            if tuning:
                optimizer.retune()
            while optimizer.auto_report()["phase"] != "settled":
                step_once(model, optimizer)
            report = optimizer.auto_report()
            found.append({"label": report["label"], "dense_ms": report["dense_ms"], "tried": report["tried"]})
        return found

    warm, optimizer = make("none")  # the job's first steps run slower
    for _ in range(10):
        step_once(warm, optimizer)
    del warm, optimizer
    draw = random.Random(0)
    model, optimizer = make({"method": "auto", "options": {**AUTO, **FORCED}})
    row: dict[str, Any] = {"forced": tunings(model, optimizer, 3)}
    # fp16 applied exactly as auto applies it, dense as auto goes back to it (private: this is what is measured; the
    # settled tuner's report then says "guard", which nothing reads here)
    tuner = optimizer._auto
    switched: dict[str, list[dict[str, float]]] = {"dense": [], "fp16": []}
    for turn in range(ROUNDS):
        for label in draw.sample(sorted(switched), 2):
            if label == "fp16":
                tuner._apply(optimizer, tuner.by_label["fp16"])
            else:
                optimizer._replan(tuner.base)
            for _ in range(2):
                step_once(model, optimizer)
            switched[label].append(timed(model, optimizer, f"switched.{label}.{turn}"))
    row["switched"] = switched
    del model, optimizer, tuner
    runs = {"dense": make("none"), "fp16": make("fp16")}
    for model, optimizer in runs.values():
        for _ in range(5):
            step_once(model, optimizer)
    separate: dict[str, list[dict[str, float]]] = {"dense": [], "fp16": []}
    for turn in range(ROUNDS):
        for label in draw.sample(sorted(runs), 2):
            model, optimizer = runs[label]
            step_once(model, optimizer)
            hvd.allreduce(torch.zeros(1), name=f"separate.{label}.{turn}.barrier")
            separate[label].append(timed(model, optimizer, f"separate.{label}.{turn}"))
    row["separate"] = separate
    del runs, model, optimizer
    candidates = {m: CANDIDATE_OPTIONS.get(m, {}) for m in hvdcomp.CompressionConfig.parse("auto").auto.methods()}
    model, optimizer = make({"method": "auto", "options": {**AUTO, "candidates": candidates}})
    row["default"] = tunings(model, optimizer, 4)
    if rank == 0:
        clusterbench.emit(row)


def report(row: dict[str, Any]) -> None:
    print(f"{row['hosts']} hosts at {row['rate']}, digits, {row['time']}:")
    for part in ("forced", "default"):
        for tuning in row[part]:
            ran_off = {t["label"]: t for t in tuning["tried"] if "runoff_ms" in t}
            text = "; ".join(f"{label} judged {t['judged_ms']:.2f} ms"
                             + (f", won {t['rounds_won']} of {len(t['runoff_ms'])}" if "rounds_won" in t else "")
                             for label, t in ran_off.items())
            text += "".join(f"; in the final {t['label']} won {t['final_won']} of {len(t['final_ms'])}"
                            for t in tuning["tried"] if "final_won" in t)
            print(f"  auto ({part} candidates): kept {tuning['label']}; runoff: {text}")
    for part in ("switched", "separate"):
        for measure in ("auto_ms", "trimmed_ms", "mean_ms"):
            dense, fp16 = ([r[measure] for r in row[part][label]] for label in ("dense", "fp16"))
            faster = sum(f < d for f, d in zip(fp16, dense, strict=True))
            print(f"  {part}, {measure}: medians of {len(dense)} rounds dense {statistics.median(dense):.2f} ms, fp16 "
                  f"{statistics.median(fp16):.2f} ms ({statistics.median(fp16) / statistics.median(dense):.2f}x); "
                  f"fp16 faster in {faster}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[2])
    parser.add_argument("--rates", nargs="+", default=["10gbit"])
    parser.add_argument("--report", action="store_true", help="only print the latest rows")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    if not args.report:
        clusterbench.run_settings(__file__, [], args.hosts, args.rates, timeout=1200, results=RESULTS)
    for row in clusterbench.latest(clusterbench.load(RESULTS), "hosts", "rate"):
        report(row)


if __name__ == "__main__":
    sys.exit(main())
