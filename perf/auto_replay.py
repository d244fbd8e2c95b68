"""``compression: auto``'s choice replayed on the digits launches' interleaved rounds (perf/results/auto.jsonl): how
often the guard's rules keep a plan within 10% of the best and at most 5% slower than dense, and how often the
benchmark itself (perf/auto.py) can tell, where even a chooser that knew each plan's true step (the oracle) is
judged by noisy figures.

    .venv/bin/python perf/auto_replay.py                 # every digits launch timed in 30 interleaved rounds or more
    .venv/bin/python perf/auto_replay.py --draws 400 --rounds 30 60 120

The model, per setting of a launch (hosts, rate): each run's mean step in each round k (perf/auto.py: every run 20
steps in turn, 30 rounds from launch AA on) is m[p, k] = exp(a[p] + b[k] + e[p, k]), fitted by median polish: a[p]
the plan's level (its true step: exp(a[p])), b[k] the round's drift, shared by the plans measured in it, e[p, k] what
is left, kept per plan. A measurement of plan p in a round with drift b is exp(a[p] + b + e), b drawn from the
setting's drifts and e from p's own rests. (A round mean holds 20 steps, where a measurement of the guard holds 5 to
50 by its trimmed mean: the replay's measurements are, if anything, noisier than the guard's.) Checked against the
launches: dense measured twice so, in 30 rounds each, against each launch's dense again / dense.

The guard, replayed with hvdcomp.auto's own functions: the plans the launch's auto measured alone (the methods and
dense; per-tensor mixes were not run alone, and are left out) are measured once each, in a round of its own; then
:func:`hvdcomp.auto.wide_runoff` (or :func:`~hvdcomp.auto.runoff_plans`) in rounds that share a drift,
:func:`~hvdcomp.auto.final_plans` in :func:`~hvdcomp.auto.runoff_rounds`' rounds, and
:func:`~hvdcomp.auto.kept_plan`; a measurement's steps are the tuner's (2 to settle and the guard's, at the plan's
predicted step in that launch), so the rounds fit in ``runoff_s`` as they would. Each variant sets only the rule
against dense (:func:`hvdcomp.auto.clear_win`, or a share of the rounds), ``runoff_s`` and MAX_RUNOFF_ROUNDS. Then
the benchmark: every plan and the plan kept timed in ``--rounds`` interleaved rounds, each figure the median of its
round means; the setting passes where the plan kept's figure is within 10% of the best figure, and at most 5% above
dense's. Rows go to perf/results/auto_replay.jsonl.
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

import clusterbench
from auto import CONTROL, RESULTS, round_means

from hvdcomp import auto

REPLAYS = "auto_replay.jsonl"


def three_quarters(won: int, rounds: int) -> bool:
    """The rule against dense up to launch AJ: more than three quarters of the rounds won."""
    return won > 0.75 * rounds


#: name -> (the rule against dense, runoff_s, MAX_RUNOFF_ROUNDS); None: the oracle
VARIANTS: dict[str, tuple[Callable[[int, int], bool], float, int] | None] = {
    "oracle": None,
    "up to AJ: three quarters, runoff_s 10, 8 rounds": (three_quarters, 10.0, 8),
    "sign test, runoff_s 10, 8 rounds": (auto.clear_win, 10.0, 8),
    "three quarters, runoff_s 30, 24 rounds": (three_quarters, 30.0, 24),
    "now: sign test, runoff_s 30, 24 rounds": (auto.clear_win, auto.AutoSettings.runoff_s, auto.MAX_RUNOFF_ROUNDS),
}


class Setting:
    """One launch's digits setting: each plan's level, the rounds' drifts and each plan's rests (the docstring)."""

    def __init__(self, runs: dict[str, dict[str, Any]]) -> None:
        means = {m: [math.log(x * 1e3) for x in round_means(r)] for m, r in runs.items() if m not in ("auto", CONTROL)}
        rounds = range(len(means["dense"]))
        self.level = {p: statistics.median(v) for p, v in means.items()}
        for _ in range(10):  # median polish
            self.drifts = [statistics.median(v[k] - self.level[p] for p, v in means.items()) for k in rounds]
            self.level = {p: statistics.median(v[k] - self.drifts[k] for k in rounds) for p, v in means.items()}
        self.rests = {p: [v[k] - self.level[p] - self.drifts[k] for k in rounds] for p, v in means.items()}
        self.true = {p: math.exp(a) for p, a in self.level.items()}
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


def guard(setting: Setting, rule: Callable[[int, int], bool], runoff_s: float, rng: random.Random) -> str:
    """The plan the guard keeps on measurements drawn from ``setting`` (module docstring), by hvdcomp.auto's rules
    with ``rule`` against dense and ``runoff_s``."""
    settings = auto.AutoSettings()
    tried = [{"label": p, "predicted_ms": setting.predicted[p], "kept": False,
              "measured_ms": setting.measure(p, rng.choice(setting.drifts), rng)} for p in [*setting.measured, "dense"]]
    by_label = {t["label"]: t for t in tried}
    dense_ms = by_label["dense"]["measured_ms"]

    def steps_of(label: str) -> int:
        wanted = math.ceil(settings.guard_s * 1e3 / setting.predicted[label])
        return auto.SETTLE_STEPS + max(settings.guard_steps, min(wanted, auto.MAX_GUARD_STEPS))

    def run(labels: list[str], rounds: int, key: str) -> None:
        for label in labels:
            by_label[label][key] = []
        for _ in range(rounds):
            drift = rng.choice(setting.drifts)
            for label in labels:
                by_label[label][key].append(setting.measure(label, drift, rng))

    saved = auto.clear_win
    auto.clear_win = rule  # _passing looks it up in the module
    try:
        order, rounds = auto.wide_runoff(tried, dense_ms, settings.dense_band, settings.runoff, runoff_s, steps_of)
        if not order:
            order = auto.runoff_plans(tried, dense_ms, settings.runoff_band, settings.dense_band)
            rounds = settings.runoff
        run(order, rounds, "runoff_ms")
        finalists = auto.final_plans(tried, dense_ms, settings.runoff_band)
        run(finalists, auto.runoff_rounds({p: by_label[p]["measured_ms"] for p in finalists}, auto.BLOCK_ROUNDS,
                                          runoff_s, steps_of) if finalists else 0, "final_ms")
        kept = auto.kept_plan(tried, dense_ms)
    finally:
        auto.clear_win = saved
    return "dense" if kept is None else tried[kept]["label"]


def launches_of(keys: list[tuple]) -> dict[tuple, int]:
    """Each setting's launch (a number), by time: a launch times each (hosts, rate) once, so a setting whose (hosts,
    rate) its launch has already timed starts the next."""
    launch, seen, found = 0, set(), {}
    for key in sorted(keys):
        if key[1:] in seen:
            launch, seen = launch + 1, set()
        seen.add(key[1:])
        found[key] = launch
    return found


def replay(settings: dict[tuple, Setting], draws: int, rounds: list[int], seed: int = 0) -> list[dict[str, Any]]:
    """Per variant and benchmark rounds: the share of draws (over every setting) whose kept plan is truly within 10%
    of the best and at most 5% slower than dense, the share the benchmark measures so, and each launch's chance of
    all its settings measured within both (the product of its settings' shares; launches whose digits settings were
    all timed so)."""
    rows = []
    rng = random.Random(seed)
    saved = auto.MAX_RUNOFF_ROUNDS
    launch_of = launches_of(list(settings))
    sizes = {launch: list(launch_of.values()).count(launch) for launch in set(launch_of.values())}
    for name, variant in VARIANTS.items():
        kept: dict[tuple, list[str]] = {}
        for key, setting in settings.items():
            if variant is None:
                kept[key] = [min(setting.true, key=setting.true.__getitem__)] * draws
                continue
            rule, runoff_s, auto.MAX_RUNOFF_ROUNDS = variant
            kept[key] = [guard(setting, rule, runoff_s, rng) for _ in range(draws)]
        auto.MAX_RUNOFF_ROUNDS = saved
        for count in rounds:
            truly, measured, launches = [], [], {}
            for key, setting in settings.items():
                launch = launch_of[key]
                best = min(setting.true.values())
                truly.append(statistics.fmean(setting.true[p] <= 1.10 * best and setting.true[p] <= 1.05 *
                                              setting.true["dense"] for p in kept[key]))
                passed = 0
                for plan in kept[key]:
                    mine, fastest, dense = setting.benchmark(plan, count, rng)
                    passed += mine <= 1.10 * fastest and mine <= 1.05 * dense
                measured.append(passed / draws)
                launches[launch] = launches.get(launch, 1.0) * measured[-1]
            rows.append({"variant": name, "benchmark_rounds": count, "settings": len(settings), "draws": draws,
                         "truly_within": round(statistics.fmean(truly), 4),
                         "measured_within": round(statistics.fmean(measured), 4),
                         "launch_all_within": round(statistics.fmean(v for k, v in launches.items()
                                                                     if sizes[k] == 6), 4),
                         "launches": sum(size == 6 for size in sizes.values())})
    return rows


def control_check(settings: dict[tuple, Setting], rows: dict[tuple, dict[str, dict[str, Any]]],
                  rng: random.Random) -> tuple[float, float]:
    """The share of the launches' controls (dense again / dense) more than 5% from 1, and of the model's."""
    real = [runs[CONTROL]["mean_step_s"] / runs["dense"]["mean_step_s"] for runs in rows.values() if CONTROL in runs]
    model = []
    for setting in settings.values():
        for _ in range(100):
            drifts = [rng.choice(setting.drifts) for _ in range(30)]
            twice = [statistics.median(setting.measure("dense", d, rng) for d in drifts) for _ in range(2)]
            model.append(twice[0] / twice[1])
    return (statistics.fmean(abs(c - 1) > 0.05 for c in real), statistics.fmean(abs(c - 1) > 0.05 for c in model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=200, help="replays per setting and variant")
    parser.add_argument("--rounds", type=int, nargs="+", default=[30, 60], help="the benchmark's interleaved rounds")
    args = parser.parse_args()
    launches: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in clusterbench.load(RESULTS):
        if row["workload"] == "digits" and (row["method"] == "auto" or row.get("rounds", 0) >= 30):
            launches.setdefault((row["time"], row["hosts"], row["rate"]), {})[row["method"]] = row
    launches = {key: runs for key, runs in launches.items() if {"auto", "dense"} <= set(runs) and all(
        r.get("rounds") == runs["dense"]["rounds"] for m, r in runs.items() if m != "auto")}
    settings = {key: Setting(runs) for key, runs in launches.items()}
    real, model = control_check(settings, launches, random.Random(1))
    print(f"{len(settings)} digits settings; dense again / dense more than 5% from 1: {real:.0%} of the launches', "
          f"{model:.0%} of the model's")
    rows = replay(settings, args.draws, args.rounds)
    print("| variant | benchmark rounds | truly within both | measured within both | a launch's 6 digits settings "
          "all measured within both |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        row.update(controls_off_real=round(real, 4), controls_off_model=round(model, 4))
        print(f"| {row['variant']} | {row['benchmark_rounds']} | {row['truly_within']:.1%} | "
              f"{row['measured_within']:.1%} | {row['launch_all_within']:.1%} |")
    with open(clusterbench.RESULTS / REPLAYS, "a") as out:
        for row in rows:
            out.write(json.dumps({**row, **clusterbench.machine()}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
