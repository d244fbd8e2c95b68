"""The contracts every registered method keeps, checked for every method in the registry (``hvdcomp.METHODS``) at
its defaults, on one rank: a method added later is checked here with no test to write.

What a method's own tests check (its paper's equations, its options' ranges) stays in its own file; what holds for
every method is here: the round trip keeps shape and dtype class for any shape it compresses, and says why it does
not compress the others; the same seeds give the same bits; a method that declares itself unbiased is, on average;
error feedback keeps exactly what was not sent; a parameter's state survives ``torch.save`` and resumes the same
draws; an option of the wrong type, and an unknown one, is refused with its name. Multi-rank contracts (replicas
identical, every reduction) are tests/test_multirank.py's. Tests taking ``path`` run on the fused kernels and on
the PyTorch path (tests/conftest.py).
"""

from __future__ import annotations

import inspect
import io
from dataclasses import replace
from typing import Any

import pytest
import torch

from hvdcomp import METHODS, Context, ErrorFeedback, make_compressor
from hvdcomp.compressor import STEADY_STEP, Compressor, State
from hvdcomp.error_feedback import corrected

NAMES = sorted(METHODS)
SHAPES = [(), (0,), (1,), (7,), (3, 7), (96, 64), (2, 3, 300)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def grad(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def steady(tensor: torch.Tensor, step: int = STEADY_STEP, seed: int = 3) -> Context:
    """A context past every method's warm-up (PowerSGD's dense steps, DGC's sparsity stages)."""
    return replace(Context.local(tensor, seed=seed), step=step)


def round_trip(compressor: Compressor, tensor: torch.Tensor, state: State, ctx: Context) -> tuple[list, Any,
                                                                                                   torch.Tensor]:
    """One rank's step: the agreement (its own values stand for the agreed ones), compress, decompress."""
    request = compressor.agree(tensor, state, ctx)
    payload, meta = compressor.compress(tensor, state, ctx, None if request is None else request.values)
    return payload, meta, compressor.decompress(payload, meta)


@pytest.mark.parametrize("method", NAMES)
def test_round_trip_keeps_the_shape_or_says_why_not(method: str, path: str) -> None:
    """Every shape the method compresses comes back in its shape, finite and floating point, from any floating
    gradient dtype, on the fused kernels and on the PyTorch path; a shape it leaves dense has a reason (logged by
    the optimizer)."""
    compressor = make_compressor(method)
    for shape in SHAPES:
        if not compressor.compresses(torch.Size(shape)):
            assert compressor.why_dense(torch.Size(shape)), f"{method} leaves {shape} dense without a reason"
            continue
        for dtype in DTYPES:
            x = grad(shape, dtype=dtype)
            ctx = steady(x)
            _, _, out = round_trip(compressor, x, compressor.init_state(x, ctx), ctx)
            assert out.shape == x.shape and out.is_floating_point(), (method, shape, dtype)
            assert bool(torch.isfinite(out).all()), (method, shape, dtype)


@pytest.mark.parametrize("method", NAMES)
def test_the_same_seeds_give_the_same_bits(method: str, path: str) -> None:
    """Runs are reproducible: the same seed, step and input give the same payload, on fresh state."""
    compressor = make_compressor(method)
    x = grad((96, 64))
    results = []
    for _ in range(2):
        state = compressor.init_state(x, steady(x))
        results.append([round_trip(compressor, x, state, steady(x, step))[::2] for step in (0, 1, STEADY_STEP)])
    for (payload_a, out_a), (payload_b, out_b) in zip(*results, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(payload_a, payload_b, strict=True)), method
        assert torch.equal(out_a, out_b), method


@pytest.mark.parametrize("method", [name for name in NAMES if make_compressor(name, error_feedback=False).unbiased])
def test_a_method_declared_unbiased_is_unbiased(method: str, path: str) -> None:
    """E[D(C(g))] = g: the mean of 400 draws (400 steps of the same gradient, each with its own seed) is as close
    to g as the draws' variance allows: ||mean - g||^2 at most 3 times its expectation for an unbiased method,
    sum_i var_i / 400 (over 512 elements that sum concentrates within a few percent), plus float16's rounding."""
    compressor = make_compressor(method, error_feedback=False)
    x = grad((16, 32), seed=1)
    draws = []
    for step in range(400):
        ctx = steady(x, step=STEADY_STEP + step, seed=step)
        draws.append(round_trip(compressor, x, compressor.init_state(x, ctx), ctx)[2].double())
    stacked = torch.stack(draws)
    squared_error = float((stacked.mean(0) - x.double()).square().sum())
    expected = float(stacked.var(0).sum()) / len(draws)
    assert squared_error ** 0.5 <= (3 * expected) ** 0.5 + 1e-3 * float(x.norm()), \
        f"{method}: ||mean of draws - g||^2 = {squared_error:.3g}, an unbiased method's expectation {expected:.3g}"


@pytest.mark.parametrize("method", [name for name in NAMES if isinstance(make_compressor(name), ErrorFeedback)])
def test_error_feedback_keeps_exactly_what_was_not_sent(method: str) -> None:
    """With error feedback (the default of every biased method without a memory of its own), the residual plus what
    was sent equals the gradient plus the last residual, every step; with momentum correction (top-k, threshold,
    random-k, EF-signSGD), the momentum-corrected gradient u (hvdcomp.error_feedback) in place of the gradient."""
    compressor = make_compressor(method)
    x = grad((96, 64), seed=2)
    ctx = steady(x)
    state = compressor.init_state(x, ctx)
    u = torch.zeros_like(x)
    for step in range(4):
        g = x * (step + 1)
        compensated = (corrected(g, u, compressor.momentum, compressor.average) if compressor.momentum else g) \
            + state["residual"]
        _, _, out = round_trip(compressor, g, state, replace(ctx, step=STEADY_STEP + step))
        torch.testing.assert_close(state["residual"] + out.float(), compensated, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", NAMES)
def test_state_survives_a_checkpoint(method: str) -> None:
    """A parameter's state saved with ``torch.save`` and loaded resumes exactly: the next steps' payloads equal
    those of the state that was never saved (residuals, step counters, warm starts, learned weights)."""
    compressor = make_compressor(method)
    x = grad((96, 64), seed=4)
    ctx = steady(x)
    state = compressor.init_state(x, ctx)
    for step in range(3):
        round_trip(compressor, x * (step + 1), state, replace(ctx, step=step))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for step in range(3, 6):
        kept = round_trip(compressor, x * (step + 1), state, replace(ctx, step=step))
        resumed = round_trip(compressor, x * (step + 1), loaded, replace(ctx, step=step))
        assert all(torch.equal(a, b) for a, b in zip(kept[0], resumed[0], strict=True)), (method, step)
        assert torch.equal(kept[2], resumed[2]), (method, step)


def _wrong_type(default: object) -> object | None:
    """A value of the wrong type for an option whose default is ``default`` (None: no generic wrong value)."""
    if isinstance(default, bool):
        return "yes"
    if isinstance(default, int | float) or default is None:
        return "0.5x"
    if isinstance(default, str):
        return "no-such-choice"
    return None


@pytest.mark.parametrize("method", NAMES)
def test_an_option_of_the_wrong_type_is_refused_with_its_name(method: str) -> None:
    """Each option (a keyword of the method's constructor) given a value of the wrong type raises ValueError naming
    the option, through the configuration as through the class."""
    signature = inspect.signature(METHODS[method].__init__)
    for name, parameter in signature.parameters.items():
        if name == "self" or parameter.default is inspect.Parameter.empty:
            continue
        bad = _wrong_type(parameter.default)
        if bad is None:
            continue
        with pytest.raises(ValueError, match=name):
            make_compressor(method, {name: bad})


@pytest.mark.parametrize("method", NAMES)
def test_an_unknown_option_is_refused_with_the_valid_ones(method: str) -> None:
    signature = inspect.signature(METHODS[method].__init__)
    valid = [name for name in signature.parameters if name != "self" and signature.parameters[name].kind
             is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    with pytest.raises(ValueError, match="no_such_option") as raised:
        make_compressor(method, {"no_such_option": 1})
    for name in valid:
        assert name in str(raised.value), f"{method}: the error does not list the valid option {name!r}"
