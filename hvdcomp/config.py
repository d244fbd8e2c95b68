"""Compression configuration: which compressor and collective each parameter uses.

``DistributedOptimizer(compression=...)`` accepts a :class:`~hvdcomp.compressor.Compressor`, a method name
(``"terngrad"``), or a dict as loaded from YAML::

    method: terngrad            # default for every parameter; see hvdcomp.METHODS
    options: {clip: 2.5}        # keyword arguments of the method's class
    error_feedback: null        # null: on for biased methods (topk), off for unbiased ones
    collective: auto            # auto | allgather | two_phase (summable methods always use allreduce)
    min_numel: 1024             # smaller tensors go uncompressed through Horovod's fused allreduce
    dense: ["fc3.*"]            # parameter-name patterns (fnmatch) that stay uncompressed
    overrides:                  # first matching pattern wins; any key above except dense/min_numel/seed
      - match: "*.embedding.weight"
        method: topk
        options: {ratio: 0.001}
    seed: 0                     # base seed of the stochastic methods' draws
    nonfinite: raise            # raise | skip: what a NaN/Inf gradient does (see DistributedOptimizer)

Every key and value is checked: unknown names are rejected with the list of valid ones.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hvdcomp.compressor import Compressor
from hvdcomp.error_feedback import ErrorFeedback
from hvdcomp.methods import METHODS

COLLECTIVE_CHOICES = ("auto", "allgather", "two_phase")
NONFINITE_CHOICES = ("raise", "skip")
#: With ``collective: auto``, fixed-size gathered payloads switch to the two-phase scheme above this many
#: ranks: allgather receives (N-1) payloads per rank, two-phase about 2 at any N.
TWO_PHASE_MIN_RANKS = 5

_METHOD_KEYS = ("method", "options", "error_feedback", "collective")
_TOP_KEYS = (*_METHOD_KEYS, "min_numel", "dense", "overrides", "seed", "nonfinite")
_OVERRIDE_KEYS = ("match", *_METHOD_KEYS)


def _unknown(kind: str, key: object, valid: tuple[str, ...] | list[str]) -> ValueError:
    return ValueError(f"unknown {kind} {key!r}; valid: {', '.join(valid)}")


def _check_keys(where: str, given: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    for key in given:
        if key not in valid:
            raise _unknown(f"key in {where}", key, valid)


def make_compressor(method: str, options: Mapping[str, Any] | None = None,
                    error_feedback: bool | None = None) -> Compressor:
    """Builds the named method; error feedback defaults to on for biased methods."""
    if method not in METHODS:
        raise _unknown("compression method", method, sorted(METHODS))
    cls = METHODS[method]
    options = dict(options or {})
    valid = [name for name in inspect.signature(cls).parameters if name != "self"]
    for key in options:
        if key not in valid:
            raise _unknown(f"option for {method}", key, valid or ["(none)"])
    compressor = cls(**options)
    if error_feedback is None:
        error_feedback = not cls.unbiased
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be true, false or null; got {error_feedback!r}")
    return ErrorFeedback(compressor) if error_feedback else compressor


@dataclass(frozen=True)
class Choice:
    """What one parameter gets: a compressor and collective name, or ``None`` for Horovod's dense path."""

    compressor: Compressor | None
    collective: str = "allreduce"

    def describe(self) -> str:
        return "dense" if self.compressor is None else f"{self.compressor!r} via {self.collective}"


@dataclass(frozen=True)
class _Rule:
    match: str
    compressor: Compressor
    collective: str


def _rule(where: str, entry: Mapping[str, Any], match: str, defaults: Mapping[str, Any]) -> _Rule:
    merged = {**defaults, **entry}
    collective = merged.get("collective", "auto")
    if collective not in COLLECTIVE_CHOICES:
        raise _unknown(f"collective in {where}", collective, COLLECTIVE_CHOICES)
    options = merged.get("options") or {}
    if not isinstance(options, Mapping):
        raise ValueError(f"options in {where} must be a mapping; got {options!r}")
    if "method" in entry and "options" not in entry:
        options = {}  # another method's options do not carry over
    compressor = make_compressor(merged.get("method", "none"), options, merged.get("error_feedback"))
    return _Rule(match, compressor, collective)


@dataclass(frozen=True)
class CompressionConfig:
    """A validated compression config; :meth:`choose` answers for one parameter."""

    default: _Rule
    overrides: tuple[_Rule, ...] = ()
    dense: tuple[str, ...] = ()
    min_numel: int = 1024
    seed: int = 0
    nonfinite: str = "raise"
    source: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, compression: Compressor | str | Mapping[str, Any] | None) -> CompressionConfig:
        if compression is None:
            compression = "none"
        if isinstance(compression, Compressor):
            return cls(default=_Rule("*", compression, "auto"), source={"method": compression.name})
        if isinstance(compression, str):
            compression = {"method": compression}
        if not isinstance(compression, Mapping):
            raise ValueError(f"compression must be a Compressor, a method name or a config mapping; "
                             f"got {type(compression).__name__}")
        _check_keys("compression config", compression, _TOP_KEYS)
        defaults = {key: compression[key] for key in _METHOD_KEYS if key in compression}
        default = _rule("compression config", defaults, "*", {})
        overrides = []
        for i, entry in enumerate(compression.get("overrides") or []):
            where = f"overrides[{i}]"
            if not isinstance(entry, Mapping) or "match" not in entry:
                raise ValueError(f"{where} must be a mapping with a 'match' pattern; got {entry!r}")
            _check_keys(where, entry, _OVERRIDE_KEYS)
            overrides.append(_rule(where, {k: v for k, v in entry.items() if k != "match"}, str(entry["match"]),
                                   defaults))
        dense = compression.get("dense") or []
        if isinstance(dense, str) or not all(isinstance(p, str) for p in dense):
            raise ValueError(f"dense must be a list of parameter-name patterns; got {dense!r}")
        min_numel = compression.get("min_numel", 1024)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative integer; got {min_numel!r}")
        seed = compression.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer; got {seed!r}")
        nonfinite = compression.get("nonfinite", "raise")
        if nonfinite not in NONFINITE_CHOICES:
            raise _unknown("nonfinite policy", nonfinite, NONFINITE_CHOICES)
        return cls(default, tuple(overrides), tuple(dense), min_numel, seed, nonfinite, dict(compression))

    def choose(self, name: str, numel: int, world_size: int) -> Choice:
        """The compressor and collective for parameter ``name`` of ``numel`` elements."""
        if numel < self.min_numel or any(fnmatch.fnmatchcase(name, p) for p in self.dense):
            return Choice(None)
        rule = next((r for r in self.overrides if fnmatch.fnmatchcase(name, r.match)), self.default)
        compressor = rule.compressor
        if compressor.name == "none":
            return Choice(None)
        if compressor.summable:
            return Choice(compressor, "allreduce")
        collective = rule.collective
        if collective == "auto":
            use_two_phase = compressor.fixed_size and world_size >= TWO_PHASE_MIN_RANKS
            collective = "two_phase" if use_two_phase else "allgather"
        return Choice(compressor, collective)
