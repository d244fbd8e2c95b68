#!/usr/bin/env bash
# The main job: set up, then train the digits workload on 2 MPI ranks with TernGrad compression and compare it
# against dense (uncompressed) allreduce. Extra arguments go to `hvdcomp train`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh
exec launch/mpirun.sh -np 2 .venv/bin/hvdcomp train --workload digits --compression terngrad --compare dense "$@"
