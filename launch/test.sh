#!/usr/bin/env bash
# Set up, then lint (ruff) and run the test suite (pytest). Extra arguments go to pytest.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO_ROOT=$PWD
source launch/venv.sh
bash launch/setup.sh
echo "[test] ruff check ."
"$VENV/bin/ruff" check .
echo "[test] pytest -v $*"
status=0
"$VENV/bin/python" -m pytest -v "$@" || status=$?
if [[ $status -eq 5 ]]; then
    # pytest's exit code 5: nothing was collected. A run that tests nothing must not pass.
    echo "[test] ERROR: pytest collected no tests" >&2
fi
exit "$status"
