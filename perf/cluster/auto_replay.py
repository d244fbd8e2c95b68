"""``compression: auto``'s choice replayed on the digits launches' interleaved rounds (perf/results/auto.jsonl): how
often the guard's rules keep a plan within 10% of the best and at most 5% slower than dense, and how often the
benchmark itself (perf/cluster/auto.py) can tell, where even a chooser that knew each plan's true step (the oracle) is
judged by noisy figures.

    .venv/bin/python perf/cluster/auto_replay.py                 # every digits launch timed in 30 interleaved rounds
    .venv/bin/python perf/cluster/auto_replay.py --draws 400 --rounds 30 60 120

The model, per setting of a launch (hosts, rate): each run's mean step in each round k (perf/cluster/auto.py: every run
20 steps in turn, 30 rounds from launch AA to AJ) is m[p, k] = exp(c + a[p] + b[k] + e[p, k]), fitted by median polish:
a[p] the plan's level (its true step: exp(c + a[p])), b[k] the round's drift, shared by the plans measured in it,
e[p, k] what is left, kept per plan. A measurement of plan p in a round with drift b is exp(c + a[p] + b + e), b drawn
from the setting's drifts and e from p's own rests. So a measurement scatters as a round mean of 20 steps does, where
the guard's holds 5 to 50 steps (more than 20 for steps under 12.5 ms, fewer above: dense at 100 Mbit/s); and a plan
runs alike switched in auto's optimizer and alone, which perf/cluster/auto_runoff.py found not always so (docs/auto.md).
Checked against the launches: dense measured twice so, in as many rounds, against each launch's dense again / dense.

The guard, replayed with hvdcomp.auto's own functions: the plans the launch's auto measured alone (the methods and
dense; per-tensor mixes were not run alone, and are left out) are measured once each, in a round of its own; then
:func:`hvdcomp.auto.wide_runoff` (or :func:`~hvdcomp.auto.runoff_plans`) in rounds that share a drift,
:func:`~hvdcomp.auto.final_plans` in :func:`~hvdcomp.auto.runoff_rounds`' rounds, and
:func:`~hvdcomp.auto.kept_plan`; a measurement's steps are the tuner's (2 to settle and the guard's, at the plan's
predicted step in that launch), so the rounds fit in ``runoff_s`` as they would. Each variant sets only the rule
against dense (:func:`hvdcomp.auto.clear_win`, or a share of the rounds), ``runoff_s`` and MAX_RUNOFF_ROUNDS. Then
the benchmark: every plan and the plan kept timed in ``--rounds`` interleaved rounds, each figure the median of its
round means; the setting passes where the plan kept's figure is within 10% of the best figure, and at most 5% above
dense's. Every variant replays the same draws (each setting's draw d from its own seeds), so that variants differ by
their rules, not their luck; each figure against the first variant's comes with the standard error of the paired
differences. Rows go to perf/results/auto_replay.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable
from typing import Any

import auto as bench
import clusterbench

from hvdcomp import auto

REPLAYS = "auto_replay.jsonl"
#: the settings' order in a launch of perf/cluster/auto.py: each rate in turn, on 2 hosts then 4
ORDER = [(hosts, rate) for rate in clusterbench.RATES for hosts in clusterbench.HOSTS]


def three_quarters(won: int, rounds: int) -> bool:
    """The rule against dense up to launch AJ: more than three quarters of the rounds won."""
    return won > 0.75 * rounds


#: name -> (the rule against dense, runoff_s, MAX_RUNOFF_ROUNDS); None: the oracle. The first is the baseline.
VARIANTS: dict[str, tuple[Callable[[int, int], bool], float, int] | None] = {
    "as up to AJ: three quarters, runoff_s 10, 8 rounds": (three_quarters, 10.0, 8),
    "oracle": None,
    "sign test, runoff_s 10, 8 rounds": (auto.clear_win, 10.0, 8),
    "three quarters, runoff_s 30, 24 rounds": (three_quarters, 30.0, 24),
    "from AK on: sign test, runoff_s 30, 24 rounds": (auto.clear_win, auto.AutoSettings.runoff_s,
                                                      auto.MAX_RUNOFF_ROUNDS),
}


class Setting:
    """One launch's digits setting: each plan's level, the rounds' drifts and each plan's rests (the docstring)."""

    def __init__(self, runs: dict[str, dict[str, Any]]) -> None:
        means = {m: [math.log(x * 1e3) for x in bench.round_means(r)] for m, r in runs.items()
                 if m not in ("auto", bench.CONTROL)}
        rounds = range(len(means["dense"]))
        self.level = {p: statistics.median(v) for p, v in means.items()}
        for _ in range(10):  # median polish
            self.drifts = [statistics.median(v[k] - self.level[p] for p, v in means.items()) for k in rounds]
            self.level = {p: statistics.median(v[k] - self.drifts[k] for k in rounds) for p, v in means.items()}
        self.rests = {p: [v[k] - self.level[p] - self.drifts[k] for k in rounds] for p, v in means.items()}
        middle = statistics.median(self.drifts)  # the overall level: the drifts' middle round
        self.level = {p: a + middle for p, a in self.level.items()}
        self.drifts = [b - middle for b in self.drifts]
        self.true = {p: math.exp(a) for p, a in self.level.items()}  # ms
        tuned = runs["auto"]
        self.measured = [t["label"] for t in tuned["tried"] if t["label"] in means and t["label"] != "dense"]
        self.predicted = {p: tuned["predicted"].get(p, self.true[p]) for p in means}

    def measure(self, plan: str, drift: float, rng: random.Random) -> float:
        return math.exp(self.level[plan] + drift + rng.choice(self.rests[plan]))

    def benchmark(self, kept: str, rounds: int, rng: random.Random) -> tuple[float, float, float]:
        """The plan kept's figure, the best single plan's and dense's, timed in ``rounds`` interleaved rounds."""
        drifts = [rng.choice(self.drifts) for _ in range(rounds)]
        figures = {p: statistics.median(self.measure(p, d, rng) for d in drifts) for p in self.true}
        return statistics.median(self.measure(kept, d, rng) for d in drifts), min(figures.values()), figures["dense"]


def guard(setting: Setting, runoff_s: float, rng: random.Random) -> tuple[str, float]:
    """The plan the guard keeps on measurements drawn from ``setting`` (module docstring), by hvdcomp.auto's rules as
    they stand (a variant patches them), and the seconds its runoff and final took at their measured steps."""
    settings = auto.AutoSettings()
    tried = [{"label": p, "predicted_ms": setting.predicted[p], "kept": False,
              "measured_ms": setting.measure(p, rng.choice(setting.drifts), rng)} for p in [*setting.measured, "dense"]]
    by_label = {t["label"]: t for t in tried}
    dense_ms = by_label["dense"]["measured_ms"]
    spent = 0.0

    def steps_of(label: str) -> int:
        step = setting.predicted[label]
        wanted = math.ceil(settings.guard_s * 1e3 / step) if step > 0 else auto.MAX_GUARD_STEPS
        return auto.SETTLE_STEPS + max(settings.guard_steps, min(wanted, auto.MAX_GUARD_STEPS))

    def run(labels: list[str], rounds: int, key: str) -> None:
        nonlocal spent
        for label in labels:
            by_label[label][key] = []
        for _ in range(rounds):
            drift = rng.choice(setting.drifts)
            for label in labels:
                by_label[label][key].append(setting.measure(label, drift, rng))
                spent += steps_of(label) * by_label[label][key][-1] / 1e3

    order, rounds = auto.wide_runoff(tried, dense_ms, settings.dense_band, settings.runoff, runoff_s, steps_of)
    if not order:
        order = auto.runoff_plans(tried, dense_ms, settings.runoff_band, settings.dense_band)
        rounds = settings.runoff
    run(order, rounds, "runoff_ms")
    finalists = auto.final_plans(tried, dense_ms, settings.runoff_band)
    rounds = auto.runoff_rounds({p: by_label[p]["measured_ms"] for p in finalists}, auto.BLOCK_ROUNDS, runoff_s,
                                steps_of) if finalists else 0
    if rounds:  # as the tuner: no final where its rounds do not fit
        run(finalists, rounds, "final_ms")
    kept = auto.kept_plan(tried, dense_ms)
    return "dense" if kept is None else tried[kept]["label"], spent


def kept_plans(settings: list[Setting], variant: tuple[Callable[[int, int], bool], float, int] | None, draws: int,
               seed: int) -> tuple[list[list[str]], float]:
    """Per setting, the plan kept in each draw (draw d of setting i from its own seed, the same for every variant),
    and the mean seconds of a runoff and final together."""
    if variant is None:
        return [[min(s.true, key=s.true.__getitem__)] * draws for s in settings], 0.0
    rule, runoff_s, rounds = variant
    saved = auto.clear_win, auto.MAX_RUNOFF_ROUNDS
    auto.clear_win, auto.MAX_RUNOFF_ROUNDS = rule, rounds  # _passing and runoff_rounds look them up in the module
    try:
        kept, spent = [], []
        for i, setting in enumerate(settings):
            found = [guard(setting, runoff_s, random.Random(f"{seed}/guard/{i}/{d}")) for d in range(draws)]
            kept.append([plan for plan, _ in found])
            spent += [seconds for _, seconds in found]
    finally:
        auto.clear_win, auto.MAX_RUNOFF_ROUNDS = saved
    return kept, statistics.fmean(spent)


def launches_of(keys: list[tuple]) -> dict[tuple, int]:
    """Each setting's (time, hosts, rate) launch, a number: a launch times the settings in ORDER, so one that comes
    no later in ORDER than the setting before it starts the next."""
    launch, last, found = 0, -1, {}
    for key in sorted(keys):
        place = ORDER.index(key[1:])
        if place <= last:
            launch += 1
        found[key], last = launch, place
    return found


def replay(settings: dict[tuple, Setting], draws: int, rounds: list[int], seed: int = 0) -> list[dict[str, Any]]:
    """Per variant and benchmark rounds: the share of draws (over every setting) whose kept plan is truly within 10%
    of the best and at most 5% slower than dense, and the share the benchmark measures so, each with its difference
    from the first variant's (the same draws) and that difference's standard error; each launch's chance of all its
    settings measured within both (the product of its settings' shares; launches whose six digits settings were all
    timed so); the mean seconds of a runoff and final."""
    keys = list(settings)
    launch_of = launches_of(keys)
    sizes = {launch: list(launch_of.values()).count(launch) for launch in set(launch_of.values())}
    chosen = {name: kept_plans(list(settings.values()), variant, draws, seed) for name, variant in VARIANTS.items()}
    outcomes: dict[tuple[str, int], tuple[list[bool], list[bool]]] = {}
    rows = []
    for count in rounds:
        for name, (kept, spent) in chosen.items():
            truly, measured = [], []
            for i, setting in enumerate(settings.values()):
                best, dense_ms = min(setting.true.values()), setting.true["dense"]
                for d, plan in enumerate(kept[i]):
                    truly.append(setting.true[plan] <= 1.10 * best and setting.true[plan] <= 1.05 * dense_ms)
                    mine, fastest, dense = setting.benchmark(plan, count, random.Random(f"{seed}/bench/{i}/{d}"))
                    measured.append(mine <= 1.10 * fastest and mine <= 1.05 * dense)
            outcomes[name, count] = truly, measured
            baseline = outcomes[next(iter(VARIANTS)), count]
            launches: dict[int, float] = {}
            for i, key in enumerate(keys):
                share = statistics.fmean(measured[i * draws:(i + 1) * draws])
                launches[launch_of[key]] = launches.get(launch_of[key], 1.0) * share
            row = {"variant": name, "benchmark_rounds": count, "settings": len(settings), "draws": draws,
                   "launch_all_within": round(statistics.fmean(v for k, v in launches.items() if sizes[k] == 6), 4),
                   "launches": sum(size == 6 for size in sizes.values()), "runoff_final_s": round(spent, 2)}
            for figure, mine, theirs in (("truly_within", truly, baseline[0]), ("measured_within", measured,
                                                                                  baseline[1])):
                differences = [int(a) - int(b) for a, b in zip(mine, theirs, strict=True)]
                row[figure] = round(statistics.fmean(mine), 4)
                row[f"{figure}_vs_first"] = round(statistics.fmean(differences), 4)
                row[f"{figure}_vs_first_se"] = round(statistics.stdev(differences) / math.sqrt(len(differences)), 4)
            rows.append(row)
    return rows


def control_check(settings: dict[tuple, Setting], rows: dict[tuple, dict[str, dict[str, Any]]],
                  rng: random.Random) -> tuple[float, float]:
    """The share of the launches' controls (dense again / dense) more than 5% from 1, and of the model's (dense
    timed twice in as many interleaved rounds as the setting's)."""
    real = [runs[bench.CONTROL]["mean_step_s"] / runs["dense"]["mean_step_s"] for runs in rows.values()
            if bench.CONTROL in runs]
    model = []
    for setting in settings.values():
        for _ in range(100):
            drifts = [rng.choice(setting.drifts) for _ in setting.drifts]
            twice = [statistics.median(setting.measure("dense", d, rng) for d in drifts) for _ in range(2)]
            model.append(twice[0] / twice[1])
    return (statistics.fmean(abs(c - 1) > 0.05 for c in real), statistics.fmean(abs(c - 1) > 0.05 for c in model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=200, help="replays per setting and variant")
    parser.add_argument("--rounds", type=int, nargs="+", default=[30, 60], help="the benchmark's interleaved rounds")
    args = parser.parse_args()
    launches: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in clusterbench.load(bench.RESULTS):
        if row["workload"] == "digits":
            launches.setdefault((row["time"], row["hosts"], row["rate"]), {})[row["method"]] = row
    launches = {key: runs for key, runs in launches.items() if {"auto", "dense"} <= set(runs) and all(
        r.get("rounds") == 30 for r in runs.values())}  # AA to AJ
    settings = {key: Setting(runs) for key, runs in launches.items()}
    real, model = control_check(settings, launches, random.Random(1))
    print(f"{len(settings)} digits settings; dense again / dense more than 5% from 1: {real:.0%} of the launches', "
          f"{model:.0%} of the model's")
    rows = replay(settings, args.draws, args.rounds)
    first = next(iter(VARIANTS))
    print(f"| variant | benchmark rounds | truly within both (against {first}) | measured within both (against it) | "
          "a launch's 6 digits settings all measured within both | runoff and final, s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        row.update(controls_off_real=round(real, 4), controls_off_model=round(model, 4))
        print(f"| {row['variant']} | {row['benchmark_rounds']} | {row['truly_within']:.1%} "
              f"({row['truly_within_vs_first']:+.1%} ± {row['truly_within_vs_first_se']:.1%}) | "
              f"{row['measured_within']:.1%} ({row['measured_within_vs_first']:+.1%} ± "
              f"{row['measured_within_vs_first_se']:.1%}) | {row['launch_all_within']:.1%} | "
              f"{row['runoff_final_s']:.1f} |")
    with open(clusterbench.RESULTS / REPLAYS, "a") as out:
        for row in rows:
            out.write(json.dumps({**row, **clusterbench.machine()}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
