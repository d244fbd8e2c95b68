"""The performance model: cost formulas against hand-computed values, the step timeline on constructed
profiles, YAML validation, the probe's NVML path against a fake pynvml (no GPU here), and real
``hvdcomp probe`` (2 MPI ranks), ``hvdcomp profile`` and ``hvdcomp predict`` runs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import BIN, REPO, run_ranks
from scripted import cluster_of, profile_of

from hvdcomp import LGC, METHODS, cli
from hvdcomp.perfmodel import costs, predict, probe, schema, timeline
from hvdcomp.perfmodel.costs import Link

# ------------------------------------------------------------------------------------------------ costs


def test_cost_formulas_match_hand_computed_values() -> None:
    link = Link(alpha=1e-5, beta=1e-9)  # 10 us per step, 1 GB/s
    # 2*3*10us + 2*3/4 * 1 MB * 1 ns = 60 us + 1.5 ms
    assert costs.ring_allreduce(1e6, 4, link) == pytest.approx(1.56e-3)
    assert costs.ring_allgather(1e6, 4, link) == pytest.approx(3e-5 + 3e-3)
    assert costs.alltoall(1e6, 4, link) == pytest.approx(3e-5 + 0.75e-3)
    # alltoall of 1 MB (0.78 ms) + allgather of 250 kB per rank (0.78 ms)
    assert costs.two_phase(1e6, 4, link, link) == pytest.approx(1.56e-3)
    assert costs.parameter_server(1e6, 4, link) == pytest.approx(2e-5 + 8e-3)
    intra, inter = Link(1e-6, 1e-10), Link(1e-5, 1e-9)
    # inside: 2*(7 us + 7/8 * 8 MB * 0.1 ns) = 1.414 ms; across: 6*10 us + 1.5 * 8 MB * 1 ns = 12.06 ms
    assert costs.hierarchical_allreduce(8e6, 8, 4, intra, inter) == pytest.approx(1.414e-3 + 12.06e-3)
    for formula in (costs.ring_allreduce, costs.ring_allgather, costs.alltoall, costs.parameter_server):
        assert formula(1e6, 1, link) == 0.0
    assert costs.bus_factor("allreduce", 4) == 1.5 and costs.bus_factor("allgather", 4) == 0.75
    with pytest.raises(ValueError, match="unknown collective 'reduce'"):
        costs.steps("reduce", 4)


def test_fit_line_recovers_alpha_and_beta() -> None:
    sizes = [8.0, 512.0, 65536.0, 4e6]
    alpha, beta = costs.fit_line(sizes, [20e-6 + n * 1e-9 for n in sizes])
    assert alpha == pytest.approx(20e-6) and beta == pytest.approx(1e-9)
    # a token bucket: the first 500 kB leave at 10x the rate; the sustained rate is what large messages see
    sizes = [8.0, 4096.0, 262144.0, 1e6, 4e6, 16e6]
    times = [20e-6 + min(n, 5e5) * 1e-10 + max(n - 5e5, 0) * 1e-9 for n in sizes]
    alpha, beta = costs.fit_line(sizes, times)
    assert beta == pytest.approx(1e-9) and alpha == pytest.approx(20e-6, abs=1e-8)


# --------------------------------------------------------------------------------------------- timeline


def test_timeline_full_overlap() -> None:
    # 1 MB at 0.16 Gbit/s takes 50 ms; ready at 10 ms of a 100 ms backward, so it ends at 70 ms: hidden.
    step = timeline.simulate(profile_of(ready_ms=10), cluster_of(0.16), "none", 2)
    assert step.communication_s == pytest.approx(0.05, rel=1e-4)
    assert step.step_s == pytest.approx(0.115, rel=1e-4)
    assert step.exposed_s == pytest.approx(0.0, abs=1e-6)


def test_timeline_no_overlap() -> None:
    # ready at the very end of backward: all 50 ms are exposed
    step = timeline.simulate(profile_of(ready_ms=100), cluster_of(0.16), "none", 2)
    assert step.step_s == pytest.approx(0.010 + 0.100 + 0.050 + 0.005, rel=1e-4)
    assert step.exposed_s == pytest.approx(0.05, rel=1e-3)


def test_timeline_fuses_gradients_ready_together() -> None:
    # both ready at 100 ms, 1 ms per step of latency: one fused allreduce, one latency term (2(p-1) = 2 steps)
    step = timeline.simulate(profile_of(ready_ms=100), cluster_of(0.16, latency_us=1000), "none", 2)
    assert step.collectives == 1
    assert step.step_s == pytest.approx(0.115 + 0.002 + 1_000_004 * 8 / 0.16e9, rel=1e-4)


def test_timeline_collectives_negotiated_together_share_a_round() -> None:
    # Horovod negotiates in rounds (1 ms here, no latency per collective): the gathered gradient, the dense one and
    # the vote, all submitted at backward's end, share one round; ready 90 ms apart, the first round is long over
    # when the dense gradient comes, which starts a second
    encoded = schema.Encoded(62_500, shared_ms=0, encode_ms=0, decode_ms=0, decode_extra_payload_ms=0)
    gathered = {"g": schema.CompressorProfile("g", summable=False, fixed_size=True, shared_before_encode=False,
                                              gradients={"a": encoded})}
    rounds = dataclasses.replace(cluster_of(0.16), round_us=1000)
    for ready_ms, count in ((100, 1), (10, 2)):
        profile = profile_of(ready_ms, gathered)
        step, alone = (timeline.simulate(profile, cluster, "g", 2) for cluster in (rounds, cluster_of(0.16)))
        assert step.collectives == 3
        assert step.communication_s - alone.communication_s == pytest.approx(0.001 * count, rel=1e-6)
    assert step.step_s - alone.step_s == pytest.approx(0.001, rel=1e-6)  # the first round hides under backward
    # without a measured round, each collective's latency holds it: three of them
    latency = timeline.simulate(profile_of(100, gathered), cluster_of(0.16, latency_us=250), "g", 2)
    assert latency.step_s - timeline.simulate(profile_of(100, gathered), cluster_of(0.16), "g", 2).step_s == \
        pytest.approx(3 * 2 * 250e-6 - 250e-6, rel=1e-6)  # allgather: p-1 steps, the allreduces 2(p-1)


def test_timeline_gated_compressor_encodes_after_backward() -> None:
    # TernGrad-like: statistics in the hook (1 ms), vote, then encode (4 ms), 62.5 kB on the wire, decode of
    # 2 payloads (2 + 1 ms); gradient "b" goes dense. 62.5 kB allgather at 0.16 Gbit/s (p=2) = 3.125 ms.
    encoded = schema.Encoded(62_500, shared_ms=1, encode_ms=4, decode_ms=2, decode_extra_payload_ms=1)
    compressor = schema.CompressorProfile("tern", summable=False, fixed_size=True, shared_before_encode=True,
                                          gradients={"a": encoded})
    step = timeline.simulate(profile_of(ready_ms=10, compressors={"tern": compressor}), cluster_of(0.16), "tern", 2)
    # "a" is ready at 10 ms: hook (1 ms), the vote starts (nothing waits for it in backward); "b"'s hook, at the end
    # of backward (100 ms + 1), finds it done and encodes "a" (4 ms), whose allgather (3.125 ms) then runs past
    # backward's end, "b"'s tiny allreduce after it; decode 3 ms; optimizer 5 ms
    expected = 0.010 + 0.100 + 0.001 + 0.004 + 62_500 * 8 / 0.16e9 + 0.003 + 0.005
    assert step.collective == "allgather"
    assert step.step_s == pytest.approx(expected, rel=1e-4)
    assert step.bytes_per_rank == pytest.approx(62_500 + 4 + 16)
    # at 5 workers hvdcomp's auto switches to two-phase: about 2x the payload leaves each rank
    two_phase = timeline.simulate(profile_of(10, {"tern": compressor}), cluster_of(0.16), "tern", 5)
    assert two_phase.collective == "two_phase"
    assert two_phase.bytes_per_rank == pytest.approx(62_500 * 1.2 + 4 + 16)


def test_two_phase_prices_each_chunk_as_a_call_of_its_own() -> None:
    """Two-phase calls the compressor once per rank's chunk: each call is priced at the chunk's size from the
    gradients the profile measured. Launch-bound calls (the same cost whatever the size) then cost once per chunk;
    calls whose cost follows the size add up to the whole gradient's, below the smallest measured size too; no call
    costs more than the whole gradient's own."""
    sizes = {"a": 400_000, "c": 100_000, "d": 50_000}
    gradients = tuple(schema.Gradient(name, numel, 4 * numel, ready) for (name, numel), ready
                      in zip(sizes.items(), (10.0, 50.0, 90.0), strict=True))

    def profile(cost: Callable[[int], float]) -> schema.Profile:
        encoded = {name: schema.Encoded(numel // 8, shared_ms=cost(numel) / 2, encode_ms=cost(numel),
                                        decode_ms=cost(numel) / 2, decode_extra_payload_ms=cost(numel) / 4)
                   for name, numel in sizes.items()}
        compressor = schema.CompressorProfile("q", summable=False, fixed_size=True, shared_before_encode=False,
                                              gradients=encoded)
        return schema.Profile("toy", 8, "cpu", forward_ms=10, backward_ms=100, optimizer_ms=5, gradients=gradients,
                              compressors={"q": compressor})

    flat = profile(lambda numel: 1.0)
    chunks = timeline.in_parts(flat, flat.compressors["q"], "a", 8)  # 8 chunks of 50,000: "d"'s size
    assert (chunks.encode_ms, chunks.decode_ms, chunks.decode_extra_payload_ms, chunks.shared_ms) == (8, 4, 2, 4)
    assert chunks.wire_bytes == 50_000, "the bytes are the whole gradient's"
    assert timeline.in_parts(flat, flat.compressors["q"], "a", 1) is flat.compressors["q"].gradients["a"]
    linear = profile(lambda numel: numel * 1e-5)  # "a" 4 ms, "c" 1 ms, "d" 0.5 ms
    for parts in (2, 3, 4, 8):  # 200,000 and 133,333 between "c" and "a", 100,000 and 50,000 measured
        assert timeline.in_parts(linear, linear.compressors["q"], "a", parts).encode_ms == pytest.approx(4.0)
    assert timeline.in_parts(linear, linear.compressors["q"], "a", 16).encode_ms == pytest.approx(4.0)  # below "d"
    assert timeline.in_parts(flat, flat.compressors["q"], "a", 64).encode_ms == pytest.approx(64.0)
    noisy = profile(lambda numel: {400_000: 1.0, 100_000: 2.0, 50_000: 3.0}[numel])  # smaller measured slower
    assert timeline.in_parts(noisy, noisy.compressors["q"], "a", 8).encode_ms == pytest.approx(8 * 1.0)
    assert timeline.in_parts(noisy, noisy.compressors["q"], "c", 4).encode_ms == pytest.approx(4 * 2.0)
    # the timeline runs two-phase at 5 workers: on each gradient 5 launch-bound encodes in the hooks, and the owner's
    # sum of 5 payloads (0.5 + 4 x 0.25 ms) and re-encode (1 ms) of one chunk before the allgather
    step = timeline.simulate(flat, cluster_of(100), "q", 5)
    assert step.collective == "two_phase"
    assert step.encode_s == pytest.approx(3 * 5 * 1e-3)
    assert step.decode_s == pytest.approx(3 * (0.5 + 4 * 0.25 + 1 + 5 * 0.5) * 1e-3)
    # a per-tensor plan's isolated cost: statistics, encodes and decodes of 5 chunks, the owner's sum and re-encode
    network = timeline.Network(cluster_of(100), 5)
    wire = network.time("alltoall", 50_000) + network.time("allgather", 10_000)
    assert predict.tensor_costs(cluster_of(100), flat, 5)["a"]["q/two_phase"] == pytest.approx(
        wire + (5 * 0.5 + 5 * 1 + (0.5 + 4 * 0.25 + 1) + 5 * 0.5) * 1e-3)


def test_timeline_charges_the_checks_and_the_averaging() -> None:
    # synchronize() checks the reduced compressed gradients for NaN/Inf (2 ms each here; dense ones pass unchecked,
    # as Horovod passes them), a gathered method also checks its input in the hook, and each compressed result is
    # written, averaged, into the gradient (3 ms)
    base = profile_of(ready_ms=100)
    checked = dataclasses.replace(base, gradients=tuple(dataclasses.replace(g, check_ms=2.0) for g in base.gradients))
    cluster = cluster_of(0.16)
    dense = timeline.simulate(checked, cluster, "none", 2).step_s - timeline.simulate(base, cluster, "none", 2).step_s
    assert dense == 0
    encoded = schema.Encoded(62_500, shared_ms=0, encode_ms=4, decode_ms=2, decode_extra_payload_ms=1)
    gathered = {"g": schema.CompressorProfile("g", summable=False, fixed_size=True, shared_before_encode=False,
                                              gradients={"a": encoded})}
    finished = {"g": dataclasses.replace(gathered["g"], gradients={"a": dataclasses.replace(encoded, finish_ms=3)})}
    before = timeline.simulate(dataclasses.replace(base, compressors=gathered), cluster, "g", 2).step_s
    after = timeline.simulate(dataclasses.replace(checked, compressors=finished), cluster, "g", 2).step_s
    assert after - before == pytest.approx(0.002 + 0.003 + 0.002, rel=1e-6)  # input check, averaging, "a"'s output
    # a profile that measured the one call over every gradient (on CUDA a few launches however many): the compressed
    # gradients' check costs at most that
    batched = dataclasses.replace(checked, check_all_ms=0.5, compressors=finished)
    once = timeline.simulate(batched, cluster, "g", 2).step_s - after
    assert once == pytest.approx(0.0005 - 0.002, rel=1e-6)
    assert schema.parse_profile({**PROFILE, "check_all_ms": 0.5}, "x").check_all_ms == 0.5
    assert schema.parse_profile(PROFILE, "x").check_all_ms is None, "older profiles: the sum"


def test_timeline_rejects_unknown_method_and_collective() -> None:
    with pytest.raises(ValueError, match="has no compressor 'qsgd'; valid: none"):
        timeline.simulate(profile_of(10), cluster_of(1), "qsgd", 2)
    with pytest.raises(ValueError, match="none cannot use collective 'allgather'; valid: allreduce, hierarchical"):
        timeline.simulate(profile_of(10), cluster_of(1), "none", 2, "allgather")


def test_multi_node_needs_inter_node_link() -> None:
    cluster = schema.Cluster("one node", True, 2, schema.Tier(1, 10), None)
    with pytest.raises(ValueError, match="has no inter_node link, so it cannot place 4 workers"):
        timeline.simulate(profile_of(10), cluster, "none", 4)


# ----------------------------------------------------------------------------------------------- schema

CLUSTER = {"kind": "cluster", "name": "c", "nominal": False, "ranks_per_node": 1,
           "inter_node": {"latency_us": 5, "bandwidth_gbps": 1, "allreduce": {"latency_us": 9, "busbw_gbps": 0.9}}}


def _load(tmp_path: Path, data: object, kind: str) -> object:
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(data))
    return schema.load(path, kind)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["inter_node"].pop("bandwidth_gbps"), "missing field inter_node.bandwidth_gbps"),
    (lambda d: d["inter_node"].update(latency_us="fast"), "inter_node.latency_us must be a non-negative finite "
                                                          "number; got 'fast'"),
    (lambda d: d["inter_node"]["allreduce"].update(busbw_gbps=0), "inter_node.allreduce.busbw_gbps must be a "
                                                                  "positive finite number; got 0"),
    (lambda d: d["inter_node"].update(bandwith_gbps=3), "unknown field inter_node.bandwith_gbps; valid:"),
    (lambda d: d.update(ranks_per_node=2), "missing field intra_node (ranks_per_node is 2)"),
    (lambda d: d.update(nominal="yes"), "nominal must be true or false; got 'yes'"),
    (lambda d: d.update(kind="profile"), "kind must be one of cluster; got 'profile'"),
])
def test_cluster_errors_name_the_field(tmp_path: Path, edit, message: str) -> None:
    data = json.loads(json.dumps(CLUSTER))
    edit(data)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _load(tmp_path, data, "cluster")


def test_cluster_uses_measured_collectives(tmp_path: Path) -> None:
    cluster = _load(tmp_path, CLUSTER, "cluster")
    allreduce, allgather = cluster.inter_node.link("allreduce"), cluster.inter_node.link("allgather")
    assert (allreduce.alpha, allreduce.beta) == pytest.approx((9e-6, 8 / 0.9e9))
    assert (allgather.alpha, allgather.beta) == pytest.approx((5e-6, 8 / 1e9))  # not measured: the link's own


PROFILE = {"kind": "profile", "model": "m", "batch_size": 4, "device": "cpu", "forward_ms": 1, "backward_ms": 2,
           "optimizer_ms": 0.5, "gradients": [{"name": "w", "numel": 10_000, "bytes": 40_000, "ready_ms": 1}],
           "compressors": {"topk": {"summable": False, "fixed_size": False, "shared_before_encode": False,
                                    "gradients": {"w": {"wire_bytes": 816, "encode_ms": 0.1, "decode_ms": 0.1,
                                                        "decode_extra_payload_ms": 0.01}}}}}


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["gradients"][0].pop("ready_ms"), r"missing field gradients\[0\].ready_ms"),
    (lambda d: d.update(gradients=[]), "gradients must be a non-empty list; got \\[\\]"),
    (lambda d: d["compressors"]["topk"]["gradients"]["w"].update(wire_bytes=-1),
     "compressors.topk.gradients.w.wire_bytes must be a non-negative integer; got -1"),
    (lambda d: d["compressors"]["topk"]["gradients"].update(v=d["compressors"]["topk"]["gradients"]["w"]),
     "compressors.topk.gradients.v is not one of the profile's gradients; valid: w"),
    (lambda d: d["compressors"]["topk"].pop("summable"), "missing field compressors.topk.summable"),
    (lambda d: d.update(batch_size=1.5), "batch_size must be a positive integer; got 1.5"),
    (lambda d: d["compressors"]["topk"].update(step_encode_ms="slow"),
     "compressors.topk.step_encode_ms must be a non-negative finite number; got 'slow'"),
    (lambda d: d["compressors"]["topk"].update(step_encode=0.1), "unknown field compressors.topk.step_encode; valid:"),
    (lambda d: d["gradients"].append(dict(d["gradients"][0])), "gradients name w more than once"),
    (lambda d: d.update(forward_ms=0, backward_ms=0, optimizer_ms=0), "optimizer_ms are all 0: a step takes"),
])
def test_profile_errors_name_the_field(tmp_path: Path, edit, message: str) -> None:
    data = json.loads(json.dumps(PROFILE))
    edit(data)
    with pytest.raises(ValueError, match=message):
        _load(tmp_path, data, "profile")


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="cannot read the profile file"):
        schema.load(tmp_path / "missing.yaml", "profile")
    (tmp_path / "bad.yaml").write_text("kind: [cluster\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        schema.load(tmp_path / "bad.yaml", "cluster")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="the document must be a mapping"):
        schema.load(tmp_path / "list.yaml", "cluster")


def test_presets_load_and_are_nominal(tmp_path: Path) -> None:
    presets = sorted(predict.PRESETS.glob("*.yaml"))
    assert len(presets) >= 3
    for path in presets:
        cluster = predict.load_cluster(path.stem)
        assert cluster.nominal and cluster.inter_node is not None, path
        assert "NOMINAL" in path.read_text().splitlines()[0] and "Sources" in path.read_text(), path
    with pytest.raises(FileNotFoundError, match="not a preset; presets: a100-nvlink-100gbe"):
        predict.load_cluster("dgx-9000")


def test_predict_api_break_even_and_recommendation(tmp_path: Path) -> None:
    profile = _load(tmp_path, PROFILE, "profile")
    slow = predict.predict(cluster_of(0.001, latency_us=1), profile, [1, 2, 8])
    assert slow.auto(8, "topk").step.collective == "allgather"
    assert slow.best(8).step.method == "topk"
    assert slow.recommendation.startswith("at 8 workers: topk over allgather")
    (even,) = slow.break_even
    assert even.method == "topk" and even.bandwidth_gbps is not None
    # at the break-even bandwidth both take the same time
    at = predict._scaled(cluster_of(0.001, 1), "inter_node", even.bandwidth_gbps / 0.001)
    assert timeline.simulate(profile, at, "topk", 8).step_s == pytest.approx(
        timeline.simulate(profile, at, "none", 8).step_s, rel=1e-6)
    fast = predict.predict(cluster_of(1000, latency_us=1), profile, [2])
    assert fast.recommendation.startswith("at 2 workers: no compression")
    costs_per_tensor = predict.tensor_costs(cluster_of(0.001, 1), profile, 8)
    assert set(costs_per_tensor["w"]) == {"none/allreduce", "topk/allgather", "topk/parameter_server"}


# ------------------------------------------------------------------------------------- probe: fake NVML


class FakeNVML(types.ModuleType):
    """The pynvml calls the probe makes, for two GPUs, with the errors NVML raises."""

    def __init__(self, unsupported: set[str] = frozenset(), init_error: str | None = None) -> None:
        super().__init__("pynvml")

        class NVMLError(Exception):
            def __str__(self) -> str:
                return self.args[0] if self.args else "Unknown Error"

        self.NVMLError = NVMLError
        self.NVMLError_NotSupported = type("NVMLError_NotSupported", (NVMLError,),
                                           {"__str__": lambda s: "Not Supported"})
        self.NVMLError_InvalidArgument = type("NVMLError_InvalidArgument", (NVMLError,),
                                              {"__str__": lambda s: "Invalid Argument"})
        self.NVMLError_DriverNotLoaded = type("NVMLError_DriverNotLoaded", (NVMLError,),
                                              {"__str__": lambda s: "Driver Not Loaded"})
        self.NVML_CLOCK_SM, self.NVML_CLOCK_MEM = 1, 2
        self.NVML_PCIE_UTIL_TX_BYTES, self.NVML_PCIE_UTIL_RX_BYTES = 0, 1
        self.NVML_P2P_CAPS_INDEX_READ = 0
        self.NVML_NVLINK_MAX_LINKS = 18
        self.NVML_FI_DEV_NVLINK_SPEED_MBPS_L0, self.NVML_FI_DEV_NVLINK_SPEED_MBPS_L1 = 164, 165
        self.unsupported, self.init_error, self.shutdown = unsupported, init_error, False
        values = {
            "nvmlDeviceGetName": lambda h: b"NVIDIA H100 80GB HBM3",
            "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(busId=f"00000000:{h + 0x18:02X}:00.0"),
            "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
            "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(total=85_520_809_984),
            "nvmlDeviceGetMemoryBusWidth": lambda h: 5120,
            "nvmlDeviceGetClockInfo": lambda h, c: 1980 if c == 1 else 2619,
            "nvmlDeviceGetMaxClockInfo": lambda h, c: 1980 if c == 1 else 2619,
            "nvmlDeviceGetPowerUsage": lambda h: 71_000,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
            "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=3, memory=0),
            "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16,
            "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
            "nvmlDeviceGetPcieSpeed": lambda h: 32000,
            "nvmlDeviceGetPcieThroughput": lambda h, counter: 1234 + counter,
            "nvmlDeviceGetNvLinkState": self._link_state,
            "nvmlDeviceGetNvLinkVersion": lambda h, link: 4,
            "nvmlDeviceGetNvLinkRemotePciInfo": lambda h, link: types.SimpleNamespace(busId=b"00000000:05:00.0"),
            "nvmlDeviceGetFieldValues": lambda h, fields: [types.SimpleNamespace(
                nvmlReturn=0, value=types.SimpleNamespace(uiVal=25781))],
            "nvmlDeviceGetTopologyCommonAncestor": lambda a, b: 0,
            "nvmlDeviceGetP2PStatus": lambda a, b, index: 0,
        }
        for name, function in values.items():
            setattr(self, name, self._guard(name, function))

    def _guard(self, name, function):
        def call(*args):
            if name in self.unsupported:
                raise self.NVMLError_NotSupported()
            return function(*args)
        return call

    def _link_state(self, handle, link):
        if link >= 2:
            raise self.NVMLError_InvalidArgument()
        return 1

    def nvmlInit(self):
        if self.init_error:
            raise self.NVMLError_DriverNotLoaded()

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlSystemGetDriverVersion(self):
        return "575.57.08"


def test_probe_reads_every_gpu_field(monkeypatch) -> None:
    fake = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    records, status = probe.gpus()
    assert status == "2 GPU(s) seen by NVML, driver 575.57.08" and fake.shutdown
    first = records[0]
    assert first["name"] == "NVIDIA H100 80GB HBM3" and first["compute_capability"] == "9.0"
    assert first["memory_total_bytes"] == 85_520_809_984 and first["memory_bus_width_bits"] == 5120
    assert first["sm_clock_max_mhz"] == 1980 and first["memory_clock_mhz"] == 2619
    assert first["power_draw_w"] == 71 and first["power_limit_w"] == 700
    assert first["utilization_percent"] == {"gpu": 3, "memory": 0}
    assert (first["pcie_generation"], first["pcie_width_max"], first["pcie_tx_kb_s"]) == (5, 16, 1234)
    assert first["nvlink"] == [
        {"link": i, "active": True, "version": 4, "remote_pci_bus_id": "00000000:05:00.0", "speed_mbps": 25781}
        for i in range(2)]
    assert first["topology"] == [{"gpus": [0, 1], "common_ancestor": "internal", "p2p_read": "ok"}]
    assert "unavailable" not in first
    assert yaml.safe_load(yaml.safe_dump(records)) == records  # plain data, as written to the YAML


def test_probe_unsupported_calls_leave_the_field_empty_with_the_reason(monkeypatch) -> None:
    fake = FakeNVML(unsupported={"nvmlDeviceGetMemoryBusWidth", "nvmlDeviceGetPowerUsage",
                                 "nvmlDeviceGetNvLinkState", "nvmlDeviceGetP2PStatus"})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    records, _ = probe.gpus()
    first = records[0]
    assert "memory_bus_width_bits" not in first and "power_draw_w" not in first and "nvlink" not in first
    assert first["unavailable"] == {"memory_bus_width_bits": "NVMLError_NotSupported: Not Supported",
                                    "power_draw_w": "NVMLError_NotSupported: Not Supported",
                                    "nvlink": "NVMLError_NotSupported: Not Supported"}
    assert first["power_limit_w"] == 700 and first["name"] == "NVIDIA H100 80GB HBM3"  # the rest is read
    assert first["topology"][0]["unavailable"] == {"p2p_read": "NVMLError_NotSupported: Not Supported"}


def test_probe_without_driver_or_library(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(init_error="driver"))
    assert probe.gpus() == ([], "no GPU section: NVML could not start (NVMLError_DriverNotLoaded: Driver Not "
                                "Loaded); no NVIDIA driver here?")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    records, status = probe.gpus()
    assert records == [] and status.startswith("no GPU section: nvidia-ml-py is not installed")


def test_nics_from_sysfs(tmp_path: Path) -> None:
    for name, files in {"net/eth0": {"type": "1", "speed": "10000", "operstate": "up"},
                        "net/lo": {"type": "772", "operstate": "unknown"},
                        "infiniband/mlx5_0/ports/1": {"rate": "400 Gb/sec (4X NDR)"}}.items():
        (tmp_path / name).mkdir(parents=True)
        for file, text in files.items():
            (tmp_path / name / file).write_text(text + "\n")
    eth, lo, ib = probe.nics(tmp_path)
    assert eth == {"name": "eth0", "kind": "ethernet", "state": "up", "speed_gbps": 10.0}
    assert lo["kind"] == "loopback" and "speed_gbps" in lo["unavailable"]
    assert ib == {"name": "mlx5_0/1", "kind": "infiniband", "rate": "400 Gb/sec (4X NDR)", "speed_gbps": 400.0}


# ------------------------------------------------------------------------------------ real runs, real ranks


def _hvdcomp(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "hvdcomp"), *args], capture_output=True, text=True, timeout=timeout)


def _hvdcomp_here(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """``hvdcomp ARGS`` run in this process (:func:`hvdcomp.cli.main`): its exit status and what it wrote to stderr."""
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.multirank
def test_probe_profile_predict_for_real(tmp_path: Path) -> None:
    cluster_path, profile_path = tmp_path / "cluster.yaml", tmp_path / "profile.yaml"
    ranks = run_ranks([str(BIN / "hvdcomp"), "probe", "--out", str(cluster_path)], np=2, timeout=300)
    assert ranks.returncode == 0, ranks.output[-3000:]
    document = yaml.safe_load(cluster_path.read_text())
    assert document["gpus"][0]["devices"] == [] and document["gpus"][0]["status"].startswith("no GPU section")
    cluster = schema.load(cluster_path, "cluster")
    assert not cluster.nominal and cluster.ranks_per_node == 2 and cluster.inter_node is None
    assert cluster.round_us == document["horovod"]["round_us"] >= 0  # Horovod's negotiation round (0: lost in noise)
    assert cluster.intra_node.bandwidth_gbps > 0.1 and set(cluster.intra_node.measured) == {
        "allreduce", "allgather", "alltoall"}
    done = _hvdcomp("profile", "--model", "digits", "--repeats", "3", "--out", str(profile_path))
    assert done.returncode == 0, done.stderr
    profile = schema.load(profile_path, "profile")
    assert [g.name for g in profile.gradients][-1] in ("0.weight", "0.bias")  # the first layer is ready last
    assert profile.dense_bytes == 4 * (64 * 512 + 512 + 512 * 96 + 96 + 96 * 10 + 10)
    # every registered method, with no list to edit: PowerSGD, random-k and the quantizers joined by being defined
    assert set(profile.compressors) == set(METHODS) - {"none"}
    orq = profile.compressors["orq"].gradients["0.weight"]  # 64 x 512: 64 buckets of 512, 2 bits + 4 levels each
    assert orq.wire_bytes == 64 * (512 * 2 // 8 + 4 * 4)
    assert profile.compressors["terngrad"].shared_before_encode
    assert set(profile.compressors["topk"].gradients) == {"0.weight", "2.weight"}  # min_numel 1024
    powersgd = profile.compressors["powersgd"]
    assert powersgd.reduction == "powersgd" and set(powersgd.gradients) == {"0.weight", "2.weight"}
    assert powersgd.gradients["0.weight"].part_bytes == (512 * 2 * 4, 64 * 2 * 4)  # P and Q of the 512 x 64
    plot, report = tmp_path / "scaling.png", tmp_path / "prediction.json"
    done = _hvdcomp("predict", "--cluster", str(cluster_path), "--profile", str(profile_path), "--workers", "1,2",
                    "--plot", str(plot), "--json", str(report))
    assert done.returncode == 0, done.stderr
    assert "recommendation at 2 workers" in done.stdout and plot.stat().st_size > 10_000
    prediction = json.loads(report.read_text())
    assert prediction["workers"] == [1, 2]
    assert {(o["step"]["method"], o["step"]["collective"]) for o in prediction["options"]} >= {
        ("powersgd", "powersgd"), ("randomk", "allreduce"), ("terngrad", "two_phase"), ("topk", "parameter_server"),
        ("orq", "two_phase"), ("signsgd", "allgather")}
    done = _hvdcomp("predict", "--cluster", str(cluster_path), "--profile", str(profile_path), "--workers", "4")
    assert done.returncode == 2 and "has no inter_node link, so it cannot place 4 workers" in done.stderr


def test_predict_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    for workers, message in (("1,two", "expected comma-separated integers"),
                             ("0,4", "workers must be positive integers")):
        code, stderr = _hvdcomp_here(capsys, "predict", "--cluster", "gtx1080-pcie-1gbe", "--profile", str(profile),
                                     "--workers", workers)
        assert code == 2 and message in stderr, (workers, stderr)
    done = _hvdcomp("predict", "--cluster", "gtx1080-pcie-1gbe", "--profile", str(profile), "--workers", "1,4,16")
    assert done.returncode == 0 and "(nominal)" in done.stdout
    profile.write_text(yaml.safe_dump({**PROFILE, "compressors": {"topk": {**PROFILE["compressors"]["topk"],
                                                                           "reduction": "bogus"}}}))
    for mode in (["--workers", "2"], ["--per-tensor", "4"]):
        code, stderr = _hvdcomp_here(capsys, "predict", "--cluster", "gtx1080-pcie-1gbe", "--profile", str(profile),
                                     *mode)
        assert code == 2 and "compressors.topk.reduction 'bogus' is not a reduction" in stderr, (mode, stderr)


def test_profile_any_model_from_python(capsys: pytest.CaptureFixture[str]) -> None:
    """``hvdcomp.perfmodel.profile.profile(model, batch, loss_fn)``: a user's model with its own loss (a regression
    here) and inputs of two tensors; gradients listed in the order backward makes them ready, the compressors
    measured on them; a parameter that gets no gradient, in any step or in some, is left out, and named, and the
    document loads."""
    import torch
    from torch import nn

    from hvdcomp.perfmodel.profile import profile

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left, self.right, self.out = nn.Linear(16, 64), nn.Linear(16, 64), nn.Linear(64, 1)
            self.spare = nn.Linear(4, 4)  # unused in forward
            self.sometimes = nn.Linear(64, 64)  # unused in the first timed step (the third), used in the last
            self.calls = 0

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            h = torch.relu(self.left(a) + self.right(b))
            return self.out(h if self.calls == 3 else self.sometimes(h)).squeeze(1)

    torch.manual_seed(0)
    batch = ((torch.randn(8, 16), torch.randn(8, 16)), torch.randn(8))
    document = profile(TwoInputs(), batch, nn.functional.mse_loss, methods=["topk", "fp16"], repeats=2, name="two")
    assert document["model"] == "two" and document["batch_size"] == 8 and document["device"].startswith("cpu")
    names = [g["name"] for g in document["gradients"]]
    assert names[0] in ("out.weight", "out.bias") and set(names) == {
        f"{layer}.{kind}" for layer in ("left", "right", "out") for kind in ("weight", "bias")}
    assert "left out (as if frozen): sometimes.bias, sometimes.weight, spare.bias, spare.weight" in \
        capsys.readouterr().err
    assert set(document["compressors"]) == {"topk", "fp16"}
    assert set(document["compressors"]["topk"]["gradients"]) == {"left.weight", "right.weight"}  # min_numel 1024
    schema.parse_profile(document, "two")
    assert document["forward_ms"] > 0 and document["backward_ms"] > 0 and document["check_all_ms"] > 0
    assert document["measured"]["clock"] == "host" and "autocast" not in document


def test_profile_sums_each_compressors_costs_per_step(tmp_path: Path) -> None:
    """Per compressor, the encode and decode times summed over its gradients (one payload each), beside forward +
    backward as a fraction; written before the per-gradient figures, loaded by the schema, printed by the command."""
    import torch
    from torch import nn

    from hvdcomp.perfmodel.profile import profile, summary

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    batch = (torch.randn(8, 32), torch.randint(0, 4, (8,)))
    document = profile(model, batch, methods=["terngrad", "fp16"], repeats=2)
    compute_ms = document["forward_ms"] + document["backward_ms"]
    for method, entry in document["compressors"].items():
        gradients = entry["gradients"]
        assert len(gradients) == 2, method  # the weights of 2,048 and 4,096 elements (min_numel 1024)
        assert list(entry)[-4:] == ["step_encode_ms", "step_decode_ms", "step_fraction_of_compute", "gradients"]
        assert entry["step_encode_ms"] == pytest.approx(sum(g["encode_ms"] for g in gradients.values()), abs=1e-4)
        assert entry["step_decode_ms"] == pytest.approx(sum(g["decode_ms"] for g in gradients.values()), abs=1e-4)
        assert entry["step_encode_ms"] > 0 and entry["step_decode_ms"] > 0
        assert entry["step_fraction_of_compute"] == pytest.approx(
            (entry["step_encode_ms"] + entry["step_decode_ms"]) / compute_ms, abs=1e-5)
    path = tmp_path / "profile.yaml"
    schema.dump(document, path)
    assert set(schema.load(path, "profile").compressors) == {"terngrad", "fp16"}
    printed = summary(document, str(path))
    for method in ("terngrad", "fp16"):
        entry = document["compressors"][method]
        assert (f"  {method:<10} encode {entry['step_encode_ms']:8.3f} ms  decode {entry['step_decode_ms']:8.3f} ms  "
                f"(2 gradients)  = {100 * entry['step_fraction_of_compute']:.2f}% of forward + backward") in printed


def test_profile_under_bf16_autocast() -> None:
    """``autocast=torch.bfloat16`` (``--autocast bf16``): the forward pass in bfloat16, the gradients (and so
    every compressor's input) float32, the document says so."""
    import torch
    from torch import nn

    from hvdcomp.perfmodel.profile import profile

    seen: list[torch.dtype] = []
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    model[2].register_forward_hook(lambda _module, _inputs, output: seen.append(output.dtype))
    document = profile(model, (torch.randn(8, 32), torch.randint(0, 4, (8,))), methods=["fp16"], repeats=1,
                       autocast=torch.bfloat16)
    assert document["autocast"] == "bfloat16" and set(seen) == {torch.bfloat16}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert document["compressors"]["fp16"]["step_encode_ms"] > 0


def test_profile_a_factory_model_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``hvdcomp profile --model package.module:factory`` with an input shape, and with a batch function; bad
    specifications name what is wrong (the command's entry point called in this process: no import each)."""
    out = tmp_path / "resnet.yaml"
    done = _hvdcomp("profile", "--model", "hvdcomp.tools.models:resnet18", "--input-shape", "3,32,32", "--classes",
                    "10", "--batch-size", "2", "--repeats", "1", "--methods", "topk", "--autocast", "bf16", "--out",
                    str(out))
    assert done.returncode == 0, done.stderr
    assert "(bfloat16 autocast)" in done.stdout and "\n  topk       encode " in done.stdout, done.stdout
    assert yaml.safe_load(out.read_text())["autocast"] == "bfloat16"
    profile = schema.load(out, "profile")
    assert profile.model == "hvdcomp.tools.models:resnet18" and len(profile.gradients) == 62
    assert profile.dense_bytes == 4 * 11_173_962 and "1.weight" not in profile.compressors["topk"].gradients
    out = tmp_path / "transformer.yaml"
    done = _hvdcomp("profile", "--model", "hvdcomp.tools.models:transformer", "--batch",
                    "hvdcomp.tools.models:transformer_batch", "--batch-size", "2", "--repeats", "1", "--methods",
                    "fp16", "--loss", "torch.nn.functional:multi_margin_loss", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert schema.load(out, "profile").batch_size == 2
    for args, message in ((["--model", "nowhere.at.all:f", "--input-shape", "4"], "cannot import 'nowhere.at.all'"),
                          (["--model", "hvdcomp.tools.models"], "must be package.module:callable"),
                          (["--model", "hvdcomp.tools.models:missing"], "has no callable 'missing'"),
                          (["--model", "hvdcomp.tools.models:resnet18"], "needs --input-shape or --batch"),
                          (["--model", "hvdcomp.tools.models:resnet18_batch", "--input-shape", "3"],
                           "must be callable without arguments"),
                          (["--model", "builtins:dict", "--input-shape", "3"], "returned dict, not a torch.nn.Module"),
                          (["--model", "hvdcomp.tools.models:resnet18", "--input-shape", "3,x"],
                           "--input-shape must be comma-separated integers"),
                          (["--model", "digits", "--loss", "torch.nn.functional:nothing"],
                           "--loss: torch.nn.functional has no callable 'nothing'")):
        code, stderr = _hvdcomp_here(capsys, "profile", *args, "--out", str(tmp_path / "bad.yaml"))
        assert code == 2 and message in stderr, (args, stderr)
    # an error inside the user's own code (here a batch function's ValueError) is theirs: its traceback, not usage
    done = _hvdcomp("profile", "--model", "hvdcomp.tools.models:resnet18", "--batch", "math:acos", "--out",
                    str(tmp_path / "bad.yaml"))
    assert done.returncode == 1 and "Traceback" in done.stderr, done.stderr
    assert "UserCodeError: --batch math:acos raised ValueError: math domain error" in done.stderr, done.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_device_is_refused_where_there_is_none(tmp_path: Path) -> None:
    for command in ("profile", "probe"):
        extra = ["--model", "digits"] if command == "profile" else []
        done = _hvdcomp(command, *extra, "--device", "cuda", "--out", str(tmp_path / "x.yaml"))
        assert done.returncode == 2 and "torch sees no CUDA device" in done.stderr, (command, done.stderr)


def test_per_tensor_plan_picks_dense_on_fast_links_and_compressors_on_slow_ones() -> None:
    """The per-tensor chooser on scripted costs: a 1 MB gradient a compressor sends in 62.5 kB at 2.5 ms of compute
    goes compressed on a 0.16 Gbit/s link and dense on a 100 Gbit/s one; the 4-byte gradient stays dense; a method
    held back for accuracy (random-k) is chosen only when allowed, even where it is cheapest."""
    def compressor(name: str, wire: int, summable: bool) -> schema.CompressorProfile:
        encoded = schema.Encoded(wire, shared_ms=0, encode_ms=1, decode_ms=1, decode_extra_payload_ms=0.5)
        return schema.CompressorProfile(name, summable=summable, fixed_size=True, shared_before_encode=False,
                                        gradients={"a": encoded})

    profile = profile_of(10, {"onebit": compressor("onebit", 62_500, False), "randomk": compressor("randomk", 20_000,
                                                                                                 True)})
    candidates = predict.guarded_candidates(profile)
    assert candidates == ["onebit"]
    slow = {c.name: c for c in predict.per_tensor_plan(cluster_of(0.16, latency_us=10), profile, 2, candidates)}
    assert (slow["a"].method, slow["a"].collective) == ("onebit", "allgather") and slow["a"].predicted_ms < \
        slow["a"].dense_ms / 5  # 3.1 ms on the wire + 2.5 ms of compute against 50 ms dense
    assert (slow["b"].method, slow["b"].collective) == ("none", "allreduce")
    fast = {c.name: c for c in predict.per_tensor_plan(cluster_of(100, latency_us=10), profile, 2, candidates)}
    assert fast["a"].method == "none" and fast["a"].predicted_ms == fast["a"].dense_ms
    allowed = {c.name: c for c in predict.per_tensor_plan(cluster_of(0.16, latency_us=10), profile, 2,
                                                          predict.guarded_candidates(profile, ("randomk",)))}
    assert (allowed["a"].method, allowed["a"].collective) == ("randomk", "allreduce")
    assert "randomk" in predict.ACCURACY_GUARD and "8 more epochs" in predict.ACCURACY_GUARD["randomk"]


def test_predict_per_tensor_from_the_command_line(tmp_path: Path) -> None:
    profile = str(REPO / "perf" / "results" / "perfmodel" / "workloads" / "profile-synthetic.yaml")
    report = tmp_path / "plan.json"
    done = _hvdcomp("predict", "--cluster", "gtx1080-pcie-1gbe", "--profile", profile, "--per-tensor", "8",
                    "--json", str(report))
    assert done.returncode == 0 and "per-tensor plan at 8 workers" in done.stdout, done.stderr
    assert "<- chosen" in done.stdout and "plans by predicted step" in done.stdout, done.stdout
    document = json.loads(report.read_text())
    chosen = next(p for p in document["plans"] if p["label"] == document["chosen"])
    plan = {c["name"]: c for c in chosen["choices"]}
    assert plan["2.weight"]["method"] != "none" and plan["6.bias"]["method"] == "none"
    dense = next(p for p in document["plans"] if p["label"] == "dense")
    assert chosen["step_ms"] * 1.05 < dense["step_ms"]
    done = _hvdcomp("predict", "--cluster", "h100-nvlink-ib400", "--profile", profile, "--per-tensor", "8")
    assert done.returncode == 0 and "dense  <- chosen" in done.stdout, done.stdout
    done = _hvdcomp("predict", "--cluster", "h100-nvlink-ib400", "--profile", profile, "--per-tensor", "8",
                    "--allow", "topk")
    assert done.returncode == 2 and "'topk' is not held back" in done.stderr


def test_mixed_timeline_of_one_method_everywhere_is_that_method() -> None:
    """simulate_mixed with every gradient a method compresses given to it is simulate() of that method; a mixed plan
    sits between, and gradients it does not name go dense."""
    profile = schema.load(REPO / "perf" / "results" / "perfmodel" / "workloads" / "profile-synthetic.yaml", "profile")
    cluster = predict.load_cluster("gtx1080-pcie-1gbe")
    for method in ("terngrad", "topk", "fp16", "powersgd"):
        compressor = profile.compressors[method]
        collective = timeline.auto_collective(compressor, 8)
        uniform = timeline.simulate(profile, cluster, method, 8)
        mixed = timeline.simulate_mixed(profile, cluster, 8, {name: (method, collective)
                                                              for name in compressor.gradients})
        assert mixed.step_s == pytest.approx(uniform.step_s, rel=1e-12), method
    assert timeline.simulate_mixed(profile, cluster, 8, {}).step_s == pytest.approx(
        timeline.simulate(profile, cluster, "none", 8).step_s, rel=1e-12)
    with pytest.raises(ValueError, match="cannot use collective 'allreduce'"):
        timeline.simulate_mixed(profile, cluster, 8, {"2.weight": ("topk", "allreduce")})
    with pytest.raises(ValueError, match="no costs of zip"):
        timeline.simulate_mixed(profile, cluster, 8, {"2.weight": ("zip", "allreduce")})


def test_choose_plans_on_scripted_costs() -> None:
    """The live chooser's ranking on scripted costs: on a slow link the compressor's plan comes first and is chosen,
    on a fast one dense is; a candidate left out (the accuracy guard's randomk, unless allowed) is in no plan; a
    method whose reduction cannot price a payload is refused with the reason."""
    def compressor(name: str, wire: int, summable: bool) -> schema.CompressorProfile:
        encoded = schema.Encoded(wire, shared_ms=0, encode_ms=1, decode_ms=1, decode_extra_payload_ms=0.5)
        return schema.CompressorProfile(name, summable=summable, fixed_size=True, shared_before_encode=False,
                                        gradients={"a": encoded})

    profile = profile_of(100, {"onebit": compressor("onebit", 62_500, False),
                             "randomk": compressor("randomk", 20_000, True)})
    slow = predict.choose_plans(cluster_of(0.16, latency_us=10), profile, 2, predict.guarded_candidates(profile))
    chosen = predict.chosen_plan(slow)
    assert chosen is slow[0] and chosen.assignment() == {"a": ("onebit", "allgather")}, slow
    dense = next(p for p in slow if p.label == "dense")
    assert chosen.step_ms < dense.step_ms - 40  # 50 ms of exposed communication, most of it saved
    assert all("randomk" not in {m for m, _ in p.assignment().values()} for p in slow)
    fast = predict.choose_plans(cluster_of(100, latency_us=10), profile, 2, predict.guarded_candidates(profile))
    assert predict.chosen_plan(fast).label == "dense"
    allowed = predict.choose_plans(cluster_of(0.16, latency_us=10), profile, 2,
                                   predict.guarded_candidates(profile, ("randomk",)))
    assert allowed[0].assignment() == {"a": ("randomk", "allreduce")}, allowed
    example = profile.compressors["onebit"].gradients["a"]
    assert timeline.priced(profile.compressors["onebit"], example, 2) is None
    # LGC's reduction prices its payload's parts (the leader's indices, the values): with none it cannot
    assert "lgc reduction's costs (ReductionMethod.phases) failed" in timeline.priced(LGC(), example, 2)


def test_profile_of_a_bfloat16_model_counts_its_gradients_as_they_travel() -> None:
    """A model in bfloat16 (its gradients too): dense they travel as float32 (Horovod has no bfloat16 allreduce,
    the optimizer converts them), 4 bytes an element, as auto's live profile counts them."""
    import torch
    from torch import nn

    from hvdcomp.perfmodel.profile import profile

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(torch.bfloat16)
    document = profile(model, (torch.randn(8, 32, dtype=torch.bfloat16), torch.randint(0, 4, (8,))),
                       methods=["fp16"], repeats=1)
    assert {g["name"]: g["bytes"] for g in document["gradients"]} == {
        name: 4 * p.numel() for name, p in model.named_parameters()}


def test_predict_names_an_unknown_reduction(tmp_path: Path) -> None:
    data = json.loads(json.dumps(PROFILE))
    data["compressors"]["topk"]["reduction"] = "powersdg"
    with pytest.raises(ValueError, match=r"compressors\.topk\.reduction 'powersdg' is not a reduction; valid: "):
        predict.predict(cluster_of(1), _load(tmp_path, data, "profile"), [2])


def test_recommendation_is_a_plan_hvdcomp_runs() -> None:
    """Hierarchical allreduce and a parameter server are priced for comparison only: the fastest of those is not
    recommended, and dense is judged as it runs (flat allreduce)."""
    def option(method: str, collective: str, step_ms: float) -> predict.Option:
        step = timeline.StepTime(method, collective, 8, step_ms / 1e3, 0, 0, 0, 0, 0, 0, 0, 0)
        return predict.Option(step, 1.0, 1.0, collective == "allreduce")

    options = [option("none", "allreduce", 100), option("none", "hierarchical", 30),
               option("randomk", "allreduce", 60), option("randomk", "hierarchical", 20),
               option("topk", "parameter_server", 10)]
    assert predict.recommend(options, 8).startswith("at 8 workers: randomk over allreduce, 60.0 ms/step, 1.67x dense")


def test_multi_node_collectives_cross_each_tier_as_they_run() -> None:
    """On 2 nodes of 8 ranks: a collective the probe measured across the nodes is priced by that measurement, not
    held to the intra-node tier's host ping-pong; without one, a ring's bottleneck is the slower tier, and an
    alltoall sends 8 ranks' off-node shares through each node's NICs (8 x 8 / 16 of a rank's bytes, not 15 / 16)."""
    intra = schema.Tier(1.0, 120.0)
    measured = schema.Tier(5.0, 100.0, {"allreduce": schema.Measured(10.0, 2800.0)})
    probed = schema.Cluster("probed", False, 8, intra, measured)
    link = timeline.Network(probed, 16).link("allreduce")
    assert (link.alpha, link.beta) == pytest.approx((10e-6, 8 / 2800e9))
    nominal = timeline.Network(schema.Cluster("nominal", True, 8, intra, schema.Tier(5.0, 100.0)), 16)
    ring = nominal.link("allgather")
    assert ring.beta == pytest.approx(8 / 100e9)  # the slower of 120 and 100 Gbit/s
    n = 64e6
    assert nominal.time("alltoall", n) == pytest.approx(15 * 5e-6 + 8 * 8 / 16 * n * 8 / 100e9)
