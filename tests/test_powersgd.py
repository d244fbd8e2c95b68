"""PowerSGD in one process: orthogonalization, which tensors it compresses, exactness on low-rank matrices,
memory, options. The comparison with PyTorch's own hook on real ranks is tests/ranks.py powersgd_reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import nearly_parallel

from hvdcomp import CompressionConfig, Context, ErrorFeedback, PowerSGD
from hvdcomp.error_feedback import with_memory
from hvdcomp.methods.powersgd import orthogonalize
from hvdcomp.requests import run_one_rank


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns(rank: int) -> None:
    matrix = torch.randn(50, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    q = orthogonalize(matrix.clone())
    torch.testing.assert_close(q.t() @ q, torch.eye(rank, dtype=torch.float64))


def test_nearly_parallel_columns_come_out_orthonormal() -> None:
    """Where the second column's projection leaves little but rounding, one Gram-Schmidt pass normalizes that
    rounding (in any direction, along the first column too: P P^T M then scales M up to 2x); projected twice it is
    orthonormal."""
    got = orthogonalize(nearly_parallel())
    eye = torch.eye(2).expand(50, 2, 2)
    torch.testing.assert_close(got.transpose(-2, -1) @ got, eye, atol=1e-5, rtol=0)


def test_a_rank_one_matrix_at_rank_two_is_recovered_not_amplified() -> None:
    """PowerSGD at rank 2 on rank-1 matrices: each decodes to itself (its approximation a projection, never above it),
    and the residual stays near zero."""
    compressor = PowerSGD(rank=2)
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        matrix = torch.randn(300, 1, generator=generator) @ torch.randn(1, 200, generator=generator)
        ctx = Context.local(matrix)
        state = compressor.init_state(matrix, ctx)
        payload, meta = compressor.compress(matrix, state, ctx)
        torch.testing.assert_close(compressor.decompress(payload, meta), matrix, rtol=1e-4, atol=1e-4)
        assert state["residual"].abs().max() < 1e-4 * matrix.abs().max(), seed


@pytest.mark.parametrize("rows", [2, 3, 40])
@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
@pytest.mark.parametrize("zero", [[0], [1], [0, 1]])
def test_a_zero_column_becomes_its_spare(zero: list[int], epsilon: float, rows: int) -> None:
    """A zero column (a layer no rank used) becomes its spare signs, so orthonormalized: not NaN (PyTorch's hook at
    epsilon 0), not zero (for good, under the warm start), not parallel to the other (2 rows too); a column that is
    not zero is orthonormalized as ever."""
    matrix = torch.randn(2, rows, 2, generator=torch.Generator().manual_seed(1))
    matrix[1][:, zero] = 0
    got = orthogonalize(matrix.clone(), epsilon)
    eye = torch.eye(2).expand(2, 2, 2)
    torch.testing.assert_close(got.transpose(-2, -1) @ got, eye, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[0], orthogonalize(matrix[0].clone(), epsilon))  # the batch's other matrix
    if zero == [1]:
        torch.testing.assert_close(got[1][:, 0], matrix[1][:, 0] / (matrix[1][:, 0].norm() + epsilon))


@pytest.mark.parametrize("epsilon", [0.0, 1e-3, 0.5])
def test_a_matrix_beside_a_zero_one_orthogonalizes_as_alone(epsilon: float) -> None:
    """Alone, on CPU tensors, a matrix without a zero column skips its spares' operations; in a batch beside a zero
    matrix it goes through them, and comes out the same, bit for bit, epsilon included."""
    matrix = torch.randn(2, 40, 2, generator=torch.Generator().manual_seed(3))
    matrix[1] = 0
    got = orthogonalize(matrix.clone(), epsilon)
    assert torch.equal(got[0], orthogonalize(matrix[0].clone(), epsilon))


def test_a_step_of_zero_gradients_does_not_stop_compression() -> None:
    """A step where M is zero (the zero step of hvd.broadcast_optimizer_state, or a layer without a gradient yet) makes
    P and Q zero; under the warm start a zero Q made P = M Q zero in every step after, sending nothing while the
    residual grew. With the spare columns the next steps approximate M again."""
    compressor = PowerSGD(rank=2, start_iter=0)
    ctx = Context.local(torch.zeros(30, 20), seed=5, name="w")
    state = compressor.init_state(torch.zeros(30, 20), ctx)
    payload, meta = compressor.compress(torch.zeros(30, 20), state, ctx)
    assert not compressor.decompress(payload, meta).any()
    generator = torch.Generator().manual_seed(2)
    low_rank = torch.randn(30, 2, generator=generator) @ torch.randn(2, 20, generator=generator)
    for step in range(1, 4):
        payload, meta = compressor.compress(low_rank, state, replace(ctx, step=step))
        approximation = compressor.decompress(payload, meta)
        assert approximation.norm() > 0.5 * low_rank.norm(), f"step {step}: {approximation.norm()}"


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
    for error_feedback in (True, False):  # (false would be ignored: its own option is error_feedback in options)
        with pytest.raises(ValueError, match="keeps its own memory"):
            CompressionConfig.parse({"method": "powersgd", "error_feedback": error_feedback})
    with pytest.raises(ValueError, match="keeps its own memory"):
        ErrorFeedback(PowerSGD())
    no_memory = PowerSGD(error_feedback=False)
    assert "residual" not in no_memory.init_state(torch.zeros(8, 8), Context.local(torch.zeros(8, 8)))


@pytest.mark.parametrize(("options", "message"), [
    ({"rank": 0}, "rank must be a positive integer"),
    ({"start_iter": -1}, "start_iter must be a non-negative integer"),
    ({"min_compression_rate": 0}, "min_compression_rate must be a positive finite number"),
    ({"warm_start": "yes"}, "warm_start must be true or false"),
    ({"orthogonalization_epsilon": -1e-8}, "orthogonalization_epsilon must be a non-negative finite number"),
])
def test_bad_options_are_rejected(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PowerSGD(**options)


@pytest.mark.parametrize("warm_start", [True, False])
def test_a_batch_of_one_shape_gives_each_matrix_what_it_gets_alone(warm_start: bool) -> None:
    """``batch_tensors_with_same_shape``: the stacked products and orthogonalizations give each matrix its own sum,
    residual and next Q, as if reduced alone (to float rounding), step after step; during the warm-up the batch is
    summed densely."""
    from hvdcomp.methods.powersgd import PowerSGDReduction

    generator = torch.Generator().manual_seed(1)
    shape = (40, 6, 5)  # viewed as 40 x 30
    alone = PowerSGDReduction(PowerSGD(start_iter=1, warm_start=warm_start))
    batched = PowerSGDReduction(PowerSGD(start_iter=1, warm_start=warm_start, batch_tensors_with_same_shape=True))
    assert alone.batch_key(torch.zeros(shape)) is None
    assert batched.batch_key(torch.zeros(shape)) == batched.batch_key(torch.zeros(shape)) \
        != batched.batch_key(torch.zeros(40, 30))
    contexts = [Context.local(torch.zeros(shape), seed=3, name=f"w{i}") for i in range(3)]
    states_alone = [alone.init_state(torch.zeros(shape), ctx) for ctx in contexts]
    states_batched = [batched.init_state(torch.zeros(shape), ctx) for ctx in contexts]
    for step in range(4):
        grads = [torch.randn(shape, generator=generator) for _ in contexts]
        steps = [replace(ctx, step=step) for ctx in contexts]
        expected = [run_one_rank(alone.reduce(grad.clone(), state, ctx))
                    for grad, state, ctx in zip(grads, states_alone, steps, strict=True)]
        got = run_one_rank(batched.reduce_batch([grad.clone() for grad in grads], states_batched, steps))
        for mine, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(states_batched, states_alone, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batched", [False, True])
def test_a_bucket_gives_each_matrix_what_it_gets_alone(batched: bool) -> None:
    """``bucket_cap_mb``: a bucket of matrices of several shapes (two of one shape; one channels-last, as a conv
    weight's gradient may be) gives each its own sum, residual and next Q, as if reduced alone with its member's
    context (to float rounding), step after step, in one allreduce of the dense gradients during the warm-up and two
    allreduces (every P, then every Q) after it, each of contiguous tensors, as Horovod needs."""
    from hvdcomp.methods.powersgd import PowerSGDReduction

    generator = torch.Generator().manual_seed(2)
    shapes = [(40, 6, 5), (24, 3, 2, 2), (40, 6, 5), (16, 20)]
    reduction = PowerSGDReduction(PowerSGD(start_iter=1, batch_tensors_with_same_shape=batched))
    ctx = Context.local(torch.zeros(1), seed=3, name="bucket")
    members = [ctx.derive("member", i) for i in range(len(shapes))]
    bucket = reduction.init_bucket_state([torch.zeros(shape) for shape in shapes], ctx)
    alone = [reduction.init_state(torch.zeros(shape), member) for shape, member in zip(shapes, members, strict=True)]
    for step in range(4):
        grads = [torch.randn(shape, generator=generator) for shape in shapes]
        grads[1] = grads[1].to(memory_format=torch.channels_last)
        expected = [run_one_rank(reduction.reduce(grad.clone(), state, replace(member, step=step)))
                    for grad, state, member in zip(grads, alone, members, strict=True)]
        steps = reduction.reduce_bucket([grad.clone() for grad in grads], bucket, replace(ctx, step=step))
        allreduces = 0
        request = next(steps)
        try:
            while True:
                allreduces += 1
                assert all(tensor.is_contiguous() for tensor in request.tensors), step
                request = steps.send(request.tensors)
        except StopIteration as done:
            got = done.value
        assert allreduces == (1 if step == 0 else 2), (step, allreduces)
        for mine, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(mine, theirs.reshape(-1), rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(bucket["members"], alone, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_the_warm_up_sums_copies_and_leaves_the_gradients_as_they_are() -> None:
    """During the dense warm-up a gradient (alone, or a bucket's) goes to the allreduce as a copy: Horovod sums in
    place, in the background, and p.grad must not change under a reader before synchronize() writes the average."""
    from hvdcomp.methods.powersgd import PowerSGDReduction

    reduction = PowerSGDReduction(PowerSGD(start_iter=1))
    grads = [torch.randn(8, 6), torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)]
    before = [grad.clone() for grad in grads]
    ctx = Context.local(grads[0], seed=1)
    for steps in (reduction.reduce(grads[0], reduction.init_state(grads[0], ctx), ctx),
                  reduction.reduce_bucket(grads, reduction.init_bucket_state(grads, ctx), ctx)):
        request = next(steps)
        for tensor in request.tensors:
            tensor.mul_(2)  # a sum over two ranks of equal gradients, in place, as Horovod's
        with pytest.raises(StopIteration):
            steps.send(request.tensors)
    for grad, original in zip(grads, before, strict=True):
        assert torch.equal(grad, original)


def test_batch_option_is_checked() -> None:
    with pytest.raises(ValueError, match="batch_tensors_with_same_shape must be true or false"):
        PowerSGD(batch_tensors_with_same_shape=1)
