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

#: methods ``compression: auto`` and ``hvdcomp predict`` leave out unless allowed, and why: their defaults lost accuracy
#: on the shipped tasks, or a profile cannot describe them (docs/methods.md, accuracy at the defaults;
#: perf/accuracy/README.md)
ACCURACY_GUARD = {
    "signsgd": "without momentum it ended 1.4 points under dense on digits on 2 hosts, did not reach 95% on 4, and "
               "turned unstable on glyphs; its default now, Signum, ended level with dense on glyphs at 2 ranks but "
               "has not run on more",
    "randomk": "at 1% it ended 5.0 and 2.0 points under dense on glyphs (seeds 0, 1) even with its momentum "
               "correction; under the optimizer's momentum it needed 8 more epochs than dense to reach 95% on digits "
               "on 2 hosts, did not reach it on 4, and collapsed on glyphs",
    "dgc": "applies momentum itself: the optimizer's momentum must be 0 for its parameters",
    "gravac": "adapts its own compression factor: its profile is one moment of it",
    "lgc": "its stages and autoencoder are not in a profile (the steady state only), and a state made afresh by a "
           "change of plan trains again first",
    "sketch": "sums sparse rows: for embeddings' gradients, chosen by configuration",
}

__all__ = ["ACCURACY_GUARD", "DGC", "LGC", "METHODS", "ORQ", "QSGD", "BinGrad", "EFSignSGD", "FP16Compressor", "GraVAC",
           "NoneCompressor", "OneBit", "PowerSGD", "RandomK", "SignSGD", "Sketch", "TernGrad", "Threshold", "TopK"]
