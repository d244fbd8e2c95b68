"""The homomorphic sketch on one process: hashing, the filter, peeling (fused C++ and PyTorch), exactness, sizes.

Several ranks are simulated by summing their sketches and OR-ing their filters, as the collectives do; the real
collectives run in tests/ranks.py (scenario ``sketch``).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch

from hvdcomp import ErrorFeedback, make_compressor
from hvdcomp.compressor import Context
from hvdcomp.config import CompressionConfig
from hvdcomp.methods import sketch
from hvdcomp.methods.sketch import Sketch, SketchReduction
from hvdcomp.requests import one_rank


def splitmix64(z: int) -> int:
    mask = (1 << 64) - 1
    z = (z + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_mix_is_splitmix64_bit_for_bit() -> None:
    values = [0, 1, 2, 77, 2**31 - 1, 2**40 + 5, 2**62 + 3, 2**63 - 1]
    mixed = sketch.mix(torch.tensor(values))
    assert [v & ((1 << 64) - 1) for v in mixed.tolist()] == [splitmix64(v) for v in values]


def simulate(supports: list[torch.Tensor], width: int, items: int, dtype: torch.dtype = torch.float64,
             margin: float = 1.1, step: int = 0, fp_rate: float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Ranks with the given supports and random values: (candidates, decoded values, resolved, exact sum)."""
    generator = torch.Generator().manual_seed(step)
    values = [torch.randn(s.numel(), width, generator=generator) for s in supports]
    total = sum(s.numel() for s in supports)
    bits, hashes = sketch.filter_size(total, items, len(supports), fp_rate)
    union = sketch.bloom(supports[0], 11 + step, bits, hashes)
    for support in supports[1:]:
        union |= sketch.bloom(support, 11 + step, bits, hashes)
    found = sketch.candidates(union, items, 11 + step, hashes)
    c3 = sketch.sketch_cells(found.numel(), margin, 24)
    table = sum(sketch.encode(v, s, 99 + step, c3, dtype) for v, s in zip(values, supports, strict=True))
    decoded, resolved = sketch.peel(found, table, 99 + step)
    exact = torch.zeros(items, width, dtype=torch.float64)
    for v, s in zip(values, supports, strict=True):
        exact.index_add_(0, s, v.double())
    return found, decoded, resolved, exact


@pytest.mark.parametrize("overlap", ["disjoint", "half", "identical"])
def test_decoded_sum_is_exact_and_false_positives_are_zero(path: str, overlap: str) -> None:
    items, ranks, k = 50_000, 4, 800
    for step in range(10):
        generator = torch.Generator().manual_seed(step)
        pool = torch.randperm(items, generator=generator)
        if overlap == "disjoint":
            supports = [pool[r * k:(r + 1) * k] for r in range(ranks)]
        elif overlap == "identical":
            supports = [pool[:k]] * ranks
        else:  # half of each support is shared by all ranks
            supports = [torch.cat([pool[:k // 2], pool[k + r * k // 2:k + (r + 1) * k // 2]]) for r in range(ranks)]
        found, decoded, resolved, exact = simulate(supports, 4, items, step=step, fp_rate=0.1)
        union = torch.unique(torch.cat(supports))
        assert resolved == found.numel(), f"step {step}: peeling stopped at {resolved} of {found.numel()}"
        assert torch.isin(union, found).all(), "a true item failed the filter"
        assert found.numel() > union.numel(), "no false positive in the test: it would not test them"
        assert torch.equal(decoded, exact[found]), "float64 cells: the decoded sum is the exact sum"
        false_positive = ~torch.isin(found, union)
        assert torch.equal(decoded[false_positive], torch.zeros_like(decoded[false_positive]))


def test_float32_cells_decode_to_float_rounding(path: str) -> None:
    supports = [torch.randperm(20_000, generator=torch.Generator().manual_seed(r))[:500] for r in range(3)]
    found, decoded, resolved, exact = simulate(supports, 1, 20_000, dtype=torch.float32)
    assert resolved == found.numel()
    torch.testing.assert_close(decoded, exact[found], rtol=1e-5, atol=1e-6)


def test_kernels_and_pytorch_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same candidates and verdict; the same values with float64 cells (float32 cells: to rounding, as the
    paths peel in different orders)."""
    assert sketch.cpu_kernels() is not None, "the fused CPU kernels did not build"
    supports = [torch.randperm(30_000, generator=torch.Generator().manual_seed(r))[:1500] for r in range(2)]
    for dtype in (torch.float64, torch.float32):
        monkeypatch.undo()
        fused = simulate(supports, 3, 30_000, dtype=dtype)
        monkeypatch.setattr(sketch, "cpu_kernels", lambda: None)
        plain = simulate(supports, 3, 30_000, dtype=dtype)
        assert torch.equal(fused[0], plain[0]) and fused[2] == plain[2] == fused[0].numel()
        if dtype == torch.float64:
            assert torch.equal(fused[1], plain[1])
        torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-5)


def test_too_small_a_sketch_is_detected(path: str) -> None:
    supports = [torch.arange(0, 4000, 2), torch.arange(1, 4000, 4)]
    found, _, resolved, _ = simulate(supports, 1, 10_000, margin=0.5)
    assert resolved < found.numel()


def test_filter_meets_its_false_positive_rate() -> None:
    items, members = 1_000_000, 2000
    support = torch.randperm(items, generator=torch.Generator().manual_seed(0))[:members]
    for rate in (0.01, 0.001):
        bits, hashes = sketch.filter_size(members, items, 2, rate)
        found = sketch.candidates(sketch.bloom(support, 5, bits, hashes), items, 5, hashes)
        measured = (found.numel() - members) / (items - members)
        assert measured < 1.5 * rate, (rate, measured)
    bits, hashes = sketch.filter_size(members, items, 4, None)  # the default: 0.024 N T / n
    rate = 0.024 * 4 * members / items
    found = sketch.candidates(sketch.bloom(support, 6, bits, hashes), items, 6, hashes)
    assert bits % 64 == 0 and (found.numel() - members) / (items - members) < 1.5 * rate


def test_sketch_method_takes_sparse_and_dense_gradients_alike() -> None:
    indices = torch.tensor([[5, 1, 5, 9]])
    values = torch.arange(12, dtype=torch.float32).view(4, 3)
    sparse = torch.sparse_coo_tensor(indices, values, (20, 3), check_invariants=True)  # row 5 twice: summed
    method = Sketch()
    ctx = Context.local(sparse.to_dense())
    (sparse_values, sparse_rows), meta = method.compress(sparse, {}, ctx)
    (dense_values, dense_rows), _ = method.compress(sparse.to_dense(), {}, ctx)
    assert sparse_rows.tolist() == dense_rows.tolist() == [1, 5, 9]
    assert torch.equal(sparse_values, dense_values)
    assert torch.equal(method.decompress([sparse_values, sparse_rows], meta), sparse.to_dense())
    assert float(method.agree(sparse, {}, ctx).values) == float(method.agree(sparse.to_dense(), {}, ctx).values) == 3


def test_sketch_method_sends_the_rows_not_equal_to_zero() -> None:
    """A row is sent where any entry is not 0: a NaN row is (the optimizer's check then sees it), a row of -0 is not;
    agree counts the same rows, for rows and for single entries."""
    method = Sketch()
    for shape in [(5, 2), (5,)]:
        x = torch.zeros(shape)
        x[1], x[2], x[4] = float("nan"), -0.0, 3.0
        ctx = Context.local(x)
        (_, rows), _ = method.compress(x, {}, ctx)
        assert rows.tolist() == [1, 4], shape
        assert float(method.agree(x, {}, ctx).values) == 2, shape


def recorded(steps: Generator[Any, Any, Any]) -> tuple[Any, list[str]]:
    """Runs a reduction as one rank would (:func:`one_rank`); its result and the kinds of its requests, in order."""
    kinds, answer = [], None
    while True:
        try:
            request = steps.send(answer)
        except StopIteration as done:
            return done.value, kinds
        kinds.append(type(request).__name__)
        answer = one_rank(request)


def test_a_bucket_sums_each_gradient_as_alone_with_one_request_a_round(path: str) -> None:
    """The sketch method's bucket: each gradient takes the path and sum it takes alone (with its member context), the
    bucket one request a round: one vote, one filter, one allreduce (the dense ones concatenated, the sketches, float64
    here beside float32), one gather of the payloads whose peeling did not complete."""
    generator = torch.Generator().manual_seed(0)
    embedding = torch.zeros(4000, 3)
    embedding[torch.randperm(4000, generator=generator)[:40]] = torch.randn(40, 3, generator=generator)
    other = torch.zeros(3000, 2)
    other[torch.randperm(3000, generator=generator)[:30]] = torch.randn(30, 2, generator=generator)
    full = torch.randn(50, 4, generator=generator)
    half = torch.zeros(2000, 2)  # dense only once its filter's false positives are counted, at fp_rate 0.25
    half[torch.randperm(2000, generator=generator)[:700]] = torch.randn(700, 2, generator=generator)
    bucket = [full, embedding, torch.zeros(300), other.to_sparse(1), torch.randn(7, 3, generator=generator).t(), half]
    cases = [({"dtype": "float64"}, ["dense", "sketch", "empty", "sketch", "dense", "sketch"],
              ["Agree", "Allgather", "Allreduce"]),
             ({"dtype": "float64", "fp_rate": 0.25}, ["dense", "sketch", "empty", "sketch", "dense", "dense"],
              ["Agree", "Allgather", "Allreduce"]),
             ({"dtype": "float64", "margin": 0.2}, ["dense", "fallback", "empty", "fallback", "dense", "fallback"],
              ["Agree", "Allgather", "Allreduce", "Allgather"])]
    for options, paths, kinds in cases:
        reduction = SketchReduction(Sketch(), **options)
        ctx = Context.local(full, name="bucket", step=3)
        state = reduction.init_bucket_state(bucket, ctx)
        sums, made = recorded(reduction.reduce_bucket(bucket, state, ctx))
        assert made == kinds, made
        assert [member["sketch"]["path"] for member in state["members"]] == paths
        for tensor, member, total in zip(bucket, reduction.member_contexts(ctx, len(bucket)), sums, strict=True):
            alone, _ = recorded(reduction.reduce(tensor, reduction.init_state(tensor, member), member))
            dense = tensor.to_dense() if tensor.is_sparse else tensor
            assert total.shape == (dense.numel(),) and torch.equal(total, alone.reshape(-1)), options
            assert torch.equal(total, dense.reshape(-1)), options  # one rank: its own gradient, exactly
        assert state["members"][5]["sketch"]["candidates"] > 0, "half went dense before its filter"


def test_a_bucket_of_the_sketch_method_with_error_feedback_plans_and_sums_each_gradient() -> None:
    """The sketch method wrapped in error feedback, in a bucket: the plan and decisions read each member's state, and
    the sum is each gradient's (lossless: nothing is left in the residuals)."""
    bucket = [torch.randn(30, 2), torch.zeros(500, 3)]
    bucket[1][7] = 1.5
    reduction = SketchReduction(ErrorFeedback(Sketch()), dtype="float64")
    ctx = Context.local(bucket[0], name="bucket", step=2)
    state = reduction.init_bucket_state(bucket, ctx)
    assert reduction.plan(state) == "" and reduction.decisions(state) is None
    sums, _ = recorded(reduction.reduce_bucket(bucket, state, ctx))
    for tensor, total in zip(bucket, sums, strict=True):
        assert torch.equal(total, tensor.reshape(-1))


def test_bad_options_and_collectives_are_named() -> None:
    for options, text in (({"margin": 0}, "margin"), ({"dtype": "float16"}, "dtype"), ({"slack": -1}, "slack"),
                          ({"fp_rate": 1.5}, "fp_rate"), ({"filter_collective": "or"}, "filter_collective")):
        with pytest.raises(ValueError, match=text):
            SketchReduction(Sketch(), **options)
    with pytest.raises(ValueError, match="sparse payloads"):
        CompressionConfig.parse({"method": "terngrad", "collective": "sketch"})
    config = CompressionConfig.parse({"method": "topk", "collective": "sketch",
                                      "collective_options": {"margin": 1.3}})
    choice = config.choose("w", (1000, 10), 4)
    assert isinstance(choice.reduction, SketchReduction) and choice.reduction.margin == 1.3
    assert make_compressor("topk").sparse_payload and not make_compressor("terngrad").sparse_payload
    with pytest.raises(ValueError, match="unknown option 'margin' for the allgather collective"):
        CompressionConfig.parse({"method": "topk", "collective_options": {"margin": 1.3}})  # auto never sketches
    inherited = CompressionConfig.parse({"method": "terngrad", "collective": "allgather",
                                         "overrides": [{"match": "emb.*", "method": "sketch"}]})
    assert isinstance(inherited.choose("emb.weight", (1000, 10), 4).reduction, SketchReduction)


def test_profile_takes_the_sparse_workload() -> None:
    """``hvdcomp profile --model bow``: the embedding's sparse gradient is profiled densified, as the optimizer
    hands it to every method but the sketch."""
    from hvdcomp.perfmodel.profile import profile, workload_batch

    model, batch = workload_batch("bow", 8)
    document = profile(model, batch, methods=["sketch", "topk"], repeats=1)
    assert set(document["compressors"]) == {"sketch", "topk"}
    assert document["compressors"]["sketch"]["reduction"] == "sketch"
    assert document["compressors"]["topk"]["sparse_payload"] is True


def test_only_cuda_tensors_take_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors keep the C++ kernels (the Triton ones are for CUDA, or for every device when the tests ask with
    ``HVDCOMP_KERNELS=triton``)."""
    monkeypatch.delenv("HVDCOMP_KERNELS", raising=False)
    assert sketch._triton_kernels(torch.device("cpu")) is None


def test_the_performance_model_prices_the_filter_collective_the_reduction_runs() -> None:
    """The filter is gathered packed below FILTER_ALLGATHER_MAX_RANKS ranks and summed as float16 flags from there
    (filter_collective: auto): the model's first phase is that collective, of those bytes."""
    from hvdcomp.perfmodel.schema import Encoded

    e = Encoded(wire_bytes=8000, shared_ms=0.0, encode_ms=1.0, decode_ms=1.0, decode_extra_payload_ms=0.5)
    for workers in (2, sketch.FILTER_ALLGATHER_MAX_RANKS - 1, sketch.FILTER_ALLGATHER_MAX_RANKS, 1024):
        first = SketchReduction.phases(e, workers)[0]
        gathered = SketchReduction(Sketch())._filter_collective(workers) == "allgather"
        union_items = workers * e.wire_bytes / 8
        assert (first.collective, first.nbytes) == (("allgather", union_items * 10 / 8) if gathered
                                                    else ("allreduce", union_items * 10 * 2)), workers
