#!/usr/bin/env bash
# The main job: set up, then train the digits workload on 2 ranks with TernGrad compression beside dense
# (uncompressed) allreduce, and print each one's time to 95% test accuracy side by side; then train it once more with
# `compression: auto`, which measures the job and chooses per tensor, and print the plan it chose.
#
# Where this machine can host network namespaces (root, iproute2), the 2 ranks run on an emulated cluster of 2 hosts
# linked at 100 Mbit/s (`hvdcomp cluster`): the slow network compression exists for. Elsewhere they run on this
# machine over shared memory, where compression does not pay, and the demo says so. Extra arguments go to the first
# `hvdcomp train` (e.g. --compression topk). DEMO_CLUSTER names the emulated cluster (default hvdcdemo).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO_ROOT=$PWD
source launch/venv.sh
bash launch/setup.sh
export PATH="$PATH:/usr/sbin:/sbin"  # ip and tc, for the emulated cluster
hvdcomp=$VENV/bin/hvdcomp
train=("$hvdcomp" train --workload digits --target 0.95 --no-progress)
name=${DEMO_CLUSTER:-hvdcdemo}
if why=$("$hvdcomp" cluster --name "$name" up --hosts 2 --rate 100mbit 2>&1); then
    trap '"$hvdcomp" cluster --name "$name" down || true' EXIT
    echo "hvdcomp demo: 2 emulated hosts (network namespaces), each linked at 100 Mbit/s"
    launch=("$hvdcomp" cluster --name "$name" run --)
else
    echo "hvdcomp demo: no emulated cluster here (${why##*error: }); 2 ranks on this machine instead, over shared"
    echo "memory, where compression does not pay (docs/cluster.md): see the 100 Mbit/s figures there"
    launch=(launch/mpirun.sh -np 2)
fi
# the JSON summary line is for scripts (hvdcomp train --json); the demo shows the tables
"${launch[@]}" "${train[@]}" --compression terngrad --compare dense "$@" | sed '/^\[{/d'
echo
echo "hvdcomp demo: the same job with compression: auto (dense first, then the best predicted plans raced against"
echo "dense in interleaved rounds for about 5 s; the fastest is kept if it beat dense clearly):"
"${launch[@]}" "${train[@]}" --compression auto --epochs 60 | sed '/^\[{/d'
