"""TernGrad: unbiasedness, clipping, scaler handling, shapes, wire size; fused kernels and PyTorch path."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hvdcomp import Context, TernGrad, wire
from hvdcomp.kernels import cpu_kernels
from hvdcomp.packing import pack_bits


def clipped(x: torch.Tensor, c: float | None) -> torch.Tensor:
    if c is None:
        return x
    bound = c * x.std(correction=0)
    return x.clamp(-bound, bound)


@pytest.mark.parametrize("clip", [2.5, None])
def test_unbiased(path: str, clip: float | None) -> None:
    """E[Q(g)] = clip(g): the mean of R draws is within the variance-derived tolerance."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=generator) * 0.01
    x[:20] *= 40  # outliers, so clipping matters
    compressor = TernGrad(clip=clip)
    ctx = Context.local(x, seed=1)
    state = compressor.init_state(x, ctx)
    draws = 400
    mean = torch.zeros_like(x, dtype=torch.float64)
    scaler = None
    for step in range(draws):
        payload, meta = compressor.compress(x, state, replace(ctx, step=step))
        scaler = payload[0].item()
        mean += compressor.decompress(payload, meta).double() / draws
    target = clipped(x, clip).double()
    # Per element, Q_k is s * sign * Bernoulli(|a_k| / s): variance |a_k| (s - |a_k|).
    variance = target.abs() * (scaler - target.abs()) / draws
    total_z = (mean - target).sum() / variance.sum().sqrt()
    assert abs(total_z) < 4.5, f"sum of the means is {total_z:.2f} standard deviations off"
    random = variance > 0
    z = (mean - target)[random] / variance[random].sqrt()
    assert abs(z.pow(2).mean().item() - 1) < 0.2, f"mean z^2 {z.pow(2).mean():.3f}: spread not as derived"
    torch.testing.assert_close(mean[~random], target[~random], msg="deterministic elements (a = 0 or s) drift")


def test_clipping_bounds_the_scaler(path: str) -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    x[0] = 1000.0
    bound = 2.5 * x.std(correction=0).item()
    payload, meta = TernGrad().compress(x, {}, Context.local(x))
    assert payload[0].item() == pytest.approx(bound, rel=1e-5)
    values = TernGrad().decompress(payload, meta)
    assert set(values.unique().tolist()) <= {-payload[0].item(), 0.0, payload[0].item()}
    assert values[0].item() == pytest.approx(bound, rel=1e-5), "the outlier is clipped to c*sigma and kept"
    unclipped, _ = TernGrad(clip=None).compress(x, {}, Context.local(x))
    assert unclipped[0].item() == 1000.0


@pytest.mark.parametrize(("mean", "spread"), [(0.0, 1.0), (1e3, 1.0), (-1e4, 1.0), (0.0, 1e-24), (0.0, 1e20),
                                               (1e35, 1e34)])
def test_clip_bound_holds_where_the_mean_is_far_above_the_spread(path: str, mean: float, spread: float) -> None:
    """sigma from deviations about the mean: E[x^2] - E[x]^2 in float32 partial sums cancels at mean / sigma = 1e3
    (a bound 15% off) and 1e4 (none left); and from deviations scaled by their block's max, whose squares would
    underflow float32 at 1e-24 and overflow it at 1e20, as would the blocks' sums at 1e35. Over 3 of the CPU kernel's
    chunks, so its merges count."""
    x = mean + spread * torch.randn(100_003, generator=torch.Generator().manual_seed(4))
    bound = 2.5 * x.double().std(correction=0).item()
    payload, _ = TernGrad().compress(x, {}, Context.local(x))
    assert payload[0].item() == pytest.approx(bound, rel=1e-5, abs=0)


def test_shared_scaler_is_used(path: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    compressor = TernGrad()
    ctx = Context.local(x)
    state = compressor.init_state(x, ctx)
    request = compressor.agree(x, state, ctx)
    assert request.op == "max"
    payload, _ = compressor.compress(x, state, ctx, agreed=request.values * 4)
    assert payload[0].item() == pytest.approx(request.values.item() * 4)
    assert TernGrad(scaler_sharing=False).agree(x, state, ctx) is None


@pytest.mark.parametrize("shape", [(), (0,), (1,), (5,), (3, 7), (2, 3, 5)])
def test_shapes_round_trip(path: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    compressor = TernGrad()
    payload, meta = compressor.compress(x, {}, Context.local(x))
    out = compressor.decompress(payload, meta)
    assert out.shape == x.shape and out.dtype == torch.float32
    s = payload[0].item()
    assert all(v in (-s, 0.0, s) for v in out.reshape(-1).tolist())
    assert torch.all((out == 0) | (torch.sign(out) == torch.sign(x)))



def test_kernels_and_torch_path_share_the_wire_format() -> None:
    """Where every draw is decided (|x| = s or 0), both paths must produce the same bytes."""
    kernels = cpu_kernels()
    assert kernels is not None
    for n in (0, 1, 3, 4, 5, 1001):
        x = (torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(n)) - 1).float() * 0.5
        packed = kernels.ternarize_pack(x, 0.5, math.inf, 123)
        codes = ((x > 0).to(torch.uint8)) | ((x < 0).to(torch.uint8) << 1)
        assert torch.equal(packed, pack_bits(codes, 2)), n
        decoded = kernels.unpack_sum(packed.view(1, -1), torch.tensor([0.5]), n)
        assert torch.equal(decoded, x), n


def test_kernel_unpack_sum_adds_ranks_with_their_scales() -> None:
    kernels = cpu_kernels()
    codes = torch.randint(0, 3, (3, 10), generator=torch.Generator().manual_seed(5)).to(torch.uint8)
    packed = torch.stack([pack_bits(c, 2) for c in codes])
    scales = torch.tensor([1.0, 2.0, 0.25])
    expected = sum(scales[r] * ((codes[r] & 1).float() - (codes[r] >> 1).float()) for r in range(3))
    assert torch.equal(kernels.unpack_sum(packed, scales, 10), expected)
    with pytest.raises(RuntimeError, match="cannot hold"):
        kernels.unpack_sum(packed, scales, 20)


def test_same_seed_and_step_give_the_same_draws(path: str) -> None:
    x = torch.randn(500, generator=torch.Generator().manual_seed(6))
    compressor = TernGrad()
    ctx = Context.local(x, seed=9)
    first = compressor.compress(x, {}, ctx)[0][1]
    assert torch.equal(first, compressor.compress(x, {}, Context.local(x, seed=9))[0][1])
    assert not torch.equal(compressor.compress(x, {}, replace(ctx, step=1))[0][1], first), "the next step draws anew"
    assert not torch.equal(compressor.compress(x, {}, Context.local(x, seed=10))[0][1], first), "another seed"


def test_wire_size_at_most_2_05_bits_per_element() -> None:
    x = torch.randn(1_000_000)
    compressor = TernGrad()
    payload, _ = compressor.compress(x, {}, Context.local(x))
    bits = wire.nbytes(wire.layout_of(payload)) * 8 / x.numel()
    assert bits <= 2.05, bits


@pytest.mark.parametrize("bad", [0, -1.0, "2.5", True])
def test_bad_clip_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="clip must be a positive finite number"):
        TernGrad(clip=bad)
