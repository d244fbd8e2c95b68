"""Compression methods, one module per method family, named after the method.

Every module in this package is imported here, and each :class:`~hvdcomp.compressor.Compressor` subclass
with a ``name`` registers itself in :data:`METHODS` (a method that owns its reduction registers that too, in
:data:`hvdcomp.reductions.REDUCTIONS`): a new method is a new file, with no list to edit.
"""

import importlib
import pkgutil

from hvdcomp.compressor import METHODS, NoneCompressor

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

from hvdcomp.methods.bingrad import BinGrad  # noqa: E402
from hvdcomp.methods.dgc import DGC  # noqa: E402
from hvdcomp.methods.fp16 import FP16Compressor  # noqa: E402
from hvdcomp.methods.gravac import GraVAC  # noqa: E402
from hvdcomp.methods.lgc import LGC  # noqa: E402
from hvdcomp.methods.onebit import OneBit  # noqa: E402
from hvdcomp.methods.orq import ORQ  # noqa: E402
from hvdcomp.methods.powersgd import PowerSGD  # noqa: E402
from hvdcomp.methods.qsgd import QSGD  # noqa: E402
from hvdcomp.methods.randomk import RandomK  # noqa: E402
from hvdcomp.methods.signsgd import EFSignSGD, SignSGD  # noqa: E402
from hvdcomp.methods.sketch import Sketch  # noqa: E402
from hvdcomp.methods.terngrad import TernGrad  # noqa: E402
from hvdcomp.methods.threshold import Threshold  # noqa: E402
from hvdcomp.methods.topk import TopK  # noqa: E402

__all__ = ["DGC", "LGC", "METHODS", "ORQ", "QSGD", "BinGrad", "EFSignSGD", "FP16Compressor", "GraVAC", "NoneCompressor",
           "OneBit", "PowerSGD", "RandomK", "SignSGD", "Sketch", "TernGrad", "Threshold", "TopK"]
