"""The bucketed quantizers (BinGrad, ORQ, QSGD, 1-bit SGD, signSGD, EF-signSGD): unbiasedness, the optimality
claims of Xu, Huo and Huang as properties, the levels' optimality conditions, wire sizes, the majority vote, and
the fused kernels against the PyTorch path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import huge_gradient, nonfinite_buckets
from torch import nn

from hvdcomp import ORQ, QSGD, BinGrad, Context, ErrorFeedback, OneBit, SignSGD, make_compressor, wire
from hvdcomp.kernels import cpu_kernels
from hvdcomp.packing import pack_bits, unpack_bits
from hvdcomp.quantization import rounding_variance, stacked
from hvdcomp.workloads import synthetic

QUANTIZERS = ["bingrad", "onebit", "orq", "qsgd", "signsgd", "efsignsgd"]


def inputs(n: int = 200_000) -> dict[str, torch.Tensor]:
    """Gaussian, Laplace and heavy-tailed (Student t, 2 degrees of freedom) values, and real gradients of the
    synthetic workload's model (a slice of each weight's gradient, concatenated)."""
    workload = synthetic(seed=0, train_samples=64, test_samples=1)
    nn.functional.cross_entropy(workload.model(workload.data.train_x), workload.data.train_y).backward()
    gradients = torch.cat([p.grad.reshape(-1)[:n // 3] for p in workload.model.parameters() if p.dim() == 2][:3])
    torch.manual_seed(1)
    return {"gaussian": torch.randn(n),
            "laplace": torch.distributions.Laplace(0.0, 1.0).sample((n,)),
            "heavy-tailed": torch.distributions.StudentT(2.0).sample((n,)),
            "gradients": gradients}


@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    return inputs()


def variance(compressor: ORQ | QSGD, x: torch.Tensor) -> float:
    payload, _ = compressor.compress(x, {}, Context.local(x))
    return rounding_variance(x, compressor.rounding_levels(payload), compressor.bucket_size).sum().item()


def squared_error(method: str, x: torch.Tensor) -> float:
    compressor = make_compressor(method, error_feedback=False)
    payload, meta = compressor.compress(x, {}, Context.local(x))
    return (compressor.decompress(payload, meta) - x).double().pow(2).sum().item()


@pytest.mark.parametrize("compressor", [ORQ(), ORQ(bits=3, bucket_size=64), ORQ(iterations=0), QSGD(),
                                        QSGD(bits=2, norm="max"), QSGD(bits=8, bucket_size=128)], ids=repr)
def test_unbiased(path: str, compressor: ORQ | QSGD) -> None:
    """E[Q(g)] = g: the mean of R draws is within the tolerance derived from the per-element variance."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 0.01
    x[:10] *= 30  # outliers stretch the levels
    ctx = Context.local(x, seed=1)
    draws = 300
    mean = torch.zeros_like(x, dtype=torch.float64)
    for step in range(draws):
        payload, meta = compressor.compress(x, {}, replace(ctx, step=step))
        mean += compressor.decompress(payload, meta).double() / draws
    per_element = rounding_variance(x, compressor.rounding_levels(payload), compressor.bucket_size) / draws
    total_z = (mean - x.double()).sum() / per_element.sum().sqrt()
    assert abs(total_z) < 4.5, f"sum of the means is {total_z:.2f} standard deviations off"
    random = per_element > 1e-20
    z = (mean - x.double())[random] / per_element[random].sqrt()
    assert abs(z.pow(2).mean().item() - 1) < 0.2, f"mean z^2 {z.pow(2).mean():.3f}: spread not as derived"
    torch.testing.assert_close(mean[~random], x.double()[~random], msg="elements on a level drift")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_orq_variance_at_most_qsgd_and_uniform(path: str, data: dict[str, torch.Tensor], bits: int) -> None:
    """The paper's claim, as a property: at the same bits per element and bucket size, ORQ's variance is at most
    QSGD's (either norm) and that of uniform levels from min to max, on every input."""
    bucket = 512 if bits < 8 else 4096
    for name, x in data.items():
        orq = variance(ORQ(bits=bits, bucket_size=bucket), x)
        uniform = variance(ORQ(bits=bits, bucket_size=bucket, iterations=0), x)
        l2 = variance(QSGD(bits=bits, bucket_size=bucket, norm="l2"), x)
        maximum = variance(QSGD(bits=bits, bucket_size=bucket, norm="max"), x)
        assert orq <= uniform and orq <= l2 and orq <= maximum, (name, orq, uniform, l2, maximum)
        if bits == 2:  # where the levels matter most, the gain is large on every input
            assert orq < 0.9 * uniform, (name, orq, uniform)


def test_bingrad_error_at_most_onebit_and_efsignsgd(path: str, data: dict[str, torch.Tensor]) -> None:
    """At one bit per element, BinGrad's optimal levels give a squared error at most 1-bit SGD's and EF-signSGD's."""
    for name, x in data.items():
        bingrad, onebit, efsign = (squared_error(method, x) for method in ("bingrad", "onebit", "efsignsgd"))
        assert bingrad <= onebit and bingrad <= efsign, (name, bingrad, onebit, efsign)


@pytest.mark.parametrize("bits", [2, 3])
def test_orq_levels_satisfy_the_optimality_condition(path: str, bits: int) -> None:
    """For each interior level l_j with neighbours a < b: sum_{[a, l_j)} (g - a) = sum_{[l_j, b)} (b - g), to
    within (b - a) times the values of one bin around l_j (the search works on bins of the bucket's range)."""
    x = torch.randn(64 * 512, generator=torch.Generator().manual_seed(5))
    compressor = ORQ(bits=bits)
    payload, _ = compressor.compress(x, {}, Context.local(x))
    levels = payload[0].double()
    worst = 0.0
    for row, values in enumerate(x.double().view(-1, 512)):
        width = (values.max() - values.min()) / compressor.search_bins
        for j in range(1, levels.shape[1] - 1):
            a, level, b = levels[row, j - 1], levels[row, j], levels[row, j + 1]
            left = values[(values >= a) & (values < level)]
            right = values[(values >= level) & (values < b)]
            residual = ((left - a).sum() - (b - right).sum()).abs() / (b - a)
            near = ((values - level).abs() <= width).sum() + 1
            assert residual <= near, (row, j, residual.item(), near.item())
            worst = max(worst, (residual / near).item())
    assert worst > 0  # the check compared something


def test_bingrad_levels_are_the_lloyd_max_fixed_point(path: str) -> None:
    """With enough iterations: each level is the mean of the values it replaces, and every value is nearest to
    its own level (the optimality condition b1 = mean{g < t}, b2 = mean{g >= t}, t = (b1 + b2) / 2)."""
    x = torch.distributions.Laplace(0.3, 1.0).sample((32 * 512,))
    compressor = BinGrad(iterations=200)
    payload, meta = compressor.compress(x, {}, Context.local(x))
    decoded = compressor.decompress(payload, meta)
    for row in range(32):
        values, coded = x[row * 512:(row + 1) * 512].double(), decoded[row * 512:(row + 1) * 512]
        low, high = payload[0][row].double()
        upper = coded == payload[0][row, 1]
        torch.testing.assert_close(values[~upper].mean(), low, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(values[upper].mean(), high, rtol=1e-5, atol=1e-6)
        middle = (low + high) / 2
        assert (values[~upper] <= middle + 1e-6).all() and (values[upper] >= middle - 1e-6).all(), row


@pytest.mark.parametrize("method,options,ideal", [
    ("bingrad", {}, 1 + 64 / 512), ("onebit", {}, 1 + 64 / 512), ("orq", {}, 2 + 128 / 512),
    ("orq", {"bits": 3, "bucket_size": 2048}, 3 + 256 / 2048), ("qsgd", {}, 4 + 32 / 512),
    ("qsgd", {"bits": 8}, 8 + 32 / 512), ("signsgd", {}, 1), ("efsignsgd", {}, 1)])
def test_wire_size_at_1m_elements(method: str, options: dict, ideal: float) -> None:
    """Within 2% of the ideal: bits per element plus the per-bucket levels or scales."""
    x = torch.randn(1_000_000)
    payload, _ = make_compressor(method, options, error_feedback=False).compress(x, {}, Context.local(x))
    bits = wire.nbytes(wire.layout_of(payload)) * 8 / x.numel()
    assert ideal <= bits <= 1.02 * ideal, (bits, ideal)


@pytest.mark.parametrize("method", QUANTIZERS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 7), (513,), (2, 3, 300)])
def test_shapes_round_trip(path: str, method: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    compressor = make_compressor(method, error_feedback=False)
    payload, meta = compressor.compress(x, {}, Context.local(x))
    out = compressor.decompress(payload, meta)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    if method in ("signsgd", "efsignsgd") and x.numel():
        scale = x.abs().mean()
        torch.testing.assert_close(out, torch.where(x > 0, scale, -scale))
    if method == "orq" and x.numel():  # an element at the bucket's min or max is exact
        assert out.reshape(-1)[x.reshape(-1).argmax()] == x.max()



@pytest.mark.parametrize("method", QUANTIZERS)
def test_kernels_and_torch_path_agree(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The same levels (to float rounding: the paths sum in different orders) and, where no draw decides, the
    same decoded values; the kernels decode the torch path's payloads and vice versa."""
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(8))
    compressor = make_compressor(method, error_feedback=False)
    ctx = Context.local(x)
    kernel_payload, meta = compressor.compress(x, {}, ctx)
    kernel_from_kernel = compressor.decompress(kernel_payload, meta)
    monkeypatch.setenv("HVDCOMP_KERNELS", "0")
    torch_payload, _ = compressor.compress(x, {}, ctx)
    torch.testing.assert_close(torch_payload[0], kernel_payload[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compressor.decompress(kernel_payload, meta), kernel_from_kernel)
    if method in ("bingrad", "onebit", "signsgd", "efsignsgd"):  # deterministic (no exact zeros here)
        assert torch.equal(torch_payload[1], kernel_payload[1]), method


def test_kernels_decode_and_sum_ranks_through_tables_and_grids() -> None:
    kernels = cpu_kernels()
    for bits, bucket, n in [(1, 8, 37), (3, 16, 100), (5, 8, 64), (8, 24, 50)]:
        codes = torch.randint(0, 1 << bits, (3, n), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
        packed = torch.stack([pack_bits(c, bits) for c in codes])
        buckets = -(-n // bucket)
        tables = torch.randn(3, buckets, 1 << bits, generator=torch.Generator().manual_seed(1))
        index = torch.arange(n) // bucket
        expected = sum(tables[r, index, codes[r].long()] for r in range(3))
        torch.testing.assert_close(kernels.decode_sum(packed, tables, torch.empty(0), bits, bucket, n), expected)
        grid = torch.randn(1 << bits)
        scales = tables[:, :, :1].contiguous()
        expected = sum(scales[r, index, 0] * grid[codes[r].long()] for r in range(3))
        torch.testing.assert_close(kernels.decode_sum(packed, scales, grid, bits, bucket, n), expected)
    with pytest.raises(RuntimeError, match="cannot hold"):
        kernels.decode_sum(packed, tables, torch.empty(0), bits, bucket, n + 8)


def test_kernels_subtract_a_decoded_payload_in_place() -> None:
    """Error feedback's update in one pass (``decode_subtract``): the residual minus the payload as decode_sum decodes
    it, bit for bit, with tables or a grid; one payload only."""
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(4)
    for bits, bucket, n in [(1, 8, 37), (1, 64, 64), (3, 16, 100), (8, 24, 50)]:
        packed = pack_bits(torch.randint(0, 1 << bits, (n,), generator=generator, dtype=torch.uint8), bits)[None]
        tables = torch.randn(1, -(-n // bucket), 1 << bits, generator=generator)
        for table, grid in [(tables, torch.empty(0)), (tables[:, :, :1].contiguous(), torch.randn(1 << bits))]:
            residual = torch.randn(n, generator=generator)
            expected = residual - kernels.decode_sum(packed, table, grid, bits, bucket, n)
            kernels.decode_subtract(residual, packed, table, grid, bits, bucket)
            assert torch.equal(residual, expected), (bits, bucket, n)
    with pytest.raises(RuntimeError, match="subtracts one payload, got 2"):
        kernels.decode_subtract(torch.zeros(n), packed.expand(2, -1), tables.expand(2, -1, -1), torch.empty(0), bits,
                                bucket)


def test_kernels_take_the_majority_vote_in_one_pass() -> None:
    """``sign_vote``: sign(sum of the ranks' signs) times their scales added in rank order, ties 0, on every element
    of a ragged last byte and over scales at a stride (gathered payloads)."""
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(5)
    for ranks, n in [(1, 13), (2, 37), (3, 4100), (4, 9000)]:
        bits = torch.randint(0, 2, (ranks, n), generator=generator, dtype=torch.uint8)
        packed = torch.stack([pack_bits(row, 1) for row in bits])
        scales = torch.rand(ranks, 2, generator=generator)[:, 0]  # a stride of 2
        scale = scales[0].clone()
        for value in scales[1:]:
            scale += value
        expected = (2 * bits.float() - 1).sum(0).sign() * scale
        assert torch.equal(kernels.sign_vote(packed, scales, n), expected), (ranks, n)
    with pytest.raises(RuntimeError, match="scales must be a CPU float32 tensor"):
        kernels.sign_vote(packed, scales[:2], n)


def test_gathered_payloads_decode_in_place(path: str) -> None:
    """Payloads gathered into one buffer (each rank's segment after the last, as Horovod's allgather returns them)
    decode as rows of one strided view, with no copy of the ranks' codes, to what the payloads decode to one by
    one."""
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    for method in ("qsgd", "orq", "terngrad"):
        compressor = make_compressor(method, error_feedback=False)
        ctx = Context.local(x[0])
        payloads = [compressor.compress(row, {}, ctx) for row in x]
        meta = payloads[0][1]
        buffer = torch.cat([wire.pack(payload) for payload, _ in payloads])
        gathered = [wire.unpack(segment, wire.layout_of(payloads[0][0])) for segment in buffer.chunk(3)]
        rows = stacked([payload[-1] for payload in gathered])
        assert rows.data_ptr() == gathered[0][-1].data_ptr() and rows.shape == (3, gathered[0][-1].numel()), method
        expected = sum(compressor.decompress(payload, meta) for payload, _ in payloads)
        torch.testing.assert_close(compressor.aggregate(gathered, meta), expected, rtol=1e-6, atol=1e-6)


def test_majority_vote_semantics(path: str) -> None:
    """signsgd's aggregate: sign of the sum of the ranks' signs, times the sum of their scales (the optimizer
    then averages: the mean scale); a tie gives 0; scaled=False gives the bare vote."""
    signs = torch.tensor([[1, 1, -1, -1, 1, 1], [1, -1, -1, 1, 1, -1], [1, 1, 1, -1, -1, -1],
                          [1, -1, -1, -1, 1, 1]], dtype=torch.float32)
    magnitudes = torch.tensor([0.5, 1.0, 2.0, 4.0]).unsqueeze(1)
    for scaled in (True, False):
        compressor = SignSGD(scaled=scaled)
        compressed = [compressor.compress(row * magnitudes[r], {}, Context.local(row)) for r, row in
                      enumerate(signs)]
        payloads, meta = [payload for payload, _ in compressed], compressed[0][1]
        scale = magnitudes.sum() if scaled else 4.0
        # four ranks: votes 4, 0, -2, -2, 2, 0: ties (0) stay 0
        expected = torch.tensor([1.0, 0.0, -1.0, -1.0, 1.0, 0.0]) * scale
        assert torch.equal(compressor.aggregate(payloads, meta), expected)
        three = compressor.aggregate(payloads[:3], meta)  # an odd count never ties
        assert torch.equal(three.sign(), torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0]))


def test_exact_zeros_vote_on_a_seeded_coin(path: str) -> None:
    x = torch.zeros(4000)
    compressor = SignSGD(scaled=False)
    payload, meta = compressor.compress(x, {}, Context.local(x, seed=3))
    positive = (compressor.decompress(payload, meta) > 0).float().mean().item()
    assert 0.45 < positive < 0.55, positive
    again, _ = compressor.compress(x, {}, Context.local(x, seed=3))
    assert torch.equal(again[1], payload[1]), "the coin comes from the seed"


def test_error_feedback_defaults() -> None:
    """Biased methods get error feedback, except signSGD with majority vote (as in its paper)."""
    for method in ("bingrad", "onebit", "efsignsgd"):
        assert isinstance(make_compressor(method), ErrorFeedback), method
    for method in ("signsgd", "orq", "qsgd"):
        assert not isinstance(make_compressor(method), ErrorFeedback), method
    assert isinstance(make_compressor("signsgd", error_feedback=True), ErrorFeedback)


@pytest.mark.parametrize("make,match", [
    (lambda: BinGrad(bucket_size=100), "bucket_size must be a positive multiple of 8"),
    (lambda: OneBit(bucket_size=0), "bucket_size must be a positive multiple of 8"),
    (lambda: ORQ(bits=9), r"bits must be an integer in \[1, 8\]"),
    (lambda: ORQ(iterations=-1), r"iterations must be an integer in \[0, 1000\]"),
    (lambda: QSGD(bits=1), r"bits must be an integer in \[2, 8\]"),
    (lambda: QSGD(norm="l1"), "norm must be one of l2, max"),
    (lambda: SignSGD(scaled="yes"), "scaled must be true or false"),
    (lambda: BinGrad(iterations=True), r"iterations must be an integer"),
])
def test_bad_options_are_rejected(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("method", QUANTIZERS)
def test_nonfinite_input_keeps_the_payload_size(path: str, method: str) -> None:
    """A NaN or Inf gradient (which the optimizer then rejects on every rank) is encoded without reading or writing
    outside its buffers: the payload has its usual sizes."""
    compressor = make_compressor(method, error_feedback=False)
    reference, _ = compressor.compress(torch.ones(1200), {}, Context.local(torch.ones(1200)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(1200, generator=torch.Generator().manual_seed(0))
        x[::7] = bad
        for tensor in (x, torch.full((1200,), bad)):
            payload, meta = compressor.compress(tensor, {}, Context.local(tensor))
            assert [part.shape for part in payload] == [part.shape for part in reference], (method, bad)
            assert compressor.decompress(payload, meta).shape == tensor.shape


GUARDED_DECODE = r"""
import ctypes, mmap, sys
import torch
from hvdcomp.kernels import cpu_kernels

kernels = cpu_kernels()
page = mmap.PAGESIZE
memory = mmap.mmap(-1, 2 * page)
start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mprotect(ctypes.c_void_p(start + page), ctypes.c_size_t(page), 0) == 0  # the second page: no access
for bits in range(1, 9):
    for n in range(1, 65):
        nbytes = -(-n * bits // 8)
        codes = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=page - nbytes)  # ends at the page
        tables = torch.arange(1 << bits, dtype=torch.float32).reshape(1, 1, -1)
        decoded = kernels.decode_sum(codes.unsqueeze(0), tables, torch.empty(0), bits, 64, n)
        residual = torch.zeros(n)
        kernels.decode_subtract(residual, codes.unsqueeze(0), tables, torch.empty(0), bits, 64)
        assert torch.equal(residual, -decoded), (bits, n)
print("decoded every payload")
"""


@pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the PyTorch paths only")
def test_the_cpu_decoder_reads_no_byte_past_a_short_payload() -> None:
    """Payloads of 1 to 64 elements at 1 to 8 bits, each ending where an inaccessible page begins: the decoder's
    8-byte loads must stay inside the payload (one read past it ends the process with SIGSEGV)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", GUARDED_DECODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "decoded every payload" in done.stdout, (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("method", ["signsgd", "efsignsgd", "onebit", "bingrad"])
def test_sign_scales_and_binary_levels_hold_beyond_float32_sums(path: str, method: str) -> None:
    """Sums of |x| overflow float32 from |x| ~ 1e36 in a bucket of 512 (the CPU kernels' lanes from ~2.6e36 for the
    scale, ~5e36 for the levels): the sign
    family's scale and 1-bit SGD's and BinGrad's levels are summed in float64 there (scaled, in the Triton kernels),
    so a gradient at any magnitude whose 2-rank sum float32 holds decodes finite, with what the method keeps kept: the
    L1 norm (the sign family) or each bucket's sum (the binary quantizers' levels are their sides' means); and the
    residual of error feedback stays finite."""
    x = huge_gradient()
    compressor = make_compressor(method, {"momentum": 0} if "sign" in method else {})  # (a gain of 10 would overflow)
    ctx = Context.local(x)
    state = compressor.init_state(x, ctx)
    payload, meta = compressor.compress(x.clone(), state, ctx)
    decoded = compressor.decompress(payload, meta).double()
    assert torch.isfinite(decoded).all() and torch.isfinite(state.get("residual", decoded)).all()
    if "sign" in method:
        sums, expected, magnitude = decoded.abs().sum(), x.double().abs().sum(), x.double().abs().sum()
    else:
        sums, expected = decoded.view(-1, 512).sum(1), x.double().view(-1, 512).sum(1)
        magnitude = x.double().view(-1, 512).abs().sum(1)
    assert ((sums - expected).abs() <= 1e-6 * magnitude).all(), (sums, expected)


@pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the PyTorch paths only")
@pytest.mark.parametrize("method", ["onebit", "bingrad"])
def test_binary_payloads_of_nonfinite_buckets_are_the_same_on_both_paths(monkeypatch: pytest.MonkeyPatch,
                                                                        method: str) -> None:
    """Buckets holding NaN or infinities (which the optimizer then reports on every rank) are sent alike by the CPU
    kernels and the PyTorch path: the same levels, NaN where the bucket's sum less the lower side's is, and the same
    codes (a NaN is not >= the threshold: code 0)."""
    x = nonfinite_buckets()
    compressor = make_compressor(method, {"bucket_size": 8}, error_feedback=False)
    expected, _ = compressor.compress(x, {}, Context.local(x))
    monkeypatch.setenv("HVDCOMP_KERNELS", "0")
    got, _ = compressor.compress(x, {}, Context.local(x))
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[1], expected[1]), (unpack_bits(got[1], 1, x.numel()), unpack_bits(expected[1], 1, x.numel()))


def test_bingrad_threshold_holds_where_its_levels_sum_overflows(path: str) -> None:
    """BinGrad's threshold, the midpoint of its levels, where their sum overflows float32 (both above ~1.7e38): halved
    first, so a bucket of two values that large is sent exactly, not with an infinite level."""
    x = torch.tensor([2.0**127, 2.0**127, 1.5 * 2.0**127, 1.5 * 2.0**127] * 2)
    compressor = BinGrad(bucket_size=8)
    payload, meta = compressor.compress(x, {}, Context.local(x))
    assert torch.equal(compressor.decompress(payload, meta), x), payload[0]


def test_qsgd_l2_norm_holds_beyond_float32_squares(path: str) -> None:
    """Squares of |x| above ~1.8e19 overflow float32 and below ~1e-19 underflow it: the L2 norm is summed in float64
    there, and one beyond float32's range is its largest value (>= every |x|), so the bucket is sent (unbiased), not
    as zeros or with a norm below max |x|."""
    compressor = QSGD(bits=4, bucket_size=64, norm="l2")
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    x[64:128] *= 1e20
    x[128:192] = 2e38  # the norm, 1.6e39, is beyond float32
    x[130] = -2e38
    x[192:] *= 1e-24
    payload, meta = compressor.compress(x, {}, Context.local(x))
    norms = payload[0].reshape(-1)
    for bucket in (0, 1, 3):
        expected = x[64 * bucket:64 * (bucket + 1)].double().norm().item()
        assert norms[bucket].item() == pytest.approx(expected, rel=1e-6, abs=0), bucket
    assert norms[2].item() == torch.finfo(torch.float32).max
    decoded = compressor.decompress(payload, meta)
    assert torch.isfinite(decoded).all() and all((decoded[j:j + 64] != 0).any() for j in (64, 128, 192))


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_qsgd_sends_a_subnormal_bucket_as_zeros_and_keeps_codes_in_range(path: str, norm: str) -> None:
    """A bucket whose norm is so small that s / norm overflows (a subnormal float32) is sent as zeros on both paths,
    not as +-norm (the PyTorch path) or a biased value (the kernel); a NaN or infinite input still makes valid codes
    (it is caught by the optimizer's check of the inputs)."""
    compressor = QSGD(bits=4, bucket_size=64, norm=norm)
    x = torch.zeros(128)
    x[3] = 1e-39
    x[64:] = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ctx = Context.local(x)
    payload, meta = compressor.compress(x, {}, ctx)
    decoded = compressor.decompress(payload, meta)
    assert torch.equal(decoded[:64], torch.zeros(64)), decoded[:8]
    assert torch.isfinite(decoded).all() and decoded[64:].abs().max() > 0
    x[70], x[71] = float("nan"), float("inf")
    codes = unpack_bits(compressor.compress(x, {}, ctx)[0][1], 4, 128)
    assert int(codes.max()) <= 2 * compressor.levels, codes.max()
