#!/usr/bin/env bash
# The emulated cluster (network namespaces on one bridge, links shaped with tc); needs root.
#   launch/cluster.sh up --hosts 4 --rate 100mbit     launch/cluster.sh run -- hvdcomp train --workload digits
#   launch/cluster.sh status                          launch/cluster.sh down
# Options before the action: --name NAME (default hvdc). See `hvdcomp cluster --help` and hvdcomp/tools/cluster.py.
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/launch/venv.sh"
export PATH="$VENV/bin:$PATH:/usr/sbin:/sbin"
exec "$VENV/bin/hvdcomp" cluster "$@"
