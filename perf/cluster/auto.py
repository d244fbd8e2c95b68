"""``compression: auto`` on the emulated cluster: its step time (by throughput) against the best single method chosen in
hindsight and against dense, per hosts, rate and workload. The targets: auto within 10% of the best, and at most 5%
slower than dense.

    .venv/bin/python perf/cluster/auto.py [--hosts 2 4] [--rates 100mbit 1gbit 10gbit] [--workloads synthetic digits]
    .venv/bin/python perf/cluster/auto.py --report          # the tables from perf/results/auto.jsonl
    .venv/bin/python perf/cluster/auto.py --report --before 2026-11-26T00:00    # an earlier launch's

One launch per (hosts, rate) runs, for each workload, in turn and on the same links: dense (``compression="none"``),
every candidate ``auto`` has by default (every registered method but those of ``hvdcomp.ACCURACY_GUARD``; PowerSGD with
``start_iter: 2``, in both), each alone at its defaults with ``collective: auto``, ``auto`` itself at its defaults, and
dense again (a control: what the same plan measures in another run of the same launch). Every run trains a fresh model
(the same initial weights) with the loop of ``hvdcomp train`` (zero_grad, forward, backward, step; SGD with momentum
0.9, or 0 for a method that applies momentum itself; 32 samples per rank), with denormal floats flushed to zero
(auto's model has trained through its tuning, and momentum decaying into denormals slows a step on x86:
perf/training/denormals.py). A method's timed steps come after its warm-up (5 steps, 1 for synthetic at 100 Mbit/s,
and PowerSGD's two dense steps), the first method's after a dense run of twice that; ``auto``'s after it settled. Each
step's time is its slowest rank's.

Digits runs are timed in ROUNDS rounds of 20 steps, every run in turn, each round in another order, each run in it
after one untimed step: millisecond steps drift between runs on the emulated links, and interleaving compares the runs
under the same drift. Synthetic runs (seconds-long steps) are timed one after another for about SYNTHETIC_S each, then
auto and the fastest contenders go on in rounds of 3 steps for about SYNTHETIC_CONTEST_S (:func:`contenders`,
:func:`synthetic_rounds`). A run's step time is its throughput: each round's mean step, the mean over the rounds
(``rounds_mean_s``); ``--report`` also prints the median over the rounds and the median step. ``auto``'s rows also give
the plan it settled on, the plans it raced (predicted and judged ms, rounds won against dense), every plan it ranked,
the dense step it measured and predicted, and the steps and seconds its tuning took (not in its step time: once per
job). The first table gives how sure auto / best is (``resampled``: the rounds drawn again with replacement).
Rows go to perf/results/auto.jsonl (``--results``: another file there).
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from typing import Any

import clusterbench

RESULTS = "auto.jsonl"
WORKLOADS = ("synthetic", "digits")
#: PowerSGD's warm-up shortened from 10 dense steps to 2, as in perf/cluster/cluster_training.py, for single runs and
#: auto alike
CANDIDATE_OPTIONS = {"powersgd": {"start_iter": 2}}
#: a bound on auto's tuning (its dense steps, then rounds of 4 plans of up to 2 + 25 steps while its 5 s budget lasts:
#: about 2,700 steps at 2 ms a step)
MAX_TUNING_STEPS = 10000
#: digits' runs are timed in turn, 20 steps each, this many times (with fewer, the ranking of methods within 1.6x of
#: each other changed from launch to launch)
ROUNDS = 60
#: a synthetic run is timed for about this many seconds, by one step's time (at least 3 steps at 100 Mbit/s, 6 on
#: faster links), up to SYNTHETIC_STEPS steps
SYNTHETIC_S = 12.0
SYNTHETIC_STEPS = 30
#: synthetic: after that first round, auto and the CONTENDERS fastest single plans within CONTENDER_BAND of the fastest
#: go on in turn, SYNTHETIC_BLOCK steps each, for as many rounds as take about SYNTHETIC_CONTEST_S seconds of timed
#: steps after the first round (by their first rounds' mean steps: :func:`synthetic_rounds`), SYNTHETIC_ROUNDS to
#: SYNTHETIC_MAX_ROUNDS rounds with the first (a second-long step drifts by 10% and more within a run)
SYNTHETIC_BLOCK = 3
SYNTHETIC_CONTEST_S = 180.0
SYNTHETIC_ROUNDS = 6
SYNTHETIC_MAX_ROUNDS = 48
CONTENDERS = 4
CONTENDER_BAND = 1.25
CONTROL = "dense again"
RESAMPLINGS = 2000  # draws of the rounds (resampled)
#: the figures a setting is judged by: row key -> what it is
FIGURES = {"rounds_mean_s": "throughput (each round's mean step, the mean over the rounds)",
           "mean_step_s": "each round's mean step, the median over the rounds (the figure up to launch AM)",
           "step_s": "the median step"}
#: how each figure over the rounds takes them (``resampled`` draws the rounds again and takes them so)
OVER_ROUNDS = {"rounds_mean_s": statistics.fmean, "mean_step_s": statistics.median}
BATCH = 32  # per rank


def worker(workloads: list[str], rate: str) -> None:
    import horovod.torch as hvd
    import torch
    from torch import nn

    import hvdcomp
    from hvdcomp.workloads import WORKLOADS as BUILT_IN

    hvd.init()
    torch.set_num_threads(1)
    # every run alike, however long its model trained: auto's trains through its tuning (thousands of steps), and
    # momentum that decays into denormal floats slows x86 arithmetic (perf/training/denormals.py: 1.10x after 8,000
    # steps)
    torch.set_flush_denormal(True)
    rank, size = hvd.rank(), hvd.size()
    candidates = {m: CANDIDATE_OPTIONS.get(m, {}) for m in hvdcomp.CompressionConfig.parse("auto").auto.methods()}
    loss_fn = nn.CrossEntropyLoss()

    def measure(workload: str) -> None:
        data = BUILT_IN[workload](0).data
        warmup = 1 if workload == "synthetic" and rate == "100mbit" else 5
        # digits: ROUNDS rounds of 20 steps, every run in turn (the same drift of the links for all); synthetic: a
        # first of at least this many steps (more for shorter steps: run_steps), then SYNTHETIC_BLOCK for contenders
        block = 20 if workload == "digits" else 3 if rate == "100mbit" else 6
        rounds = ROUNDS if workload == "digits" else 1  # synthetic: the first round sets the rest (synthetic_rounds)

        def step_once(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, data: Any = data) -> None:
            start = ((step * size + rank) * BATCH) % (len(data.train_x) - BATCH)
            optimizer.zero_grad()
            loss_fn(model(data.train_x[start:start + BATCH]), data.train_y[start:start + BATCH]).backward()
            optimizer.step()

        def timed(model: nn.Module, optimizer: torch.optim.Optimizer, first: int, label: str,
                  steps: int) -> list[float]:
            """Each step's slowest rank's seconds (a step ends on a rank when its optimizer.step() returns; the next
            begins there)."""
            hvd.allreduce(torch.zeros(1), name=f"{label}.barrier")
            times = []
            for step in range(first, first + steps):
                start = time.perf_counter()
                step_once(model, optimizer, step)
                times.append(time.perf_counter() - start)
            return hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name=f"{label}.time").tolist()

        def run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, first: int, label: str) -> int:
            """A synthetic run's timed steps: about SYNTHETIC_S seconds by one step's time (a probe, not counted; the
            slowest rank's: the same count on every rank), ``block`` at least, SYNTHETIC_STEPS at most."""
            (seconds,) = timed(model, optimizer, first, f"{label}.probe", 1)
            return max(block, min(SYNTHETIC_STEPS, math.ceil(SYNTHETIC_S / seconds)))

        def start(method: str) -> tuple[nn.Module, torch.optim.Optimizer, int, dict[str, Any]]:
            """A fresh model (the same initial parameters on every rank) and its optimizer, warmed up (auto: until
            it settled); the next step, and the row so far."""
            model = BUILT_IN[workload](0).model
            # a method that applies momentum itself (the sparsifiers' momentum correction) gets the optimizer's at 0,
            # as hvdcomp train gives it
            own = method in candidates and hvdcomp.make_compressor(method, candidates[method]).applies_momentum
            sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0 if own else 0.9)
            if method == "auto":
                compression: Any = {"method": "auto", "options": {"candidates": candidates}}
            elif method in ("dense", CONTROL):
                compression = "none"
            else:
                compression = {"method": method, "options": candidates[method]}
            optimizer = hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                     compression=compression)
            row: dict[str, Any] = {"workload": workload, "method": method, "ranks": size, "batch_size": BATCH}
            if method != "auto":
                first = warmup + 2 if method == "powersgd" else warmup
                for step in range(first):
                    step_once(model, optimizer, step)
                return model, optimizer, first, row
            began, steps = time.perf_counter(), 0
            while optimizer.auto_report()["phase"] != "settled":
                if steps == MAX_TUNING_STEPS:
                    raise RuntimeError(f"auto did not settle in {steps} steps: {optimizer.auto_report()}")
                step_once(model, optimizer, steps)
                steps += 1
            report = optimizer.auto_report()
            row.update(tuning_steps=steps, tuning_s=time.perf_counter() - began, label=report["label"],
                       plan={c["name"]: f"{c['method']}/{c['collective']}" for c in report["plan"]},
                       tried=report["tried"], predicted=report["predicted"], dense_ms=report["dense_ms"],
                       dense_predicted_ms=report["dense_predicted_ms"], measure_s=report["measure_s"],
                       race_s=report.get("race_s", 0.0), links=report["links"])
            return model, optimizer, steps, row

        # the job's first steps run slower (connections, Horovod's caches): a dense run, not reported, before the first
        model = BUILT_IN[workload](0).model
        optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                                 named_parameters=model.named_parameters())
        for step in range(2 * warmup):
            step_once(model, optimizer, step)
        del model, optimizer
        gc.collect()
        runs: dict[str, list[Any]] = {}
        times: dict[str, list[list[float]]] = {}  # per round
        first_means: dict[str, float] = {}  # synthetic: each run's first-round mean step

        def finish(method: str) -> None:
            """The run's row: its rounds, each round's step count, every step, and the step time by each figure."""
            row = runs.pop(method)[3]
            gc.collect()  # (synthetic: 25 M parameters and their method state per run; an optimizer's hooks and its
            # parameters refer to each other, and only a collection frees them)
            every = [t for steps_s in times[method] for t in steps_s]
            quartiles = statistics.quantiles(every, n=4)
            # each round's mean step, the median over the rounds (the throughput, their mean, is rounds_mean_s)
            row.update(steps=len(every), rounds=len(times[method]), round_steps=[len(t) for t in times[method]],
                       step_s=quartiles[1], step_p25_s=quartiles[0], step_p75_s=quartiles[2],
                       mean_step_s=statistics.median(map(statistics.fmean, times[method])),
                       steps_s=[round(t, 6) for t in every])
            if rank == 0:
                clusterbench.emit(row)

        methods = ["dense", *candidates, "auto", CONTROL]
        turn = 0
        while turn < rounds:
            # each round starting from another run (the order of the runs going on rotated), and from the second on
            # one untimed step per run first (the runs share collective names, which Horovod negotiates anew for each)
            going = [m for m in methods if not turn or m in runs]  # synthetic: the contenders after the first
            for method in going[turn % len(going):] + going[:turn % len(going)]:
                if method not in runs:
                    runs[method] = list(start(method))
                model, optimizer, first = runs[method][:3]
                if turn:
                    step_once(model, optimizer, first)
                    first += 1
                    steps = SYNTHETIC_BLOCK if workload == "synthetic" else block
                elif workload == "synthetic":
                    steps = run_steps(model, optimizer, first, f"{workload}.{method}")
                    first += 1
                else:
                    steps = block
                times.setdefault(method, []).append(timed(model, optimizer, first, f"{workload}.{method}.{turn}",
                                                          steps))
                runs[method][2] = first + steps
                del model, optimizer
                if workload == "synthetic" and not turn:
                    first_means[method] = statistics.fmean(times[method][0])
                    going_on = contenders(first_means)
                    for dropped in [m for m in runs if m not in going_on]:
                        finish(dropped)
            if workload == "synthetic" and not turn:
                rounds = synthetic_rounds([first_means[m] for m in runs])
            turn += 1
        for method in list(runs):
            finish(method)

    for workload in workloads:
        measure(workload)


def contenders(first: dict[str, float]) -> set[str]:
    """The synthetic runs timed again after their first round: auto, and the ``CONTENDERS`` fastest of the single
    plans (dense and each method; not the control) within ``CONTENDER_BAND`` of the fastest run so far (auto among
    them), by ``first`` (each run's first-round mean step, those timed so far). A plan left out timed over
    ``CONTENDER_BAND`` x the fastest, or no faster than ``CONTENDERS`` others that did not: its one round stands (a
    near-tie left out by the count is judged by its first round alone). Every rank decides the same: the times are the
    slowest rank's."""
    fastest = min(first.values())
    close = sorted((m for m, step in first.items() if m not in ("auto", CONTROL) and step <= CONTENDER_BAND * fastest),
                   key=first.__getitem__)
    return {"auto", *close[:CONTENDERS]}


def synthetic_rounds(first: list[float]) -> int:
    """The synthetic rounds in all, the first among them: those in which the runs going on after it (``first``: each
    one's first-round mean step) take about ``SYNTHETIC_CONTEST_S`` seconds of timed steps, ``SYNTHETIC_BLOCK`` each
    per round, from ``SYNTHETIC_ROUNDS`` to ``SYNTHETIC_MAX_ROUNDS``: fewer or faster contenders, more rounds. Every
    rank decides the same: the times are the slowest rank's."""
    later = math.ceil(SYNTHETIC_CONTEST_S / (SYNTHETIC_BLOCK * sum(first)))
    return 1 + max(SYNTHETIC_ROUNDS - 1, min(SYNTHETIC_MAX_ROUNDS - 1, later))


def round_means(row: dict[str, Any]) -> list[float]:
    """A run's mean step in each of its rounds (``steps_s`` holds them in turn: ``round_steps`` each where the row
    has it, else the same count each)."""
    steps = row["steps_s"]
    counts = row.get("round_steps")
    if counts is None:
        if len(steps) % row["rounds"]:
            raise ValueError(f"{row['method']}: {len(steps)} timed steps do not split into {row['rounds']} rounds")
        counts = [len(steps) // row["rounds"]] * row["rounds"]
    if sum(counts) != len(steps):
        raise ValueError(f"{row['method']}: {len(steps)} timed steps, but rounds of {counts}")
    means: list[float] = []
    start = 0
    for count in counts:
        means.append(statistics.fmean(steps[start:start + count]))
        start += count
    return means


def figure_of(row: dict[str, Any], figure: str) -> float | None:
    """A run's step time by ``figure`` (a key of FIGURES), or None where its row lacks it (older launches' rows:
    without ``mean_step_s``, or without the steps the mean over the rounds is taken from)."""
    if figure == "rounds_mean_s":
        return statistics.fmean(round_means(row)) if "steps_s" in row else None
    return row.get(figure)


def resampled(methods: dict[str, dict[str, Any]], figure: str,
              draws: int = RESAMPLINGS) -> tuple[float, float, float]:
    """How sure auto / best (by ``figure``, one of OVER_ROUNDS) is, where the runs were timed in interleaved rounds:
    the rounds are drawn again with replacement (the same rounds for every run: a round's runs share its drift), each
    run's step time taken over them by the figure, and auto's ratio to the best single method of that draw computed,
    ``draws`` times (a fixed seed).
    ``methods``: the runs timed in every round (on synthetic, the contenders that went on after the first round: the
    others ran 1.25x the fastest or slower in it). Returns the 5th and 95th percentiles of the ratio and the share of
    draws within 10% of the best. (The best of ten noisy runs reads faster than its method is: the draws carry that
    bias too.)"""
    means = {m: round_means(r) for m, r in methods.items()}
    over = OVER_ROUNDS[figure]
    count = len(means["auto"])
    single = [m for m in methods if m not in ("auto", CONTROL)]
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        picked = [rng.randrange(count) for _ in range(count)]
        step = {m: over([means[m][i] for i in picked]) for m in ["auto", *single]}
        ratios.append(step["auto"] / min(step[m] for m in single))
    low, *_, high = statistics.quantiles(ratios, n=20)
    return low, high, sum(ratio <= 1.10 for ratio in ratios) / draws


def summarize(rows: list[dict[str, Any]], figure: str) -> list[dict[str, Any]]:
    """Per (hosts, rate, workload) whose runs all have ``figure`` (a key of FIGURES; :func:`figure_of`): auto, dense,
    the best single method in hindsight by it (dense among them), and auto's ratios to them, the control's to dense,
    auto's to its plan run alone, and that run's to the best (nan where it was not run: a per-tensor mix); auto's
    quartiles and round means; by a figure over interleaved rounds, :func:`resampled` (else None)."""
    settings: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in rows:
        settings.setdefault((row["hosts"], row["rate_bps"], row["rate"], row["workload"]), {})[row["method"]] = row
    result = []
    for (hosts, _, rate, workload), methods in sorted(settings.items()):
        step = {m: figure_of(r, figure) for m, r in methods.items()}
        if "auto" not in methods or "dense" not in methods or None in step.values():
            continue
        auto = methods["auto"]
        single = [m for m in methods if m not in ("auto", CONTROL)]
        best = min(single, key=step.__getitem__)
        alone = step.get(auto["label"], math.nan)  # a per-tensor mix was not run alone
        timed = {m: r for m, r in methods.items()  # over the rounds: the runs timed in every round
                 if figure in OVER_ROUNDS and auto.get("rounds", 1) > 1 and r.get("rounds") == auto["rounds"]
                 and "steps_s" in r}
        result.append({"hosts": hosts, "rate": rate, "workload": workload, "auto_s": step["auto"],
                       "dense_s": step["dense"], "best": best, "best_s": step[best],
                       "auto_vs_best": step["auto"] / step[best], "auto_vs_dense": step["auto"] / step["dense"],
                       "control_vs_dense": step.get(CONTROL, math.nan) / step["dense"],
                       "auto_vs_alone": step["auto"] / alone, "alone_vs_best": alone / step[best],
                       "quartiles": (auto["step_p25_s"], auto["step_p75_s"]),
                       "round_means": round_means(auto) if "steps_s" in auto else [],
                       "resampled": resampled(timed, figure) if {"auto", best} <= timed.keys() else None,
                       "label": auto["label"], "plan": auto["plan"], "tried": auto["tried"],
                       "tuning_steps": auto["tuning_steps"], "tuning_s": auto["tuning_s"]})
    return result


def ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def plan_text(r: dict[str, Any]) -> str:
    """The plan auto kept: its label and the methods/collectives in it."""
    methods = sorted(set(r["plan"].values()) - {"none/allreduce"}) or ["dense"]
    return f"{r['label']}: {', '.join(methods)}"


def tried_text(r: dict[str, Any]) -> str:
    """The plans auto raced: predicted ms -> judged ms, rounds won against dense. Rows of launches before the race
    (up to 2026-11-26) give each plan's first measurement instead."""
    def one(t: dict[str, Any]) -> str:
        if "rounds_ms" not in t:
            return f"{t['label']}: {ms(t['predicted_ms'])} -> {ms(t['measured_ms'])}" + (" kept" if t["kept"] else "")
        won = "" if t["rounds_won"] is None else f", won {t['rounds_won']} of {len(t['rounds_ms'])}"
        return f"{t['label']}: {ms(t['predicted_ms'])} -> {ms(t['judged_ms'])}{won}" + (" kept" if t["kept"] else "")

    return "; ".join(one(t) for t in r["tried"]) or "none tried"


def totals(table: list[dict[str, Any]], figure: str) -> None:
    """The targets' counts over ``table``, by ``figure``."""
    within = sum(r["auto_vs_best"] <= 1.10 for r in table)
    print(f"\nby {FIGURES[figure]}: auto within 10% of the best in hindsight in {within} of {len(table)} settings "
          f"(worst {max(r['auto_vs_best'] for r in table):.2f}x, median "
          f"{statistics.median(r['auto_vs_best'] for r in table):.2f}); at most "
          f"{max(r['auto_vs_dense'] for r in table):.2f}x dense's step time")
    for key, what in (("control_vs_dense", "dense again / dense (the same plan in another run of the launch)"),
                      ("auto_vs_alone", "auto / its plan run alone (where it kept dense or one method)"),
                      ("alone_vs_best", "its plan run alone / the best")):
        ratios = [r[key] for r in table if not math.isnan(r[key])]
        if ratios:
            print(f"{what}: {min(ratios):.2f} to {max(ratios):.2f} in {len(ratios)} settings, median "
                  f"{statistics.median(ratios):.2f}")


def report(rows: list[dict[str, Any]]) -> None:
    """A table by throughput (the figure that judges the targets), with auto's plan and what it tried, then shorter
    ones by the other figures; each with its targets' counts. Older launches' rows lack some figures."""
    table = summarize(rows, "rounds_mean_s")
    if table:
        print(f"By {FIGURES['rounds_mean_s']}:\n")
        print("| hosts | rate | workload | dense ms | best single (ms) | auto ms (rounds' range) | auto / best "
              "| rounds resampled: auto / best, 90%; share within 10% | auto / dense | dense again / dense "
              "| auto's plan | tried: predicted -> measured ms | tuning |")
        print("| --- " * 13 + "|")
        for r in table:
            means = r["round_means"]
            spread = f" ({min(means) * 1e3:.1f}-{max(means) * 1e3:.1f})" if len(means) > 1 else ""
            print(f"| {r['hosts']} | {r['rate']} | {r['workload']} | {r['dense_s'] * 1e3:.1f} | {r['best']} "
                  f"({r['best_s'] * 1e3:.1f}) | {r['auto_s'] * 1e3:.1f}{spread} | {r['auto_vs_best']:.2f} | "
                  + ("{:.2f}-{:.2f}; {:.0%}".format(*r["resampled"]) if r["resampled"] else "-") + " | "
                  f"{r['auto_vs_dense']:.2f} | {r['control_vs_dense']:.2f} | {plan_text(r)} | "
                  f"{tried_text(r)} | {r['tuning_steps']} steps, {r['tuning_s']:.1f} s |")
        totals(table, "rounds_mean_s")
    above = {(r["hosts"], r["rate"], r["workload"]) for r in table}
    for figure in ("mean_step_s", "step_s"):
        by_figure = summarize(rows, figure)
        if not by_figure:
            continue
        print(f"\nBy {FIGURES[figure]} (each step the slowest rank's):\n")
        print("| hosts | rate | workload | dense ms | best single (ms) | auto ms (its steps' quartiles) | auto / best "
              "| auto / dense | dense again / dense | auto's plan, tried, tuning (where not above) |")
        print("| --- " * 10 + "|")
        for r in by_figure:
            low, high = (x * 1e3 for x in r["quartiles"])
            detail = "" if (r["hosts"], r["rate"], r["workload"]) in above else (
                f"{plan_text(r)}; {tried_text(r)}; {r['tuning_steps']} steps, {r['tuning_s']:.1f} s")
            print(f"| {r['hosts']} | {r['rate']} | {r['workload']} | {r['dense_s'] * 1e3:.1f} | {r['best']} "
                  f"({r['best_s'] * 1e3:.1f}) | {r['auto_s'] * 1e3:.1f} ({low:.1f}-{high:.1f}) | "
                  f"{r['auto_vs_best']:.2f} | {r['auto_vs_dense']:.2f} | {r['control_vs_dense']:.2f} | {detail} |")
        totals(by_figure, figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=list(clusterbench.HOSTS))
    parser.add_argument("--rates", nargs="+", default=list(clusterbench.RATES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--controller", choices=["mpi", "gloo"], default="mpi", help="Horovod's controller")
    parser.add_argument("--results", default=RESULTS, help=f"the rows' file in perf/results (default {RESULTS}; "
                        "auto_checks.jsonl: spot checks beside the launches)")
    parser.add_argument("--report", action="store_true", help="only print the tables of the latest rows")
    parser.add_argument("--before", metavar="TIME", help="the tables of the latest rows measured before TIME (ISO, "
                        "as the rows' time: 2026-11-24T09:10), an earlier launch's")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        rate, *workloads = args.worker
        worker(workloads, rate)
        return
    if not args.report:
        for rate in args.rates:
            clusterbench.run_settings(__file__, [rate, *args.workloads], args.hosts, [rate], timeout=3000,
                                      results=args.results, controller=args.controller)
    rows = [r for r in clusterbench.load(args.results) if args.before is None or r["time"] < args.before]
    report(clusterbench.latest(rows, "controller", "hosts", "rate", "workload", "method"))


if __name__ == "__main__":
    sys.exit(main())
