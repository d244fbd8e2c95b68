"""``compression: auto``: per tensor, the method and collective that this job's own measurements say pay, kept only
if it beat dense clearly on the running job.

    optimizer = hvdcomp.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression="auto")

    compression:                      # in a config (hvdcomp.config)
      method: auto
      options: {allow: [randomk], candidates: {topk: {ratio: 0.01}, terngrad: {}}, plans: 3, budget_s: 5}
      dense: ["embedding.*"]          # min_numel, bucket_cap_mb, dense, seed and nonfinite apply as with any method

Espresso (Wang et al., EuroSys 2023) chooses a compression per tensor offline, in a simulator; here the job measures
and chooses while it trains, by one rule:

1. **Measure and predict.** The job starts dense. After WARMUP_STEPS steps it times MEASURE_STEPS dense steps (the
   step, and when each gradient became ready in backward), then, once, the links (Horovod's negotiation round and its
   allreduce, allgather and alltoall among the job's ranks, as ``hvdcomp probe`` fits them) and every candidate's
   wire bytes, encoding and decoding on this step's gradients (as ``hvdcomp profile`` measures them). Every number is
   replaced by its maximum over the ranks (the slowest rank's), so every rank ranks the same plans with the
   performance model's timeline (:func:`hvdcomp.perfmodel.predict.choose_plans`: dense, each method alone, mixes
   per tensor).
2. **Take dense and the few best predicted plans**: the fastest predicted, then single methods in predicted order,
   ``plans`` in all (:func:`plans_to_race`).
3. **Race them** in interleaved rounds until ``budget_s`` is spent, 3 rounds at least: each round applies every plan
   in turn, in an order drawn from the round's number (the same on every rank), lets it settle (SETTLE_STEPS, and
   its methods' warm-ups), and times about MEASURE_S of steps (MIN_STEPS to MAX_STEPS, by the plan's step as last
   measured, dense's in the first round: a prediction can be far off), the slowest rank's trimmed mean
   (:func:`step_ms`). A round's measurements share its drift (the links, the machine), so each plan is
   compared with dense in the same round. A raced plan skips non-finite steps whatever the job's ``nonfinite``
   policy (a plan auto tries must not end the job) and is left out of the race (``_drop``): at once under
   ``raise``, after MAX_STEPS + 1 such steps in one measurement under ``skip`` (a GradScaler's occasional overflow
   steps); the kept plan runs under the job's policy.
4. **Keep the fastest that beat dense clearly** (:func:`kept_plan`): a plan beat dense clearly if it was faster than
   dense in more rounds than a plan that runs like dense would be with probability above 1/8 (a sign test,
   :func:`clear_win`: 3 of 3, 7 of 8, 8 of 10); of those, the one with the lowest median ratio to dense over the
   rounds is kept. With none, every tensor stays dense: keeping a plan slower than dense costs every step, keeping
   dense where a plan was a little faster costs that little.

Candidates: every registered method (a method added later joins) with its defaults, or those of ``candidates``, but
those :data:`hvdcomp.methods.ACCURACY_GUARD` holds back for accuracy unless ``allow`` names them; where the wrapped
optimizer has momentum, methods that apply it themselves by default (``applies_momentum``: top-k, random-k, threshold,
DGC, signSGD, EF-signSGD: two momentums would compound); methods whose warm-up outlasts MAX_STEPS steps from
here; and methods whose reduction states no costs the timeline can price (the report says why each is left out).

A change of plan starts every compressed parameter's method state afresh (error-feedback residuals are dropped); the
step counters go on, so the dense steps count towards a method's warm-up. ``optimizer.retune()`` (on every rank, in
the same step) measures and chooses again from dense, as an elastic reset does. ``optimizer.auto_report()`` holds the
plan in force (per tensor: size, method, collective, predicted ms), every ranked plan's predicted step, the links, and
each raced plan's rounds, judged step and rounds won (:func:`table` prints it; ``hvdcomp train`` does).
The tuner drives the optimizer only through its public interface (:class:`hvdcomp.optimizer.Tuner`).
"""

from __future__ import annotations

import glob
import math
import random
import statistics
import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from hvdcomp import reductions
from hvdcomp.compressor import nonfinite
from hvdcomp.config import AutoSettings, CompressionConfig, make_compressor
from hvdcomp.methods import METHODS
from hvdcomp.perfmodel import live, predict, profile, schema, timeline

if TYPE_CHECKING:
    from hvdcomp.perfmodel.predict import Plan

#: dense steps before measuring (a step is timed from the previous one's end), and dense steps measured
WARMUP_STEPS, MEASURE_STEPS = 1, 3
#: timed runs of each candidate's encoding and decoding per gradient (the median is kept)
REPEATS = 3
#: steps of a newly applied plan before it is timed (Horovod negotiates the new collectives' names once)
SETTLE_STEPS = 2
#: seconds one measurement of a plan aims at, in MIN_STEPS to MAX_STEPS steps (:func:`measured_steps`)
MEASURE_S, MIN_STEPS, MAX_STEPS = 0.1, 2, 25
#: the fewest rounds of the race: a sign test cannot show a clear win in fewer
MIN_ROUNDS = 3
#: a plan beat dense clearly if one that runs like dense wins as many rounds at most this often (:func:`clear_win`)
CLEAR_WIN_P = 1 / 8
#: the fraction of a measurement's step intervals left out at each end before they are averaged (:func:`step_ms`)
TRIM = 0.1
#: the names of auto's collectives start so
PREFIX = "hvdcomp.auto"


def plans_to_race(ranked: Sequence[Plan], methods: Collection[str], count: int) -> list[Plan]:
    """Of ``ranked`` (plans by predicted step, fastest first, dense among them), the ``count`` to race against dense:
    the fastest predicted, then ``methods`` alone in predicted order (a single method leaves no mix for the model to
    misjudge), then the other mixes."""
    others = [p for p in ranked if p.label != "dense" and p.assignment()]
    order = [*others[:1], *(p for p in others[1:] if p.label in methods), *(p for p in others[1:]
                                                                           if p.label not in methods)]
    return order[:count]


def measured_steps(step_ms: float) -> int:
    """The steps one measurement of a plan times at ``step_ms`` a step (agreed, as every rank replans in the same
    step): about MEASURE_S, MIN_STEPS to MAX_STEPS."""
    wanted = math.ceil(MEASURE_S * 1e3 / step_ms) if step_ms > 0 else MAX_STEPS
    return max(MIN_STEPS, min(wanted, MAX_STEPS))


def race_order(labels: Sequence[str], round_index: int) -> list[str]:
    """The order of a round's measurements: drawn from the round's number, so the same on every rank, and a
    different one each round (no plan always follows the same one)."""
    order = list(labels)
    random.Random(round_index).shuffle(order)
    return order


def step_ms(intervals: Collection[float]) -> float:
    """A measurement's step in ms: the mean of its step intervals (seconds) without the TRIM fastest and slowest
    (rounded up, fewer than half): what throughput sees, without a passing stall."""
    ordered = sorted(intervals)
    cut = min(math.ceil(TRIM * len(ordered)), (len(ordered) - 1) // 2)
    kept = ordered[cut:len(ordered) - cut]
    return 1e3 * sum(kept) / len(kept)


def clear_win(won: int, rounds: int) -> bool:
    """Whether winning ``won`` of ``rounds`` rounds against dense is clearly more than chance: a plan that runs like
    dense wins as many or more with probability at most CLEAR_WIN_P (a one-sided sign test)."""
    tail = sum(math.comb(rounds, k) for k in range(won, rounds + 1)) / 2 ** rounds
    return rounds > 0 and tail <= CLEAR_WIN_P


def judge(tried: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each raced plan of ``tried`` (label, ``rounds_ms``: its measurement in each round, dense's entry among them)
    judged against dense round by round: ``judged_ms``, the median of its ratios to dense's measurement in the same
    round times dense's median; ``rounds_won``, the rounds it was faster than dense in; ``clear``, :func:`clear_win`.
    Dense's own entry is judged by its median."""
    dense = next(t["rounds_ms"] for t in tried if t["label"] == "dense")
    level = statistics.median(dense)
    verdicts = []
    for trial in tried:
        ratios = [ms / base for ms, base in zip(trial["rounds_ms"], dense, strict=True)]
        won = sum(r < 1 for r in ratios)
        is_dense = trial["label"] == "dense"
        verdicts.append({"judged_ms": round(statistics.median(ratios) * level, 3),
                         "rounds_won": None if is_dense else won,
                         "clear": not is_dense and clear_win(won, len(ratios))})
    return verdicts


def kept_plan(tried: Sequence[Mapping[str, Any]]) -> str:
    """The plan kept after the race: of those that beat dense clearly (:func:`judge`), the fastest judged; else
    dense."""
    verdicts = judge(tried)
    clear = [(v["judged_ms"], t["label"]) for t, v in zip(tried, verdicts, strict=True) if v["clear"]]
    return min(clear)[1] if clear else "dense"


class _Clock:
    """Marks in a step: host seconds on the CPU; on a GPU CUDA events (a hook runs when its gradient's kernels are
    queued, not when they are done), read after the step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

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
    """What the measured dense steps recorded, per step: the step intervals (s), backward's end and each gradient's
    readiness, from the previous step's end (s)."""

    intervals: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    ready: dict[str, list[float]] = field(default_factory=dict)


class Tuner:
    """``compression: auto``'s state across steps (the module docstring's rule), driven by the optimizer
    (:class:`hvdcomp.optimizer.Tuner`): phases ``warmup``, ``dense`` (measured), ``race`` and ``settled``."""

    def __init__(self, settings: AutoSettings, base: CompressionConfig) -> None:
        self.settings, self.base = settings, base
        self.restart()

    def restart(self) -> None:
        self.phase = "warmup"
        self.steps = 0  # steps of the current phase, or of the plan being measured
        self.samples = _Samples()
        self.by_label: dict[str, Plan] = {}
        self.queue: list[str] = []  # the current round's plans still to measure
        self.rounds = 0  # rounds begun
        self.started = 0.0  # when the race began (perf_counter)
        self.settle = SETTLE_STEPS
        self._skipped = 0  # non-finite steps of the plan being measured
        self.report: dict[str, Any] = {"phase": "measuring dense", "label": "dense", "plan": [], "tried": []}
        self._clock: _Clock | None = None
        self._origin: Any = None  # the previous step's end, as the clock marks it (while measuring dense)
        self._last_end = 0.0  # and on the host clock
        self._marks: dict[str, Any] = {}
        self._backward_mark: Any = None

    @property
    def measuring(self) -> bool:
        return self.phase == "dense" and self._origin is not None

    def gradient_ready(self, name: str) -> None:
        if self.measuring:
            self._marks[name] = self._clock.mark()

    def backward_done(self) -> None:
        if self.measuring:
            self._backward_mark = self._clock.mark()

    def step_done(self, optimizer: Any) -> None:
        """After each step's ``synchronize()``, on every rank: records, and at a phase's end measures, chooses and
        applies a plan (``optimizer.apply_config``)."""
        if self.phase == "settled":
            return
        if self._clock is None:
            self._clock = _Clock(optimizer.gradients()[0][1].device)
        now = time.perf_counter()
        if optimizer.step_skipped:  # a non-finite step (nonfinite: skip) is not measured, nor measured on
            self._marks, self._backward_mark, self._origin, self._last_end = {}, None, None, now
            if self.phase == "race" and self.report["label"] != "dense":
                self._skipped += 1
                if self.base.nonfinite == "raise" or self._skipped > MAX_STEPS:
                    self._drop(optimizer, f"{self._skipped} of its steps had non-finite gradients")
            return
        self.steps += 1
        if self.phase == "warmup":
            if optimizer.config is not self.base:  # retune(): back to dense, and the warm-up counts from here
                optimizer.apply_config(self.base)
                self.steps = 0
            if self.steps >= WARMUP_STEPS:
                self.phase, self.steps = "dense", 0
        elif self.phase == "dense" and self._origin is not None:  # (after a skipped step: not timed)
            self._record(now)
            if len(self.samples.intervals) >= MEASURE_STEPS:
                self._choose(optimizer)
                self._next_measurement(optimizer)
        elif self.phase == "race":
            if self.steps > self.settle:
                self.samples.intervals.append(now - self._last_end)
            if self.steps >= self.settle + self._trial()["steps"]:
                self._finish_measurement(optimizer)
        self._marks, self._backward_mark = {}, None
        self._origin = self._clock.mark() if self.phase == "dense" else None
        self._last_end = time.perf_counter()

    def _trial(self) -> dict[str, Any]:
        return next(t for t in self.report["tried"] if t["label"] == self.report["label"])

    def _record(self, now: float) -> None:
        clock, samples = self._clock, self.samples
        samples.intervals.append(now - self._last_end)
        samples.backward.append(clock.seconds(self._origin, self._backward_mark or clock.mark()))
        for name, mark in self._marks.items():
            samples.ready.setdefault(name, []).append(clock.seconds(self._origin, mark))

    def _choose(self, optimizer: Any) -> None:
        """Step 1 and 2 of the rule: the costs, the links, the ranking, the plans to race."""
        started = time.perf_counter()
        job, excluded, fusion = self._live_profile(optimizer)
        cluster, links = live.cluster(optimizer.process_set, self._clock.device, job.dense_bytes, fusion,
                                      optimizer.wait, PREFIX)
        workers = optimizer.process_set.size()
        ranked = predict.choose_plans(cluster, job, workers, list(job.compressors))
        self.by_label = {p.label: p for p in ranked}
        dense = self.by_label["dense"]
        raced = [dense, *plans_to_race(ranked, job.compressors, self.settings.plans)]
        self.report.update({
            "workers": workers, "candidates": list(job.compressors), "excluded": excluded,
            "dense_predicted_ms": dense.step_ms, "links": links,
            "predicted": {p.label: round(p.step_ms, 3) for p in ranked},
            "tried": [{"label": p.label, "predicted_ms": p.step_ms, "steps": measured_steps(self.report["dense_ms"]),
                       "rounds_ms": [], "kept": False} for p in raced]})
        # identical inputs give identical plans; checked, so that no rank races alone
        live.agreed({"raced": [[p.label, *(f"{n}={m}/{c}" for n, (m, c) in sorted(p.assignment().items()))]
                               for p in raced]}, optimizer.process_set, "max", optimizer.wait, PREFIX)
        self.report["measure_s"] = round(time.perf_counter() - started, 3)
        self.phase, self.started = "race", time.perf_counter()

    def _live_profile(self, optimizer: Any) -> tuple[schema.Profile, dict[str, str], int]:
        """The job's profile from the measured dense steps and the candidates' costs on this step's gradients, agreed
        (the slowest rank's), the methods left out with why, and Horovod's fusion threshold (agreed too); sets the
        report's ``dense_ms``. A candidate that fails to measure (out of memory) on any rank, or that the timeline
        cannot price, is left out on every rank."""
        samples, process_set = self.samples, optimizer.process_set
        alone = profile.Ranks()
        # copies: the reduced gradients are this step's update, which no measurement may touch
        named = [(name, grad.detach().clone()) for name, grad in optimizer.gradients() if grad.numel()]
        device = named[0][1].device
        gradients = []
        for name, grad in named:
            gradients.append({"name": name, "numel": grad.numel(), "bytes": profile.dense_bytes(grad),
                              "ready_ms": 1e3 * statistics.median(samples.ready.get(name) or samples.backward),
                              "check_ms": profile.median_ms(lambda g=grad: nonfinite([g]), REPEATS, alone,
                                                            device=device)})
        momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
        methods = self.settings.methods()
        excluded: dict[str, str] = {}
        measured: dict[str, dict[str, Any]] = {}
        for method, options in methods.items():
            if momentum and make_compressor(method, options).applies_momentum:
                excluded[method] = "applies momentum itself, and the optimizer has momentum"
                continue
            warm_until = METHODS[method](**options).steady_from()
            if warm_until > optimizer.steps_done + MAX_STEPS:
                excluded[method] = (f"its warm-up runs to step {warm_until} (steady_from): past what a measurement "
                                    f"waits for ({MAX_STEPS} steps from here)")
                continue
            spec = {"method": method, "options": dict(options), "min_numel": self.base.min_numel,
                    "dense": list(self.base.dense), "seed": self.base.seed}
            try:
                found = profile.measure_compressor(spec, named, REPEATS, alone, world=process_set.size(),
                                                   edge=optimizer.edges)
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
        everywhere = live.agreed({"kept": {m: float(m in measured) for m in methods}}, process_set, "min",
                                 optimizer.wait, PREFIX)["kept"]
        for method, kept in everywhere.items():
            if method in measured and not kept:
                excluded[method] = "left out on another rank (its measurement failed there)"
                del measured[method]
        document = live.agreed({"kind": "profile", "model": "this job", "batch_size": 1, "device": device.type,
                                "forward_ms": 0.0, "optimizer_ms": 0.0,
                                "backward_ms": 1e3 * statistics.median(samples.backward),
                                "dense_ms": step_ms(samples.intervals), "fusion": live.fusion_bytes(),
                                "check_all_ms": profile.median_ms(  # every gradient in one call (schema.Profile)
                                    lambda: nonfinite([g for _, g in optimizer.gradients()]), REPEATS, alone,
                                    device=device),
                                "gradients": gradients, "compressors": measured}, process_set, "max", optimizer.wait,
                               PREFIX)
        self.report["dense_ms"] = round(document.pop("dense_ms"), 3)
        fusion = document.pop("fusion")
        job = schema.parse_profile(document, "auto")
        priced = {}
        for method, compressor in job.compressors.items():  # agreed numbers: the same verdict on every rank
            unpriced = timeline.priced(compressor, next(iter(compressor.gradients.values())), process_set.size())
            if unpriced:
                excluded[method] = unpriced
            else:
                priced[method] = compressor
        return replace(job, compressors=priced), excluded, fusion

    def _next_measurement(self, optimizer: Any) -> None:
        """Applies the next plan of the round, starting a round where the last ended (the first, or while the budget
        lasts or fewer than MIN_ROUNDS ran); after the last, keeps :func:`kept_plan`'s plan."""
        tried = self.report["tried"]
        if not self.queue and len(tried) > 1:
            spent = self.report.get("race_s", 0.0)
            if self.rounds < MIN_ROUNDS or spent < self.settings.budget_s:
                self.rounds += 1
                self.queue = race_order([t["label"] for t in tried], self.rounds)
        if self.queue:
            self.phase, self.steps, self.samples, self._skipped = "race", 0, _Samples(), 0
            self._apply(optimizer, self.queue.pop(0), racing=True)
            self.settle = SETTLE_STEPS + optimizer.warmup_left()
            return
        kept = "dense" if len(tried) <= 1 else kept_plan(tried)
        for trial, verdict in zip(tried, judge(tried) if len(tried) > 1 else [{}], strict=True):
            trial.update(verdict, kept=trial["label"] == kept)
        if kept != "dense" or self.report["label"] != "dense":  # a kept plan anew: the job's nonfinite policy now
            self._apply(optimizer, kept, racing=False)
        self.phase = self.report["phase"] = "settled"

    def _finish_measurement(self, optimizer: Any) -> None:
        """The slowest rank's step and time spent racing (agreed, so every rank goes on alike), then the next."""
        measured, spent = live.agreed([step_ms(self.samples.intervals), time.perf_counter() - self.started],
                                      optimizer.process_set, "max", optimizer.wait, PREFIX)
        trial = self._trial()
        trial["rounds_ms"].append(round(measured, 3))
        trial["steps"] = measured_steps(measured)  # the next measurement's, by this one's step
        self.report["race_s"] = round(spent, 3)
        self._next_measurement(optimizer)

    def _drop(self, optimizer: Any, why: str) -> None:
        """Leaves the plan being measured out of the race for good (every rank in the same step: the non-finite
        verdict is agreed), then goes on with the next."""
        label = self.report["label"]
        self.report["tried"] = [trial for trial in self.report["tried"] if trial["label"] != label]
        self.report.setdefault("dropped", {})[label] = why
        warnings.warn(f"hvdcomp auto: plan {label} left out of the race: {why}", RuntimeWarning, stacklevel=2)
        self._next_measurement(optimizer)

    def _apply(self, optimizer: Any, label: str, racing: bool) -> None:
        """Applies the ranked plan ``label`` (dense: the base configuration) at this step boundary, to be measured in
        the race (``racing``) or kept."""
        self.report.update(phase="racing", label=label)
        if label == "dense":
            self.report["plan"] = []
            optimizer.apply_config(self.base)
            return
        plan = self.by_label[label]
        methods = self.settings.methods()
        overrides = []
        for choice in plan.choices:
            if choice.method == "none":
                continue
            selectable = choice.collective in reductions.selectable()  # else the method's only one: auto finds it
            overrides.append({"match": glob.escape(choice.name), "method": choice.method,
                              "options": dict(methods[choice.method]),
                              "collective": choice.collective if selectable else "auto"})
        self.report["plan"] = [asdict(c) for c in plan.choices]
        # a raced plan skips a non-finite step, whatever the job's policy, and is left out (_drop): a plan auto tries
        # (fp16's float16 sum can overflow where dense's does not) must not end the job; the kept plan has the policy
        nonfinite = "skip" if racing else self.base.nonfinite
        optimizer.apply_config(CompressionConfig.parse({
            "method": "none", "min_numel": self.base.min_numel, "bucket_cap_mb": self.base.bucket_cap_mb,
            "dense": list(self.base.dense), "seed": self.base.seed, "nonfinite": nonfinite,
            "overrides": overrides}))


def table(report: Mapping[str, Any]) -> str:
    """``auto_report()`` as text: the plan in force as a table, then each raced plan's rounds and verdict."""
    if "why" in report:
        return f"auto: {report['label']} ({report['why']})"
    if report["phase"] != "settled":
        return f"auto: {report['phase']}" + (f" (measuring {report['label']})" if report["phase"] == "racing" else "")
    plan = [predict.TensorChoice(**c) for c in report["plan"]]
    workers = report["workers"]
    lines = [predict.plan_table(plan, workers, title=f"auto's plan at {workers} ranks: {report['label']} (ms: "
                                                     "isolated costs, this job's links and gradients)")
             if plan else f"auto's plan at {workers} ranks: dense (no plan beat dense clearly)"]
    raced = len(report["tried"]) > 1
    lines.append(f"dense step: measured {report['dense_ms']:.1f} ms, predicted {report['dense_predicted_ms']:.1f} ms; "
                 f"measuring took {report['measure_s']:.1f} s" +
                 (f", racing {report.get('race_s', 0.0):.1f} s in {len(report['tried'][0]['rounds_ms'])} rounds"
                  if raced else " (no plan to race)"))
    for trial in report["tried"] if raced else []:
        rounds = ", ".join(f"{ms:.1f}" for ms in trial["rounds_ms"])
        verdict = "" if trial["label"] == "dense" else (
            f"; faster than dense in {trial['rounds_won']} of {len(trial['rounds_ms'])} rounds"
            f" ({'clearly' if trial['clear'] else 'not clearly'})")
        lines.append(f"{trial['label']}: predicted {trial['predicted_ms']:.1f} ms, rounds {rounds} ms, judged "
                     f"{trial['judged_ms']:.1f} ms{verdict}, {'kept' if trial['kept'] else 'dropped'}")
    if report.get("excluded"):
        lines.append("not candidates: " + "; ".join(f"{m}: {why}" for m, why in report["excluded"].items()))
    return "\n".join(lines)
