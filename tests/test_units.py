"""Packing, wire format, error feedback, top-k, fp16, configuration and the deadlines' beacon, in one process."""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from operators import Operators

from hvdcomp import (
    METHODS,
    CompressionConfig,
    Context,
    ErrorFeedback,
    FP16Compressor,
    HorovodCompression,
    NoneCompressor,
    RandomK,
    TernGrad,
    TopK,
    check,
    make_compressor,
    reductions,
    requests,
    wire,
)
from hvdcomp.deadlines import Beacon, answering
from hvdcomp.methods.topk import candidate_threshold, largest, sample_stride
from hvdcomp.packing import pack_bits, unpack_bits
from hvdcomp.requests import Reduction


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [*range(10), 17, 1001, 4096])
def test_bit_packing_round_trips_exactly(n: int, bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == -(-n * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)
    assert torch.equal(unpack_bits(torch.stack([packed, packed]), bits, n), torch.stack([codes, codes]))


def test_bit_packing_is_a_little_endian_bit_stream() -> None:
    """Element i at bits [i b, (i + 1) b): 2 bits is TernGrad's layout, 3 bits crosses byte boundaries."""
    assert pack_bits(torch.tensor([1, 2, 0, 3], dtype=torch.uint8), 2).tolist() == [0b11001001]
    assert pack_bits(torch.tensor([5, 3, 7], dtype=torch.uint8), 3).tolist() == [0b11011101, 0b1]


def test_packing_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="1-D uint8"):
        pack_bits(torch.zeros(4), 2)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 2, 9)
    with pytest.raises(ValueError, match=r"bits must be in \[1, 8\]"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)


def test_wire_round_trip_mixed_dtypes() -> None:
    payload = [torch.tensor([1.5]), torch.arange(5, dtype=torch.uint8), torch.arange(3, dtype=torch.int64),
               torch.tensor([], dtype=torch.int32)]
    buffer = wire.pack(payload)
    assert buffer.dtype == torch.uint8 and buffer.numel() % wire.ALIGN == 0
    layout = wire.layout_of(payload)
    assert buffer.numel() == wire.nbytes(layout) == 8 + 8 + 24 + 0
    for original, unpacked in zip(payload, wire.unpack(buffer, layout), strict=True):
        assert torch.equal(original, unpacked)
    with pytest.raises(ValueError, match="does not match its layout"):
        wire.unpack(buffer[:-8], layout)


def test_values_read_on_the_host_come_back_as_they_were() -> None:
    """``to_host`` (the optimizer's one copy a step of its reductions' Read requests): each tensor's values, shape and
    dtype, on the CPU, whatever the mix of dtypes and shapes, and not aliasing the originals."""
    tensors = [torch.tensor([1.5, -2.0]), torch.arange(6, dtype=torch.int64).view(2, 3), torch.tensor(3.25),
               torch.zeros(0), torch.tensor([[0.1]], dtype=torch.float64), torch.tensor([7.0, 8.0]).expand(2, 2)]
    copies = requests.to_host(tensors)
    assert len(copies) == len(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.device.type == "cpu" and copy.dtype == tensor.dtype and torch.equal(copy, tensor), (tensor, copy)
    tensors[0].add_(1)
    assert torch.equal(copies[0], torch.tensor([1.5, -2.0]))


def test_a_step_on_one_rank_answers_its_opening_host_agreements_together() -> None:
    """``run_one_rank_step`` (benchmarks' step of one rank): every reduction makes its first request before any is
    answered, the host agreements among them come back on the host with their values, shapes and dtypes, and each
    reduction then runs to its end; one that makes no request returns as it is."""
    log: list[str] = []

    def reduction(name: str, values: torch.Tensor) -> Reduction:
        log.append(f"{name} asks")
        agreed = yield requests.Agree(values, "sum", host=True)
        log.append(f"{name} has {agreed.tolist()} {agreed.dtype} on {agreed.device.type}")
        (summed,) = yield requests.Allreduce([agreed.float() + 1])
        return summed

    def no_request() -> Reduction:
        return torch.ones(1)
        yield  # a generator

    def gathers() -> Reduction:
        (payload,) = yield requests.Allgather([torch.arange(3)])
        return payload[0]

    results = requests.run_one_rank_step([reduction("a", torch.tensor([1.0, 2.0])), no_request(), gathers(),
                                          reduction("b", torch.tensor([[3.0]], dtype=torch.float64))])
    assert log == ["a asks", "b asks", "a has [1.0, 2.0] torch.float32 on cpu",
                   "b has [[3.0]] torch.float64 on cpu"], log
    for result, expected in zip(results, [[2.0, 3.0], [1.0], [0, 1, 2], [[4.0]]], strict=True):
        assert result.tolist() == expected, results


@pytest.mark.parametrize("inner", [TopK(0.1), TernGrad(), FP16Compressor(), NoneCompressor()])
def test_error_feedback_invariant(inner) -> None:
    """residual + decompressed = compensated input, every step."""
    compressor = ErrorFeedback(inner)
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(0))
    ctx = Context.local(x)
    state = compressor.init_state(x, ctx)
    for step in range(5):
        g = x * (step + 1)
        compensated = g + state["residual"]
        payload, meta = compressor.compress(g, state, ctx)
        torch.testing.assert_close(state["residual"] + compressor.decompress(payload, meta), compensated,
                                   rtol=0, atol=1e-5)
        if isinstance(inner, NoneCompressor):  # a payload that is a view of its input is not zeroed
            torch.testing.assert_close(payload[0], compensated)
    with pytest.raises(ValueError, match="already has error feedback"):
        ErrorFeedback(compressor)


def test_topk_keeps_largest_and_drops_zeros() -> None:
    x = torch.tensor([0.1, -5.0, 0.0, 3.0, -0.2, 0.0, 0.0, 0.0, 0.0, 0.0])
    compressor = TopK(0.2)
    payload, meta = compressor.compress(x, {}, Context.local(x))
    assert sorted(payload[1].tolist()) == [1, 3] and payload[1].dtype == torch.int32
    assert torch.equal(compressor.decompress(payload, meta), torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0, 0, 0]))
    sparse = torch.zeros(10)
    sparse[4] = 1.0
    payload, _ = TopK(0.5).compress(sparse, {}, Context.local(sparse))
    assert payload[0].numel() == 1, "zeros among the top-k are not sent"
    with pytest.raises(ValueError, match=r"ratio must be a number in \(0, 1\]"):
        TopK(0)


@pytest.mark.parametrize("case", ["gaussian", "ties", "sparse", "fallback"])
def test_topk_selection_is_exact(case: str) -> None:
    """The sampled-threshold selection returns the same set as torch.topk, including on its fallback path."""
    n, k = 1_000_003, 10_001
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    if case == "ties":
        x = x.mul(4).round()  # many equal magnitudes, of both signs, around the threshold
    elif case == "sparse":
        x[torch.arange(0, n, 3)] = 0.0
    elif case == "fallback":  # the sampled entries are the largest: their threshold keeps fewer than k
        x[::sample_stride(n)] = -100.0
        k = 100_001
    chosen = largest(x, k)
    reference = x.abs().topk(k, sorted=False).values
    assert chosen.numel() == k and chosen.unique().numel() == k
    assert torch.equal(x[chosen].abs().sort().values, reference.sort().values)


@pytest.mark.parametrize("shape", [(1024, 4096), (512, 64, 3, 3)])
def test_topk_candidate_threshold_holds_on_a_layer_gradient(shape: tuple[int, ...]) -> None:
    """The sample sees every column of a gradient whose magnitudes differ by column (the outer product of a
    linear layer's output errors and inputs; a convolution's kernel positions): its threshold keeps at least
    k, so selection takes the fast path. A step of n / 65536 (64 over 4096-wide rows) saw 64 of the 4096
    columns and kept fewer than k in 5 and 6 of these 20 draws."""
    generator = torch.Generator().manual_seed(5)
    for _ in range(20):
        rows = torch.randn(shape[0], 1, generator=generator)
        columns = torch.randn(1, math.prod(shape[1:]), generator=generator).pow(3)  # heavy-tailed inputs
        x = (rows * columns).view(-1)
        k = math.ceil(0.01 * x.numel())
        assert (x.abs() >= candidate_threshold(x, k)).sum() >= k


def test_topk_aggregate_sums_overlapping_indices() -> None:
    compressor = TopK(0.5)
    x, y = torch.tensor([4.0, 0.0, 1.0, 0.0]), torch.tensor([2.0, 3.0, 0.0, 0.0])
    a, meta = compressor.compress(x, {}, Context.local(x))
    b, _ = compressor.compress(y, {}, Context.local(y))
    assert torch.equal(compressor.aggregate([a, b], meta), torch.tensor([6.0, 3.0, 1.0, 0.0]))


@pytest.mark.parametrize(("dtype", "big", "small"), [(torch.float16, 60000.0, 60000.0), (torch.bfloat16, 256.0, 1.0)])
def test_topk_aggregate_sums_half_payloads_in_float32(dtype: torch.dtype, big: float, small: float) -> None:
    """A bare top-k on a half gradient sums in float32: 60000 + 60000 overflows float16 (the average would be Inf),
    and 256 + 1 is 256 in bfloat16."""
    compressor = TopK(0.5)
    x, y = torch.tensor([big, 0.0, 1.0, 0.0], dtype=dtype), torch.tensor([small, 0.5, 0.0, 0.0], dtype=dtype)
    a, meta = compressor.compress(x, {}, Context.local(x))
    b, _ = compressor.compress(y, {}, Context.local(y))
    total = compressor.aggregate([a, b], meta)
    assert total.dtype == torch.float32
    assert torch.equal(total, torch.tensor([big + small, 0.5, 1.0, 0.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_fp16(dtype: torch.dtype) -> None:
    x = torch.randn(100).to(dtype)
    payload, meta = FP16Compressor().compress(x, {}, Context.local(x))
    assert payload[0].dtype == torch.float16
    out = FP16Compressor().decompress(payload, meta)
    assert out.shape == x.shape
    torch.testing.assert_close(out.float(), x.float(), rtol=1e-2, atol=1e-3)


def test_horovod_adapter_accepts_only_stateless_summable() -> None:
    adapter = HorovodCompression(FP16Compressor())
    tensor, ctx = adapter.compress(torch.ones(3, dtype=torch.float64))
    assert tensor.dtype == torch.float16
    assert adapter.decompress(tensor, ctx).dtype == torch.float64
    # TernGrad is gathered; random-k needs the step (its positions would never change); error feedback a state
    for compressor in (TernGrad(), RandomK(), ErrorFeedback(FP16Compressor())):
        with pytest.raises(ValueError, match="does not fit Horovod's compression hook"):
            HorovodCompression(compressor)


def test_horovods_own_compression_is_named_and_pointed_home() -> None:
    """hvd.Compression.fp16 given to hvdcomp: the error names the class and what to say instead."""
    import horovod.torch as hvd

    with pytest.raises(ValueError, match=r'got FP16Compressor .*hvd\.DistributedOptimizer; here say "fp16"'):
        CompressionConfig.parse(hvd.Compression.fp16)


def test_config_choices() -> None:
    config = CompressionConfig.parse({
        "method": "terngrad", "options": {"clip": 3.0}, "min_numel": 100, "dense": ["head.*"],
        "overrides": [{"match": "emb*", "method": "topk", "options": {"ratio": 0.001}},
                      {"match": "*.bias", "method": "fp16"}]})
    body = config.choose("body.weight", (1000,), world_size=2)
    assert isinstance(body.compressor, TernGrad) and body.compressor.clip == 3.0
    assert body.reduction.name == "allgather"
    assert config.choose("body.weight", (1000,), world_size=8).reduction.name == "two_phase"
    embedding = config.choose("emb.weight", (1000,), 2)
    assert isinstance(embedding.compressor, ErrorFeedback) and embedding.compressor.inner.ratio == 0.001
    assert config.choose("body.bias", (1000,), 2).reduction.name == "allreduce"
    assert config.choose("head.weight", (10**6,), 2).compressor is None
    assert config.choose("small.weight", (99,), 2).compressor is None
    assert CompressionConfig.parse("none").choose("x", (10**6,), 2).compressor is None
    assert CompressionConfig.parse(TernGrad(clip=None)).choose("x", (10**6,), 2).compressor.clip is None
    unbiased_with_ef = CompressionConfig.parse({"method": "terngrad", "error_feedback": True})
    assert isinstance(unbiased_with_ef.choose("x", (10**6,), 2).compressor, ErrorFeedback)
    owner = CompressionConfig.parse({"method": "terngrad", "collective": "two_phase",
                                     "collective_options": {"owner_error_feedback": False}})
    assert owner.choose("x", (10**6,), 2).reduction.owner_error_feedback is False
    # under auto, an option of two_phase is accepted at any rank count and given to two_phase only
    auto = CompressionConfig.parse({"method": "terngrad", "collective_options": {"owner_error_feedback": False}})
    assert auto.choose("x", (10**6,), 2).reduction.name == "allgather"
    assert auto.choose("x", (10**6,), 8).reduction.owner_error_feedback is False
    # an override that names a method takes its own error feedback (top-k's), not the default's
    memory = CompressionConfig.parse({"method": "randomk", "error_feedback": False,
                                      "overrides": [{"match": "emb*", "method": "topk"}]})
    assert isinstance(memory.choose("emb.weight", (10**6,), 2).compressor, ErrorFeedback)
    same = CompressionConfig.parse({"method": "topk", "error_feedback": False,  # the same method keeps it
                                    "overrides": [{"match": "emb*", "method": "topk", "options": {"ratio": 0.1}}]})
    assert not isinstance(same.choose("emb.weight", (10**6,), 2).compressor, ErrorFeedback)
    # an override of another method inherits the collective's options, taking what its own reduction takes (fp16: none)
    mixed = CompressionConfig.parse({"method": "terngrad", "collective": "two_phase",
                                     "collective_options": {"owner_error_feedback": False},
                                     "overrides": [{"match": "*.bias", "method": "fp16"}]})
    assert mixed.choose("b.bias", (10**6,), 2).reduction.name == "allreduce"
    assert mixed.choose("w", (10**6,), 2).reduction.owner_error_feedback is False
    # an override that names no method sets its options over the default's (clip stays off)
    kept = CompressionConfig.parse({"method": "terngrad", "options": {"clip": None},
                                    "overrides": [{"match": "emb*", "options": {"scaler_sharing": False}}]})
    chosen = kept.choose("emb.weight", (10**6,), 2).compressor
    assert chosen.clip is None and chosen.scaler_sharing is False
    # and the other way: a default method that takes no collective option (none) names the collective and its
    # options for the overrides
    dense_default = CompressionConfig.parse({"method": "none", "collective": "two_phase",
                                            "collective_options": {"owner_error_feedback": False},
                                            "overrides": [{"match": "w*", "method": "terngrad"}]})
    assert dense_default.choose("w", (10**6,), 2).reduction.owner_error_feedback is False


@pytest.mark.parametrize(("argument", "message"), [
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor=2.0: hvdcomp averages once"),
    ({"num_groups": 4}, "num_groups and groups"),
    ({"groups": [[]]}, "num_groups and groups"),
])
def test_horovods_arguments_that_do_not_apply_are_refused(argument: dict, message: str) -> None:
    """DistributedOptimizer takes hvd.DistributedOptimizer's arguments, in its order; those that do not apply are
    refused by name, before anything runs (a ported job fails at once, not on a TypeError or a wrong average)."""
    pytest.importorskip("horovod.torch")
    import hvdcomp

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=message):
        hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                     "topk", 1, **argument)


def test_patterns_that_match_no_parameter_are_named() -> None:
    """A dense or override pattern that matches no parameter name (a typo, or the model's names read wrong: the
    optimizer warns of them on rank 0)."""
    config = CompressionConfig.parse({"method": "terngrad", "dense": ["6.*", "fc3.*"],
                                      "overrides": [{"match": "*.bias", "method": "fp16"},
                                                    {"match": "emb*", "method": "topk"}]})
    names = ["0.weight", "0.bias", "6.weight", "6.bias"]
    assert config.unmatched(names) == ["dense pattern 'fc3.*'", "overrides[1]'s match 'emb*'"]
    assert CompressionConfig.parse("terngrad").unmatched(names) == []


def test_unscaled_signs_are_gathered_not_summed_by_owners() -> None:
    """Two-phase's owner compresses the ranks' vote again: unscaled signSGD's bare signs cannot carry that sum of N
    votes (it would arrive N times too small), so auto gathers it at any rank count and two_phase is refused; the
    scaled vote (the default) and EF-signSGD go two-phase from 5 ranks."""
    unscaled = {"method": "signsgd", "options": {"scaled": False}}
    assert CompressionConfig.parse(unscaled).choose("w", (10**6,), 8).reduction.name == "allgather"
    with pytest.raises(ValueError, match="cannot compress the ranks' sum again"):
        CompressionConfig.parse({**unscaled, "collective": "two_phase"})
    for method in ("signsgd", "efsignsgd"):
        assert CompressionConfig.parse(method).choose("w", (10**6,), 8).reduction.name == "two_phase"


@pytest.mark.parametrize("config", [{"method": "terngrad", "error_feedback": True, "collective": "two_phase"},
                                    {"method": "randomk"}, {"method": "powersgd"}, "terngrad"])
def test_every_reduction_states_its_plan(config) -> None:
    """The optimizer asks the reduction for the plan: two-phase's state holds a state per chunk."""
    chosen = CompressionConfig.parse(config).choose("w", (64, 32), 8)
    x = torch.randn(64, 32)
    ctx = Context("w", 3, 8, x.device, 1, 2)
    assert isinstance(chosen.reduction.plan(chosen.reduction.init_state(x, ctx)), str)


def test_memory_policy_is_the_same_for_names_configs_and_objects() -> None:
    """Biased methods get error feedback whether given by name, by config or as an object."""
    for given in ("topk", {"method": "topk"}, TopK(0.01)):
        chosen = CompressionConfig.parse(given).choose("x", (10**6,), 2).compressor
        assert isinstance(chosen, ErrorFeedback) and isinstance(chosen.inner, TopK), given
    bare = CompressionConfig.parse({"method": "topk", "error_feedback": False}).choose("x", (10**6,), 2)
    assert isinstance(bare.compressor, TopK)
    assert not isinstance(CompressionConfig.parse(TernGrad()).choose("x", (10**6,), 2).compressor, ErrorFeedback)


@pytest.mark.parametrize(("config", "message"), [
    ("terngard", f"unknown compression method 'terngard'; valid: {', '.join(sorted(METHODS))}"),
    ({"method": "terngrad", "options": {"clipp": 2}}, "unknown option for terngrad 'clipp'; valid: clip, "
                                                      "scaler_sharing"),
    ({"method": "terngrad", "options": {"clip": -1}}, "clip must be a positive finite number"),
    ({"method": "topk", "options": {"ratio": 2}}, "ratio must be a number in"),
    ({"methd": "topk"}, "unknown key in compression config 'methd'; valid: method, options"),
    ({"method": "topk", "collective": "ring"}, "unknown collective in compression config 'ring'; valid: auto"),
    ({"method": "topk", "collective": "two_phase"}, "two_phase needs fixed-size payloads"),
    ({"method": "terngrad", "collective": "two_phase", "collective_options": {"owner": 1}},
     "unknown option 'owner' for the two_phase collective; valid: owner_error_feedback"),
    ({"method": "topk", "collective_options": {"owner_error_feedback": False}},
     "unknown option 'owner_error_feedback' for the allgather collective; valid: \\(none\\)"),
    ({"method": "terngrad", "collective_options": {"owner_error_feedback": "no"}},
     "two_phase: owner_error_feedback must be true or false; got 'no'"),  # under auto: two-phase from 5 ranks
    ({"method": "sketch", "collective_options": {"dtype": "float16"}}, "sketch: dtype must be one of float32, float64"),
    ({"method": "topk", "min_numel": -1}, "min_numel must be a non-negative integer"),
    ({"method": "topk", "bucket_cap_mb": -1}, "bucket_cap_mb must be a non-negative finite number of MiB; got -1"),
    ({"method": "topk", "bucket_cap_mb": "25MB"}, "bucket_cap_mb must be a non-negative finite number of MiB"),
    ({"method": "topk", "dense": "fc.*"}, "dense must be a list"),
    ({"method": "topk", "nonfinite": "ignore"}, "unknown nonfinite policy 'ignore'; valid: raise, skip"),
    ({"method": "topk", "error_feedback": "yes"}, "error_feedback must be true, false or null"),
    ({"overrides": [{"method": "topk"}]}, r"overrides\[0\] must be a mapping with a 'match' pattern"),
    ({"overrides": [{"match": None, "method": "topk"}]}, r"overrides\[0\] must be a mapping with a 'match' pattern \(a "
                                                          r"string\); got \{'match': None"),
    ({"method": "terngrad", "collective": "two_phase", "overrides": [{"match": "x", "method": "topk"}]},
     r"overrides\[0\]: .*two_phase needs fixed-size payloads"),
    ({"overrides": {"match": "fc.*", "method": "topk"}}, "overrides must be a list of mappings, each with a 'match'"),
    ({"overrides": 5}, "overrides must be a list of mappings"),
    ({"method": "topk", "dense": 5}, "dense must be a list of parameter-name patterns; got 5"),
    ({"overrides": [{"match": "*", "methd": "topk"}]}, r"unknown key in overrides\[0\] 'methd'"),
    (42, "compression must be a Compressor, a method name or a config mapping"),
    ({"method": "auto", "collective": "allgather"}, "collective does not go with method auto"),
    ({"method": "auto", "overrides": []}, "overrides does not go with method auto"),
    ({"method": "auto", "options": {"plans": 0}}, "auto: plans must be a positive integer; got 0"),
    ({"method": "auto", "options": {"budget_s": -1}}, "auto: budget_s must be a non-negative finite number .* got -1"),
    ({"method": "auto", "options": {"budget_s": "5s"}}, "auto: budget_s must be a non-negative finite .* got .5s."),
    ({"method": "auto", "options": {"budget_s": float("inf")}}, "auto: budget_s must be a non-negative finite number"),
    ({"method": "auto", "options": {"allow": ["topk"]}}, "auto's allow: 'topk' is not held back; held back: dgc"),
    ({"method": "auto", "options": {"candidates": {"randomk": {}}}}, "randomk is held back .*add it to allow"),
    ({"method": "auto", "options": {"candidates": {"zip": {}}}}, "unknown compression method in auto.s candidates"),
    ({"method": "auto", "options": {"candidates": {"topk": {"ratioo": 1}}}}, "unknown option for topk 'ratioo'"),
    ({"method": "auto", "options": {"guard": 3}}, "unknown key in auto's options 'guard'; valid: allow, candidates"),
])
def test_bad_config_is_rejected_with_the_valid_choices(config: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompressionConfig.parse(config)


def test_auto_starts_dense_with_its_settings() -> None:
    """compression: auto plans every parameter dense until the optimizer's tuner applies a plan; its candidates are
    every registered method but the guarded ones, unless allowed or named."""
    config = CompressionConfig.parse({"method": "auto", "options": {"allow": ["randomk"]}, "min_numel": 10})
    assert config.choose("w", (1000,), 4).compressor is None and config.min_numel == 10
    candidates = config.auto.methods()
    assert "randomk" in candidates and "signsgd" not in candidates and "topk" in candidates
    assert "none" not in candidates and "auto" not in candidates
    named = CompressionConfig.parse({"method": "auto", "options": {"candidates": {"topk": {"ratio": 0.1}}}})
    assert named.auto.methods() == {"topk": {"ratio": 0.1}}


def test_decisions_come_through_every_reduction() -> None:
    """``optimizer.decisions()`` asks each parameter's reduction: two-phase's chunked state has none to give, a
    method that decides (GraVAC) answers through its own reduction."""
    grad = torch.randn(64, 64)
    ctx = Context.local(grad)
    for method in ("onebit", "terngrad"):
        reduction = reductions.make("two_phase", make_compressor(method))
        assert reduction.decisions(reduction.init_state(grad, ctx)) is None
    reduction = reductions.make("gravac", make_compressor("gravac"))
    state = reduction.init_state(grad, ctx)
    assert reduction.decisions(state) is None  # no step yet
    state["last"] = {"cf": 10.0, "sent": 10.0, "gain": 0.812345678}
    assert reduction.decisions(state) == [10.0, 10.0, 0.81235]


def test_every_registered_method_builds_with_defaults() -> None:
    for name in METHODS:
        assert make_compressor(name).name == name


def test_a_method_of_a_taken_name_is_refused_and_a_method_name_must_be_a_string() -> None:
    """A class of another module under a built-in method's name is refused, naming both (it would replace the
    built-in everywhere); a method that is not a string gets the message of an unknown one."""
    from hvdcomp.compressor import Compressor

    with pytest.raises(ValueError, match="compression method 'topk' is defined twice"):
        type("TopK", (Compressor,), {"name": "topk", "__module__": "users_code"})
    assert METHODS["topk"].__module__ == "hvdcomp.methods.topk"
    with pytest.raises(ValueError, match=r"unknown compression method \['topk'\]; valid:"):
        make_compressor(["topk"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: check.number("topk", "ratio", True, gt=0, le=1), "topk: ratio must be a number in (0, 1]; got True"),
    (lambda: check.number("dgc", "momentum", 1, ge=0, lt=1), "dgc: momentum must be a number in [0, 1); got 1"),
    (lambda: check.number("lgc", "lr", 0, gt=0), "lgc: lr must be a positive finite number; got 0"),
    (lambda: check.number("f.yaml", "a.b", math.inf, ge=0),
     "f.yaml: a.b must be a non-negative finite number; got inf"),
    (lambda: check.number("terngrad", "clip", math.inf, gt=0, optional=True),
     "terngrad: clip must be a positive finite number or null; got inf"),
    (lambda: check.number("dgc", "clip_norm", "1", gt=0, optional=True),
     "dgc: clip_norm must be a positive finite number or null; got '1'"),
    (lambda: check.number("topk", "ratio", -1, ge=0, noun="fraction"),
     "topk: ratio must be a non-negative finite fraction; got -1"),
    (lambda: check.number("", "deadline", -1, gt=0, expected="a Deadline or seconds"),
     "deadline must be a Deadline or seconds; got -1"),
    (lambda: check.integer("powersgd", "rank", 0, ge=1), "powersgd: rank must be a positive integer; got 0"),
    (lambda: check.integer("gravac", "interval", 1, ge=2), "gravac: interval must be an integer >= 2; got 1"),
    (lambda: check.integer("qsgd", "bits", 2.0, ge=2, le=8), "qsgd: bits must be an integer in [2, 8]; got 2.0"),
    (lambda: check.integer("", "seed", False), "seed must be an integer; got False"),
    (lambda: check.integer("x", "size", 12, ge=1, multiple_of=8), "x: size must be a positive multiple of 8; got 12"),
    (lambda: check.numbers("gravac", "candidates", [], gt=1, nonempty=True, noun="factors"),
     "gravac: candidates must be a non-empty list of finite factors > 1; got []"),
    (lambda: check.numbers("gravac", "candidates", [10, math.inf], gt=1, nonempty=True, noun="factors"),
     "gravac: candidates must be a non-empty list of finite factors > 1; got [10, inf]"),
    (lambda: check.numbers("dgc", "warmup", "0.5", gt=0, le=1),
     "dgc: warmup must be a list of numbers in (0, 1]; got '0.5'"),
    (lambda: check.numbers("x", "y", [*range(40), None]),
     f"x: y must be a list of finite numbers; got {list(range(20))}"[:-1]),
    (lambda: check.boolean("randomk", "unbiased", 1), "randomk: unbiased must be true or false; got 1"),
    (lambda: check.boolean("", "error_feedback", "no", optional=True),
     "error_feedback must be true, false or null; got 'no'"),
    (lambda: check.choice("lgc", "variant", "tree", ("ring", "ps")),
     "lgc: variant must be one of ring, ps; got 'tree'"),
])
def test_option_checks_name_the_owner_the_option_the_range_and_the_value(call, message: str) -> None:
    """One message format for every option (the owner, the option, what it may be, the value, cut to 80 characters
    with "..."); booleans are refused as numbers and integers, floats as integers."""
    with pytest.raises(ValueError) as error:
        call()
    text = str(error.value)
    assert text == message or (text.startswith(message) and text.endswith("...")), text
    assert len(text.partition("; got ")[2]) <= 80


def test_option_checks_return_the_value() -> None:
    assert check.number("m", "ratio", 1, gt=0, le=1) == 1.0 and isinstance(check.number("m", "r", 1), float)
    assert check.number("m", "clip", None, gt=0, optional=True) is None
    assert check.integer("m", "bucket_size", 512, ge=1, multiple_of=8) == 512
    assert check.numbers("m", "densities", [0.25, 1], gt=0, le=1) == (0.25, 1.0)
    assert check.boolean("m", "scaled", False) is False and check.boolean("m", "ef", None, optional=True) is None
    assert check.choice("m", "norm", "max", ("l2", "max")) == "max"


def _listening(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket of this network namespace listens on at ``port`` (Linux's /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(socket.inet_ntoa(struct.pack("<I", int(address, 16))))
    return found


def test_a_beacon_listens_only_on_the_addresses_it_advertises() -> None:
    """A beacon listens on each address it advertises (loopback last, so ranks on one machine reach each other), on
    one port, and on no other address (not the wildcard); each answers a peer's probe, and a closed port does not."""
    addresses, port = Beacon.address()
    assert addresses and addresses[-1].startswith("127."), addresses
    assert _listening(port) == set(addresses)
    assert Beacon.address() == (addresses, port), "started once per process"
    for address in addresses:
        assert answering({1: ([address], port)}) == ([1], [])
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
    assert answering({1: (addresses, port), 2: (["127.0.0.1"], closed_port)}, timeout_s=1) == ([1], [2])


def test_silent_ranks_cost_one_probe_timeout_together() -> None:
    """Peers whose beacon leaves a connect unanswered (here: a listener whose queue is full) cost one timeout together,
    not one each; a peer's loopback address is tried only where it advertises no other (on another host it would
    reach this one: here a listener on loopback alone does not answer for a peer that also advertises this host's
    network address)."""
    with contextlib.ExitStack() as stack:
        full = stack.enter_context(socket.socket())
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        for _ in range(3):
            queued = stack.enter_context(socket.socket())
            queued.setblocking(False)
            queued.connect_ex(full.getsockname())
        time.sleep(0.1)
        _, beacon = Beacon.address()
        silent = {rank: (["127.0.0.1"], full.getsockname()[1]) for rank in (1, 2, 3)}
        start = time.monotonic()
        assert answering({**silent, 4: (["127.0.0.1"], beacon)}, timeout_s=1) == ([4], [1, 2, 3])
        assert time.monotonic() - start < 2, "each silent rank waited for in turn"
        network = [address for address in Beacon.address()[0] if not address.startswith("127.")]
        if network:
            loopback_only = stack.enter_context(socket.socket())
            loopback_only.bind(("127.0.0.1", 0))
            loopback_only.listen(8)
            assert answering({5: ([network[0], "127.0.0.1"], loopback_only.getsockname()[1])}, timeout_s=1) == ([], [5])


def test_probes_past_the_open_file_limit_wait_their_turn() -> None:
    """A large job's peers under a low open-file limit: probes that find no descriptor are tried once others close,
    so every beacon that answers is found, and nothing raises (the deadline's watchdog formats this message before it
    ends the job)."""
    script = """
import resource, socket
from hvdcomp.deadlines import answering
listener = socket.create_server(("127.0.0.1", 0), backlog=1024)  # connects complete in its queue, unaccepted
port = listener.getsockname()[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
yes, no = answering({rank: (["127.0.0.1"], port) for rank in range(1, 200)}, timeout_s=2)
print(len(yes), len(no))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["199", "0"], done.stdout + done.stderr


def test_a_failed_collective_stays_horovods_error_whatever_its_context_meets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective that fails (a peer gone) is re-raised as HorovodInternalError, what Elastic Horovod recovers from,
    naming it, also where telling where the job stood fails. (Horovod's wait stood in for: here no peer can go.)"""
    import horovod.torch as hvd
    from horovod.common.exceptions import HorovodInternalError

    from hvdcomp import deadlines

    def lost(handle: int) -> None:
        raise HorovodInternalError("Gloo: connection closed by peer")

    def context() -> str:
        raise OSError("no file descriptor left")

    monkeypatch.setattr(hvd, "synchronize", lost)
    with pytest.raises(HorovodInternalError, match=r"collective 'hvdcomp\.c\.fc' \(where the job stood could not be "
                                                   r"told: OSError.*failed: Gloo: connection closed"):
        deadlines.synchronize(0, "hvdcomp.c.fc", context=context)


def test_buckets_close_at_the_cap_per_method_and_dtype() -> None:
    """bucket_cap_mb: in the order given, a bucket per method (with its options and collective), dtype and device,
    closed once it holds the cap; dense parameters stay out, and a bucket of one is no bucket. PowerSGD's matrices and
    the sketch method's gradients bucket too (their reductions reduce each member on its own)."""
    config = CompressionConfig.parse({"method": "topk", "min_numel": 100, "bucket_cap_mb": 1,
                                      "overrides": [{"match": "q*", "method": "qsgd"},
                                                    {"match": "p*", "method": "powersgd"},
                                                    {"match": "s*", "method": "sketch"}]})
    quarter = 2**16  # float32 entries in a quarter of a MiB
    shapes = {"t1": (quarter,), "q1": (quarter,), "t2": (2 * quarter,), "small": (10,), "p1": (256, 256),
              "p2": (256, 256), "t3": (quarter,), "t4": (quarter,), "h": (quarter,), "q2": (quarter,), "t5": (8,),
              "s1": (quarter,), "s2": (quarter,)}
    planned = []
    for name, shape in shapes.items():
        dtype = torch.float16 if name == "h" else torch.float32
        planned.append((torch.empty(shape, dtype=dtype), config.choose(name, shape, 2)))
    # t1 t2 t3 reach 1 MiB; t4 and h alone; p1 p2, q1 q2 and s1 s2 open
    assert config.buckets(planned) == [[0, 2, 6], [4, 5], [1, 9], [11, 12]]
    assert CompressionConfig.parse({"method": "topk"}).buckets(planned) == []


def test_the_gradients_check_by_norms_takes_as_many_operators_for_any_number_of_tensors() -> None:
    """On CUDA the optimizer checks a step's gradients with one multi-tensor norm and two small operators (then its
    flags' where), however many gradients there are (counted here on CPU tensors: the same operators)."""
    from hvdcomp.compressor import _finite_by_norms

    counts = []
    for n in (3, 50):
        tensors = [torch.ones(100) for _ in range(n)]
        with Operators() as count:
            _finite_by_norms(tensors)
        counts.append(count.calls)
    assert counts[0] == counts[1] == ['aten._foreach_norm', 'aten.stack', 'aten.lt'], counts


@pytest.mark.parametrize(("method", "options", "agrees"), [
    ("efsignsgd", {}, False), ("signsgd", {}, False), ("topk", {}, False), ("terngrad", {}, True),
    ("terngrad", {"scaler_sharing": False}, False), ("sketch", {}, True)])
def test_memory_wrappers_build_agree_s_input_only_for_a_method_that_agrees(method: str, options: dict,
                                                                           agrees: bool) -> None:
    """Error feedback and momentum correction add the residual or the momentum to the gradient for :meth:`agree`
    only where the method asks for values there: otherwise no operator runs, and nothing is asked."""
    compressor = make_compressor(method, options)
    assert compressor.agrees is agrees
    x = torch.randn(1000)
    ctx = Context.local(x, seed=1)
    state = compressor.init_state(x, ctx)
    with Operators() as count:
        request = compressor.agree(x, state, ctx)
    assert (request is not None) is agrees
    if not agrees:
        assert count.calls == [], count.calls
