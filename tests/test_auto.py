"""``compression: auto``'s rule (hvdcomp/auto.py) on scripted plans and measurements: which plans race against dense,
in which order, for how many rounds, and which is kept. The numbers are scripted inputs that put each part of the rule
on its edge; the tests assert the rule's outcome. Auto on real ranks is tests/test_multirank.py's (auto_local) and
tests/test_cluster.py's (2 emulated hosts)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from hvdcomp import auto
from hvdcomp.config import AutoSettings, CompressionConfig
from hvdcomp.perfmodel import predict


def _plans(**steps: float) -> list[predict.Plan]:
    """Plans by predicted step, fastest first; a plan other than dense compresses one tensor."""
    choice = predict.TensorChoice("w", 1, "m", "allreduce", 0.0, 0.0)
    return sorted((predict.Plan(label, () if label == "dense" else (choice,), ms) for label, ms in steps.items()),
                  key=lambda p: p.step_ms)


def _tried(**rounds: list[float]) -> list[dict[str, Any]]:
    return [{"label": label, "rounds_ms": ms} for label, ms in rounds.items()]


def test_auto_races_the_fastest_predicted_then_single_methods() -> None:
    """The fastest predicted (a mix, here), then methods alone in predicted order, then other mixes; dense is
    raced anyway (not among these), and a plan that compresses nothing is no plan."""
    ranked = _plans(mix=60, mix2=65, topk=70, dense=100, onebit=90, qsgd=130)
    singles = {"topk", "onebit", "qsgd"}
    assert [p.label for p in auto.plans_to_race(ranked, singles, 3)] == ["mix", "topk", "onebit"]
    assert [p.label for p in auto.plans_to_race(ranked, singles, 5)] == ["mix", "topk", "onebit", "qsgd", "mix2"]
    assert [p.label for p in auto.plans_to_race(ranked, singles, 1)] == ["mix"]
    empty = [predict.Plan("per-tensor", (), 50.0), *_plans(dense=100)]
    assert auto.plans_to_race(empty, set(), 3) == []


def test_auto_times_a_measurement_for_about_measure_s() -> None:
    assert auto.measured_steps(1000.0) == auto.MIN_STEPS  # long steps: the fewest
    assert auto.measured_steps(1.0) == auto.MAX_STEPS  # millisecond steps: the most
    assert auto.measured_steps(20.0) == 5  # 0.1 s
    assert auto.measured_steps(0.0) == auto.MAX_STEPS


def test_auto_rounds_run_in_orders_every_rank_shares() -> None:
    """A round's order depends on its number only (every rank draws the same), and changes between rounds."""
    labels = ["dense", "a", "b", "c"]
    orders = [auto.race_order(labels, r) for r in range(1, 9)]
    assert all(sorted(order) == sorted(labels) for order in orders)
    assert orders == [auto.race_order(labels, r) for r in range(1, 9)]
    assert len({tuple(order) for order in orders}) > 1


def test_auto_measures_a_plan_by_its_trimmed_mean_step() -> None:
    """The mean step without the slowest and fastest tenth (rounded up, fewer than half): a stall does not decide."""
    assert auto.step_ms([0.001] * 9 + [0.1]) == pytest.approx(1.0)
    assert auto.step_ms([0.001, 0.003]) == pytest.approx(2.0)  # two: nothing left out
    assert auto.step_ms([0.001, 0.002, 0.009]) == pytest.approx(2.0)


def test_auto_clear_win_is_a_sign_test_at_one_in_eight() -> None:
    """Clearly more rounds won than chance gives a plan that runs like dense: 3 of 3, 7 of 8, 8 of 10, 11 of 16."""
    assert auto.clear_win(3, 3) and not auto.clear_win(2, 3)
    assert auto.clear_win(7, 8) and not auto.clear_win(6, 8)
    assert auto.clear_win(8, 10) and not auto.clear_win(7, 10)
    assert auto.clear_win(11, 16) and not auto.clear_win(10, 16)
    assert not auto.clear_win(2, 2) and not auto.clear_win(0, 0)  # too few rounds to show it


def test_auto_judges_each_plan_against_dense_in_the_same_round() -> None:
    """A round's drift is shared: a plan 10% faster than dense in every round wins them all, though its slow
    rounds measure slower than dense's fast ones; judged at the median ratio times dense's median."""
    tried = _tried(dense=[10.0, 20.0, 10.0], a=[9.0, 18.0, 9.0], b=[10.5, 19.0, 11.0])
    dense, a, b = auto.judge(tried)
    assert dense == {"judged_ms": 10.0, "rounds_won": None, "clear": False}
    assert a == {"judged_ms": 9.0, "rounds_won": 3, "clear": True}
    assert b["rounds_won"] == 1 and not b["clear"] and b["judged_ms"] == pytest.approx(10.5)


def test_auto_keeps_the_fastest_plan_that_beat_dense_clearly() -> None:
    # a is faster by the median, but won only 2 of 3 rounds: b, which won all, is kept
    tried = _tried(dense=[10.0, 10.0, 10.0], a=[5.0, 5.0, 11.0], b=[9.0, 9.0, 9.0])
    assert auto.kept_plan(tried) == "b"
    # both clear: the faster judged
    assert auto.kept_plan(_tried(dense=[10.0] * 3, a=[5.0] * 3, b=[9.0] * 3)) == "a"
    # none clear: dense, also where a plan tied dense
    assert auto.kept_plan(_tried(dense=[10.0] * 3, a=[10.0] * 3, b=[11.0, 9.0, 12.0])) == "dense"


class _Optimizer:
    """The optimizer's interface a tuner uses (hvdcomp.optimizer.Tuner's docstring), scripted: the real one runs in
    tests/ranks.py's auto scenarios. Every plan applied is recorded."""

    def __init__(self, base: CompressionConfig) -> None:
        self.config, self.applied = base, []
        self.process_set = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)
        self.step_skipped, self.steps_done, self.wait = False, 0, None

    def gradients(self) -> list[tuple[str, Any]]:
        return [("w", types.SimpleNamespace(device=types.SimpleNamespace(type="cpu")))]

    def apply_config(self, config: CompressionConfig) -> None:
        self.config = config

    def warmup_left(self) -> int:
        return 0


def _race(monkeypatch: pytest.MonkeyPatch, measured: dict[str, list[float]], budget_s: float,
          round_s: float) -> tuple[list[str], dict[str, Any]]:
    """Runs the tuner's race on scripted measurements (ms, one per round and plan) from the plans raced on; each
    measurement takes ``round_s`` / (plans) of racing. Returns the plans applied in turn and the report."""
    base = CompressionConfig.parse("none")
    tuner = auto.Tuner(AutoSettings(budget_s=budget_s), base)
    optimizer = _Optimizer(base)
    clock = {"s": 0.0}

    def apply(self: auto.Tuner, opt: _Optimizer, label: str, racing: bool) -> None:
        opt.applied.append(label)
        self.report.update(phase="racing", label=label)

    monkeypatch.setattr(auto.Tuner, "_apply", apply)
    monkeypatch.setattr(auto.live, "agreed", lambda document, *args: document)  # one rank: the slowest is this one
    tuner.by_label = {label: predict.Plan(label, (), 1.0) for label in measured}
    tuner.report["tried"] = [{"label": label, "predicted_ms": 1.0, "steps": 2, "rounds_ms": [], "kept": False}
                             for label in measured]
    pending = {label: list(ms) for label, ms in measured.items()}
    tuner.phase = "race"
    tuner._next_measurement(optimizer)
    while tuner.phase != "settled":
        clock["s"] += round_s / len(measured)
        tuner.samples.intervals = [pending[tuner.report["label"]].pop(0) / 1e3]
        monkeypatch.setattr(auto.time, "perf_counter", lambda: clock["s"])
        tuner._finish_measurement(optimizer)
    return optimizer.applied, tuner.report


def test_auto_races_in_rounds_until_the_budget_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rounds at least; then rounds while the budget lasts; every plan once a round, in the round's order; the
    plan kept is applied if it is not the one in force."""
    measured = {"dense": [10.0] * 5, "a": [9.0] * 5, "b": [12.0] * 5}
    applied, report = _race(monkeypatch, {k: v[:3] for k, v in measured.items()}, budget_s=0, round_s=1.0)
    rounds = [applied[i:i + 3] for i in range(0, 9, 3)]
    assert rounds == [auto.race_order(list(measured), r) for r in (1, 2, 3)], applied
    assert report["label"] == "a" and [t["kept"] for t in report["tried"]] == [False, True, False], report
    assert applied[9:] == ([] if applied[8] == "a" else ["a"]), applied  # a applied again unless in force
    assert [t["rounds_won"] for t in report["tried"]] == [None, 3, 0], report
    # 1 s a round, a budget of 4.5 s: 5 rounds (the fifth begins at 4 s)
    _, report = _race(monkeypatch, measured, budget_s=4.5, round_s=1.0)
    assert [len(t["rounds_ms"]) for t in report["tried"]] == [5, 5, 5] and report["race_s"] == pytest.approx(5.0)
    lines = auto.table({**report, "workers": 2, "dense_ms": 10.0, "dense_predicted_ms": 11.0,
                        "measure_s": 0.5, "plan": [], "phase": "settled"}).splitlines()
    assert lines[1] == "dense step: measured 10.0 ms, predicted 11.0 ms; measuring took 0.5 s, racing 5.0 s in 5 rounds"
    assert lines[3] == ("a: predicted 1.0 ms, rounds 9.0, 9.0, 9.0, 9.0, 9.0 ms, judged 9.0 ms; faster than dense in "
                        "5 of 5 rounds (clearly), kept")


def test_auto_settings_are_checked_with_their_names() -> None:
    assert AutoSettings.parse(None) == AutoSettings()
    assert AutoSettings.parse({"plans": 2, "budget_s": 1}).plans == 2
    for options, message in [({"tries": 2}, "unknown key in auto's options 'tries'; valid: allow, candidates"),
                             ({"plans": 0}, "plans"), ({"budget_s": -1}, "budget_s"), ({"budget_s": "x"}, "budget_s"),
                             ({"allow": ["topk"]}, "'topk' is not held back"),
                             ({"candidates": {"randomk": {}}}, "randomk is held back"),
                             ({"candidates": {"nope": {}}}, "'nope'"),
                             ({"candidates": {"topk": {"ratio": 2}}}, "ratio")]:
        with pytest.raises(ValueError, match=message):
            AutoSettings.parse(options)
    assert "randomk" in AutoSettings.parse({"allow": ["randomk"]}).methods()
    assert "randomk" not in AutoSettings().methods() and "terngrad" in AutoSettings().methods()
    assert CompressionConfig.parse({"method": "auto", "options": {"plans": 2}}).auto == AutoSettings(plans=2)
