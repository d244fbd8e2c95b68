"""``compression: auto``'s rules (hvdcomp/auto.py) on scripted measurements and plans: which plans the guard
measures, when it measures again, widens, runs off and keeps a plan over dense. The numbers are scripted inputs
(some shaped like steps measured on the emulated cluster) that put each rule on its edge; the tests assert the rule's
outcome. Auto on real ranks is tests/test_multirank.py's (auto_local) and tests/test_cluster.py's (2 emulated
hosts)."""

from __future__ import annotations

import statistics
import types

import pytest

from hvdcomp import auto
from hvdcomp.perfmodel import predict


def test_auto_plans_to_try() -> None:
    """What auto's guard measures: where the model predicted the measured dense step within the margin, only plans
    predicted to pay (the fastest, then single methods); where it misjudged it (millisecond steps), plans within its
    error of dense fill the tries, and dense itself comes last unless one is predicted to pay beyond the error; or,
    if measuring them costs at most SURVEY_S, every method alone within the error and dense."""
    def plans(**steps: float) -> list[predict.Plan]:
        return sorted((predict.Plan(label, (), ms) for label, ms in steps.items()), key=lambda p: p.step_ms)

    def labels(ranked: list[predict.Plan], dense_ms: float, tries: int, methods: set[str],
               try_ms: float = 1e9) -> list[str]:
        return [p.label for p in auto.plans_to_try(ranked, dense_ms, 0.05, tries, methods, try_ms)]

    ranked = plans(mix=60, topk=70, fp16=98, onebit=90, dense=100, qsgd=130)
    singles = {"topk", "fp16", "onebit", "qsgd"}
    assert labels(ranked, 102, 5, singles) == ["mix", "topk", "onebit"]  # fp16: 2% faster, under the margin
    assert labels(ranked, 102, 2, {"topk"}) == ["mix", "topk"]
    assert labels(plans(fp16=98, dense=100), 101, 5, {"fp16"}) == []  # stays dense
    assert labels(ranked, 0, 5, singles) == ["mix", "topk", "onebit"]  # no dense step to judge the model by
    # dense predicted 100 ms, measured 40 (2.5x): everything under 250 ms may pay, nothing beyond 2.5x: dense too
    assert labels(ranked, 40, 5, singles) == ["mix", "topk", "onebit", "fp16", "qsgd", "dense"]
    assert labels(ranked, 40, 2, singles) == ["mix", "topk", "dense"]
    # ... and where measuring is cheap (6 plans of 0.8 s within SURVEY_S, not 6 of 1 s), every method alone too
    assert labels(ranked, 40, 2, singles, try_ms=800) == ["mix", "topk", "onebit", "fp16", "qsgd", "dense"]
    assert labels(ranked, 40, 1, {"topk", "qsgd"}, try_ms=800) == ["mix", "topk", "qsgd", "dense"]
    assert labels(ranked, 40, 2, singles, try_ms=1000) == ["mix", "topk", "dense"]
    # measured 80 (1.25x): up to 125 ms may pay; the mix, predicted 40% faster, pays beyond that: dense is not
    # measured again, unless measuring is cheap
    assert labels(ranked, 80, 5, {"topk"}) == ["mix", "topk", "onebit", "fp16"]
    assert labels(ranked, 80, 5, {"topk"}, try_ms=1) == ["mix", "topk", "onebit", "dense"]
    assert labels(plans(fp16=98, dense=100), 80, 5, {"fp16"}) == ["fp16", "dense"]


def test_auto_widens_the_plans_tried_where_the_model_misranks_them() -> None:
    """After the plans tried, methods alone not yet measured are measured where the plans measured disagree with the
    model: those that would beat the fastest measured at their prediction x the lowest ratio of measured to
    predicted seen / the spread of those ratios; none where every plan is off by the same factor."""
    def plans(**steps: float) -> list[predict.Plan]:
        return sorted((predict.Plan(label, (), ms) for label, ms in steps.items()), key=lambda p: p.step_ms)

    def tried(**steps: tuple[float, float]) -> list[dict]:
        return [{"label": label, "predicted_ms": p, "measured_ms": m} for label, (p, m) in steps.items()]

    ranked = plans(mix=691, other_mix=700, onebit=800, terngrad=873, efsignsgd=886, topk=918, powersgd=1000, orq=1200,
                   qsgd=1500, dense=2600)
    methods = {"onebit", "terngrad", "efsignsgd", "topk", "powersgd", "orq", "qsgd"}
    # 4 hosts at 1 Gbit/s, synthetic: the five tried measured 1.03x to 1.52x their predictions, the fastest 909 ms;
    # a method could measure as low as its prediction x 1.03 / 1.48 (0.69): with the predictions assumed here (the
    # run kept none for plans not tried) PowerSGD and ORQ could beat 909, QSGD not
    misranked = tried(mix=(691, 1052.6), onebit=(800, 1130.5), terngrad=(873, 945.2), efsignsgd=(886, 909.3),
                      topk=(918, 1165.0))
    assert [p.label for p in auto.widened_plans(ranked, misranked, methods, 5)] == ["powersgd", "orq"]  # no mix
    assert [p.label for p in auto.widened_plans(ranked, misranked, methods, 1)] == ["powersgd"]
    assert auto.widened_plans(ranked, misranked, methods - {"powersgd", "orq"}, 5) == []  # only candidates
    # every plan measured 1.2x its prediction: the model ranks them right, and none is added
    even = tried(mix=(691, 829.2), onebit=(800, 960.0), topk=(918, 1101.6))
    assert auto.widened_plans(ranked, even, methods, 5) == []
    assert auto.widened_plans(ranked, misranked[:1], methods, 5) == []  # one plan measured: no spread to judge by
    # dense measured in the guard counts as a plan measured; it is not a method alone, and is not added again
    assert [p.label for p in auto.widened_plans(ranked, tried(topk=(918, 900), dense=(2600, 1300)),
                                                {"topk", "powersgd", "orq", "qsgd"}, 5)] == ["powersgd", "orq", "qsgd"]


def test_auto_measures_again_a_plan_measured_far_over_its_prediction_and_dense() -> None:
    """A plan measured more than DISTURBED (3) times both its prediction and the dense step measured is measured
    again, in the order tried; over only one of them, or not more than 3x, it is not (a plan that is simply slow)."""
    tried = [{"label": label, "predicted_ms": p, "measured_ms": m} for label, p, m in
             [("powersgd", 5.2, 36.5), ("fp16", 6.3, 38.5), ("onebit", 2.0, 8.0), ("qsgd", 20.0, 40.0),
              ("topk", 4.0, 6.0), ("dense", 2.9, 2.2), ("lgc", 10.0, None)]]
    assert auto.disturbed_plans(tried, 2.2) == ["powersgd", "fp16", "onebit"]
    assert auto.disturbed_plans(tried, 3.0) == ["powersgd", "fp16"]  # onebit: 8.0 is not over 3 x 3.0 (dense)
    assert auto.disturbed_plans(tried, 13.0) == []  # dense measured slow: the plans are not disturbed by its measure
    assert auto.disturbed_plans([], 2.2) == []


def _tried(*measured: tuple[str, float]) -> list[dict]:
    """Guard trials (label, measured ms), as auto's report holds them."""
    return [{"label": label, "measured_ms": ms} for label, ms in measured]


def _ran_off(runoff: dict[str, tuple[float, list[float]]]) -> list[dict]:
    """Runoff trials (label -> the guard's measured ms and the runoff's), as auto's report holds them."""
    return [{"label": label, "measured_ms": ms, "runoff_ms": ran} for label, (ms, ran) in runoff.items()]


def test_auto_keeps_only_a_plan_measured_faster_than_dense() -> None:
    assert auto.kept_plan(_tried(("a", 3.0), ("dense", 2.8)), 2.0) is None  # dense measured in the guard wins
    assert auto.kept_plan(_tried(("a", 3.0), ("dense", 3.2)), 2.0) == 0  # ... or loses; the earlier 2.0 is not used
    assert auto.kept_plan(_tried(("a", 2.8), ("dense", 2.8)), 5.0) is None  # a tie keeps dense
    assert auto.kept_plan(_tried(("a", 3.0), ("b", 2.5)), 2.7) == 1  # dense not measured again: the dense phase's step
    assert auto.kept_plan(_tried(("a", 3.0), ("b", 2.5)), 2.4) is None
    assert auto.kept_plan([], 2.0) is None
    # after a runoff of fewer than 3 rounds a plan's step is the median of its measurements: the guard's fast one is
    # outvoted
    assert auto.kept_plan([{"label": "a", "measured_ms": 2.0, "runoff_ms": [3.0, 3.1]},
                           {"label": "dense", "measured_ms": 2.8, "runoff_ms": [2.9, 2.7]}], 5.0) is None
    assert auto.kept_plan([{"label": "a", "measured_ms": 4.3, "runoff_ms": [4.2, 4.4]},
                           {"label": "dense", "measured_ms": 4.2, "runoff_ms": [5.1, 5.3]}], 4.0) == 0
    # ... and only the runoff's plans compete: c, measured once, does not win over them on that one measurement
    ran_off = [{"label": "a", "measured_ms": 4.0, "runoff_ms": [4.6, 4.7]}, {"label": "c", "measured_ms": 4.45},
               {"label": "b", "measured_ms": 4.1, "runoff_ms": [4.7, 4.8]}]
    assert auto.kept_plan(ran_off, 5.0) == 0
    assert auto.kept_plan(ran_off, 4.5) is None  # dense, measured once, is still the bar
    # dense among three in the runoff: the lowest median of the three wins, dense's included
    ran_off.append({"label": "dense", "measured_ms": 5.0, "runoff_ms": [4.4, 4.5]})
    assert auto.kept_plan(ran_off, 5.0) is None
    ran_off[-1]["runoff_ms"] = [4.9, 4.8]
    assert auto.kept_plan(ran_off, 4.0) == 0  # dense's median in the runoff is the bar, not its dense steps'


def test_auto_judges_a_runoff_of_three_rounds_or_more_by_its_rounds() -> None:
    # a is faster than b in two of three rounds, but the rounds drift (about 2, 4 and 6 ms): b's median measurement
    # is the lower (3.95 ms against 4.25, the guard's among them); judged against its rounds, a is the faster
    tried = [{"label": "a", "measured_ms": 4.3, "runoff_ms": [2.0, 4.2, 6.1]},
             {"label": "b", "measured_ms": 3.9, "runoff_ms": [2.1, 4.0, 6.3]}]
    assert statistics.median([3.9, 2.1, 4.0, 6.3]) < statistics.median([4.3, 2.0, 4.2, 6.1])
    level = statistics.median([2.05, 4.1, 6.2])  # the rounds' medians
    assert auto.judged_ms(tried) == pytest.approx([level * 6.1 / 6.2, level * 6.3 / 6.2])
    assert auto.kept_plan(tried, 9.0) == 0
    # two rounds are no blocks: each plan's median measurement, the guard's among them, as before
    two = [{**t, "runoff_ms": t["runoff_ms"][:2]} for t in tried]
    assert auto.judged_ms(two) == [statistics.median([4.3, 2.0, 4.2]), statistics.median([3.9, 2.1, 4.0])]
    assert auto.kept_plan(two, 9.0) == 1
    # a plan not run off is judged by its one measurement; dense, run off, by its rounds too
    tried.append({"label": "c", "measured_ms": 3.0})
    tried.append({"label": "dense", "measured_ms": 3.0, "runoff_ms": [2.2, 4.4, 6.6]})
    assert auto.judged_ms(tried)[2] == 3.0 and auto.kept_plan(tried, 1.0) == 0  # dense's runoff is the bar
    tried[-1]["runoff_ms"] = [1.9, 3.9, 6.0]
    assert auto.kept_plan(tried, 9.0) is None
    # dense not run off (measured more than dense_band slower): the winner, judged at the rounds' level (a's 4.03 ms),
    # against dense's one measurement
    del tried[-1]
    assert auto.kept_plan(tried, 4.1) == 0 and auto.kept_plan(tried, 4.0) is None
    with pytest.raises(ValueError):  # the runoff's plans are measured in the same rounds, as many for each
        auto.judged_ms([{"label": "a", "measured_ms": 1.0, "runoff_ms": [1.0, 2.0, 3.0]},
                        {"label": "b", "measured_ms": 1.0, "runoff_ms": [1.0, 2.0]}])
    # Shaped like 2 hosts at 100 Mbit/s, digits: ten plans, eight rounds. orq, first in every round, read 3.3 ms in the
    # first, where the other nine read 4.6 to 9.7; by the median auto kept orq (4.3 ms), timed 1.33x onebit's
    # step, the best; judged by the rounds it keeps onebit
    runoff = {"per-tensor (timeline)": (5.74, [8.422, 8.847, 6.352, 6.515, 4.788, 6.819, 7.668, 5.116]),
              "topk": (4.892, [9.09, 5.027, 7.348, 4.345, 7.466, 5.061, 7.013, 5.36]),
              "efsignsgd": (5.24, [7.119, 6.711, 4.368, 3.975, 4.181, 4.904, 7.141, 4.954]),
              "bingrad": (4.542, [9.665, 6.146, 6.048, 3.265, 6.431, 6.148, 5.033, 4.718]),
              "onebit": (5.496, [4.882, 4.204, 4.274, 6.401, 5.403, 4.31, 4.188, 5.25]),
              "threshold": (6.036, [6.164, 5.438, 5.337, 5.529, 5.271, 5.842, 4.988, 6.617]),
              "orq": (6.083, [3.269, 5.583, 5.959, 5.57, 4.242, 3.584, 4.34, 4.323]),
              "qsgd": (4.483, [8.044, 3.872, 4.421, 5.521, 4.376, 4.864, 4.288, 4.376]),
              "terngrad": (5.698, [5.887, 5.635, 4.392, 6.752, 5.71, 4.366, 5.251, 4.351]),
              "powersgd": (4.367, [4.56, 5.531, 4.716, 6.692, 4.353, 5.989, 4.939, 4.373])}
    tried = _ran_off(runoff)
    medians = {label: statistics.median([ms, *ran]) for label, (ms, ran) in runoff.items()}
    assert min(medians, key=medians.get) == "orq"
    assert tried[auto.kept_plan(tried, 28.4)]["label"] == "onebit"


def test_auto_keeps_a_plan_over_dense_only_where_it_won_most_rounds() -> None:
    # Shaped like 2 hosts at 10 Gbit/s, digits: judged against its rounds fp16 read faster than dense, but it won only
    # 6 of the 8 rounds; timed, it ran 1.18x dense's step. Dense is kept
    runoff = {"onebit": (3.252, [3.708, 3.847, 3.293, 3.458, 3.725, 3.748, 3.824, 4.363]),
              "qsgd": (3.444, [3.604, 3.931, 4.081, 4.541, 3.372, 3.33, 4.278, 3.548]),
              "fp16": (2.666, [2.239, 2.684, 3.045, 2.835, 2.315, 2.542, 2.528, 2.531]),
              "efsignsgd": (3.568, [3.577, 3.305, 3.435, 3.957, 3.699, 4.018, 3.812, 3.742]),
              "bingrad": (3.563, [4.087, 3.81, 3.611, 4.332, 3.614, 3.266, 3.414, 3.941]),
              "dense": (2.446, [2.458, 2.642, 3.119, 2.752, 2.854, 2.862, 2.981, 2.662])}
    tried = _ran_off(runoff)
    tried.insert(4, {"label": "threshold", "measured_ms": 4.928})
    judged = dict(zip(runoff, (ms for t, ms in zip(tried, auto.judged_ms(tried), strict=True) if "runoff_ms" in t),
                      strict=True))
    assert judged["fp16"] < judged["dense"] == min(v for k, v in judged.items() if k != "fp16")
    assert auto.rounds_won(tried) == [0, 0, 6, 0, None, 0, None]
    assert auto.kept_plan(tried, 2.142) is None
    # fp16, judged faster than dense, runs a final against dense alone (final_plans); a final decides alone
    assert auto.final_plans(tried, 2.142, 0.1) == ["fp16", "dense"]
    tried[2]["final_ms"] = [2.5, 2.4, 2.6, 2.5, 2.4, 2.5, 2.6, 2.5]
    tried[-1]["final_ms"] = [2.6, 2.5, 2.7, 2.6, 2.5, 2.6, 2.7, 2.4]
    assert auto.final_view(tried)[0] == [2, 6] and auto.kept_plan(tried, 2.142) == 2  # won 7 of 8
    tried[2]["final_ms"][0] = 2.7
    assert auto.kept_plan(tried, 2.142) is None  # won 6 of 8
    assert auto.final_plans(tried, 2.142, 0.1) == []  # one final at most
    del tried[2]["final_ms"], tried[-1]["final_ms"]
    # no final where dense did not run off
    # (there every plan is judged slower than the dense steps' 2.142 ms: none passes, and no final)
    assert auto.final_plans([t for t in tried if t["label"] != "dense"], 2.142, 0.1) == []
    # no final where the fastest other plan was judged more than the band above dense
    assert auto.final_plans(tried, 2.142, 0.0) != [] and auto.final_plans(
        [{**t, "runoff_ms": [ms * 1.2 for ms in t["runoff_ms"]]} if t["label"] == "fp16" else t for t in tried],
        2.142, 0.1) == []
    # 7 of 8 rounds is clearly more than chance: kept
    tried[2]["runoff_ms"][1] = 2.6
    assert auto.rounds_won(tried)[2] == 7 and auto.kept_plan(tried, 2.142) == 2
    # the fastest that clears the bar is kept: a, the fastest judged, won 2 of 3 rounds; b, slower, won all 3
    tried = [{"label": "a", "measured_ms": 2.5, "runoff_ms": [2.0, 4.0, 7.0]},
             {"label": "b", "measured_ms": 2.8, "runoff_ms": [2.9, 4.5, 5.9]},
             {"label": "dense", "measured_ms": 3.2, "runoff_ms": [3.0, 4.6, 6.0]}]
    assert auto.judged_ms(tried)[0] < auto.judged_ms(tried)[1] < auto.judged_ms(tried)[2]
    assert auto.rounds_won(tried) == [2, 3, None] and auto.kept_plan(tried, 9.0) == 1
    assert auto.final_plans(tried, 9.0, 0.1) == []  # b is kept, and no other plan passed the bar: no final
    # two rounds are no blocks: judged by the median, as before, with no rounds to win
    two = [{**t, "runoff_ms": t["runoff_ms"][:2]} for t in tried]
    assert auto.rounds_won(two) == [None] * 3 and auto.kept_plan(two, 9.0) == 0
    slow = [{**t, "runoff_ms": [ms * 2 for ms in t["runoff_ms"]]} if t["label"] != "dense" else t for t in tried]
    assert auto.kept_plan(slow, 9.0) is None and auto.final_plans(slow, 9.0, 1.5) == ["dense", "a"]  # a within 150%
    assert auto.final_plans([{**t, "runoff_ms": t["runoff_ms"][:2]} for t in slow], 9.0, 1.5) == []  # 2 rounds
    assert auto.final_plans(slow[1:], 9.0, 1.5) == []  # only one other plan ran off: the runoff was its final
    # dense measured in the guard but not run off: no rounds to win either, and its one measurement is the bar
    alone = [*tried[:2], {"label": "dense", "measured_ms": 9.0}]
    assert auto.rounds_won(alone) == [None] * 3 and auto.kept_plan(alone, 1.0) == 0
    alone[-1]["measured_ms"] = 3.0
    assert auto.kept_plan(alone, 9.0) is None  # a is judged 4.0 ms at the rounds' level


def test_auto_keeps_a_plan_over_dense_only_where_its_rounds_won_are_clearly_more_than_chance() -> None:
    # a one-sided sign test at 1/8: the fewest rounds won that a plan running like dense wins at most 1 time in 8
    least = {n: min(k for k in range(n + 1) if auto.clear_win(k, n)) for n in (3, 4, 5, 6, 7, 8, 10, 16, 24)}
    assert least == {3: 3, 4: 4, 5: 5, 6: 5, 7: 6, 8: 7, 10: 8, 16: 11, 24: 16}, least
    assert auto.clear_win(3, 3) and not auto.clear_win(2, 3)  # 3 of 3 by chance: exactly 1/8, at the bar
    # over 16 rounds, a plan faster than dense in 11 (judged faster too) is kept; three quarters asked for 13
    dense = [4.0 + 0.1 * (k % 3) for k in range(16)]
    plan = [ms - 0.3 if k < 11 else ms + 0.1 for k, ms in enumerate(dense)]
    tried = [{"label": "fp16", "measured_ms": 3.8, "runoff_ms": plan},
             {"label": "dense", "measured_ms": 4.0, "runoff_ms": dense}]
    assert auto.rounds_won(tried) == [11, None] and auto.kept_plan(tried, 4.0) == 0
    tried[0]["runoff_ms"][10] = dense[10] + 0.1  # 10 of 16: 1 time in 4 by chance (11 or more: 1 in 10)
    assert auto.rounds_won(tried) == [10, None] and auto.kept_plan(tried, 4.0) is None


def test_auto_runs_a_final_of_the_plan_kept_and_the_next() -> None:
    # Shaped like 2 hosts at 100 Mbit/s, digits: five plans ran off in 8 rounds, dense (31 ms) not among them; the
    # runoff keeps terngrad, judged 4.35 ms, and orq, judged 4.58 (5% above), is the next: the two run a final alone
    # (final_plans), fastest first, and the faster in it is kept (timed alone: terngrad 4.71 ms, orq 4.83)
    runoff = {"onebit": (4.567, [4.609, 6.652, 4.974, 4.819, 4.415, 4.981, 5.723, 3.255]),
              "orq": (4.74, [4.49, 3.691, 6.336, 4.266, 4.519, 4.393, 4.286, 3.865]),
              "bingrad": (3.946, [3.596, 5.653, 4.181, 5.458, 4.877, 5.25, 6.252, 3.673]),
              "terngrad": (4.211, [3.683, 4.328, 5.074, 4.146, 3.95, 4.616, 6.573, 8.823]),
              "qsgd": (5.707, [4.358, 4.772, 4.443, 4.384, 5.143, 6.499, 5.481, 5.186])}
    tried = [*_tried(("threshold", 6.183), ("powersgd", 6.278)), *_ran_off(runoff),
             *_tried(("fp16", 15.32), ("dense", 30.968))]
    terngrad, orq = 5, 3
    assert auto.kept_plan(tried, 33.621) == terngrad and auto.rounds_won(tried) == [None] * len(tried)
    assert auto.final_plans(tried, 33.621, 0.1) == ["terngrad", "orq"]
    assert auto.final_plans(tried, 33.621, 0.05) == []  # orq is judged 5.4% above terngrad
    # the final decides alone, between two plans that both passed the bar: the faster, here orq ...
    tried[terngrad]["final_ms"] = [4.2, 4.4, 4.1, 4.3]
    tried[orq]["final_ms"] = [4.0, 4.2, 4.3, 4.1]
    assert auto.final_view(tried)[0] == [orq, terngrad] and auto.kept_plan(tried, 33.621) == orq
    assert auto.kept_plan(tried, 1.0) == orq  # (dense's step is no bar in it: both beat dense in the runoff)
    assert auto.final_plans(tried, 33.621, 0.1) == []  # one final at most
    # ... or terngrad; a tie goes to the plan the runoff judged faster, terngrad
    tried[orq]["final_ms"] = [4.3, 4.5, 4.0, 4.4]
    assert auto.kept_plan(tried, 33.621) == terngrad
    tried[orq]["final_ms"] = list(tried[terngrad]["final_ms"])
    assert auto.kept_plan(tried, 33.621) == terngrad
    # where dense ran off, both must have passed its bar: a (judged 3.8 ms) and b (4.5) each beat dense in all 3
    # rounds, and b is within 20% of a, not 10%; where a won only 2 of 3, b alone passed, is kept, and has no final
    both = [{"label": "a", "measured_ms": 2.5, "runoff_ms": [2.0, 4.0, 5.0]},
            {"label": "b", "measured_ms": 2.8, "runoff_ms": [2.9, 4.5, 5.9]},
            {"label": "dense", "measured_ms": 3.2, "runoff_ms": [3.0, 4.6, 6.0]}]
    assert auto.rounds_won(both) == [3, 3, None] and auto.kept_plan(both, 9.0) == 0
    assert auto.final_plans(both, 9.0, 0.2) == ["a", "b"] and auto.final_plans(both, 9.0, 0.1) == []
    both[0]["runoff_ms"][2] = 7.0
    assert auto.kept_plan(both, 9.0) == 1 and auto.final_plans(both, 9.0, 1.0) == []


def test_auto_runoff_rounds_fit_in_runoff_s() -> None:
    steps = {"a": 3.0, "b": 3.1}  # 52 steps of each a round: 317.2 ms

    def per(label: str) -> int:
        return 52

    assert auto.runoff_rounds(steps, 3, 0.952, per) == 3  # 951.6 ms: 3 fit
    assert auto.runoff_rounds(steps, 3, 0.95, per) == 0  # 3 do not: none
    assert auto.runoff_rounds(steps, 2, 0.95, per) == 2
    assert auto.runoff_rounds(steps, 3, 5.0, per) == 15  # 15.8 fit in 5 s
    assert auto.runoff_rounds(steps, 3, 10.0, per) == 24  # MAX_RUNOFF_ROUNDS at most ...
    assert auto.runoff_rounds(steps, 30, 10.0, per) == 30  # ... unless more are asked for
    assert auto.runoff_rounds(steps, 3, 0, per) == 0  # runoff_s 0: never
    assert auto.runoff_rounds({"a": 0.0, "b": 0.0}, 3, 10.0, per) == 0  # nothing measured
    assert auto.runoff_rounds({}, 3, 10.0, per) == 0  # no plans


def test_auto_runoff_rounds_run_in_drawn_orders() -> None:
    ranked = ["a", "b", "c", "d"]  # fastest first
    sequence = auto.runoff_sequence(ranked, 8, "b")
    rounds = [sequence[i:i + 4] for i in range(0, len(sequence), 4)]
    assert len(rounds) == 8 and all(sorted(r) == ranked for r in rounds)  # each plan once a round
    assert rounds[0] == ["a", "d", "c", "b"]  # slowest first, rotated to end on the plan in force
    assert all(x != y for x, y in zip(["b", *sequence], sequence, strict=False))  # never twice in a row
    assert len({tuple(r) for r in rounds[1:]}) > 2  # the later rounds' orders are drawn
    before = {label: {sequence[i - 1] for i in range(1, len(sequence)) if sequence[i] == label} for label in ranked}
    assert all(len(plans) == 3 for plans in before.values()), before  # each plan follows every other (seed 0's draw)
    assert auto.runoff_sequence(ranked, 8, "b") == sequence  # a fixed seed: the same on every rank
    assert auto.runoff_sequence(["a", "b"], 3, "a") == ["b", "a", "b", "a", "b", "a"]
    assert auto.runoff_sequence(["a", "b", "c"], 1, None) == ["c", "b", "a"]
    assert auto.runoff_sequence([], 2, "a") == [] and auto.runoff_sequence(ranked, 0, None) == []
    assert auto.runoff_sequence(["a"], 3, "a") == ["a"] * 3  # (a runoff has two plans at least)


def test_auto_measures_a_plan_by_its_trimmed_mean_step() -> None:
    # 2 hosts at 10 Gbit/s, digits: steps fall in clusters 1.1 ms apart; fp16 came within 4% of dense's median step,
    # but more of its steps fell in the slower cluster, and it ran 1.2x slower
    dense = [2.2e-3] * 18 + [3.3e-3] * 2
    fp16 = [3.3e-3, 2.2e-3] * 9 + [2.2e-3] * 2
    assert statistics.median(fp16) == statistics.median(dense)  # the median step cannot tell them apart
    assert auto.step_ms(dense) == pytest.approx(2.2)  # the slowest 2 of 20 left out
    assert auto.step_ms(fp16) == pytest.approx((9 * 2.2 + 7 * 3.3) / 16)
    assert auto.step_ms(fp16) > 1.2 * auto.step_ms(dense)
    assert auto.step_ms([2e-3] * 19 + [1.0]) == pytest.approx(2.0)  # one stalled step of 20 does not count
    assert auto.step_ms([1e-3, 2e-3, 9e-3]) == pytest.approx(2.0)  # of 3 steps, the median
    assert auto.step_ms([1e-3, 2e-3, 3e-3, 4e-3, 40e-3]) == pytest.approx(3.0)  # of 5, the middle 3
    assert auto.step_ms([1e-3, 3e-3]) == pytest.approx(2.0)  # of 2, both
    assert auto.step_ms([2e-3]) == pytest.approx(2.0)
    with pytest.raises(statistics.StatisticsError):
        auto.step_ms([])


def test_auto_runs_off_the_close_plans_and_dense() -> None:
    # 4 hosts at 1 Gbit/s, digits: fp16 and dense measured 0.3% apart in the guard (timed: fp16 4.3 ms, dense 5.2)
    close = _tried(("powersgd", 8.46), ("fp16", 4.258), ("dense", 4.247))
    assert auto.runoff_plans(close, 4.3, 0.1, 0.5) == ["dense", "fp16"]
    assert auto.runoff_plans(_tried(("a", 3.0), ("b", 2.5)), 2.7, 0.1, 0) == ["b", "dense"]  # dense: the dense phase's
    assert auto.runoff_plans(_tried(("a", 3.0), ("b", 2.5)), 2.8, 0.1, 0) == []  # 12% apart
    assert auto.runoff_plans(_tried(("a", 3.0), ("b", 2.5)), 2.8, 0.2, 0) == ["b", "dense"]
    assert auto.runoff_plans(_tried(("a", 3.0), ("b", 2.5)), 2.8, 0.1, 0.5) == ["b", "dense"]  # dense within 50%
    # 2 hosts at 1 Gbit/s, digits: fp16 measured 2.6 ms in the guard, dense 3.6 (timed: fp16 4.2, dense 3.2)
    assert auto.runoff_plans(_tried(("onebit", 4.5), ("fp16", 2.6)), 3.6, 0.1, 0.5) == ["fp16", "dense"]
    assert auto.runoff_plans(_tried(("a", 2.6), ("b", 2.5)), 9.0, 0.1, 0.5) == ["b", "a"]  # dense far behind
    assert auto.runoff_plans(_tried(("a", 2.6), ("b", 2.5)), 3.0, 0.1, 0.5) == ["b", "a", "dense"]
    assert auto.runoff_plans(_tried(("a", 2.0)), 3.5, 0.1, 0.5) == []  # clearly faster than dense
    assert auto.runoff_plans(_tried(("dense", 2.0)), 2.1, 0.1, 0.5) == []  # dense alone: no runoff
    assert auto.runoff_plans([], 2.0, 0.1, 0.5) == []  # nothing tried: no runoff


def test_auto_runs_off_every_close_plan_where_measuring_is_cheap() -> None:
    # Shaped like 2 hosts at 1 Gbit/s, digits: dense measured 2.8 ms in the guard and fp16 3.4, 21% apart: no runoff by
    # runoff_band; timed, fp16 ran 1.23x faster than dense
    w = _tried(("efsignsgd", 4.0), ("onebit", 4.3), ("qsgd", 3.9), ("topk", 5.7), ("threshold", 3.5), ("bingrad", 4.6),
               ("fp16", 3.4), ("orq", 6.9), ("powersgd", 5.4), ("terngrad", 4.3), ("dense", 2.8))
    assert auto.runoff_plans(w, 2.9, 0.1, 0.5) == []

    def guard_steps(label: str) -> int:  # 2 to settle and 50 measured
        return 52

    close = ["dense", "fp16", "threshold", "qsgd", "efsignsgd"]  # within 50% of dense's 2.8, fastest first
    # a round: 52 steps of each, 17.6 ms together, 0.92 s: as many rounds as take 10 s, 24 at most
    assert auto.wide_runoff(w, 2.9, 0.5, 2, 10.0, guard_steps) == (close, 10)
    assert auto.wide_runoff(w, 2.9, 0.5, 2, 30.0, guard_steps) == (close, 24)
    assert auto.wide_runoff(w, 2.9, 0.5, 2, 4.0, guard_steps) == (close, 4)
    assert auto.wide_runoff(w, 2.9, 0.5, 2, 1.9, guard_steps) == (close, 2)
    assert auto.wide_runoff(w, 2.9, 0.5, 3, 1.9, guard_steps) == ([], 0)  # 3 rounds take 2.7 s
    assert auto.wide_runoff(w, 2.9, 0.5, 2, 0, guard_steps) == ([], 0)  # runoff_s 0: never
    assert auto.wide_runoff(w, 2.9, 0.2, 2, 10.0, guard_steps) == ([], 0)  # a narrower band: fp16 is 1.21x dense
    assert auto.wide_runoff(w, 2.9, 0.26, 2, 10.0, guard_steps) == (close[:3], 19)  # threshold at 1.25x: in
    assert auto.wide_runoff(w, 2.9, 0.5, 30, 30.0, guard_steps) == (close, 30)  # runoff above 24: as many as asked
    assert auto.wide_runoff(_tried(("a", 0.0)), 0.0, 0.5, 2, 10.0, guard_steps) == ([], 0)  # nothing measured
    # each plan's measurement at its own steps: dense predicted slower, fewer of its steps (a round: 0.23 s)
    assert auto.wide_runoff(_tried(("a", 3.0)), 10.0, 3.0, 2, 1.0, {"a": 52, "dense": 7}.get) == (["a", "dense"], 4)
    # dense from the dense steps; alone within the band, or no plan within it: none
    assert auto.wide_runoff(_tried(("a", 3.0)), 2.9, 0.5, 2, 10.0, guard_steps) == (["dense", "a"], 24)
    assert auto.wide_runoff(_tried(("a", 3.0)), 9.0, 0.5, 2, 10.0, guard_steps) == ([], 0)
    assert auto.wide_runoff(_tried(("dense", 3.0)), 2.9, 0.5, 2, 10.0, guard_steps) == ([], 0)
    # seconds steps (2 hosts at 10 Gbit/s, synthetic: 2 + 5 steps a measurement): the two rounds take 26 s; none
    assert auto.wide_runoff(_tried(("fp16", 547), ("mix", 526), ("dense", 789)), 906, 0.5, 2, 10.0,
                            lambda label: 7) == ([], 0)


def test_auto_tuner_runs_off_the_close_plans_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's state machine on one rank, with the step times scripted (the slowest rank's: here the one's):
    which plans it applies in which order, where each measurement goes, and what it keeps."""
    def guard(runoff: int, guard_ms: dict[str, float | list[float]], dense_ms: float,
              runoff_ms: dict[str, list[float]],
              dense_band: float = 0, predicted: dict[str, float] | None = None,
              later: dict[str, float] | None = None, runoff_s: float = 0) -> tuple[list[str], dict, list]:
        """The plans applied in turn, the report, the configs replanned to directly (dense: the base config).
        ``dense_band`` 0: dense runs off only as one of the two fastest. Plans are predicted at 1 ms (dense at 2)
        unless ``predicted`` says; the methods alone of ``later`` are ranked but not tried (candidates, measured
        at that if the guard widens to them). ``runoff_s`` 0: no runoff of every close plan (wide_runoff). A
        measurement is one step's ms, or a list: each of its steps'."""
        predicted, later = predicted or {}, later or {}
        settings = auto.AutoSettings(runoff=runoff, dense_band=dense_band, runoff_s=runoff_s)
        tuner, base, applied, replanned = auto.Tuner(settings, "base"), "base", [], []

        def apply(self: auto.Tuner, optimizer: object, plan: predict.Plan) -> None:
            applied.append(plan.label)
            self.report["label"] = plan.label
            optimizer.config = plan.label

        monkeypatch.setattr(auto.Tuner, "_apply", apply)
        optimizer = types.SimpleNamespace(config=base, process_set=None, _replan=replanned.append, _wait=None)
        plans = [predict.Plan(label, (), predicted.get(label, 1.0)) for label in guard_ms]
        ranked = [*plans, *(predict.Plan(label, (), predicted[label]) for label in later),
                  predict.Plan("dense", (), predicted.get("dense", 2.0))]
        tuner.by_label = {p.label: p for p in sorted(ranked, key=lambda p: p.step_ms)}
        tuner.plans, tuner.dense_ms, tuner.report["candidates"] = plans, dense_ms, list(later)
        tuner.report["dense_ms"] = dense_ms  # as _choose reports it
        measured = {label: [ms, *runoff_ms.get(label, [])] for label, ms in {**guard_ms, **later}.items()}
        measured.setdefault("dense", runoff_ms.get("dense", []))
        tuner._next_plan(optimizer)
        while tuner.phase != "settled":
            taken = measured[tuner.report["label"]].pop(0)
            tuner.samples.intervals = [ms / 1e3 for ms in (taken if isinstance(taken, list) else [taken])]
            tuner._judge(optimizer)
        assert not any(measured.values()), measured  # every scripted measurement was taken
        return applied, tuner.report, replanned

    monkeypatch.setattr(auto, "_agreed", lambda document, *args: document)  # one rank: the slowest is this one
    # a and b within 10%: each twice more, in turn, ending on the faster so far; a (median 4.6) beats b (4.7), and
    # c, measured once at 4.45, is not kept on that one measurement; a, in force after the runoff, is not re-applied
    applied, report, replanned = guard(2, {"a": 4.0, "b": 4.1, "c": 4.45}, 5.0, {"a": [4.6, 4.7], "b": [4.7, 4.8]})
    assert applied == ["a", "b", "c", "b", "a", "b", "a"] and replanned == [], applied
    assert [(t["label"], t.get("runoff_ms"), t["kept"]) for t in report["tried"]] == [
        ("a", [4.6, 4.7], True), ("b", [4.7, 4.8], False), ("c", None, False)], report
    assert report["label"] == "a" and report["phase"] == "settled"
    # fp16 0.3% behind dense's dense steps: dense joins the runoff (its entry says where its first step came from)
    # and loses it; the runoff starts from dense (fp16 is in force) and ends on fp16, which is kept
    applied, report, replanned = guard(2, {"fp16": 4.26}, 4.25, {"fp16": [4.3, 4.4], "dense": [5.1, 5.3]})
    assert applied == ["fp16", "dense", "fp16", "dense", "fp16"] and replanned == [], applied
    assert report["tried"][1] == {"label": "dense", "predicted_ms": 2.0, "measured_ms": 4.25, "dense_steps": True,
                                  "runoff_ms": [5.1, 5.3], "judged_ms": 5.1, "kept": False}, report
    assert report["label"] == "fp16" and report["tried"][0]["kept"]
    # ... or wins it: every parameter goes back to dense (the base config)
    applied, report, replanned = guard(2, {"fp16": 4.26}, 4.25, {"fp16": [4.3, 4.4], "dense": [4.0, 4.1]})
    assert replanned == ["base"] and report["label"] == "dense" and report["plan"] == [], report
    assert [t["kept"] for t in report["tried"]] == [False, True]
    # the faster of the two in force: the runoff starts from the other and ends on it
    applied, report, _ = guard(2, {"b": 4.1, "a": 4.0}, 5.0, {"a": [4.6, 4.7], "b": [4.7, 4.8]})
    assert applied == ["b", "a", "b", "a", "b", "a"] and report["label"] == "a", applied
    # the slower in force: the runoff ends on it; the faster wins, and is applied again
    applied, report, _ = guard(2, {"a": 4.0, "b": 4.1}, 5.0, {"a": [4.2, 4.3], "b": [4.6, 4.7]})
    assert applied == ["a", "b", "a", "b", "a", "b", "a"] and report["label"] == "a", applied
    # dense measured in the guard runs off as it is (no entry from the dense steps), and loses
    applied, report, replanned = guard(2, {"dense": 4.0, "a": 4.1}, 5.0, {"dense": [4.5, 4.6], "a": [4.2, 4.3]})
    assert applied == ["dense", "a", "dense", "a", "dense", "a"] and replanned == [], applied
    assert [(t["label"], "dense_steps" in t, t["kept"]) for t in report["tried"]] == [
        ("dense", False, False), ("a", False, True)], report
    # dense within dense_band of the fastest joins the two close ones: three run off, the first round dense, c, a
    # (slowest first) rotated to end on c, in force, the second in a drawn order (runoff_sequence); c (median 4.2)
    # beats dense (4.5) and a (4.6), and is applied again
    applied, report, replanned = guard(2, {"a": 4.0, "b": 4.3, "c": 4.1}, 5.0,
                                       {"a": [4.6, 4.7], "c": [4.2, 4.3], "dense": [4.4, 4.5]}, dense_band=0.5)
    assert applied == ["a", "b", "c", "a", "dense", "c", "dense", "c", "a", "c"] and replanned == [], applied
    assert [(t["label"], t.get("runoff_ms"), t["kept"]) for t in report["tried"]] == [
        ("a", [4.6, 4.7], False), ("b", None, False), ("c", [4.2, 4.3], True), ("dense", [4.4, 4.5], False)], report
    # 2 hosts at 1 Gbit/s, digits: fp16's one fast measurement (2.6 ms) is outvoted in turn with dense: dense is kept
    applied, report, replanned = guard(2, {"fp16": 2.6}, 3.6, {"fp16": [4.1, 4.3], "dense": [3.2, 3.3]},
                                       dense_band=0.5)
    assert applied == ["fp16", "dense", "fp16", "dense", "fp16"] and replanned == ["base"], applied
    assert report["label"] == "dense" and [t["kept"] for t in report["tried"]] == [False, True], report
    # ... as it ran there: dense measured last in the guard (3.6 ms, in force), so the runoff starts from fp16
    applied, report, replanned = guard(2, {"fp16": 2.6, "dense": 3.6}, 3.2, {"fp16": [4.1, 4.3], "dense": [3.2, 3.3]},
                                       dense_band=0.5)
    assert applied == ["fp16", "dense", "fp16", "dense", "fp16", "dense"] and replanned == ["base"], applied
    assert [(t["label"], "dense_steps" in t, t["kept"]) for t in report["tried"]] == [
        ("fp16", False, False), ("dense", False, True)], report
    # three run off, the plan in force (b, measured last) not among them: slowest first, ending on a, which wins
    applied, report, replanned = guard(2, {"a": 4.0, "c": 4.1, "b": 4.9}, 5.0,
                                       {"a": [4.2, 4.3], "c": [4.6, 4.7], "dense": [4.8, 4.9]}, dense_band=0.5)
    assert applied == ["a", "c", "b", "dense", "c", "a", "c", "dense", "a"] and replanned == [], applied
    assert report["label"] == "a" and [t["kept"] for t in report["tried"]] == [True, False, False, False], report
    # 4 hosts at 1 Gbit/s, synthetic: the model misranked the five tried (1.03x to 1.52x their predictions); the
    # guard widens to PowerSGD and ORQ (their predictions and measurements assumed), and keeps PowerSGD, 13% faster
    # than the rest (no runoff), applied again after ORQ
    five = {"mix": 691, "onebit": 800, "terngrad": 873, "efsignsgd": 886, "topk": 918}
    applied, report, replanned = guard(
        2, dict(zip(five, (1052.6, 1130.5, 945.2, 909.3, 1165.0), strict=True)), 2500, {}, dense_band=0.5,
        predicted={**five, "powersgd": 1000, "orq": 1200, "dense": 2600}, later={"powersgd": 790, "orq": 1000})
    assert applied == [*five, "powersgd", "orq", "powersgd"] and replanned == [], applied
    assert [t["label"] for t in report["tried"] if t.get("widened")] == ["powersgd", "orq"], report
    assert report["label"] == "powersgd", report
    assert [t["label"] for t in report["tried"] if t["kept"]] == ["powersgd"], report
    # Shaped like 2 hosts at 1 Gbit/s, digits (dense 2.8 ms, fp16 3.4, 21% apart), with runoff_s: dense,
    # fp16 and threshold within 50% of dense run off, 52 steps of each a round (0.50 s), 3 rounds in 1.6 s, the first
    # slowest first and ending on dense, in force; judged against the others in each round (3 rounds: blocks), fp16
    # (2.3 ms at the rounds' level, 2.8) beats dense (2.8), and fp16 is applied again
    applied, report, replanned = guard(2, {"fp16": 3.4, "threshold": 3.5, "onebit": 4.3, "dense": 2.8}, 2.9,
                                       {"fp16": [2.3, 2.4, 2.2], "threshold": [3.5, 3.6, 3.4],
                                        "dense": [2.8, 2.9, 2.7]}, dense_band=0.5, runoff_s=1.6)
    assert applied == ["fp16", "threshold", "onebit", "dense", "threshold", "fp16", "dense", "fp16", "threshold",
                       "dense", "fp16", "threshold", "dense", "fp16"], applied
    assert [(t["label"], len(t.get("runoff_ms", ())), t["kept"]) for t in report["tried"]] == [
        ("fp16", 3, True), ("threshold", 3, False), ("onebit", 0, False), ("dense", 3, False)], report
    assert report["label"] == "fp16" and replanned == [], report
    # fp16 won all 3 rounds against dense, clearly more than chance (clear_win: 3 of 3); threshold none
    assert [t.get("rounds_won") for t in report["tried"]] == [3, 0, None, None], report
    lines = auto.table({**report, "workers": 2, "dense_ms": 2.9, "dense_predicted_ms": 2.0,
                        "measure_s": 0.0}).splitlines()
    assert [line.rsplit("ms ", 1)[1] for line in lines if line.startswith("tried") and "runoff" in line] == [
        "(against the others in each round), faster than dense in 3 of 3 rounds, kept",
        "(against the others in each round), faster than dense in 0 of 3 rounds, dropped",
        "(against the others in each round), dropped"], lines
    # fp16 judged faster than dense again (2.4 ms at the rounds' level, against 2.9), but faster in only 2 of the 3
    # rounds: no plan is kept on the runoff, and fp16 runs a final against dense alone (final_plans), in as many rounds
    # as fit in runoff_s at their guard measurements (52 steps of 3.4 and 2.8 ms a round: 4), alternating, the first
    # round ending on dense, in force. Faster in all 4, fp16 is kept, and applied again
    runoff = {"fp16": [2.3, 2.4, 3.0], "threshold": [3.5, 3.6, 3.4], "dense": [2.8, 2.9, 2.7]}
    final = {"fp16": [2.5, 2.6, 2.4, 2.5], "dense": [2.8, 2.9, 2.7, 2.8]}
    applied, report, replanned = guard(2, {"fp16": 3.4, "threshold": 3.5, "onebit": 4.3, "dense": 2.8}, 2.9,
                                       {label: [*ms, *final.get(label, [])] for label, ms in runoff.items()},
                                       dense_band=0.5, runoff_s=1.6)
    assert applied[13:] == ["fp16", "dense"] * 4 + ["fp16"] and replanned == [], applied
    assert [(t["label"], t.get("rounds_won"), t.get("final_ms"), t.get("final_won"), t["kept"])
            for t in report["tried"]] == [("fp16", 2, final["fp16"], 4, True), ("threshold", 0, None, None, False),
                                          ("onebit", None, None, None, False),
                                          ("dense", None, final["dense"], None, False)], report
    assert report["label"] == "fp16", report
    text = auto.table({**report, "workers": 2, "dense_ms": 2.9, "dense_predicted_ms": 2.0, "measure_s": 0.0,
                       "plan": []})
    assert ("in the final against dense 2.5, 2.6, 2.4, 2.5 ms: judged 2.5 ms, faster than dense in 4 of 4 rounds, "
            "kept") in text, text
    assert "in the final against fp16 2.8, 2.9, 2.7, 2.8 ms: judged 2.8 ms, dropped" in text, text
    # ... faster in 3 of the 4: dense is kept
    final["fp16"][2] = 2.8
    applied, report, replanned = guard(2, {"fp16": 3.4, "threshold": 3.5, "onebit": 4.3, "dense": 2.8}, 2.9,
                                       {label: [*ms, *final.get(label, [])] for label, ms in runoff.items()},
                                       dense_band=0.5, runoff_s=1.6)
    assert replanned == ["base"] and report["label"] == "dense", report
    assert [t.get("final_won") for t in report["tried"]] == [3, None, None, None], report
    # three plans within 50% of each other run off, dense (9 ms) not among them: 3 rounds fit in runoff_s (52 steps of
    # each, 0.48 s a round); a, judged fastest, would be kept, and b, within 10% of it, is next: the two run a final, in
    # 5 rounds (0.32 s each), alternating, the first slowest first and ending on a; b, faster in most of them, is
    # kept and applied again
    final = {"a": [3.2, 3.3, 3.2, 3.3, 3.2], "b": [3.0, 3.1, 3.0, 3.1, 3.0]}
    applied, report, replanned = guard(2, {"a": 3.0, "b": 3.1, "c": 3.2}, 9.0,
                                       {"a": [3.0, 3.1, 3.0, *final["a"]], "b": [3.1, 3.2, 3.1, *final["b"]],
                                        "c": [3.6, 3.7, 3.6]}, dense_band=0.5, runoff_s=1.6)
    assert len(applied) == 3 + 9 + 10 + 1 and applied[12:22] == ["b", "a"] * 5, applied
    assert applied[22] == "b" and replanned == [] and report["label"] == "b", applied
    assert [(t["label"], t.get("final_ms"), t["kept"]) for t in report["tried"]] == [
        ("a", final["a"], False), ("b", final["b"], True), ("c", None, False)], report
    text = auto.table({**report, "workers": 2, "dense_ms": 9.0, "dense_predicted_ms": 2.0, "measure_s": 0.0})
    assert "in the final against a 3.0, 3.1, 3.0, 3.1, 3.0 ms: judged 3.0 ms, kept" in text, text
    # runoff 3 asked for and runoff_s 0 (no wide runoff): a, b and dense (3.4 ms, within dense_band) run off in 3
    # rounds; a and b both beat dense in all 3, and b is judged within 10% of a, but 3 rounds of a final do not fit in
    # runoff_s: no final, and a is kept
    applied, report, replanned = guard(3, {"a": 3.0, "b": 3.1, "c": 3.6}, 3.4,
                                       {"a": [3.0, 3.1, 3.0], "b": [3.1, 3.2, 3.1], "dense": [3.5, 3.6, 3.5]},
                                       dense_band=0.5)
    assert auto.final_plans(report["tried"], 3.4, 0.1) == ["a", "b"] and report["label"] == "a", report
    assert [(t["label"], len(t.get("runoff_ms", ())), t.get("final_ms")) for t in report["tried"]] == [
        ("a", 3, None), ("b", 3, None), ("c", 0, None), ("dense", 3, None)], report
    assert applied == ["a", "b", "c", "dense", "b", "a", "b", "dense", "a", "b", "dense", "a"] and replanned == [], \
        applied
    # runoff: 0, or the two fastest 13% apart (dense's 4.25, fp16's 4.8): none; the guard's measurements decide
    for runoff, guard_ms in ((0, {"fp16": 4.26}), (2, {"fp16": 4.8, "b": 5.0})):
        applied, report, replanned = guard(runoff, guard_ms, 4.25, {})
        assert applied == list(guard_ms) and replanned == ["base"] and report["label"] == "dense", report
        assert [t["label"] for t in report["tried"]] == list(guard_ms), report
        assert not any("runoff_ms" in t for t in report["tried"]), report
    # Shaped like fp16 on 2 hosts at 10 Gbit/s, digits: its median step (2.2 ms) beats the dense steps' 2.25, but the
    # guard measures its steps' trimmed mean (2.68) and keeps dense
    steps = [3.3, 2.2] * 9 + [2.2] * 2
    applied, report, replanned = guard(0, {"fp16": steps}, 2.25, {})
    assert statistics.median(steps) < 2.25 and replanned == ["base"] and report["label"] == "dense", report
    assert report["tried"][0]["measured_ms"] == pytest.approx(auto.step_ms([ms / 1e3 for ms in steps]), abs=1e-3)
