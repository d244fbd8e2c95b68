"""The YAML files of the performance model: a cluster (``hvdcomp probe``, or a nominal preset) and a model
profile (``hvdcomp profile``), loaded into frozen dataclasses. Units are in the keys (``latency_us``,
``bandwidth_gbps`` in Gbit/s, ``time_ms``, ``bytes``). Every error names the file and the field path
(``inter_node.allreduce.busbw_gbps``), and unknown keys are refused with the valid ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hvdcomp import check
from hvdcomp.perfmodel.costs import Link

COLLECTIVES = ("allreduce", "allgather", "alltoall")
#: Horovod 0.28's defaults (horovod/common/operations.cc): 128 MiB fusion buffer, 1 ms cycle.
HOROVOD_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024


class Fields:
    """Typed access to one mapping of a YAML document, with errors that name the field path."""

    def __init__(self, data: Any, path: str, where: str) -> None:
        if not isinstance(data, Mapping):
            raise check.invalid(where, path or "the document", "a mapping", data)
        self.data, self.path, self.where = data, path, where
        self.read: set[str] = set()

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str, default: Any) -> Any:
        self.read.add(key)
        if key not in self.data:
            if default is _REQUIRED:
                raise ValueError(f"{self.where}: missing field {self._name(key)}")
            return default
        return self.data[key]

    def _fail(self, key: str, expected: str, value: Any) -> ValueError:
        return check.invalid(self.where, self._name(key), expected, value)

    def number(self, key: str, minimum: float = 0.0, strict: bool = False, default: Any = None) -> float:
        value = self._get(key, _REQUIRED if default is None else default)
        return check.number(self.where, self._name(key), value, gt=minimum if strict else None,
                            ge=None if strict else minimum)

    def integer(self, key: str, minimum: int = 0, default: Any = None) -> int:
        value = self._get(key, _REQUIRED if default is None else default)
        return check.integer(self.where, self._name(key), value, ge=minimum)

    def string(self, key: str, choices: tuple[str, ...] | None = None, default: Any = None) -> str:
        value = self._get(key, _REQUIRED if default is None else default)
        if choices is not None:
            return check.choice(self.where, self._name(key), value, choices)
        if not isinstance(value, str):
            raise self._fail(key, "a string", value)
        return value

    def boolean(self, key: str, default: Any = None) -> bool:
        value = self._get(key, _REQUIRED if default is None else default)
        return check.boolean(self.where, self._name(key), value)

    def mapping(self, key: str, required: bool = True) -> Fields | None:
        value = self._get(key, _REQUIRED if required else None)
        return None if value is None else Fields(value, self._name(key), self.where)

    def sequence(self, key: str) -> list[Fields]:
        value = self._get(key, _REQUIRED)
        if not isinstance(value, list) or not value:
            raise self._fail(key, "a non-empty list", value)
        return [Fields(item, f"{self._name(key)}[{i}]", self.where) for i, item in enumerate(value)]

    def informational(self, *keys: str) -> None:
        """Keys kept for people (raw measurements, GPU readings): allowed, not used by the model."""
        self.read.update(keys)

    def done(self) -> None:
        unknown = [key for key in self.data if key not in self.read]
        if unknown:
            raise ValueError(f"{self.where}: unknown field {self._name(str(unknown[0]))}; valid: "
                             f"{', '.join(sorted(self.read))}")


_REQUIRED = object()


# ---------------------------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Measured:
    """A Horovod collective as measured by the probe: per-step latency and bus bandwidth (nccl-tests)."""

    latency_us: float
    busbw_gbps: float

    def link(self) -> Link:
        return Link(self.latency_us * 1e-6, 8 / (self.busbw_gbps * 1e9))


@dataclass(frozen=True)
class Tier:
    """One level of links: inside a node (per rank) or between nodes (per node, all NICs together)."""

    latency_us: float
    bandwidth_gbps: float
    measured: Mapping[str, Measured] = field(default_factory=dict)

    def link(self, collective: str | None = None) -> Link:
        """The (alpha, beta) for ``collective``: the probe's measurement of it where present, else the link's."""
        if collective in self.measured:
            return self.measured[collective].link()
        return Link(self.latency_us * 1e-6, 8 / (self.bandwidth_gbps * 1e9))

    def scaled(self, factor: float) -> Tier:
        """The same tier with every bandwidth multiplied by ``factor``."""
        return Tier(self.latency_us, self.bandwidth_gbps * factor,
                    {name: Measured(m.latency_us, m.busbw_gbps * factor) for name, m in self.measured.items()})


@dataclass(frozen=True)
class Cluster:
    name: str
    nominal: bool
    ranks_per_node: int
    intra_node: Tier | None
    inter_node: Tier | None
    fusion_threshold_bytes: int = HOROVOD_FUSION_THRESHOLD_BYTES
    #: Horovod's cost per negotiation round, shared by every collective negotiated in it (the background thread's
    #: wait for its cycle, the ranks' coordination); measured collectives' latencies then exclude it. 0 if not
    #: measured: each collective's fitted latency holds it.
    round_us: float = 0.0

    def layout(self, workers: int) -> tuple[int, int]:
        """(ranks per node, nodes) for ``workers`` ranks, nodes filled first."""
        local = min(workers, self.ranks_per_node)
        return local, -(-workers // local)


def _tier(fields: Fields | None) -> Tier | None:
    if fields is None:
        return None
    measured = {}
    for name in COLLECTIVES:
        sub = fields.mapping(name, required=False)
        if sub is not None:
            measured[name] = Measured(sub.number("latency_us"), sub.number("busbw_gbps", strict=True))
            sub.informational("ranks", "points")
            sub.done()
    tier = Tier(fields.number("latency_us"), fields.number("bandwidth_gbps", strict=True), measured)
    fields.informational("name", "pairs")
    fields.done()
    return tier


def parse_cluster(data: Any, where: str) -> Cluster:
    top = Fields(data, "", where)
    top.string("kind", ("cluster",))
    ranks_per_node = top.integer("ranks_per_node", 1)
    intra = _tier(top.mapping("intra_node", required=False))
    inter = _tier(top.mapping("inter_node", required=False))
    if ranks_per_node > 1 and intra is None:
        raise ValueError(f"{where}: missing field intra_node (ranks_per_node is {ranks_per_node})")
    if intra is None and inter is None:
        raise ValueError(f"{where}: missing field inter_node (a cluster needs intra_node or inter_node)")
    horovod = top.mapping("horovod", required=False)
    fusion, round_us = HOROVOD_FUSION_THRESHOLD_BYTES, 0.0
    if horovod is not None:
        fusion = horovod.integer("fusion_threshold_bytes", 0, default=HOROVOD_FUSION_THRESHOLD_BYTES)
        round_us = horovod.number("round_us", default=0.0)
        horovod.done()
    cluster = Cluster(top.string("name"), top.boolean("nominal"), ranks_per_node, intra, inter, fusion, round_us)
    top.informational("source", "gpus", "nics", "hosts", "network_status", "collectives_device")
    top.done()
    return cluster


# ---------------------------------------------------------------------------------------------- profile


#: a compressor's per-step sums in a profile (hvdcomp.perfmodel.profile.step_totals), optional (older profiles lack
#: them): encode and decode time summed over its gradients, and the two as a fraction of forward + backward
STEP_TOTALS = ("step_encode_ms", "step_decode_ms", "step_fraction_of_compute")


@dataclass(frozen=True)
class Gradient:
    name: str
    numel: int
    bytes: int
    ready_ms: float  # since the start of backward
    #: the non-finite check of this gradient alone: of the input in its backward hook, where a method can hide a NaN
    #: (synchronize()'s check of the reduced compressed gradients: at most Profile.sync_check_ms)
    check_ms: float = 0.0


@dataclass(frozen=True)
class Encoded:
    """One compressor on one gradient: bytes on the wire and the costs on the rank's compute thread."""

    wire_bytes: int
    shared_ms: float  # statistics computed in the backward hook (TernGrad's scaler), before the vote
    encode_ms: float
    decode_ms: float  # aggregate() of one payload
    decode_extra_payload_ms: float  # each further payload aggregated
    finish_ms: float = 0.0  # writing the reduced sum, averaged, into the gradient (synchronize())
    part_bytes: tuple[int, ...] = ()  # the payload's parts (PowerSGD's P and Q travel in separate collectives)

    def aggregate_ms(self, payloads: int) -> float:
        return self.decode_ms + max(payloads - 1, 0) * self.decode_extra_payload_ms


@dataclass(frozen=True)
class CompressorProfile:
    """A method's traits (what hvdcomp.reductions chooses by) and its measured costs per gradient."""

    method: str
    summable: bool
    fixed_size: bool
    shared_before_encode: bool  # encoding waits for the step's vote (TernGrad's scaler sharing)
    gradients: Mapping[str, Encoded]  # compressed gradients only; the others go dense
    reduction: str | None = None  # the method's own reduction (PowerSGD), if it has one
    #: the optimizer checks the input for NaN/Inf too (not Compressor.keeps_nonfinite); None: not summable
    checks_input: bool | None = None
    #: payloads of (values, unique indices), which the sketch collective can sum (Compressor.sparse_payload)
    sparse_payload: bool = False
    #: the ranks' sum compresses again (Compressor.recompressible: two-phase's owners)
    recompressible: bool = True

    def __post_init__(self) -> None:
        if self.checks_input is None:  # profiles measured before the field: the rule of that time
            object.__setattr__(self, "checks_input", not self.summable)


@dataclass(frozen=True)
class Profile:
    model: str
    batch_size: int
    device: str
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    gradients: tuple[Gradient, ...]  # in the order they become ready in backward
    compressors: Mapping[str, CompressorProfile]
    #: the non-finite check of every reduced gradient in one call, as synchronize() checks the compressed ones (on CUDA
    #: a few launches however many gradients; on CPU a pass per tensor); None in profiles measured before the field:
    #: the sum of the gradients' ``check_ms``
    check_all_ms: float | None = None

    @property
    def sync_check_ms(self) -> float:
        """The non-finite check of every reduced gradient in one call (synchronize() checks the compressed ones)."""
        return sum(g.check_ms for g in self.gradients) if self.check_all_ms is None else self.check_all_ms

    @property
    def dense_bytes(self) -> int:
        return sum(g.bytes for g in self.gradients)


def _part_bytes(fields: Fields) -> tuple[int, ...]:
    if "part_bytes" not in fields.data:  # profiles measured before parts were recorded
        fields.informational("part_bytes")
        return ()
    parts = fields.data["part_bytes"]
    fields.informational("part_bytes")
    if not isinstance(parts, list) or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0
                                              for p in parts):
        raise fields._fail("part_bytes", "a list of non-negative integers", parts)
    return tuple(parts)


def parse_profile(data: Any, where: str) -> Profile:
    top = Fields(data, "", where)
    top.string("kind", ("profile",))
    gradients = []
    for item in top.sequence("gradients"):
        gradients.append(Gradient(item.string("name"), item.integer("numel", 1), item.integer("bytes", 1),
                                  item.number("ready_ms"), item.number("check_ms", default=0.0)))
        item.done()
    names = {g.name for g in gradients}
    if len(names) < len(gradients):
        twice = sorted(name for name, count in Counter(g.name for g in gradients).items() if count > 1)
        raise ValueError(f"{where}: gradients name {', '.join(twice)} more than once; each gradient is listed once")
    compressors = {}
    section = top.mapping("compressors")
    for method in section.data:
        entry = section.mapping(str(method))
        encoded = {}
        per_gradient = entry.mapping("gradients")
        for name in per_gradient.data:
            if name not in names:
                raise ValueError(f"{where}: compressors.{method}.gradients.{name} is not one of the profile's "
                                 f"gradients; valid: {', '.join(sorted(names))}")
            g = per_gradient.mapping(str(name))
            encoded[name] = Encoded(g.integer("wire_bytes"), g.number("shared_ms", default=0.0),
                                    g.number("encode_ms"), g.number("decode_ms"), g.number("decode_extra_payload_ms"),
                                    g.number("finish_ms", default=0.0), _part_bytes(g))
            g.done()
        per_gradient.done()
        reduction = entry.string("reduction", default="") or None
        checks_input = entry.boolean("checks_input") if "checks_input" in entry.data else None
        compressors[str(method)] = CompressorProfile(str(method), entry.boolean("summable"),
                                                     entry.boolean("fixed_size"),
                                                     entry.boolean("shared_before_encode"), encoded, reduction,
                                                     checks_input, entry.boolean("sparse_payload", default=False),
                                                     entry.boolean("recompressible", default=True))
        for key in STEP_TOTALS:  # for people, derived from the per-gradient costs: checked, not used by the model
            entry.number(key, default=0.0)
        entry.informational("options", "collective")
        entry.done()
    section.done()
    profile = Profile(top.string("model"), top.integer("batch_size", 1), top.string("device"),
                      top.number("forward_ms"), top.number("backward_ms"), top.number("optimizer_ms"),
                      tuple(sorted(gradients, key=lambda g: g.ready_ms)), compressors,
                      top.number("check_all_ms") if "check_all_ms" in top.data else None)
    top.informational("source", "measured", "autocast")
    top.done()
    if profile.forward_ms + profile.backward_ms + profile.optimizer_ms <= 0:
        raise ValueError(f"{where}: forward_ms, backward_ms and optimizer_ms are all 0: a step takes some time (the "
                         f"model predicts throughput from it)")
    return profile


def load(path: str | Path, kind: str) -> Cluster | Profile:
    """Loads a ``cluster`` or ``profile`` YAML file; errors name the file and the field."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise FileNotFoundError(f"{where}: cannot read the {kind} file: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{where}: not valid YAML: {error}") from None
    if kind == "cluster":
        return parse_cluster(data, where)
    if kind == "profile":
        return parse_profile(data, where)
    raise ValueError(f"unknown kind {kind!r}; valid: cluster, profile")


def dump(data: Mapping[str, Any], path: str | Path, header: str = "") -> None:
    """Writes a document with an optional comment header, keys in the order given."""
    text = yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=None, width=120)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    Path(path).write_text(comment + text)
