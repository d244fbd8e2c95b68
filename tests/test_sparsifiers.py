"""DGC, threshold and GraVAC on one process: the paper's updates on hand-computed cases, the schedules, and
GraVAC's decision rule on scripted gains and step times (every branch). Real ranks: tests/ranks.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hvdcomp import DGC, Context, GraVAC, Threshold, make_compressor
from hvdcomp.methods.gravac import DENSE
from hvdcomp.methods.threshold import fitted_threshold


def _ctx(tensor: torch.Tensor, step: int = 0, size: int = 1) -> Context:
    return replace(Context.local(tensor), step=step, size=size)


# ------------------------------------------------------------------------------------------- threshold

@pytest.mark.parametrize("density", [0.1, 0.01, 0.001])
@pytest.mark.parametrize("law", ["gaussian", "laplace", "student-t3"])
def test_fitted_threshold_keeps_about_the_density(law: str, density: float) -> None:
    """The multi-stage exponential fit keeps within a factor of 2 of the target (module docstring's table)."""
    torch.manual_seed(0)
    sample = {"gaussian": lambda: torch.randn(10**6),
              "laplace": lambda: torch.distributions.Laplace(0.0, 1.0).sample((10**6,)),
              "student-t3": lambda: torch.distributions.StudentT(3.0).sample((10**6,))}[law]().abs()
    kept = sample.gt(fitted_threshold(sample, density)).float().mean().item()
    assert density / 2 <= kept <= 2 * density, (law, density, kept)


def test_fitted_threshold_leaves_nan_out_on_both_paths(path: str) -> None:
    """A NaN entry is not above any t and adds nothing to the fit (which the optimizer then reports on every rank):
    the fit of the finite entries, on the fused kernels and on the PyTorch path alike."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    finite = fitted_threshold(x, 0.01)
    x[[3, 500]] = float("nan")
    fitted = fitted_threshold(x, 0.01)
    assert torch.isfinite(fitted).all() and fitted.item() == pytest.approx(finite.item(), rel=0.05)
    (values, indices), _ = Threshold(density=0.01).compress(x, {}, _ctx(x))
    assert torch.isfinite(values).all() and not {3, 500} & set(indices.tolist())


def test_fixed_threshold_sends_exactly_the_entries_above_it_up_to_the_cap() -> None:
    x = torch.tensor([0.5, -2.0, 0.1, 3.0, -0.9, 1.5, 0.0, -1.1, 0.2, 0.3])
    compressor = Threshold(threshold=1.0, max_density=1.0)
    (values, indices), meta = compressor.compress(x, {}, _ctx(x))
    assert indices.tolist() == [1, 3, 5, 7] and torch.equal(values, x[[1, 3, 5, 7]])
    assert torch.equal(compressor.decompress([values, indices], meta), x * (x.abs() > 1.0))
    (values, indices), _ = Threshold(threshold=1.0, max_density=0.2).compress(x, {}, _ctx(x))
    assert sorted(indices.tolist()) == [1, 3], "the cap keeps the largest above t"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fixed_threshold_compares_half_gradients_in_float32(dtype: torch.dtype) -> None:
    """t = 1 + 0.75 ulp rounds to 1 + ulp in half precision: compared there, the entry 1 + ulp would not pass."""
    above = 1 + torch.finfo(dtype).eps
    x = torch.tensor([above, 1.0, -above, 0.5], dtype=dtype)
    compressor = Threshold(threshold=1 + 0.75 * torch.finfo(dtype).eps, max_density=1.0)
    (values, indices), _ = compressor.compress(x, {}, _ctx(x))
    assert sorted(indices.tolist()) == [0, 2]
    (values32, indices32), _ = compressor.compress(x.float(), {}, _ctx(x.float()))
    assert torch.equal(indices, indices32) and torch.equal(values.float(), values32)


@pytest.mark.parametrize(("options", "message"), [
    ({"threshold": 1.0, "density": 0.1}, "not both"), ({"threshold": -1.0}, "positive"),
    ({"density": 1.5}, "density must be a number in"), ({"density": 0.1, "max_density": 0.05}, "at least density"),
    ({"threshold": "1"}, "threshold must be a positive finite number")])
def test_threshold_rejects_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_compressor("threshold", options)


# ------------------------------------------------------------------------------------------------ DGC

def test_dgc_momentum_correction_and_factor_masking_by_hand() -> None:
    """Lin et al., Algorithm 1 with momentum correction: u <- m u + g, v <- v + u, send top-k of v, zero u and
    v where sent (factor masking, ``momentum_masking: true``); m = 0.5, one entry of four sent per step."""
    dgc = DGC(density=0.25, momentum=0.5, warmup_densities=[], momentum_masking=True)
    g1, g2, g3 = torch.tensor([1.0, -3.0, 2.0, 0.5]), torch.tensor([1.0, 1.0, 2.0, 0.5]), torch.tensor([0.0] * 4)
    state = dgc.init_state(g1, _ctx(g1))
    sent = []
    for step, g in enumerate((g1, g2, g3)):
        (values, indices), _ = dgc.compress(g, state, _ctx(g, step))
        sent.append((indices.tolist(), values.tolist()))
    # step 0: u = v = g1 = [1, -3, 2, 0.5]: send index 1 (-3); u = v = [1, 0, 2, 0.5]
    # step 1: u = 0.5 [1, 0, 2, 0.5] + g2 = [1.5, 1, 3, 0.75]; v = [2.5, 1, 5, 1.25]: send index 2 (5)
    #         u = [1.5, 1, 0, 0.75], v = [2.5, 1, 0, 1.25]
    # step 2: u = [0.75, 0.5, 0, 0.375]; v = [3.25, 1.5, 0, 1.625]: send index 0 (3.25)
    assert sent == [([1], [-3.0]), ([2], [5.0]), ([0], [3.25])]
    assert state["momentum"].tolist() == [0.0, 0.5, 0.0, 0.375]
    assert state["accumulated"].tolist() == [0.0, 1.5, 0.0, 1.625]


def test_dgc_without_masking_keeps_the_momentum_of_entries_sent() -> None:
    """The default: only v is zeroed where sent; u goes on, so an entry sent in every step moves as under dense
    momentum SGD (with masking it would get g alone: a step 1 / (1 - m) times smaller)."""
    dgc = DGC(density=0.25, momentum=0.5, warmup_densities=[])
    state = dgc.init_state(torch.zeros(4), _ctx(torch.zeros(4)))
    sent = []
    for step in range(3):
        g = torch.tensor([4.0, 1.0, 0.0, 0.0])
        (values, indices), _ = dgc.compress(g, state, _ctx(g, step))
        sent.append((indices.tolist(), values.tolist()))
    # u: 4, 6, 7 at entry 0, sent each step (v = u there); entry 1 accumulates v = 1, 1 + 1.5, 2.5 + 1.75
    assert sent == [([0], [4.0]), ([0], [6.0]), ([0], [7.0])]
    assert state["momentum"].tolist() == [7.0, 1.75, 0.0, 0.0]
    assert state["accumulated"].tolist() == [0.0, 4.25, 0.0, 0.0]


def test_dgc_at_density_one_is_momentum_sgd() -> None:
    """Without masking, sending everything applies u = m u + g each step: what SGD's momentum buffer holds."""
    dgc = DGC(density=1.0, momentum=0.9, warmup_densities=[])
    gradients = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    state = dgc.init_state(gradients[0], _ctx(gradients[0]))
    buffer = torch.zeros(50)
    for step, g in enumerate(gradients):
        payload, meta = dgc.compress(g, state, _ctx(g, step))
        buffer = 0.9 * buffer + g
        torch.testing.assert_close(dgc.decompress(payload, meta), buffer)


def test_dgc_local_clipping_takes_a_ranks_share_of_the_threshold() -> None:
    """The paper's N^-1/2 of the threshold for a rank's share g / N of the summed gradient: g clipped to clip_norm x
    sqrt(N), so that the average of N independent gradients is clipped near clip_norm."""
    g = torch.tensor([3.0, 4.0])  # norm 5; clip_norm 0.5 on 4 ranks: each rank clips to 1
    dgc = DGC(density=1.0, momentum=0.0, warmup_densities=[], clip_norm=0.5)
    (values, _), _ = dgc.compress(g, dgc.init_state(g, _ctx(g)), _ctx(g, size=4))
    torch.testing.assert_close(values.sort().values, torch.tensor([0.6, 0.8]))
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(10_000, generator=generator) for _ in range(16)]  # independent, norm about 100 each
    dgc = DGC(density=1.0, momentum=0.0, warmup_densities=[], clip_norm=5.0)
    clipped = [dgc.decompress(*dgc.compress(x, dgc.init_state(x, _ctx(x)), _ctx(x, size=16))) for x in gradients]
    assert torch.stack(clipped).mean(0).norm().item() == pytest.approx(5.0, rel=0.05)


def test_dgc_follows_the_warmup_schedule() -> None:
    dgc = DGC(density=0.001, warmup_steps=3)  # the paper's stages: 75%, 93.75%, 98.4375%, 99.6%, then 99.9%
    assert [dgc.density_at(step) for step in range(0, 18, 3)] == [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    state = dgc.init_state(x, _ctx(x))
    sizes = [dgc.compress(x, state, _ctx(x, step))[0][0].numel() for step in range(15)]
    assert sizes == [1024] * 3 + [256] * 3 + [64] * 3 + [17] * 3 + [5] * 3, sizes


@pytest.mark.parametrize(("options", "message"), [
    ({"density": 0}, "density"), ({"momentum": 1.0}, "momentum"), ({"warmup_steps": 0}, "warmup_steps"),
    ({"warmup_densities": "0.25"}, "warmup_densities"), ({"clip_norm": -1.0}, "clip_norm"),
    ({"momentum_masking": 1}, "momentum_masking")])
def test_dgc_rejects_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_compressor("dgc", options)


def test_dgc_keeps_its_own_memory() -> None:
    assert isinstance(make_compressor("dgc"), DGC), "DGC takes no generic error feedback"
    with pytest.raises(ValueError, match="own memory"):
        make_compressor("dgc", error_feedback=True)
    assert DGC().applies_momentum and not DGC(momentum=0.0).applies_momentum


# --------------------------------------------------------------------------------------------- GraVAC

def _gravac(**options: object) -> tuple[GraVAC, dict]:
    options = {"candidates": [10, 100, 1000], "warmup_steps": 2, "window": 1, "interval": 2, **options}
    gravac = GraVAC(**options)
    x = torch.zeros(100)
    return gravac, gravac.init_state(x, _ctx(x))


def _sums(current: float, least: float, step_time: float = 1.0) -> list[float]:
    """Agreed sums giving the gains ``current`` and ``least`` (||p||^2 = 1)."""
    return [1.0, current**2, least**2, step_time]


def test_gravac_warmup_sends_the_least_aggressive_candidate() -> None:
    gravac, state = _gravac()
    assert [gravac.decide(state, step, _sums(0.1, 0.1), 1) for step in range(2)] == [0, 0]
    assert state["phase"] == "explore" and state["cf"] == 0


def test_gravac_sends_current_then_least_then_dense_by_epsilon() -> None:
    gravac, state = _gravac(warmup_steps=0, interval=100)
    state["cf"] = 2
    assert gravac.decide(state, 0, _sums(0.8, 0.9), 1) == 2, "gain >= epsilon: the current CF"
    assert gravac.decide(state, 1, _sums(0.5, 0.9), 1) == 0, "current < epsilon <= least: the least CF"
    assert gravac.decide(state, 2, _sums(0.5, 0.6), 1) == DENSE, "both below epsilon: dense"


def test_gravac_smooths_gains_over_a_window_and_restarts_at_a_new_cf() -> None:
    gravac, state = _gravac(warmup_steps=0, interval=100, window=3, alpha=0.5)
    state["cf"] = 1
    decisions = [gravac.decide(state, step, _sums(gain, 0.9), 1) for step, gain in enumerate([1.0, 0.6, 0.6, 0.6])]
    # weights 1, 0.5, 0.25 for ages 0, 1, 2: (0.6 + 0.5)/1.5 = 0.733 (< 0.75) at the second step; the window drops
    # the 1.0 at the fourth
    assert decisions == [1, 0, 0, 0]
    assert state["gains"][0] == [0.6, 0.6, 0.6]
    gravac._switch(state, 2)
    assert state["gains"][0] == [] and len(state["gains"][1]) == 3


def test_gravac_explores_and_stops_when_two_best_are_within_omega() -> None:
    gravac, state = _gravac(warmup_steps=0)
    # candidate 0: gain 1.0 at 1 s/step -> score 1.0; candidate 1: gain 0.98 at 1 s/step -> 0.98 (within 5%)
    for step, (gain, t) in enumerate([(1.0, 1.0), (1.0, 1.0), (0.98, 1.0), (0.98, 1.0)]):
        gravac.decide(state, step, _sums(gain, 1.0, t), 1)
    assert state["scores"][:2] == [pytest.approx(1.0), pytest.approx(0.98)]
    assert state["phase"] == "exploit" and state["cf"] == 1, "the more aggressive of the two best"


def test_gravac_explores_every_candidate_then_keeps_the_best() -> None:
    gravac, state = _gravac(warmup_steps=0)
    # scores: 1.0 (gain 1 at 1 s), 1.6 (0.8 at 0.5 s), 1.0 (0.25 at 0.25 s): never within 5% of the best two
    for step, (gain, t) in enumerate([(1.0, 1.0)] * 2 + [(0.8, 0.5)] * 2 + [(0.25, 0.25)] * 2):
        gravac.decide(state, step, _sums(gain, 1.0, t), 1)
    assert state["scores"] == [pytest.approx(1.0), pytest.approx(1.6), pytest.approx(1.0)]
    assert state["phase"] == "exploit" and state["cf"] == 1
    assert gravac.plan(state) == "cf 100 exploit"


def test_gravac_does_not_time_a_trials_first_step() -> None:
    """A step's reading covers mostly the step before it: under the previous candidate."""
    gravac, state = _gravac(warmup_steps=0, interval=3)
    for step, t in enumerate([100.0, 2.0, 2.0]):
        gravac.decide(state, step, _sums(1.0, 1.0, t), 1)
    assert state["scores"][0] == pytest.approx(0.5)


def test_gravac_step_times_are_the_mean_over_ranks() -> None:
    gravac, state = _gravac(warmup_steps=0)
    for step in range(2):
        gravac.decide(state, step, _sums(1.0, 1.0, 8.0), 4)  # 4 ranks, 2 s each
    assert state["scores"][0] == pytest.approx(0.5)


@pytest.mark.parametrize(("options", "message"), [
    ({"method": "fp16"}, "ratio knob"), ({"method": "topk", "options": {"ratio": 0.1}}, "leave it out"),
    ({"candidates": [0.5]}, "compression factors > 1"), ({"epsilon": 0}, "epsilon"), ({"interval": 0}, "interval"),
    ({"method": "qsgd", "candidates": [3]}, "qsgd's payloads compress 3.97x to 15.5x .* none within 25% of CF 3"),
    ({"method": "orq", "candidates": [8, 9]}, r"come nearest the bit widths \[3, 3\]"),
    ({"method": "randomk"}, "randomk keeps about 1/sqrt.*0.316 at CF 10.* under epsilon 0.75"),
    ({"method": "randomk", "candidates": [2, 10], "epsilon": 0.5}, "under epsilon 0.5 at CFs 10: it would never"),
    ({"method": "qsgd", "options": {"bucket_size": 7}}, "qsgd: bucket_size must be a positive multiple of 8"),
    ({"options": {"ratioo": 0.1}}, "unknown option 'ratioo'"),
    ({"method": "randomk", "options": {"unbiased": True}}, "unbiased"), ({"interval": 1}, "interval"),
    ({"options": [1]}, "mapping")])
def test_gravac_rejects_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_compressor("gravac", options)


@pytest.mark.parametrize("method", ["topk", "randomk", "threshold", "dgc", "qsgd", "orq"])
def test_gravac_wraps_each_method_with_a_knob(method: str) -> None:
    """Each candidate compresses at its CF; the memory keeps what was not sent (p = sent + memory)."""
    gravac = make_compressor("gravac", {"method": method, "options": {"momentum": 0.0} if method == "dgc" else {},
                                        **({"candidates": [4, 10], "epsilon": 0.3} if method == "randomk" else {})})
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    state = gravac.init_state(x, _ctx(x))
    payload, meta = gravac.compress(x, state, _ctx(x))
    decoded = gravac.decompress(payload, meta)
    memory = state["memory"]["accumulated" if method == "dgc" else "residual"]
    torch.testing.assert_close(decoded.reshape(-1) + memory, x)


def test_gravac_over_randomk_warns_as_random_k_without_its_momentum_correction() -> None:
    risk = GraVAC(method="randomk", candidates=[2, 4], epsilon=0.5).accuracy_risk()
    assert risk is not None and risk.startswith("gravac over randomk keeps no momentum correction: random-k with "
                                                "error feedback under the optimizer's momentum diverges"), risk
    assert GraVAC().accuracy_risk() is None


@pytest.mark.parametrize(("method", "widths"), [("qsgd", [8, 4, 2]), ("orq", [5, 3, 2])])
def test_gravac_quantizers_compress_near_their_cf_and_gain_less_as_they_compress_more(method: str,
                                                                                        widths: list[int]) -> None:
    """A quantizer candidate takes the bit width whose payload (its buckets' tables included: ORQ's 2^bits levels
    a bucket) compresses nearest its CF. Its gain is the part of p that its error leaves: at most 1, and smaller the
    more it compresses (||C(p)|| / ||p|| grows instead: an unbiased quantizer's variance adds to it)."""
    gravac = GraVAC(method=method, candidates=[4, 8, 16])
    assert [c.bits for c in gravac._compressors] == widths
    p = torch.randn(512 * 64, generator=torch.Generator().manual_seed(0))
    state = gravac.init_state(p, _ctx(p))
    gains, norms = [], []
    for index, cf in enumerate(gravac.candidates):
        payload, meta = gravac.encode(index, p, state, _ctx(p))
        assert 4 * p.numel() / sum(t.numel() * t.element_size() for t in payload) == pytest.approx(cf, rel=0.25)
        error = gravac.measured(index, p, payload, meta).square().sum().item()
        fresh = gravac.init_state(p, _ctx(p))
        gravac.decide(fresh, 0, [p.square().sum().item(), error, error, 1.0], 1)
        gains.append(fresh["last"]["gain"])
        norms.append(gravac.compressor(index).decompress(payload, meta).norm().item() / p.norm().item())
    assert all(0 <= g <= 1 for g in gains) and gains == sorted(gains, reverse=True) and gains[0] > 0.99, gains
    if method == "qsgd":
        assert norms[-1] > 1.2, "||C(p)|| / ||p||, the sparsifiers' gain, grows with the CF"


def test_train_sets_epoch_counted_options_where_not_given() -> None:
    """DGC's warm-up stage and GraVAC's exploration interval are an epoch in their papers: hvdcomp train sets
    them to its steps per epoch, at the top level and in overrides (inheriting as the config does)."""
    from hvdcomp.tools.train import with_epochs

    assert with_epochs("dgc", 22) == {"method": "dgc", "options": {"warmup_steps": 22}}
    assert with_epochs({"method": "dgc", "options": {"warmup_steps": 5}}, 22)["options"] == {"warmup_steps": 5}
    assert with_epochs({"method": "topk", "overrides": [{"match": "*", "method": "dgc"}]}, 22)["overrides"] == [
        {"match": "*", "method": "dgc", "options": {"warmup_steps": 22}}]
    config = with_epochs({"method": "gravac", "overrides": [{"match": "a", "options": {"epsilon": 0.5}}]}, 22)
    assert config["overrides"][0]["options"] == {"interval": 22, "epsilon": 0.5}
    assert with_epochs("topk", 22) == {"method": "topk"}
    assert with_epochs({"method": "lgc", "options": {"train_epochs": 2, "dense_steps": 5}}, 22)["options"] == {
        "dense_steps": 5, "train_steps": 44}
    assert with_epochs({"method": "gravac", "options": {"interval_epochs": 0.5}}, 22)["options"] == {"interval": 11}
    assert with_epochs({"method": "dgc", "options": [1]}, 22) == {"method": "dgc", "options": [1]}, "left to the config"
    # under --elastic an epoch's steps change with the world: the methods' step defaults stay, epochs are refused
    assert with_epochs("dgc", None) == {"method": "dgc"}
    assert with_epochs({"method": "gravac", "options": {"epsilon": 0.5}}, None) == {"method": "gravac",
                                                                                     "options": {"epsilon": 0.5}}
    with pytest.raises(ValueError, match=r"gravac's interval_epochs: under --elastic .* give interval"):
        with_epochs({"method": "gravac", "options": {"interval_epochs": 1}}, None)


def test_train_gives_sgds_momentum_by_world_to_parameters_whose_method_applies_its_own() -> None:
    """hvdcomp train's SGD: the parameters DGC compresses (it applies momentum itself) have momentum 0 where ranks
    reduce, and SGD's 0.9 on one rank, which reduces nothing; an elastic reset sets it for the new world (a job
    started on one rank and grown would fail the optimizer's momentum check, and one shrunk to one rank would train
    without momentum)."""
    from torch import nn

    from hvdcomp.tools.train import follow_world, sgd

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))  # DGC compresses the 4,096-element weight only

    def momenta(optimizer: torch.optim.Optimizer) -> dict[int, float]:
        return {len(group["params"]): group["momentum"] for group in optimizer.param_groups}

    alone, together = sgd(model, "dgc", 0.1, 1), sgd(model, "dgc", 0.1, 4)
    assert momenta(alone) == {1: 0.9, 3: 0.9} and momenta(together) == {1: 0.0, 3: 0.9}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    alone.step()
    follow_world(alone, 2)
    follow_world(together, 1)
    assert momenta(alone) == {1: 0.0, 3: 0.9} and momenta(together) == {1: 0.9, 3: 0.9}
    # the group turned to 0 keeps no momentum buffer (a rank joining the job has none for it)
    assert set(alone.state) == {p for name, p in model.named_parameters() if name != "0.weight"}
