"""GraVAC: gradient variance-based adaptive compression (Tyagi and Swany, IEEE CLOUD 2023, arXiv:2305.12201).

A controller around a compressor with a ratio knob that picks the compression factor (CF) online. Its signal
is the *gain* of a CF c on the error-compensated gradient p (the gradient plus the method's memory):

    gain(c) = ||C_c(p)|| / ||p||,          summed over ranks: sqrt(sum_r ||C_c(p_r)||^2 / sum_r ||p_r||^2)

for the sparsifiers, which keep some of p's entries (then ||C_c(p)||^2 = ||p||^2 - ||C_c(p) - p||^2). This is not
quite the paper's: its code divides the smoothed ||C_c(p)|| by the smoothed norm of the gradient g alone, which error
feedback can take above 1; here the gain is at most 1, and lower the more p holds that earlier steps left unsent, so
this controller falls back to a lower CF, or dense, sooner than the paper's.
A quantizer's C_c(p) is noisy, not a part of p: an unbiased one's ||C_c(p)|| exceeds ||p|| by its variance, more
the more it compresses, so its gain is the part of p's norm that its error leaves, 0 where the error outweighs p:

    gain(c) = sqrt(max(0, 1 - sum_r ||C_c(p_r) - p_r||^2 / sum_r ||p_r||^2))

smoothed by an exponentially weighted moving average over the last ``window`` steps at that CF (weights
(1 - alpha)^age, normalized; it restarts when the CF changes). Every step compresses p at the current CF and at
the least aggressive candidate c_min, and sends (Section IV of the paper):

* C_c(p) if the smoothed gain of c is at least ``epsilon``;
* else C_{c_min}(p) if the smoothed gain of c_min is at least ``epsilon``;
* else p itself, dense (allreduce).

During the first ``warmup_steps`` steps it sends C_{c_min}(p). Then it explores: each candidate, from the least
aggressive up, is tried for ``interval`` steps (an epoch in the paper) and scored by its compression throughput,
samples/s x mean gain (here 1 / mean step time x mean gain: the batch is fixed). Exploration stops when the two
best scores are within ``omega`` of each other (relative), keeping the more aggressive of the two, or when every
candidate was tried, keeping the best. (The authors' code jumps straight to the largest CF at that point; this
follows the paper's text, as ../shared/notes/methods.md records.)

Every input to a decision is agreed across ranks: the squared norms and each rank's step time are summed in the
step's vote (one small collective for all parameters), and the decision is computed from the sums on every rank
alike, so all ranks change CF in the same step (the CF and phase are in the plan the optimizer checks). The
decision reads the vote's result on the host once the vote is done (at a backward hook that finds it done, where
the optimizer resolves the vote, or in ``synchronize()``): the vote copies it there (``Agree.host``) in its one
transfer a step, with every other parameter's.

The step time is the wall time between this parameter's consecutive reductions on each rank (its mean over
ranks). A step's reading covers mostly the previous step's communication, so the first step of each trial is not
timed (``interval`` is at least 2), and a trial's throughput is that of what was sent while it ran (the least CF,
where the epsilon rule fell back to it). The first step after a resume, which has no previous reading in this
process, takes the last agreed step time: a resumed run continues the same schedule from the checkpointed state,
but runs are reproducible only as far as their step times are.

Here each tensor has a controller of its own (the paper adapts one CF for the whole model from the sum of the
layers' norms): a tensor whose gradient compresses badly falls back alone. Candidates and what their CF sets:

* ``topk``, ``randomk``: ratio = 1 / CF; ``threshold``: density = 1 / CF; with error feedback kept by GraVAC
  (random-k without its momentum correction: the optimizer's momentum applies).
* ``dgc``: DGC's memory (momentum correction, accumulation, factor masking) with top-k at density 1 / CF;
  GraVAC's warm-up and CFs replace DGC's sparsity warm-up.
* ``qsgd``, ``orq`` (a bits knob): the bit width whose payload, its buckets' tables included, compresses nearest
  the CF (within 25%): the default candidates 4, 8 and 16 give QSGD 8, 4 and 2 bits (3.97x, 7.88x, 15.5x with its
  norm per bucket of 512) and ORQ 5, 3 and 2 (4.57x, 9.14x, 14.2x: 2^bits levels per bucket).
* ``randomk`` keeps about 1/sqrt(CF) of p's norm whatever p is, so a CF is refused where that is under
  ``epsilon`` (it would never be sent: 0.32 at 10x).

Knobs: ``method`` and ``options`` (the wrapped method and its other options), ``candidates`` (CFs, default
10x to 10,000x), ``epsilon`` (0.75), ``alpha`` (0.05), ``window`` (25 steps), ``warmup_steps`` (25), ``omega``
(0.05), ``interval`` (100 steps per explored candidate).
"""

from __future__ import annotations

import inspect
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hvdcomp import check
from hvdcomp.compressor import METHODS, Compressor, Context, State
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.methods.dgc import DGC
from hvdcomp.methods.topk import Sparse, TopK
from hvdcomp.quantization import BucketQuantizer
from hvdcomp.reductions import Phase, ReductionMethod
from hvdcomp.requests import Agree, Allgather, Allreduce, Reduction
from hvdcomp.wire import Payload

if TYPE_CHECKING:
    from hvdcomp.perfmodel.schema import Encoded

#: the wrapped methods and the option their CF sets
KNOBS = {"topk": "ratio", "randomk": "ratio", "threshold": "density", "dgc": "density", "qsgd": "bits",
         "orq": "bits"}
DENSITY_CANDIDATES = (10.0, 100.0, 1000.0, 10000.0)
BITS_CANDIDATES = (4.0, 8.0, 16.0)

#: the clock step times are read from (a test may replace it to script step times)
clock: Callable[[], float] = time.perf_counter
#: this process: a clock reading saved by another process (a checkpoint) is not comparable with ours
_PROCESS = uuid.uuid4().hex

#: a decision's outcome: the candidate index sent, or DENSE
DENSE = -1


class GraVAC(Compressor):
    """GraVAC's adaptive CF around ``method`` (see the module docstring for each knob)."""

    name = "gravac"
    unbiased = False
    own_memory = True  # GraVAC keeps the memory: error feedback, or DGC's
    reduction = "gravac"
    epoch_options = ("interval",)

    def __init__(self, method: str = "topk", options: Mapping[str, Any] | None = None,
                 candidates: Sequence[float] | None = None, epsilon: float = 0.75, alpha: float = 0.05,
                 window: int = 25, warmup_steps: int = 25, omega: float = 0.05, interval: int = 100) -> None:
        if method not in KNOBS:
            raise ValueError(f"gravac: method must be one with a ratio knob, one of {', '.join(sorted(KNOBS))}; "
                             f"got {method!r}")
        if options is not None and not isinstance(options, Mapping):
            raise check.invalid(self.name, "options", f"a mapping of {method}'s options", options)
        options = dict(options or {})
        knob = KNOBS[method]
        if knob in options:
            raise ValueError(f"gravac: {method}'s {knob} is what gravac sets from the CF; leave it out of options")
        # GraVAC keeps the memory: the momentum correction of randomk's option is not in it (DGC's is its memory)
        valid = [key for key in inspect.signature(METHODS[method]).parameters
                 if key != knob and (key != "momentum" or method == "dgc")]
        for key in options:
            if key not in valid:
                raise ValueError(f"gravac: unknown option {key!r} for {method}; valid: {', '.join(valid)}")
        if options.get("unbiased"):
            raise ValueError("gravac: randomk's unbiased variant does not take error feedback, which gravac keeps")
        if candidates is None:
            candidates = BITS_CANDIDATES if knob == "bits" else DENSITY_CANDIDATES
        check.numbers(self.name, "candidates", candidates, gt=1, nonempty=True, noun="compression factors")
        for key, value in (("epsilon", epsilon), ("alpha", alpha), ("omega", omega)):
            check.number(self.name, key, value, gt=0, le=1)
        for key, value, low in (("window", window, 1), ("warmup_steps", warmup_steps, 0), ("interval", interval, 2)):
            check.integer(self.name, key, value, ge=low)
        self.method = method
        self.options = options
        self.candidates = tuple(sorted(float(c) for c in candidates))
        hopeless = [cf for cf in self.candidates if 1 / math.sqrt(cf) < epsilon] if method == "randomk" else []
        if hopeless:
            raise ValueError(f"gravac: randomk keeps about 1/sqrt(CF) of a gradient's norm ("
                             f"{1 / math.sqrt(hopeless[0]):.3g} at CF {hopeless[0]:g}), under epsilon {epsilon:g} at "
                             f"CFs {', '.join(f'{cf:g}' for cf in hopeless)}: it would never send them; use CFs up to "
                             f"{1 / epsilon**2:.3g} or an epsilon up to {1 / math.sqrt(self.candidates[-1]):.3g}")
        self.epsilon, self.alpha, self.omega = float(epsilon), float(alpha), float(omega)
        self.window, self.warmup_steps, self.interval = window, warmup_steps, interval
        self._memory = DGC(**options) if method == "dgc" else None
        #: the quantizers' gain comes from their error (the module docstring)
        self._gain_from_error = knob == "bits"
        self._widths = self._bit_widths() if self._gain_from_error else []
        self._compressors = [self._candidate(cf) for cf in self.candidates]
        widths = [getattr(c, "bits", None) for c in self._compressors]
        if self._gain_from_error and len(set(widths)) < len(widths):
            raise ValueError(f"gravac: {self.method}'s CFs {', '.join(f'{c:g}' for c in self.candidates)} come nearest "
                             f"the bit widths {widths}, one of them twice; use CFs further apart")

    def steady_from(self) -> int:
        return self.warmup_steps

    def accuracy_risk(self) -> str | None:
        if self.method != "randomk":
            return None
        # its memory is error feedback alone: random-k's momentum correction is not in it
        return f"gravac over randomk keeps no momentum correction: {METHODS['randomk'](momentum=0.0).accuracy_risk()}"

    def _candidate(self, cf: float) -> Compressor:
        knob = KNOBS[self.method]
        if self.method == "dgc":
            return TopK(ratio=1 / cf)
        if knob == "bits":
            return self._quantizer(cf)
        return METHODS[self.method](**self.options, **{knob: 1 / cf})

    def _bit_widths(self) -> list[BucketQuantizer]:
        """The method at each bit width in its range, with the given options."""
        METHODS[self.method](**self.options)  # the options' own errors, named by the method
        widths = []
        for bits in range(1, 9):
            try:
                widths.append(METHODS[self.method](**self.options, bits=bits))
            except ValueError:  # outside the method's range
                continue
        return widths

    def _quantizer(self, cf: float) -> BucketQuantizer:
        """The method at the bit width whose payload compresses nearest ``cf`` (within 25%), tables included."""
        widths = self._widths
        best = min(widths, key=lambda q: abs(math.log(32 / q.bits_per_element() / cf)))
        factor = 32 / best.bits_per_element()
        if abs(math.log(factor / cf)) > math.log(1.25):
            factors = sorted(32 / q.bits_per_element() for q in widths)
            raise ValueError(f"gravac: {self.method}'s payloads compress {factors[0]:.3g}x to {factors[-1]:.3g}x "
                             f"(its buckets' tables included), none within 25% of CF {cf:g}; use CFs in that range")
        return best

    def compressor(self, index: int) -> Compressor:
        """The compressor of candidate ``index`` (candidates sorted, least aggressive first)."""
        return self._compressors[index]

    @property
    def applies_momentum(self) -> bool:  # type: ignore[override]
        return self._memory is not None and self._memory.applies_momentum

    # ----------------------------------------------------------------------------------- state, memory

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        memory = (self._memory.init_state(tensor, ctx) if self._memory is not None else
                  {"residual": torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device)})
        return {"memory": memory, "inner": [c.init_state(tensor, ctx) for c in self._compressors],
                "cf": 0, "phase": "warmup" if self.warmup_steps else "explore", "gains": [[], []],
                "scores": [None] * len(self.candidates), "trial": [0, 0.0, 0.0],
                "clock": None, "last": None}

    def plan(self, state: State) -> str:
        return f"cf {self.candidates[state['cf']]:g} {state['phase']}"

    def compensate(self, tensor: torch.Tensor, state: State, ctx: Context) -> torch.Tensor:
        """p: the gradient plus the memory (flat float32, the memory's buffer)."""
        if self._memory is not None:
            return self._memory.accumulate(tensor, state["memory"], ctx)
        return state["memory"]["residual"].add_(tensor.detach().reshape(-1))

    def keep(self, state: State, sent: int, payload: Payload, meta: Any) -> None:
        """The memory after sending ``payload`` of candidate ``sent`` (or p itself, DENSE)."""
        if self._memory is not None:
            self._memory.release(state["memory"], None if sent == DENSE else payload[1])
        elif sent == DENSE:
            state["memory"]["residual"].zero_()
        else:
            self._compressors[sent].subtract(state["memory"]["residual"], payload, meta)

    def encode(self, index: int, p: torch.Tensor, state: State, ctx: Context) -> tuple[Payload, Any]:
        """Candidate ``index``'s payload of p and its meta."""
        return self._compressors[index].compress(p, state["inner"][index], ctx)

    def measured(self, index: int, p: torch.Tensor, payload: Payload, meta: Any) -> torch.Tensor:
        """The tensor whose squared norm the step agrees on for candidate ``index``'s gain: for the sparsifiers a
        tensor with the norm of what ``payload`` decodes to (its values where indices are unique, else the decoded
        tensor); for the quantizers the error, decoded minus p (the module docstring)."""
        compressor = self._compressors[index]
        if isinstance(compressor, Sparse):
            return payload[0]
        decoded = compressor.decompress(payload, meta).reshape(-1)
        return decoded.sub_(p) if self._gain_from_error else decoded

    # -------------------------------------------------------------------------------------- decisions

    def decisions(self, state: State) -> list[Any] | None:
        """[CF, what was sent (a CF or "dense"), gain] of the last step."""
        last = state["last"]
        return None if last is None else [last["cf"], last["sent"], round(last["gain"], 5)]

    def decide(self, state: State, step: int, sums: Sequence[float], size: int) -> int:
        """Returns what this step sends (the current candidate's index, 0 for the least aggressive, or DENSE)
        from the agreed sums (||p||^2, ||C_c(p)||^2, ||C_min(p)||^2, step time; for the quantizers the errors'
        squared norms in place of ||C(p)||^2: :meth:`measured`), and updates the controller for
        the next step (the end of the warm-up, a trial's score, the next candidate). The same sums give the
        same result on every rank."""
        total, current_sq, least_sq, step_time = sums
        if self._gain_from_error:  # the sums are the errors' (measured())
            current_sq, least_sq = total - current_sq, total - least_sq
        gains = [math.sqrt(max(current_sq, 0.0) / total) if total > 0 else 1.0,
                 math.sqrt(max(least_sq, 0.0) / total) if total > 0 else 1.0]
        smoothed = []
        for history, gain in zip(state["gains"], gains, strict=True):
            history.append(gain)
            del history[:-self.window]
            weights = [(1 - self.alpha) ** age for age in range(len(history) - 1, -1, -1)]
            smoothed.append(sum(w * g for w, g in zip(weights, history, strict=True)) / sum(weights))
        cf = state["cf"]
        state["last"] = {"cf": self.candidates[cf], "gain": gains[0], "step_time": step_time / size}
        if state["phase"] == "warmup":
            sent = 0
        elif smoothed[0] >= self.epsilon:
            sent = cf
        else:
            sent = 0 if smoothed[1] >= self.epsilon else DENSE
        # what changes for the next step
        if state["phase"] == "warmup" and step + 1 >= self.warmup_steps:
            state["phase"] = "explore"
            self._switch(state, 0)
        elif state["phase"] == "explore":
            trial = state["trial"]  # steps, sum of gains, time of the steps after the first
            trial[0] += 1
            trial[1] += gains[0]
            if trial[0] > 1:  # the first step's reading is mostly the previous candidate's step
                trial[2] += step_time / size
            if trial[0] >= self.interval:
                self._score(state, trial)
        return sent

    def _score(self, state: State, trial: list[Any]) -> None:
        """Ends one candidate's trial: its score, then the next candidate or the end of exploration."""
        steps, gain_sum, time_sum = trial
        scores = state["scores"]
        scores[state["cf"]] = (gain_sum / steps) * ((steps - 1) / time_sum if time_sum > 0 else 1.0)
        tried = sorted((s, i) for i, s in enumerate(scores) if s is not None)
        if len(tried) >= 2:
            (second, i2), (best, i1) = tried[-2], tried[-1]
            if best - second <= self.omega * best:
                state["phase"] = "exploit"
                self._switch(state, max(i1, i2))  # the more aggressive of the two
                return
        if state["cf"] + 1 < len(self.candidates):
            self._switch(state, state["cf"] + 1)
        else:
            state["phase"] = "exploit"
            self._switch(state, tried[-1][1])

    @staticmethod
    def _switch(state: State, index: int) -> None:
        if index != state["cf"]:
            state["gains"][0] = []  # the current CF's history; c_min's goes on
        state["cf"] = index
        state["trial"] = [0, 0.0, 0.0]

    # ------------------------------------------------------------------------ one rank (bench, profile)

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        """One rank on its own: the current candidate's payload of p, with the memory kept (no decision:
        decisions need the agreed values of the reduction)."""
        p = self.compensate(tensor, state, ctx)
        payload, meta = self.encode(state["cf"], p, state, ctx)
        self.keep(state, state["cf"], payload, meta)
        return payload, (state["cf"], meta, tensor.shape)

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        index, inner, shape = meta
        return self._compressors[index].decompress(payload, inner).reshape(shape)


def agreed_inputs(tensors: list[torch.Tensor], step_time: float) -> torch.Tensor:
    """What a step agrees on: the squared norms of p, C_c(p) and C_min(p) (``tensors``), then the step time; float32
    on p's device, without a host-to-device copy. On the Triton kernels three launches (the step time's fill, the
    norms in two); elsewhere PyTorch's ``pow`` and ``sum`` per tensor."""
    local = tensors[0].new_full((len(tensors) + 1,), step_time, dtype=torch.float32)
    kernels = kernels_for(tensors[0].device)
    if is_triton(kernels) and len(tensors) <= kernels.MAX_NORMS:
        kernels.squared_norms([t.contiguous() for t in tensors], local)
        return local
    norms = torch.stack([t.float().square().sum() for t in tensors])
    return torch.cat([norms, local[len(tensors):]])


class GraVACReduction(ReductionMethod):
    """GraVAC's step: compress at the current and the least CF, agree on the norms and step times (in the
    step's vote), decide, then send the chosen payload (gathered, or allreduced if summable) or p dense."""

    name = "gravac"

    @classmethod
    def rejects(cls, traits: Any) -> str | None:
        return None if traits.reduction == cls.name else f"{traits!r} is not GraVAC"

    @classmethod
    def phases(cls, e: Encoded, workers: int) -> list[Phase]:
        """For the performance model, the profiled payload (the CF in force, the least at first) gathered, as
        top-k's is; the wait for the step's vote before sending is not modeled (a random-k inner, which is
        allreduced, is priced as gathered too)."""
        return [Phase("allgather", e.wire_bytes)]

    def reduce(self, tensor: torch.Tensor, state: State, ctx: Context) -> Reduction:
        method: GraVAC = self.compressor  # type: ignore[assignment]  # own_memory: never wrapped
        now = clock()
        if state["clock"] is not None and state["clock"][0] == _PROCESS:
            step_time = now - state["clock"][1]
        else:  # the first step, or the first after a resume: the last agreed step time stands in for it
            step_time = 0.0 if state["last"] is None else state["last"]["step_time"]
        state["clock"] = (_PROCESS, now)
        p = method.compensate(tensor, state, ctx)
        current = method.encode(state["cf"], p, state, ctx)
        least = current if state["cf"] == 0 else method.encode(0, p, state, ctx)
        measured_now = method.measured(state["cf"], p, *current)
        local = agreed_inputs([p, measured_now, measured_now if least is current else method.measured(0, p, *least)],
                              step_time)
        before = state["cf"]
        sums = yield Agree(local, "sum", host=True)
        sent = method.decide(state, ctx.step, sums.tolist(), ctx.size)
        state["last"]["sent"] = "dense" if sent == DENSE else method.candidates[sent]
        if sent == DENSE:
            (total,) = yield Allreduce([p.clone()])
            method.keep(state, DENSE, [], None)
            return total.view(tensor.shape)
        payload, meta = current if sent == before else least
        compressor = method.compressor(sent)
        method.keep(state, sent, payload, meta)
        if compressor.summable:
            summed = yield Allreduce(payload)
            return compressor.decompress(summed, meta).reshape(tensor.shape)
        payloads = yield Allgather(payload, compressor.fixed_size_on(tensor.device))
        return compressor.aggregate(payloads, meta).reshape(tensor.shape)
