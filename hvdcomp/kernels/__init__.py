"""Fused CPU kernels (``ternary.cpp``), compiled once with PyTorch's C++ extension builder and cached.

The build lands in PyTorch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), keyed by the source's hash, so it happens once per machine and torch version;
``launch/setup.sh`` runs it ahead of time (``python -m hvdcomp.kernels --build``). Where no compiler is
available the methods fall back to their pure-PyTorch path, with one warning saying why.
"""

from __future__ import annotations

import logging
import pathlib
from types import ModuleType

_SOURCE = pathlib.Path(__file__).with_name("ternary.cpp")
_state: dict[str, ModuleType | Exception] = {}
log = logging.getLogger(__name__)


def build() -> ModuleType:
    """Compiles (or loads from the cache) the extension; raises if the build fails."""
    from torch.utils.cpp_extension import load

    return load(name="hvdcomp_kernels", sources=[str(_SOURCE)], extra_cflags=["-O3"], verbose=False)


def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None (warning once) when it cannot be built here."""
    if not _state:
        try:
            _state["module"] = build()
        except Exception as error:  # a missing compiler shows up as one of several exception types
            _state["module"] = error
            log.warning("hvdcomp: fused CPU kernels unavailable (%s); using the PyTorch path", error)
    module = _state["module"]
    return None if isinstance(module, Exception) else module
