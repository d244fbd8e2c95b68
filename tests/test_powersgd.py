"""PowerSGD in one process: orthogonalization, which tensors it compresses, exactness on low-rank matrices,
memory, options. The comparison with PyTorch's own hook on real ranks is tests/ranks.py powersgd_reference."""

from __future__ import annotations

import pytest
import torch

from hvdcomp import CompressionConfig, Context, ErrorFeedback, PowerSGD
from hvdcomp.error_feedback import with_memory
from hvdcomp.methods.powersgd import orthogonalize


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns(rank: int) -> None:
    matrix = torch.randn(50, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    q = orthogonalize(matrix.clone())
    torch.testing.assert_close(q.t() @ q, torch.eye(rank, dtype=torch.float64))


def test_a_zero_column_stays_zero_without_epsilon() -> None:
    matrix = torch.zeros(10, 2)
    assert torch.equal(orthogonalize(matrix), torch.zeros(10, 2)), "0/0 would poison the gradient with NaN"


def test_compresses_what_pytorch_compresses() -> None:
    compressor = PowerSGD(rank=2)
    assert compressor.compresses(torch.Size([96, 32]))  # (96 + 32) 2 x 2 = 512 < 3072
    assert compressor.compresses(torch.Size([64, 16, 3, 3]))  # rows x the rest: 64 x 144
    assert not compressor.compresses(torch.Size([10, 3]))  # (10 + 3) 2 x 2 = 52 >= 30
    assert not compressor.compresses(torch.Size([100_000]))  # 1-D tensors never
    config = CompressionConfig.parse({"method": "powersgd", "min_numel": 0})
    assert config.choose("bias", (100_000,), 2).reduction is None, "1-D tensors go Horovod's dense way"
    assert config.choose("w", (96, 32), 2).reduction.name == "powersgd"
    assert config.choose("w", (96, 32), 8).reduction.name == "powersgd", "its own reduction, at any size"


def test_one_rank_recovers_a_low_rank_matrix_and_remembers_the_rest() -> None:
    generator = torch.Generator().manual_seed(0)
    low_rank = torch.randn(60, 2, generator=generator) @ torch.randn(2, 40, generator=generator)
    compressor = PowerSGD(rank=2)
    ctx = Context.local(low_rank)
    state = compressor.init_state(low_rank, ctx)
    payload, meta = compressor.compress(low_rank, state, ctx)
    assert [p.shape for p in payload] == [torch.Size([60, 2]), torch.Size([40, 2])]
    torch.testing.assert_close(compressor.decompress(payload, meta), low_rank, rtol=1e-4, atol=1e-4)
    assert state["residual"].abs().max() < 1e-4
    full_rank = torch.randn(60, 40, generator=generator)
    payload, meta = compressor.compress(full_rank, state, ctx)
    torch.testing.assert_close(state["residual"] + compressor.decompress(payload, meta), full_rank,
                               rtol=0, atol=1e-4)


def test_own_memory_takes_no_generic_error_feedback() -> None:
    chosen = CompressionConfig.parse("powersgd").choose("w", (96, 32), 2).compressor
    assert isinstance(chosen, PowerSGD)
    assert isinstance(with_memory(PowerSGD()), PowerSGD)
    with pytest.raises(ValueError, match="keeps its own memory"):
        CompressionConfig.parse({"method": "powersgd", "error_feedback": True})
    with pytest.raises(ValueError, match="keeps its own memory"):
        ErrorFeedback(PowerSGD())
    no_memory = PowerSGD(error_feedback=False)
    assert "residual" not in no_memory.init_state(torch.zeros(8, 8), Context.local(torch.zeros(8, 8)))


@pytest.mark.parametrize(("options", "message"), [
    ({"rank": 0}, "rank must be a positive integer"),
    ({"start_iter": -1}, "start_iter must be a non-negative integer"),
    ({"min_compression_rate": 0}, "min_compression_rate must be a positive number"),
    ({"warm_start": "yes"}, "warm_start must be true or false"),
    ({"orthogonalization_epsilon": -1e-8}, "orthogonalization_epsilon must be a non-negative number"),
])
def test_bad_options_are_rejected(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PowerSGD(**options)
