"""The Triton kernels (:mod:`hvdcomp.kernels.gpu`) against the CPU kernels, their reference.

The two share the generator and the wire format, so where the statistics agree bit for bit the codes must too.
Inputs are multiples of 1/64 in [-1, 1] ("dyadic"): every sum the statistics take is then exact in float32 and in
any order, and the comparisons are exact. Gaussian inputs check what float rounding may change: the levels to
rounding, and for ORQ (whose level search the CPU runs in float64 from float32 bin sums) that a differently placed
level costs no variance.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` is set below before
the kernels are defined, so nothing may import :mod:`hvdcomp.kernels.gpu` earlier in the session. With one they are
compiled and run on CUDA tensors, and every method compresses and decodes under
``torch.cuda.set_sync_debug_mode("error")`` (``perf/gpu/gpu_kernels.sh``). The interpreter is slow: keep tensors small.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    if "hvdcomp.kernels.gpu" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("hvdcomp.kernels.gpu was imported before TRITON_INTERPRET=1 was set: its kernels cannot "
                           "run on CPU tensors in this session")
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from conftest import huge_gradient, nearly_parallel, nonfinite_buckets  # noqa: E402
from operators import Operators  # noqa: E402
from triton_compile import compile_for, covering, recording  # noqa: E402

from hvdcomp import Context, make_compressor, requests  # noqa: E402
from hvdcomp.kernels import cpu_kernels, gpu  # noqa: E402
from hvdcomp.packing import pack_bits  # noqa: E402
from hvdcomp.quantization import rounding_variance  # noqa: E402
from hvdcomp.reductions import MEMBERS  # noqa: E402
from hvdcomp.requests import run_one_rank  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cuda" if CUDA else "cpu")
#: the methods whose CUDA path runs on these kernels
METHODS = ("terngrad", "qsgd", "signsgd", "efsignsgd", "onebit", "bingrad", "orq", "randomk")
SIZES = (0, 1, 7, 100, 1037)  # empty, one element, a ragged group, ragged buckets


#: the interpreted launches of this module's tests (tests/triton_compile.py), compiled by its last test
LAUNCHES: set[str] = set()


@pytest.fixture(scope="module", autouse=True)
def _note_launches() -> Iterator[None]:
    if CUDA:  # compiled anyway
        yield
        return
    with recording(LAUNCHES):
        yield


@pytest.fixture(scope="module")
def cpu() -> object:
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels, the reference, did not build here")
    return kernels


def dyadic(n: int, seed: int = 0) -> torch.Tensor:
    """n multiples of 1/64 in [-1, 1], a tenth of them zero: exact sums, ties and zeros."""
    return torch.randint(-64, 65, (n,), generator=torch.Generator().manual_seed(seed)).float() / 64


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def same(reference: torch.Tensor, result: torch.Tensor, what: str) -> None:
    assert torch.equal(reference, result.cpu()), f"{what}: differs from the CPU kernels"


@contextmanager
def no_sync() -> Iterator[None]:
    """On CUDA, any host-device synchronization raises (the hot path must not have one)."""
    if not CUDA:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_qsgd_codes_of_a_subnormal_bucket_and_of_nan_equal_the_cpu_kernels(cpu: object) -> None:
    """A bucket whose norm is subnormal (s / norm overflows: zeros sent) and NaN or infinite inputs (codes at s)."""
    x = torch.zeros(128)
    x[3] = 1e-39
    x[64:] = torch.randn(64, generator=torch.Generator().manual_seed(0))
    x[70], x[71] = float("nan"), float("inf")
    for kind in (1, 2):
        tables, packed = cpu.quantize_levels(x, 64, 4, kind, 0, 1, 5)
        got = gpu.quantize_levels(*on_device(x), 64, 4, kind, 0, 1, 5)
        torch.testing.assert_close(got[0].cpu(), tables, rtol=0, atol=0, equal_nan=True)  # the second's norm: NaN
        same(packed, got[1], f"qsgd codes, kind {kind}")


def test_qsgd_l2_norms_above_float32_squares_equal_the_cpu_kernels(cpu: object) -> None:
    """Buckets whose squares overflow or underflow float32 (summed again in float64; a norm beyond float32 at its
    largest). Multiples of 2^64, 2^121 and 2^-86: their float64 sums are exact in any order."""
    x = torch.cat([dyadic(64), dyadic(64, 1) * 2.0**70, dyadic(64, 2) * 2.0**127, dyadic(64, 3) * 2.0**-80])
    tables, packed = cpu.quantize_levels(x, 64, 4, 1, 0, 1, 5)
    got = gpu.quantize_levels(*on_device(x), 64, 4, 1, 0, 1, 5)
    same(tables, got[0], "L2 norms")
    assert tables[1].item() > 2.0**70 and tables[2].item() == torch.finfo(torch.float32).max
    assert tables[3].item() == pytest.approx(x[192:].double().norm().item(), rel=1e-7, abs=0)
    same(packed, got[1], "qsgd codes")


@pytest.mark.parametrize("n", SIZES)
def test_qsgd_codes_equal_the_cpu_kernels(cpu: object, n: int) -> None:
    for bits in range(2, 9):
        for kind in (1, 2):  # the L2 and the max norm
            for bucket in (8, 64, 520):
                x = dyadic(n, bits)
                tables, packed = cpu.quantize_levels(x, bucket, bits, kind, 0, 1, 5)
                (x_dev,) = on_device(x)
                got = gpu.quantize_levels(x_dev, bucket, bits, kind, 0, 1, 5)
                same(tables, got[0], f"qsgd tables, bits {bits}, kind {kind}, bucket {bucket}")
                same(packed, got[1], f"qsgd codes, bits {bits}, kind {kind}, bucket {bucket}")


@pytest.mark.parametrize("n", SIZES)
def test_orq_levels_and_codes_equal_the_cpu_kernels(cpu: object, n: int) -> None:
    # The interpreter runs the level search slowly at many levels (56 s at 8 bits): searched up to 4 bits and once
    # at 6 bits, uniform levels at every width.
    cases = [(bits, iterations) for bits in range(1, 9) for iterations in (0, 8) if iterations == 0 or bits <= 4]
    for bits, iterations in [*cases, *([(6, 2)] if n == 100 else [])]:
        bins = max(128, 16 << bits)
        x = dyadic(n, bits)
        tables, packed = cpu.quantize_levels(x, 64, bits, 0, iterations, bins, 7)
        got = gpu.quantize_levels(*on_device(x), 64, bits, 0, iterations, bins, 7)
        same(tables, got[0], f"orq levels, bits {bits}, iterations {iterations}")
        same(packed, got[1], f"orq codes, bits {bits}, iterations {iterations}")


def test_orq_levels_on_gaussian_buckets_cost_no_more_variance(cpu: object) -> None:
    """Where rounding places a level elsewhere than the CPU does, the levels still span the bucket, stay sorted and
    round with no more variance (the quantity ORQ minimizes) than the CPU's, to 1%."""
    for bits in (2, 3, 4):
        x = gaussian(2048, bits)
        reference, _ = cpu.quantize_levels(x, 128, bits, 0, 8, max(128, 16 << bits), 1)
        levels = gpu.quantize_levels(*on_device(x), 128, bits, 0, 8, max(128, 16 << bits), 1)[0].cpu()
        rows = x.view(-1, 128)
        assert torch.equal(levels[:, 0], rows.min(dim=1).values) and torch.equal(levels[:, -1], rows.max(dim=1).values)
        assert bool((levels[:, 1:] >= levels[:, :-1]).all()), "levels out of order"
        variance = rounding_variance(x, levels, 128).sum()
        assert variance <= 1.01 * rounding_variance(x, reference, 128).sum(), f"bits {bits}"


@pytest.mark.parametrize("n", SIZES)
def test_binary_levels_and_codes_equal_the_cpu_kernels(cpu: object, n: int) -> None:
    for kind, iterations in ((0, 1), (0, 4), (1, 0)):  # BinGrad at its mean, BinGrad's fixed point, 1-bit SGD
        for bucket in (8, 64, 520):
            x = dyadic(n, bucket)
            tables, packed = cpu.quantize_binary(x, bucket, kind, iterations)
            got = gpu.quantize_binary(*on_device(x), bucket, kind, iterations)
            same(tables, got[0], f"binary levels, kind {kind}, bucket {bucket}")
            same(packed, got[1], f"binary codes, kind {kind}, bucket {bucket}")
    x = gaussian(1037)  # float rounding: the same levels to rounding, the same codes away from the threshold
    tables, packed = cpu.quantize_binary(x, 64, 0, 4)
    got = gpu.quantize_binary(*on_device(x), 64, 0, 4)
    torch.testing.assert_close(got[0].cpu(), tables, rtol=1e-5, atol=1e-6)
    same(packed, got[1], "bingrad codes of a Gaussian tensor")


def test_binary_levels_and_codes_of_nan_and_infinite_inputs_equal_the_cpu_kernels(cpu: object) -> None:
    """Buckets holding NaN, +-Inf or both infinities (which the optimizer then reports on every rank): the levels are
    the CPU kernels' (NaN where theirs is: the upper level is the bucket's sum less the lower side's) and so are the
    codes (NaN codes 0: it is not >= the threshold)."""
    x = nonfinite_buckets()
    for kind, iterations in ((0, 1), (0, 4), (1, 0)):
        tables, packed = cpu.quantize_binary(x, 8, kind, iterations)
        got = gpu.quantize_binary(*on_device(x), 8, kind, iterations)
        torch.testing.assert_close(got[0].cpu(), tables, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, kind=kind: f"kind {kind}: {m}")
        same(packed, got[1], f"binary codes, kind {kind}")


@pytest.mark.parametrize("n", (*SIZES, 9000))
def test_signs_and_moments_equal_the_cpu_kernels(cpu: object, n: int) -> None:
    """The signs, the mean magnitude, and both from the one pass that packs the signs (9,000: three blocks)."""
    x = dyadic(n)  # a tenth are exact zeros: they vote on a coin
    moments = cpu.moments(x)
    expected = torch.tensor([[moments[3].item() / max(n, 1)]], dtype=torch.float32)
    for seed in (5, -1):
        signs = cpu.pack_signs(x, seed)
        same(signs, gpu.pack_signs(*on_device(x), seed), f"signs, seed {seed}")
        scale, packed = gpu.pack_signs_abs_mean(*on_device(x), seed)
        same(signs, packed, f"signs with the scale, seed {seed}")
        same(expected, scale, "mean |x| with the signs")
    same(expected, gpu.abs_mean(*on_device(x)), "mean |x|")


@pytest.mark.parametrize("masking", [False, True])
def test_dgc_memory_on_the_triton_kernels_equals_the_cpu_path(masking: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """DGC's own memory over two steps (momentum, accumulation, the release of what was sent, with and without
    factor masking): its buffers bit for bit as on the CPU kernels' path."""
    options = {"density": 0.05, "warmup_steps": 1, "momentum_masking": masking}
    grads = [gaussian(3 * 700, seed).view(3, 700) for seed in range(2)]

    def steps(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        compressor = make_compressor("dgc", options)
        ctx = replace(Context.local(tensors[0], seed=3), step=10)  # past the warm-up
        state = compressor.init_state(tensors[0], ctx)
        for step, grad in enumerate(tensors):
            compressor.compress(grad, state, replace(ctx, step=10 + step))
        return [state["momentum"], state["accumulated"]]

    expected = steps(grads)
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    moved = on_device(*grads)  # (a copy from the host synchronizes: before no_sync)
    with no_sync():
        got = steps(moved)
    for name, want, have in zip(("momentum", "accumulated"), expected, got, strict=True):
        same(want, have, f"{name}, masking {masking}")


def test_dgc_releases_the_sent_entries_in_one_launch() -> None:
    """DGC's release: zeros at the sent indices (int32 or int64) in one buffer or two, as ``index_fill_``."""
    generator = torch.Generator().manual_seed(8)
    indices = torch.randperm(5000, generator=generator)[:1500]
    for dtype in (torch.int32, torch.int64):
        buffers = [torch.randn(5000, generator=generator) for _ in range(2)]
        for count in (1, 2):
            got = [buffer.to(DEVICE) for buffer in buffers[:count]]
            gpu.release(got, indices.to(dtype).to(DEVICE))
            for buffer, result in zip(buffers, got, strict=False):
                same(buffer.clone().index_fill_(0, indices, 0), result, f"{count} buffers, {dtype}")


@pytest.mark.parametrize("n", SIZES)
def test_ternary_statistics_and_codes_equal_the_cpu_kernels(cpu: object, n: int) -> None:
    """The statistics to float rounding (each kernel takes deviations from its own blocks' means), and from them the
    same codes."""
    x = dyadic(n)
    _, deviations, absmax, _ = cpu.moments(x).tolist()
    for clip in (2.5, None):
        bound, scaler = gpu.ternary_statistics(*on_device(x), clip)
        if n == 0:
            assert bound.item() == scaler.item() == 0
            continue
        expected = float("inf") if clip is None else clip * (deviations / n) ** 0.5
        assert bound.item() == pytest.approx(expected, rel=1e-6)
        assert scaler.item() == pytest.approx(min(absmax, expected), rel=1e-6)
        for seed in (0, 11):
            codes = cpu.ternarize_pack(x, scaler.item(), bound.item(), seed)
            same(codes, gpu.ternarize_pack(*on_device(x), scaler, bound, seed), f"ternary codes, clip {clip}")
    zero = torch.zeros(1, device=DEVICE)
    assert not gpu.ternarize_pack(*on_device(x), zero, zero, 3).any(), "a zero scaler sends zeros"


def test_ternary_codes_of_nan_and_infinite_inputs_equal_the_cpu_kernels(cpu: object) -> None:
    """NaN sends 0 and an infinite value its sign's code, as the CPU kernel's std::min takes them, with an infinite
    bound (no clip) and a finite one. (The interpreter's minimum keeps NaN as the CPU does; compiled, tl.minimum
    returned the bound for NaN, which then sent +scaler: this fails only on a GPU.)"""
    x = dyadic(256)
    x[5], x[6], x[200] = float("nan"), float("inf"), float("-inf")
    scaler = torch.tensor([float(x[torch.isfinite(x)].abs().max())])
    for bound in (torch.tensor([float("inf")]), torch.tensor([2.0])):
        for seed in (0, 11):
            codes = cpu.ternarize_pack(x, scaler.item(), bound.item(), seed)
            same(codes, gpu.ternarize_pack(*on_device(x, scaler, bound), seed), f"bound {bound.item()}, seed {seed}")


@pytest.mark.parametrize(("mean", "spread"), [(1e3, 1.0), (0.0, 1e-24), (0.0, 1e20), (1e35, 1e34)])
def test_ternary_bound_holds_where_the_mean_is_far_above_the_spread(mean: float, spread: float) -> None:
    """sigma merged from the blocks' deviations (3 blocks), where E[x^2] - E[x]^2 in float32 would cancel, and
    scaled by their blocks' max, where their squares (and at 1e35 the blocks' sums) would leave float32's range."""
    x = mean + spread * gaussian(9000)
    bound, _ = gpu.ternary_statistics(*on_device(x), 2.5)
    assert bound.item() == pytest.approx(2.5 * x.double().std(correction=0).item(), rel=1e-5, abs=0)


@pytest.mark.parametrize("n", SIZES)
def test_decoding_sums_the_ranks_as_the_cpu_kernels(cpu: object, n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    for ranks in (1, 3):
        for bits in range(1, 9):
            for bucket in (8, 64, max(n, 8)):  # the last: one bucket for the whole tensor (the sign family)
                codes = torch.randint(0, 1 << bits, (ranks, n), generator=generator, dtype=torch.uint8)
                packed = torch.stack([pack_bits(c, bits) for c in codes])
                buckets = -(-n // bucket)
                levels = torch.randn(ranks, buckets, 1 << bits, generator=generator)
                scales = torch.randn(ranks, buckets, 1, generator=generator)
                grid = torch.randn(1 << bits, generator=generator)
                empty = torch.empty(0)
                same(cpu.decode_sum(packed, levels, empty, bits, bucket, n),
                     gpu.decode_sum(*on_device(packed, levels, empty), bits, bucket, n), f"levels, {bits} bits")
                same(cpu.decode_sum(packed, scales, grid, bits, bucket, n),
                     gpu.decode_sum(*on_device(packed, scales, grid), bits, bucket, n), f"grid, {bits} bits")
        ternary = torch.stack([pack_bits(c, 2) for c in
                               torch.randint(0, 3, (ranks, n), generator=generator, dtype=torch.uint8)])
        scales = torch.rand(ranks, 2, generator=generator)  # read at a stride, as gathered
        same(cpu.unpack_sum(ternary, scales[:, 0], n), gpu.unpack_sum(ternary.to(DEVICE), scales.to(DEVICE)[:, 0], n),
             "ternary sum")


@pytest.mark.parametrize("n", SIZES)
def test_the_vote_and_the_subtraction_equal_the_cpu_kernels(cpu: object, n: int) -> None:
    """signSGD's majority vote (ties on even ranks; scales at a stride, as gathered) and error feedback's update of
    the residual in place (one payload, with tables or a grid)."""
    generator = torch.Generator().manual_seed(n)
    for ranks in (1, 2, 3, 4):
        votes = torch.stack([pack_bits(c, 1) for c in torch.randint(0, 2, (ranks, n), generator=generator,
                                                                    dtype=torch.uint8)])
        scales = torch.rand(ranks, 2, generator=generator)
        same(cpu.sign_vote(votes, scales[:, 0], n), gpu.sign_vote(votes.to(DEVICE), scales.to(DEVICE)[:, 0], n), "vote")
    for bits in range(1, 9):
        bucket = 8 if bits % 2 else max(n, 8)
        codes = pack_bits(torch.randint(0, 1 << bits, (n,), generator=generator, dtype=torch.uint8), bits)[None]
        tables = torch.randn(1, -(-n // bucket), 1 << bits, generator=generator)
        for table, grid in [(tables, torch.empty(0)), (tables[:, :, :1].contiguous(), torch.randn(1 << bits))]:
            residual = torch.randn(n, generator=generator)
            expected = residual.clone()
            cpu.decode_subtract(expected, codes, table, grid, bits, bucket)
            residual = residual.to(DEVICE)
            gpu.decode_subtract(residual, *on_device(codes, table, grid), bits, bucket)
            same(expected, residual, f"subtracted, {bits} bits")


@pytest.mark.parametrize("average", [True, False])
def test_the_memory_update_equals_the_cpu_kernels(cpu: object, average: bool) -> None:
    """Momentum correction with error feedback's accumulation in one launch: u and the residual bit for bit as the
    CPU kernel's (Gaussian values: the multiply and the add round apart on both), u or the residual absent too."""
    generator = torch.Generator().manual_seed(9)
    g, u, residual = (torch.randn(3000, generator=generator) for _ in range(3))
    factor = 0.9 if average else 1 / (1 - 0.9)
    for keep_u, keep_residual in [(True, True), (True, False), *([] if average else [(False, True)])]:
        expected = [u.clone() if keep_u else None, residual.clone() if keep_residual else None]
        cpu.momentum_step(g, *expected, factor, average)
        got = [u.to(DEVICE) if keep_u else None, residual.to(DEVICE) if keep_residual else None]
        g_on_device = g.to(DEVICE)
        with no_sync():
            gpu.momentum_step(g_on_device, *got, factor, average)
        for name, want, have in zip(("u", "residual"), expected, got, strict=True):
            if want is not None:
                same(want, have, f"{name}, average={average}")


def test_gravac_agrees_on_norms_summed_in_two_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """GraVAC's agreed inputs, the squared norms of p, C_c(p) and C_min(p) then the step time: on the Triton kernels
    the sums of PyTorch's path (dyadic values: exact in any order) from a fill and two launches; a half-precision
    payload is summed in float32."""
    from hvdcomp.kernels.gpu import norms
    from hvdcomp.methods.gravac import agreed_inputs

    tensors = [dyadic(3000, 1), dyadic(2049, 2), dyadic(1, 3).half()]
    expected = agreed_inputs(tensors, 0.25)
    monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    moved = on_device(*tensors)
    with no_sync(), Operators() as count:
        got = agreed_inputs(moved, 0.25)
    same(expected, got, "agreed inputs")
    assert not {"aten.pow", "aten.sum", "aten.stack", "aten.cat"} & set(count.calls), count.calls  # Triton's two
    monkeypatch.setattr(norms, "_CHUNK", 16)  # 20 blocks: the finish kernel's loop takes two chunks
    tensors = [dyadic(20 * 1024 - 3, 4), torch.zeros(0), dyadic(5, 5)]
    got = torch.full((4,), -1.0, device=DEVICE)
    gpu.squared_norms(on_device(*tensors), got)
    same(torch.tensor([float(t.double().square().sum()) for t in tensors] + [-1.0]), got, "squared norms")
    with pytest.raises(ValueError, match="1 to 3 contiguous tensors"):
        gpu.squared_norms(on_device(*tensors, *tensors), torch.empty(6, device=DEVICE))


def test_decoding_reads_gathered_rows_in_place(cpu: object) -> None:
    """Rows of payloads at equal steps in one buffer (each rank's segment after the last, as gathered) decode as
    a strided view, as the CPU kernels decode them."""
    n, bits, bucket, ranks, step = 300, 3, 64, 3, 4 * 200
    generator = torch.Generator().manual_seed(1)
    buffer = torch.randint(0, 256, (ranks * step,), generator=generator, dtype=torch.uint8)
    packed = buffer.as_strided((ranks, -(-n * bits // 8)), (step, 1))
    tables = buffer.view(torch.float32).as_strided((ranks, -(-n // bucket), 1 << bits), (step // 4, 1 << bits, 1),
                                                    128 // 4)
    tables.copy_(torch.randn(tables.shape, generator=generator))  # finite levels where the codes were
    empty = torch.empty(0)
    packed_dev, tables_dev, empty_dev = (t.to(DEVICE) for t in (buffer, buffer.view(torch.float32), empty))
    got = gpu.decode_sum(packed_dev.as_strided(packed.shape, packed.stride()),
                         tables_dev.as_strided(tables.shape, tables.stride(), 128 // 4), empty_dev, bits, bucket, n)
    same(cpu.decode_sum(packed, tables, empty, bits, bucket, n), got, "gathered rows")
    same(cpu.decode_sum(packed.contiguous(), tables.contiguous(), empty, bits, bucket, n), got, "copied rows")
    ternary = buffer.as_strided((ranks, -(-n // 4)), (step, 1))
    scales = torch.rand(ranks, generator=generator)
    same(cpu.unpack_sum(ternary, scales, n),
         gpu.unpack_sum(packed_dev.as_strided(ternary.shape, ternary.stride()), scales.to(DEVICE), n), "ternary rows")


def test_randomk_draws_the_positions_of_the_cpu_kernels(cpu: object) -> None:
    for n, k in [(1, 1), (7, 3), (1037, 10), (1037, 1037), (100_000, 999)]:
        x = gaussian(n)
        for seed in (0, 5, (1 << 62) + 12345):  # seeds are 63-bit
            for scale in (False, True):
                values, indices = cpu.randomk_select(x, k, seed, scale)
                got = gpu.randomk_select(*on_device(x), k, seed, scale)
                same(values, got[0], f"random-k values, n {n}, k {k}")
                same(indices, got[1], f"random-k positions, n {n}, k {k}")


@pytest.mark.parametrize("case", ["gaussian", "ties", "zeros", "constant"])
def test_topk_selects_exactly_the_largest_magnitudes(case: str) -> None:
    """The radix select's k entries are the k largest magnitudes (torch.topk's), each once with its value, the
    entries tied with the k-th taken from the lowest indices; with a threshold, those not above it come last as 0.
    (A constant tensor: every entry of a block is equal to the k-th, the largest in-block count the compaction's
    packed scan holds.)"""
    generator = torch.Generator().manual_seed(3)
    for n, k in [(1, 1), (7, 3), (3000, 30), (4096, 4096), (5000, 50), (20_000, 200), (9000, 9000), (9000, 1),
                 (9000, 6000)]:
        x = torch.randint(-3, 4, (n,), generator=generator).float() if case == "ties" else gaussian(n, k)
        if case == "zeros":
            x[::2] = 0
        if case == "constant":
            x = torch.full((n,), -1.5)
        values, indices = (t.cpu() for t in gpu.topk(*on_device(x), k))
        expected = x.abs().topk(k).values
        assert torch.equal(values.abs().sort().values, expected.sort().values), (n, k)
        assert torch.equal(x[indices], values) and indices.unique().numel() == k, (n, k)
        tied = (x.abs() == expected.min()).nonzero().view(-1)
        taken = indices[values.abs() == expected.min()].sort().values
        assert torch.equal(taken, tied[:taken.numel()]), (n, k)
        x_dev, limit = on_device(x, torch.tensor([0.5]))
        values, indices = (t.cpu() for t in gpu.topk(x_dev, k, torch.int32, threshold=limit))
        above = x.abs() > 0.5
        kept = min(k, int(above.sum()))
        assert torch.equal(values[:kept].abs().sort().values, x.abs()[above].topk(kept).values.sort().values)
        assert not values[kept:].any() and indices.dtype == torch.int32


@pytest.mark.parametrize("case", ["gaussian", "ties"])
def test_topk_in_one_launch_equals_the_blocks(case: str) -> None:
    """A tensor of one block's entries takes the one-launch selection: the same entries in the same order as the
    selection across blocks, with and without a threshold."""
    from hvdcomp.kernels.gpu import select

    generator = torch.Generator().manual_seed(5)
    for n, k in [(1, 1), (7, 3), (1000, 10), (4096, 1), (4096, 4096)]:
        x = torch.randint(-3, 4, (n,), generator=generator).float() if case == "ties" else gaussian(n, k)
        for threshold in (None, torch.tensor([0.5])):
            x_dev, limit = on_device(x, threshold) if threshold is not None else (*on_device(x), None)
            blocks = select._select_blocks(x_dev, k, torch.empty(k, device=DEVICE),
                                           torch.empty(k, dtype=torch.int64, device=DEVICE), limit, None)
            for expected, got in zip(blocks, select.topk(x_dev, k, threshold=limit), strict=True):
                same(expected.cpu(), got, f"n {n}, k {k}, threshold {threshold}")


def test_topk_values_keep_a_float64_gradients_bits() -> None:
    """The keys are float32, the values the tensor's own: a float64 gradient's selected values are not rounded, in
    one launch or across blocks, with or without a threshold."""
    generator = torch.Generator().manual_seed(6)
    for n in (1000, 5000):
        x = torch.randn(n, generator=generator, dtype=torch.float64)
        for threshold in (None, torch.tensor([0.5])):
            x_dev, limit = on_device(x, threshold) if threshold is not None else (*on_device(x), None)
            values, indices = (t.cpu() for t in gpu.topk(x_dev, 10, threshold=limit))
            assert values.dtype == torch.float64 and torch.equal(values, x[indices]), (n, threshold)


#: the gatherings tested: (the bound: the sample's or a threshold (its value), k, the plan if not topk's, the case:
#: candidates from k to the capacity, more, fewer)
GATHERINGS = {
    "sample": ("sample", 100, None, "within"),
    "sample, 2 blocks of candidates": ("sample", 4500, (1024, 10_000), "within"),
    "sample, ties": ("sample", 100, None, "more"),
    "sample's largest": ("sample", 100, "rank 1", "fewer"),
    "threshold": (2.7, 100, None, "within"),
    "threshold, exactly k above": ("k-th", 100, None, "within"),
    "threshold, low": (0.5, 100, None, "more"),
    "threshold, high": (2.9, 100, None, "fewer"),
    "threshold, high, filled over 2 blocks": (2.9, 5000, (0, 10_000), "fewer"),
}


@pytest.mark.parametrize("name", GATHERINGS)
def test_topk_over_gathered_candidates_equals_the_whole_tensor(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the candidates gathered at the sample's bound, or above the threshold, the selection takes the same
    entries in the same order as over the whole tensor. Where the sample misleads (more candidates than the capacity:
    ties; fewer than k: a bound from the sample's largest), it reads the whole tensor instead; under a threshold with
    fewer than k above it, it places the candidates and then the first entries not above it. The candidates are
    checked against the bound computed here, and which way the selection went by running it on zeros (or, where it
    fills, on the candidates reversed); :func:`topk` gathers from ``_GATHER_MIN`` entries on, where its plan does."""
    from hvdcomp.kernels.gpu import select

    bound, k, plan, case = GATHERINGS[name]
    n = 20_000
    x = torch.randint(-3, 4, (n,)).float() if name == "sample, ties" else gaussian(n, 7)
    threshold = None
    if bound == "k-th":  # halfway between the k-th and the next magnitude
        magnitudes = x.abs().sort(descending=True).values
        threshold = (magnitudes[k - 1:k] + magnitudes[k:k + 1]) / 2
    elif bound != "sample":
        threshold = torch.tensor([bound])
    default = select._gathering(n, k, threshold is not None)
    rank, capacity = default if plan is None or plan == "rank 1" else plan
    if threshold is not None:
        candidate = x.abs() > threshold
    else:
        rank = 1 if plan == "rank 1" else rank
        i = torch.arange(select._SAMPLE)
        stride = n // select._SAMPLE
        sample = x.abs()[i * stride + (i * 2654435761) % stride]
        candidate = x.abs() >= sample.topk(rank).values[-1]
    total = int(candidate.sum())
    assert {"within": k <= total <= capacity, "more": total > capacity, "fewer": total < k}[case], total
    x_dev, limit = on_device(x, threshold) if threshold is not None else (*on_device(x), None)

    def select_with(data: torch.Tensor, gathered: object) -> list[torch.Tensor]:
        outputs = torch.empty(k, device=DEVICE), torch.empty(k, dtype=torch.int64, device=DEVICE)
        return [t.cpu() for t in select._select_blocks(data, k, *outputs, limit, gathered)]

    gathered = select._gather(x_dev, k, limit, (rank, capacity))
    whole = select_with(x_dev, None)
    for expected, got in zip(whole, select_with(x_dev, gathered), strict=True):
        same(expected, got, name)
    assert int(gathered.found[-1]) == total
    if case != "more":
        assert torch.equal(gathered.index[:total].cpu(), candidate.nonzero().view(-1))
    if case == "fewer" and threshold is not None:  # the candidates as gathered (here reversed), then x's first
        gathered.index[:total] = gathered.index[:total].flip(0)  # entries not above the threshold
        values, indices = select_with(x_dev, gathered)
        order = torch.cat([candidate.nonzero().view(-1).flip(0), (~candidate).nonzero().view(-1)[:k - total]])
        assert torch.equal(indices, order) and torch.equal(values, torch.where(candidate, x, 0)[order])
    else:
        values, indices = select_with(torch.zeros_like(x_dev), gathered)
        if case == "within":  # the top k of the candidates, whatever x now holds
            assert torch.equal(indices.sort().values, x.abs().topk(k).indices.sort().values)
        else:  # the whole tensor: all zeros, the first k taken
            assert torch.equal(indices, torch.arange(k))
        assert not values.any()
    monkeypatch.setattr(select, "_GATHER_MIN", n)  # topk gathers from n entries on
    plans, gather = [], select._gather
    monkeypatch.setattr(select, "_gather", lambda *args: plans.append(args[3]) or gather(*args))
    for expected, got in zip(whole, select.topk(x_dev, k, threshold=limit), strict=True):
        same(expected, got, f"{name}: topk")
    assert plans == ([default] if default else [])


#: the selections run at each count of programs: (k, the threshold's value or None, the gathering's plan or None,
#: the case: no gathering, candidates from k to the capacity, more, fewer)
PROGRAM_CASES = {
    "whole tensor": (100, None, None, "whole"),
    "whole tensor, threshold": (100, 0.5, None, "whole"),
    "candidates": (4500, None, (1024, 10_000), "within"),
    "more candidates than the capacity": (100, None, (100, 300), "more"),
    "threshold, filled over 2 blocks": (5000, 2.9, (0, 10_000), "fewer"),
}


@pytest.mark.parametrize("name", PROGRAM_CASES)
def test_the_selection_does_not_depend_on_how_many_programs_share_the_blocks(name: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The digit passes, the counts and the compaction loop over the blocks with a fixed number of programs (4 an SM
    on a GPU): with 1, 2 or 3 programs over 5 blocks, each taking every so-many-th block, they select the same
    entries in the same order as with a program a block, over the whole tensor and over gathered candidates, where
    the sample misled, and where threshold fills past its candidates."""
    from hvdcomp.kernels.gpu import select

    k, threshold, plan, case = PROGRAM_CASES[name]
    n = 20_000
    x = gaussian(n, 11)
    x_dev, limit = on_device(x, torch.tensor([threshold])) if threshold is not None else (*on_device(x), None)
    gathered = select._gather(x_dev, k, limit, plan) if plan else None
    if gathered is not None:
        total = int(gathered.found[-1])
        assert {"within": k <= total <= plan[1], "more": total > plan[1], "fewer": total < k}[case], total
    results = {}
    for programs in (1, 2, 3, 5):
        monkeypatch.setattr(select, "_programs", lambda device, blocks, programs=programs: min(blocks, programs))
        outputs = torch.empty(k, device=DEVICE), torch.empty(k, dtype=torch.int64, device=DEVICE)
        results[programs] = [t.cpu() for t in select._select_blocks(x_dev, k, *outputs, limit, gathered)]
    for programs in (1, 2, 3):
        for expected, got in zip(results[5], results[programs], strict=True):
            same(expected, got, f"{name}, {programs} programs")


def test_threshold_fit_on_the_device_equals_the_cpu_fit(cpu: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threshold's whole fit on the device gives the fit of the CPU kernels to float rounding, from one block to
    several; each of its ways (one program, a launch a stage, two a stage) gives the same bits."""
    from hvdcomp.kernels.gpu import select
    from hvdcomp.methods.threshold import fitted_threshold

    ways = {}
    for n in (1, 1000, 20_000):
        x = gaussian(n, n)
        for density in (0.1, 0.01):
            stages = math.ceil(math.log10(1 / density)) + 1  # the method's (hvdcomp.methods.threshold)
            for way in ("one program", "a launch a stage", "two a stage"):
                monkeypatch.setattr(select, "_fit_way", lambda blocks, way=way: way)
                ways[way] = gpu.threshold_fit(*on_device(x), stages, math.log(1 / density) / stages)
            torch.testing.assert_close(ways["two a stage"].cpu(), fitted_threshold(x, density), rtol=1e-5, atol=0)
            for way in ("one program", "a launch a stage"):
                if n <= 4096 or way != "one program":  # one program reads one block
                    same(ways["two a stage"].cpu(), ways[way], f"{way}, {n} entries, density {density}")
    monkeypatch.undo()
    assert [select._fit_way(blocks) for blocks in (1, 2, 1024, 1025)] == [
        "one program", "a launch a stage", "a launch a stage", "two a stage"]
    assert gpu.threshold_fit(*on_device(gaussian(9000)), 0, 1.0).item() == 0, "no stage: t = 0"


def test_threshold_fit_passes_equal_the_cpu_kernels(cpu: object) -> None:
    """One stage of threshold's fit: the excess of |x| over t and the count above t, as the CPU kernel sums them
    (exactly, on dyadic values)."""
    for n in (1, 7, 5000, 20_000):
        x = dyadic(n, n)
        for t in (0.0, 0.25, 0.875, 2.0):
            limit = torch.tensor([t])
            same(cpu.excess_moments(x, limit), gpu.excess_moments(*on_device(x, limit)), f"n {n}, t {t}")


@pytest.mark.parametrize("method", ["topk", "threshold", "dgc"])
def test_sparsifiers_on_the_triton_selection_decode_as_on_the_cpu(method: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The sparsifiers send the same entries through the Triton selection (on CUDA without a host sync): the
    decoded sum over 3 ranks and one decoded payload equal the CPU path's, whose payloads leave out the zeros, where
    CUDA's hold a fixed count, int32 indices as the selection wrote them (also where most entries are zero)."""
    options = {"topk": {"ratio": 0.05}, "threshold": {"density": 0.05}, "dgc": {"density": 0.05,
                                                                             "warmup_steps": 1}}[method]
    for zeros in (0.0, 0.97):
        grads = [gaussian(3 * 700, seed).mul_(torch.rand(3 * 700) >= zeros).view(3, 700) for seed in range(3)]
        reference = _through_method(method, grads, options)
        with monkeypatch.context() as patched:
            if not CUDA:
                patched.setenv("HVDCOMP_KERNELS", "triton")
            moved = on_device(*grads)
            with no_sync():
                results = _through_method(method, moved, options)
        for expected, got in zip(reference[-2:], results[-2:], strict=True):
            same(expected, got, f"{method}, {zeros:.0%} zeros")
        values = results[0:-2:2]
        assert len({part.numel() for part in values}) == 1, [part.numel() for part in values]
        assert {part.dtype for part in results[1:-2:2]} == {torch.int32}
        if zeros:  # the CPU path sent fewer: its payloads leave out the zeros that CUDA's carry
            assert sum(part.numel() for part in reference[0:-2:2]) < sum(part.numel() for part in values)
    payloads = [results[i:i + 2] for i in range(0, len(results) - 2, 2)]
    compressor = make_compressor(method, options)
    meta = (torch.Size([3, 700]), 3 * 700, torch.float32)
    with monkeypatch.context() as patched:
        if not CUDA:
            patched.setenv("HVDCOMP_KERNELS", "triton")
        with Operators() as count:  # decoding and the memory's subtraction take the int32 indices as they are
            compressor.unwrapped().aggregate(payloads, meta)
            compressor.unwrapped().subtract(torch.zeros(3 * 700, device=DEVICE), payloads[0], meta)
    assert "aten._to_copy" not in count.calls, count.calls


@pytest.mark.parametrize("method", ["topk", "threshold", "dgc"])
def test_sparsifiers_are_gathered_without_sizes_on_cudas_path(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA's path a sparsifier's payloads hold the same count on every rank (the selection's k, or threshold's
    capacity), so the allgather gathers no sizes, which finishing would read on the host; the CPU path leaves out
    the zeros and gathers its sizes."""
    from hvdcomp import reductions
    from hvdcomp.requests import Agree, Allgather

    options = {"topk": {"ratio": 0.05}, "threshold": {"density": 0.05}, "dgc": {"density": 0.05}}[method]
    for cuda_path in (False, True):
        with monkeypatch.context() as patched:
            if cuda_path and not CUDA:
                patched.setenv("HVDCOMP_KERNELS", "triton")
            (x,) = on_device(gaussian(3 * 700, 0)) if cuda_path else [gaussian(3 * 700, 0)]
            reduction = reductions.make("allgather", make_compressor(method, options))
            ctx = Context("w", 0, 3, x.device, 1, 2)
            steps = reduction.reduce(x, reduction.init_state(x, ctx), ctx)
            request = next(steps)
            while isinstance(request, Agree):
                request = steps.send(request.values)
            assert isinstance(request, Allgather) and request.fixed_size == cuda_path, (cuda_path, request)
            # the sketch method's payloads are the rows each rank has: their sizes travel on every path
            assert not make_compressor("sketch").fixed_size_on(x.device)


@pytest.mark.parametrize(("shape", "epsilon"), [((50, 1), 0.0), ((1500, 2), 0.0), ((4, 70, 2), 0.0),
                                              ((4, 1500, 2), 1e-8), ((2, 50, 1), 0.0), ((70, 2), 1e-8),
                                              ((0, 2), 0.0)])
def test_orthogonalization_equals_pytorch_gram_schmidt(shape: tuple[int, ...], epsilon: float) -> None:
    """PowerSGD's orthogonalization in one launch (n over a block of rows too, batches) gives PyTorch's Gram-Schmidt to
    float rounding, a zero column replaced by its spare signs on both (the first, the second, both)."""
    from hvdcomp.methods.powersgd import gram_schmidt

    matrix = gaussian(math.prod(shape), seed=len(shape)).view(shape)
    if len(shape) == 3:
        matrix[1, :, 0] = 0
        matrix[-1] = 0
        if shape[-1] == 2:
            matrix[2, :, 1] = 0
    expected = gram_schmidt(matrix.clone(), epsilon)
    if len(shape) == 3:
        assert expected.abs().amax(-2).min() > 0, "a column stayed zero"
    got = gpu.orthogonalize(matrix.clone().to(DEVICE), epsilon)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-6)


def test_orthogonalization_of_nearly_parallel_columns_is_orthonormal() -> None:
    """Where column 1 lies along column 0 to float rounding (or to noise 1e-6 of it), projected out twice, as on the
    PyTorch path: orthonormal columns, not normalized rounding."""
    got = gpu.orthogonalize(nearly_parallel().to(DEVICE)).cpu()
    torch.testing.assert_close(got.transpose(-2, -1) @ got, torch.eye(2).expand(50, 2, 2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rank", [1, 2])
def test_orthogonalization_of_matrices_side_by_side_equals_each_alone(rank: int) -> None:
    """A bucket's Ps (or Qs) side by side in one buffer, of different numbers of rows (one of them over a block of
    rows, one empty, two with a zero column), orthonormalized in one launch: each as PyTorch's Gram-Schmidt alone."""
    from hvdcomp.methods.powersgd import gram_schmidt

    rows = [7, 1500, 0, 64, 3]
    flat = gaussian(sum(rows) * rank, seed=rank)
    parts = list(flat.split([n * rank for n in rows]))
    parts[3].view(64, rank)[:, 0] = 0
    parts[0].view(7, rank)[:, rank - 1] = 0
    expected = [gram_schmidt(part.clone().view(n, rank)) for part, n in zip(parts, rows, strict=True)]
    got = gpu.orthogonalize_parts(flat.clone().to(DEVICE), rows, rank).cpu()
    for part, n, want in zip(got.split([n * rank for n in rows]), rows, expected, strict=True):
        torch.testing.assert_close(part.view(n, rank), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do not cover"):
        gpu.orthogonalize_parts(flat.to(DEVICE), rows[:-1], rank)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_products_of_several_matrices_in_one_launch_equal_pytorchs(rank: int) -> None:
    """PowerSGD's products of a bucket's matrices, one launch each (shapes over a tile's rows and columns, a single
    row, a single column): M Q, M^T P and P Q^T as PyTorch's matmul to float rounding, and the residual's update
    M + s P Q^T in the same launch, written into each matrix where it lies."""
    shapes = [(7, 100), (40, 3), (1, 5), (65, 130), (33, 1)]
    matrices = [gaussian(n * m, seed).view(n, m) for seed, (n, m) in enumerate(shapes)]
    qs = [gaussian(m * rank, 10 + seed).view(m, rank) for seed, (_, m) in enumerate(shapes)]
    ps = [gaussian(n * rank, 20 + seed).view(n, rank) for seed, (n, _) in enumerate(shapes)]
    q_flat, p_flat = (torch.cat([f.reshape(-1) for f in factors]) for factors in (qs, ps))
    on = on_device(*matrices)
    for got, want in ((gpu.products(on, q_flat.to(DEVICE), rank), [m @ q for m, q in zip(matrices, qs, strict=True)]),
                      (gpu.products(on, p_flat.to(DEVICE), rank, transpose=True),
                       [m.t() @ p for m, p in zip(matrices, ps, strict=True)])):
        torch.testing.assert_close(got.cpu(), torch.cat([w.reshape(-1) for w in want]), rtol=1e-5, atol=1e-5)
    approximations = [p @ q.t() for p, q in zip(ps, qs, strict=True)]
    residuals = [m - 0.5 * a for m, a in zip(matrices, approximations, strict=True)]  # (on CPU, on is matrices)
    got = gpu.approximations(on, p_flat.to(DEVICE), q_flat.to(DEVICE), rank, residual_scale=-0.5)
    torch.testing.assert_close(got.cpu(), torch.cat([a.reshape(-1) for a in approximations]), rtol=1e-5, atol=1e-5)
    for updated, residual in zip(on, residuals, strict=True):
        torch.testing.assert_close(updated.cpu(), residual, rtol=1e-5, atol=1e-5)
    kept = [m.clone() for m in on]
    gpu.approximations(on, p_flat.to(DEVICE), q_flat.to(DEVICE), rank)
    assert all(torch.equal(a, b) for a, b in zip(on, kept, strict=True)), "no residual_scale: the matrices unchanged"
    with pytest.raises(ValueError, match="hold 5 elements, got 3"):
        gpu.products(on[2:3], torch.zeros(3, device=DEVICE), 1)
    with pytest.raises(ValueError, match="not contiguous"):
        gpu.products([on[0].t()], torch.zeros(7 * rank, device=DEVICE), rank)


@pytest.mark.parametrize(("error_feedback", "rank"), [(True, 2), (False, 2), (True, 3)])
def test_powersgd_bucket_in_a_launch_a_product_equals_its_cpu_path(error_feedback: bool, rank: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A PowerSGD bucket of matrices of one rank (2: Gram-Schmidt; 3: QR), of several shapes (two of one shape, as a
    batch with ``batch_tensors_with_same_shape``): the Triton path takes each product of the bucket in one launch, with
    no host sync on CUDA, and leaves the gradients as they were; its sums, next Qs and residuals equal the CPU path's
    to float rounding, three steps running. A matrix with a side past ``MAX_PRODUCT_SIDE`` is refused by name."""
    from hvdcomp.methods.powersgd import PowerSGD, PowerSGDReduction

    def steps(grads: list[torch.Tensor], batch: bool) -> list[torch.Tensor]:
        reduction = PowerSGDReduction(PowerSGD(rank=rank, start_iter=0, error_feedback=error_feedback,
                                               batch_tensors_with_same_shape=batch))
        ctx = Context.local(grads[0], seed=4, name="bucket")
        state = reduction.init_bucket_state(grads, ctx)  # (its Qs drawn on the host: set-up, which synchronizes)
        kept = [grad.clone() for grad in grads]
        results = []
        with no_sync():
            for step in range(3):
                results += run_one_rank(reduction.reduce_bucket(
                    grads, state, Context.local(grads[0], seed=4, name="bucket", step=step)))
        assert all(torch.equal(grad, same) for grad, same in zip(grads, kept, strict=True)), "a gradient was written"
        return [*results, *(member[key] for member in state[MEMBERS] for key in sorted(member))]

    grads = [gaussian(50 * 40, 1).view(50, 40), gaussian(30 * 20, 2).view(30, 20), gaussian(96 * 70, 3).view(96, 70),
             gaussian(30 * 20, 4).view(30, 20), gaussian(8 * 3 * 3 * 3, 5).view(8, 3, 3, 3)]
    launches = []
    products = gpu.products
    monkeypatch.setattr(gpu, "products", lambda matrices, *args, **kwargs: launches.append(len(matrices)) or
                        products(matrices, *args, **kwargs))
    for batch in (False, True):
        monkeypatch.delenv("HVDCOMP_KERNELS", raising=False)
        reference = steps(grads, batch)
        if not CUDA:
            monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
        launches.clear()
        for expected, got in zip(reference, steps(on_device(*grads), batch), strict=True):
            torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)
        assert launches == [5] * 6, "each step's two products: one launch each for the bucket's 5 matrices"
    tall = torch.zeros(gpu.MAX_PRODUCT_SIDE + 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {gpu.MAX_PRODUCT_SIDE} rows and columns"):
        gpu.products([tall], torch.zeros(rank, device=DEVICE), rank)


@pytest.mark.parametrize("k", [1, 100, 5000])
def test_lgc_guard_projection_equals_its_pytorch_path(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """LGC's guard in one launch each: S x with the PyTorch path's signs (sums of ones, exact, equal), the same sums
    of Gaussian values and the same error to float rounding; the largest key, whose key + i reaches 2^62 + k."""
    from hvdcomp.methods.lgc import GUARD_BUCKETS, Projection

    monkeypatch.delenv("HVDCOMP_KERNELS", raising=False)  # Projection on CPU tensors: the PyTorch path
    for key in (7, 2**62 - 1):
        projection = Projection(key)
        ones = torch.ones(k)
        assert torch.equal(gpu.projection(ones.to(DEVICE), key, GUARD_BUCKETS).cpu(), projection(ones))
        x, reconstructed = gaussian(k, seed=1), gaussian(k, seed=2)
        exact = projection(x)
        torch.testing.assert_close(gpu.projection(x.to(DEVICE), key, GUARD_BUCKETS).cpu(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gpu.projection_error(exact.to(DEVICE), reconstructed.to(DEVICE), key).cpu(),
                                   projection.error(exact, reconstructed), rtol=1e-5, atol=1e-5)


def test_powersgd_on_the_triton_kernels_equals_its_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """PowerSGD's step on CUDA (or with ``HVDCOMP_KERNELS=triton``), per matrix and in a batch of one shape, gives
    its CPU path's sums and next Q to float rounding."""
    from hvdcomp.methods.powersgd import PowerSGD, PowerSGDReduction

    def step(grads: list[torch.Tensor], sync_free: bool = False) -> list[torch.Tensor]:
        """Both ways' reductions; with ``sync_free``, under no_sync from the first reduction on (the states' Q are
        drawn on the host, then copied to the device: set-up, which synchronizes)."""
        reduction = PowerSGDReduction(PowerSGD(start_iter=0, batch_tensors_with_same_shape=True))
        contexts = [Context.local(grads[0], seed=2, name=f"w{i}") for i in range(3)]
        states = [reduction.init_state(grad, ctx) for grad, ctx in zip(grads, contexts, strict=True)]
        results = []
        with no_sync() if sync_free else nullcontext():
            for steps in (reduction.reduce(grads[0].clone(), states[0], contexts[0]),
                          reduction.reduce_batch([grad.clone() for grad in grads[1:]], states[1:], contexts[1:])):
                request = next(steps)
                try:
                    while True:
                        request = steps.send(request.tensors)
                except StopIteration as done:
                    results += [done.value] if isinstance(done.value, torch.Tensor) else done.value
        return [*results, *(state["q"] for state in states)]

    grads = [gaussian(40 * 30, seed).view(40, 30) for seed in range(3)]
    reference = step(grads)
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    results = step(on_device(*grads), sync_free=True)
    for expected, got in zip(reference, results, strict=True):
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)


def test_powersgd_bucket_of_mixed_shapes_and_ranks_on_the_triton_kernels_equals_its_cpu_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A PowerSGD bucket whose Ps and Qs lie side by side in one buffer each: matrices of different shapes, one of
    rank 1 (a single row, which ``min_compression_rate`` < 1 compresses), so not all orthonormalized in one launch;
    the Triton path's sums and next Qs equal the CPU path's to float rounding, two steps running."""
    from hvdcomp.methods.powersgd import PowerSGD, PowerSGDReduction

    def steps(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        reduction = PowerSGDReduction(PowerSGD(start_iter=0, min_compression_rate=0.5))
        ctx = Context.local(grads[0], seed=3, name="bucket")
        state = reduction.init_bucket_state(grads, ctx)
        results = []
        for step in range(2):
            results += run_one_rank(reduction.reduce_bucket([g.clone() for g in grads], state,
                                                            Context.local(grads[0], seed=3, name="bucket", step=step)))
        return [*results, *(member["q"] for member in state[MEMBERS])]

    grads = [gaussian(100, 0).view(1, 100), gaussian(50 * 40, 1).view(50, 40), gaussian(30 * 20, 2).view(30, 20)]
    reference = steps(grads)
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    for expected, got in zip(reference, steps(on_device(*grads)), strict=True):
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)


def test_bad_arguments_are_refused_with_their_name() -> None:
    x = torch.zeros(64, device=DEVICE)
    with pytest.raises(ValueError, match="bucket must be a positive multiple of 8"):
        gpu.quantize_levels(x, 12, 2, 1, 0, 1, 0)
    with pytest.raises(ValueError, match="fit a program's registers"):
        gpu.quantize_binary(x, gpu.MAX_BUCKET * 2, 0, 4)
    with pytest.raises(ValueError, match="QSGD: 2 to 8"):
        gpu.quantize_levels(x, 64, 1, 1, 0, 1, 0)
    with pytest.raises(ValueError, match=r"k must be in \[1, n\] = \[1, 64\]"):
        gpu.randomk_select(x, 65, 0, False)
    with pytest.raises(ValueError, match=r"k must be in \[0, n\] = \[0, 64\]"):
        gpu.topk(x, 65)
    with pytest.raises(ValueError, match="subtracts one payload from a float32 contiguous residual, got 2"):
        gpu.decode_subtract(x, torch.zeros(2, 8, dtype=torch.uint8, device=DEVICE), torch.zeros(2, 1, 1, device=DEVICE),
                            torch.zeros(2, device=DEVICE), 1, 64)
    with pytest.raises(ValueError, match="indices must be a contiguous 1-D int32 or int64 tensor"):
        gpu.release([x], torch.zeros(4, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="u needed to average"):
        gpu.momentum_step(x, None, x.clone(), 0.9, True)
    with pytest.raises(ValueError, match="do not hold 64 signs"):
        gpu.sign_vote(torch.zeros(1, 7, dtype=torch.uint8, device=DEVICE), torch.ones(1, device=DEVICE), 64)
    with pytest.raises(ValueError, match="do not hold 64 elements"):
        gpu.decode_sum(torch.zeros(1, 7, dtype=torch.uint8, device=DEVICE), torch.zeros(1, 1, 4, device=DEVICE),
                       torch.empty(0, device=DEVICE), 1, 64, 64)


def _through_method(method: str, grads: list[torch.Tensor], options: dict,
                    error_feedback: bool = False) -> list[torch.Tensor]:
    """Every rank's payload of one step, then the decoded sum and one rank's decoded payload; with
    ``error_feedback``, each rank's residual after its step (each rank a state of its own, as in training)."""
    compressor = make_compressor(method, options, error_feedback=error_feedback)
    ctx = replace(Context.local(grads[0], seed=3), step=1)
    shared = compressor.init_state(grads[0], ctx)
    payloads, residuals = [], []
    for grad in grads:
        state = compressor.init_state(grad, ctx) if error_feedback else shared
        compressor.agree(grad, state, ctx)  # TernGrad keeps its statistics for compress()
        payload, meta = compressor.compress(grad, state, ctx)
        payloads.append(payload)
        residuals.extend([state["residual"]] if error_feedback else [])
    return [*(part for payload in payloads for part in payload), compressor.aggregate(payloads, meta),
            compressor.decompress(payloads[0], meta), *residuals]


@pytest.mark.parametrize("method", METHODS)
def test_methods_on_the_triton_kernels_equal_the_cpu_kernels(cpu: object, method: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A method's payloads, its decoded sum over 3 ranks and one decoded payload, through the Triton kernels (on
    CUDA without a host sync), are those of the CPU kernels."""
    # (the sign family's momentum, on by default, would scale the dyadic inputs by 0.9: sums no longer exact)
    options = {"qsgd": {"bits": 3}, "orq": {"bits": 3}, "signsgd": {"momentum": 0},
               "efsignsgd": {"momentum": 0}}.get(method, {})
    grads = [dyadic(3 * 700, seed).view(3, 700) for seed in range(3)]
    error_feedback = method in ("efsignsgd", "onebit", "bingrad")  # their residual's update is a kernel's too
    reference = _through_method(method, grads, options, error_feedback)
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    moved = [grad.to(DEVICE) for grad in grads]
    with no_sync():
        results = _through_method(method, moved, options, error_feedback)
    for index, (expected, got) in enumerate(zip(reference, results, strict=True)):
        same(expected, got, f"{method}, output {index}")


@pytest.mark.parametrize("method", ["signsgd", "efsignsgd", "onebit", "bingrad"])
def test_sign_scales_and_binary_levels_beyond_float32_sums_equal_the_cpu_kernels(cpu: object, method: str,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient up to 1e38, whose float32 sums overflow (tests/test_quantizers.py checks what the CPU kernels keep
    of it): the Triton kernels sum x scaled by a power of two where the CPU kernels sum in float64, so their scale or
    levels, the decoded gradient and the residual of error feedback (x minus the decoded: to the rounding of either)
    are the CPU kernels' to float32 rounding."""
    x = huge_gradient()
    compressor = make_compressor(method, {"momentum": 0} if "sign" in method else {})

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        ctx = Context.local(x)
        state = compressor.init_state(x, ctx)
        payload, meta = compressor.compress(x.clone(), state, ctx)
        return [payload[0], compressor.decompress(payload, meta), *([state["residual"]] if "residual" in state else [])]

    reference = run(x)
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    for index, (expected, got) in enumerate(zip(reference, run(x.to(DEVICE)), strict=True)):
        scale = torch.maximum(x.abs(), reference[1].abs()) if index == 2 else expected.abs()
        assert torch.isfinite(got).all() and ((got.cpu() - expected).abs() <= 1e-6 * scale).all(), \
            f"{method}, output {index}: {got.cpu()} against the CPU kernels' {expected}"


@pytest.mark.parametrize(("method", "values"), [
    ("onebit", [2.0**127, -1e-30, 1, 1, 1, 1, 1, 1]),  # -1e-30 under float32's normal range once scaled
    ("onebit", [2.0**64, -2.0**-149, 1, 1, 1, 1, 1, 1]),
    ("bingrad", [2.0**127, 2.0**127, 1.5 * 2.0**127, 1.5 * 2.0**127] * 2)])  # its levels' sum overflows
def test_binary_codes_of_scaled_buckets_equal_the_cpu_kernels(cpu: object, method: str, values: list[float],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Buckets the binary kernel takes in scaled units (max |x| 2^64 or more): its codes are the CPU kernels' (a value
    too small to scale keeps its sign) and its levels theirs to 1e-6 of the bucket's max."""
    x = torch.tensor(values)
    compressor = make_compressor(method, {"bucket_size": 8}, error_feedback=False)
    expected = compressor.compress(x, {}, Context.local(x))[0]
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    moved = x.to(DEVICE)
    levels, codes = compressor.compress(moved, {}, Context.local(moved))[0]
    same(expected[1], codes, f"{method}, codes")
    assert ((levels.cpu() - expected[0]).abs() <= 1e-6 * x.abs().max()).all(), (levels, expected[0])


@pytest.mark.parametrize("method", ["onebit", "bingrad"])
def test_binary_levels_of_subnormal_values_equal_the_cpu_kernels(cpu: object, method: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket the binary kernel takes as it is (max |x| under 2^64) keeps its subnormal values: its codes and
    levels are the CPU kernels' bits."""
    x = torch.tensor([1e-39, -2e-39, -3e-40, 4e-39, 2.0**-149, -(2.0**-149), 0.0, 1e-39])
    compressor = make_compressor(method, {"bucket_size": 8}, error_feedback=False)
    expected = compressor.compress(x, {}, Context.local(x))[0]
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    moved = x.to(DEVICE)
    for index, got in enumerate(compressor.compress(moved, {}, Context.local(moved))[0]):
        same(expected[index], got, f"{method}, output {index}")


def test_each_kernel_runs_on_its_tensors_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every function of the Triton kernels' interface switches the current CUDA device (where Triton launches) to
    its first tensor's GPU for its run, and only where that is another: tensors on GPU 1 with GPU 0 current (a model
    split across GPUs), a list of tensors first. (The devices stood in for: these machines have one GPU each.)"""
    events: list[object] = []

    @contextmanager
    def device(index: int) -> Iterator[None]:
        events.append(("switch to", index))
        yield
        events.append("back")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)

    class OnGpu1(torch.Tensor):
        def get_device(self) -> int:
            return 1

    class OnGpu0(torch.Tensor):
        def get_device(self) -> int:
            return 0

    run = gpu._on_their_device(lambda *args, **kwargs: events.append("run"))
    on_0, on_1, on_cpu = torch.zeros(1).as_subclass(OnGpu0), torch.zeros(1).as_subclass(OnGpu1), torch.zeros(1)
    for args in ((on_0, on_1), (on_cpu, on_1), (on_1, on_0), ([on_1], on_1)):
        run(*args, seed=0)
    assert events == ["run", "run", ("switch to", 1), "run", "back", ("switch to", 1), "run", "back"], events
    interface = [name for name in gpu.__all__ if callable(getattr(gpu, name))]
    assert len(interface) > 25 and all(getattr(gpu, name).__wrapped__ for name in interface), interface


def test_larger_buckets_than_registers_hold_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    x = dyadic(3 * gpu.MAX_BUCKET).to(DEVICE)
    compressor = make_compressor("qsgd", {"bucket_size": 2 * gpu.MAX_BUCKET, "norm": "l2"}, error_feedback=False)
    payload, meta = compressor.compress(x, {}, Context.local(x))
    assert compressor.fused_kernels(x) is None
    torch.testing.assert_close(payload[0].cpu(), torch.stack([x[:2 * gpu.MAX_BUCKET].norm(),
                                                             x[2 * gpu.MAX_BUCKET:].norm()]).view(2, 1).cpu())
    assert compressor.decompress(payload, meta).shape == x.shape


def _two_core(found: torch.Tensor, seed: int, c3: int) -> torch.Tensor:
    """Which candidates are in the 2-core of their hypergraph (left once every candidate alone in a cell has left,
    all at once, round after round): the set peeling in any order cannot resolve."""
    from hvdcomp.methods import sketch

    cells, _ = sketch.cells_of(found, seed, c3)
    left = torch.ones(found.numel(), dtype=torch.bool)
    while True:
        covered = torch.bincount(cells[left].view(-1), minlength=3 * c3)
        alone = left & (covered[cells] == 1).any(1)
        if not alone.any():
            return left
        left &= ~alone


def test_sketch_candidates_equal_the_cpu_kernels(cpu: object) -> None:
    """The items that pass a Bloom filter (of a support; empty; full), for 63-bit seeds of either sign, are the CPU
    scan's."""
    from hvdcomp.methods import sketch

    generator = torch.Generator().manual_seed(0)
    for items, members, bits, hashes, seed in [(0, 0, 64, 1, 3), (1, 1, 64, 1, 3), (3000, 100, 640, 4, 5),
                                               (3000, 300, 1024, 7, -(2**62)), (5000, 2000, 2560, 2, 2**62 + 1)]:
        support = torch.randperm(max(items, 1), generator=generator)[:members]
        packed = sketch.bloom(support, seed, bits, hashes)
        for packed_filter in (packed, torch.zeros_like(packed), torch.full_like(packed, 255)):  # some, none, all
            expected = cpu.sketch_candidates(packed_filter, items, seed, hashes)
            got = gpu.sketch_candidates(*on_device(packed_filter), items, seed, hashes)
            same(expected, got, f"candidates, {items} items, {hashes} hashes")


def test_sketch_encoding_adds_each_cell_in_item_order() -> None:
    """Each cell's float64 sum in item order, as ``index_add_`` adds it on the CPU, to the last bit. Sums of float32
    values are exact in float64 (in any order); those of float64 values round, so another order would differ
    (checked on the CPU)."""
    from hvdcomp.methods import sketch

    generator = torch.Generator().manual_seed(1)
    for k, width, c3 in [(0, 3, 5), (1, 1, 1), (700, 1, 7), (300, 3, 40), (200, 33, 9)]:
        items = torch.randperm(50_000, generator=generator)[:k]
        values = torch.randn(k, width, generator=generator, dtype=torch.float64)
        for dtype in (torch.float32, torch.float64):
            for rows, index in ((values.float(), items), (values, items.int())):
                expected = sketch.encode(rows, index, 9, c3, dtype)
                moved = on_device(rows, index)
                with no_sync():
                    got = gpu.sketch_encode(*moved, 9, c3, dtype)
                same(expected, got, f"sketch of {k} items, width {width}, {c3} cells per sub-table, {dtype}")
        if k > 100:
            reordered = sketch.encode(values.flip(0), items.flip(0), 9, c3, torch.float64)
            assert not torch.equal(reordered, sketch.encode(values, items, 9, c3, torch.float64))


@pytest.mark.parametrize("case", ["disjoint", "overlapping", "identical", "too small"])
def test_sketch_peeling_equals_the_cpu_kernels(cpu: object, case: str) -> None:
    """The values and the count the CPU's sequential peeling finds, bit for bit, where rounding makes them depend on
    its order: with float32 cells, the cell each value is read from; with float64 values in float64 cells, also the
    order of the subtractions. A sketch too small to peel completely stops where the CPU does: at its 2-core, whose
    values stay 0."""
    from hvdcomp.methods import sketch

    generator = torch.Generator().manual_seed(2)
    items, ranks, seed = 20_000, 3, 6
    for width, dtype, k in ((1, torch.float32, 200), (3, torch.float64, 200), (33, torch.float32, 40)):
        pool = torch.randperm(items, generator=generator)
        if case == "identical":
            supports = [pool[:k]] * ranks
        elif case == "overlapping":  # half of each support shared by all ranks
            supports = [torch.cat([pool[:k // 2], pool[k + r * k // 2:k + (r + 1) * k // 2]]) for r in range(ranks)]
        else:
            supports = [pool[r * k:(r + 1) * k] for r in range(ranks)]
        bits, hashes = sketch.filter_size(ranks * k, items, ranks, 0.01)
        union = sketch.bloom(supports[0], 4, bits, hashes)
        for support in supports[1:]:
            union |= sketch.bloom(support, 4, bits, hashes)
        found = cpu.sketch_candidates(union, items, 4, hashes)
        c3 = sketch.sketch_cells(found.numel(), 0.8 if case == "too small" else 1.1, 24)
        table = sum(sketch.encode(torch.randn(k, width, generator=generator, dtype=dtype)  # all 53 bits for float64
                                  * torch.exp(3 * torch.randn(k, 1, generator=generator)), s, seed, c3, dtype)
                    for s in supports)
        expected, resolved = cpu.sketch_peel(found, table, seed)
        values, count = gpu.sketch_peel(*on_device(found, table), seed)
        same(expected, values, f"decoded values, width {width}, {dtype}")
        assert int(count) == int(resolved), f"resolved {int(count)}, the CPU {int(resolved)}"
        core = _two_core(found, seed, c3)
        assert int(count) == found.numel() - int(core.sum()) and not expected[core].any()
        assert bool(core.any()) == (case == "too small"), f"2-core of {int(core.sum())} candidates"


@pytest.mark.parametrize("width", [1, 3, 32, 70])
def test_sketch_rows_are_the_nonzero_rows_in_order(width: int) -> None:
    """The rows a rank sends: those holding a value other than 0 (NaN included, -0 not), ascending, with their
    values, as ``x[x.any(1).nonzero()]`` finds them; over programs that hold one and none, rows wider than a
    program's columns, every row and no row; float16 and bfloat16 too."""
    generator = torch.Generator().manual_seed(6)
    per_program = gpu.sketch._tile(width, gpu.sketch._ROWS_BLOCK)[0]
    items = 2 * per_program + 300
    x = torch.randn(items, width, generator=generator)
    x[torch.rand(items, generator=generator) < 0.6] = 0
    x[: 2 * per_program] = 0  # the first program holds one row, the second none
    x[per_program // 2, width - 1] = 3.0
    x[-5, -1] = -0.0
    x[-3, 0] = float("nan")
    x[-2, width // 2] = 2.0**-24  # the smallest float16 (a subnormal there)
    for data in (x, x.half(), x.bfloat16(), torch.zeros_like(x), torch.ones_like(x)):
        for index_dtype in (torch.int32, torch.int64):
            rows = data.any(1).nonzero().view(-1)
            values, indices = gpu.sketch_rows(*on_device(data), index_dtype)
            bits = torch.int32 if data.dtype == torch.float32 else torch.int16  # NaN is not equal to itself
            same(data[rows].view(bits), values.view(bits), f"width {width}, {data.dtype}: values")
            same(rows.to(index_dtype), indices, f"width {width}: rows")
    assert gpu.sketch_rows(*on_device(torch.zeros(0, width)), torch.int64)[0].shape == (0, width)


def test_a_buckets_rows_are_counted_on_its_concatenation_as_each_gradient_alone() -> None:
    """The sketch method's vote for a bucket of dense gradients (``sketch_bucket_counts``): each gradient's nonzero
    rows (NaN counted, -0 not) as ``any`` counts them, over gradients of 1 entry to 100 values a row (wider than a
    program's columns), of several programs' rows, with no row or no column, and all zeros."""
    generator = torch.Generator().manual_seed(8)
    shapes = [(300, 3), (1000,), (0, 5), (5, 0), (130, 100), (64, 2), (7, 1)]
    grads = []
    for shape in shapes:
        grad = torch.randn(shape, generator=generator)
        grad[torch.rand(shape[0], generator=generator) < 0.5] = 0
        grads.append(grad)
    grads[4][3] = 0.0
    grads[4][3, 99] = float("nan")  # a row of one NaN: sent
    grads[4][5] = 0.0
    grads[4][5, 7] = -0.0  # a row of -0: not sent
    grads[5].zero_()
    items = [shape[0] for shape in shapes]  # rows, or a 1-D gradient's entries
    widths = [grad.numel() // n if n else 0 for grad, n in zip(grads, items, strict=True)]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    counts = gpu.sketch_bucket_counts(flat.to(DEVICE), items, widths).cpu()
    expected = [float(grad.reshape(n, -1).any(1).sum()) if n else 0.0 for grad, n in zip(grads, items, strict=True)]
    assert counts.tolist() == expected, (counts, expected)
    with pytest.raises(ValueError, match="concatenation"):
        gpu.sketch_bucket_counts(flat.to(DEVICE), items[:-1], widths[:-1])


def test_the_sketch_methods_bucket_on_the_triton_kernels_sums_as_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket of the sketch method on CUDA (or ``HVDCOMP_KERNELS=triton``), its rows counted on its concatenation
    (once a bucket, float32 or float16, channels-last too): the same paths and sums as on the CPU path, whether every
    gradient goes dense at once (the concatenation itself sent) or one is sketched (the others concatenated apart);
    float64 gradients, which the float32 concatenation could round to 0, are counted one by one."""
    from hvdcomp.methods.sketch import Sketch, SketchReduction

    generator = torch.Generator().manual_seed(4)
    sparse_rows = torch.zeros(3000, 2)
    sparse_rows[torch.randperm(3000, generator=generator)[:20]] = 1.5
    buckets = [[torch.randn(40, 3, generator=generator), torch.randn(50, generator=generator)],
               [torch.randn(40, 3, generator=generator), sparse_rows, torch.randn(9, 2, generator=generator)],
               [torch.randn(40, 3, generator=generator).half(),
                torch.randn(4, 3, 2, 2, generator=generator).half().to(memory_format=torch.channels_last)],
               [torch.randn(40, 3, generator=generator).double(), torch.randn(30, generator=generator).double()]]
    sent: list[torch.Tensor] = []

    def reduced(bucket: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[str]]:
        reduction = SketchReduction(Sketch(), dtype="float64")
        ctx = Context.local(bucket[0], name="bucket", step=5)
        state = reduction.init_bucket_state(bucket, ctx)
        steps = reduction.reduce_bucket(bucket, state, ctx)
        request = next(steps)
        try:
            while True:
                if isinstance(request, requests.Allreduce):
                    sent.append(request.tensors[0])
                request = steps.send(requests.one_rank(request))
        except StopIteration as done:
            sums = done.value
        return [total.cpu() for total in sums], [member["sketch"]["path"] for member in state[MEMBERS]]

    reference = [reduced(bucket) for bucket in buckets]
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    counted = []
    counts = gpu.sketch_bucket_counts
    monkeypatch.setattr(gpu, "sketch_bucket_counts", lambda *args: counted.append(1) or counts(*args))
    for index, (bucket, (sums, paths)) in enumerate(zip(buckets, reference, strict=True)):
        sent.clear()
        got, got_paths = reduced(on_device(*bucket))
        assert got_paths == paths, (got_paths, paths)
        for expected, total in zip(sums, got, strict=True):
            same(expected, total, f"bucket {paths}")
        assert len(counted) == min(index + 1, 3), f"bucket {index}: its rows counted {len(counted)} times in all"
        if index == 0:  # the concatenation made to count the rows is what the allreduce sends
            assert sent[0].numel() == sum(t.numel() for t in bucket) and sent[0].data_ptr() != bucket[0].data_ptr()
    assert [paths for _, paths in reference] == [["dense", "dense"], ["dense", "sketch", "dense"], ["dense", "dense"],
                                                  ["dense", "dense"]], reference
    counted.clear()  # once a gradient of the bucket was sketched, the next step counts gradient by gradient
    reduction = SketchReduction(Sketch(), dtype="float64")
    bucket, ctx = on_device(*buckets[1]), Context.local(buckets[1][0], name="bucket")
    state = reduction.init_bucket_state(bucket, ctx)
    for step in range(2):
        run_one_rank(reduction.reduce_bucket(bucket, state, replace(ctx, step=step)))
    assert len(counted) == 1, counted


def test_sketch_peeling_resumes_after_each_check_of_its_progress(cpu: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked every 2 rounds instead of every :data:`~hvdcomp.kernels.gpu.sketch.ROUNDS`, peeling resumes where
    it was, to the CPU's result (complete, and stuck at a 2-core)."""
    from hvdcomp.methods import sketch

    monkeypatch.setattr(gpu.sketch, "ROUNDS", 2)
    generator = torch.Generator().manual_seed(4)
    found = torch.randperm(20_000, generator=generator)[:500].sort().values
    for margin in (1.2, 0.85):
        c3 = sketch.sketch_cells(found.numel(), margin, 0)
        table = sketch.encode(torch.randn(500, 2, generator=generator, dtype=torch.float64), found, 3, c3,
                              torch.float64)
        expected, resolved = cpu.sketch_peel(found, table, 3)
        values, count = gpu.sketch_peel(*on_device(found, table), 3)
        same(expected, values, f"margin {margin}")
        assert int(count) == int(resolved) > 0, f"resolved {int(count)}, the CPU {int(resolved)}"


def _sketch_step(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One step of the sketch method over ranks holding ``grads``: the candidates, every rank's sketch and the
    decoded sum, as the reduction computes them; then one rank's reduction run end to end (its requests answered
    as by a job of one rank)."""
    from hvdcomp.methods import sketch
    from hvdcomp.requests import Agree, Allgather

    method, items = sketch.Sketch(), grads[0].shape[0]
    payloads = [method.compress(grad, {}, Context.local(grad))[0] for grad in grads]
    bits, hashes = sketch.filter_size(sum(rows.numel() for _, rows in payloads), items, len(grads), 0.05)
    union = sketch.bloom(payloads[0][1], 8, bits, hashes)
    for _, rows in payloads[1:]:
        union |= sketch.bloom(rows, 8, bits, hashes)
    found = sketch.candidates(union, items, 8, hashes)
    c3 = sketch.sketch_cells(found.numel(), 1.1, 24)
    tables = [sketch.encode(values.view(rows.numel(), -1), rows, 9, c3, torch.float32) for values, rows in payloads]
    decoded, resolved = sketch.peel(found, sum(tables), 9)
    assert resolved == found.numel()
    state: dict = {}
    steps = sketch.SketchReduction(method).reduce(grads[0], state, Context.local(grads[0], seed=1))
    answer: object = None
    while True:
        try:
            request = steps.send(answer)
        except StopIteration as done:
            assert state["sketch"]["path"] == "sketch", state["sketch"]
            return [found, *tables, decoded, done.value]
        if isinstance(request, Agree):
            answer = request.values
        elif isinstance(request, Allgather):
            answer = [request.payload]
        else:
            answer = request.tensors


def test_sketch_method_on_the_triton_kernels_decodes_as_on_the_cpu(cpu: object,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through :mod:`hvdcomp.methods.sketch` (on CUDA, or on CPU tensors with ``HVDCOMP_KERNELS=triton``): the
    candidates, each rank's sketch and the decoded sum of 3 ranks, and one rank's reduction, equal the CPU kernels'
    (the PyTorch path peels float32 cells in another order)."""
    generator = torch.Generator().manual_seed(3)
    grads = []
    for _ in range(3):
        grad = torch.randn(600, 4, generator=generator)
        grad[torch.rand(600, generator=generator) > 0.1] = 0  # about 60 rows each
        grads.append(grad)
    reference = _sketch_step(grads)
    if not CUDA:
        monkeypatch.setenv("HVDCOMP_KERNELS", "triton")
    results = _sketch_step([grad.to(DEVICE) for grad in grads])
    for index, (expected, got) in enumerate(zip(reference, results, strict=True)):
        same(expected, got, f"sketch step, output {index}")


@pytest.mark.skipif(CUDA, reason="the compiler's report needs no GPU: CPU CI runs it")
def test_the_selection_kernels_do_not_spill(tmp_path: Path) -> None:
    """The selection's block kernels, compiled for sm_90a (H100, H200) at the warps select.py launches them with, as
    top-k and threshold launch them, spill nothing to local memory by the report of Triton's ptxas
    (perf/gpu/registers.py, which needs no GPU): at 4 warps threshold's compaction over its candidates spilled 536
    bytes a thread."""
    from triton import knobs

    from hvdcomp.kernels.gpu import select

    try:
        knobs.nvidia.ptxas.path  # noqa: B018 (raises where it finds none)
    except RuntimeError as error:
        pytest.skip(f"this Triton has no ptxas for Hopper: {error}")
    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "registers.jsonl"
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    done = subprocess.run([sys.executable, str(repo / "perf" / "gpu" / "registers.py"), "--warps", str(select._WARPS),
                           "--out", str(out)], env=environment, cwd=repo, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 16, rows
    spilled = [(row["kernel"], row["constants"], row["spill_stores"]) for row in rows if row["spill_stores"]]
    assert not spilled, spilled


@pytest.mark.skipif(CUDA, reason="on a GPU every test above compiled its kernels")
@pytest.mark.skipif("PYTEST_XDIST_WORKER" in os.environ,
                    reason="under pytest-xdist each worker notes only its own tests' launches")
def test_every_interpreted_launch_compiles_for_hopper() -> None:
    """The kernel launches the tests above made in the interpreter (a covering set of them) also pass Triton's
    compiler front end for sm_90 (the H100 and H200), without a GPU: what the interpreter accepts and the compiler
    refuses fails here, not on a GPU machine (tests/triton_compile.py)."""
    if not LAUNCHES:
        pytest.skip("no kernel was launched before this test (it runs last in the file, after the others)")
    launches = covering(LAUNCHES)
    if os.environ.get("HVDCOMP_LAUNCHES"):  # kept for perf/gpu/registers.py --launches, one JSON line each
        Path(os.environ["HVDCOMP_LAUNCHES"]).write_text("\n".join(launches) + "\n")
    failures = compile_for(launches)
    assert not failures, f"{len(failures)} of {len(launches)} launches do not compile:\n" + "\n".join(failures)
