"""hvdcomp: gradient compression for Horovod + PyTorch.

    import horovod.torch as hvd
    import hvdcomp

    hvd.init()
    optimizer = hvdcomp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression="terngrad")

Layout, lower layers first: :mod:`hvdcomp.wire` (the payload and its bytes), :mod:`hvdcomp.requests` (the
requests a reduction yields and receives), :mod:`hvdcomp.compressor` (the interface), :mod:`hvdcomp.error_feedback`
(memory), :mod:`hvdcomp.reductions` (how payloads travel: allreduce, allgather, two-phase, and the registry methods
add to), :mod:`hvdcomp.methods` (one module per method), :mod:`hvdcomp.deadlines` (a wait past its deadline ends
the job, saying what it waited for), :mod:`hvdcomp.collectives` (how Horovod runs the requests),
:mod:`hvdcomp.config` (per-parameter configuration), :mod:`hvdcomp.checkpoint` (the method states in a checkpoint),
:mod:`hvdcomp.optimizer` (the Horovod drop-in), :mod:`hvdcomp.elastic` (Elastic Horovod's state), then above the
optimizer :mod:`hvdcomp.auto` (``compression: auto``: the per-tensor choice made on the running job, through the
optimizer's interface for a tuner) and :mod:`hvdcomp.distributed` (:func:`DistributedOptimizer`, which attaches it,
and Horovod's :func:`broadcast_optimizer_state` for it); the tools live in :mod:`hvdcomp.tools` (train, bench,
cluster), :mod:`hvdcomp.perfmodel` and :mod:`hvdcomp.k8s`, with :mod:`hvdcomp.workloads` below them.
``tests/test_layers.py`` keeps the imports one way.

The compressors, requests, reductions, kernels, configuration, deadlines and ``hvdcomp bench compress`` import no
Horovod and work without it installed; the collectives, the optimizer and what runs on ranks do import it, and
``import hvdcomp`` imports it only when :class:`DistributedOptimizer` (or :func:`broadcast_optimizer_state`) is first
used.
"""

from typing import TYPE_CHECKING

from hvdcomp.compressor import AccuracyWarning, Compressor, Context, HorovodCompression, NoneCompressor
from hvdcomp.config import AutoSettings, CompressionConfig, make_compressor
from hvdcomp.deadlines import Deadline
from hvdcomp.error_feedback import ErrorFeedback, MomentumCorrection
from hvdcomp.methods import (
    ACCURACY_GUARD,
    DGC,
    LGC,
    METHODS,
    ORQ,
    QSGD,
    BinGrad,
    EFSignSGD,
    FP16Compressor,
    GraVAC,
    OneBit,
    PowerSGD,
    RandomK,
    SignSGD,
    Sketch,
    TernGrad,
    Threshold,
    TopK,
)
from hvdcomp.reductions import REDUCTIONS, ReductionMethod
from hvdcomp.requests import Agree, Allgather, Allreduce, Alltoall, Broadcast, Read

if TYPE_CHECKING:
    from hvdcomp.distributed import DistributedOptimizer, broadcast_optimizer_state

#: the names whose modules import Horovod, by module: imported on first use (PEP 562); ``elastic`` is the module
#: itself (``hvdcomp.elastic.TorchState``, as ``hvd.elastic.TorchState``)
_LAZY = {"DistributedOptimizer": "hvdcomp.distributed", "broadcast_optimizer_state": "hvdcomp.distributed",
         "elastic": "hvdcomp.elastic"}

__all__ = [
    "ACCURACY_GUARD",
    "DGC",
    "LGC",
    "METHODS",
    "ORQ",
    "QSGD",
    "REDUCTIONS",
    "AccuracyWarning",
    "Agree",
    "Allgather",
    "Allreduce",
    "Alltoall",
    "AutoSettings",
    "BinGrad",
    "Broadcast",
    "CompressionConfig",
    "Compressor",
    "Context",
    "Deadline",
    "DistributedOptimizer",
    "EFSignSGD",
    "ErrorFeedback",
    "FP16Compressor",
    "GraVAC",
    "HorovodCompression",
    "MomentumCorrection",
    "NoneCompressor",
    "OneBit",
    "PowerSGD",
    "RandomK",
    "Read",
    "ReductionMethod",
    "SignSGD",
    "Sketch",
    "TernGrad",
    "Threshold",
    "TopK",
    "broadcast_optimizer_state",
    "make_compressor",
]


def __getattr__(name: str) -> object:
    """A name of :data:`_LAZY`, imported with its module on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_LAZY[name])
    value = module if module.__name__ == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value  # later lookups find it without calling here
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included as if imported."""
    return sorted({*globals(), *_LAZY})
