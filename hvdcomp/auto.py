"""``compression: auto``: per tensor, the method and collective this job's own measurements say pay, and never
slower than dense, checked by measurement.

    optimizer = hvdcomp.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression="auto")

    compression:                      # in a config (hvdcomp.config)
      method: auto
      options: {allow: [randomk], candidates: {topk: {ratio: 0.01}, terngrad: {}}, guard_steps: 5}
      dense: ["embedding.*"]          # min_numel, dense, seed and nonfinite apply as with any method

Espresso (Wang et al., EuroSys 2023) chooses a compression per tensor offline, in a simulator; here the job measures
and chooses while it trains. The optimizer starts dense and acts at step boundaries (the end of ``synchronize()``,
in the same step on every rank):

1. ``warmup_steps`` dense steps, not measured.
2. ``measure_steps`` dense steps, measured on every rank: the interval between consecutive steps' ends (the step
   time: data, forward, backward, communication, update), and, since the previous step's end, when each gradient
   became ready (its hook; on a GPU a CUDA event, read after the step) and when backward ended.
3. Once, after the last of them: the links (Horovod's negotiation round, then its allreduce, allgather and alltoall
   on the job's process set and device, 16 KiB up to a step's dense bytes (1 to 16 MiB), fitted as ``hvdcomp probe``
   fits them: :func:`hvdcomp.perfmodel.probe.horovod_round` and ``horovod_collectives``);
   each candidate's wire bytes, encoding and decoding on this step's gradients, configured as the optimizer would
   configure it (:func:`hvdcomp.perfmodel.profile.measure_compressor`, as ``hvdcomp profile`` measures); each
   gradient's non-finite check. All ranks measure at once, then every number is replaced by its maximum over the
   ranks (an allreduce, after one that drops any candidate some rank could not measure): the slowest rank's, the
   same on every rank.
4. Every rank ranks plans by the step the timeline predicts from those agreed numbers
   (:func:`hvdcomp.perfmodel.predict.choose_plans`: dense, each candidate alone, the per-tensor choices): identical
   inputs, identical ranking (checked), no broadcast. A plan is applied by rebuilding the optimizer's plan at a step
   boundary, checked across ranks as at start.
5. The guard: the plans to try (:func:`plans_to_try`: those predicted ``margin`` faster than dense, ``tries`` at
   most, the fastest first, then single methods in predicted order; where the model misjudged the measured dense
   step by more than ``margin``, as it does for millisecond steps, also those it predicts within its error of dense,
   up to ``tries``, and dense itself, last, unless a plan is predicted to pay beyond that error; or every method
   alone within it and dense, where measuring them is estimated at ``SURVEY_S`` (5 s) at most) are applied in turn,
   each measured for ``guard_steps`` steps, or ``guard_s`` seconds by its predicted step time if that is more (up to 50
   steps), after 2 steps to settle (and the rest of its methods' warm-ups, :meth:`Compressor.steady_from`, counted from
   the job's first step), by its mean step without the 10% fastest and slowest (:func:`step_ms`: what throughput sees;
   the slowest rank's), as the dense steps are. A plan measured more than DISTURBED (3) times both its predicted step
   and the dense step measured is measured again, once, after the others (:func:`disturbed_plans`: a disturbance,
   such as the link probe can leave, slowed it), and the new measurement stands. Then the plans tried are widened
   (:func:`widened_plans`): where their
   ratios of measured to predicted step differ, by a factor s (on noisy measurements they always differ a little), the
   methods alone not yet measured that would beat the fastest measured were their step their prediction x the lowest
   ratio / s are measured too, ``tries`` at most (marked ``widened``).
   With no plan to try, the job stays dense. The runoff (:func:`runoff_plans`): where the two fastest measured (dense
   among them: measured in the guard if it was, else in 2, and then, if it goes to the runoff, added to the plans tried,
   marked ``dense_steps``) are within ``runoff_band`` (10%) of each other, both, and where the fastest is not dense but
   dense measured within ``dense_band`` (50%) of it, the fastest and dense (all three if both hold), are measured
   ``runoff`` (2) more times each, in turn, as a benchmark interleaves its runs: one measurement can be off by as much
   as they differ. Where ``runoff`` rounds of every plan measured within ``dense_band`` of the fastest (dense among
   them) take at most ``runoff_s`` (30 s) by their measured steps (typically millisecond steps, where one measurement
   can be off by 2x), all of them run off instead, in as many rounds as take that, ``runoff`` at least and else 24 at
   most (:func:`wide_runoff`). A round measures each plan once, one after another, the first slowest first and the
   rest in orders drawn at random (:func:`runoff_sequence`). From 3 rounds on the rounds are blocks, as in a
   randomized block design: a round's measurements share its drift (the links' token buckets, Horovod's cycle, the
   machine), often larger than the plans' differences, so a plan is judged by its measurements each divided by its
   round's median over the runoff's plans: the median of these ratios (times the median round's level, to read in
   ms); over fewer rounds, by the median of its measurements (:func:`judged_ms`). Of the plans judged faster than
   dense (judged so if dense ran off, else its one measurement; after a runoff, of the runoff's plans) that, where
   dense ran off in 3 rounds or more, also measured faster than dense in clearly more of those rounds than chance gives
   a plan that runs like dense (a sign test, :func:`clear_win`: 3 of 3, 7 of 8, 11 of 16), the fastest so judged is
   kept (:func:`kept_plan`: keeping a plan slower than dense costs more than keeping dense where a plan
   is a little faster; applied again if it is not the plan in force); with none, every parameter goes back to dense.
   But after a runoff of three plans or more in 3 rounds or more, two plans first run a final, alone
   (:func:`final_plans`): where a plan is kept so, it and the next fastest that passed the same bar, if judged within
   ``runoff_band`` of it, and the faster in the final is kept; where none is kept and dense ran off, the fastest of
   the others and dense, if it was judged within ``runoff_band`` above dense or faster, and the final decides by the
   same rule. A final runs in as many rounds as fit in ``runoff_s`` by their measured steps, 3 to 24 (none where 3 do
   not fit: :func:`runoff_rounds`), and its rounds alone decide: a round of three plans or more measures two of them
   far apart.

Candidates: every registered method (``hvdcomp.METHODS``: a method added later joins) with its default options, or
those of ``candidates``, but those in :data:`ACCURACY_GUARD` unless ``allow`` names them, and, where the wrapped
optimizer has momentum, methods that apply momentum themselves (DGC), and those whose warm-up
(:meth:`Compressor.steady_from`) would outlast the guard. A candidate must declare its costs: its
reduction's phases (:meth:`hvdcomp.reductions.ReductionMethod.phases`) in collectives the timeline prices (a method
that owns a reduction without them is left out, with the reason in the report). Each may use any collective
``collective: auto`` resolves to for it (allgather or two-phase for gathered payloads). Every rank must register the
same methods: what the ranks measure is compared (a fingerprint in the agreeing allreduce), and a candidate that fails
to measure on one rank (out of memory) is left out on all.

A change of plan starts every compressed parameter's method state afresh on every rank, as an elastic reset does:
error-feedback residuals (what a biased method has not sent yet, a few steps' worth of small entries) are dropped.
The step counters go on, so the dense steps count towards a method's warm-up. A job resumed from a checkpoint
(``load_state_dict``) starts dense and measures and chooses again: the saved method state belongs to the plan in force
when it was saved, and only parameters compressed at loading take theirs back.
``optimizer.retune()`` starts again from step 1 (call it on every rank in the same step, after the cluster changed);
an elastic reset does too. ``optimizer.auto_report()`` holds the plan in force (per tensor: size, method, collective,
its predicted ms alone and dense's), the predicted step of every plan ranked (``predicted``, fastest first), the
measured step times and every plan tried (``tried``: predicted and measured ms, the first measurement of one measured
again (``disturbed_ms``), the runoff's measurements and the step
it was judged by, in how many rounds it measured faster than dense (``rounds_won``, from 3 rounds with dense on),
the final's measurements, judged step and rounds won (``final_ms``, ``final_judged_ms``, ``final_won``), whether it
was widened to and whether it was kept); ``hvdcomp train`` prints it and saves it in its JSON summary.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hvdcomp.config import CompressionConfig
    from hvdcomp.perfmodel.predict import Plan
    from hvdcomp.perfmodel.schema import Cluster, Profile

#: methods ``auto`` leaves out unless allowed, and why (docs/methods.md, accuracy at the defaults; docs/cluster.md;
#: perf/accuracy/README.md, glyphs on 2 ranks)
ACCURACY_GUARD = {
    "signsgd": "without momentum it ended 1.4 points under dense on digits on 2 hosts, did not reach 95% on 4, and "
               "turned unstable on glyphs; its default now, Signum, ended level with dense on glyphs at 2 ranks but "
               "has not run on more",
    "randomk": "at 1% it ended 5.0 and 2.0 points under dense on glyphs (seeds 0, 1) even with its momentum "
               "correction; under the optimizer's momentum it needed 8 more epochs than dense to reach 95% on digits "
               "on 2 hosts, did not reach it on 4, and collapsed on glyphs",
    "dgc": "applies momentum itself: the optimizer's momentum must be 0 for its parameters",
    "gravac": "adapts its own compression factor: its profile is one moment of it",
    "lgc": "its stages and autoencoder are not in a profile (the steady state only), and a state made afresh by a "
           "change of plan trains again first",
    "sketch": "sums sparse rows: for embeddings' gradients, chosen by configuration",
}
#: what the links are timed at (bytes): from the first, up to a step's dense bytes (what fusion may send at once)
#: within the other two; the bandwidth is fitted from the three largest sizes
LINK_BYTES = (1 << 14, 1 << 20, 1 << 24)
#: the names of auto's collectives start so
PREFIX = "hvdcomp.auto"
#: steps of a newly applied plan before it is measured (Horovod negotiates the new collectives' names once)
SETTLE_STEPS = 2
#: the most steps the guard measures one plan for by ``guard_s`` (and waits for a method's warm-up)
MAX_GUARD_STEPS = 50
#: seconds, at the dense step, within which the guard measures every method alone and dense where the model misjudged
#: the dense step (millisecond steps), rather than only ``tries`` plans (:func:`plans_to_try`)
SURVEY_S = 5.0
#: the fraction of a measurement's step intervals left out at each end, the fastest and the slowest, before they are
#: averaged, rounded up, and fewer than half (:func:`step_ms`)
TRIM = 0.1
#: the fewest rounds of a runoff judged by blocks (:func:`judged_ms`)
BLOCK_ROUNDS = 3
#: a plan other than dense is kept after a runoff of BLOCK_ROUNDS rounds or more with dense only if a plan that runs
#: like dense would measure faster than dense in as many of the rounds at most this often (:func:`clear_win`)
CLEAR_WINS = Fraction(1, 8)
#: the most rounds of a runoff or a final sized by ``runoff_s`` (:func:`runoff_rounds`)
MAX_RUNOFF_ROUNDS = 24
#: a plan measured more than this many times both its predicted step and the dense step measured is measured again,
#: once (:func:`disturbed_plans`)
DISTURBED = 3.0


def link_sizes(largest: int) -> list[int]:
    """16 KiB, then powers of 4 from 64 KiB up to ``largest`` bytes, but up to 1 MiB at least and 16 MiB at most."""
    smallest, least, most = LINK_BYTES
    top = min(max(largest, least), most)
    return [smallest, *(1 << bits for bits in range(16, top.bit_length(), 2))]


@dataclass(frozen=True)
class AutoSettings:
    """``options`` of ``method: auto`` (see the module docstring).

    Attributes:
        allow: methods of ACCURACY_GUARD that may be chosen all the same.
        candidates: method -> its options, the methods to choose from (default: every registered method with its
            defaults, but the guarded ones).
        warmup_steps: dense steps before measuring (at least 1: a step is timed from the previous one's end).
        measure_steps: dense steps measured (the step time to beat, the backward timeline).
        guard_steps: steps of a plan measured at least (after SETTLE_STEPS steps to settle).
        guard_s: seconds of a plan measured at least, by its predicted step time (up to MAX_GUARD_STEPS steps): a
            short step is a noisy one.
        margin: a plan is measured if predicted this fraction faster than dense (or, where the model misjudged
            the dense step by more than this fraction, predicted within its error of dense), and kept only if
            measured faster than dense.
        tries: plans chosen from the ranking at most: the fastest predicted to pay, then single methods in predicted
            order (where the model misjudged the dense step and measuring is cheap, every method alone within its
            error, and dense, are measured, past ``tries``: :func:`plans_to_try`); then up to this many more methods
            alone, widened to where the plans measured disagree with the model (:func:`widened_plans`).
        runoff: rounds of the runoff (at least, and up to MAX_RUNOFF_ROUNDS where ``runoff_s`` allows:
            :func:`wide_runoff`): where the two fastest plans measured (dense among them) are within
            ``runoff_band`` of each other, or dense within ``dense_band`` of the fastest (:func:`runoff_plans`: then
            the fastest and dense), each is measured this many more times, in turn, and of those judged faster than
            dense (from BLOCK_ROUNDS rounds on by their measurements against the others' in the same rounds, else
            by the median of their measurements: :func:`judged_ms`) that, from BLOCK_ROUNDS rounds with dense on,
            measured faster than dense in clearly more of them than chance gives (:func:`clear_win`), the fastest is
            kept (:func:`kept_plan`), or after a final (``runoff_s``), the final decides; 0: none.
        runoff_band: the two fastest run off if the slower measured at most this fraction above the faster (and a
            plan judged at most this above dense, or above the plan kept, runs a final against it:
            :func:`final_plans`): closer than that, one measurement cannot tell them apart (on the emulated cluster
            dense run twice in one launch measured 0.68x to 1.38x of itself in four launches, perf/history/RESULTS.md;
            the target is within 10% of the best).
        dense_band: dense runs off too if the fastest is not dense and dense measured at most this fraction above
            it: a plan is kept only if it beats dense in turn, unless it measured clearly faster (on the emulated
            cluster one measurement of fp16's 4.2 ms step read 2.6 ms, against dense's 3.6, and fp16 was kept: auto
            ran at 1.33x dense's step, perf/history/RESULTS.md); where the runoff is cheap (``runoff_s``), every plan
            measured within it of the fastest runs off.
        runoff_s: seconds a runoff may take, by the plans' measured steps: where ``runoff`` rounds of every plan
            measured within ``dense_band`` of the fastest (dense among them) take at most this (typically
            millisecond steps), all of them run off, in as many rounds as take this, ``runoff`` at least and else
            MAX_RUNOFF_ROUNDS at most (:func:`wide_runoff`): there one measurement can be off by 2x
            (perf/history/RESULTS.md), and measuring is cheap; and after any runoff of three plans or more in
            BLOCK_ROUNDS rounds or more, a final of two of them (:func:`final_plans`), in as many rounds as fit in this,
            BLOCK_ROUNDS to MAX_RUNOFF_ROUNDS, and none where BLOCK_ROUNDS do not (:func:`runoff_rounds`); 0: never.
            (10 up to launch AJ, with 8 rounds at most; replayed on the digits launches,
            ``perf/cluster/auto_replay.py``, 30 s and 24 rounds kept a plan truly within 10% of the best and 5% of
            dense in 93.9% of the draws, 10 s and 8 rounds in 90.1%, with the same rule against dense: tuning costs a
            job seconds once, a plan 10% slower every step.)
        repeats: timed runs of each candidate's encoding and decoding per gradient (the median is kept).
    """

    allow: tuple[str, ...] = ()
    candidates: Mapping[str, Mapping[str, Any]] | None = None
    warmup_steps: int = 3
    measure_steps: int = 5
    guard_steps: int = 5
    guard_s: float = 0.25
    margin: float = 0.05
    tries: int = 5
    runoff: int = 2
    runoff_band: float = 0.1
    dense_band: float = 0.5
    runoff_s: float = 30.0
    repeats: int = 3

    @classmethod
    def parse(cls, options: Any) -> AutoSettings:
        from hvdcomp import check
        from hvdcomp.config import make_compressor
        from hvdcomp.methods import METHODS

        options = options or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"options of method auto must be a mapping; got {options!r}")
        valid = [f.name for f in fields(cls)]
        for key in options:
            if key not in valid:
                raise ValueError(f"unknown option for auto {key!r}; valid: {', '.join(valid)}")
        for key, least in (("warmup_steps", 1), ("measure_steps", 2), ("guard_steps", 1), ("tries", 1),
                           ("runoff", 0), ("repeats", 1)):
            check.integer("auto", key, options.get(key, getattr(cls, key)), ge=least)
        check.number("auto", "margin", options.get("margin", cls.margin), ge=0, lt=1, noun="fraction")
        for key, noun in (("guard_s", "number of seconds"), ("runoff_band", "fraction"), ("dense_band", "fraction"),
                          ("runoff_s", "number of seconds")):
            check.number("auto", key, options.get(key, getattr(cls, key)), ge=0, noun=noun)
        allow = options.get("allow") or ()
        if not isinstance(allow, (list, tuple)) or not all(isinstance(m, str) for m in allow):
            raise check.invalid("auto", "allow", "a list of method names", allow)
        for method in allow:
            if method not in ACCURACY_GUARD:
                raise ValueError(f"auto's allow: {method!r} is not held back; held back: "
                                 f"{', '.join(sorted(ACCURACY_GUARD))}")
        candidates = options.get("candidates")
        if candidates is not None:
            if not isinstance(candidates, Mapping) or not candidates:
                raise ValueError(f"auto's candidates must be a mapping of method -> options; got {candidates!r}")
            for method, method_options in candidates.items():
                if not isinstance(method_options, (Mapping, type(None))):
                    raise ValueError(f"auto's candidates: the options of {method} must be a mapping; got "
                                     f"{method_options!r}")
            candidates = {str(m): dict(o or {}) for m, o in candidates.items()}
            for method, method_options in candidates.items():
                if method in ("none", "auto") or method not in METHODS:
                    raise ValueError(f"auto's candidates: unknown compression method {method!r}; valid: "
                                     f"{', '.join(sorted(set(METHODS) - {'none'}))}")
                if method in ACCURACY_GUARD and method not in allow:
                    raise ValueError(f"auto's candidates: {method} is held back ({ACCURACY_GUARD[method]}); add it "
                                     "to allow to choose it all the same")
                make_compressor(method, method_options)  # its options, checked now
        return cls(tuple(allow), candidates, *(options.get(key, getattr(cls, key)) for key in
                                               ("warmup_steps", "measure_steps", "guard_steps", "guard_s", "margin",
                                                "tries", "runoff", "runoff_band", "dense_band", "runoff_s",
                                                "repeats")))

    def methods(self) -> dict[str, Mapping[str, Any]]:
        """The candidate methods and their options."""
        from hvdcomp.methods import METHODS

        if self.candidates is not None:
            return dict(self.candidates)
        return {m: {} for m in METHODS if m != "none" and (m not in ACCURACY_GUARD or m in self.allow)}


def plans_to_try(plans: list[Plan], dense_ms: float, margin: float, tries: int, methods: Collection[str],
                 try_ms: float) -> list[Plan]:
    """The plans the guard measures, in order, from ``plans`` ranked by predicted step (dense among them), the dense
    step measured (``dense_ms``) and what measuring one plan takes at about that step (``try_ms``): those predicted
    ``margin`` faster than dense, ``tries`` at most: the fastest, then ``methods`` alone (a single method leaves no
    mix for the model to misjudge) in predicted order, then the rest.

    Where the model misjudged the dense step by more than ``margin`` (a ratio r between predicted and measured; at
    millisecond steps latency and bursts rule), plans it predicts within r of dense may pay too, and it can tell what
    pays only if a plan is predicted faster than dense by more than r. If measuring every method alone within r and
    dense is estimated at SURVEY_S at most (``try_ms`` each: an estimate at the dense step, while the guard sizes each
    plan by its predicted step, so up to MAX_GUARD_STEPS of its real one), all of them are measured; otherwise plans
    within r fill the tries left, and dense itself is measured unless a plan is predicted to pay beyond r. Dense
    comes last: a disturbance left by the link probe slows the first plan measured, which may drop a plan but can
    never keep one slower than dense."""
    def distinct(found: list[Plan]) -> list[Plan]:
        return list({id(p): p for p in found}.values())

    dense = next(p for p in plans if p.label == "dense")
    paying = [p for p in plans if p.step_ms * (1 + margin) < dense.step_ms]
    chosen = distinct([*paying[:1], *(p for p in paying if p.label in methods), *paying[1:]])[:tries]
    if dense_ms <= 0 or dense.step_ms <= 0:  # nothing measured or predicted to judge the model by
        return chosen
    ratio = max(dense.step_ms, dense_ms) / min(dense.step_ms, dense_ms)
    if ratio - 1 <= margin:
        return chosen
    unsure = [p for p in plans if p is not dense and p.step_ms < dense.step_ms * ratio]
    survey = distinct([*chosen, *(p for p in unsure if p.label in methods)])
    if survey and (len(survey) + 1) * try_ms <= SURVEY_S * 1e3:
        return [*survey, dense]
    chosen = distinct([*chosen, *unsure])[:tries]
    clear = any(p.step_ms < dense.step_ms / ratio for p in chosen)
    return [*chosen, dense] if chosen and not clear else chosen


def widened_plans(plans: list[Plan], tried: list[Mapping[str, Any]], methods: Collection[str],
                  tries: int) -> list[Plan]:
    """The ``methods`` alone to measure after the plans ``tried`` (label, predicted_ms, measured_ms), from ``plans``
    ranked by predicted step, ``tries`` at most, in predicted order. Where the ratio of measured to predicted step
    differs between the plans tried, by a factor s from the lowest ratio to the highest, the model cannot rank plans
    closer than s on this job: a method not yet measured might measure as low as its prediction x the lowest ratio /
    s, and those that could so beat the fastest measured are measured too. Any difference widens (measurements on a
    busy machine always differ a little), in proportion to it; a model off by the same factor for every plan adds
    none it ranked below the fastest measured. (On the emulated cluster, 4 hosts at 1 Gbit/s, the five plans
    tried measured 1.03x to 1.52x their predictions, and PowerSGD, predicted slower than all five, ran 1.15x faster
    than the one kept, perf/history/RESULTS.md.)"""
    measured = [t for t in tried if t["measured_ms"] and t["predicted_ms"] > 0]
    if len(measured) < 2:
        return []
    ratios = [t["measured_ms"] / t["predicted_ms"] for t in measured]
    spread = max(ratios) / min(ratios)
    floor = min(ratios) / spread  # the lowest ratio a plan not measured might have
    fastest = min(t["measured_ms"] for t in measured)
    done = {t["label"] for t in tried}
    return [p for p in plans if p.label in methods and p.label not in done and p.step_ms * floor < fastest][:tries]


def disturbed_plans(tried: Sequence[Mapping[str, Any]], dense_ms: float) -> list[str]:
    """The labels of the plans ``tried`` (label, predicted_ms, measured_ms) to measure again, once, in order: those
    measured more than DISTURBED times both their predicted step and ``dense_ms``, the dense step measured. A plan's
    own cost seldom does that; a disturbance does, and it passes: on the emulated cluster, of the 1,518 plans the
    guard measured in launches up to AI (perf/results/auto.jsonl), 5 did, all on 2 hosts and the digits model, at
    36.5 to 39.3 ms a step; in launch AI (2 hosts at 1 Gbit/s) the first three plans measured after the link probe,
    fp16 among them, the best alone, read so, against dense's 2.2 ms, and ran 2.2 to 3.5 ms when measured again in
    the runoff a little later: dropped on one measurement, fp16 never ran off (perf/history/RESULTS.md)."""
    return [t["label"] for t in tried
            if t["measured_ms"] and t["measured_ms"] > DISTURBED * max(t["predicted_ms"], dense_ms)]


def step_ms(intervals: Collection[float]) -> float:
    """One measurement's step in ms, from its steps' intervals (seconds): their mean without the ``TRIM`` fastest and
    slowest, one of each at least from 3 steps on (a trimmed mean: of 3 steps the median, of 5 the middle 3, of 50 the
    middle 40). The mean, because throughput is: millisecond steps run in clusters about 1.1 ms apart on the emulated
    cluster (Horovod's cycle), and a plan can come within 4% of dense's median step while more of its steps fall in
    the slower clusters (2 hosts at 10 Gbit/s, digits: fp16's median step 1.04x dense's, its mean 1.20x, its trimmed
    mean 1.12x, perf/history/RESULTS.md); trimmed, so that one stalled step (the first steps of a job run slower) does
    not decide a short measurement."""
    ordered = sorted(intervals)
    cut = min(math.ceil(len(ordered) * TRIM), (len(ordered) - 1) // 2)
    return 1e3 * statistics.fmean(ordered[cut:len(ordered) - cut])


def judged_ms(tried: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each plan's step as the guard judges it, in the order of ``tried`` (label, measured_ms and, for the runoff's
    plans, runoff_ms: one measurement a round, as many rounds for each). A plan not run off: its one measurement. The
    runoff's plans, where it ran BLOCK_ROUNDS rounds at least: the rounds are blocks; each measurement is divided by
    its round's median over the runoff's plans, and a plan's step is the median of these ratios times the median of
    the rounds' medians (a level, to read in ms). Over fewer rounds: the median of a plan's measurements, the guard's
    among them.

    Why blocks: a round measures its plans one after another within a second or two, and rounds drift as a whole by
    more than the plans differ (on the emulated cluster, 2 hosts at 100 Mbit/s, digits, launch AA: the five rounds'
    medians ranged 3.8 to 4.4 ms, and the two fastest methods timed 10% apart, perf/history/RESULTS.md). The median of a
    plan's raw measurements mixes rounds of different levels; its ratios to its rounds do not: a plan faster than the
    others in most rounds is judged faster. The guard's measurements are no round (a plan's and dense's are taken far
    apart), and a median of one or two ratios is no judgment. Re-judged so, the runoffs of the launches before AB on the
    emulated cluster (which chose this rule) keep a plan timed within 10% of the best in three settings more than the
    median did (two of them by under 1%), and in none fewer; in AB, the first launch since, it kept a plan timed 1.14x
    the best in the one setting where the two differ, where the median would have kept the best; in AC the two kept
    the same plans (``perf/cluster/auto.py --rejudge``, perf/history/RESULTS.md)."""
    judged = [float(t["measured_ms"]) for t in tried]
    ran_off = [i for i, t in enumerate(tried) if "runoff_ms" in t]
    rounds = list(zip(*(tried[i]["runoff_ms"] for i in ran_off), strict=True))
    if len(rounds) < BLOCK_ROUNDS:
        for i in ran_off:
            judged[i] = statistics.median([tried[i]["measured_ms"], *tried[i]["runoff_ms"]])
        return judged
    levels = [statistics.median(measured) for measured in rounds]
    level = statistics.median(levels)
    for column, i in enumerate(ran_off):
        judged[i] = level * statistics.median(measured[column] / mid
                                              for measured, mid in zip(rounds, levels, strict=True))
    return judged


def _measured_steps(tried: list[Mapping[str, Any]], dense_ms: float) -> dict[str, float]:
    """Label -> measured ms of the plans ``tried`` and dense (measured in the guard if it was, else ``dense_ms``)."""
    steps = {t["label"]: t["measured_ms"] for t in tried}
    steps.setdefault("dense", dense_ms)
    return steps


def runoff_plans(tried: list[Mapping[str, Any]], dense_ms: float, band: float, dense_band: float) -> list[str]:
    """The labels of the plans to run off, fastest first, from the plans ``tried`` (label, measured_ms) and dense
    (measured in the guard if it was, else ``dense_ms``): the two fastest if the slower measured at most ``band`` (a
    fraction) above the faster, and dense if the fastest is not dense and dense measured at most ``dense_band``
    above it; else none."""
    steps = _measured_steps(tried, dense_ms)
    if len(steps) < 2:
        return []
    first, second = sorted(steps, key=steps.__getitem__)[:2]
    close = [second] if steps[second] <= steps[first] * (1 + band) else []
    if first != "dense" and "dense" not in close and steps["dense"] <= steps[first] * (1 + dense_band):
        close.append("dense")
    return [first, *close] if close else []


def wide_runoff(tried: list[Mapping[str, Any]], dense_ms: float, band: float, rounds: int, budget_s: float,
                steps_of: Callable[[str], int]) -> tuple[list[str], int]:
    """Where measuring is cheap (typically millisecond steps), the labels of the plans to run off, fastest first,
    and the rounds: every plan ``tried`` (label, measured_ms) and dense (measured in the guard if it was, else
    ``dense_ms``) measured at most ``band`` (a fraction) above the fastest, in as many rounds as take ``budget_s`` at
    their measured steps (``steps_of(label)`` steps a measurement), ``rounds`` at least and else MAX_RUNOFF_ROUNDS at
    most. ``([], 0)`` where ``rounds`` rounds would take longer, nothing was measured (0 ms), or no other plan is
    within ``band``: then :func:`runoff_plans` decides. (On the emulated cluster, 2 hosts at 1 Gbit/s, digits: fp16
    measured 3.4 ms in the guard, 1.2x dense's 2.8, and ran 1.23x faster than dense when timed,
    perf/history/RESULTS.md.)"""
    steps = _measured_steps(tried, dense_ms)
    ranked = sorted(steps, key=steps.__getitem__)
    close = [label for label in ranked if steps[label] <= steps[ranked[0]] * (1 + band)]
    count = runoff_rounds({label: steps[label] for label in close}, rounds, budget_s, steps_of)
    return (close, count) if len(close) >= 2 and count else ([], 0)


def runoff_rounds(steps: Mapping[str, float], rounds: int, budget_s: float, steps_of: Callable[[str], int]) -> int:
    """How many rounds of the plans ``steps`` (label -> measured ms; ``steps_of(label)`` steps a measurement) to run:
    as many as take ``budget_s``, ``rounds`` at least and else MAX_RUNOFF_ROUNDS at most; 0 where ``rounds`` rounds
    would take longer or nothing was measured (0 ms)."""
    round_ms = sum(steps_of(label) * ms for label, ms in steps.items())
    if round_ms <= 0 or rounds * round_ms > budget_s * 1e3:
        return 0
    return max(rounds, min(MAX_RUNOFF_ROUNDS, math.floor(budget_s * 1e3 / round_ms)))


def runoff_sequence(ranked: list[str], rounds: int, current: str | None) -> list[str]:
    """The runoff's measurements in turn: ``rounds`` rounds of the plans ``ranked`` (fastest first), each plan once a
    round. The first round runs slowest first, ending on the fastest so far (rotated to end on ``current``, the plan
    in force, where it is among them); each later round in an order drawn at random (a fixed seed: the same on every
    rank, which run the same Python; a difference would fail the plan check at the next change of plan, not diverge),
    so that no plan keeps its place in the rounds, nor the plan before it (a round drifts within too: launch Z's first
    round measured orq, its first plan, at 3.3 ms and the other nine at 4.6 to 9.7, perf/history/RESULTS.md). No plan is
    measured twice in a row, so two plans simply alternate, each in the same place in every round. The last round
    need not end on the plan kept, which is then applied again (its method state afresh, as at any change of plan)."""
    if not ranked or rounds < 1:
        return []
    first = ranked[::-1]
    if current in first:
        last = first.index(current)
        first = [*first[last + 1:], *first[:last + 1]]
    sequence = list(first)
    draw = random.Random(0)
    for _ in range(rounds - 1):
        order = draw.sample(ranked, len(ranked))
        if len(order) > 1 and order[0] == sequence[-1]:
            order[0], order[1] = order[1], order[0]
        sequence += order
    return sequence


def rounds_won(tried: Sequence[Mapping[str, Any]]) -> list[int | None]:
    """For each of the plans ``tried`` (label and, for the runoff's plans, runoff_ms), in order: where it and dense ran
    off in BLOCK_ROUNDS rounds or more, how many of the rounds it measured faster than dense in (a tie is a loss);
    else None."""
    dense = next((t.get("runoff_ms") for t in tried if t["label"] == "dense"), None)
    if not dense or len(dense) < BLOCK_ROUNDS:
        return [None] * len(tried)
    return [sum(mine < theirs for mine, theirs in zip(t["runoff_ms"], dense, strict=True))
            if "runoff_ms" in t and t["label"] != "dense" else None for t in tried]


def kept_plan(tried: Sequence[Mapping[str, Any]], dense_ms: float) -> int | None:
    """Which of the plans ``tried`` (label, measured_ms and any runoff_ms) to keep, by :func:`judged_ms`: the fastest
    (after a runoff, of the runoff's plans: a plan measured once does not win over them on that one measurement) of
    those that are not dense and faster than dense (measured among them if it was, else ``dense_ms``) and, where dense
    ran off in BLOCK_ROUNDS rounds or more, measured faster than dense in clearly more of its rounds than chance gives
    (:func:`rounds_won`, :func:`clear_win`); None keeps dense. After a final (:func:`final_plans`), its two plans'
    final_ms alone decide, as a runoff of its own: against dense by the same rule; between two plans that both passed
    it, the faster.

    Why the rounds won: the targets weigh the two errors differently. A plan kept slower than dense breaks "never slower
    than dense"; dense kept where a plan is a little faster costs that little. So a plan must beat dense in clearly more
    rounds than chance gives, not only by its judged step: of two plans that run alike, one is faster in 7 of 8 rounds
    or more by chance 3.5% of the time (3 of 3: 12.5%), in 6 of 8 or more 14.5%. On the emulated cluster, 2 hosts at 10
    Gbit/s, digits, launch AB, fp16 was judged 2.6 ms against dense's 2.8 and was faster in 6 of 8 rounds; timed, it ran
    1.18x dense's step by throughput (1.06x by the median step), and a job of its own measured it slower than dense
    (``perf/cluster/auto_runoff.py``). The bar was set just above that case. Re-judged so, the runoffs of every launch
    up to AC keep dense in two settings where AB's rule (the judged step alone) kept fp16: AB's, and one where fp16
    timed 1.02x dense (``perf/cluster/auto.py --rejudge``). It errs too: in a job of its own on 2 hosts at 1 Gbit/s,
    where fp16 ran 0.85x dense's step (the steps' mean), a runoff of every candidate kept dense where fp16 won 6 of 8
    rounds (and where it won 3 of 5, judged slower than dense by its step itself); the six runoffs of fp16 and dense
    alone, at 1 and 10 Gbit/s, all judged right (perf/history/RESULTS.md): hence the final (:func:`final_plans`).

    Why a sign test (:func:`clear_win`) and not a share of the rounds: chance's margin shrinks as the rounds grow, a
    fixed share does not, so more rounds let a share tell a faster plan no better. A plan that wins 70% of the rounds
    passes "more than three quarters" about 1 time in 4 at 8 rounds and at 24 alike; the test's 16 of 24, 7 times in 10.
    Up to 10 rounds the two bars differ only at 5 (5 of 5; 4 of 5 was more than three quarters); at 16 rounds the test
    asks 11 and at 24, the most, 16, where three quarters asked 13 and 19. Replayed on the interleaved rounds of the 49
    digits settings of the launches up to AJ (``perf/cluster/auto_replay.py``, perf/history/RESULTS.md), the plan kept
    was truly within 10% of the best and 5% of dense in 93.9% of the draws with the test and ``runoff_s`` 30, in 92.7%
    with three quarters and the same ``runoff_s``, and in 90.1% as up to AJ (three quarters, ``runoff_s`` 10)."""
    finalists, final = final_view(tried)
    if finalists:
        if all(tried[i]["label"] != "dense" for i in finalists):  # both passed the bar against dense: the faster
            judged, before = judged_ms(final), judged_ms(tried)  # a tie: the one the runoff judged faster
            return finalists[min(range(len(final)), key=lambda k: (judged[k], before[finalists[k]]))]
        kept = kept_plan(final, dense_ms)
        return None if kept is None else finalists[kept]
    passing = _passing(tried, dense_ms)[0]
    return passing[0] if passing else None


def clear_win(won: int, rounds: int) -> bool:
    """Whether measuring faster than dense in ``won`` of ``rounds`` rounds is clearly more than chance: a plan that runs
    like dense wins each round as a coin toss, and wins ``won`` or more at most CLEAR_WINS of the time (a one-sided
    sign test, in exact arithmetic: 3 of 3 rounds, 4 of 4, 5 of 5, 5 of 6, 6 of 7, 7 of 8, 8 of 10, 11 of 16,
    16 of 24)."""
    return sum(math.comb(rounds, k) for k in range(won, rounds + 1)) <= CLEAR_WINS * 2 ** rounds


def _passing(tried: Sequence[Mapping[str, Any]], dense_ms: float) -> tuple[list[int], list[float]]:
    """The plans of ``tried`` that :func:`kept_plan` may keep (its rule, without a final), fastest first, and every
    plan's :func:`judged_ms`."""
    judged = judged_ms(tried)
    won = rounds_won(tried)
    dense_ms = next((judged[i] for i, t in enumerate(tried) if t["label"] == "dense"), dense_ms)
    ran_off = [i for i, t in enumerate(tried) if "runoff_ms" in t]
    clear = [i for i in ran_off or range(len(tried)) if tried[i]["label"] != "dense" and judged[i] < dense_ms
             and (won[i] is None or clear_win(won[i], len(tried[i]["runoff_ms"])))]
    return sorted(clear, key=judged.__getitem__), judged


def final_view(tried: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[dict[str, Any]]]:
    """The final's plans (those of ``tried`` with final_ms; none if there was no final): their indices in ``tried``,
    and each as a runoff of its own, its final_ms as its runoff_ms."""
    finalists = [i for i, t in enumerate(tried) if "final_ms" in t]
    view = [{**{key: value for key, value in tried[i].items() if key != "final_ms"}, "runoff_ms": tried[i]["final_ms"]}
            for i in finalists]
    return finalists, view


def final_plans(tried: Sequence[Mapping[str, Any]], dense_ms: float, band: float) -> list[str]:
    """The two plans to run off once more, alone, in a final, fastest first by :func:`judged_ms`, after a runoff of
    three plans or more in BLOCK_ROUNDS rounds or more (``tried``: label, measured_ms, runoff_ms):

    - where :func:`kept_plan` keeps a plan: it and the next fastest it might have kept (faster than dense and, where
      dense ran off, in clearly more of the rounds than chance gives: :func:`clear_win`), if that one was judged
      within ``band`` (a fraction) above it;
    - where it keeps none and dense ran off: the fastest other plan and dense, if it was judged within ``band``
      above dense or faster;

    else none (and after a final: one at most). Its rounds are as many as fit in ``runoff_s`` (:func:`runoff_rounds`).

    Why: a round of a wide runoff measures every plan in it once, one after another (on the emulated cluster up to
    ten, over a second or more), so two plans' measurements in one round lie far apart, and plans within 10% of each
    other are ranked by chance. In jobs of their own on 2 hosts at 1 Gbit/s, digits, where fp16 ran 0.85x dense's
    step, runoffs of every candidate kept dense where fp16 won 6 of 8 rounds, and where it won 3 of 5 and was judged
    2.80 ms against dense's 2.78; the six runoffs of fp16 and dense alone, at 1 and 10 Gbit/s, all judged right
    (``perf/cluster/auto_runoff.py``, perf/history/RESULTS.md). On 2 hosts at 100 Mbit/s, digits, launches AB and AC
    kept terngrad, judged 3 to 7% faster than the next plans, where onebit alone ran 0.88x and 0.81x terngrad's step
    (but switched in one optimizer, as auto runs them, onebit ran 0.92x to 0.98x terngrad's step in a job of its own: a
    final settles what auto's own plan runs at, which is what a user gets)."""
    ran_off = [i for i, t in enumerate(tried) if "runoff_ms" in t]
    if final_view(tried)[0] or len(ran_off) < 3 or len(tried[ran_off[0]]["runoff_ms"]) < BLOCK_ROUNDS:
        return []
    passing, judged = _passing(tried, dense_ms)
    if passing:  # the plan kept and the next
        if len(passing) < 2 or judged[passing[1]] > judged[passing[0]] * (1 + band):
            return []
        pair = passing[:2]
    else:  # none clearly faster than dense: the fastest other, against dense alone
        dense = next((i for i in ran_off if tried[i]["label"] == "dense"), None)
        if dense is None:
            return []
        best = min((i for i in ran_off if i != dense), key=judged.__getitem__)
        if judged[best] > judged[dense] * (1 + band):
            return []
        pair = sorted([best, dense], key=judged.__getitem__)
    return [tried[i]["label"] for i in pair]


class _Clock:
    """Marks in a step: host seconds on the CPU; on a GPU CUDA events (a hook runs when its gradient's kernels are
    queued, not when they are done), read after the step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the gradients' device, whichever is current here
        return event

    def seconds(self, origin: Any, mark: Any) -> float:
        if not self.cuda:
            return mark - origin
        mark.synchronize()
        return origin.elapsed_time(mark) / 1e3


@dataclass
class _Samples:
    """What the measured dense steps recorded, per step."""

    intervals: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    ready: dict[str, list[float]] = field(default_factory=dict)


class Tuner:
    """``compression: auto``'s state across steps (the module docstring's phases), driven by the optimizer: it calls
    :meth:`ready` from each gradient's hook, :meth:`backward_done` when ``synchronize()`` starts and
    :meth:`step_done` when it ends."""

    def __init__(self, settings: AutoSettings, base: CompressionConfig) -> None:
        self.settings, self.base = settings, base
        self.restart()

    def restart(self) -> None:
        self.phase = "warmup"
        self.steps = 0  # steps done in this phase
        self.settle = SETTLE_STEPS  # steps of a plan before the guard measures it
        self.guard = self.settings.guard_steps  # and the steps it measures
        self.samples = _Samples()
        self.plans: list[Plan] = []  # to measure
        self.by_label: dict[str, Plan] = {}  # every plan ranked
        self.trial = 0  # the entry of report["tried"] being measured
        self.retried = False  # the disturbed measurements were taken again (disturbed_plans), or there were none
        self.widened = False  # the plans tried were widened (widened_plans), or found to need none
        self.runoff_decided = False  # the runoff is under way, or there is none
        self.final_decided = False  # the final is under way, or there is none
        self.dense_ms = 0.0
        self.report: dict[str, Any] = {"phase": "measuring dense", "tried": []}
        self._clock: _Clock | None = None
        self._origin: Any = None  # the previous step's end, as the clock marks it
        self._last_end = 0.0  # and on the host clock
        self._marks: dict[str, Any] = {}
        self._backward_mark: Any = None

    @property
    def measuring(self) -> bool:
        return self.phase == "dense" and self._origin is not None

    def ready(self, name: str) -> None:
        if self.measuring:
            self._marks[name] = self._clock.mark()

    def backward_done(self) -> None:
        if self.measuring:
            self._backward_mark = self._clock.mark()

    def step_done(self, optimizer: Any) -> None:
        """After each step's ``synchronize()``, on every rank: records, and at a phase's end measures, chooses and
        applies (``optimizer._replan``)."""
        if self.phase == "settled":
            return
        if self._clock is None:
            self._clock = _Clock(optimizer._slots[0].param.device)
        now = time.perf_counter()
        if optimizer._skip_step:  # a non-finite step (nonfinite: skip) is not measured, nor measured on
            self._marks, self._backward_mark, self._origin, self._last_end = {}, None, None, now
            return
        self.steps += 1
        if self.phase == "warmup" and optimizer.config is not self.base:  # retune(): from dense again
            optimizer._replan(self.base)
            self.steps = 0  # the warm-up counts from here
        if self.phase == "warmup" and self.steps >= self.settings.warmup_steps:
            self.phase, self.steps = "dense", 0
        elif self.phase == "dense" and self._origin is not None:  # (after a skipped step: not timed)
            self._record(now)
            if len(self.samples.intervals) >= self.settings.measure_steps:
                self._choose(optimizer)
                self._next_plan(optimizer)
        elif self.phase == "guard":
            if self.steps > self.settle:
                self.samples.intervals.append(now - self._last_end)
            if self.steps >= self.settle + self.guard:
                self._judge(optimizer)
        self._marks, self._backward_mark = {}, None
        self._origin = self._clock.mark() if self.phase == "dense" else None
        self._last_end = time.perf_counter()

    def _record(self, now: float) -> None:
        clock, samples = self._clock, self.samples
        samples.intervals.append(now - self._last_end)
        samples.backward.append(clock.seconds(self._origin, self._backward_mark or clock.mark()))
        for name, mark in self._marks.items():
            samples.ready.setdefault(name, []).append(clock.seconds(self._origin, mark))

    def _choose(self, optimizer: Any) -> None:
        """Steps 3 and 4 of the module docstring: the costs, the links, the ranked plans."""
        from hvdcomp.perfmodel import predict

        started = time.perf_counter()
        live, excluded, fusion = self._live_profile(optimizer)
        cluster, links = _live_cluster(optimizer.process_set, optimizer._slots[0].param.device, live.dense_bytes,
                                       fusion, optimizer._wait)
        workers, margin = optimizer.process_set.size(), self.settings.margin
        plans = predict.choose_plans(cluster, live, workers, list(live.compressors), margin)
        self.by_label = {p.label: p for p in plans}
        dense = self.by_label["dense"]
        self.plans = plans_to_try(plans, self.dense_ms, margin, self.settings.tries, live.compressors,
                                  self.dense_ms * (SETTLE_STEPS + self._guard_steps(self.dense_ms)))
        # identical inputs give identical plans; checked, so that no rank replans alone
        _agreed({"plans": [[p.label, *(f"{n}={m}/{c}" for n, (m, c) in sorted(p.assignment().items()))]
                           for p in self.plans]}, optimizer.process_set, "max", optimizer._wait)
        self.report.update({"workers": workers, "margin": margin, "candidates": list(live.compressors),
                            "excluded": excluded, "dense_ms": round(self.dense_ms, 3),
                            "dense_predicted_ms": dense.step_ms, "links": links,
                            "predicted": {p.label: round(p.step_ms, 3) for p in plans},
                            "measure_s": round(time.perf_counter() - started, 3)})

    def _live_profile(self, optimizer: Any) -> tuple[Profile, dict[str, str], int]:
        """The job's profile from the measured dense steps and the candidates' costs on this step's gradients, agreed
        (the slowest rank's), the methods left out with why, and Horovod's fusion threshold (agreed too); sets
        ``dense_ms``, the measured dense step. A candidate that fails to measure (out of memory) on any rank, or that
        the timeline cannot price, is left out on every rank."""
        from hvdcomp.compressor import nonfinite
        from hvdcomp.config import make_compressor
        from hvdcomp.methods import METHODS
        from hvdcomp.perfmodel import profile, schema, timeline

        settings, samples, process_set = self.settings, self.samples, optimizer.process_set
        alone = profile.Ranks()
        device = optimizer._slots[0].param.device
        # copies: the reduced gradients are this step's update, which no measurement may touch
        named = [(slot.name, slot.param.grad.detach().clone()) for slot in optimizer._slots if slot.param.numel()]
        gradients = []
        for name, grad in named:
            wire_size = 4 if grad.dtype == torch.bfloat16 else grad.element_size()  # bfloat16 travels as float32
            gradients.append({"name": name, "numel": grad.numel(), "bytes": grad.numel() * wire_size,
                              "ready_ms": 1e3 * statistics.median(samples.ready.get(name) or samples.backward),
                              "check_ms": profile.median_ms(lambda g=grad: nonfinite(g), settings.repeats, alone,
                                                            device=device)})
        momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
        methods = settings.methods()
        excluded: dict[str, str] = {}
        measured: dict[str, dict[str, Any]] = {}
        for method, options in methods.items():
            if momentum and make_compressor(method, options).applies_momentum:
                excluded[method] = "applies momentum itself, and the optimizer has momentum"
                continue
            warm_until = METHODS[method](**options).steady_from()
            if warm_until > optimizer._steps_done + MAX_GUARD_STEPS:
                excluded[method] = (f"its warm-up runs to step {warm_until} (steady_from): past what the guard "
                                    f"waits for ({MAX_GUARD_STEPS} steps from here)")
                continue
            spec = {"method": method, "options": dict(options), "min_numel": self.base.min_numel,
                    "dense": list(self.base.dense), "seed": self.base.seed}
            try:
                found = profile.measure_compressor(spec, named, settings.repeats, alone, world=process_set.size(),
                                                   edge=optimizer._edges)
            except RuntimeError as error:  # out of memory, on this rank: every rank leaves it out below
                excluded[method] = f"measuring it failed on rank {process_set.rank()}: {error}"
                continue
            if not found:
                excluded[method] = "compresses none of the parameters"
                continue
            measured[method] = found
        # ranks measured alone and may finish far apart (a big model, an out-of-memory error): meet first, without the
        # step deadline, which knows nothing of measuring
        profile.ProcessSetRanks(process_set, PREFIX).barrier()
        everywhere = _agreed({"kept": {m: float(m in measured) for m in methods}}, process_set, "min",
                             optimizer._wait)["kept"]
        for method, kept in everywhere.items():
            if method in measured and not kept:
                excluded[method] = "left out on another rank (its measurement failed there)"
                del measured[method]
        fusion = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", schema.HOROVOD_FUSION_THRESHOLD_BYTES))
        document = _agreed({"kind": "profile", "model": "this job", "batch_size": 1, "device": device.type,
                            "forward_ms": 0.0, "optimizer_ms": 0.0,
                            "backward_ms": 1e3 * statistics.median(samples.backward),
                            "dense_ms": step_ms(samples.intervals), "fusion": fusion,
                            "gradients": gradients, "compressors": measured}, process_set, "max", optimizer._wait)
        self.dense_ms = document.pop("dense_ms")
        fusion = document.pop("fusion")
        live = schema.parse_profile(document, "auto")
        priced = {}
        for method, compressor in live.compressors.items():  # agreed numbers: the same verdict on every rank
            unpriced = timeline.priced(compressor, next(iter(compressor.gradients.values())), process_set.size())
            if unpriced:
                excluded[method] = unpriced
            else:
                priced[method] = compressor
        return replace(live, compressors=priced), excluded, fusion

    def _next_plan(self, optimizer: Any) -> None:
        """Applies the next plan to measure: those to try, then those disturbed (once each), then those widened to
        (once), then the runoff, if
        :func:`wide_runoff` or else :func:`runoff_plans` names plans (each again in each of its rounds:
        :func:`runoff_sequence`), then the final, if :func:`final_plans` names two plans and 3 rounds of them fit in
        ``runoff_s`` (:func:`runoff_rounds`); after the last, keeps the plan
        :func:`kept_plan` says (applied again if it is not the one in force), or goes back to dense."""
        self.phase, self.steps, self.samples = "guard", 0, _Samples()
        tried = self.report["tried"]
        if not self.plans and not self.retried:
            self.retried = True
            self.plans = [self.by_label[label] for label in disturbed_plans(tried, self.dense_ms)]
        if not self.plans and not self.widened:
            self.widened = True
            self.plans = widened_plans(list(self.by_label.values()), tried, self.report["candidates"],
                                       self.settings.tries)
        if not self.plans and not self.runoff_decided:
            self.runoff_decided = True
            settings = self.settings
            order: list[str] = []
            rounds = 0
            if settings.runoff:
                order, rounds = wide_runoff(tried, self.dense_ms, settings.dense_band, settings.runoff,
                                            settings.runoff_s, self._measurement_steps)
                if not order:
                    order = runoff_plans(tried, self.dense_ms, settings.runoff_band, settings.dense_band)
                    rounds = settings.runoff
            if "dense" in order and all(t["label"] != "dense" for t in tried):  # measured in the dense steps only
                tried.append({"label": "dense", "predicted_ms": self.by_label["dense"].step_ms,
                              "measured_ms": round(self.dense_ms, 3), "dense_steps": True, "kept": False})
            self.plans = [self.by_label[label] for label in runoff_sequence(order, rounds, self.report.get("label"))]
        if not self.plans and self.runoff_decided and not self.final_decided:
            self.final_decided = True
            finalists = final_plans(tried, self.report["dense_ms"], self.settings.runoff_band)
            rounds = runoff_rounds({t["label"]: t["measured_ms"] for t in tried if t["label"] in finalists},
                                   BLOCK_ROUNDS, self.settings.runoff_s, self._measurement_steps)
            self.plans = [self.by_label[label]
                          for label in runoff_sequence(finalists if rounds else [], rounds, self.report.get("label"))]
        if self.plans:
            plan = self.plans.pop(0)
            if self.runoff_decided:
                self.trial = next(i for i, t in enumerate(tried) if t["label"] == plan.label)
                tried[self.trial].setdefault("final_ms" if self.final_decided else "runoff_ms", [])
            elif self.retried and not self.widened:  # measured again: the new measurement stands
                self.trial = next(i for i, t in enumerate(tried) if t["label"] == plan.label)
                tried[self.trial]["disturbed_ms"] = tried[self.trial]["measured_ms"]
            else:
                self.trial = len(tried)
                tried.append({"label": plan.label, "predicted_ms": plan.step_ms, "measured_ms": None, "kept": False,
                              **({"widened": True} if self.widened else {})})
            self._apply(optimizer, plan)
            return
        for trial, judged, won in zip(tried, judged_ms(tried), rounds_won(tried), strict=True):
            if "runoff_ms" in trial:
                trial["judged_ms"] = round(judged, 3)
            if won is not None:
                trial["rounds_won"] = won
        finalists, final = final_view(tried)
        for i, judged, won in zip(finalists, judged_ms(final), rounds_won(final), strict=True):
            tried[i]["final_judged_ms"] = round(judged, 3)
            if won is not None:
                tried[i]["final_won"] = won
        fastest = kept_plan(tried, self.report["dense_ms"])  # as the report holds it: its verdict can be re-judged
        if fastest is not None:
            tried[fastest]["kept"] = True
            if tried[fastest]["label"] != self.report["label"]:
                self._apply(optimizer, self.by_label[tried[fastest]["label"]])
        else:
            for trial in tried:
                trial["kept"] = trial["label"] == "dense"
            self.report.update(label="dense", plan=[])
            if optimizer.config is not self.base:
                optimizer._replan(self.base)
        self.phase = "settled"
        self.report["phase"] = "settled"

    def _apply(self, optimizer: Any, plan: Plan) -> None:
        from hvdcomp import reductions
        from hvdcomp.config import CompressionConfig

        methods = self.settings.methods()
        overrides = []
        for choice in plan.choices:
            if choice.method == "none":
                continue
            selectable = choice.collective in reductions.selectable()  # else the method's only one: auto finds it
            overrides.append({"match": glob.escape(choice.name), "method": choice.method,
                              "options": dict(methods[choice.method]),
                              "collective": choice.collective if selectable else "auto"})
        config = CompressionConfig.parse({"method": "none", "min_numel": self.base.min_numel,
                                          "dense": list(self.base.dense), "seed": self.base.seed,
                                          "nonfinite": self.base.nonfinite, "overrides": overrides})
        self.report.update(phase="guard", label=plan.label, plan=[asdict(c) for c in plan.choices])
        optimizer._replan(config)
        # SETTLE_STEPS settle the plan, and its methods' warm-ups (Compressor.steady_from) run out unmeasured
        self.settle = SETTLE_STEPS + max([0, *(slot.choice.compressor.unwrapped().steady_from() - slot.step
                                               for slot in optimizer._slots if slot.choice.compressor is not None)])
        self.guard = self._guard_steps(plan.step_ms)  # the predicted step: agreed, like the count

    def _measurement_steps(self, label: str) -> int:
        """The steps one measurement of a ranked plan takes, SETTLE_STEPS among them (after the guard, its methods'
        warm-ups have run out)."""
        return SETTLE_STEPS + self._guard_steps(self.by_label[label].step_ms)

    def _guard_steps(self, step_ms: float) -> int:
        """The steps the guard measures a plan for, at ``step_ms`` a step."""
        wanted = math.ceil(self.settings.guard_s * 1e3 / step_ms) if step_ms > 0 else MAX_GUARD_STEPS
        return max(self.settings.guard_steps, min(wanted, MAX_GUARD_STEPS))

    def _judge(self, optimizer: Any) -> None:
        # the slowest rank's, waited for within the optimizer's deadline: a rank lost while auto measures ends the job
        measured = round(_agreed(step_ms(self.samples.intervals), optimizer.process_set, "max", optimizer._wait), 3)
        trial = self.report["tried"][self.trial]
        if self.final_decided:
            trial["final_ms"].append(measured)
        elif self.runoff_decided:
            trial["runoff_ms"].append(measured)
        else:
            trial["measured_ms"] = measured
        self._next_plan(optimizer)


def _live_cluster(process_set: Any, device: torch.device, largest: int, fusion: int,
                  wait: Callable[[int, str], Any]) -> tuple[Cluster, dict[str, dict[str, float]]]:
    """The links as the job's collectives see them: Horovod's negotiation round
    (:func:`hvdcomp.perfmodel.probe.horovod_round`), then its allreduce, allgather and alltoall among the process
    set's ranks on ``device``, at sizes up to ``largest`` bytes (:func:`link_sizes`), fitted (the slowest rank's
    times), with Horovod's tensor fusion up to ``fusion`` bytes; and, for the report, the round's latency and each
    collective's latency and bus bandwidth. Each of these collectives is waited for with ``wait`` (the optimizer's
    deadline): a rank lost or stalled while the others probe ends the job as it would in a step."""
    from hvdcomp.perfmodel import probe, profile, schema

    group = profile.ProcessSetRanks(process_set, f"{PREFIX}.probe", wait)
    round_s = probe.horovod_round(group, device, process_set, budget_s=0.2, prefix=f"{PREFIX}.probe")
    links = probe.horovod_collectives(group, link_sizes(largest), device, process_set, budget_s=0.2,
                                      prefix=f"{PREFIX}.probe", round_s=round_s)
    tier = {"latency_us": links["allreduce"]["latency_us"], "bandwidth_gbps": links["allreduce"]["busbw_gbps"],
            **links}
    # one rank per node: every collective is priced with what it measured among exactly these ranks
    round_us = round(round_s * 1e6, 3)
    cluster = schema.parse_cluster({"kind": "cluster", "name": f"this job ({process_set.size()} ranks)",
                                    "nominal": False, "ranks_per_node": 1, "inter_node": tier,
                                    "horovod": {"fusion_threshold_bytes": fusion, "round_us": round_us}}, "auto")
    return cluster, {"round": {"latency_us": round_us},
                     **{name: {"latency_us": link["latency_us"], "busbw_gbps": link["busbw_gbps"]}
                        for name, link in links.items()}}


def _agreed(document: Any, process_set: Any, op: str, wait: Callable[[int, str], Any]) -> Any:
    """``document`` with every number replaced by its maximum (or minimum) over the ranks, in one allreduce waited
    for with ``wait`` (the optimizer's deadline); integers stay integers. The rest of it (keys, strings, booleans,
    lengths) must be the same on every rank: a fingerprint of it travels along, and a difference raises."""
    import horovod.torch as hvd

    numbers: list[float] = []
    shape: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, Mapping):
            shape.append(f"{{{len(value)}")
            for key, item in value.items():
                shape.append(str(key))
                collect(item)
        elif isinstance(value, list):
            shape.append(f"[{len(value)}")
            for item in value:
                collect(item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers.append(float(value))
            shape.append("#")
        else:
            shape.append(repr(value))

    collect(document)
    digest = float(int.from_bytes(hashlib.blake2b("\x00".join(shape).encode(), digest_size=6).digest(), "little"))
    # the fingerprint's extremes both ways (it and its negation): they match only if it is the same everywhere
    values = torch.tensor([*numbers, digest, -digest], dtype=torch.float64)
    name = f"{PREFIX}.agree.{op}"
    *agreed, high, low = wait(hvd.allreduce_async(values, name=name, op=hvd.Max if op == "max" else hvd.Min,
                                                  process_set=process_set), name).tolist()
    if high != -low:
        raise ValueError("hvdcomp auto: the ranks measured different things (their documents differ in keys, "
                         "candidates or plans); every rank must use the same model, config and registered methods")
    found = iter(agreed)

    def rebuild(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: rebuild(item) for key, item in value.items()}
        if isinstance(value, list):
            return [rebuild(item) for item in value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = next(found)
            return int(number) if isinstance(value, int) else number
        return value

    return rebuild(document)


def table(report: Mapping[str, Any]) -> str:
    """``auto_report()`` as text: the plan in force as a table, then the plans tried."""
    from hvdcomp.perfmodel.predict import TensorChoice, plan_table

    if "why" in report:
        return f"auto: {report['label']} ({report['why']})"
    if report["phase"] != "settled":
        return f"auto: {report['phase']}" + (f" (trying {report['label']})" if report["phase"] == "guard" else "")
    plan = [TensorChoice(**c) for c in report.get("plan") or []]
    lines = []
    if plan:
        lines.append(plan_table(plan, report["workers"], title=f"auto's plan at {report['workers']} ranks: "
                                                               f"{report['label']} (ms: isolated costs, this job's "
                                                               "links and gradients)"))
    else:
        lines.append(f"auto's plan at {report['workers']} ranks: dense (no plan to try, or none measured clearly "
                     "faster than dense)")
    lines.append(f"dense step: measured {report['dense_ms']:.1f} ms, predicted {report['dense_predicted_ms']:.1f} ms; "
                 f"measuring took {report['measure_s']:.1f} s")
    finalists = [report["tried"][i]["label"] for i in final_view(report["tried"])[0]]
    for tried in report["tried"]:
        measured = "not measured" if tried["measured_ms"] is None else f"measured {tried['measured_ms']:.1f} ms"
        if tried.get("dense_steps"):
            measured += " (in the dense steps)"
        if tried.get("disturbed_ms"):
            measured += f" (again: first {tried['disturbed_ms']:.1f} ms)"
        if tried.get("widened"):
            measured += " (widened to)"
        if tried.get("runoff_ms"):
            how = "against the others in each round" if len(tried["runoff_ms"]) >= BLOCK_ROUNDS else "the median"
            measured += (", in the runoff " + ", ".join(f"{ms:.1f}" for ms in tried["runoff_ms"]) +
                         f" ms: judged {tried['judged_ms']:.1f} ms ({how})")
            if "rounds_won" in tried:
                measured += f", faster than dense in {tried['rounds_won']} of {len(tried['runoff_ms'])} rounds"
        if tried.get("final_ms"):
            (other,) = (label for label in finalists if label != tried["label"])
            measured += (f", in the final against {other} " + ", ".join(f"{ms:.1f}" for ms in tried["final_ms"]) +
                         f" ms: judged {tried['final_judged_ms']:.1f} ms")
            if "final_won" in tried:
                measured += f", faster than dense in {tried['final_won']} of {len(tried['final_ms'])} rounds"
        lines.append(f"tried {tried['label']}: predicted {tried['predicted_ms']:.1f} ms, {measured}, "
                     f"{'kept' if tried['kept'] else 'dropped'}")
    if report.get("excluded"):
        lines.append("not candidates: " + "; ".join(f"{m}: {why}" for m, why in report["excluded"].items()))
    return "\n".join(lines)
