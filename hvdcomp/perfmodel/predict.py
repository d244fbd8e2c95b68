"""``hvdcomp predict``: step time, throughput and speedup per compressor and worker count, the bandwidth
below which each compressor pays, and a recommendation, from a cluster YAML and a model profile.

    hvdcomp predict --cluster cluster.yaml --profile profile.yaml --workers 1,2,4,8,16 --plot scaling.png
    hvdcomp predict --cluster h100-nvlink-ib400 --profile profile.yaml      # a nominal preset by name

For each worker count (nodes filled first: ``ranks_per_node`` ranks per node) and each method, every
collective the method can use is simulated (:func:`hvdcomp.perfmodel.timeline.simulate`); the table shows
the one hvdcomp's ``collective: auto`` runs and the best one. Speedup is against one dense worker.
The recommendation is the fastest (method, collective) at the largest worker count; it says nothing about
accuracy (TernGrad and top-k change the gradients: check convergence with ``hvdcomp train --compare dense``).

From Python, :func:`predict` returns a :class:`Prediction`, and :func:`tensor_costs` the isolated cost of
each option for each gradient, what a per-tensor choice needs.

``--per-tensor N`` chooses per gradient, at N workers, a (method, collective) that hvdcomp can run, the way
``compression: auto`` does on a live job (:mod:`hvdcomp.auto`): :func:`choose_plans` ranks dense, each method alone,
the per-gradient choice by isolated cost (:func:`per_tensor_plan`: encode, collectives, decode, no overlap with
backward), and the fastest of these refined on the timeline; the fastest is chosen if predicted at least 5% faster
than dense.
Methods whose defaults lost accuracy on the shipped tasks (:data:`hvdcomp.methods.ACCURACY_GUARD`, with the reasons) are
not candidates unless ``--allow`` names them. It prints the chosen plan as a table (tensor, size, method, collective,
predicted ms alone, dense ms alone) and the plans ranked, and with ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hvdcomp import extras, reductions
from hvdcomp.methods import ACCURACY_GUARD
from hvdcomp.perfmodel import schema, timeline
from hvdcomp.perfmodel.schema import Cluster, Profile
from hvdcomp.perfmodel.timeline import Network, StepTime

PRESETS = Path(__file__).parent / "presets"
#: a compressor is recommended only if predicted this much faster than dense
MARGIN = 1.05


@dataclass(frozen=True)
class Option:
    step: StepTime
    samples_per_s: float
    speedup: float  # over one dense worker
    auto: bool  # what hvdcomp's collective: auto runs


@dataclass(frozen=True)
class BreakEven:
    """The bandwidth of ``tier`` at which ``method`` and dense take equally long; below it ``method`` wins."""

    method: str
    workers: int
    tier: str
    bandwidth_gbps: float | None
    verdict: str


@dataclass(frozen=True)
class Prediction:
    cluster: str
    nominal: bool
    model: str
    batch_size: int
    workers: tuple[int, ...]
    options: tuple[Option, ...]
    break_even: tuple[BreakEven, ...]
    recommendation: str

    def best(self, workers: int, method: str | None = None) -> Option:
        """The fastest option at ``workers`` (of ``method``, if given)."""
        candidates = [o for o in self.options if o.step.workers == workers and method in (None, o.step.method)]
        return min(candidates, key=lambda o: o.step.step_s)

    def auto(self, workers: int, method: str) -> Option:
        return next(o for o in self.options if o.step.workers == workers and o.step.method == method and o.auto)


def methods_of(profile: Profile) -> list[str]:
    return ["none", *profile.compressors]


def _options(cluster: Cluster, profile: Profile, workers: int, base: float) -> list[Option]:
    options = []
    for method in methods_of(profile):
        compressor = profile.compressors.get(method)
        auto = timeline.auto_collective(compressor, workers)
        plans = [auto] if workers == 1 else list(timeline.valid_plans(compressor))
        for plan in plans:
            step = timeline.simulate(profile, cluster, method, workers, plan)
            rate = workers * profile.batch_size / step.step_s
            options.append(Option(step, rate, rate / base, plan == auto))
    return options


def _scaled(cluster: Cluster, tier: str, factor: float) -> Cluster:
    values = {"intra_node": cluster.intra_node, "inter_node": cluster.inter_node}
    values[tier] = values[tier].scaled(factor)
    return Cluster(cluster.name, cluster.nominal, cluster.ranks_per_node, values["intra_node"],
                   values["inter_node"], cluster.fusion_threshold_bytes, cluster.round_us)


def break_even(cluster: Cluster, profile: Profile, method: str, workers: int) -> BreakEven:
    """Bisection on the bottleneck tier's bandwidth (all its measured bus bandwidths scaled alike)."""
    network = Network(cluster, workers)
    tier = "inter_node" if network.nodes > 1 or cluster.intra_node is None else "intra_node"
    link = getattr(cluster, tier)

    def gap(log_factor: float) -> float:  # < 0: the compressor is faster
        scaled = _scaled(cluster, tier, math.exp(log_factor))
        return (timeline.simulate(profile, scaled, method, workers).step_s
                - timeline.simulate(profile, scaled, "none", workers).step_s)

    low, high = math.log(1e-4), math.log(1e4)
    g_low, g_high = gap(low), gap(high)
    span = f"{link.bandwidth_gbps * 1e-4:.3g}-{link.bandwidth_gbps * 1e4:.3g} Gbit/s"
    if workers == 1:
        return BreakEven(method, workers, tier, None, "one worker: nothing to communicate")
    if g_low >= 0:
        return BreakEven(method, workers, tier, None, f"slower than dense at every {tier} bandwidth in {span}")
    if g_high < 0:
        return BreakEven(method, workers, tier, None, f"faster than dense at every {tier} bandwidth in {span}")
    for _ in range(40):
        middle = (low + high) / 2
        if gap(middle) < 0:
            low = middle
        else:
            high = middle
    bandwidth = link.bandwidth_gbps * math.exp((low + high) / 2)
    return BreakEven(method, workers, tier, bandwidth,
                     f"faster than dense below {bandwidth:.3g} Gbit/s of {tier} link bandwidth "
                     f"(this cluster: {link.bandwidth_gbps:.3g})")


def recommend(prediction_options: list[Option], workers: int) -> str:
    """The fastest option hvdcomp runs, against dense as it runs (flat allreduce): a parameter server and hierarchical
    allreduce are priced only for comparison (timeline.MODEL_ONLY)."""
    at = [o for o in prediction_options
          if o.step.workers == workers and o.step.collective not in timeline.MODEL_ONLY]
    dense = min((o for o in at if o.step.method == "none"), key=lambda o: o.step.step_s)
    best = min(at, key=lambda o: o.step.step_s)
    if best.step.method == "none" or dense.step.step_s / best.step.step_s < MARGIN:
        return (f"at {workers} workers: no compression (dense {dense.step.collective}, "
                f"{dense.step.step_s * 1e3:.1f} ms/step); no compressor is predicted {MARGIN:.2f}x faster")
    return (f"at {workers} workers: {best.step.method} over {best.step.collective}, {best.step.step_s * 1e3:.1f} "
            f"ms/step, {dense.step.step_s / best.step.step_s:.2f}x dense's throughput (dense "
            f"{dense.step.collective}: {dense.step.step_s * 1e3:.1f} ms); check accuracy before adopting it")


def _check_reductions(profile: Profile) -> None:
    """Raises where a compressor's ``reduction`` (written by a newer hvdcomp, or by hand) is none of this one's."""
    for method, compressor in profile.compressors.items():
        if compressor.reduction is not None and compressor.reduction not in reductions.REDUCTIONS:
            raise ValueError(f"profile: compressors.{method}.reduction {compressor.reduction!r} is not a reduction; "
                             f"valid: {', '.join(sorted(reductions.REDUCTIONS))}")


def predict(cluster: Cluster, profile: Profile, workers: list[int]) -> Prediction:
    """Every method and collective at every worker count, break-even bandwidths and a recommendation."""
    if not workers or any(w < 1 for w in workers):
        raise ValueError(f"workers must be positive integers; got {workers}")
    _check_reductions(profile)
    workers = sorted(set(workers))
    base = profile.batch_size / timeline.simulate(profile, cluster, "none", 1).step_s
    options = [o for w in workers for o in _options(cluster, profile, w, base)]
    top = workers[-1]
    evens = tuple(break_even(cluster, profile, m, top) for m in profile.compressors)
    return Prediction(cluster.name, cluster.nominal, profile.model, profile.batch_size, tuple(workers),
                      tuple(options), evens, recommend(options, top))


def tensor_costs(cluster: Cluster, profile: Profile, workers: int) -> dict[str, dict[str, float]]:
    """Per gradient, the seconds each (method/collective) takes on its own, encode + collective + decode,
    with no overlap: the cost a per-tensor choice would compare."""
    network = Network(cluster, workers)
    result: dict[str, dict[str, float]] = {}
    for gradient in profile.gradients:
        costs = {"none/allreduce": network.time("allreduce", gradient.bytes)}
        for method, compressor in profile.compressors.items():
            if gradient.name not in compressor.gradients:
                continue
            for plan in timeline.valid_plans(compressor):
                reduction = timeline.reduction_of(plan)
                e = timeline.in_parts(profile, compressor, gradient.name, reduction.parts(workers))
                phases = reduction.phases(e, workers)
                if plan in timeline.MODEL_ONLY:
                    wire = network.time(plan, e.wire_bytes)
                else:
                    wire = sum(network.time(phase.collective, phase.nbytes) for phase in phases)
                compute = (e.shared_ms + reduction.hook_ms(e) + sum(phase.compute_ms for phase in phases)
                           + reduction.decode_ms(e, workers))
                costs[f"{method}/{plan}"] = wire + compute * 1e-3
        result[gradient.name] = costs
    return result


@dataclass(frozen=True)
class TensorChoice:
    """One gradient's choice in a per-tensor plan: its method and collective, with their predicted cost and dense's."""

    name: str
    numel: int
    method: str
    collective: str
    predicted_ms: float
    dense_ms: float


def _isolated(costs: dict[str, float], profile: Profile, candidates: Sequence[str],
              margin: float = MARGIN - 1) -> tuple[tuple[str, str], float]:
    """One gradient's cheapest (method, collective) that ``collective: auto`` may pick, among ``candidates``, by
    isolated cost, kept where below dense's by ``margin``; dense otherwise."""
    dense = costs["none/allreduce"]
    best, best_cost = ("none", "allreduce"), dense
    for key, cost in costs.items():
        method, collective = key.split("/")
        compressor = profile.compressors.get(method)
        if compressor is None or method not in candidates:
            continue
        if collective in reductions.automatic(compressor) and cost * (1 + margin) < dense and cost < best_cost:
            best, best_cost = (method, collective), cost
    return best, best_cost


def guarded_candidates(profile: Profile, allow: Sequence[str] = ()) -> list[str]:
    """The profile's compressors but those held back by the accuracy guard (ACCURACY_GUARD) and not allowed."""
    return [m for m in profile.compressors if m not in ACCURACY_GUARD or m in allow]


def per_tensor_plan(cluster: Cluster, profile: Profile, workers: int, candidates: Sequence[str],
                    margin: float = MARGIN - 1) -> list[TensorChoice]:
    """Per gradient (in the order backward makes them ready), the cheapest option hvdcomp runs (not the model-only
    plans, not the sketch: the collectives ``collective: auto`` may pick) among ``candidates`` (the profile's
    compressors to choose from: :func:`guarded_candidates`), kept where its isolated cost (:func:`tensor_costs`) is
    below dense's by ``margin``; dense otherwise."""
    costs = tensor_costs(cluster, profile, workers)
    plan = []
    for gradient in profile.gradients:
        best, best_cost = _isolated(costs[gradient.name], profile, candidates, margin)
        plan.append(_choice(gradient, best, best_cost, costs[gradient.name]))
    return plan


def _choice(gradient: schema.Gradient, option: tuple[str, str], cost: float, costs: dict[str, float]) -> TensorChoice:
    return TensorChoice(gradient.name, gradient.numel, *option, round(cost * 1e3, 4),
                        round(costs["none/allreduce"] * 1e3, 4))


@dataclass(frozen=True)
class Plan:
    """A per-tensor plan (every gradient, in the order backward makes them ready) and the step the timeline
    predicts for it (:func:`hvdcomp.perfmodel.timeline.simulate_mixed`); ``label`` says how it was found."""

    label: str
    choices: tuple[TensorChoice, ...]
    step_ms: float

    def assignment(self) -> dict[str, tuple[str, str]]:
        """The compressed gradients' (method, collective); the others go dense."""
        return {c.name: (c.method, c.collective) for c in self.choices if c.method != "none"}


def choose_plans(cluster: Cluster, profile: Profile, workers: int, candidates: Sequence[str],
                 margin: float = MARGIN - 1) -> list[Plan]:
    """Per-tensor plans ranked by the step the timeline predicts (fastest first; each distinct plan once), dense
    among them: each candidate alone on every gradient it compresses (its ``collective: auto``), the isolated
    choice (:func:`per_tensor_plan`'s rule, with ``margin``), and the fastest of these refined on the timeline,
    where fusion and overlap with backward count: one pass over the gradients, largest first, giving each the option
    (dense, or a candidate with a collective ``collective: auto`` may pick) that shortens the predicted step most
    (each option must beat the best so far by 0.1%)."""
    _check_reductions(profile)
    costs = tensor_costs(cluster, profile, workers)
    gradients = {g.name: g for g in profile.gradients}
    options = {name: [("none", "allreduce"), *((method, collective) for method in candidates
                                               for collective in reductions.automatic(profile.compressors[method])
                                               if name in profile.compressors[method].gradients)]
               for name in gradients}

    def step_ms(assignment: dict[str, tuple[str, str]]) -> float:
        return timeline.simulate_mixed(profile, cluster, workers, assignment).step_s * 1e3

    def plan(label: str, assignment: dict[str, tuple[str, str]]) -> Plan:
        choices = []
        for name, gradient in gradients.items():
            option = assignment.get(name, ("none", "allreduce"))
            choices.append(_choice(gradient, option, costs[name]["/".join(option)], costs[name]))
        return Plan(label, tuple(choices), round(step_ms(assignment), 4))

    found = [plan("dense", {})]
    for method in candidates:
        compressor = profile.compressors[method]
        collective = timeline.auto_collective(compressor, workers)
        found.append(plan(method, {name: (method, collective) for name in compressor.gradients}))
    isolated = per_tensor_plan(cluster, profile, workers, candidates, margin)
    found.append(plan("per-tensor (isolated costs)", {c.name: (c.method, c.collective) for c in isolated
                                                      if c.method != "none"}))
    best = min(found, key=lambda p: p.step_ms)
    assignment, current = best.assignment(), best.step_ms
    for name in sorted(gradients, key=lambda n: -gradients[n].bytes):
        for option in options[name]:
            trial = {**assignment, name: option}
            if option[0] == "none":
                del trial[name]
            trial_ms = step_ms(trial)
            if trial_ms < current * 0.999:
                assignment, current = trial, trial_ms
    found.append(plan("per-tensor (timeline)", assignment))
    ranked: dict[tuple[tuple[str, tuple[str, str]], ...], Plan] = {}
    for candidate in sorted(found, key=lambda p: p.step_ms):
        ranked.setdefault(tuple(sorted(candidate.assignment().items())), candidate)
    return list(ranked.values())


def chosen_plan(plans: list[Plan], margin: float = MARGIN - 1) -> Plan:
    """The fastest plan if predicted ``margin`` faster than dense, else dense."""
    dense = next(p for p in plans if p.label == "dense")
    return plans[0] if plans[0].step_ms * (1 + margin) < dense.step_ms else dense


def ranking(plans: list[Plan], chosen: Plan) -> str:
    """The plans considered, fastest first, with the step the timeline predicts for each."""
    lines = ["plans by predicted step (the timeline: fusion and overlap with backward):"]
    lines += [f"  {p.step_ms:10.2f} ms  {p.label}{'  <- chosen' if p is chosen else ''}" for p in plans]
    return "\n".join(lines)


def plan_table(plan: list[TensorChoice], workers: int, title: str = "") -> str:
    """The plan as a table: per tensor its size, method, collective, and the predicted ms of it and of dense alone
    (encode, collectives, decode: isolated costs, no overlap with backward)."""
    header = f"{'tensor':>28} {'size':>11} {'method':>11} {'collective':>10} {'predicted ms':>12} {'dense ms':>9}"
    lines = [title or f"per-tensor plan at {workers} workers (isolated costs, no overlap with backward)", header,
             "-" * len(header)]
    lines += [f"{c.name:>28} {c.numel:>11,} {c.method:>11} {c.collective:>10} {c.predicted_ms:>12.3f} "
              f"{c.dense_ms:>9.3f}" for c in plan]
    chosen, dense = sum(c.predicted_ms for c in plan), sum(c.dense_ms for c in plan)
    lines.append(f"{'total':>28} {sum(c.numel for c in plan):>11,} {'':>11} {'':>10} {chosen:>12.3f} {dense:>9.3f}")
    return "\n".join(lines)


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster YAML file, or a preset's name (see ``hvdcomp predict --help``)."""
    path = Path(name_or_path)
    if not path.exists() and (PRESETS / f"{name_or_path}.yaml").exists():
        path = PRESETS / f"{name_or_path}.yaml"
    elif not path.exists():
        presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise FileNotFoundError(f"--cluster {name_or_path}: no such file, and not a preset; presets: {presets}")
    return schema.load(path, "cluster")


def table(prediction: Prediction) -> str:
    header = (f"{'workers':>7} {'method':>9} {'collective (auto)':>18} {'step ms':>9} {'samples/s':>10} "
              f"{'speedup':>8} {'MB/rank':>8} {'exposed ms':>10}   best collective")
    lines = [f"{prediction.model}, batch {prediction.batch_size} per worker, on {prediction.cluster}"
             f"{' (nominal)' if prediction.nominal else ' (measured)'}", header, "-" * len(header)]
    for workers in prediction.workers:
        for method in dict.fromkeys(o.step.method for o in prediction.options):
            o = prediction.auto(workers, method)
            best = prediction.best(workers, method)
            note = "" if best is o else f"{best.step.collective}: {best.step.step_s * 1e3:.1f} ms"
            lines.append(f"{workers:>7} {method:>9} {o.step.collective:>18} {o.step.step_s * 1e3:>9.1f} "
                         f"{o.samples_per_s:>10.1f} {o.speedup:>7.2f}x {o.step.bytes_per_rank / 1e6:>8.3f} "
                         f"{o.step.exposed_s * 1e3:>10.1f}   {note}")
    lines.append("")
    lines += [f"break-even {b.method} ({b.workers} workers): {b.verdict}" for b in prediction.break_even]
    lines.append(f"recommendation {prediction.recommendation}")
    return "\n".join(lines)


def plot(prediction: Prediction, path: str) -> None:
    with extras.required("perf", "hvdcomp predict --plot"):
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(o.step.method for o in prediction.options):
        chosen = [prediction.auto(w, method) for w in prediction.workers]
        left.plot(prediction.workers, [o.samples_per_s for o in chosen], marker="o", label=method)
        right.plot(prediction.workers, [o.speedup for o in chosen], marker="o", label=method)
    right.plot(prediction.workers, prediction.workers, color="grey", linestyle=":", label="linear")
    for axis, label in ((left, "samples/s"), (right, "speedup over 1 dense worker")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("workers")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    left.set_yscale("log")
    right.set_yscale("log", base=2)
    right.legend()
    kind = "nominal" if prediction.nominal else "measured"
    figure.suptitle(f"{prediction.model} (batch {prediction.batch_size}/worker) on {prediction.cluster} ({kind}); "
                    "hvdcomp's collective: auto")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
    parser = argparse.ArgumentParser(prog="hvdcomp predict", description=__doc__ + f"\npresets: {presets}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", required=True, help="a cluster YAML (hvdcomp probe) or a preset name")
    parser.add_argument("--profile", required=True, help="a profile YAML (hvdcomp profile)")
    parser.add_argument("--workers", default="1,2,4,8,16,32,64,128,256,512,1024",
                        help="comma-separated worker counts")
    parser.add_argument("--plot", metavar="PNG", help="write throughput and speedup vs workers")
    parser.add_argument("--json", metavar="PATH", help="write the prediction (or the --per-tensor plan) as JSON")
    parser.add_argument("--per-tensor", type=int, metavar="N",
                        help="print the per-tensor plan at N workers instead (method and collective per gradient)")
    parser.add_argument("--allow", default="",
                        help=f"comma-separated methods the per-tensor plan may use despite the accuracy guard: "
                             f"{', '.join(sorted(ACCURACY_GUARD))}")
    args = parser.parse_args(argv)
    allow = tuple(m for m in args.allow.split(",") if m)
    for method in allow:
        if method not in ACCURACY_GUARD:
            parser.error(f"--allow: {method!r} is not held back; held back: {', '.join(sorted(ACCURACY_GUARD))}")
    if args.per_tensor is not None:
        if args.per_tensor < 1:
            parser.error("--per-tensor must be >= 1")
        cluster, profile = load_cluster(args.cluster), schema.load(args.profile, "profile")
        try:
            plans = choose_plans(cluster, profile, args.per_tensor, guarded_candidates(profile, allow))
        except ValueError as error:
            parser.error(str(error))
        chosen = chosen_plan(plans)
        print(plan_table(list(chosen.choices), args.per_tensor))
        print(ranking(plans, chosen))
        if args.json:
            Path(args.json).write_text(json.dumps({"workers": args.per_tensor, "chosen": chosen.label,
                                                   "plans": [asdict(p) for p in plans]}, indent=1) + "\n")
        return 0
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--workers {args.workers!r}: expected comma-separated integers, e.g. 1,2,4,8")
    prediction = predict(load_cluster(args.cluster), schema.load(args.profile, "profile"), workers)
    print(table(prediction))
    if args.plot:
        plot(prediction, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(prediction), indent=1) + "\n")
    return 0
