#!/usr/bin/env bash
# `pip install .` without extras, into an environment that has torch and Horovod, trains with
# hvdcomp.DistributedOptimizer:
#
#   perf/install/plain_install.sh [WORK_DIR]     # default: a temporary folder, removed at the end
#
# 1. A throwaway virtual environment (WORK_DIR/venv) that has, besides pip, only torch, Horovod and what they
#    require, taken from .venv (launch/setup.sh builds Horovod from source: nothing to download): a .pth file adds
#    WORK_DIR/base, a folder of links to just those packages.
# 2. `pip install` of a copy of this checkout (its tracked and untracked files, no build outputs), not editable and
#    without extras: pip resolves hvdcomp's runtime dependencies itself, from the package index.
# 3. No extra's package came with it: scikit-learn, jsonschema, kubernetes-validate, matplotlib, mpi4py and
#    nvidia-ml-py are neither installed nor importable; a tool that needs one says which extra installs it.
# 4. 2 ranks under mpirun train a small classifier with hvdcomp.DistributedOptimizer and TernGrad (the C++ kernels,
#    built on first use with the ninja that pip installed), top-k and QSGD: each reaches 90% test accuracy and the
#    ranks end with identical parameters.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REPO=$PWD
readonly REPO BASE_PY=$REPO/.venv/bin/python
[[ -x $BASE_PY ]] || { echo "plain_install: no .venv: run launch/setup.sh first" >&2; exit 1; }
if [[ $# -ge 1 ]]; then
    work=$1
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/hvdcomp-plain.XXXXXX")
    # shellcheck disable=SC2064 # expand $work now
    trap "rm -rf '$work'" EXIT
fi
log() { echo "[plain_install] $*"; }

# 1. torch, Horovod and their requirements (transitively, extras left out), as links to .venv's copies
log "environment with torch and Horovod only: $work/venv"
rm -rf "$work/base" "$work/venv" "$work/src"
mkdir -p "$work/base"
"$BASE_PY" - "$work/base" <<'EOF'
import importlib.metadata as metadata
import os
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

base, todo, seen = sys.argv[1], ["torch", "horovod"], set()
while todo:
    name = canonicalize_name(todo.pop())
    if name in seen:
        continue
    seen.add(name)
    distribution = metadata.distribution(name)
    for line in distribution.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            todo.append(requirement.name)
    tops = {file.parts[0] for file in distribution.files or [] if file.parts[0] not in ("..", "__pycache__")}
    for top in sorted(tops):
        link = os.path.join(base, top)
        if not os.path.lexists(link):
            os.symlink(distribution.locate_file(top), link)
print(f"[plain_install] linked: {', '.join(sorted(seen))}")
EOF
"$BASE_PY" -m venv "$work/venv"
PY=$work/venv/bin/python
"$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' |
    { read -r site && echo "$work/base" >"$site/torch-and-horovod.pth"; }
"$PY" -c 'import horovod.torch, torch; print("[plain_install] torch", torch.__version__, "horovod", horovod.__version__)'

# 2. pip install of a copy of the checkout (files deleted in the working tree left out)
mkdir -p "$work/src"
git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' file; do [[ ! -e $file ]] || printf '%s\0' "$file"; done |
    tar --null -T - -cf - | tar -xf - -C "$work/src"
log "pip install $work/src (a copy of $REPO, no extras)"
"$PY" -m pip install --disable-pip-version-check --no-input "$work/src" 2>&1 | tee "$work/pip.log" |
    grep -E '^(Successfully installed|Requirement already satisfied: (torch|horovod)[ >=<])' || true
grep -q '^Successfully installed.* hvdcomp-' "$work/pip.log" || { echo "plain_install: pip install failed" >&2; exit 1; }

# 3. no extra's package, and the message that names the extra
"$PY" - <<'EOF'
import importlib.metadata as metadata
import importlib.util

for distribution, module in (("scikit-learn", "sklearn"), ("jsonschema", "jsonschema"),
                             ("kubernetes-validate", "kubernetes_validate"), ("matplotlib", "matplotlib"),
                             ("mpi4py", "mpi4py"), ("nvidia-ml-py", "pynvml")):
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        pass
    else:
        raise SystemExit(f"plain_install: {distribution} was installed without its extra")
    assert importlib.util.find_spec(module) is None, module
print("[plain_install] none of scikit-learn, jsonschema, kubernetes-validate, matplotlib, mpi4py, nvidia-ml-py "
      "is installed")
EOF
status=0
"$work/venv/bin/hvdcomp" train --workload digits --epochs 1 --no-progress 2>"$work/digits.err" || status=$?
if [[ $status -ne 2 ]] || ! grep -q "pip install 'hvdcomp\[digits\]'" "$work/digits.err"; then
    echo "plain_install: hvdcomp train --workload digits (status $status):" >&2
    cat "$work/digits.err" >&2
    exit 1
fi
log "hvdcomp train --workload digits: $(cat "$work/digits.err")"

# 4. 2 ranks train with hvdcomp.DistributedOptimizer
cat >"$work/train.py" <<'EOF'
"""A 2-layer classifier of a fixed random teacher's labels, each rank training on its half of the samples."""
import json

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdcomp

hvd.init()
torch.set_num_threads(1)
data = torch.Generator().manual_seed(0)
x = torch.randn(2560, 32, generator=data)
y = (x @ torch.randn(32, 4, generator=data)).argmax(1)
train_x, train_y = x[512 + hvd.rank()::hvd.size()], y[512 + hvd.rank()::hvd.size()]
for method in ("terngrad", "topk", "qsgd"):
    torch.manual_seed(hvd.rank())  # different initial weights: broadcast_parameters must make them equal
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters(),
                                             compression={"method": method, "min_numel": 0})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(20):
        for start in range(0, len(train_x), 32):
            optimizer.zero_grad()
            F.cross_entropy(model(train_x[start:start + 32]), train_y[start:start + 32]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = float((model(x[:512]).argmax(1) == y[:512]).float().mean())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    same = bool(torch.equal(hvd.broadcast(flat, root_rank=0, name=f"check.{method}"), flat))
    if hvd.rank() == 0:
        print(json.dumps({"method": method, "ranks": hvd.size(), "test_accuracy": round(accuracy, 4)}))
    assert same, f"{method}: the ranks' parameters differ"
    assert accuracy >= 0.9, f"{method}: test accuracy {accuracy:.3f}"
EOF
flags=(--oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none)
[[ $EUID -ne 0 ]] || flags+=(--allow-run-as-root)
log "mpirun -np 2: hvdcomp.DistributedOptimizer with terngrad, topk, qsgd"
start=$SECONDS
(cd "$work" && mpirun "${flags[@]}" -np 2 "$PY" train.py)
log "trained in $((SECONDS - start)) s (the CPU kernels' first build included)"
log "OK: pip install without extras trains with hvdcomp.DistributedOptimizer"
