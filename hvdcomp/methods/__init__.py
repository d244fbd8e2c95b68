"""Compression methods, one module per method family, registered by the name used in configs."""

from hvdcomp.compressor import Compressor, NoneCompressor
from hvdcomp.methods.fp16 import FP16Compressor
from hvdcomp.methods.terngrad import TernGrad
from hvdcomp.methods.topk import TopK

METHODS: dict[str, type[Compressor]] = {cls.name: cls for cls in (NoneCompressor, FP16Compressor, TernGrad, TopK)}

__all__ = ["METHODS", "FP16Compressor", "TernGrad", "TopK"]
