"""``hvdcomp.DistributedOptimizer``: Horovod's DistributedOptimizer with compressed gradient reduction.

A drop-in for ``hvd.DistributedOptimizer`` (Horovod 0.28, ``horovod/torch/optimizer.py``): the same
arguments where they apply, and the same behaviour of ``synchronize()``, ``skip_synchronize()``, ``step()``,
``zero_grad()`` and ``backward_passes_per_step``. It is built on Horovod's public async collectives only.

Each step:

1. During backward, a post-accumulate-grad hook fires per parameter. Uncompressed parameters (small
   tensors, names listed as dense, method ``none``) start Horovod's own fused in-place allreduce, exactly as
   stock Horovod does. Compressed ones start their collective (:mod:`hvdcomp.communicator`): compression and
   communication overlap the rest of backward.
2. When every compressed parameter has started, one small max-allreduce (the *vote*) carries each
   parameter's non-finite flag and the values methods must share before compressing (TernGrad's scalers):
   one collective per step, not one per layer. Gated encodings (TernGrad's) then run in the order the
   gradients became ready.
3. ``synchronize()`` submits parameters that got no gradient (as zeros, so no rank waits forever), drives
   every collective to completion in the order they were started (the first sent is the first decoded,
   while later payloads are still on the wire), writes the averaged (or summed) result into
   ``p.grad``, and checks that no gradient was NaN/Inf. All ranks see the same vote and the same reduced
   values, so they all raise (or skip) together: no rank diverges or hangs.

Every collective has a deterministic name derived from the parameter name (Horovod matches collectives by
name, so the order a rank starts or waits for them in is free), and everything that must line up across ranks
(the plan, the vote's layout) is in sorted-name order.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch

from hvdcomp.communicator import COLLECTIVES, Collective, Reduction, SharedMax
from hvdcomp.compressor import Compressor, State, derive_seed
from hvdcomp.config import Choice, CompressionConfig

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    """One parameter's fixed plan and per-parameter compressor state."""

    name: str
    param: torch.Tensor
    choice: Choice
    collective: Collective | None
    state: State
    seed: int
    delay: int


@dataclass
class _Dense:
    handle: int
    wire: torch.Tensor  # what Horovod reduces in place: the gradient itself, or a float32 copy of bfloat16


@dataclass
class _Compressed:
    reduction: Reduction
    request: Any  # a Horovod handle, or SharedMax before the vote
    flag: torch.Tensor  # [1] float32: rank + 1 if this rank's gradient is not finite, else 0


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                 compression: Compressor | str | Mapping[str, Any] | None, backward_passes_per_step: int,
                 op: Any, process_set: hvd.ProcessSet) -> None:
        super().__init__(params)
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvdcomp.DistributedOptimizer supports op=hvd.Average or hvd.Sum; for Adasum, "
                             "Min, Max or Product use hvd.DistributedOptimizer")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer; got {backward_passes_per_step!r}")
        self.config = CompressionConfig.parse(compression)
        self.op = op
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._slots = self._plan(named_parameters)
        active = process_set.included() and process_set.size() > 1
        if not active:
            self._slots = []  # like Horovod: nothing to reduce on one rank
        self._work: dict[int, _Dense | _Compressed] = {}
        self._compressed_total = sum(slot.collective is not None for slot in self._slots)
        self._compressed_started = 0
        self._uncompressed_bytes_sent = 0
        self._vote: int | None = None
        self._vote_result: torch.Tensor | None = None
        self._synchronized = False
        self._should_synchronize = True
        self._skip_step = False
        if active:
            self._check_same_plan()
            for index, slot in enumerate(self._slots):
                slot.param.register_post_accumulate_grad_hook(self._make_hook(index))

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
        names = [name for name, _ in named]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {duplicates}")
        optimized = {id(p) for group in self.param_groups for p in group["params"]}
        unnamed = optimized - {id(p) for _, p in named}
        if unnamed:
            raise ValueError(f"named_parameters was given, but {len(unnamed)} optimized parameter(s) are not named")
        size = self.process_set.size() or 1
        rank = self.process_set.rank() or 0
        slots = []
        for name, param in sorted(named, key=lambda item: item[0]):
            if id(param) not in optimized or not param.requires_grad:
                continue
            choice = self.config.choose(name, param.numel(), size)
            collective = None
            state: State = {}
            seed = derive_seed(self.config.seed, name, rank)
            if choice.compressor is not None:
                collective = COLLECTIVES[choice.collective](self.process_set)
                collective.check(choice.compressor)
                state = collective.init_state(choice.compressor, param.detach(), seed)
            slots.append(_Slot(name, param, choice, collective, state, seed, self.backward_passes_per_step))
        return slots

    def _check_same_plan(self) -> None:
        """Ranks with different plans would wait forever on each other's collectives: fail fast instead."""
        plan = [[slot.name, list(slot.param.shape), slot.choice.describe()] for slot in self._slots]
        mine = json.dumps({"op": str(self.op), "passes": self.backward_passes_per_step,
                           "nonfinite": self.config.nonfinite, "params": plan})
        data = torch.frombuffer(bytearray(mine.encode()), dtype=torch.uint8)
        lengths = hvd.allgather(torch.tensor([data.numel()]), name="hvdcomp.plan.lengths",
                                process_set=self.process_set)
        gathered = hvd.allgather(data, name="hvdcomp.plan", process_set=self.process_set)
        plans = [bytes(chunk.tolist()).decode() for chunk in gathered.split(lengths.tolist())]
        for rank, other in enumerate(plans):
            if other != mine:
                raise ValueError(f"hvdcomp: ranks are configured differently (this rank "
                                 f"{self.process_set.rank()} vs rank {rank}): {_first_difference(mine, other)}. "
                                 "Every rank must use the same model, compression config and optimizer options")

    # ------------------------------------------------------------------------------------ reduction

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            slot = self._slots[index]
            if index in self._work:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before "
                                     "call to step(). Increase backward_passes_per_step to accumulate gradients "
                                     "locally.")
            slot.delay -= 1
            if slot.delay == 0:
                self._submit(index)
        return hook

    def _submit(self, index: int) -> None:
        slot = self._slots[index]
        if slot.param.grad is None:  # no gradient on this rank this step: others may have one
            slot.param.grad = torch.zeros_like(slot.param)
        grad = slot.param.grad
        if grad.is_sparse:
            raise ValueError(f"parameter {slot.name!r} has a sparse gradient; hvdcomp reduces dense gradients "
                             "(use a dense embedding, or hvd.DistributedOptimizer for sparse ones)")
        if slot.choice.compressor is None:
            wire = grad.float() if grad.dtype == torch.bfloat16 else grad  # Horovod has no bfloat16 allreduce
            handle = hvd.allreduce_async_(wire, name=f"hvdcomp.dense.{slot.name}", op=self.op,
                                          process_set=self.process_set)
            self._work[index] = _Dense(handle, wire)
            self._uncompressed_bytes_sent += wire.numel() * wire.element_size()
            return
        if slot.choice.compressor.summable:  # NaN/Inf survive a sum: the check of the result catches them
            flag = grad.new_zeros((), dtype=torch.float32)
        else:  # a gathered encoding can hide them (TernGrad's draw): check the input, and name this rank
            flag = nonfinite(grad).to(torch.float32).mul_(self.process_set.rank() + 1)
        reduction = slot.collective.reduce(slot.choice.compressor, grad, slot.state, slot.name)
        self._work[index] = _Compressed(reduction, next(reduction), flag.reshape(1))
        self._compressed_started += 1
        if self._compressed_started == self._compressed_total:
            self._start_vote()
            if any(isinstance(w.request, SharedMax) for w in self._compressed_work()):
                self._finish_vote()  # shared values gate compression: resolve them now, at end of backward

    def _compressed_work(self) -> Iterator[_Compressed]:
        return (w for _, w in sorted(self._work.items()) if isinstance(w, _Compressed))

    def _start_vote(self) -> None:
        parts = []
        for work in self._compressed_work():
            parts.append(work.flag)
            if isinstance(work.request, SharedMax):
                parts.append(work.request.values.reshape(-1).float())
        device = parts[0].device
        votes = torch.cat([part.to(device) for part in parts])
        self._uncompressed_bytes_sent += votes.numel() * votes.element_size()
        self._vote = hvd.allreduce_async(votes, name="hvdcomp.vote", op=hvd.Max, process_set=self.process_set)

    def _finish_vote(self) -> None:
        result = hvd.synchronize(self._vote)
        flags, shared, offset = [], {}, 0
        for work in self._compressed_work():  # the vote's layout: parameter-name order on every rank
            flags.append(result[offset:offset + 1])
            offset += 1
            if isinstance(work.request, SharedMax):
                length = work.request.values.numel()
                shared[id(work)] = result[offset:offset + length].to(work.request.values.device)
                offset += length
        for work in self._work.values():  # encode in the order gradients became ready (see synchronize)
            if id(work) in shared:
                work.request = work.reduction.send(shared[id(work)])
        self._vote, self._vote_result = None, torch.cat(flags)

    def synchronize(self) -> None:
        """Waits for every gradient's reduction and writes the results into ``p.grad``."""
        if not self._slots:
            self._synchronized = True
            return
        for index in range(len(self._slots)):
            if index not in self._work:
                self._submit(index)
        if self._vote is not None:
            self._finish_vote()
        divisor = self.process_set.size() if self.op == hvd.Average else 1
        # In submission order (the order backward made the gradients ready): the first payloads sent are the
        # first decoded, while later ones are still on the wire. Horovod matches collectives by name, so
        # this order need not be the same on every rank.
        for index, work in self._work.items():
            grad = self._slots[index].param.grad
            if isinstance(work, _Dense):
                hvd.synchronize(work.handle)
                if work.wire is not grad:
                    grad.copy_(work.wire)
            else:
                total = _drive(work).view_as(grad)
                if divisor > 1:
                    torch.div(total, divisor, out=grad)
                else:
                    grad.copy_(total)
        results = [self._slots[index].param.grad for index in sorted(self._work)]
        input_flags = self._vote_result
        self._reset_step()
        self._check_finite(input_flags, results)
        self._synchronized = True

    def _reset_step(self) -> None:
        self._work.clear()
        self._vote = self._vote_result = None
        self._compressed_started = 0
        for slot in self._slots:
            slot.delay = self.backward_passes_per_step

    def _check_finite(self, input_flags: torch.Tensor | None, results: list[torch.Tensor]) -> None:
        """One host sync per step: every rank reaches the same verdict from the vote and identical results."""
        output_bad = torch.stack([nonfinite(g) for g in results]).float()
        flags = output_bad if input_flags is None else torch.cat([input_flags.to(output_bad.device), output_bad])
        values = flags.tolist()
        if not any(values):
            return
        compressed = [slot for slot in self._slots if slot.collective is not None]
        inputs, outputs = values[:len(values) - len(self._slots)], values[len(values) - len(self._slots):]
        problems = [f"{slot.name!r} on rank {int(v) - 1}" for slot, v in zip(compressed, inputs, strict=True) if v]
        problems += [f"{slot.name!r} after reduction" for slot, v in zip(self._slots, outputs, strict=True) if v]
        message = f"non-finite gradient (NaN or Inf) in {', '.join(problems)}"
        if self.config.nonfinite == "raise":
            raise FloatingPointError(f"hvdcomp: {message}. Lower the learning rate, check the data, or set "
                                     "nonfinite: skip in the compression config to skip such steps")
        for slot in compressed:  # residuals may hold NaN now: start them afresh
            slot.state = slot.collective.init_state(slot.choice.compressor, slot.param.detach(), slot.seed)
        warnings.warn(f"hvdcomp: skipping this optimizer step: {message}", RuntimeWarning, stacklevel=3)
        self._skip_step = True

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has handed to collectives so far (dense gradients, compressed payloads,
        votes); dense float32 would be 4 bytes per gradient element per step."""
        compressed = sum(slot.collective.bytes_sent for slot in self._slots if slot.collective is not None)
        return compressed + self._uncompressed_bytes_sent

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
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
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
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus this rank's compressor state under ``"hvdcomp"``.

        Compressor state (error-feedback residuals, step counters of seeded draws) differs per rank: save
        one file per rank to resume exactly.
        """
        state = super().state_dict()
        state["hvdcomp"] = {slot.name: slot.state for slot in self._slots if slot.collective is not None}
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("hvdcomp", None)
        super().load_state_dict(state_dict)
        self._reset_step()
        self._synchronized = False
        for slot in self._slots:
            if saved is not None and slot.collective is not None:
                if slot.name not in saved:
                    raise ValueError(f"checkpoint has no hvdcomp state for parameter {slot.name!r}")
                slot.state = _to_device(saved[slot.name], slot.param.device)


def nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """True (a 0-dim bool tensor, no host sync) if ``tensor`` holds a NaN or an Inf.

    One pass that allocates nothing of the tensor's size: the min and max propagate NaN and show an Inf,
    where ``isfinite(t).all()`` writes a full-size mask (on one CPU thread, 116 ms against 6 ms for 25 M
    elements).
    """
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor)
    return torch.stack([low, high]).isfinite().all().logical_not()


def _drive(work: _Compressed) -> torch.Tensor:
    """Runs a reduction to completion: each yielded handle is waited for and its output sent back."""
    while True:
        output = hvd.synchronize(work.request)
        try:
            work.request = work.reduction.send(output)
        except StopIteration as done:
            return done.value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value


def _first_difference(mine: str, other: str) -> str:
    a, b = json.loads(mine), json.loads(other)
    for key in ("op", "passes", "nonfinite"):
        if a[key] != b[key]:
            return f"{key}: {a[key]} here, {b[key]} there"
    for x, y in zip(a["params"], b["params"], strict=False):
        if x != y:
            return f"parameter {x[0]!r}: {x[2]} {x[1]} here, {y[0]!r}: {y[2]} {y[1]} there"
    return f"{len(a['params'])} parameters here, {len(b['params'])} there"


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Compressor | str | Mapping[str, Any] | None = "none",
                         backward_passes_per_step: int = 1, op: Any = hvd.Average,
                         process_set: hvd.ProcessSet = hvd.global_process_set) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that gradients are averaged across ranks, compressed as configured.

    Args:
        optimizer: the optimizer to wrap (its class is subclassed, as ``hvd.DistributedOptimizer`` does).
        named_parameters: ``model.named_parameters()``; names key the config's patterns and the collectives.
        compression: a Compressor, a method name (``"terngrad"``, see ``hvdcomp.METHODS``) or a config
            mapping (see :mod:`hvdcomp.config`). ``"none"`` gives exactly stock Horovod's updates.
        backward_passes_per_step: backward passes accumulated locally before each reduction.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        process_set: the Horovod process set to reduce over.
    """
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op, process_set)
