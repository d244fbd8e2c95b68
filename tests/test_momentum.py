"""Momentum correction (hvdcomp.error_feedback.MomentumCorrection) on one process: which methods the memory policy
wraps, Signum's and random-k's updates by hand, and the wrapper's contracts. Real ranks: tests/test_accuracy.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hvdcomp import (
    Context,
    EFSignSGD,
    ErrorFeedback,
    FP16Compressor,
    MomentumCorrection,
    NoneCompressor,
    RandomK,
    SignSGD,
    TernGrad,
    make_compressor,
    reductions,
)
from hvdcomp.error_feedback import corrected, with_memory
from hvdcomp.kernels import cpu_kernels


def _ctx(tensor: torch.Tensor, step: int = 0) -> Context:
    return replace(Context.local(tensor), step=step)


@pytest.mark.parametrize(("method", "average"), [("topk", True), ("threshold", True), ("randomk", False),
                                                ("efsignsgd", False)])
def test_methods_with_error_feedback_get_momentum_correction_before_it(method: str, average: bool) -> None:
    compressor = make_compressor(method)
    assert isinstance(compressor, ErrorFeedback) and compressor.applies_momentum
    assert compressor.momentum == 0.9 and compressor.average is average
    plain = make_compressor(method, {"momentum": 0.0})
    assert isinstance(plain, ErrorFeedback) and not plain.applies_momentum, "momentum 0: the optimizer's applies"
    assert not make_compressor("bingrad").applies_momentum and not make_compressor("onebit").applies_momentum


def test_signsgd_gets_momentum_correction_alone_and_the_gain_needs_error_feedback() -> None:
    """signSGD, without error feedback, gets momentum correction alone (Signum). Random-k's and EF-signSGD's gain
    stands in for momentum because their error feedback averages: without it (unbiased random-k, error_feedback:
    false) nothing is wrapped and the optimizer's momentum applies."""
    signum = make_compressor("signsgd")
    assert isinstance(signum, MomentumCorrection) and signum.applies_momentum and type(signum.inner) is SignSGD
    assert isinstance(make_compressor("signsgd", {"momentum": 0.0}), SignSGD)
    assert isinstance(make_compressor("signsgd", error_feedback=False), SignSGD), "false: no memory of any kind"
    assert make_compressor("signsgd", error_feedback=True).average, "Signum with error feedback averages"
    assert isinstance(make_compressor("randomk", {"unbiased": True}), RandomK)
    assert isinstance(make_compressor("efsignsgd", error_feedback=False), EFSignSGD)


def test_a_wrapped_compressor_is_kept_and_checked() -> None:
    for wrapped in (make_compressor("signsgd"), make_compressor("topk")):
        assert with_memory(wrapped) is wrapped
    with pytest.raises(ValueError, match="has no error feedback, but error_feedback: true"):
        with_memory(make_compressor("signsgd"), error_feedback=True)
    assert with_memory(make_compressor("signsgd"), error_feedback=False).applies_momentum, "kept as it is"
    with pytest.raises(ValueError, match="has error feedback, but error_feedback: false"):
        with_memory(make_compressor("randomk"), error_feedback=False)
    with pytest.raises(ValueError, match=r"momentum correction: momentum must be a number in \(0, 1\)"):
        MomentumCorrection(SignSGD(), 1.0)
    with pytest.raises(ValueError, match="has a memory already"):
        MomentumCorrection(make_compressor("topk"), 0.9)
    with pytest.raises(ValueError, match=r"signsgd: momentum must be a number in \[0, 1\)"):
        SignSGD(momentum=1.0)


def test_signum_votes_on_the_sign_of_the_momentum() -> None:
    """Bernstein et al., Algorithm 1: each rank sends sign(u), u <- m u + g (undampened: the scale, ||u||_1 / d, is
    dense momentum SGD's)."""
    compressor = make_compressor("signsgd", {"momentum": 0.5})
    gradients = [torch.tensor([1.0, -2.0, 0.5, 4.0]), torch.tensor([-3.0, 1.0, 0.25, -1.0])]
    state = compressor.init_state(gradients[0], _ctx(gradients[0]))
    u = torch.zeros(4)
    for step, g in enumerate(gradients):
        u = 0.5 * u + g
        payload, meta = compressor.compress(g, state, _ctx(g, step))
        # step 1: u = [-2.5, 0, 0.5, 1]: the zero votes on a coin, the others by the sign of u, not of g
        decoded = compressor.decompress(payload, meta)
        known = u != 0
        assert torch.equal(decoded[known].sign(), u[known].sign())
        torch.testing.assert_close(decoded.abs(), torch.full((4,), u.abs().mean().item()))


def test_random_k_sends_the_gradient_times_the_gain_with_error_feedback() -> None:
    """Random-k keeps the momentum's gain only: what was sent plus the residual is the sum of g / (1 - m)."""
    compressor = make_compressor("randomk", {"ratio": 0.1, "momentum": 0.75})
    gradients = torch.randn(5, 200, generator=torch.Generator().manual_seed(0))
    state = compressor.init_state(gradients[0], _ctx(gradients[0]))
    sent = torch.zeros(200)
    for step, g in enumerate(gradients):
        payload, meta = compressor.compress(g, state, _ctx(g, step))
        sent += compressor.decompress(payload, meta)
        torch.testing.assert_close(sent + state["residual"], gradients[:step + 1].sum(0) * 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_gain_of_a_half_precision_gradient_is_taken_in_float32(dtype: torch.dtype) -> None:
    """EF-signSGD keeps the momentum's gain g / (1 - m): 7,000 x 10 overflows float16 (and bfloat16 rounds the gain),
    so the memory takes it in float32, as for a float32 gradient."""
    g = torch.tensor([7000.0, -1, 0.5, 3, 1, 2, -2, 1])
    results = []
    for tensor in (g.to(dtype), g.to(dtype).float()):
        compressor = make_compressor("efsignsgd")
        state = compressor.init_state(tensor, _ctx(tensor))
        compressor.agree(tensor, state, _ctx(tensor))
        payload, _ = compressor.compress(tensor, state, _ctx(tensor))
        results.append((payload[0], state["residual"]))
    assert torch.isfinite(results[0][1]).all()
    for half, single in zip(*results, strict=True):
        assert torch.equal(half, single)


def test_top_k_accumulates_the_momentum() -> None:
    """DGC's momentum correction without masking: p = e + u, u <- m u + g; what was sent plus the residual is the
    sum of every u so far."""
    compressor = make_compressor("topk", {"ratio": 0.05, "momentum": 0.5})
    gradients = torch.randn(5, 200, generator=torch.Generator().manual_seed(2))
    state = compressor.init_state(gradients[0], _ctx(gradients[0]))
    sent, u, total = torch.zeros(200), torch.zeros(200), torch.zeros(200)
    for step, g in enumerate(gradients):
        u = 0.5 * u + g
        total += u
        payload, meta = compressor.compress(g, state, _ctx(g, step))
        sent += compressor.decompress(payload, meta)
        torch.testing.assert_close(sent + state["residual"], total)


def test_payloads_do_not_alias_the_momentum_and_agreeing_leaves_it() -> None:
    g = torch.randn(64, generator=torch.Generator().manual_seed(1))
    bare = MomentumCorrection(NoneCompressor(), 0.9)
    state = bare.init_state(g, _ctx(g))
    payload, _ = bare.compress(g, state, _ctx(g))
    assert payload[0].data_ptr() != state["momentum"].data_ptr(), "an in-place allreduce would overwrite u"
    payload[0].zero_()
    torch.testing.assert_close(state["momentum"], g)
    for terngrad in (MomentumCorrection(TernGrad(), 0.5), ErrorFeedback(TernGrad(), 0.5)):
        state = terngrad.init_state(g, _ctx(g))
        terngrad.compress(g, state, _ctx(g))
        before, residual = state["momentum"].clone(), state.get("residual", torch.zeros(64))
        request = terngrad.agree(g, state, _ctx(g, 1))
        assert torch.equal(state["momentum"], before), "agree() must not advance the momentum"
        expected = TernGrad().agree(0.5 * before + g + residual, TernGrad().init_state(g, _ctx(g)), _ctx(g, 1))
        torch.testing.assert_close(request.values, expected.values)


def test_two_phase_owners_re_send_without_momentum() -> None:
    """Under two-phase each owner re-compresses the sum of the ranks' chunks: with the bare method (and its own error
    feedback), never with a second momentum."""
    for method, bare in (("signsgd", SignSGD), ("efsignsgd", EFSignSGD)):
        reduction = reductions.make("two_phase", make_compressor(method))
        assert isinstance(reduction._owner, ErrorFeedback) and type(reduction._owner.inner) is bare
        assert not reduction._owner.applies_momentum


@pytest.mark.parametrize("average", [True, False])
def test_the_fused_update_has_the_bits_of_pytorchs_operations(average: bool) -> None:
    """The memory's update in one pass of the CPU kernels (``momentum_step``) rounds as PyTorch's ``mul_``, ``add_``,
    ``add_`` do: u and the residual equal bit for bit, with the residual or u absent too; the gain keeps no u."""
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(6)
    g, u, residual = (torch.randn(40_000, generator=generator) for _ in range(3))
    expected_u = corrected(g, u.clone(), 0.9, average)
    for keep_u, keep_residual in [(True, True), (True, False), (False, True)]:
        if average and not keep_u:
            with pytest.raises(RuntimeError, match="the running average needs its buffer u"):
                kernels.momentum_step(g, None, residual.clone(), 0.9, True)
            continue
        got_u, got_residual = u.clone() if keep_u else None, residual.clone() if keep_residual else None
        kernels.momentum_step(g, got_u, got_residual, 0.9 if average else 1 / (1 - 0.9), average)
        if keep_u:
            assert torch.equal(got_u, expected_u)
        if keep_residual:
            assert torch.equal(got_residual, residual + expected_u)
    with pytest.raises(RuntimeError, match="buffers of 3 elements for a gradient of 40000"):
        kernels.momentum_step(g, torch.zeros(3), None, 0.9, True)
    state = make_compressor("randomk" if not average else "topk").init_state(g, _ctx(g))
    assert ("momentum" in state) is average, "the gain alone keeps nothing from step to step"


MEMORIES = {"topk": lambda: make_compressor("topk"), "dgc": lambda: make_compressor("dgc"),
            "fp16, the gain": lambda: ErrorFeedback(FP16Compressor(), 0.9, average=False),
            "fp16, the momentum alone": lambda: MomentumCorrection(FP16Compressor(), 0.9)}


@pytest.mark.parametrize("method", MEMORIES)
def test_the_memory_on_the_kernels_equals_its_pytorch_path(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps of a method with its memory (error feedback with the running average or the gain, Signum's
    momentum alone, DGC's own): the same payloads and state, bit for bit, with the fused kernels and without. (The
    methods chosen select alike on both paths; fp16 stands in for the sign family and random-k, whose
    PyTorch paths draw or sum apart from their kernels.)"""
    assert cpu_kernels() is not None, "the fused CPU kernels did not build"
    gradients = torch.randn(3, 64, 50, generator=torch.Generator().manual_seed(7))

    def steps() -> list[torch.Tensor]:
        compressor = MEMORIES[method]()
        state = compressor.init_state(gradients[0], _ctx(gradients[0]))
        out = []
        for step, g in enumerate(gradients):
            payload, _ = compressor.compress(g, state, _ctx(g, 1000 + step))
            out += [*payload, *(value for value in state.values() if isinstance(value, torch.Tensor))]
        return out

    fused = steps()
    monkeypatch.setenv("HVDCOMP_KERNELS", "0")
    for index, (expected, got) in enumerate(zip(steps(), fused, strict=True)):
        assert torch.equal(expected, got), f"{method}, output {index}"
