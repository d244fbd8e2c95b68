"""``hvdcomp.DistributedOptimizer``: the entry point. It wraps a PyTorch optimizer in hvdcomp's optimizer
(:mod:`hvdcomp.optimizer`, a drop-in for Horovod's) and, for ``compression: auto``, attaches the tuner
(:mod:`hvdcomp.auto`) above it: the optimizer knows nothing of auto but the small interface a tuner uses
(:class:`hvdcomp.optimizer.Tuner`). :func:`broadcast_optimizer_state` is Horovod's for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import horovod.torch as hvd
import torch

from hvdcomp import elastic
from hvdcomp.auto import Tuner
from hvdcomp.compressor import Compressor
from hvdcomp.config import CompressionConfig
from hvdcomp.deadlines import DEFAULT_DEADLINE, Deadline
from hvdcomp.optimizer import _DistributedOptimizer


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Compressor | str | Mapping[str, Any] | None = "none",
                         backward_passes_per_step: int = 1, op: Any = hvd.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False, process_set: hvd.ProcessSet = hvd.global_process_set,
                         deadline: Deadline | float | None = DEFAULT_DEADLINE) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that gradients are averaged across ranks, compressed as configured. The arguments are
    ``hvd.DistributedOptimizer``'s (Horovod 0.28), in its order, and ``deadline``.

    Args:
        optimizer: the optimizer to wrap (its class is subclassed, as ``hvd.DistributedOptimizer`` does).
        named_parameters: ``model.named_parameters()``; names key the config's patterns and the collectives.
        compression: a Compressor, a method name (``"terngrad"``, see ``hvdcomp.METHODS``), ``"auto"`` (chosen per
            tensor while the job trains: :mod:`hvdcomp.auto`) or a config mapping (see :mod:`hvdcomp.config`).
            ``"none"`` gives exactly stock Horovod's updates.
        backward_passes_per_step: backward passes accumulated locally before each reduction.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: 1.0 only: Horovod splits the average around its sum with it; hvdcomp averages
            once, after decoding.
        num_groups, groups: 0 and None only: Horovod's groups of fused allreduces. hvdcomp's own are the
            compression config's buckets (``bucket_cap_mb``); dense gradients go through Horovod's tensor fusion.
        sparse_as_dense: densify sparse gradients (``nn.Embedding(..., sparse=True)``) for every method. Without
            it they are densified too, except for methods that take them as they are (the sketch).
        process_set: the Horovod process set to reduce over.
        deadline: how long to wait for any of hvdcomp's collectives before ending the job with a message
            (:class:`Deadline`: from the slowest step so far; a number: fixed seconds; None: wait forever, as
            Horovod does).
    """
    if gradient_predivide_factor != 1.0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r}: hvdcomp averages once, after "
                         "decoding (Horovod splits the average around its sum with it); leave it at 1.0")
    if num_groups != 0 or groups is not None:
        raise ValueError("num_groups and groups (Horovod's groups of fused allreduces) are not taken: hvdcomp "
                         "compresses gradients together in the compression config's buckets (bucket_cap_mb), and "
                         "dense ones go through Horovod's tensor fusion")
    config = CompressionConfig.parse(compression)
    elastic.register()  # hvd.elastic.TorchState then handles it as hvdcomp's own TorchState does
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls(optimizer.param_groups, named_parameters, config, backward_passes_per_step, op, process_set,
                  deadline, sparse_as_dense)
    if config.auto is not None:
        wrapped.attach_tuner(Tuner(config.auto, config))
    return wrapped


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: torch.nn.Module | None = None) -> None:
    """``hvd.broadcast_optimizer_state`` for an hvdcomp optimizer: the wrapped optimizer's options (learning rate,
    momentum) and state (SGD's momentum, Adam's moments) from ``root_rank`` to every rank. Call it on every rank,
    where Horovod's recipe calls Horovod's (after ``hvd.broadcast_parameters``; ``model`` names sparse parameters, as
    there).

    Horovod's calls ``optimizer.step()`` on a rank whose optimizer has no state yet, except on Horovod's own
    optimizer: hvdcomp's step reduces, so where only the root loaded a checkpoint the other ranks would wait in that
    step's collectives until the deadline ends the job. This one creates the missing state locally first (a step of
    zeros of the wrapped optimizer alone; a stateless optimizer, SGD without momentum, has none to broadcast, and no
    step is taken); and it broadcasts the options of a stateless optimizer too, which Horovod's leaves as each rank
    has them. hvdcomp's method states (residuals, PowerSGD's Q) belong to each rank and are not broadcast: where every
    rank loaded its own they resume exactly; where only some did, every rank starts them afresh
    (:meth:`~hvdcomp.optimizer._DistributedOptimizer.broadcast_state`).
    """
    if not isinstance(optimizer, _DistributedOptimizer):
        raise TypeError(f"hvdcomp.broadcast_optimizer_state takes an hvdcomp.DistributedOptimizer; got "
                        f"{type(optimizer).__name__} (use hvd.broadcast_optimizer_state for other optimizers)")
    embeddings = [] if model is None else [module for module in model.modules()
                                           if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag)]
    optimizer.broadcast_state(root_rank, model, [p for module in embeddings if module.sparse
                                                 for p in module.parameters()])
