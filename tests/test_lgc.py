"""LGC on one process: options, which tensors it takes, its stage schedule, its autoencoder's training, its memory.
The stages on real ranks (both variants, replicas and autoencoders identical, the guard, resume) are tests/ranks.py's
``lgc`` scenario; training digits within a point of dense, its ``digits`` scenario."""

from __future__ import annotations

import math

import pytest
import torch

from hvdcomp import CompressionConfig, Context
from hvdcomp.methods.lgc import LGC


@pytest.mark.parametrize(("options", "message"), [
    ({"variant": "tree"}, "variant must be one of ring, ps"),
    ({"ratio": 0}, "ratio must be a number in"),
    ({"innovation_ratio": 1.5}, "innovation_ratio must be a number in"),
    ({"train_steps": 0}, "train_steps must be a positive integer"),
    ({"downsample": 0}, "downsample must be a positive integer"),
    ({"lr": 0}, "lr must be a positive finite number"),
    ({"max_error": -1}, "max_error must be a non-negative finite number"),
    ({"dense_edges": "yes"}, "dense_edges must be true or false"),
])
def test_lgc_rejects_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LGC(**options)


def test_small_tensors_and_the_models_edges_stay_dense_and_say_why() -> None:
    config = CompressionConfig.parse({"method": "lgc", "min_numel": 0})
    small = config.choose("fc.weight", (10, 64), 2)  # k = 7 < 64
    assert small.reduction is None
    assert small.declined == ("lgc: a tensor of shape (10, 64) has 7 top-k values (ratio 0.01), fewer than the "
                              "encoder's minimum of 64 (4 x 2^downsample)")
    edge = config.choose("conv1.weight", (512, 64), 2, edge=True)
    assert edge.reduction is None and "first and last layers dense" in edge.declined
    assert config.choose("conv2.weight", (512, 64), 2).reduction is not None
    assert CompressionConfig.parse({"method": "lgc", "options": {"dense_edges": False}}).choose(
        "conv1.weight", (512, 64), 2, edge=True).reduction is not None
    assert CompressionConfig.parse("topk").choose("conv1.weight", (512, 64), 2, edge=True).reduction is not None


def test_stages_follow_the_step_and_the_guard() -> None:
    method = LGC(dense_steps=3, train_steps=2)
    state = {"retrain_until": 0}
    assert [method.stage(state, step) for step in range(7)] == [1, 1, 1, 2, 2, 3, 3]
    state["retrain_until"] = 9  # the guard fired at step 7
    assert [method.stage(state, step) for step in range(7, 11)] == [2, 2, 3, 3]


def test_weights_come_from_the_shared_seed() -> None:
    method = LGC(variant="ps")
    a, b, c = method.init_weights(3, 7), method.init_weights(3, 7), method.init_weights(3, 8)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert not all(torch.equal(a[key], c[key]) for key in a)
    assert {key.split(".")[1] for key in a if key.startswith("decoder")} == {"0", "1", "2"}  # one decoder per rank


@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_the_autoencoder_learns_a_common_part(variant: str) -> None:
    """Ranks whose values share a smooth common part (plus their own noise): training lowers the reconstruction
    error well below what the untrained autoencoder gives."""
    torch.manual_seed(0)
    method = LGC(variant=variant)
    ranks, k = 4, 512
    state = {"ae": method.init_weights(ranks, 1), "last": {}}
    state["adam"] = {"t": 0, "m": {n: torch.zeros_like(w) for n, w in state["ae"].items()},
                     "v": {n: torch.zeros_like(w) for n, w in state["ae"].items()}}
    position = torch.linspace(0, 1, k)

    def batch() -> torch.Tensor:
        frequency, phase = torch.rand(2) * torch.tensor([6.0, 6.28])
        common = torch.sin(2 * math.pi * frequency * position + phase)
        return common + 0.1 * torch.randn(ranks, k)

    losses = []
    for step in range(300):
        method.train_step(state, batch(), step % ranks)
        losses.append(state["last"]["loss"][0].item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.3 * first, (variant, first, last)


@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_one_rank_keeps_what_it_did_not_send(variant: str) -> None:
    """compress() alone (benchmarks, profiles): the decoded values sit at the top-k indices only, and the memory
    holds the rest exactly: memory + decoded = gradient + previous memory."""
    method = LGC(variant=variant, ratio=0.05)
    grad = torch.randn(96, 64, generator=torch.Generator().manual_seed(2))
    ctx = Context.local(grad, seed=1)
    state = method.init_state(grad, ctx)
    payload, meta = method.compress(grad, state, ctx)
    decoded = method.decompress(payload, meta).reshape(-1)
    indices = payload[0].long()
    assert indices.numel() == method.k(grad.numel()) == 308 and bool((indices[1:] > indices[:-1]).all())
    outside = torch.ones(grad.numel(), dtype=torch.bool)
    outside[indices] = False
    assert bool((decoded[outside] == 0).all())
    torch.testing.assert_close(state["residual"] + decoded, grad.reshape(-1), rtol=0, atol=1e-6)


def test_the_guard_acts_on_the_moving_average_of_the_errors() -> None:
    """One bad step does not send a tensor back to stage 2; errors that stay above the bound do, for train_steps
    steps, and the average starts afresh in the next stage 3."""
    method = LGC(max_error=0.9, train_steps=5)
    state = {"retrain_until": 0, "fallbacks": 0, "smoothed_error": None, "last": {}}

    def step(number: int, relative: float) -> None:
        method.guard(state, number, torch.tensor([relative ** 2 * 4.0, 4.0]))

    step(10, 0.5)
    step(11, 1.5)  # average 0.75
    assert state["fallbacks"] == 0 and state["last"]["error"] == pytest.approx(1.5)
    for number in range(12, 20):
        step(number, 1.5)
        if state["fallbacks"]:
            break
    assert number == 12 and state["retrain_until"] == 18  # 0.75 -> 0.94: past 0.9 at step 12
    assert state["smoothed_error"] is None


def test_edges_are_the_first_and_last_layers() -> None:
    from hvdcomp.config import edges

    names = ["conv1.weight", "conv1.bias", "layer1.0.conv.weight", "fc.weight", "fc.bias"]
    assert edges(names) == {"conv1.weight", "conv1.bias", "fc.weight", "fc.bias"}
    assert edges(["w"]) == {"w"} and edges([]) == set()


def test_the_leaders_indices_are_wide_enough_for_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's top-k indices take top-k's index type for the tensor's size (int64 from 2^31 elements, where
    int32 would wrap to negative indices), stood in for here by a small tensor."""
    from hvdcomp.methods import lgc

    p = torch.randn(4096)
    assert LGC().select(p, 64)[0].dtype == torch.int32
    monkeypatch.setattr(lgc, "index_dtype", lambda numel: torch.int64 if numel == p.numel() else torch.int32)
    indices = LGC().select(p, 64)[0]
    assert indices.dtype == torch.int64 and torch.equal(indices, p.abs().topk(64).indices.sort().values)
