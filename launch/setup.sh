#!/usr/bin/env bash
# Set up this checkout on a fresh machine, idempotently:
#   a. the system packages a build needs (Debian's), those missing: Open MPI (mpirun, mpicc), g++, Python's venv
#      and its headers,
#   b. the virtual environment .venv with PyTorch,
#   c. Horovod 0.28.1 built once from its PyPI source release and cached as a wheel outside the checkout,
#   d. hvdcomp itself (editable, with the extras the demo and the tests need),
#   e. the optional kernel pre-build hook, then `horovodrun --check-build`.
# A second run skips b-d while .venv/.hvdcomp-setup matches pyproject.toml, this script, HVDCOMP_HOROVOD_GPU_OPS,
# HVDCOMP_EXTRAS and the nvcc found (a CUDA toolkit installed since is built for).
#
# Environment:
#   HVDCOMP_CACHE  where the Horovod source release, built wheels and build logs are kept
#                  (default: ${XDG_CACHE_HOME:-$HOME/.cache}/hvdcomp)
#   HVDCOMP_HOROVOD_GPU_OPS  Horovod's GPU operations. auto (the default): NCCL's where torch has CUDA, nvcc is found
#                  (on the PATH, else in $HOROVOD_CUDA_HOME or /usr/local/cuda) and an NCCL is found, else none. none: none even there. Horovod then stages CUDA tensors
#                  through host memory (its CudaOnCPU operations, over MPI or Gloo), so that several ranks can share
#                  one GPU: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); its collectives need a GPU
#                  per rank. That build is cached as a wheel of its own (key ...-staged-sm<archs>-..., beside the NCCL
#                  build's ...-nccl-sm<archs>-...) and set up in .venv-staged, not .venv (perf/gpu/gpu_multirank.sh).
#                  With a CUDA torch both builds compile Horovod's CUDA kernels and need the CUDA toolkit (nvcc on the
#                  PATH or in /usr/local/cuda): the staged copies to host memory are awaited through CUDA events.
#   HVDCOMP_VENV   the virtual environment to set up, relative to the checkout or absolute (default: .venv, or
#                  .venv-staged with HVDCOMP_HOROVOD_GPU_OPS=none)
#   HVDCOMP_EXTRAS hvdcomp's extras to install (default: all,test: the tools' packages, which the demo and the
#                  tests use, and pytest, ruff and Triton; the GPU check, which does not lint, uses perf; empty:
#                  hvdcomp's runtime dependencies only)
set -euo pipefail

readonly HOROVOD_VERSION=0.28.1
# sha256 of horovod-0.28.1.tar.gz as published on PyPI.
readonly HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
# Pinned on purpose: an unpinned torch pulls several GB of CUDA wheels on a CPU machine.
readonly TORCH_VERSION=2.13.0

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly REPO_ROOT
cd "$REPO_ROOT"

readonly GPU_OPS=${HVDCOMP_HOROVOD_GPU_OPS:-auto}
if [[ $GPU_OPS != auto && $GPU_OPS != none ]]; then
    echo "[setup] ERROR: HVDCOMP_HOROVOD_GPU_OPS=$GPU_OPS: valid values are auto and none" >&2
    exit 1
fi
source "$REPO_ROOT/launch/venv.sh"
readonly VENV
readonly VENV_NAME=${VENV#"$REPO_ROOT"/}  # for the messages
readonly PY="$VENV/bin/python"
readonly STAMP="$VENV/.hvdcomp-setup"
readonly CONSTRAINTS="$VENV/hvdcomp-constraints.txt"
readonly CACHE="${HVDCOMP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdcomp}"
PIP=("$PY" -m pip --disable-pip-version-check --no-input)

log() { echo "[setup] $*"; }
die() {
    echo "[setup] ERROR: $*" >&2
    exit 1
}

# True when the system python3 already has a torch that can use a GPU (a CUDA build, with a GPU to see): the venv
# then inherits it. A CUDA build that cannot reach the GPU here (a container without the device) counts where
# nvidia-smi answers; a CPU build never does.
system_torch_has_cuda() {
    local status=0  # 0: a GPU is available, 2: a CUDA build without one, 1: no torch or a CPU build
    python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2 if torch.version.cuda else 1)' \
        >/dev/null 2>&1 || status=$?
    [[ $status -eq 0 ]] && return 0
    [[ $status -eq 2 ]] && command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1
}

# a. The system packages a build needs, those missing (Debian's names): Open MPI (mpirun to launch ranks, mpicc and
# the headers to build Horovod and mpi4py), g++ (Horovod, the kernels; Open MPI's packages bring gcc, not g++),
# Python's venv and its headers (Python.h).
install_system_packages() {
    local missing=()
    command -v mpirun >/dev/null && command -v mpicc >/dev/null || missing+=(openmpi-bin libopenmpi-dev)
    command -v g++ >/dev/null || missing+=(g++)
    if command -v python3 >/dev/null; then
        python3 -m ensurepip --version >/dev/null 2>&1 || missing+=(python3-venv)
        local headers
        headers=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null) || headers=""
        [[ -n $headers && -f $headers/Python.h ]] || missing+=(python3-dev)
    else
        missing+=(python3 python3-venv python3-dev)
    fi
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "system packages present: $(mpirun --version 2>/dev/null | head -n 1), $(g++ --version | head -n 1)"
        return
    fi
    local sudo=()
    if [[ $EUID -ne 0 ]]; then
        command -v sudo >/dev/null ||
            die "missing ${missing[*]} and not running as root: install them first" \
                "(Debian/Ubuntu: apt-get install ${missing[*]}), then re-run $0"
        sudo=(sudo)
    fi
    log "installing Debian's packages: apt-get install ${missing[*]}"
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    log "installed: $(mpirun --version 2>/dev/null | head -n 1)"
}

# b. The virtual environment and torch. With a CUDA torch already on the machine, .venv sees it: through
# --system-site-packages when python3 is the system's, through a .pth of python3's own site-packages when python3
# is itself a virtual environment (GPU images; the system's older packages then stay out of .venv). The .pth calls
# site.addsitedir, so that the .pth files there (setuptools' distutils shim, which Horovod's build needs) run too.
setup_venv() {
    local system_site=$1 flags=() torch_site=""
    if [[ $system_site == true ]]; then
        if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
            torch_site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        else
            flags=(--system-site-packages)
        fi
    fi
    # an existing .venv is kept if made the same way (a CPU-made one would hide the image's CUDA torch)
    local has_pth=false wants_pth=false
    compgen -G "$VENV/lib/python*/site-packages/system-torch.pth" >/dev/null && has_pth=true
    [[ -z $torch_site ]] || wants_pth=true
    if [[ -x $PY ]] && "$PY" -V >/dev/null 2>&1 && [[ $has_pth == "$wants_pth" ]] &&
        grep -qx "include-system-site-packages = $([[ -n ${flags[*]} ]] && echo true || echo false)" \
            "$VENV/pyvenv.cfg"; then
        log "virtual environment $VENV_NAME already exists"
    else
        log "creating $VENV_NAME ${flags[*]}"
        python3 -m venv --clear "${flags[@]}" "$VENV"
    fi
    if [[ -n $torch_site ]]; then
        "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' |
            { read -r dir && echo "import site; site.addsitedir('$torch_site')" >"$dir/system-torch.pth"; }
        log "python3 is a virtual environment: its site-packages $torch_site added to $VENV_NAME's (system-torch.pth)"
    fi
    log "upgrading pip, setuptools and wheel in $VENV_NAME"
    "${PIP[@]}" install -q --upgrade pip setuptools wheel

    if [[ $system_site == true ]]; then
        log "using the system torch $("$PY" -c 'import torch; print(torch.__version__)')"
    elif [[ $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) == "$TORCH_VERSION"* ]]; then
        log "torch $TORCH_VERSION already installed"
    else
        # numpy too: torch warns on import without it (and hvdcomp needs it anyway).
        log "installing torch==$TORCH_VERSION and numpy"
        "${PIP[@]}" install -q "torch==$TORCH_VERSION" numpy
    fi
}

# Prints where an NCCL to build against is: "system" when nccl.h is where Horovod's CMake looks
# (HOROVOD_NCCL_HOME, the CUDA toolkit, /usr), else the folder of the nvidia-nccl-cu* Python package; or nothing.
find_nccl() {
    local dir
    for dir in ${HOROVOD_NCCL_HOME:+"$HOROVOD_NCCL_HOME/include"} /usr/local/cuda/include /usr/include; do
        if [[ -f $dir/nccl.h ]]; then
            echo system
            return
        fi
    done
    dir=$("$PY" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null) || return 0
    if [[ -f $dir/include/nccl.h && -f $dir/lib/libnccl.so.2 ]]; then
        echo "$dir"
    fi
}

# The CUDA compiler: on the PATH, else in $HOROVOD_CUDA_HOME or /usr/local/cuda (where NVIDIA's installer puts it,
# off the PATH); nothing where there is none.
find_nvcc() {
    command -v nvcc && return
    local nvcc=${HOROVOD_CUDA_HOME:-/usr/local/cuda}/bin/nvcc
    [[ ! -x $nvcc ]] || echo "$nvcc"
}

# c. Horovod: install the cached wheel for this python/torch/MPI/NCCL combination, building it first if needed.
install_horovod() {
    log "installing Horovod's Python dependencies (cloudpickle, psutil, pyyaml, packaging, cffi)"
    "${PIP[@]}" install -q cloudpickle psutil pyyaml packaging "cffi>=1.4.0"

    local torch_info torch_version torch_cuda nccl="" gpu_ops=cpu ompi_version py_version key archs=""
    torch_info=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "")')
    read -r torch_version torch_cuda <<<"$torch_info"
    # NCCL ops only make sense with a CUDA torch, nvcc and an NCCL to link (and unless HVDCOMP_HOROVOD_GPU_OPS=none).
    local nvcc
    nvcc=$(find_nvcc)
    [[ -z $nvcc ]] || PATH="${nvcc%/*}:$PATH"  # for Horovod's build, which looks on the PATH
    if [[ -n $torch_cuda && $GPU_OPS == auto && -n $nvcc ]]; then
        nccl=$(find_nccl)
        [[ -z $nccl ]] || gpu_ops=nccl
    fi
    if [[ -n $torch_cuda ]]; then
        # Without NCCL ops a CUDA torch's tensors are staged through host memory ("staged"). Either way Horovod
        # compiles its few CUDA kernels: for this machine's GPUs only, unless asked (Horovod's default: every
        # architecture nvcc knows). Part of the cache key: a wheel for sm_90 has no kernels for another GPU.
        [[ $gpu_ops == nccl ]] || gpu_ops=staged
        archs=${HOROVOD_BUILD_CUDA_CC_LIST:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
            tr -d . | sort -u | paste -sd,)} || archs=""
        gpu_ops+="${archs:+-sm$archs}"
    fi
    ompi_version=$(mpirun --version 2>/dev/null | sed -n 's/.*(Open MPI) \([0-9.]*\).*/\1/p')
    [[ -n $ompi_version ]] || die "could not read the Open MPI version from 'mpirun --version'"
    py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    key="horovod$HOROVOD_VERSION-py$py_version-torch$torch_version-ompi$ompi_version-$gpu_ops-$(uname -m)"

    local wheel_dir="$CACHE/wheels/$key"
    local wheels=("$wheel_dir"/horovod-*.whl)
    if [[ -f ${wheels[0]} ]]; then
        log "Horovod wheel already built: using the cached $wheel_dir/${wheels[0]##*/}"
    else
        build_horovod "$key" "$nccl" "$archs"
        wheels=("$wheel_dir"/horovod-*.whl)
    fi
    log "installing ${wheels[0]##*/} into $VENV_NAME"
    "${PIP[@]}" install -q --force-reinstall --no-deps "${wheels[0]}"
    printf 'torch==%s\nhorovod==%s\n' "$torch_version" "$HOROVOD_VERSION" >"$CONSTRAINTS"
}

# Builds the Horovod wheel into $CACHE/wheels/KEY. Args: KEY NCCL (find_nccl's answer; empty: CPU ops only, which
# stage CUDA tensors through host memory where torch has CUDA) ARCHS (the compute capabilities to build its CUDA
# kernels for, "80,90"; empty: Horovod's default).
build_horovod() {
    local key=$1 nccl=$2 archs=$3
    local sdist="$CACHE/sdist/horovod-$HOROVOD_VERSION.tar.gz"
    local log_file="$CACHE/logs/horovod-$key.log"
    mkdir -p "$CACHE/sdist" "$CACHE/logs" "$CACHE/wheels"

    # One build at a time per cache (two checkouts may set up at once); re-check once the lock is ours.
    exec 9>"$CACHE/wheels/.lock"
    flock 9
    if compgen -G "$CACHE/wheels/$key/horovod-*.whl" >/dev/null; then
        log "Horovod wheel was built meanwhile by another set-up"
        return
    fi

    if [[ -f $sdist ]]; then
        log "Horovod $HOROVOD_VERSION source release already downloaded: $sdist"
    else
        log "downloading the Horovod $HOROVOD_VERSION source release from PyPI into $CACHE/sdist"
        "${PIP[@]}" download -q --no-deps --no-binary :all: -d "$CACHE/sdist" "horovod==$HOROVOD_VERSION"
    fi
    echo "$HOROVOD_SDIST_SHA256  $sdist" | sha256sum --check --status ||
        die "$sdist does not have the expected sha256; delete it and re-run"

    # Horovod's bundled gloo asks for a CMake policy level older than CMake 4 configures, unless told the floor
    # (CMAKE_POLICY_VERSION_MINIMUM, CMake 4's own way): a CMake 4 on the PATH (the GPU images have one) builds so;
    # otherwise CMake 3 is installed into .venv.
    local cmake_version policy=()
    cmake_version=$(PATH="$VENV/bin:$PATH" cmake --version 2>/dev/null |
        sed -n 's/^cmake version \([0-9.]*\).*/\1/p') || cmake_version=""  # no CMake at all
    if [[ ${cmake_version%%.*} =~ ^[0-9]+$ ]] && ((${cmake_version%%.*} >= 4)); then
        log "building with CMake $cmake_version, with CMAKE_POLICY_VERSION_MINIMUM=3.5 for Horovod's bundled gloo"
        policy=(CMAKE_POLICY_VERSION_MINIMUM=3.5)
    else
        log "installing Horovod's build tools (cmake<4: its bundled gloo does not configure with CMake 4 as it is)"
        "${PIP[@]}" install -q "cmake>=3.13,<4"
    fi

    local work
    work=$(mktemp -d "$CACHE/build.XXXXXX")
    # shellcheck disable=SC2064 # expand $work now: it is local
    trap "rm -rf '$work'" EXIT
    tar -xzf "$sdist" -C "$work"
    local src="$work/horovod-$HOROVOD_VERSION"

    # torch >= 2.1 headers need C++17; Horovod 0.28.1 asks for C++14 in these two files, and C++11 for its CUDA
    # kernels (CUDA 13's headers need C++17).
    local file standard
    for file in CMakeLists.txt horovod/torch/CMakeLists.txt horovod/common/ops/cuda/CMakeLists.txt; do
        standard=CMAKE_CXX_STANDARD
        [[ $file != */cuda/* ]] || standard=CMAKE_CUDA_STANDARD
        grep -Eq "set\($standard 1[14]\)" "$src/$file" ||
            die "patching Horovod: 'set($standard 11 or 14)' not found in $file"
        sed -Ei "s/set\($standard 1[14]\)/set($standard 17)/" "$src/$file"
        ! grep -Eq "set\($standard 1[14]\)" "$src/$file" || die "patching Horovod: $file not patched"
    done

    local build_env=(
        PATH="$VENV/bin:$PATH"
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
        MAKEFLAGS="-j$(nproc)" "${policy[@]}"
        # GCC 13 no longer includes these transitively; Horovod 0.28.1's sources rely on it (group_table.h, common.h).
        CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept"
    )
    local ops="PyTorch, MPI, Gloo; CPU only" no_gpu_ops=()
    if [[ -z $nccl ]]; then
        # no GPU operations whatever the environment asks for: the key says which the wheel has
        no_gpu_ops=(-u HOROVOD_GPU_OPERATIONS -u HOROVOD_GPU_ALLREDUCE -u HOROVOD_GPU_ALLGATHER
            -u HOROVOD_GPU_BROADCAST -u HOROVOD_GPU_ALLTOALL -u HOROVOD_GPU_REDUCESCATTER)
        [[ $key != *-staged* ]] || ops="PyTorch, MPI, Gloo; no GPU operations: CUDA tensors staged through host memory"
    fi
    if [[ -n $archs ]]; then
        build_env+=(HOROVOD_BUILD_CUDA_CC_LIST="$archs")
    fi
    if [[ -n $nccl ]]; then
        build_env+=(HOROVOD_GPU_OPERATIONS=NCCL)
        ops="PyTorch, MPI, Gloo, NCCL"
        if [[ $nccl != system ]]; then
            # The pip package has only libnccl.so.2: link it dynamically through a libnccl.so of our own.
            mkdir "$work/nccl-lib"
            ln -s "$nccl/lib/libnccl.so.2" "$work/nccl-lib/libnccl.so"
            build_env+=(HOROVOD_NCCL_LINK=SHARED HOROVOD_NCCL_INCLUDE="$nccl/include"
                HOROVOD_NCCL_LIB="$work/nccl-lib")
            ops+=" from $nccl"
        fi
    fi
    [[ -z $archs ]] || ops+=" (CUDA kernels for compute capability $archs)"
    log "building Horovod $HOROVOD_VERSION ($ops) with $(nproc) jobs: takes several minutes; log: $log_file"

    local start=$SECONDS
    if ! env "${no_gpu_ops[@]}" "${build_env[@]}" "${PIP[@]}" wheel -v --no-build-isolation --no-deps \
        -w "$work/dist" "$src" >"$log_file" 2>&1; then
        echo "[setup] Horovod build failed. Lines with 'error' in the log:" >&2
        grep -i 'error' "$log_file" | head -n 40 >&2 || true
        echo "[setup] Last lines of the log:" >&2
        tail -n 25 "$log_file" >&2
        die "Horovod build failed: check that g++, CMake and the MPI headers (libopenmpi-dev) are" \
            "installed; full log: $log_file"
    fi
    mkdir -p "$work/out"
    mv "$work"/dist/horovod-*.whl "$work/out/"
    # Rename is atomic on one file system: the key's folder appears complete or not at all.
    mv "$work/out" "$CACHE/wheels/$key"
    log "Horovod built in $((SECONDS - start)) s, cached in $CACHE/wheels/$key"
}

# Whether the venv's torch requires a Triton of its own (a CUDA build: PyPI's Linux wheels pin the one they were built
# with), which the test extra's pin (for Triton's interpreter beside a CPU torch) must neither replace nor contradict.
torch_brings_triton() {
    "$PY" -c 'import importlib.metadata as m, re, sys
sys.exit(0 if any(re.match(r"triton\b", r) for r in m.requires("torch") or []) else 1)'
}

# d. hvdcomp and its remaining dependencies; the constraints keep pip off torch and Horovod.
# With the machine's own torch (argument true), pip must not resolve torch: an image's torch may pin CUDA wheels that
# differ from those installed beside it, and offline pip cannot re-resolve them. hvdcomp's other requirements are
# then installed by name, but for the test extra's Triton (that torch brings its own), and hvdcomp with --no-deps;
# so too beside a torch that requires its own Triton.
install_hvdcomp() {
    local system_site=$1 extras=${HVDCOMP_EXTRAS-all,test}
    log "installing hvdcomp in editable mode with its extras [$extras]"
    if [[ $system_site == false ]] && ! torch_brings_triton; then
        "${PIP[@]}" install -q -c "$CONSTRAINTS" --no-build-isolation -e ".[$extras]"
        return
    fi
    "${PIP[@]}" install -q --no-deps --no-build-isolation -e .
    # hvdcomp's requirements and those of the extras asked for, from its installed metadata; an extra that names
    # others (all = hvdcomp[digits,k8s,perf]) brings theirs
    local requirements
    requirements=$(EXTRAS=$extras "$PY" -c '
import importlib.metadata, os, re
lines = [line.partition(";") for line in importlib.metadata.requires("hvdcomp") or []]
extras = {e for e in os.environ["EXTRAS"].split(",") if e}
while True:
    chosen = [requirement.strip() for requirement, _, marker in lines
              if (extra := re.search(r"extra\s*==\s*.([\w-]+).", marker)) is None or extra.group(1) in extras]
    named = {e.strip() for r in chosen if (m := re.match(r"hvdcomp\[(.*)\]", r)) for e in m.group(1).split(",")}
    if named <= extras:
        break
    extras |= named
print("\n".join(r for r in chosen if re.match(r"(torch|horovod|hvdcomp|triton)\b", r) is None))')
    mapfile -t requirements <<<"$requirements"
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "${requirements[@]}"
}

main() {
    local start=$SECONDS
    install_system_packages

    local system_site=false
    system_torch_has_cuda && system_site=true
    local stamp_hash
    stamp_hash=$(cat pyproject.toml launch/setup.sh <(echo "system-site-packages=$system_site gpu-ops=$GPU_OPS" \
        "extras=${HVDCOMP_EXTRAS-all,test} nvcc=$(find_nvcc)") | sha256sum | cut -d ' ' -f 1)

    if [[ -f $STAMP && $(<"$STAMP") == "$stamp_hash" ]] &&
        "$PY" -c 'import horovod.torch, hvdcomp' >/dev/null 2>&1; then
        log "$VENV_NAME is up to date with pyproject.toml and launch/setup.sh: skipping venv, Horovod and hvdcomp"
    else
        rm -f "$STAMP"
        setup_venv "$system_site"
        install_horovod
        install_hvdcomp "$system_site"
        echo "$stamp_hash" >"$STAMP"
    fi

    # e. Optional hook of the package: pre-builds its C++ extension.
    if [[ -f hvdcomp/kernels/__main__.py ]]; then
        log "pre-building hvdcomp's kernels (python -m hvdcomp.kernels --build)"
        "$PY" -m hvdcomp.kernels --build
    else
        log "no hvdcomp/kernels/__main__.py yet: no kernels to pre-build"
    fi
    log "horovodrun --check-build:"
    "$VENV/bin/horovodrun" --check-build
    log "done in $((SECONDS - start)) s"
}

# Sourced (to try one function alone, with stubs), it only defines them.
[[ ${BASH_SOURCE[0]} != "$0" ]] || main "$@"
