"""hvdcomp: gradient compression for Horovod + PyTorch.

    import horovod.torch as hvd
    import hvdcomp

    hvd.init()
    optimizer = hvdcomp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression="terngrad")

Layout: :mod:`hvdcomp.compressor` (the interface), :mod:`hvdcomp.collectives` (the requests a reduction
yields and how Horovod runs them), :mod:`hvdcomp.reductions` (how payloads travel: allreduce, allgather,
two-phase, and the registry methods add to), :mod:`hvdcomp.error_feedback` (memory), :mod:`hvdcomp.methods`
(one module per method), :mod:`hvdcomp.optimizer` (the Horovod drop-in), :mod:`hvdcomp.config`
(per-parameter configuration), :mod:`hvdcomp.auto` (``compression: auto``: the per-tensor choice made
on the running job), :mod:`hvdcomp.elastic` (Elastic Horovod's state); the tools live in
:mod:`hvdcomp.tools` (train, bench, cluster), :mod:`hvdcomp.perfmodel` and :mod:`hvdcomp.k8s`.
"""

from hvdcomp.auto import ACCURACY_GUARD, AutoSettings
from hvdcomp.collectives import Agree, Allgather, Allreduce, Alltoall, Broadcast
from hvdcomp.compressor import Compressor, Context, HorovodCompression, NoneCompressor
from hvdcomp.config import CompressionConfig, make_compressor
from hvdcomp.error_feedback import ErrorFeedback
from hvdcomp.methods import (
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
from hvdcomp.optimizer import Deadline, DistributedOptimizer
from hvdcomp.reductions import REDUCTIONS, ReductionMethod

__all__ = [
    "ACCURACY_GUARD",
    "DGC",
    "LGC",
    "METHODS",
    "ORQ",
    "QSGD",
    "REDUCTIONS",
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
    "NoneCompressor",
    "OneBit",
    "PowerSGD",
    "RandomK",
    "ReductionMethod",
    "SignSGD",
    "Sketch",
    "TernGrad",
    "Threshold",
    "TopK",
    "make_compressor",
]
