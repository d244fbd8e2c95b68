#!/usr/bin/env bash
# The wheelhouse perf/gpu/gpu_check.sh installs from on a lent GPU machine, which has no network: run it here (with
# network), then carry .whl/ to that machine with the checkout.
#
#   perf/gpu/gpu_wheelhouse.sh        # fills .whl/ at the repository root (about 4 MB), then prints its size
#
# The machines' image (the device tool's KINDS.md: Python 3.12, torch 2.11.0+cu130, Open MPI 4.1.6, CMake 4, numpy,
# scikit-learn, ninja, mpi4py, nvidia-ml-py, pyyaml, pytest, matplotlib) lacks, of what set-up installs for the GPU
# check (hvdcomp's runtime dependencies and its perf extra): cffi (Horovod's) and the Horovod source release. Those,
# with the dependencies they bring, as wheels for CPython 3.12 on manylinux x86-64. A call carries at most 64 MiB:
# the checkout's files and this folder together.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
readonly WHEELHOUSE=.whl
mkdir -p "$WHEELHOUSE"
pip=(python3 -m pip --disable-pip-version-check --no-input download -q -d "$WHEELHOUSE")
"${pip[@]}" --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "cffi>=1.4.0"
# the same source release launch/setup.sh builds (it checks its sha256)
"${pip[@]}" --no-deps --no-binary :all: "horovod==$(sed -n 's/^readonly HOROVOD_VERSION=//p' launch/setup.sh)"
echo "gpu_wheelhouse: $(du -sh "$WHEELHOUSE" | cut -f1) in $WHEELHOUSE; the checkout's tracked files:" \
    "$(git ls-files -z | du -ch --files0-from=- | tail -n 1 | cut -f1)"
