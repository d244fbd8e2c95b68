"""PowerSGD: low-rank gradient compression by one step of power iteration (Vogels, Karimireddy and Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019,
arXiv:1905.13727), as PyTorch's DDP communication hook ``powerSGD_hook`` implements it (per layer).

Each gradient of ``n`` rows is viewed as a matrix M (n x m). Algorithm 1 of the paper, with the previous
step's Q as the start (warm start) and error feedback:

    M <- M + E                       (error feedback: the residual of the last step)
    P <- M Q;        P <- sum over ranks (allreduce);   P <- orthogonalize(P)
    Q <- M^T P;      Q <- mean over ranks (allreduce)
    M_hat = P Q^T                    (the same on every rank: the averaged, rank-r approximation)
    E <- M - M_hat

Two allreduces of (n + m) r values per step instead of n m: the sum of P and Q over ranks is exact, so this
is an allreduce-compatible (linear) compressor, and it owns its reduction (:class:`PowerSGDReduction`):
computation runs between the two collectives. The memory is its own (E above, which is the *local*
input less the *averaged* approximation, as in PyTorch's hook), so no generic error feedback is added.

Knobs, as PyTorch's ``PowerSGDState`` names them where they exist:

* ``rank`` (``matrix_approximation_rank``): r, the approximation's rank; higher is more accurate and sends
  more (the paper: rank 2 matches full-precision SGD on CIFAR-10 ResNet-18; default 2).
* ``start_iter`` (``start_powerSGD_iter``): steps of plain (dense) allreduce before compression starts, a
  warm-up that protects early training (PyTorch defaults to 1000 and suggests about 10% of training; here
  10, since the shipped workloads train for a few hundred steps). The switch happens at the same step on
  every rank (the step counter is part of the plan).
* ``min_compression_rate``: a matrix is compressed only where (n + m) r x rate < n m; others, and every 1-D
  tensor, go through Horovod's fused dense allreduce (PyTorch's hook batches them into one allreduce of
  its own; Horovod's tensor fusion does the same). Default 2, as PyTorch.
* ``error_feedback`` (``use_error_feedback``): keep E (default on; the paper needs it to converge).
* ``warm_start``: reuse last step's Q (default on); off draws a new Q every step from the shared seed.
* ``orthogonalization_epsilon``: added to each column's norm in Gram-Schmidt (PyTorch's default 0). A column that
  is zero (a layer no rank used) is replaced by fixed signs (:func:`gram_schmidt`), where PyTorch's hook makes it NaN,
  or zero for good under the warm start.
* ``batch_tensors_with_same_shape``: the matrices of one shape are compressed together, as one batch (PyTorch's
  option of that name): each step's products, orthogonalizations and error-feedback updates run once per shape, not
  once per layer, and each of the two allreduces carries one tensor per shape. On a GPU that cuts the launches per
  layer (a ResNet-50 has up to 6 weights of each shape in a stage); the price is overlap: a batch starts when the last
  of its gradients is ready in backward, so the first ones wait for it. Off by default, as in PyTorch. The optimizer
  forms the batches (:meth:`PowerSGDReduction.batch_key`), the same on every rank.

With the config's ``bucket_cap_mb`` the optimizer hands PowerSGD each bucket of matrices once its last gradient is
ready, and it reduces the bucket as PyTorch's hook reduces a DDP bucket: each matrix factored on its own (with
``batch_tensors_with_same_shape``, the bucket's matrices of one shape as one batch), the Ps of the whole bucket summed
in one allreduce and its Qs in another. A step's Ps lie side by side in one buffer, the allreduce's one tensor, and so
do its Qs: on CUDA each buffer's matrices are orthonormalized in one launch, whatever their shapes, where all have one
rank r <= 2, and each of the step's products (M Q, M^T P, and P Q^T with the residual's update) is one launch for all of
its matrices where all have one rank r <= 4 and sides of at most 16,384 (:mod:`hvdcomp.kernels.gpu.lowrank`): a bucket's
step is then a dozen launches, not three or more a matrix. Those products sum in another order than cuBLAS's, so the two
agree to float rounding; every rank runs the same kernels.

Orthogonalization is Gram-Schmidt for r <= 2 and QR above (as PyTorch). The first Q is drawn from the
parameter's rank-independent seed, so every rank starts from the same Q with no broadcast.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Generator, Hashable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from hvdcomp import check
from hvdcomp.compressor import Compressor, Context, State, derive_seed
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.reductions import MEMBERS, Phase, ReductionMethod
from hvdcomp.requests import Allreduce, Reduction, dense_copy, run_one_rank
from hvdcomp.wire import Payload

_generators: dict[torch.device, torch.Generator] = {}
#: matrices factored together (:meth:`PowerSGD.power_step`): tensors of one shape, their states and contexts
Group = tuple[Sequence[torch.Tensor], Sequence[State], Sequence[Context]]

if TYPE_CHECKING:
    from hvdcomp.perfmodel.schema import Encoded


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalizes the columns of ``matrix`` (n x r, or each matrix of a batch b x n x r) in place: Gram-Schmidt
    for r <= 2, QR above. On CUDA tensors Gram-Schmidt is one Triton launch (:mod:`hvdcomp.kernels.gpu.lowrank`)."""
    rank = matrix.shape[-1]
    if rank > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        matrix.copy_(torch.linalg.qr(matrix).Q)
        return matrix
    kernels = kernels_for(matrix.device)
    if is_triton(kernels) and matrix.dtype == torch.float32 and matrix.is_contiguous():
        return kernels.orthogonalize(matrix, epsilon)
    return gram_schmidt(matrix, epsilon)


@functools.lru_cache(maxsize=256)
def spare_columns(n: int, rank: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gram-Schmidt's stand-ins for zero columns of matrices of ``n`` rows, n x ``rank`` (kept: do not write).
    Column j's entry i is +1 or -1 by bit j // 2 of (i x 2654435761) >> 16, a multiplicative hash (no pattern a
    gradient's rows could share: all ones, say, a classifier's columns would map to 0 again, as they sum to 0 over the
    classes), its sign flipped on odd rows where j is odd: columns 0 and 1 are then never parallel (their dot product
    is 0 or 1), whatever n from 2 rows on."""
    rows = torch.arange(n, dtype=torch.int64, device=device).unsqueeze(1)
    columns = torch.arange(rank, device=device)
    bits = ((rows * 2654435761) >> (16 + columns // 2)) ^ (rows * (columns % 2))
    return (1.0 - 2.0 * (bits & 1).float()).to(dtype)


def gram_schmidt(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``matrix`` (n x r or b x n x r) in place, in PyTorch operations: as PyTorch's
    hook, with ``epsilon`` added to each column's norm, but each column projected out of the ones before it twice
    (after one pass, a column nearly in their span is mostly rounding: normalized, it is not orthogonal to them, and
    P P^T M would scale M up to 2x), and a column that is zero (once the columns before it are projected out)
    replaced by its spare (:func:`spare_columns`), so projected, normalized. The hook leaves such a
    column zero, or NaN with epsilon 0; zero, it would stay so: where M is zero in one step (a layer with no gradient
    yet, or the zero step of ``hvd.broadcast_optimizer_state``) P = M Q and Q = M^T P are, and with the warm start P =
    M Q would be zero in every step after, the residual growing and nothing sent.

    On CPU tensors, where reading a value makes no one wait, a column that is not zero skips its spare's operations
    (same result); on a GPU every matrix of a batch chooses on the device, with no sync."""
    rank = matrix.shape[-1]
    spares = spare_columns(matrix.shape[-2], rank, matrix.device, matrix.dtype)
    on_host = matrix.device.type == "cpu"
    for i in range(rank):
        column = matrix[..., i:i + 1]
        for j in range(i):  # projected out again ("twice is enough"): where the column lay nearly in the others'
            # span, one pass leaves mostly rounding, in any direction, which normalizing would blow up, along them too
            before = matrix[..., j:j + 1]
            column -= torch.sum(before * column, dim=-2, keepdim=True) * before
        norm = torch.linalg.vector_norm(column, dim=-2, keepdim=True)
        zero = norm == 0
        if on_host and not zero.any():
            column /= norm + epsilon
        else:
            spare = spares[:, i:i + 1]
            if i:
                done = matrix[..., :i]
                spare = spare - done @ (done.transpose(-2, -1) @ spare)
            spare_norm = torch.linalg.vector_norm(spare, dim=-2, keepdim=True)
            column.copy_(torch.where(zero, spare, column))
            column /= torch.where(zero, torch.where(spare_norm > 0, spare_norm, 1.0), norm + epsilon)
        if i + 1 < rank:
            rest = matrix[..., i + 1:]
            rest -= torch.sum(column * rest, dim=-2, keepdim=True) * column
    return matrix


def _parts(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """``flat`` as tensors of ``shapes``, back to back: views. Matrices of one number of columns (a step's factors)
    are one view of ``flat`` split by rows, so that a bucket's many matrices cost two operations, not one each."""
    if len(shapes) == 1:  # (one matrix: a view without the split, as compress() and a lone gradient take it)
        return [flat.view(shapes[0])]
    columns = shapes[0][-1]
    if columns and all(len(shape) == 2 and shape[1] == columns for shape in shapes):
        return list(flat.view(-1, columns).split([shape[0] for shape in shapes]))
    return [part.view(shape) for part, shape in zip(flat.split([math.prod(s) for s in shapes]), shapes, strict=True)]


def _products(factors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The products a @ b of ``factors`` (matrices, or batches of them), written back to back into one new float32
    buffer: the buffer (one tensor for an allreduce) and each product, a view of it."""
    if len(factors) == 1:
        product = torch.matmul(*factors[0])  # (float32: M and Q are)
        return product.view(-1), [product]
    shapes = [torch.Size((*a.shape[:-1], b.shape[-1])) for a, b in factors]
    flat = factors[0][0].new_empty(sum(math.prod(shape) for shape in shapes), dtype=torch.float32)
    parts = _parts(flat, shapes)
    for (a, b), out in zip(factors, parts, strict=True):
        torch.matmul(a, b, out=out)
    return flat, parts


def _add_(targets: Sequence[torch.Tensor], others: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
    """targets[i] += alpha x others[i]: one multi-tensor launch for several, the tensor's own operator for one (CUDA's
    multi-tensor kernels take a 25 M-element tensor in two launches, each slower than the one elementwise launch)."""
    if len(targets) == 1:
        targets[0].add_(others[0], alpha=alpha)
    else:
        torch._foreach_add_(list(targets), list(others), alpha=alpha)


def _orthogonalize_all(flat: torch.Tensor, parts: Sequence[torch.Tensor], epsilon: float = 0.0) -> None:
    """Orthonormalizes in place the columns of each of ``parts`` (matrices or batches, views of ``flat`` back to back,
    covering it): with the Triton kernels, where all have one rank r <= 2, in one launch for all of them
    (:func:`hvdcomp.kernels.gpu.lowrank.orthogonalize_parts`), else each by :func:`orthogonalize`. (A matrix's rank is
    below the option's where it has fewer rows or columns, which ``min_compression_rate`` < 1 lets it be.)"""
    if len(parts) == 1:
        orthogonalize(parts[0], epsilon)
        return
    rank = parts[0].shape[-1]
    kernels = kernels_for(flat.device)
    if is_triton(kernels) and rank <= 2 and all(part.shape[-1] == rank for part in parts) \
            and flat.dtype == torch.float32 and flat.is_contiguous():
        rows = [part.shape[-2] for part in parts for _ in range(part.shape[0] if part.dim() == 3 else 1)]
        kernels.orthogonalize_parts(flat, rows, rank, epsilon)
        return
    for part in parts:
        orthogonalize(part, epsilon)


def _matrices(started: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The matrices of ``started`` (:meth:`PowerSGD.start`), a batch's one by one: views, in their factors' order."""
    return [member for matrix, _ in started for member in (matrix.unbind(0) if matrix.dim() == 3 else (matrix,))]


def _grouped(started: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ModuleType | None:
    """The Triton kernels where a step's several matrices take each product in one launch
    (:func:`hvdcomp.kernels.gpu.lowrank.products`): float32 and contiguous, as M is, with factors of one rank and sides
    of at most ``MAX_PRODUCT_SIDE``. One matrix takes PyTorch's ``matmul`` (cuBLAS on a GPU, a launch a product
    either way), as does a step with a longer side (an embedding's rows), where cuBLAS spreads the product wider."""
    if len(started) == 1 and started[0][0].dim() == 2:
        return None
    kernels = kernels_for(started[0][0].device)
    rank = started[0][1].shape[-1]
    if not is_triton(kernels) or rank > kernels.MAX_PRODUCT_RANK or any(
            q.shape[-1] != rank or matrix.dtype != torch.float32 or not matrix.is_contiguous()
            or max(matrix.shape[-2:]) > kernels.MAX_PRODUCT_SIDE for matrix, q in started):
        return None
    return kernels


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with warm start and error feedback (see the module docstring for each knob)."""

    name = "powersgd"
    unbiased = False
    own_memory = True
    reduction = "powersgd"

    def __init__(self, rank: int = 2, start_iter: int = 10, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 batch_tensors_with_same_shape: bool = False) -> None:
        check.integer(self.name, "rank", rank, ge=1)
        check.integer(self.name, "start_iter", start_iter, ge=0)
        check.number(self.name, "min_compression_rate", min_compression_rate, gt=0)
        for key, value in (("error_feedback", error_feedback), ("warm_start", warm_start),
                           ("batch_tensors_with_same_shape", batch_tensors_with_same_shape)):
            check.boolean(self.name, key, value)
        check.number(self.name, "orthogonalization_epsilon", orthogonalization_epsilon, ge=0)
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape

    def steady_from(self) -> int:
        return self.start_iter

    @staticmethod
    def _dims(shape: torch.Size) -> tuple[int, int]:
        n = shape[0]
        return n, math.prod(shape) // n if n else 0

    def _rank(self, shape: torch.Size) -> int:
        return min(*self._dims(shape), self.rank)

    def compresses(self, shape: torch.Size) -> bool:
        """Matrices (and higher tensors, as rows x the rest) where the approximation is ``min_compression_rate``
        times smaller than the tensor; never 1-D tensors (PyTorch's ``_should_compress``)."""
        if len(shape) < 2:
            return False
        n, m = self._dims(shape)
        return (n + m) * self._rank(shape) * self.min_compression_rate < n * m

    def why_dense(self, shape: torch.Size) -> str:
        return (f"powersgd compresses matrices where (n + m) x rank x min_compression_rate < n x m (as PyTorch's "
                f"hook); a tensor of shape {tuple(shape)} goes through the dense allreduce")

    def _q(self, shape: torch.Size, device: torch.device, seed: int) -> torch.Tensor:
        """A Gaussian m x r matrix from ``seed``, drawn on ``device`` (no host copy inside backward)."""
        generator = _generators.get(device)
        if generator is None:
            generator = _generators[device] = torch.Generator(device=device)
        return torch.randn(self._dims(shape)[1], self._rank(shape), generator=generator.manual_seed(seed),
                           device=device)

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        # drawn on the CPU (construction, not backward), so that every device starts from the same Q
        state: State = {"q": self._q(tensor.shape, torch.device("cpu"), ctx.shared_seed).to(ctx.device)}
        if self.error_feedback:  # contiguous whatever the parameter's memory format: it is viewed as n x m
            state["residual"] = torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device)
        return state

    def start(self, groups: Sequence[Group]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Each group's M (float32, n x m; a batch b x n x m for several tensors of one shape) and starting Q (m x r, or
        b x m x r), orthonormalized, and the buffer that holds the Qs back to back. M is the gradient plus the
        residual, built in the residual's buffer (every group's in one launch; a batch's then stacked); Q is last
        step's (warm start) or a new draw: one matrix's orthonormalized where it is, several copied side by side and
        orthonormalized in one launch."""
        if self.error_feedback:
            _add_([state["residual"] for _, states, _ in groups for state in states],
                  [tensor for tensors, _, _ in groups for tensor in tensors])
        matrices, qs = [], []
        for tensors, states, contexts in groups:
            n = tensors[0].shape[0]
            if self.error_feedback:
                members = [state["residual"].view(n, -1) for state in states]
            else:
                members = [tensor.detach().float().reshape(n, -1) for tensor in tensors]
            matrices.append(members[0] if len(members) == 1 else torch.stack(members))
            if self.warm_start:
                qs += [state["q"] for state in states]
            else:
                qs += [self._q(tensors[0].shape, ctx.device, derive_seed(ctx.shared_seed, ctx.step))
                       for ctx in contexts]
        shapes = [torch.Size((*matrix.shape[:-2], matrix.shape[-1], self._rank(matrix.shape[-2:])))
                  for matrix in matrices]
        flat = qs[0].view(-1) if len(qs) == 1 else torch.cat([q.reshape(-1) for q in qs])
        started = _parts(flat, shapes)
        _orthogonalize_all(flat, started, self.orthogonalization_epsilon)
        return list(zip(matrices, started, strict=True)), flat

    def power_step(self, groups: Sequence[Group], ranks: int
                   ) -> Generator[Allreduce, Payload, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """Algorithm 1 (module docstring) on groups of matrices, each one tensor or a batch of one shape, the one place
        its equations are written: a generator that yields the two sums over ``ranks`` ranks (every group's P, then
        every group's Q, each side by side in one buffer, one tensor of one request, orthonormalized in one launch)
        and returns, per group, (P, Q averaged over the ranks, M_hat summed over them), each stacked for a batch.
        :class:`PowerSGDReduction` runs it across ranks; :meth:`compress` on one rank."""
        started, flat = self.start(groups)
        grouped = _grouped(started)
        if grouped:  # P = M Q, summed: its scale is lost next
            matrices, rank = _matrices(started), started[0][1].shape[-1]
            flat = grouped.products(matrices, flat, rank)
            ps = _parts(flat, [torch.Size((*matrix.shape[:-1], q.shape[-1])) for matrix, q in started])
        else:
            flat, ps = _products(started)
        (flat,) = yield Allreduce([flat])
        ps = _parts(flat, [p.shape for p in ps])
        _orthogonalize_all(flat, ps, self.orthogonalization_epsilon)
        if grouped:
            p_flat, flat = flat, grouped.products(matrices, flat, rank, transpose=True)
            qs = _parts(flat, [q.shape for _, q in started])
        else:
            flat, qs = _products([(matrix.transpose(-2, -1), p) for (matrix, _), p in zip(started, ps, strict=True)])
        (flat,) = yield Allreduce([flat])
        qs = _parts(flat, [q.shape for q in qs])
        if grouped:  # M_hat summed (what is returned) and E <- M - M_hat / ranks in one launch
            totals = _parts(grouped.approximations(matrices, p_flat, flat, rank,
                                                   -1 / ranks if self.error_feedback else None),
                            [matrix.shape for matrix, _ in started])
        else:
            totals = [p @ q.transpose(-2, -1) for p, q in zip(ps, qs, strict=True)]  # M_hat summed: what is returned
        flat.div_(ranks)  # Q (summed above) averaged, as PyTorch's hook keeps it, for the warm start
        if self.error_feedback and not grouped:  # E <- M - M_hat in the residual's buffer (a batch's: copied below)
            _add_([matrix for matrix, _ in started], totals, alpha=-1 / ranks)
        for (tensors, states, _), (matrix, _), q in zip(groups, started, qs, strict=True):
            if len(tensors) == 1:
                states[0]["q"] = q
                continue
            if self.error_feedback:
                torch._foreach_copy_([state["residual"].view(matrix.shape[1:]) for state in states],
                                     list(matrix.unbind(0)))
            torch._foreach_copy_([state["q"] for state in states], list(q.unbind(0)))
        return list(zip(ps, qs, totals, strict=True))

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        """One rank's PowerSGD on its own (:meth:`power_step`, each sum over this rank alone): the payload is
        (P, Q) with M_hat = P Q^T. This serves benchmarks and profiles; training runs the reduction."""
        ((p, q, _),) = run_one_rank(self.power_step([([tensor], [state], [ctx])], ranks=1))
        return [p, q], tensor.shape

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        p, q = payload
        return (p @ q.t()).view(meta)


class PowerSGDReduction(ReductionMethod):
    """PowerSGD across ranks: :meth:`PowerSGD.power_step` with its two sums as allreduces; dense before
    ``start_iter``. Returns the sum over ranks (the optimizer averages). With ``batch_tensors_with_same_shape`` the
    optimizer hands it the matrices of one shape together (:meth:`batch_key`, :meth:`reduce_batch`); with the
    config's ``bucket_cap_mb``, a bucket's matrices (:meth:`reduce_bucket`)."""

    name = "powersgd"
    compressor: PowerSGD  # never wrapped: its memory is its own (own_memory)

    @classmethod
    def rejects(cls, traits: Any) -> str | None:
        return None if traits.reduction == cls.name else f"{traits!r} is not PowerSGD"

    def batch_key(self, tensor: torch.Tensor) -> Hashable | None:
        if not self.compressor.batch_tensors_with_same_shape:
            return None
        return repr(self), tuple(tensor.shape), tensor.dtype, tensor.device

    def reduce(self, tensor: torch.Tensor, state: State, ctx: Context) -> Reduction:
        (total,) = yield from self._reduce([[0]], [tensor], [state], [ctx])
        return total

    def reduce_batch(self, tensors: Sequence[torch.Tensor], states: Sequence[State],
                     contexts: Sequence[Context]) -> Generator[Allreduce, Payload, list[torch.Tensor]]:
        """The sums over ranks of tensors of one shape, as one batch (the batch's steps are the same on every rank,
        as are its members)."""
        return (yield from self._reduce([list(range(len(tensors)))], tensors, states, contexts))

    def init_bucket_state(self, tensors: Sequence[torch.Tensor], ctx: Context) -> State:
        """Each member's own state (its Q and residual)."""
        return self.init_member_states(tensors, ctx)

    def reduce_bucket(self, tensors: Sequence[torch.Tensor], state: State, ctx: Context) -> Reduction:
        """A bucket as PyTorch's hook reduces a DDP bucket: each matrix factored on its own (those of one shape as one
        batch with ``batch_tensors_with_same_shape``: they are all ready now), every P summed in one allreduce and
        every Q in another. Each sum is flat."""
        contexts = self.member_contexts(ctx, len(tensors))
        groups: dict[Hashable, list[int]] = {}
        for i, tensor in enumerate(tensors):
            key = tensor.shape if self.compressor.batch_tensors_with_same_shape else i
            groups.setdefault(key, []).append(i)
        return (yield from self._reduce(list(groups.values()), tensors, state[MEMBERS], contexts, flat=True))

    def _reduce(self, groups: Sequence[Sequence[int]], tensors: Sequence[torch.Tensor], states: Sequence[State],
                contexts: Sequence[Context], flat: bool = False) -> Generator[Allreduce, Payload, list[torch.Tensor]]:
        """The sums over ranks of ``tensors`` (each in its tensor's shape, or with ``flat`` 1-D) by
        :meth:`PowerSGD.power_step` on ``groups`` of them (positions; those of a group share a shape and are stacked as
        one batch); during the dense warm-up, one allreduce of the gradients themselves."""
        if contexts[0].step < self.compressor.start_iter:  # dense warm-up: the gradients themselves, summed
            summed = yield Allreduce([dense_copy(tensor) for tensor in tensors])
            return [total.reshape(-1) for total in summed] if flat else summed
        factored = yield from self.compressor.power_step(
            [([tensors[i] for i in g], [states[i] for i in g], [contexts[i] for i in g]) for g in groups],
            contexts[0].size)
        totals: list[torch.Tensor] = list(tensors)
        for group, (*_, total) in zip(groups, factored, strict=True):
            for j, i in enumerate(group):
                totals[i] = (total if len(group) == 1 else total[j]).view(-1 if flat else tensors[i].shape)
        return totals

    # Costs for the performance model: the compressor's measured encode (M Q, orthogonalizations, M^T P) is
    # split evenly around the first allreduce; P and Q travel in their own allreduces (fused across layers).

    @classmethod
    def hook_ms(cls, e: Encoded) -> float:
        return e.encode_ms / 2

    @classmethod
    def phases(cls, e: Encoded, workers: int) -> list[Phase]:
        p_bytes, q_bytes = e.part_bytes if len(e.part_bytes) == 2 else (e.wire_bytes / 2, e.wire_bytes / 2)
        return [Phase("allreduce", p_bytes), Phase("allreduce", q_bytes, e.encode_ms / 2)]

    @classmethod
    def decode_ms(cls, e: Encoded, workers: int) -> float:
        return e.decode_ms
