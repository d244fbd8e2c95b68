"""``hvdcomp.DistributedOptimizer``: Horovod's DistributedOptimizer with compressed gradient reduction.

A drop-in for ``hvd.DistributedOptimizer`` (Horovod 0.28, ``horovod/torch/optimizer.py``): the same
arguments where they apply, and the same behaviour of ``synchronize()``, ``skip_synchronize()``, ``step()``,
``zero_grad()`` and ``backward_passes_per_step``, but one: ``step()`` right after ``synchronize()`` outside
``skip_synchronize()``, with no backward pass between, warns and uses the gradients as reduced, where Horovod reduces
them again (averaging averages; here it would compress them twice). It is built on Horovod's public async collectives
only.

Each step:

1. During backward, a post-accumulate-grad hook fires per parameter. Uncompressed parameters (small
   tensors, names listed as dense, method ``none``) start Horovod's own fused in-place allreduce, exactly as
   stock Horovod does. Compressed ones start their reduction (:mod:`hvdcomp.reductions`), a generator of
   typed requests (:mod:`hvdcomp.requests`) run as Horovod collectives (:mod:`hvdcomp.collectives`): what it
   asks for is started at once, so compression and communication overlap the rest of backward, until it asks
   for agreed values. Parameters that a reduction batches (PowerSGD's ``batch_tensors_with_same_shape``), and
   the config's buckets (``bucket_cap_mb``: gradients of one method, reduced by its ``reduce_bucket``), start
   together, in one reduction, once the last of them has its gradient.
2. When every compressed parameter has started, one small collective (the *vote*) carries each parameter's
   non-finite flag, a fingerprint of every parameter's plan, and every value methods asked to agree on
   (TernGrad's scalers): one collective per step, not one per layer (two where values are summed: a max-allreduce
   and a gather, :func:`hvdcomp.collectives.start_vote`). Reductions waiting on it (gated
   encodings) then go on, in the order the gradients became ready: at the next gradient's hook that finds the vote
   done, else in ``synchronize()``. Nothing waits for it inside backward: a rank where a gradient is missing starts
   the vote only in ``synchronize()``, and the others must reach it (past a second optimizer's hooks, or a
   ``SyncBatchNorm``'s collective, later in backward).
3. ``synchronize()`` submits parameters that got no gradient (as zeros, so no rank waits forever), drives
   every reduction to completion in the order they were started (the first sent is the first decoded,
   while later payloads are still on the wire), fusing agreements asked for later in the step into further
   votes and copying the values reductions read on the host (LGC's guard) in one transfer once the collectives
   are done, writes the averaged (or summed) result into ``p.grad``, and checks that no compressed gradient was
   NaN/Inf (dense ones pass as Horovod passes them). All ranks see the same votes and the same reduced values, so
   they all raise (or skip) together.

Sparse gradients (``nn.Embedding(..., sparse=True)``) go as they are to methods that take them (the homomorphic
sketch, ``accepts_sparse``) unless ``sparse_as_dense``; every other path densifies them first, as Horovod's
``sparse_as_dense`` does. Either way ``p.grad`` holds the dense average after ``synchronize()``.

Plans change over time inside methods (a ratio, a phase, in the per-parameter state), decided from agreed
values or the step counter; the vote's plan fingerprint (its max and min across ranks) shows every step
whether all ranks hold the same plan, and if not, the full plans are compared and the first difference is
raised on every rank.

Every collective has a deterministic name derived from the parameter name and the request's index, under a prefix
per kind (``hvdcomp.c.``, ``hvdcomp.dense.``, ``hvdcomp.vote``, ``hvdcomp.plan``) so that no parameter's name can
collide with another kind's (Horovod matches collectives by name, so the order a rank starts or waits for them in is
free), and everything that must line up across ranks (the plan, the vote's layout, later votes) is in sorted-name
order.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

import horovod.torch as hvd
import torch

from hvdcomp import check, checkpoint
from hvdcomp.collectives import Pending, start, start_vote
from hvdcomp.compressor import AccuracyWarning, Compressor, Context, State, derive_seed, nonfinite
from hvdcomp.config import Choice, CompressionConfig, edges
from hvdcomp.deadlines import DEFAULT_DEADLINE, Beacon, Deadline, answering, share_host, synchronize
from hvdcomp.kernels import kernels_name
from hvdcomp.requests import Agree, Read, Reduction, to_host

log = logging.getLogger(__name__)


class Tuner(Protocol):
    """What changes the compression while the job trains (``compression: auto``: :class:`hvdcomp.auto.Tuner`),
    attached with :meth:`_DistributedOptimizer.attach_tuner`. The optimizer calls it at these points, on every rank in
    the same step; it acts through the optimizer's public members (:meth:`~_DistributedOptimizer.apply_config` at a
    step boundary, :meth:`~_DistributedOptimizer.wait` for its collectives)."""

    #: the configuration to go back to after an elastic reset (every parameter dense)
    base: CompressionConfig
    #: what it measured and chose, for :meth:`~_DistributedOptimizer.auto_report`
    report: dict[str, Any]

    def gradient_ready(self, name: str) -> None:
        """A parameter's gradient is ready for reduction (its hook ran)."""

    def backward_done(self) -> None:
        """``synchronize()`` starts: backward has ended."""

    def step_done(self, optimizer: Any) -> None:
        """``synchronize()`` ends: every gradient of the step is reduced."""

    def restart(self) -> None:
        """Measure and choose again, from dense (``retune()``, an elastic reset)."""


@dataclass
class _Slot:
    """One parameter's configuration, context and per-parameter method state."""

    name: str
    param: torch.Tensor
    choice: Choice
    ctx: Context
    state: State
    step: int
    delay: int
    bucket: str = ""  # in a bucket (bucket_cap_mb): its first member's name; the members share one state

    def __post_init__(self) -> None:
        self.join("")

    def join(self, bucket: str) -> None:
        """Puts this parameter in the bucket named ``bucket`` ("": alone), which its plan shows."""
        self.bucket = bucket
        compressed = self.choice.compressor is not None  # (its kernels: a path of their own, the same on every rank)
        self.fixed = [self.name, list(self.param.shape), self.param.device.type, self.choice.describe(),
                      *([f"kernels {kernels_name(self.param.device)}"] if compressed else []),
                      *([f"bucket {bucket}"] if bucket else [])]
        self.fixed_text = json.dumps(self.fixed)  # rendered once: only the method's part changes

    def plan(self) -> list[Any]:
        """What must be the same on every rank for this parameter, now: the step counter too (a method may
        change phase at a step, PowerSGD's warm-up)."""
        changing = "" if self.choice.reduction is None else self.choice.reduction.plan(self.state)
        return [*self.fixed, f"{changing} step {self.step}".strip()]


@dataclass
class _Dense:
    handle: int
    wire: torch.Tensor  # what Horovod reduces in place: the gradient itself, or a float32 copy of bfloat16


@dataclass
class _Compressed:
    slot: _Slot
    reduction: Reduction | None  # None: one of a batch's later members, reduced by its first member's work
    flag: torch.Tensor | None  # [1] float32: rank + 1 if this rank's gradient is not finite, else 0 (a bucket's
    # members: set once the bucket is complete, before the vote)
    plan: list[Any]  # the slot's plan when this step started
    ctx: Context  # the slot's context in this step
    requests: int = 0  # requests yielded so far: they name the collectives
    pending: Pending | None = None  # a started collective
    agree: Agree | None = None  # waiting for the next vote
    read: Read | None = None  # waiting for the step's copy to the host
    members: list[_Slot] | None = None  # a batch's first member: every member's slot, whose sums it returns


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                 config: CompressionConfig, backward_passes_per_step: int,
                 op: Any, process_set: hvd.ProcessSet, deadline: Deadline | float | None,
                 sparse_as_dense: bool = False) -> None:
        super().__init__(params)
        self.sparse_as_dense = check.boolean("", "sparse_as_dense", sparse_as_dense)
        if deadline is not None and not isinstance(deadline, Deadline):
            check.number("", "deadline", deadline, gt=0,
                         expected="a Deadline, a positive number of seconds or None (off)")
        if deadline is DEFAULT_DEADLINE and os.environ.get("HOROVOD_ELASTIC") == "1":
            deadline = None  # an exit would end the ranks elastic recovery keeps (Deadline's docstring)
        self.deadline = deadline
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvdcomp.DistributedOptimizer supports op=hvd.Average or hvd.Sum; for Adasum, "
                             "Min, Max or Product use hvd.DistributedOptimizer")
        check.integer("", "backward_passes_per_step", backward_passes_per_step, ge=1)
        self.config = config
        self.tuner: Tuner | None = None  # compression: auto's (attach_tuner)
        self.op = op
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._named = None if named_parameters is None else list(named_parameters)
        self._work: dict[int, _Dense | _Compressed] = {}
        self._bytes_sent = 0
        self._should_synchronize = True
        # Hooks for every parameter the plan names, once: a world of one rank reduces nothing (like Horovod), and
        # after an elastic reset (reset()) the same parameters, in the same order, make the new plan.
        # Under Elastic Horovod (HOROVOD_ELASTIC=1, set by its launcher) every collective must run inside the elastic
        # function, which handles a lost rank: the plan check then comes with the first step instead.
        self._hooked: set[int] = set()  # the parameters with a gradient hook (_build_world registers them)
        planned = self._build_world(check_now=os.environ.get("HOROVOD_ELASTIC") != "1")
        self._warn_accuracy()
        unmatched = self.config.unmatched([slot.name for slot in planned])
        if unmatched and self.process_set.rank() == 0:
            log.warning("hvdcomp: no trained parameter of this optimizer matches the %s (their names are like %s)",
                        " or the ".join(unmatched), ", ".join(repr(slot.name) for slot in planned[:3]))

    def _warn_accuracy(self) -> None:
        """One :class:`AccuracyWarning` per method of the plan whose options were measured to lose accuracy
        (:meth:`Compressor.accuracy_risk`), on rank 0: a method that trains worse fails silently otherwise."""
        if self.process_set.rank() != 0:
            return
        risks: dict[str, str] = {}
        for slot in self._slots:
            compressor = slot.choice.compressor
            risk = None if compressor is None else compressor.accuracy_risk()
            if risk:
                risks.setdefault(compressor.name, risk)
        for name, risk in sorted(risks.items()):
            warnings.warn(f"hvdcomp: {name}: {risk}", AccuracyWarning, stacklevel=4)

    def reset(self) -> None:
        """Elastic Horovod: rebuilds the plan for the world after a reset. The elastic state's sync calls it
        (:mod:`hvdcomp.elastic`), and the optimizer itself where a step starts in a world of another size or rank.

        Every parameter's method state (residuals, PowerSGD's Q, GraVAC's CF) and step counter start afresh, on
        every rank, as at the start of training: what a rank joining the job has, so the plans agree (checked with
        the next step's first gradient: a reset callback runs no collective). Residuals belong to a rank's old
        shard of the data and the plan itself depends on the world size (two-phase chunks, the collectives
        ``auto`` picks), so nothing per rank is carried over; the wrapped optimizer's state (momentum) comes back
        with the elastic state.
        """
        self._work.clear()
        if self.tuner is not None:  # the world changed: measure and choose again, from dense
            self.config = self.tuner.base
            self.tuner.restart()
        self._build_world(check_now=False)

    def retune(self) -> None:
        """``compression: auto``: measures and chooses again, from dense (call it on every rank in the same step,
        between steps: the measurements are collectives). The plan in force runs one more step, then every parameter
        is dense until the new choice."""
        if self.tuner is None:
            raise ValueError("retune() is for compression: auto; this optimizer's compression is fixed")
        self.tuner.restart()

    def auto_report(self) -> dict[str, Any] | None:
        """``compression: auto``: the plan in force, its predicted and measured step times, and every plan tried
        (:mod:`hvdcomp.auto`); None for a fixed compression."""
        if self.tuner is None:
            return None
        if not self._slots:  # one rank (or not in the process set): nothing is reduced, nothing to choose
            return {"phase": "settled", "label": "dense", "plan": [], "tried": [],
                    "why": "nothing is reduced on this rank (one rank, as in Horovod, or outside the process set)"}
        return copy.deepcopy(self.tuner.report)

    # ------------------------------------------------------------------ what a tuner uses (compression: auto)

    def attach_tuner(self, tuner: Tuner) -> None:
        """Lets ``tuner`` change this optimizer's compression while it trains (its docstring says when it is
        called); the configuration must be ``method: auto``'s (every parameter dense until the tuner applies a
        plan)."""
        if self.config.auto is None:
            raise ValueError("attach_tuner() is for compression: auto; this optimizer's compression is fixed")
        self.tuner = tuner

    @property
    def steps_done(self) -> int:
        """Steps synchronized since the plan was built (the start, or an elastic reset)."""
        return self._steps_done

    @property
    def step_skipped(self) -> bool:
        """The step just synchronized had a non-finite gradient: it is skipped (``nonfinite: skip``), or raised."""
        return self._skip_step

    @property
    def edges(self) -> set[str]:
        """The names of the model's first and last layers' parameters (methods with ``dense_edges`` keep them
        dense)."""
        return self._edges

    def gradients(self) -> list[tuple[str, torch.Tensor]]:
        """The reduced parameters' names and gradients (the live ``p.grad``), in name order; empty on one rank."""
        return [(slot.name, slot.param.grad) for slot in self._slots]

    def warmup_left(self) -> int:
        """Steps until every compressed parameter's method has ended its warm-up (:meth:`Compressor.steady_from`:
        PowerSGD's dense steps, DGC's rising sparsity)."""
        return max([0, *(slot.choice.compressor.steady_from() - slot.step
                         for slot in self._slots if slot.choice.compressor is not None)])

    def apply_config(self, config: CompressionConfig) -> None:
        """Applies ``config`` at a step boundary (between ``synchronize()`` and the next backward), on every rank
        in the same step: every parameter is planned afresh, its method state too, its step counter set to the
        steps trained so far (they count towards a method's warm-up: PowerSGD's ``start_iter``, DGC's stages, as
        from a job's first step), and the plans are checked across ranks now."""
        kept = self._steps_done, self._slowest_step, self._heard, self._skip_step  # (this step's verdict stands)
        self.config = config
        self._build_world(check_now=False)
        self._steps_done, self._slowest_step, self._heard, self._skip_step = kept
        for slot in self._slots:
            slot.step = self._steps_done
        if not self._plan_checked:
            self._check_same_plan([slot.plan() for slot in self._slots])
            self._plan_checked = True

    def _build_world(self, check_now: bool) -> list[_Slot]:
        """Plans every parameter for the current world (its size and this rank), checks that all ranks hold the same
        plan (now, or with the next step's first gradient), and returns the slots (kept only where there is more
        than one rank)."""
        size, included = self.process_set.size(), self.process_set.included()
        self._world = (size, self.process_set.rank())  # what the plan is for (_follow_world)
        self._divisor = size if self.op == hvd.Average and included else 1
        slots = self._plan(self._named)
        # the votes' names: another optimizer's (one backward pass may feed two) are in flight at the same time, and
        # Horovod refuses a name twice; its parameters' names tell it apart, the same on every rank
        names = "\n".join(sorted(slot.name for slot in slots)).encode()
        self._vote_name = f"hvdcomp.vote.{hashlib.blake2b(names, digest_size=3).hexdigest()}"
        active = included and size > 1
        self._slots = slots if active else []
        # a gradient hook's slot, by parameter: a rebuild (apply_config, reset) may plan another set of parameters
        # (a layer frozen or thawed since), which moves the others' indices; a thawed one gets its hook now
        self._index = {id(slot.param): index for index, slot in enumerate(self._slots)}
        for slot in slots:
            if id(slot.param) not in self._hooked:
                slot.param.register_post_accumulate_grad_hook(self._hook)
                self._hooked.add(id(slot.param))
        self._batches = self._batch_members()
        self._fresh_states()
        self._check_momentum()
        self._compressed_total = sum(slot.choice.reduction is not None for slot in self._slots)
        self._compressed_started = 0
        self._vote: Pending | None = None
        self._vote_gates = False  # the vote holds values that encodings wait for
        self._vote_result: torch.Tensor | None = None
        self._synchronized = False
        self._backward_since_synchronize = False  # a gradient hook fired since the last synchronize()
        self._skip_step = False
        self._slowest_step: float | None = None  # deadlines start from start-up's again
        self._step_started: float | None = None
        self._steps_done = 0
        self._heard: tuple[int, float] | None = None  # the step and time every rank was last heard from
        self._peers: dict[int, tuple[list[str], int]] = {}  # the other ranks' beacons, from the plan check
        self._loaded = False  # the method states came from a checkpoint (load_state_dict with an hvdcomp entry)
        self._alone = False  # this step's synchronize() came with no backward pass (step() alone)
        self._plan_checked = not active
        if active and check_now:
            self._check_same_plan([slot.plan() for slot in self._slots])
            self._plan_checked = True
        return slots

    # ----------------------------------------------------------------------------------------- set-up

    def _plan(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> list[_Slot]:
        if named_parameters is None:
            named = [(f"noname.{i}.{j}", p) for i, group in enumerate(self.param_groups)
                     for j, p in enumerate(group["params"])]
        else:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                                 "produced by model.named_parameters()")
        names = collections.Counter(name for name, _ in named)
        duplicates = sorted(name for name, count in names.items() if count > 1)
        if duplicates:
            raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {duplicates}")
        # one tensor under several names (tied weights, listed once per module) is reduced once, under the last of
        # its names in name order, as Horovod names a parameter, in its first place in the model (buckets and edges
        # follow the model's order): two reductions would send it twice and write its gradient twice
        kept = {id(p): name for name, p in sorted(named, key=lambda item: item[0])}
        first: dict[int, tuple[str, torch.Tensor]] = {}
        for _, p in named:
            first.setdefault(id(p), (kept[id(p)], p))
        named = list(first.values())
        optimized = {id(p) for group in self.param_groups for p in group["params"]}
        unnamed = optimized - {id(p) for _, p in named}
        if unnamed:
            raise ValueError(f"named_parameters was given, but {len(unnamed)} optimized parameter(s) are not named")
        size = self.process_set.size() or 1
        rank = self.process_set.rank() or 0
        self._model_order = {name: position for position, (name, _) in enumerate(named)}  # buckets follow it
        trained = [name for name, p in named if id(p) in optimized and p.requires_grad]
        # the model's first and last layers, by name; without names, its first two and last two parameters (a first
        # and a last layer's weight and bias)
        edge = edges(trained) if named_parameters is not None else set(trained[:2] + trained[-2:])
        self._edges = edge
        slots = []
        for name, param in sorted(named, key=lambda item: item[0]):
            if id(param) not in optimized or not param.requires_grad:
                continue
            choice = self.config.choose(name, param.shape, size, edge=name in edge)
            if choice.declined and rank == 0:
                log.warning("hvdcomp: parameter %r stays dense: %s", name, choice.declined)
            ctx = Context(name, rank, size, param.device, derive_seed(self.config.seed, name, rank),
                          derive_seed(self.config.seed, name, "shared"))
            slots.append(_Slot(name, param, choice, ctx, {}, 0, self.backward_passes_per_step))  # (_fresh_states)
        return slots

    def _batch_members(self) -> dict[int, list[int]]:
        """Slot index -> the indices of the slots reduced together with it (in name order, as the slots are: the
        same on every rank), for the config's buckets (:meth:`_buckets`), whose members it marks, and, of the slots
        in none, the batches of two or more that reductions ask for
        (:meth:`hvdcomp.reductions.ReductionMethod.batch_key`: PowerSGD's matrices of one shape)."""
        batches: dict[int, list[int]] = {}
        for members in self._buckets():
            first = self._slots[members[0]]
            for index in members:
                batches[index] = members
                self._slots[index].join(first.name)
        keyed: dict[Hashable, list[int]] = {}
        for index, slot in enumerate(self._slots):
            key = None if slot.choice.reduction is None else slot.choice.reduction.batch_key(slot.param)
            if key is not None and index not in batches:
                keyed.setdefault(key, []).append(index)
        batches.update({index: members for members in keyed.values() if len(members) > 1 for index in members})
        return batches

    def _buckets(self) -> list[list[int]]:
        """The config's buckets (:meth:`CompressionConfig.buckets`) as slot indices, each in name order: the slots
        given in reverse model order, the order backward readies them in."""
        order = sorted(range(len(self._slots)), key=lambda i: -self._model_order[self._slots[i].name])
        found = self.config.buckets([(self._slots[i].param, self._slots[i].choice) for i in order])
        return [sorted(order[position] for position in bucket) for bucket in found]

    def _fresh_states(self, names: Collection[str] | None = None) -> None:
        """Every compressed parameter's method state made afresh (or those of ``names`` and of the buckets they are
        in): a parameter's own for its gradient, or its bucket's, made once for the members, which share it."""
        for group in self._groups():
            if names is None or any(slot.name in names for slot in group):
                state = self._new_state(group)
                for slot in group:
                    slot.state = state

    def _groups(self) -> list[list[_Slot]]:
        """The compressed slots by the method state they share, in name order: one alone, or a bucket's members
        (the first, whose name the bucket takes, holds it in a checkpoint)."""
        groups: dict[str, list[_Slot]] = {}
        for slot in self._slots:
            if slot.choice.reduction is not None:
                groups.setdefault(slot.bucket or slot.name, []).append(slot)
        return list(groups.values())

    @staticmethod
    def _new_state(group: list[_Slot]) -> State:
        """A fresh method state for ``group`` (:meth:`_groups`), with its first member's context."""
        first = group[0]
        if not first.bucket:
            return first.choice.reduction.init_state(first.param.detach(), first.ctx)
        return first.choice.reduction.init_bucket_state([slot.param.detach() for slot in group], first.ctx)

    def _check_momentum(self) -> None:
        """A method that applies momentum itself (DGC) must not get it a second time from the optimizer: its
        parameters' groups must have ``momentum`` 0 (SGD's; optimizers with a first moment of their own, Adam's
        betas, are not checked)."""
        for slot in self._slots:
            compressor = slot.choice.compressor
            if compressor is None or not compressor.applies_momentum:
                continue
            group = next(g for g in self.param_groups if any(p is slot.param for p in g["params"]))
            if group.get("momentum", 0):
                raise ValueError(f"parameter {slot.name!r}: {compressor.name} applies momentum itself (momentum "
                                 f"correction), and the optimizer has momentum={group['momentum']}: it would be "
                                 "applied twice. Use the optimizer with momentum=0, or the method with momentum: 0")

    def _check_same_plan(self, plans: list[list[Any]]) -> None:
        """Ranks with different plans would wait forever on each other's collectives: fail fast instead."""
        mine = json.dumps({"op": str(self.op), "passes": self.backward_passes_per_step,
                           "nonfinite": self.config.nonfinite, "seed": self.config.seed, "params": plans})
        # each rank's host name and beacon travel on a line of their own after the plan: the ranks that share this
        # host's cores, and what a timed-out wait probes
        host = json.dumps([socket.gethostname(), Beacon.address()])
        data = torch.frombuffer(bytearray(f"{mine}\n{host}".encode()), dtype=torch.uint8)
        lengths = self.wait(hvd.allgather_async(torch.tensor([data.numel()]), name="hvdcomp.plan.lengths",
                                                 process_set=self.process_set), "hvdcomp.plan.lengths")
        gathered = self.wait(hvd.allgather_async(data, name="hvdcomp.plan", process_set=self.process_set),
                              "hvdcomp.plan")
        others, lines = zip(*(bytes(chunk.tolist()).decode().rsplit("\n", 1)
                              for chunk in gathered.split(lengths.tolist())), strict=True)
        hosts = [json.loads(line) for line in lines]
        me = self.process_set.rank()
        share_host(sum(name == hosts[me][0] for name, _ in hosts))
        self._peers = {rank: tuple(beacon) for rank, (_, beacon) in enumerate(hosts) if rank != me}
        for rank, other in enumerate(others):
            if other != mine:
                raise ValueError(f"hvdcomp: ranks are configured differently (this rank "
                                 f"{self.process_set.rank()} vs rank {rank}): {_first_difference(mine, other)}. "
                                 "Every rank must use the same model, compression config and optimizer options, "
                                 "and a method may change its plan only from agreed values")

    # ------------------------------------------------------------------------------------ deadlines

    def _deadline_s(self) -> float | None:
        if isinstance(self.deadline, Deadline):
            return self.deadline.seconds(self._slowest_step)
        return None if self.deadline is None else float(self.deadline)

    def _context(self) -> str:
        """Where the job stands, for a failed or timed-out wait's message: the step, when every rank was last heard
        from together, and which ranks answer on their beacons now (:class:`hvdcomp.deadlines.Beacon`)."""
        heard = "no step has completed yet" if self._heard is None else (
            f"every rank was last heard from together in step {self._heard[0]}, "
            f"{time.monotonic() - self._heard[1]:.1f} s ago")
        if self._peers:
            alive, silent = answering(self._peers)
            heard += (f"; ranks this rank cannot reach now: {', '.join(map(str, silent)) or 'none'}; reachable: "
                      f"{', '.join(map(str, alive)) or 'none'}")
        if self._alone:
            heard += ("; this rank's step() came without a backward pass, as hvd.broadcast_optimizer_state's on a "
                      "rank whose optimizer has no state: use hvdcomp.broadcast_optimizer_state")
        return f"in step {self._steps_done} ({heard}) "

    def wait(self, handle: int, name: str) -> Any:
        """The result of the Horovod collective ``handle`` (named ``name``), waited for under this optimizer's
        deadline: the optimizer's own collectives, and a tuner's, end the job when a rank is lost."""
        return synchronize(handle, name, self._deadline_s(), self._context)

    def _wait_for(self, pending: Pending) -> Any:
        return pending.wait(self._deadline_s(), self._context)

    # ------------------------------------------------------------------------------------ reduction

    def _follow_world(self) -> None:
        """Elastic Horovod: where a reset changed the world (its size, or this rank) since the plan was made, makes it
        afresh (:meth:`reset`) before the step's first reduction: after a reset that only removed hosts, which the
        elastic state's sync (:mod:`hvdcomp.elastic`, which resets after every other) does not follow. Every rank
        sees the smaller world at the same step."""
        if self._world != (self.process_set.size(), self.process_set.rank()):
            self.reset()

    def _hook(self, param: torch.Tensor) -> None:
        """A parameter's gradient is ready (accumulated): its reduction starts once ``backward_passes_per_step``
        passes have accumulated it."""
        if not self._work:  # a step's first gradient (or one accumulated before it)
            self._follow_world()
        if self._vote_gates and self._vote is not None and self._vote.ready():  # agreed values that gate encodings:
            self._finish_vote()  # resolved once here (waiting for them inside backward could wait for ranks that
            # start this vote only in synchronize(), a gradient missing there, while they wait for a collective later
            # in backward); a vote that gates nothing waits for synchronize(): reading it is a host sync on CUDA
        index = self._index.get(id(param))
        if index is None:  # one rank (nothing to reduce), or a parameter the plan leaves out (frozen when planned)
            return
        self._backward_since_synchronize = True
        slot = self._slots[index]
        if index in self._work:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before "
                                 "call to step(). Increase backward_passes_per_step to accumulate gradients "
                                 "locally.")
        slot.delay -= 1
        if slot.delay == 0:
            self._submit(index)

    def _submit(self, index: int) -> None:
        slot = self._slots[index]
        if self.tuner is not None:
            self.tuner.gradient_ready(slot.name)
        if not self._work:
            self._step_started = time.monotonic()
            if not self._plan_checked:  # after an elastic reset: every rank checks before its first collective
                self._check_same_plan([s.plan() for s in self._slots])
                self._plan_checked = True
        if slot.param.grad is None:  # no gradient on this rank this step: others may have one
            slot.param.grad = torch.zeros_like(slot.param)
        grad = slot.param.grad
        if grad.is_sparse and (self.sparse_as_dense or slot.choice.reduction is None
                               or not slot.choice.compressor.accepts_sparse):
            grad = slot.param.grad = grad.to_dense()  # as Horovod's sparse_as_dense
        if slot.choice.reduction is None:
            # Horovod has no bfloat16 allreduce, and reduces contiguous tensors only (a channels_last convolution's
            # gradient is not): a copy where either holds, written back below
            wire = grad.to(torch.float32 if grad.dtype == torch.bfloat16 else grad.dtype,
                           memory_format=torch.contiguous_format)
            handle = hvd.allreduce_async_(wire, name=f"hvdcomp.dense.{slot.name}", op=self.op,
                                          process_set=self.process_set)
            self._work[index] = _Dense(handle, wire)
            self._bytes_sent += wire.numel() * wire.element_size()
            return
        flag = None if slot.bucket else self._input_flags([grad], slot.choice.compressor)  # a bucket's: together
        plan = slot.plan()  # as the step starts: the reduction may change it for the next step
        ctx = replace(slot.ctx, step=slot.step)
        slot.step += 1
        members = self._batches.get(index)
        if members is None:
            work = _Compressed(slot, slot.choice.reduction.reduce(grad, slot.state, ctx), flag, plan, ctx)
            self._work[index] = work
            self._advance(work, None)
        else:  # one of a batch: reduced with the others once all of them are here, by the first one's work
            self._work[index] = _Compressed(slot, None, flag, plan, ctx)
            if all(member in self._work for member in members):
                works = [self._work[member] for member in members]
                first = works[0]
                assert isinstance(first, _Compressed)
                first.members = [work.slot for work in works]
                grads = [work.slot.param.grad for work in works]
                if slot.bucket:  # by the reduction's reduce_bucket, with the bucket's state and first member's context
                    for work, flag in zip(works, self._input_flags(grads, slot.choice.compressor).split(1),
                                          strict=True):
                        work.flag = flag
                    first.reduction = slot.choice.reduction.reduce_bucket(grads, first.slot.state, first.ctx)
                else:
                    first.reduction = slot.choice.reduction.reduce_batch(
                        grads, [work.slot.state for work in works], [work.ctx for work in works])
                self._advance(first, None)
        self._compressed_started += 1
        if self._compressed_started == self._compressed_total:
            self._start_vote()

    def _input_flags(self, grads: list[torch.Tensor], compressor: Compressor) -> torch.Tensor:
        """The vote's non-finite flags of compressed gradients, float32 [len(grads)]: this rank + 1 where one holds a
        NaN or an Inf, else 0. A method that keeps them in its sum (fp16) needs none: the check of the result catches
        them; others can hide them in their encoding (TernGrad's draw, the sparsifiers), so their inputs are checked,
        naming this rank."""
        if compressor.keeps_nonfinite:
            return grads[0].new_zeros(len(grads), dtype=torch.float32)
        return nonfinite([grad._values() if grad.is_sparse else grad for grad in grads],
                         mark=self.process_set.rank() + 1)

    def _advance(self, work: _Compressed, result: Any) -> None:
        """Sends ``result`` into the reduction and starts what it asks for next (or parks it on an Agree or a
        Read)."""
        work.pending = work.agree = work.read = None
        assert work.reduction is not None
        try:
            request = next(work.reduction) if work.requests == 0 else work.reduction.send(result)
        except StopIteration as done:  # the sum over ranks: averaged into p.grad now, not held till the end
            if work.members is None:
                self._write(work.slot, done.value)
            else:
                for slot, total in zip(work.members, done.value, strict=True):
                    self._write(slot, total)
            return
        name = f"hvdcomp.c.{work.slot.name}.{work.requests}"  # c.: apart from dense., vote., plan.
        work.requests += 1
        if isinstance(request, Agree):
            work.agree = request
        elif isinstance(request, Read):
            work.read = request
        else:
            work.pending = start(request, name, self.process_set)
            self._bytes_sent += work.pending.nbytes

    def _write(self, slot: _Slot, total: torch.Tensor) -> None:
        """The sum over ranks of ``slot``'s gradient, averaged (or summed) into its ``p.grad``."""
        grad = slot.param.grad
        if grad.is_sparse:  # a sparse gradient's sum comes back dense (as with Horovod's sparse_as_dense)
            grad = slot.param.grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        total = total.view_as(grad)
        if self._divisor > 1:
            torch.div(total, self._divisor, out=grad)
        else:
            grad.copy_(total)

    def _compressed_work(self) -> Iterator[_Compressed]:
        """Compressed parameters in name order: the order of every vote's layout on every rank."""
        return (w for _, w in sorted(self._work.items()) if isinstance(w, _Compressed))

    def _start_vote(self) -> None:
        works = list(self._compressed_work())
        device = works[0].flag.device
        text = "\n".join(f"{w.slot.fixed_text}\t{w.plan[-1]}" for w in works)
        digest = hashlib.blake2b(text.encode(), digest_size=3).digest()
        fingerprint = torch.full((1,), float(int.from_bytes(digest, "little")), device=device)  # exact in float32
        agreements = [Agree(torch.cat([w.flag.to(device) for w in works]), "max"), Agree(fingerprint, "max", host=True),
                      Agree(fingerprint, "min", host=True), *(w.agree for w in works if w.agree is not None)]
        self._vote = start_vote(agreements, self._vote_name, self.process_set)
        self._vote_gates = any(w.agree is not None for w in works)
        self._bytes_sent += self._vote.nbytes

    def _finish_vote(self) -> None:
        flags, highest, lowest, *agreed = self._wait_for(self._vote)
        self._heard = (self._steps_done, time.monotonic())  # every rank joined this step's vote
        self._vote, self._vote_result = None, flags
        if bool(highest != lowest):  # on the host: the vote's one transfer
            self._check_same_plan([w.plan for w in self._compressed_work()])
            raise ValueError("hvdcomp: the ranks' plan fingerprints differ, but their plans compare equal")
        waiting = [w for w in self._compressed_work() if w.agree is not None]
        results = {id(w): value for w, value in zip(waiting, agreed, strict=True)}
        for work in self._work.values():  # encode in the order gradients became ready (see synchronize)
            if id(work) in results:
                self._advance(work, results[id(work)])

    def synchronize(self) -> None:
        """Waits for every gradient's reduction and writes the results into ``p.grad``."""
        self._skip_step = False  # the last step's verdict ends here, whether or not step() came (a GradScaler's skip)
        self._alone = not self._work and not self._backward_since_synchronize
        if not self._work:  # no gradient came: step() called alone (Horovod's broadcast_optimizer_state does)
            self._follow_world()
        if not self._slots:
            self._synchronized = True
            return
        self._backward_since_synchronize = False
        if self.tuner is not None:
            self.tuner.backward_done()
        for index in range(len(self._slots)):
            if index not in self._work:
                self._submit(index)
        if self._vote is not None:
            self._finish_vote()
        # In passes over the reductions in submission order (the order backward made the gradients ready): the
        # first payloads sent are the first decoded while later ones are still on the wire. Each pass waits for
        # one collective per reduction and starts that reduction's next, so every rank has started the k-th
        # collective of every reduction before any rank waits for a (k+1)-th: the submission order, which
        # differs between ranks (a parameter with no gradient is submitted here, last), cannot make two ranks
        # wait for collectives the other has not started. Horovod matches collectives by name, not order.
        # Agreements asked for on the way are fused into further votes, in name order; reads, once no collective
        # is left to wait for, into one copy to the host.
        compressed = [w for w in self._work.values() if isinstance(w, _Compressed)]
        rounds = 0
        while True:
            while any(w.pending is not None for w in compressed):
                for work in compressed:
                    if work.pending is not None:
                        self._advance(work, self._wait_for(work.pending))
            waiting = [w for w in self._compressed_work() if w.agree is not None]
            if waiting:
                rounds += 1
                vote = start_vote([w.agree for w in waiting], f"{self._vote_name}.{rounds}", self.process_set)
                self._bytes_sent += vote.nbytes
                for work, value in zip(waiting, self._wait_for(vote), strict=True):
                    self._advance(work, value)
                continue
            reading = [w for w in compressed if w.read is not None]
            if not reading:
                break
            for work, values in zip(reading, to_host([w.read.values for w in reading]), strict=True):
                self._advance(work, values)
        for index, work in self._work.items():
            grad = self._slots[index].param.grad
            if isinstance(work, _Dense):
                self.wait(work.handle, f"hvdcomp.dense.{self._slots[index].name}")
                if work.wire is not grad:
                    grad.copy_(work.wire)
        checked = [self._slots[index] for index in sorted(self._work)
                   if self._slots[index].choice.reduction is not None]
        input_flags = self._vote_result
        now = time.monotonic()
        if self._step_started is not None:
            took = now - self._step_started
            self._slowest_step = took if self._slowest_step is None else max(self._slowest_step, took)
        self._heard = (self._steps_done, now)  # every collective of the step completed: every rank took part
        self._steps_done += 1
        self._reset_step()
        try:
            self._check_finite(input_flags, checked)
        finally:  # a raised step too: the tuner leaves it untimed (step_skipped), as a skipped one
            if self.tuner is not None:
                self.tuner.step_done(self)
        self._synchronized = True

    def _reset_step(self) -> None:
        self._work.clear()
        self._vote = self._vote_result = None
        self._compressed_started = 0
        for slot in self._slots:
            slot.delay = self.backward_passes_per_step

    def _check_finite(self, input_flags: torch.Tensor | None, compressed: list[_Slot]) -> None:
        """The compressed gradients' check, in one host sync per step: every rank reaches the same verdict from the
        vote (each rank's inputs) and the identical results. Dense ones pass as Horovod passes them (a GradScaler's
        overflow steps included): a NaN there harms no method state, and is the same on every rank."""
        if not compressed:
            return
        output_bad = nonfinite([slot.param.grad for slot in compressed])
        flags = output_bad if input_flags is None else torch.cat([input_flags.to(output_bad.device), output_bad])
        values = flags.tolist()
        if not any(values):
            return
        inputs, outputs = values[:len(values) - len(compressed)], values[len(values) - len(compressed):]
        problems = [f"{slot.name!r} on rank {int(v) - 1}" for slot, v in zip(compressed, inputs, strict=True) if v]
        problems += [f"{slot.name!r} after reduction" for slot, v in zip(compressed, outputs, strict=True) if v]
        message = f"non-finite gradient (NaN or Inf) in {', '.join(problems)}"
        # the flagged parameters' states may hold NaN now: they start afresh (a caller that catches the error goes on),
        # on every rank alike (the flags are agreed); the others keep theirs, this step's sent part unapplied
        self._fresh_states({slot.name for slot, i, o in zip(compressed, inputs, outputs, strict=True) if i or o})
        self._skip_step = True
        if self.config.nonfinite == "raise":
            raise FloatingPointError(f"hvdcomp: {message}. Lower the learning rate, check the data, or set "
                                     "nonfinite: skip in the compression config to skip such steps (as a "
                                     "GradScaler's overflow steps need: it then skips them too)")
        warnings.warn(f"hvdcomp: skipping this optimizer step: {message}", RuntimeWarning, stacklevel=3)

    def method_states(self) -> dict[str, State]:
        """This rank's per-parameter method state (residuals, PowerSGD's Q, GraVAC's CF and last decision), by
        parameter name, for the compressed parameters; the live objects: read, do not modify."""
        return {slot.name: slot.state for slot in self._slots if slot.choice.reduction is not None}

    def decisions(self) -> dict[str, list[Any]]:
        """What each compressed parameter's method decided in the last step (:meth:`Compressor.decisions`: GraVAC's
        CF, LGC's stage), by name, for the methods that decide something; a bucket's, under each of its members."""
        found = {slot.name: slot.choice.reduction.decisions(slot.state) for slot in self._slots
                 if slot.choice.reduction is not None}
        return {name: decided for name, decided in found.items() if decided is not None}

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has handed to collectives so far (dense gradients, compressed payloads,
        votes); dense float32 would be 4 bytes per gradient element per step."""
        return self._bytes_sent

    # --------------------------------------------------------------------------- Horovod's surface

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``optimizer.step()`` inside this context does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized and not self._backward_since_synchronize:  # reduced already, nothing new since
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(): the gradients synchronize() reduced are used as they are "
                              "(a second reduction would compress them again and keep their residuals twice). "
                              "Call step() inside optimizer.skip_synchronize() after synchronize().", stacklevel=2)
            else:
                if self._synchronized:  # a backward pass since synchronize(): reduced again, as Horovod does
                    warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                                  "optimizer.synchronize() and another backward pass: the gradients are reduced "
                                  "again.", stacklevel=2)
                self.synchronize()
        self._synchronized = False
        if self._skip_step:
            self._skip_step = False
            return None
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._work:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        self._synchronized = False  # a new step: the next step() synchronizes (after a step a GradScaler skipped)
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus this rank's compressor state under ``"hvdcomp"``.

        Per parameter: the step counter and the method's state (error-feedback residuals, PowerSGD's Q, ratios,
        phases), and the bucket it is in (``bucket_cap_mb``; its members share one state, saved once). It differs per
        rank: save one file per rank to resume exactly.
        """
        state = super().state_dict()
        size, rank = self._world  # the slots' world (after a reset that removed hosts, until the next step rebuilds)
        state["hvdcomp"] = {slot.name: checkpoint.entry(slot.step, slot.state, slot.bucket, slot.choice, size, rank)
                            for slot in self._slots if slot.choice.reduction is not None}
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The wrapped optimizer's state and this rank's method states (:mod:`hvdcomp.checkpoint`: each entry checked
        against this optimizer before anything is loaded, and a method state for a parameter not compressed here
        refused, but under ``compression: auto``, whose plan is not carried over); without an ``"hvdcomp"`` entry the
        method states start afresh."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("hvdcomp", None)
        compressed = [slot for slot in self._slots if saved is not None and slot.choice.reduction is not None]
        for slot in compressed:
            checkpoint.check_entry(slot.name, saved.get(slot.name), slot.choice, slot.bucket, *self._world)
        if saved is not None and self.tuner is None and self.config.auto is None:  # (auto's plan is not carried over)
            checkpoint.check_all_taken(saved, {slot.name for slot in compressed})
        for group in self._groups() if saved is not None else []:  # a bucket's state is its first member's
            checkpoint.check_fits(group[0].name, saved[group[0].name].get("state", {}), self._new_state(group))
        super().load_state_dict(state_dict)
        self._reset_step()
        self._synchronized = False
        self._loaded = bool(saved)  # (a checkpoint of a job that compressed nothing holds an empty entry)
        if saved is None:  # no hvdcomp entry (dropped, or an elastic restore's): the method states start afresh
            self._fresh_states()
            for slot in self._slots:
                slot.step = 0
        loaded: dict[str, State] = {}
        for slot in compressed:  # name order: a bucket's first member, whose state the others share, comes first
            slot.step = int(saved[slot.name]["step"])
            if slot.bucket and slot.bucket != slot.name:
                slot.state = loaded[slot.bucket]
            else:
                slot.state = loaded[slot.name] = checkpoint.to_device(saved[slot.name]["state"], slot.param.device)

    def _create_missing_state(self, sparse: Collection[torch.Tensor]) -> None:
        """The wrapped optimizer's state (SGD's momentum buffers, Adam's moments) of the parameters that have none
        (all of them on a rank that loaded no checkpoint or joined the job; a parameter that never had a gradient, or
        whose group's momentum was just turned on), from one local step of zeros on those alone: no reduction, and
        the parameters stay as they are (a zero gradient moves nothing without weight decay). Every rank then holds
        state for the same parameters, which Horovod's ``broadcast_optimizer_state`` needs (it names the tensors by
        their count) and without which it calls ``step()``: here a reduction. The zeros are sparse for
        ``SparseAdam`` and for the parameters in ``sparse`` (an ``nn.Embedding(..., sparse=True)``'s), as Horovod's
        broadcast makes them."""
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        missing = [p for p in params if not self.state.get(p)]
        if not missing:
            return
        grads = [p.grad for p in params]
        saved = [p.detach().clone() for p in missing]
        for p in params:
            p.grad = None  # (a step skips a parameter without a gradient)
        sparse_ids = {id(p) for p in sparse}
        for p in missing:
            zeros = torch.zeros_like(p)
            p.grad = zeros.to_sparse() if isinstance(self, torch.optim.SparseAdam) or id(p) in sparse_ids else zeros
        super().step()  # the wrapped optimizer's own step: no synchronize()
        with torch.no_grad():
            for p, value in zip(missing, saved, strict=True):
                p.copy_(value)  # weight decay would have moved them
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad

    def broadcast_state(self, root_rank: int, model: torch.nn.Module | None = None,
                        sparse: Collection[torch.Tensor] = ()) -> None:
        """The root's optimizer on every rank (:func:`hvdcomp.broadcast_optimizer_state`, and the elastic state's
        sync): a collective, to call on every rank. In turn:

        1. the root's options of each parameter group (learning rate, momentum, betas: what a checkpoint loaded on
           the root alone, or a scheduler, set) on every rank whose optimizer is over the root's process set, so
           that no rank steps with its own; Horovod's own broadcast carries them only for an optimizer with state;
        2. the wrapped optimizer's state (SGD's momentum buffers, Adam's moments) created locally where a parameter
           has none (:meth:`_create_missing_state`), then broadcast from the root by Horovod's
           ``broadcast_optimizer_state`` (``model`` names its sparse parameters); a stateless optimizer (SGD
           without momentum) has none, and no step is taken;
        3. where some ranks loaded their method states from a checkpoint and others did not (the root alone, in
           Horovod's recipe), every rank starts them afresh at the root's step counters: the plans then agree, and
           no rank adds residuals (or uses a PowerSGD Q) that the others lack. Where every rank loaded its own (one
           file per rank) or none did, they stay.

        Steps 1 and 3 share one collective (over every rank, as Horovod's broadcast)."""
        options = [{key: value for key, value in group.items() if key != "params"} for group in self.param_groups]
        gathered = hvd.allgather_object((options, self._loaded, {slot.name: slot.step for slot in self._slots},
                                         self.process_set.process_set_id), name="hvdcomp.broadcast_state")
        root_options, _, steps, root_set = gathered[root_rank]
        counts = [len(rank_options) for rank_options, _, _, set_id in gathered if set_id == root_set]
        if len(set(counts)) != 1:  # (decided from what every rank gathered: raised on every rank)
            raise ValueError(f"hvdcomp: the optimizers of rank {root_rank}'s process set have different numbers of "
                             f"parameter groups ({counts}, by rank)")
        if self.process_set.process_set_id == root_set:  # (an optimizer over another process set keeps its own)
            for group, given in zip(self.param_groups, root_options, strict=True):
                for key, value in given.items():
                    if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                        group[key].copy_(value)  # (a tensor learning rate stays on this rank's device)
                    else:
                        group[key] = value
        self._create_missing_state(sparse)
        if super().state_dict()["state"]:  # the same parameters' on every rank; none: Horovod's would call step()
            hvd.broadcast_optimizer_state(self, root_rank, model)
        if {loaded for _, loaded, rank_steps, _ in gathered if rank_steps} != {False, True}:
            return
        self._fresh_states()
        self._loaded = False
        for slot in self._slots:
            slot.step = steps.get(slot.name, 0)
        if hvd.rank() == 0:
            log.warning("hvdcomp: only some ranks loaded their method states from a checkpoint: every rank starts them "
                        "afresh (residuals, PowerSGD's Q) at rank %d's step counters. Save and load state_dict() on "
                        "every rank to resume them exactly", root_rank)


def _first_difference(mine: str, other: str) -> str:
    a, b = json.loads(mine), json.loads(other)
    for key in ("op", "passes", "nonfinite", "seed"):
        if a[key] != b[key]:
            return f"{key}: {a[key]} here, {b[key]} there"
    for x, y in zip(a["params"], b["params"], strict=False):
        if x != y:
            here, there = (" ".join(str(v) for v in p[1:] if v != "") for p in (x, y))
            return f"parameter {x[0]!r}: {here} here, {y[0]!r}: {there} there"
    return f"{len(a['params'])} parameters here, {len(b['params'])} there"
