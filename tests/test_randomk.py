"""Random-k: strata, shared positions, unbiasedness, the biased variant with error feedback; kernels and torch path."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hvdcomp import CompressionConfig, Context, ErrorFeedback, RandomK
from hvdcomp.methods.randomk import strata


@pytest.mark.parametrize(("n", "k"), [(10, 3), (1000, 10), (7, 7), (1, 1), (100_003, 1001)])
def test_one_position_per_stratum_scaled_by_its_length(path: str, n: int, k: int) -> None:
    x = torch.arange(n, dtype=torch.float32) + 1
    ctx = Context.local(x)
    k = math.ceil(k / n * n)  # what the method computes from the ratio (1001 / 100003 * 100003 rounds up)
    payload, (_, _, indices) = RandomK(k / n, unbiased=True).compress(x, {}, ctx)
    start, length = strata(n, k, x.device)
    assert indices.numel() == k and torch.all(indices >= start) and torch.all(indices < start + length)
    assert torch.equal(payload[0], x[indices] * length)


def test_positions_depend_on_the_shared_seed_and_step_only(path: str) -> None:
    x, y = torch.randn(5000), torch.randn(5000)
    ctx = Context.local(x, seed=1)
    on_other_rank = replace(ctx, rank=3, seed=ctx.seed + 1)  # another rank: same shared seed
    _, (_, _, a) = RandomK(0.01).compress(x, {}, ctx)
    _, (_, _, b) = RandomK(0.01).compress(y, {}, on_other_rank)
    assert torch.equal(a, b), "ranks would not pick the same positions: payloads would not be summable"
    _, (_, _, c) = RandomK(0.01).compress(x, {}, replace(ctx, step=1))
    assert not torch.equal(a, c), "the next step draws anew"


def test_unbiased(path: str) -> None:
    """E[Q(g)] = g: over R draws the mean is within the variance-derived tolerance."""
    x = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    compressor = RandomK(0.05, unbiased=True)
    ctx = Context.local(x)
    draws = 3000
    mean = torch.zeros(2000, dtype=torch.float64)
    for step in range(draws):
        payload, meta = compressor.compress(x, {}, replace(ctx, step=step))
        mean += compressor.decompress(payload, meta).double() / draws
    length = 1 / 0.05
    variance = x.double().pow(2) * (length - 1) / draws  # per element: g^2 (L - 1) / R
    z = (mean - x.double()) / variance.sqrt()
    assert abs(z.sum().item() / len(z) ** 0.5) < 4.5, "the mean drifts"
    assert abs(z.pow(2).mean().item() - 1) < 0.15, f"mean z^2 {z.pow(2).mean():.3f}: spread not as derived"


def test_default_variant_gets_error_feedback_and_keeps_the_invariant(path: str) -> None:
    chosen = CompressionConfig.parse("randomk").choose("w", (10**4,), 2)
    assert isinstance(chosen.compressor, ErrorFeedback) and chosen.reduction.name == "allreduce"
    unbiased = CompressionConfig.parse({"method": "randomk", "options": {"unbiased": True}}).choose("w", (10**4,), 2)
    assert isinstance(unbiased.compressor, RandomK), "the unbiased variant takes no error feedback"
    compressor = chosen.compressor
    x = torch.randn(100, 40)
    ctx = Context.local(x)
    state = compressor.init_state(x, ctx)
    for step in range(4):
        compensated = x * (1 / (1 - 0.9)) + state["residual"]  # the momentum's gain (tests/test_momentum.py)
        payload, meta = compressor.compress(x, state, replace(ctx, step=step))
        sent = compressor.decompress(payload, meta)
        assert torch.count_nonzero(sent) <= 40
        torch.testing.assert_close(state["residual"] + sent, compensated, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", [0, 1.5, True, "0.1"])
def test_bad_ratio_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match=r"randomk: ratio must be a number in \(0, 1\]"):
        RandomK(bad)
