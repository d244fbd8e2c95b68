"""Fused kernels: on CPU tensors a C++ extension (``ternary.cpp`` for TernGrad, ``randomk.cpp`` for random-k,
``quant.cpp`` for the bucketed quantizers, ``sketch.cpp`` for the homomorphic sketch's decoding, ``threshold.cpp`` for
threshold's fit, ``memory.cpp`` for momentum correction and error feedback's accumulation, bound in ``module.cpp``), on
CUDA tensors Triton kernels (:mod:`hvdcomp.kernels.gpu`: TernGrad, the quantizers, random-k, the sparsifiers' selection
and threshold's fit, the sketch's encoding and decoding, the memory's update) with the same functions, wire format and
results; and, on CUDA only, PowerSGD's orthogonalization (one launch where PyTorch takes 14; CPU tensors keep
PyTorch's). :func:`kernels_for` picks the one for a tensor's device.

The C++ extension is compiled once with PyTorch's C++ extension builder and cached.

The build lands in the Python environment (``<sys.prefix>/hvdcomp-kernels/<hash of the sources and their folder>``;
PyTorch's extension cache where that is not writable) and is rebuilt only when the source or the compiler flags
change: once per virtual environment, checkout and version of the sources, and ``launch/setup.sh`` does it ahead of
time (``python -m hvdcomp.kernels --build``). A shared cache would make every checkout rebuild the others' copy, as
the build command names the environment. Where no compiler is available the methods fall back to their pure-PyTorch
path, with one warning saying why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import sys
from types import ModuleType

import torch

_SOURCES = sorted(pathlib.Path(__file__).parent.glob("*.cpp"))
_HEADERS = sorted(pathlib.Path(__file__).parent.glob("*.h"))
_state: dict[str, ModuleType | Exception] = {}
_triton: dict[str, ModuleType | Exception] = {}
log = logging.getLogger(__name__)


def build() -> ModuleType:
    """Compiles (or loads from the cache) the extension; raises if the build fails."""
    from torch.utils.cpp_extension import load

    # One folder per checkout and version of the sources: two checkouts sharing an environment (a benchmark of a
    # base commit against the working tree) would otherwise rebuild each other's copy on every switch, even with the
    # same sources (the build names their paths). Torch's and Python's versions and this file (the flags) are in the
    # key too: the build tracks hvdcomp's headers only, so an upgraded torch would load a module built against the
    # old one's headers.
    digest = hashlib.sha256(str(_SOURCES[0].parent).encode()
                            + b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
                            + f"{torch.__version__} {torch.version.git_version} {sys.version}".encode()
                            + pathlib.Path(__file__).read_bytes()).hexdigest()[:12]
    directory = pathlib.Path(sys.prefix) / "hvdcomp-kernels" / digest
    try:
        directory.mkdir(parents=True, exist_ok=True)
        build_directory = str(directory) if os.access(directory, os.W_OK) else None
    except OSError:
        build_directory = None  # a read-only environment: PyTorch's own cache
    # PyTorch runs whichever ninja comes first on PATH. Ninja versions hash the commands in the build log
    # differently (1.11 vs 1.13), so processes with and without the environment's bin/ on PATH would each
    # find the other's build stale and rebuild it (25 s here): use the environment's own ninja if it has one.
    path = os.environ.get("PATH")
    own = pathlib.Path(sys.executable).parent
    if (own / "ninja").exists():
        os.environ["PATH"] = os.pathsep.join([str(own), path or os.defpath])
    try:
        # -fopenmp: ATen's parallel_for is an OpenMP pragma in its header; without the flag it runs on one thread.
        # -ffp-contract=off: a multiply and an add round apart, as in PyTorch's ops and the Triton kernels (GCC would
        # fuse them into an FMA where the target has one, as aarch64 does).
        return load(name="hvdcomp_kernels", sources=[str(source) for source in _SOURCES],
                    extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"], verbose=False,
                    build_directory=build_directory)
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None (warning once) when it cannot be built here.

    ``HVDCOMP_KERNELS=0`` in the environment turns the kernels off (the pure-PyTorch path runs everywhere).
    """
    if os.environ.get("HVDCOMP_KERNELS") == "0":
        return None
    return _cpu_module()


def _cpu_module() -> ModuleType | None:
    """:func:`cpu_kernels` past its environment check: :func:`kernels_for`, on every method's hot path, reads the
    environment once."""
    if not _state:
        try:
            _state["module"] = build()
        except Exception as error:  # a missing compiler shows up as one of several exception types
            _state["module"] = error
            log.warning("hvdcomp: fused CPU kernels unavailable (%s); using the PyTorch path", error)
    module = _state["module"]
    return None if isinstance(module, Exception) else module


def gpu_kernels() -> ModuleType | None:
    """The Triton kernels (:mod:`hvdcomp.kernels.gpu`), or None (warning once) where Triton cannot be imported."""
    if not _triton:
        try:
            import hvdcomp.kernels.gpu as module

            _triton["module"] = module
        except ImportError as error:
            _triton["module"] = error
            log.warning("hvdcomp: Triton kernels unavailable (%s); CUDA tensors take the PyTorch path", error)
    module = _triton["module"]
    return None if isinstance(module, Exception) else module


def is_triton(kernels: ModuleType | None) -> bool:
    """Whether ``kernels`` (from :func:`kernels_for`) are the Triton kernels, which take and return scalars as device
    tensors where the C++ extension uses host values (checked without importing Triton)."""
    return kernels is not None and kernels.__name__ == __name__ + ".gpu"


def kernels_name(device: torch.device) -> str:
    """Which fused kernels tensors on ``device`` take (:func:`kernels_for`): ``triton``, ``cpu`` (the C++ extension)
    or ``torch`` (none: the PyTorch path). Their payloads may differ (top-k sends its zeros on CUDA's path), so every
    rank's plan says which."""
    kernels = kernels_for(device)
    return "torch" if kernels is None else "triton" if is_triton(kernels) else "cpu"


def kernels_for(device: torch.device) -> ModuleType | None:
    """The fused kernels for tensors on ``device``: the C++ extension on CPU, the Triton kernels on CUDA, None where
    neither applies (each method then runs its PyTorch path).

    ``HVDCOMP_KERNELS`` in the environment: ``0`` turns every fused kernel off; ``triton`` takes the Triton kernels
    for every device, which on CPU tensors needs Triton's interpreter (``TRITON_INTERPRET=1``): how the tests run
    them without a GPU.
    """
    choice = os.environ.get("HVDCOMP_KERNELS")
    if choice == "0":
        return None
    if choice == "triton" or device.type == "cuda":
        return gpu_kernels()
    return _cpu_module() if device.type == "cpu" else None
