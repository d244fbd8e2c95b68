"""Compression configuration: which compressor and collective each parameter uses.

``DistributedOptimizer(compression=...)`` accepts a :class:`~hvdcomp.compressor.Compressor`, a method name
(``"terngrad"``), or a dict as loaded from YAML::

    method: terngrad            # default for every parameter; see hvdcomp.METHODS
    options: {clip: 2.5}        # keyword arguments of the method's class
    error_feedback: null        # null: on for biased methods (topk), off for unbiased ones
    collective: auto            # auto | allgather | two_phase | sketch (summable methods always use allreduce,
                                # methods with a reduction of their own, PowerSGD, always use it; sketch sums
                                # the sparsifiers' payloads, hvdcomp.methods.sketch)
    collective_options: {}      # keyword arguments of the reduction (two_phase: owner_error_feedback)
    min_numel: 1024             # smaller tensors go uncompressed through Horovod's fused allreduce
    bucket_cap_mb: 0            # > 0: compress gradients of one method in buckets of about this many MiB (below)
    dense: ["fc3.*"]            # parameter-name patterns (fnmatch) that stay uncompressed
    overrides:                  # first matching pattern wins; any key above but min_numel, bucket_cap_mb, dense
      - match: "*.embedding.weight"
        method: topk
        options: {ratio: 0.001}
    seed: 0                     # base seed of the stochastic methods' draws: the same on every rank (checked)
    nonfinite: raise            # raise | skip: what a NaN/Inf compressed gradient does (see DistributedOptimizer)

An override that names a method takes that method's default ``options``, and one that names another method also its
default ``error_feedback`` (whether a method needs a memory is its own), not the top level's; ``collective`` and
``collective_options`` carry over.

``bucket_cap_mb`` (0: off) compresses the gradients that share a method, its options and collective, dtype and
device in buckets, as PyTorch's DDP buckets them for its communication hooks: in reverse model order (the order
backward makes them ready), each bucket closed once it holds ``bucket_cap_mb`` MiB. A bucket is concatenated and
compressed as one tensor once its last gradient is ready: one encoding and one set of collectives per bucket, where
a GPU spends most of a small gradient's compression issuing its kernels (docs/gpu.md). The method then sees the
bucket, not the layer: TernGrad's scaler, top-k's k, QSGD's norms and LGC's autoencoder are the bucket's. PowerSGD
reduces a bucket as PyTorch's hook reduces a DDP bucket: each matrix factored on its own, their Ps summed in one
allreduce and their Qs in another. The sketch method sums each gradient's rows as alone, with one vote for the
bucket and each round's collectives as one (:meth:`hvdcomp.methods.sketch.SketchReduction.reduce_bucket`).

``method: auto`` (or ``compression="auto"``) chooses each parameter's method and collective from measurements on the
running job (:mod:`hvdcomp.auto`; its ``options`` are :class:`AutoSettings`); ``min_numel``, ``bucket_cap_mb``,
``dense``, ``seed`` and ``nonfinite`` apply as above, and the keys that choose a method or collective are not taken
with it.

Every key and value is checked: unknown names are rejected with the list of valid ones.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hvdcomp import check, reductions
from hvdcomp.compressor import Compressor
from hvdcomp.error_feedback import with_memory
from hvdcomp.methods import ACCURACY_GUARD, METHODS

NONFINITE_CHOICES = ("raise", "skip")

_METHOD_KEYS = ("method", "options", "error_feedback", "collective", "collective_options")
_TOP_KEYS = (*_METHOD_KEYS, "min_numel", "bucket_cap_mb", "dense", "overrides", "seed", "nonfinite")
_OVERRIDE_KEYS = ("match", *_METHOD_KEYS)
_TOP = "compression config"  # where the top level's keys are, in messages
#: what auto chooses itself
_NOT_WITH_AUTO = ("error_feedback", "collective", "collective_options", "overrides")


@dataclass(frozen=True)
class AutoSettings:
    """``options`` of ``method: auto`` (the rule they tune is :mod:`hvdcomp.auto`'s docstring).

    Attributes:
        allow: methods of :data:`hvdcomp.methods.ACCURACY_GUARD` that may be chosen all the same.
        candidates: method -> its options: the methods to choose from (default: every registered method with its
            defaults, but the guarded ones).
        plans: how many of the best predicted plans race against dense (the fastest predicted, then single methods
            in predicted order). More plans find the fastest more often when the model misranks them (millisecond
            steps), and make every round longer.
        budget_s: seconds of racing: rounds go on until they have taken this long, 3 rounds at least (fewer cannot
            show a clear win). More rounds tell closer plans apart; tuning costs the job this once.
    """

    allow: tuple[str, ...] = ()
    candidates: Mapping[str, Mapping[str, Any]] | None = None
    plans: int = 3
    budget_s: float = 5.0

    @classmethod
    def parse(cls, options: Any) -> AutoSettings:
        options = options or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"options of method auto must be a mapping; got {options!r}")
        _check_keys("auto's options", options, ("allow", "candidates", "plans", "budget_s"))
        plans = check.integer("auto", "plans", options.get("plans", cls.plans), ge=1)
        budget_s = check.number("auto", "budget_s", options.get("budget_s", cls.budget_s), ge=0,
                                noun="number of seconds")
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
                if method in ("none", "auto") or method not in METHODS:
                    raise _unknown("compression method in auto's candidates", method,
                                   sorted(set(METHODS) - {"none"}))
                if not isinstance(method_options, (Mapping, type(None))):
                    raise ValueError(f"auto's candidates: the options of {method} must be a mapping; got "
                                     f"{method_options!r}")
                if method in ACCURACY_GUARD and method not in allow:
                    raise ValueError(f"auto's candidates: {method} is held back ({ACCURACY_GUARD[method]}); add it "
                                     "to allow to choose it all the same")
                make_compressor(method, method_options)  # its options, checked now
            candidates = {str(m): dict(o or {}) for m, o in candidates.items()}
        return cls(tuple(allow), candidates, plans, float(budget_s))

    def methods(self) -> dict[str, Mapping[str, Any]]:
        """The candidate methods and their options."""
        if self.candidates is not None:
            return dict(self.candidates)
        return {m: {} for m in METHODS if m != "none" and (m not in ACCURACY_GUARD or m in self.allow)}


def _unknown(kind: str, key: object, valid: tuple[str, ...] | list[str]) -> ValueError:
    return ValueError(f"unknown {kind} {key!r}; valid: {', '.join(valid)}")


def _check_keys(where: str, given: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    for key in given:
        if key not in valid:
            raise _unknown(f"key in {where}", key, valid)


def make_compressor(method: str, options: Mapping[str, Any] | None = None,
                    error_feedback: bool | None = None) -> Compressor:
    """Builds the named method with its memory policy (:func:`hvdcomp.error_feedback.with_memory`)."""
    if not isinstance(method, str) or method not in METHODS:
        raise _unknown("compression method", method, [*sorted(METHODS), "auto"] if method != "auto" else
                       sorted(METHODS))
    cls = METHODS[method]
    options = dict(options or {})
    valid = [name for name in inspect.signature(cls).parameters if name != "self"]
    for key in options:
        if key not in valid:
            raise _unknown(f"option for {method}", key, valid or ["(none)"])
    return with_memory(cls(**options), error_feedback)


def edges(names: Sequence[str]) -> set[str]:
    """The parameters of a model's first and last layers, from its parameter names in the model's order
    (``named_parameters()``; a layer is a name up to its last dot): what methods with ``dense_edges`` leave dense."""
    layers = [name.rpartition(".")[0] for name in names]
    if not layers:
        return set()
    return {name for name, layer in zip(names, layers, strict=True) if layer in (layers[0], layers[-1])}


@dataclass(frozen=True)
class Choice:
    """What one parameter gets: a compressor and its reduction, or ``None`` for Horovod's dense path."""

    compressor: Compressor | None
    reduction: reductions.ReductionMethod | None = None
    declined: str = ""  # why the configured method left this parameter dense

    def describe(self) -> str:
        return "dense" if self.reduction is None else repr(self.reduction)


@dataclass(frozen=True)
class _Rule:
    match: str
    compressor: Compressor
    collective: str
    collective_options: Mapping[str, Any] = field(default_factory=dict)


def _mapping(where: str, key: str, value: Any) -> Mapping[str, Any]:
    value = value or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} in {where} must be a mapping; got {value!r}")
    return value


def _rule(where: str, entry: Mapping[str, Any], match: str, defaults: Mapping[str, Any]) -> _Rule:
    # an override that names a method takes not the default's options (one that names none adds its own to them),
    # and for another method not its error_feedback
    # (whether a method needs a memory is the method's: a top-k override of an unbiased default without one would
    # lose what it does not send); the collective and its options carry over, each reduction taking those it takes
    if "method" not in entry:
        dropped: tuple[str, ...] = ()
    elif entry["method"] == defaults.get("method"):
        dropped = ("options",)
    else:
        dropped = ("options", "error_feedback")
    inherited = {k: v for k, v in defaults.items() if k not in dropped}
    merged = {**inherited, **entry}
    if "method" not in entry and "options" in entry:  # the default's method: its options, these over them
        merged["options"] = {**_mapping(_TOP, "options", defaults.get("options")),
                             **_mapping(where, "options", entry["options"])}
    collective = merged.get("collective", "auto")
    if collective not in reductions.selectable():
        raise _unknown(f"collective in {where}", collective, reductions.selectable())
    options = _mapping(where, "options", merged.get("options"))
    collective_options = _mapping(where, "collective_options", merged.get("collective_options"))
    try:
        compressor = make_compressor(merged.get("method", "none"), options, merged.get("error_feedback"))
        if merged.get("error_feedback") is False and compressor.own_memory:  # (true is refused by make_compressor)
            raise ValueError(f"{compressor.name} keeps its own memory: set its own option (e.g. error_feedback in "
                             "options) instead of the generic error_feedback key, which it would ignore")
        # checked now, not at the first parameter it meets; options inherited from the defaults were checked there
        # (against the default method), and each reduction is given only those it takes
        if "collective_options" in entry:
            reductions.check_options(compressor, collective_options, collective, named=where == _TOP)
        for name in reductions.resolved(compressor, collective):  # each checks the values it takes
            reductions.make(name, compressor, collective_options)
    except ValueError as error:
        if where == _TOP:  # (the top level's errors name their key already)
            raise
        raise ValueError(f"{where}: {error}") from error
    return _Rule(match, compressor, collective, collective_options)


@dataclass(frozen=True)
class CompressionConfig:
    """A validated compression config; :meth:`choose` answers for one parameter."""

    default: _Rule
    overrides: tuple[_Rule, ...] = ()
    dense: tuple[str, ...] = ()
    min_numel: int = 1024
    bucket_cap_mb: float = 0.0
    seed: int = 0
    nonfinite: str = "raise"
    source: Mapping[str, Any] = field(default_factory=dict)
    auto: AutoSettings | None = None  # method: auto (every parameter dense until the optimizer's tuner applies a plan)

    @classmethod
    def parse(cls, compression: Compressor | str | Mapping[str, Any] | None) -> CompressionConfig:
        if compression is None:
            compression = "none"
        if isinstance(compression, Compressor):
            return cls(default=_Rule("*", with_memory(compression), "auto"), source={"method": compression.name})
        if isinstance(compression, str):
            compression = {"method": compression}
        if not isinstance(compression, Mapping):
            got = compression.__name__ if isinstance(compression, type) else type(compression).__name__
            hint = ""
            if getattr(compression, "__module__", "").startswith("horovod"):  # hvd.Compression.fp16 and the like
                hint = ' (Horovod\'s own compression classes go to hvd.DistributedOptimizer; here say "fp16" or "none")'
            raise ValueError(f"compression must be a Compressor, a method name or a config mapping; got {got}{hint}")
        _check_keys(_TOP, compression, _TOP_KEYS)
        if compression.get("method") == "auto":
            for key in _NOT_WITH_AUTO:
                if key in compression:
                    raise ValueError(f"{key} does not go with method auto, which chooses every parameter's method and "
                                     "collective; keep parameters uncompressed with dense: [patterns]")
            settings = AutoSettings.parse(compression.get("options"))
            rest = {key: value for key, value in compression.items() if key not in ("method", "options")}
            return replace(cls.parse({**rest, "method": "none"}), auto=settings, source=dict(compression))
        defaults = {key: compression[key] for key in _METHOD_KEYS if key in compression}
        default = _rule(_TOP, defaults, "*", {})
        overrides = []
        entries = compression.get("overrides") or []
        if not isinstance(entries, list | tuple):
            raise check.invalid("", "overrides", "a list of mappings, each with a 'match' pattern", entries)
        for i, entry in enumerate(entries):
            where = f"overrides[{i}]"
            if not isinstance(entry, Mapping) or not isinstance(entry.get("match"), str):
                raise ValueError(f"{where} must be a mapping with a 'match' pattern (a string); got {entry!r}")
            _check_keys(where, entry, _OVERRIDE_KEYS)
            overrides.append(_rule(where, {k: v for k, v in entry.items() if k != "match"}, entry["match"], defaults))
        dense = compression.get("dense") or []
        if not isinstance(dense, list | tuple) or not all(isinstance(p, str) for p in dense):
            raise check.invalid("", "dense", "a list of parameter-name patterns", dense)
        min_numel = check.integer("", "min_numel", compression.get("min_numel", 1024), ge=0)
        bucket_cap_mb = check.number("", "bucket_cap_mb", compression.get("bucket_cap_mb", 0), ge=0,
                                     noun="number of MiB")
        seed = check.integer("", "seed", compression.get("seed", 0))
        nonfinite = compression.get("nonfinite", "raise")
        if nonfinite not in NONFINITE_CHOICES:
            raise _unknown("nonfinite policy", nonfinite, NONFINITE_CHOICES)
        return cls(default, tuple(overrides), tuple(dense), min_numel, float(bucket_cap_mb), seed, nonfinite,
                   dict(compression))

    def buckets(self, planned: Sequence[tuple[torch.Tensor, Choice]]) -> list[list[int]]:
        """The buckets (``bucket_cap_mb``) of two or more of ``planned`` (each parameter and its choice, in the order
        backward readies them: reverse model order), as positions in it. A compressed gradient goes into the open
        bucket of its method (its options and collective), dtype and device, which closes once it holds
        ``bucket_cap_mb`` MiB."""
        cap = self.bucket_cap_mb * 2**20
        if not cap:
            return []
        open_buckets: dict[Any, tuple[list[int], int]] = {}
        closed = []
        for position, (param, choice) in enumerate(planned):
            if choice.reduction is None:
                continue
            key = choice.describe(), param.dtype, param.device
            members, nbytes = open_buckets.pop(key, ([], 0))
            members.append(position)
            nbytes += param.numel() * param.element_size()
            if nbytes >= cap:
                closed.append(members)
            else:
                open_buckets[key] = members, nbytes
        closed += [members for members, _ in open_buckets.values()]
        return [members for members in closed if len(members) > 1]

    def unmatched(self, names: Sequence[str]) -> list[str]:
        """The ``dense`` patterns and overrides' ``match`` patterns that match none of ``names``: a misspelled
        pattern, or a model's names read wrong (the optimizer warns of them)."""
        def matches(pattern: str) -> bool:
            return any(fnmatch.fnmatchcase(name, pattern) for name in names)
        found = [f"dense pattern {pattern!r}" for pattern in self.dense if not matches(pattern)]
        return found + [f"overrides[{i}]'s match {rule.match!r}" for i, rule in enumerate(self.overrides)
                        if not matches(rule.match)]

    def choose(self, name: str, shape: torch.Size | tuple[int, ...], world_size: int, edge: bool = False) -> Choice:
        """The compressor and reduction for parameter ``name`` of ``shape`` (see :func:`reductions.choose`);
        ``edge``: it belongs to the model's first or last layer, which methods with ``dense_edges`` leave dense.

        A parameter the configured method declines (its shape, or an edge) stays dense, and the Choice says why."""
        shape = torch.Size(shape)
        if shape.numel() < self.min_numel or any(fnmatch.fnmatchcase(name, p) for p in self.dense):
            return Choice(None)
        rule = next((r for r in self.overrides if fnmatch.fnmatchcase(name, r.match)), self.default)
        compressor = rule.compressor
        if compressor.name == "none":
            return Choice(None)
        if edge and compressor.dense_edges:
            return Choice(None, declined=f"{compressor.name} keeps the model's first and last layers dense "
                                         "(dense_edges)")
        if not compressor.compresses(shape):
            return Choice(None, declined=compressor.why_dense(shape))
        reduction = reductions.choose(compressor, rule.collective, world_size)
        return Choice(compressor, reductions.make(reduction, compressor, rule.collective_options))
