#!/usr/bin/env bash
# Every CUDA path of hvdcomp in one command, on a machine with an NVIDIA GPU (one is enough):
#
#   perf/gpu/gpu_check.sh [OUT_DIR]          # default OUT_DIR: perf/results/gpu
#   GPU_CHECK_MULTIRANK=1 perf/gpu/gpu_check.sh [OUT_DIR]    # with the multi-rank stage M too
#
# 0. perf/gpu/gpu_kernels.sh, which needs no Horovod build (OUT_DIR/kernels): the Triton kernels' tests compiled on the
#    GPU under torch.cuda.set_sync_debug_mode("error"), `bench compress --device cuda` of their methods at 25 M and
#    1,024 elements, and a ResNet-50 profile where torchvision is installed. It runs first, with the machine's
#    python3, where that has torch, triton, pytest and pyyaml, so that its results come even where the Horovod build
#    fails; otherwise after set-up, with .venv's python;
# M. optional (GPU_CHECK_MULTIRANK=1), apart from the kernel stage and before the NCCL set-up: perf/gpu/gpu_multirank.sh
#    (OUT_DIR/multirank), the multi-rank scenarios of tests/test_multirank.py on CUDA tensors with 2 and 4 ranks on
#    this GPU, through a Horovod built without GPU operations (its own build, about 3 minutes, and .venv-staged:
#    NCCL refuses two ranks on one GPU). Each stage also runs alone, in a few minutes: perf/gpu/gpu_kernels.sh OUT_DIR,
#    perf/gpu/gpu_multirank.sh OUT_DIR;
# 1. set-up (launch/setup.sh keeps the machine's CUDA torch and builds Horovod with NCCL);
# 2. tests/test_devices.py: every method on cuda against the CPU reference, determinism, no host syncs in
#    compression (torch.cuda.set_sync_debug_mode("error")), every reduction through Horovod on one rank (NCCL),
#    compression: auto's clock (CUDA events on the gradients' device; auto's collectives need 2 GPUs, as the probe's);
# 3. `hvdcomp bench compress --device cuda` for every method (JSON lines, bench-cuda.jsonl);
# 4. `hvdcomp probe --device cuda`: real NVML readings of the GPU (probe-gpu.yaml; its collectives need 2 ranks on
#    2 GPUs: NCCL takes one rank per GPU), and `hvdcomp profile --device cuda` (CUDA-timed profiles);
# 5. a 1-rank `hvdcomp train --device cuda` for every method (train-<method>.json): the training loop on CUDA,
#    and the sparse workload (bow, an embedding with sparse gradients; train-bow.json).
#    One rank reduces nothing (as in Horovod), so compression through NCCL is step 2's test_reductions_on_one_rank.
#
# A machine without network access (the project's lent GPU machines) installs from a wheelhouse: perf/gpu/gpu_wheelhouse.sh,
# run beforehand where there is network, puts what set-up needs there in .whl/ at the repository root; pip then reads
# only that folder. (Results of such runs: perf/results/gpu, an H100, and perf/results/gpu-h200.)
# Each method is listed here by name: a method that is not fails the check below.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${1:-perf/results/gpu}
mkdir -p "$out"
methods=(bingrad dgc efsignsgd fp16 gravac lgc onebit orq powersgd qsgd randomk signsgd sketch terngrad threshold topk)

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU here (nvidia-smi)" >&2; exit 1; }
if [[ -d .whl ]]; then
    # Offline: pip reads only the wheelhouse. Set-up's extras: perf, what the steps below use (no lint, so no ruff; no
    # digits or k8s tools; pytest is there).
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" HVDCOMP_EXTRAS=${HVDCOMP_EXTRAS-perf}
fi
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="$PATH:/usr/local/cuda/bin"  # set-up builds Horovod's NCCL operations only where nvcc is found
fi
status=0
kernels_checked=
if python3 -c 'import torch, triton, pytest, yaml' 2>/dev/null; then
    PYTHON=python3 perf/gpu/gpu_kernels.sh "$out/kernels" || status=1
    kernels_checked=1
fi
if [[ ${GPU_CHECK_MULTIRANK:-0} == 1 ]]; then
    perf/gpu/gpu_multirank.sh "$out/multirank" || status=1
fi
bash launch/setup.sh 2>&1 | tee "$out/setup.log"
py=.venv/bin/python
if [[ -z $kernels_checked ]]; then
    PYTHON="$py" perf/gpu/gpu_kernels.sh "$out/kernels" || status=1
fi
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
registered=$("$py" -c 'from hvdcomp import METHODS; print(" ".join(sorted(set(METHODS) - {"none"})))')
[[ $registered == "${methods[*]}" ]] ||
    { echo "gpu_check: registered methods '$registered' but this script checks '${methods[*]}'" >&2; exit 1; }
.venv/bin/horovodrun --check-build | tee "$out/check-build.txt"
grep -q '\[X\] NCCL' "$out/check-build.txt" || echo "gpu_check: WARNING: Horovod was built without NCCL operations"

"$py" -m pytest -v -p no:cacheprovider tests/test_devices.py 2>&1 | tee "$out/test_devices.log" || status=1

: >"$out/bench-cuda.jsonl"
for method in "${methods[@]}"; do
    .venv/bin/hvdcomp bench compress --method "$method" --device cuda --numel 25000000 --repeats 20 --json \
        >>"$out/bench-cuda.jsonl" || status=1
done

.venv/bin/hvdcomp probe --device cuda --out "$out/probe-gpu.yaml" || status=1
# a model profiled on the GPU (CUDA events for each gradient's readiness), and the synthetic workload
.venv/bin/hvdcomp profile --model hvdcomp.tools.models:resnet18 --batch hvdcomp.tools.models:resnet18_batch \
    --device cuda --out "$out/profile-resnet18-cuda.yaml" || status=1
.venv/bin/hvdcomp profile --model synthetic --device cuda --out "$out/profile-synthetic-cuda.yaml" || status=1

for method in "${methods[@]}"; do
    .venv/bin/hvdcomp train --workload synthetic --device cuda --compression "$method" --epochs 1 --no-progress \
        --json "$out/train-$method.json" || status=1
done
.venv/bin/hvdcomp train --workload bow --device cuda --compression sketch --epochs 1 --no-progress \
    --json "$out/train-bow.json" || status=1
echo "gpu_check: results in $out; exit status $status"
exit "$status"
