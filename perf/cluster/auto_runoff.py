"""``compression: auto``'s runoff against steady-state timing in one job, on the emulated cluster: does auto measure
two plans as a benchmark that runs them for longer does? (Launches Y and AB of perf/cluster/auto.py kept fp16 on 2 hosts
at 10 Gbit/s, digits, where fp16 alone then ran 1.10x and 1.18x dense's step by throughput, and auto 1.22x and 1.14x;
launches AB and AC kept terngrad on 2 hosts at 100 Mbit/s, where onebit alone ran 0.88x and 0.81x terngrad's step.)

    .venv/bin/python perf/cluster/auto_runoff.py [--hosts 2] [--rates 10gbit] [--plans fp16 dense]
    .venv/bin/python perf/cluster/auto_runoff.py --rates 100mbit --plans onebit terngrad

Two plans, A and B (``--plans``: each a method alone, with perf/cluster/auto.py's options, or dense). One job per
(hosts, rate), digits, 32 samples per rank, SGD with momentum 0.9 (as perf/cluster/auto.py), in turn:

1. ``auto`` with A's and B's methods its only candidates and a runoff of 8 rounds forced (``runoff: 8``, both bands
   wide, ``runoff_s: 0``: the two fastest plans tried, and dense if it measured within 2x of the fastest, and no
   final; the plans ranked may include a per-tensor mix, which may run off in A's or B's place, and the report
   names what ran off), tuned 3 times (``retune()``); each tuning's plans run off,
   their judged steps and rounds won, and the plan kept.
2. The same optimizer, settled, switched between A and B as auto applies them (``Tuner._apply``, the plans auto
   ranked; dense: its base config) in ROUNDS rounds, the order drawn each round, each plan 2 steps to settle and then
   50 steps timed by auto's own measure (``hvdcomp.auto.step_ms`` of the intervals between step ends, the slowest
   rank's) and by perf/cluster/auto.py's (each step's slowest rank's time: their mean; and their ``step_ms``).
3. Separate models, one for A and one for B (as perf/cluster/auto.py runs each method alone), interleaved the same way,
   each round as perf/cluster/auto.py times its runs after its first (one untimed step, a barrier, then each step's
   slowest rank's time), by the same three figures.
4. ``auto`` with every default candidate and perf/cluster/auto.py's options, tuned 4 times: the plan kept (and the
   final's rounds won, where there was a final).

Rows go to perf/results/auto_runoff.jsonl (``plans``: A and B; rows without it ran fp16 and dense).
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
#: auto's options in part 1 but the candidates: a runoff of 8 rounds, forced
FORCED = {"runoff": 8, "runoff_s": 0, "runoff_band": 1.0, "dense_band": 1.0}
PLANS = ("fp16", "dense")  # the rows without "plans"


def worker(plans: list[str]) -> None:
    import horovod.torch as hvd
    import torch
    from torch import nn

    import hvdcomp
    from hvdcomp.auto import MAX_GUARD_STEPS, step_ms
    from hvdcomp.tools.workloads import WORKLOADS

    hvd.init()
    torch.set_num_threads(1)
    # every run alike, however long its model trained: auto's trains through its tuning (thousands of steps), and
    # momentum that decays into denormal floats slows x86 arithmetic (perf/training/denormals.py: 1.10x after 8,000
    # steps)
    torch.set_flush_denormal(True)
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
        intervals between step ends, the slowest rank's) and perf/cluster/auto.py's (each step's slowest rank's time:
        their mean, and their step_ms)."""
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
    methods = {m: CANDIDATE_OPTIONS.get(m, {}) for m in plans if m != "dense"}
    model, optimizer = make({"method": "auto", "options": {**AUTO, **FORCED, "candidates": methods}})
    row: dict[str, Any] = {"plans": plans, "forced": tunings(model, optimizer, 3)}
    # each plan applied exactly as auto applies it, dense as auto goes back to it (private: this is what is measured;
    # the settled tuner's report then says "guard", which nothing reads here)
    tuner = optimizer._auto
    for label in plans:
        if label != "dense" and label not in tuner.by_label:
            raise RuntimeError(f"auto did not rank {label} alone in this job (left out: "
                               f"{tuner.report.get('excluded', {}).get(label, 'not a candidate')})")
    switched: dict[str, list[dict[str, float]]] = {label: [] for label in plans}
    for turn in range(ROUNDS):
        for label in draw.sample(sorted(plans), 2):
            if label == "dense":
                optimizer._replan(tuner.base)
            else:
                tuner._apply(optimizer, tuner.by_label[label])
            for _ in range(2):
                step_once(model, optimizer)
            switched[label].append(timed(model, optimizer, f"switched.{label}.{turn}"))
    row["switched"] = switched
    del model, optimizer, tuner
    runs = {label: make("none" if label == "dense" else {"method": label, "options": methods[label]})
            for label in plans}
    for model, optimizer in runs.values():
        for _ in range(5):
            step_once(model, optimizer)
    separate: dict[str, list[dict[str, float]]] = {label: [] for label in plans}
    for turn in range(ROUNDS):
        for label in draw.sample(sorted(plans), 2):
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
    a, b = row.get("plans", PLANS)
    print(f"{row['hosts']} hosts at {row['rate']}, digits, {a} against {b}, {row['time']}:")
    for part in ("forced", "default"):
        for tuning in row[part]:
            ran_off = {t["label"]: t for t in tuning["tried"] if "runoff_ms" in t}
            text = "; ".join(f"{label} judged {t['judged_ms']:.2f} ms"
                             + (f", won {t['rounds_won']} of {len(t['runoff_ms'])}" if "rounds_won" in t else "")
                             for label, t in ran_off.items())
            text += "".join(f"; in the final {t['label']}"  # (judged: in the report from b587d4c on)
                            + (f" judged {t['final_judged_ms']:.2f} ms" if "final_judged_ms" in t else "")
                            + (f", won {t['final_won']} of {len(t['final_ms'])}" if "final_won" in t else "")
                            for t in tuning["tried"] if "final_ms" in t)
            print(f"  auto ({part} candidates): kept {tuning['label']}; runoff: {text}")
    for part in ("switched", "separate"):
        for measure in ("auto_ms", "trimmed_ms", "mean_ms"):
            mine, theirs = ([r[measure] for r in row[part][label]] for label in (a, b))
            faster = sum(x < y for x, y in zip(mine, theirs, strict=True))
            print(f"  {part}, {measure}: medians of {len(mine)} rounds {b} {statistics.median(theirs):.2f} ms, {a} "
                  f"{statistics.median(mine):.2f} ms ({statistics.median(mine) / statistics.median(theirs):.2f}x); "
                  f"{a} faster in {faster}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[2])
    parser.add_argument("--rates", nargs="+", default=["10gbit"])
    parser.add_argument("--plans", nargs=2, default=list(PLANS), metavar=("A", "B"),
                        help="the two plans: method names (perf/cluster/auto.py's candidates) or dense")
    parser.add_argument("--report", action="store_true", help="only print the latest rows")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    import hvdcomp

    valid = {"dense", *hvdcomp.CompressionConfig.parse("auto").auto.methods()}  # auto's default candidates
    if len(set(args.plans)) != 2 or not set(args.plans) <= valid:
        parser.error(f"--plans: two different plans of {', '.join(sorted(valid))}; got {' '.join(args.plans)}")
    if not args.report:
        clusterbench.run_settings(__file__, args.plans, args.hosts, args.rates, timeout=1200, results=RESULTS)
    rows = [{**row, "plans": tuple(row.get("plans", PLANS))} for row in clusterbench.load(RESULTS)]
    for row in clusterbench.latest(rows, "hosts", "rate", "plans"):
        report(row)


if __name__ == "__main__":
    sys.exit(main())
