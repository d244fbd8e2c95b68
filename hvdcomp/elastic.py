"""Elastic Horovod with hvdcomp: :class:`TorchState`, ``hvd.elastic.TorchState`` for an hvdcomp optimizer.

    optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(...), named_parameters=model.named_parameters(),
                                             compression="terngrad")
    state = hvdcomp.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state): ...  # state.commit() now and then

Three things differ from Horovod's own state, for an hvdcomp optimizer:

* After a reset (a host lost or added) :meth:`hvdcomp.DistributedOptimizer.reset` rebuilds the plan for the new
  world: it is registered as a reset callback.
* The saved and restored optimizer state is the wrapped optimizer's (momentum) only: hvdcomp's per-rank state
  (residuals, PowerSGD's Q) is rebuilt by ``reset()`` anyway, so it is neither deep-copied at each commit nor
  restored from a world of another size.
* The wrapped optimizer's state is created locally before the first sync. Horovod's ``broadcast_optimizer_state``
  otherwise creates it by calling ``step()`` on any optimizer that is not Horovod's own: on hvdcomp's a reduction
  that only the ranks with empty state (a rank joining the job) would run, while the others wait in the broadcast.
"""

from __future__ import annotations

import copy
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.elastic.state import OptimizerStateHandler

from hvdcomp.optimizer import _DistributedOptimizer


class _OptimizerState(OptimizerStateHandler):
    """Saves and restores the wrapped optimizer's state, without hvdcomp's per-rank state."""

    def save(self) -> None:
        state = self.value.state_dict()
        state.pop("hvdcomp", None)
        self._saved_optimizer_state = copy.deepcopy(state)


class TorchState(hvd.elastic.TorchState):
    """``hvd.elastic.TorchState`` of ``model`` and an hvdcomp ``optimizer`` (see the module docstring), plus
    ``kwargs`` as plain synchronized attributes (epoch, batch)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        if not isinstance(optimizer, _DistributedOptimizer):
            raise TypeError(f"hvdcomp.elastic.TorchState takes an hvdcomp.DistributedOptimizer; got "
                            f"{type(optimizer).__name__} (use hvd.elastic.TorchState for Horovod's)")
        _create_state(optimizer)
        super().__init__(model=model, optimizer=optimizer, **kwargs)
        self._handlers["optimizer"] = _OptimizerState(optimizer)
        self.register_reset_callbacks([optimizer.reset])


def _create_state(optimizer: _DistributedOptimizer) -> None:
    """The wrapped optimizer's state (SGD's momentum buffers, Adam's moments) from one local step of zeros: no
    reduction, and the parameters stay as they are (a zero gradient moves nothing without weight decay)."""
    if optimizer.state_dict()["state"]:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    super(_DistributedOptimizer, optimizer).step()  # the wrapped optimizer's own step: no synchronize()
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)  # weight decay would have moved them
            p.grad = None
