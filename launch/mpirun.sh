#!/usr/bin/env bash
# Run Open MPI's mpirun with the flags this machine needs; all arguments are passed through.
#   launch/mpirun.sh -np 4 CMD [ARGS...]
# The ranks get the set-up's virtual environment's bin first on PATH (.venv/bin: launch/venv.sh), and PATH,
# PYTHONPATH and LD_LIBRARY_PATH exported (where set).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/launch/venv.sh"
export PATH="$VENV/bin:$PATH"

flags=(
    # More ranks than cores are fine (tests start 4 ranks on 2 cores).
    --oversubscribe
    # Ranks float over all cores: binding them makes oversubscribed ranks share one core.
    --bind-to none
    # Containers without ptrace (CMA) fail shared-memory single-copy transfers.
    --mca btl_vader_single_copy_mechanism none
    -x PATH
)
# As root, mpirun refuses to start without this.
[[ $EUID -ne 0 ]] || flags+=(--allow-run-as-root)
for var in PYTHONPATH LD_LIBRARY_PATH; do
    [[ -z ${!var:-} ]] || flags+=(-x "$var")
done

exec mpirun "${flags[@]}" "$@"
