"""hvdcomp: gradient compression for Horovod + PyTorch.

    import horovod.torch as hvd
    import hvdcomp

    hvd.init()
    optimizer = hvdcomp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression="terngrad")

Layout: :mod:`hvdcomp.compressor` (the interface), :mod:`hvdcomp.methods` (one module per method),
:mod:`hvdcomp.error_feedback` (memory), :mod:`hvdcomp.communicator` (compressed collectives),
:mod:`hvdcomp.optimizer` (the Horovod drop-in), :mod:`hvdcomp.config` (per-parameter configuration).
"""

from hvdcomp.compressor import Compressor, HorovodCompression, NoneCompressor
from hvdcomp.config import CompressionConfig, make_compressor
from hvdcomp.error_feedback import ErrorFeedback
from hvdcomp.methods import METHODS, FP16Compressor, TernGrad, TopK
from hvdcomp.optimizer import DistributedOptimizer

__all__ = [
    "METHODS",
    "CompressionConfig",
    "Compressor",
    "DistributedOptimizer",
    "ErrorFeedback",
    "FP16Compressor",
    "HorovodCompression",
    "NoneCompressor",
    "TernGrad",
    "TopK",
    "make_compressor",
]
