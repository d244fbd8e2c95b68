"""Elastic Horovod with hvdcomp: Horovod's own ``hvd.elastic.TorchState`` takes an hvdcomp optimizer, and
:class:`TorchState` is that state, checking that it is given one.

    optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(...), named_parameters=model.named_parameters(),
                                             compression="terngrad")
    state = hvdcomp.elastic.TorchState(model, optimizer, epoch=0, batch=0)  # or hvd.elastic.TorchState

    @hvd.elastic.run
    def train(state): ...  # state.commit() now and then

Building an hvdcomp optimizer registers :class:`_OptimizerState` as Horovod's state handler for it
(:func:`register`). Four things differ from Horovod's handler of other optimizers:

* The saved and restored optimizer state is the wrapped optimizer's (momentum) only, from the first copy on: hvdcomp's
  per-rank state (residuals, PowerSGD's Q) is neither deep-copied at each commit nor restored from a world of another
  size. A restore starts it afresh (``load_state_dict`` without an ``"hvdcomp"`` entry), on every rank alike: a step
  that failed part-way may have left it updated on some ranks only.
* Each restore loads a copy of the saved state. Horovod's loads the saved tensors themselves, which the steps after
  a restore then update in place: a second failure before the next commit would restore those steps' momentum.
* A sync is :func:`hvdcomp.broadcast_optimizer_state`'s
  (:meth:`~hvdcomp.optimizer._DistributedOptimizer.broadcast_state`): the wrapped optimizer's state is created
  locally first. Horovod's ``broadcast_optimizer_state`` otherwise creates it by calling ``step()`` on any optimizer
  that is not Horovod's own: on hvdcomp's a reduction that only the ranks with empty state (a rank joining the job)
  would run, while the others wait in the broadcast. The options (learning rate) are rank 0's also for a stateless
  optimizer (SGD without momentum), which has no state to broadcast.
* No reset callback is needed: a sync (after every reset but one that only removed hosts) rebuilds the optimizer's
  plan (:meth:`hvdcomp.DistributedOptimizer.reset`) on every rank, a rank that joined too; after a reset that only
  removed hosts, the optimizer rebuilds it itself, its next step starting in a world of another size.
"""

from __future__ import annotations

import copy
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.elastic import state as horovod_state

from hvdcomp.optimizer import _DistributedOptimizer


class _OptimizerState(horovod_state.OptimizerStateHandler):
    """Saves and restores the wrapped optimizer's state, without hvdcomp's per-rank state, restoring a copy each time;
    creates it locally before a sync (module docstring)."""

    def __init__(self, optimizer: _DistributedOptimizer) -> None:
        horovod_state.StateHandler.__init__(self, optimizer)
        self.save()

    def save(self) -> None:
        state = self.value.state_dict()
        state.pop("hvdcomp", None)
        self._saved_optimizer_state = copy.deepcopy(state)

    def restore(self) -> None:
        # A copy: ``load_state_dict`` takes the saved tensors as the state where their device and dtype already fit
        # (Horovod's handler loads them as they are), so steps after one restore would update the commit in place,
        # and a second failure before the next commit would restore those steps' momentum.
        self.value.load_state_dict(copy.deepcopy(self._saved_optimizer_state))

    def sync(self) -> None:
        self.value.reset()  # a new world, also where its size and this rank stayed (a host replaced): every rank
        self.value.broadcast_state(root_rank=0)


def register() -> None:
    """Makes :class:`_OptimizerState` Horovod's elastic state handler of hvdcomp's optimizers (once)."""
    registry = horovod_state.get_handler_registry()
    if registry[0][1] is not _OptimizerState:
        horovod_state.set_handler_registry([(_DistributedOptimizer, _OptimizerState), *registry])


class TorchState(hvd.elastic.TorchState):
    """``hvd.elastic.TorchState`` of ``model`` and an hvdcomp ``optimizer`` (see the module docstring), plus
    ``kwargs`` as plain synchronized attributes (epoch, batch)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        if not isinstance(optimizer, _DistributedOptimizer):
            raise TypeError(f"hvdcomp.elastic.TorchState takes an hvdcomp.DistributedOptimizer; got "
                            f"{type(optimizer).__name__} (use hvd.elastic.TorchState for Horovod's)")
        register()
        super().__init__(model=model, optimizer=optimizer, **kwargs)
