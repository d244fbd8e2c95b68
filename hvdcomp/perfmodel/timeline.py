"""One training step as a timeline: wait-free backprop, Horovod's tensor fusion, hvdcomp's scheduling.

:func:`simulate` prices one method on every gradient it compresses; :func:`simulate_mixed` a per-tensor plan (each
gradient its own method and collective, or dense), what ``compression: auto`` and ``predict --per-tensor`` rank.

The step is simulated on two resources, as it runs:

* the rank's compute thread: forward; backward, during which each parameter's post-accumulate-grad hook
  fires when its gradient is ready (:mod:`hvdcomp.optimizer`) and, for a compressed parameter, encodes it
  on this same thread (so encoding delays the rest of backward); the step's max-allreduce (the *vote*);
  then ``synchronize()``, which waits for each parameter's collective in the order they were started (the
  order gradients became ready) and decodes (aggregates) it; the optimizer step;
* Horovod's background thread: one collective at a time, in the order they were submitted; when it is
  free it fuses every waiting allreduce of the same kind into one, up to the fusion threshold (Sergeev and
  Del Balso, "Horovod", arXiv:1802.05799, tensor fusion; Horovod 0.28's 128 MiB default). It negotiates in
  rounds (a cycle every 1 ms, the ranks' coordination, horovod/common/operations.cc ``RunLoopOnce``): where the
  cluster states the round's cost (``horovod.round_us``, measured by :func:`hvdcomp.perfmodel.probe.horovod_round`),
  the collectives submitted before a round began share it, and each then pays only its own latency.

Compressors whose encoding needs values shared by all ranks (TernGrad's scaler sharing) only compute their
statistics in the hook; the vote starts at the last compressed gradient's hook, and their encoding follows it, at
the first later hook that finds the vote done or else in ``synchronize()`` (nothing waits for it inside
backward), so their communication cannot overlap backward. What a reduction sends, and the computation between
its collectives, is what the reduction class itself states (:meth:`hvdcomp.reductions.ReductionMethod.phases`): the
two-phase scheme's second collective is submitted from ``synchronize()`` after the owner has summed and
re-encoded its chunk; PowerSGD's Q allreduce after P's. Which reductions a method may use and which
``collective: auto`` picks come from :mod:`hvdcomp.reductions` too. Two plans are priced only for comparison
(hvdcomp does not run them): a parameter server (TernGrad's setting), one push-pull per gradient with the
server's decode and re-encode on the critical path, and a hierarchical allreduce.

Iteration time = forward + backward (+ encoding in hooks) + whatever communication and decoding does not
overlap + optimizer step: the overlap model of Zhang et al., "Poseidon" (ATC 2017) and Shi et al. (2018,
"MG-WFBP"), with hvdcomp's own ordering.

Not modeled: contention between the two resources. Communication and computation that overlap are each
charged as if alone (the probe times collectives with idle compute, the profile times compute without
collectives in flight); where they share cores, as ranks and their Horovod threads do on the emulated
cluster, steps run longer than predicted (docs/perfmodel.md, validation).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from hvdcomp import reductions
from hvdcomp.compressor import Compressor
from hvdcomp.perfmodel import costs
from hvdcomp.perfmodel.schema import Cluster, CompressorProfile, Encoded, Profile

#: plans priced for comparison only (hvdcomp runs neither), each with the reduction whose costs price it
MODEL_ONLY = {"hierarchical": "allreduce", "parameter_server": "allgather"}
#: what Network.time prices: "allreduce" is also what dense gradients use
PLANS = ("allreduce", "hierarchical", "allgather", "alltoall", "parameter_server")


class Network:
    """Collective times (seconds) for ``workers`` ranks laid out on ``cluster``'s nodes."""

    def __init__(self, cluster: Cluster, workers: int) -> None:
        self.cluster, self.workers = cluster, workers
        self.local, self.nodes = cluster.layout(workers)
        if self.nodes > 1 and cluster.inter_node is None:
            raise ValueError(f"cluster {cluster.name!r} has no inter_node link, so it cannot place {workers} "
                             f"workers ({cluster.ranks_per_node} ranks per node)")

    def link(self, collective: str | None) -> costs.Link:
        """The flat collective's bottleneck: the slower tier it crosses (a ring crosses both), or, where the probe
        measured ``collective`` across nodes, that measurement (its ranks spanned both tiers: the intra-node tier's
        figure is then a host-memory ping-pong, not what the collective ran on)."""
        intra, inter = self.cluster.intra_node, self.cluster.inter_node
        if self.nodes == 1:
            return (intra or inter).link(collective)
        if self.local == 1 or collective in inter.measured:
            return inter.link(collective)
        a, b = intra.link(collective), inter.link(collective)
        return costs.Link(max(a.alpha, b.alpha), max(a.beta, b.beta))

    def time(self, plan: str, nbytes: float) -> float:
        p = self.workers
        if plan == "allreduce":
            return costs.ring_allreduce(nbytes, p, self.link("allreduce"))
        if plan == "hierarchical":
            intra = (self.cluster.intra_node or self.cluster.inter_node).link("allreduce")
            inter = self.cluster.inter_node.link("allreduce") if self.nodes > 1 else intra
            return costs.hierarchical_allreduce(nbytes, self.local, self.nodes, intra, inter)
        if plan == "allgather":
            return costs.ring_allgather(nbytes, p, self.link("allgather"))
        if plan == "alltoall":
            inter = self.cluster.inter_node
            if self.nodes == 1 or self.local == 1 or "alltoall" in inter.measured:
                return costs.alltoall(nbytes, p, self.link("alltoall"))
            # a node's g ranks each send (p - g) / p of their bytes off the node, through its NICs together (a ring
            # sends one rank's share across each node boundary, an alltoall g of them)
            inside = costs.alltoall(nbytes, p, self.cluster.intra_node.link("alltoall"))
            link = inter.link("alltoall")
            across = (p - 1) * link.alpha + self.local * (p - self.local) / p * nbytes * link.beta
            return max(inside, across)
        if plan == "parameter_server":
            # one server's link, at the point-to-point speed Horovod's allgather reached on it
            server = self.cluster.inter_node if self.nodes > 1 else self.cluster.intra_node
            return costs.parameter_server(nbytes, p, (server or self.cluster.inter_node).link("allgather"))
        raise ValueError(f"unknown collective {plan!r}; valid: {', '.join(PLANS)}")


@dataclass(eq=False)
class Op:
    issued: float
    plan: str
    nbytes: float
    fuse: str | None = None  # ops with the same key fuse
    end: float = math.nan


class BackgroundThread:
    """Horovod's background thread: collectives one at a time, in submission order, with tensor fusion, in
    negotiation rounds: a collective submitted while none is under way, or after the round under way was negotiated,
    starts a round, which costs ``round_s`` before its first collective; the collectives submitted by then run in it
    (fused where they may), each paying only its own latency and bytes. With ``round_s`` 0 (not measured) every
    collective is a round of its own, and its latency holds the round's cost."""

    def __init__(self, cost: Callable[[str, float], float], fusion_threshold_bytes: int,
                 round_s: float = 0.0) -> None:
        self.cost, self.threshold, self.round_s = cost, fusion_threshold_bytes, round_s
        self.negotiated = -math.inf  # when the round under way began its negotiation
        self.free = 0.0
        self.pending: list[Op] = []
        self.busy = 0.0
        self.collectives = 0

    def submit(self, op: Op) -> Op:
        while self.pending and max(self.free, self.pending[0].issued) < op.issued:
            self._run_next()
        self.pending.append(op)
        return op

    def wait(self, op: Op) -> float:
        while math.isnan(op.end):
            self._run_next()
        return op.end

    def done_by(self, op: Op, time: float) -> bool:
        """Whether ``op`` has ended by ``time``: the collectives that start before it are run (as a submission at
        ``time`` would run them), none after."""
        while math.isnan(op.end) and self.pending and max(self.free, self.pending[0].issued) < time:
            self._run_next()
        return op.end <= time

    def _run_next(self) -> None:
        head = self.pending.pop(0)
        start = max(self.free, head.issued)
        negotiating = 0.0
        if not self.round_s or head.issued > self.negotiated:  # not in the round under way: a new round
            self.negotiated, negotiating = start, self.round_s
        batch, size = [head], head.nbytes
        if head.fuse is not None:
            for op in list(self.pending):
                if op.fuse == head.fuse and op.issued <= self.negotiated and size + op.nbytes <= self.threshold:
                    batch.append(op)
                    self.pending.remove(op)
                    size += op.nbytes
        duration = negotiating + self.cost(head.plan, size)
        self.free = start + duration
        self.busy += duration
        self.collectives += 1
        for op in batch:
            op.end = self.free


@dataclass(frozen=True)
class StepTime:
    """One simulated step (seconds), and the traffic one rank hands to collectives."""

    method: str
    collective: str
    workers: int
    step_s: float
    forward_s: float
    backward_s: float  # including work done in the hooks (encoding, statistics)
    encode_s: float
    decode_s: float
    optimizer_s: float
    communication_s: float  # the background thread's busy time
    exposed_s: float  # step time not spent computing: communication that did not overlap
    bytes_per_rank: float
    collectives: int = field(default=0)


def auto_collective(compressor: CompressorProfile | None, workers: int) -> str:
    """What hvdcomp runs with ``collective: auto`` (:func:`hvdcomp.reductions.choose`)."""
    return "allreduce" if compressor is None else reductions.choose(compressor, "auto", workers)


def valid_plans(compressor: CompressorProfile | None) -> tuple[str, ...]:
    """The reductions hvdcomp may run for ``compressor`` (:func:`hvdcomp.reductions.allowed`), then the
    model-only plans: hierarchical for what an allreduce carries, a parameter server for gathered payloads."""
    if compressor is None:
        return ("allreduce", "hierarchical")
    runnable = reductions.allowed(compressor)
    if compressor.reduction is not None:
        return runnable
    return (*runnable, "hierarchical" if compressor.summable else "parameter_server")


def priced(traits: CompressorProfile | Compressor, example: Encoded, workers: int) -> str | None:
    """Why the timeline cannot price the reductions ``collective: auto`` may pick for a method at ``workers`` ranks on
    a gradient whose measured costs are ``example`` (their phases name a collective Network.time does not know, as a
    method-owned reduction that states no costs of its own does, or fail on them), or None if it can."""
    for name in reductions.automatic(traits):
        try:
            phases = reductions.REDUCTIONS[name].phases(example, workers)
        except (ArithmeticError, IndexError, KeyError, TypeError, ValueError) as error:
            return f"its {name} reduction's costs (ReductionMethod.phases) failed on its measured payload: {error!r}"
        unknown = {phase.collective for phase in phases} - set(PLANS)
        if unknown:
            return (f"its {name} reduction states no costs the timeline can price (collectives "
                    f"{', '.join(sorted(unknown))}: ReductionMethod.phases)")
    return None


def reduction_of(plan: str) -> type[reductions.ReductionMethod]:
    """The reduction whose costs price ``plan`` (a model-only plan borrows the one it stands in for)."""
    return reductions.REDUCTIONS[MODEL_ONLY.get(plan, plan)]


def in_parts(profile: Profile, compressor: CompressorProfile, name: str, parts: int) -> Encoded:
    """``compressor``'s costs on gradient ``name`` where a reduction calls it ``parts`` times, each on an equal chunk
    (:meth:`hvdcomp.reductions.ReductionMethod.parts`: two-phase compresses, sums at the owner and decodes each rank's
    chunk in a call of its own). Each call costs what the profile measured on gradients of the chunk's size (the
    mean where several gradients share one): linear in the number of elements between the two nearest measured
    sizes; below the smallest, along the line through the two smallest, but at least its intercept (the launches)
    and at most the smallest's cost; and never more than the whole gradient's own call. The result sums the
    ``parts`` calls, so ``parts`` launch-bound calls (GPU kernels on small chunks) cost ``parts`` times one, and calls
    whose cost follows their size (the CPU's) about the whole gradient's. Bytes and the averaged write are the whole
    gradient's."""
    whole = compressor.gradients[name]
    if parts == 1:
        return whole
    numel = {gradient.name: gradient.numel for gradient in profile.gradients}
    by_size: dict[int, list[Encoded]] = {}
    for measured_name, measured in compressor.gradients.items():
        by_size.setdefault(numel[measured_name], []).append(measured)
    sizes = sorted(by_size)
    fields = ("shared_ms", "encode_ms", "decode_ms", "decode_extra_payload_ms")

    def mean(size: int) -> list[float]:
        return [sum(getattr(e, f) for e in by_size[size]) / len(by_size[size]) for f in fields]

    def line(low: int, high: int, at: float) -> list[float]:
        weight = (at - low) / (high - low)
        return [a + weight * (b - a) for a, b in zip(mean(low), mean(high), strict=True)]

    chunk = numel[name] / parts
    above = bisect.bisect_left(sizes, chunk)
    if above == 0 and len(sizes) == 1:
        call = mean(sizes[0])
    elif above == 0:  # below every measured size: between the launches (the intercept) and the smallest's cost
        call = [min(max(cost, intercept, 0.0), smallest) for cost, intercept, smallest in
                zip(line(sizes[0], sizes[1], chunk), line(sizes[0], sizes[1], 0), mean(sizes[0]), strict=True)]
    else:
        call = line(sizes[above - 1], sizes[above], chunk) if chunk < sizes[above] else mean(sizes[above])
    own = [getattr(whole, f) for f in fields]
    return replace(whole, **{f: parts * min(cost, limit) for f, cost, limit in zip(fields, call, own, strict=True)})


def simulate(profile: Profile, cluster: Cluster, method: str, workers: int, plan: str | None = None) -> StepTime:
    """The step time of ``method`` ("none" is dense) on ``workers`` ranks, with collective ``plan``
    (default: what hvdcomp's ``collective: auto`` picks)."""
    compressor = None
    if method != "none":
        if method not in profile.compressors:
            raise ValueError(f"profile of {profile.model!r} has no compressor {method!r}; valid: none, "
                             f"{', '.join(profile.compressors)}")
        compressor = profile.compressors[method]
    plan = plan or auto_collective(compressor, workers)
    if plan not in valid_plans(compressor):
        raise ValueError(f"{method} cannot use collective {plan!r}; valid: {', '.join(valid_plans(compressor))}")
    chosen = {name: (compressor, plan) for name in compressor.gradients} if compressor else {}
    return _timeline(profile, cluster, workers, chosen, method, plan,
                     "hierarchical" if plan == "hierarchical" else "allreduce")


def simulate_mixed(profile: Profile, cluster: Cluster, workers: int,
                   assignment: Mapping[str, tuple[str, str]]) -> StepTime:
    """The step time of a per-tensor plan: gradient name -> (method, collective), among those hvdcomp runs
    (:func:`hvdcomp.reductions.allowed`); gradients not named, or named with method ``none``, go dense."""
    chosen: dict[str, tuple[CompressorProfile, str]] = {}
    for name, (method, plan) in assignment.items():
        if method == "none":
            continue
        compressor = profile.compressors.get(method)
        if compressor is None or name not in compressor.gradients:
            raise ValueError(f"profile of {profile.model!r} has no costs of {method} on gradient {name!r}")
        if plan not in reductions.allowed(compressor):
            raise ValueError(f"{method} cannot use collective {plan!r} (gradient {name!r}); valid: "
                             f"{', '.join(reductions.allowed(compressor))}")
        chosen[name] = (compressor, plan)
    return _timeline(profile, cluster, workers, chosen, "per-tensor", "per-tensor", "allreduce")


def _timeline(profile: Profile, cluster: Cluster, workers: int, chosen: Mapping[str, tuple[CompressorProfile, str]],
              method: str, label: str, dense_plan: str) -> StepTime:
    """One step with each gradient in ``chosen`` compressed by its (compressor, collective) and the others dense,
    over ``dense_plan`` (allreduce, or the model-only hierarchical one)."""
    ms = 1e-3
    forward, backward, optimizer = profile.forward_ms * ms, profile.backward_ms * ms, profile.optimizer_ms * ms
    if workers == 1:  # DistributedOptimizer reduces nothing on one rank
        return StepTime(method, label, 1, forward + backward + optimizer, forward, backward, 0.0, 0.0, optimizer,
                        0.0, 0.0, 0.0)
    network = Network(cluster, workers)
    thread = BackgroundThread(network.time, cluster.fusion_threshold_bytes, cluster.round_us * 1e-6)
    gated = {name for name, (compressor, _) in chosen.items() if compressor.shared_before_encode}
    last_hook = max((i for i, g in enumerate(profile.gradients) if g.name in chosen), default=-1)
    ops: dict[str, Op] = {}
    sent = 0.0
    encode_total = 0.0
    delay = 0.0  # compute-thread time the hooks add to backward
    vote: Op | None = None

    def submit(name: str, at: float, phase: reductions.Phase) -> None:
        nonlocal sent
        compressor, plan = chosen[name]
        kind = {"allreduce": dense_plan}.get(phase.collective, phase.collective)
        if plan == "parameter_server":
            kind = plan
        fuse = f"{compressor.method}.allreduce" if kind == dense_plan else None
        ops[name] = thread.submit(Op(at, kind, phase.nbytes, fuse))
        sent += phase.nbytes

    encoded: dict[str, tuple[Encoded, type[reductions.ReductionMethod]]] = {}
    for name, (compressor, plan) in chosen.items():
        reduction = reduction_of(plan)
        encoded[name] = in_parts(profile, compressor, name, reduction.parts(workers)), reduction

    def encode_gated(start: float) -> float:
        """Every gated gradient encoded from ``start`` (in ready order), its first collective submitted; the end."""
        nonlocal encode_total
        now = start
        for name in (g.name for g in profile.gradients if g.name in gated):
            e, reduction = encoded[name]
            now += reduction.hook_ms(e) * ms
            encode_total += reduction.hook_ms(e) * ms
            submit(name, now, reduction.phases(e, workers)[0])
        return now

    waiting = False  # gated encodings waiting for the vote
    for index, gradient in enumerate(profile.gradients):
        hook = forward + gradient.ready_ms * ms + delay
        if waiting and vote is not None and thread.done_by(vote, hook):  # a later hook finds the vote done
            delay += encode_gated(hook) - hook
            hook = forward + gradient.ready_ms * ms + delay
            waiting = False
        if gradient.name not in chosen:
            ops[gradient.name] = thread.submit(Op(hook, dense_plan, gradient.bytes, "dense"))
            sent += gradient.bytes
        else:
            e, reduction = encoded[gradient.name]
            if chosen[gradient.name][0].checks_input:  # the input's non-finite check: an encoding can hide a NaN
                delay += gradient.check_ms * ms
                encode_total += gradient.check_ms * ms
            hook_work = (e.shared_ms if gradient.name in gated else reduction.hook_ms(e)) * ms
            delay += hook_work
            encode_total += hook_work
            if gradient.name not in gated:
                submit(gradient.name, forward + gradient.ready_ms * ms + delay, reduction.phases(e, workers)[0])
        if index == last_hook:
            now = forward + gradient.ready_ms * ms + delay
            vote_bytes = 4 * (len(chosen) + len(gated)) + 8  # flags (and scalers), the plan fingerprint
            vote = thread.submit(Op(now, "allreduce", vote_bytes))
            sent += vote_bytes
            waiting = bool(gated)  # nothing waits for the vote inside backward
    backward_end = forward + backward + delay
    now = backward_end
    if vote is not None:  # synchronize() waits for it, then encodes what it gates (if no hook did)
        now = max(now, thread.wait(vote))
        if waiting:
            now = encode_gated(now)
    decode_total = 0.0
    # synchronize(): passes over the compressed gradients in submission order (the order of readiness), each
    # waiting for one collective per reduction and starting its next (after the computation before it) or
    # decoding; then the dense gradients, long done.
    compressed = [g for g in profile.gradients if g.name in chosen]
    later_phases = {g.name: [] if chosen[g.name][1] == "parameter_server" else
                    encoded[g.name][1].phases(encoded[g.name][0], workers)[1:] for g in compressed}
    for index in range(1 + max((len(later) for later in later_phases.values()), default=0)):
        for gradient in compressed:
            later = later_phases[gradient.name]
            if index > len(later):
                continue
            now = max(now, thread.wait(ops[gradient.name]))
            e, reduction = encoded[gradient.name]
            if index < len(later):  # the reduction's next collective
                now += later[index].compute_ms * ms
                decode_total += later[index].compute_ms * ms
                submit(gradient.name, now, later[index])
                continue
            if chosen[gradient.name][1] == "parameter_server":  # the server sums every push and re-encodes the sum
                decode = (e.aggregate_ms(workers) + e.encode_ms + e.decode_ms) * ms
            else:
                decode = reduction.decode_ms(e, workers) * ms
            decode += e.finish_ms * ms  # the averaged sum written into the gradient
            now += decode
            decode_total += decode
    for gradient in profile.gradients:
        if gradient.name not in chosen:
            now = max(now, thread.wait(ops[gradient.name]))
    # synchronize()'s check of the reduced compressed gradients (dense ones pass unchecked), in one call once all are
    # in: at most the profile's call over every gradient, or their own checks summed where fewer (a pass a tensor)
    compressed = [gradient.check_ms for gradient in profile.gradients if gradient.name in chosen]
    checks = min(profile.sync_check_ms, sum(compressed)) * ms if compressed else 0.0
    now += checks
    decode_total += checks
    step = now + optimizer
    computing = forward + backward + encode_total + decode_total + optimizer
    return StepTime(method, label, workers, step, forward, backward + delay, encode_total, decode_total, optimizer,
                    thread.busy, max(step - computing, 0.0), sent, thread.collectives)
