#!/usr/bin/env bash
# The multi-rank scenarios of the test suite on CUDA tensors, 2 and 4 ranks on this machine's GPU (one is enough):
#
#   perf/gpu/gpu_multirank.sh [OUT_DIR]          # default OUT_DIR: perf/results/gpu-multirank
#   CONTROLLERS="mpi gloo" perf/gpu/gpu_multirank.sh OUT_DIR     # Gloo's controller too (default: mpi; more time)
#
# NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). A Horovod built without GPU operations stages CUDA
# tensors through host memory instead (its CudaOnCPU operations, over MPI or Gloo), so that several ranks share one
# GPU: launch/setup.sh builds it with HVDCOMP_HOROVOD_GPU_OPS=none, into .venv-staged (HVDCOMP_VENV), beside .venv's
# NCCL build; its wheel is cached apart from the NCCL build's (HVDCOMP_CACHE), so that only the first run builds it
# (about 3 minutes on an H200). This checks hvdcomp's methods, reductions and optimizer on CUDA tensors across ranks;
# NCCL's own collectives, and any speed, still need a GPU per rank.
#
# 1. set-up of .venv-staged (setup.log); the GPU, the versions and `horovodrun --check-build`, which must list no NCCL
#    (environment.txt);
# 2. tests/test_multirank.py with HVDCOMP_TEST_DEVICE=cuda (tests/ranks.py then puts each rank's model, data and
#    gradients on its GPU: hvd.local_rank() modulo the GPUs there are), the 2-rank and the 4-rank launches side by side
#    (pytest-2ranks.log, pytest-4ranks.log), in this order: every method and reduction against the sum of every rank's
#    payloads, two-phase included (collectives); replicas bitwise identical after training with every method and
#    collective (train); a run resumed from a checkpoint equal bit for bit (resume); a NaN raising or skipped on every
#    rank, ranks configured differently (nonfinite_raise, nonfinite_skip, mismatch: 2 ranks); process sets (4 ranks);
#    every request type (requests); plans that change in step (plans); equality with stock Horovod (stock); parameters
#    without gradients (nograd); signSGD's vote (majority); GraVAC; the sketch; LGC; compression: auto tuned to one
#    plan on every rank (auto_local). The scenarios that stay on CPU tensors, and why: tests/cases.py's
#    CPU_ONLY_SCENARIOS;
# then summary.txt (printed too): per scenario, controller and rank count, the tests passed, failed and skipped, and
# each failure, and the tests a time limit left unrun. At most 5 files in OUT_DIR. The exit status is 1 where set-up
# or a test failed, a test did not run, or none ran.
#
# Offline (the lent GPU machines), set-up installs from the wheelhouse .whl/ (perf/gpu/gpu_wheelhouse.sh, run
# beforehand where there is network) as perf/gpu/gpu_check.sh does. Time: BUDGET_S (default 570 s) for the whole
# stage, within which set-up has at most SETUP_TIMEOUT (default 330 s) and the tests what is left, so that the stage
# ends within 10 minutes even where set-up or a launch hangs. SETUP_DONE (the log of a set-up the caller ran with the
# same settings, as perf/gpu/gpu_stages.sh does beside the kernel stage) skips the set-up.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$repo/perf/results/gpu-multirank}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$repo"
venv=${HVDCOMP_VENV:-.venv-staged}
py=$venv/bin/python
read -r -a controllers <<<"${CONTROLLERS:-mpi}"
BUDGET_S=${BUDGET_S:-570}
SETUP_TIMEOUT=${SETUP_TIMEOUT:-330}
status=0
say() { echo "gpu_multirank: $*"; }

for controller in "${controllers[@]}"; do
    [[ $controller == mpi || $controller == gloo ]] ||
        { say "CONTROLLERS='${CONTROLLERS:-}': each must be mpi or gloo" >&2; exit 2; }
done
if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
    say "no NVIDIA GPU here (nvidia-smi)" >&2
    exit 1
fi
if [[ -d .whl ]]; then
    # Offline: pip reads only the wheelhouse. hvdcomp's runtime dependencies suffice here (no extras).
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" HVDCOMP_EXTRAS=${HVDCOMP_EXTRAS-}
fi
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="$PATH:/usr/local/cuda/bin"  # Horovod's CUDA kernels (built with a CUDA torch, NCCL or not) need nvcc
fi

# 1. set-up: Horovod without GPU operations, in its own virtual environment
say "1/2 set-up: HVDCOMP_HOROVOD_GPU_OPS=none in $venv (a first build takes about 3 minutes; setup.log)"
if [[ -n ${SETUP_DONE:-} ]]; then  # the caller ran this set-up already (an idempotent rerun took 42 s on an H100)
    echo "set-up done by the caller: $SETUP_DONE" | tee "$out/setup.log"
elif ! HVDCOMP_HOROVOD_GPU_OPS=none HVDCOMP_VENV=$venv timeout -k 10 "$SETUP_TIMEOUT" bash launch/setup.sh \
    >"$out/setup.log" 2>&1; then
    tail -n 30 "$out/setup.log" >&2
    say "FAILED: set-up (exit status or ${SETUP_TIMEOUT} s; setup.log)" >&2
    exit 1
fi
{ nvidia-smi -L 2>&1 || true
  "$py" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, GPUs: {torch.cuda.device_count()}")' 2>&1 || true
  "$venv/bin/horovodrun" --check-build 2>&1 || true
} >"$out/environment.txt"
cat "$out/environment.txt"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    say "$py's torch sees no CUDA device" >&2
    exit 1
fi
if grep -q '\[X\] NCCL' "$out/environment.txt" || ! grep -q '\[ \] NCCL' "$out/environment.txt"; then
    say "$venv's Horovod is not the staged build (horovodrun --check-build lists NCCL, or nothing)" >&2
    exit 1
fi

# 2. the scenarios on CUDA tensors: one pytest per rank count, side by side, each with what time is left
left=$((BUDGET_S - SECONDS - 20))  # 20 s for the summary
if ((left < 60)); then
    say "FAILED: only ${left} s left of BUDGET_S=${BUDGET_S} after set-up" >&2
    exit 1
fi
# -k: this rank count's scenarios under each controller; the 2-rank run also the bad inputs (2 ranks), the 4-rank
# run the process sets (4 ranks)
selection() {
    local np=$1 controller expression=""
    for controller in "${controllers[@]}"; do
        expression+="${expression:+ or }$controller-$np or "
        if ((np == 2)); then
            expression+="(test_bad_input and $controller)"
        else
            expression+="(test_process_sets and $controller)"
        fi
    done
    echo "$expression"
}
mark="gpu_multirank.$$"
say "2/2 tests/test_multirank.py on CUDA tensors, ${controllers[*]}, 2 and 4 ranks side by side (at most ${left} s)"
pids=()
for np in 2 4; do
    # The cases of every method first, auto's tuning last. At the limit pytest is interrupted (SIGINT), so that it
    # still reports what ran; the ranks it leaves running are ended below.
    env HVDCOMP_TEST_DEVICE=cuda HVDCOMP_STAGE_MARK="$mark" PYTHONUNBUFFERED=1 COLUMNS=400 \
        timeout -s INT -k 20 "$left" "$py" -m pytest -v -rfE -p no:cacheprovider \
        tests/test_multirank.py::test_case tests/test_multirank.py::test_bad_input_fails_cleanly_on_every_rank \
        tests/test_multirank.py::test_process_sets tests/test_multirank.py::test_scenario \
        -k "$(selection "$np")" >"$out/pytest-${np}ranks.log" 2>&1 &
    pids+=($!)
done
for i in 0 1; do
    np=$((2 * i + 2))
    if wait "${pids[$i]}"; then
        say "$np ranks: pytest passed"
    else
        code=$?
        status=1
        [[ $code != 124 && $code != 130 && $code != 137 && $code != 2 ]] || code+=" (interrupted at the time limit?)"
        say "FAILED: $np ranks: pytest exit status $code (pytest-${np}ranks.log)" >&2
    fi
done
# ranks and launchers that outlived their pytest (a launch cut off at the time limit): they carry the mark
for environ in /proc/[0-9]*/environ; do
    if grep -qsz "^HVDCOMP_STAGE_MARK=$mark\$" "$environ"; then
        pid=${environ#/proc/}
        kill -9 "${pid%/environ}" 2>/dev/null || true
    fi
done

# the summary: per scenario, controller and rank count, from pytest's lines (-v: one per test as it ends; -rfE: why
# each failed, once pytest ended; COLUMNS: not cut to a terminal's width)
"$py" - "$out" <<'EOF' 2>&1 | tee "$out/summary.txt" || status=1
import collections
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])
counts = collections.defaultdict(collections.Counter)
failures, problems = [], []
for np in (2, 4):
    log = (out / f"pytest-{np}ranks.log").read_text(errors="replace")
    outcomes = dict(re.findall(r"^tests/test_multirank\.py::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", log, re.MULTILINE))
    why = dict(re.findall(r"^(?:FAILED|ERROR) tests/test_multirank\.py::(\S+)(?: - (.*))?$", log, re.MULTILINE))
    selected = re.search(r"collected \d+ items(?: / \d+ deselected)? / (\d+) selected", log)
    if not re.search(r"^=+ .*\b(passed|failed|skipped|error|errors)\b.* in [\d.]+s", log, re.MULTILINE):
        problems.append(f"{np} ranks: pytest did not end by itself (a time limit, or an error before any test): "
                        f"pytest-{np}ranks.log")
    if "KeyboardInterrupt" in log:
        problems.append(f"{np} ranks: pytest was interrupted (at the time limit)")
    if selected and len(outcomes) < int(selected.group(1)):
        unrun = int(selected.group(1)) - len(outcomes)
        problems.append(f"{np} ranks: {unrun} of {selected.group(1)} tests did not run")
    for name, outcome in outcomes.items():
        params = re.search(r"\[(.*)\]$", name)
        tokens = params.group(1).split("-") if params else []
        controller = next((t for t in tokens if t in ("mpi", "gloo")), "-")
        if name.startswith("test_process_sets"):
            scenario = "process_sets"
        elif tokens and name.startswith(("test_case", "test_scenario", "test_bad_input")):
            scenario = tokens[0]
        else:
            scenario = name.split("[")[0]
        outcome = {"ERROR": "failed"}.get(outcome, outcome.lower())
        counts[scenario, controller, np][outcome] += 1
        if outcome == "failed":
            failures.append(f"{name} ({np} ranks): {(why.get(name) or 'see the log')[:300]}")
print(f"{'scenario':<16} {'controller':<10} {'ranks':>5} {'passed':>7} {'failed':>7} {'skipped':>8}")
for (scenario, controller, np), count in sorted(counts.items()):
    print(f"{scenario:<16} {controller:<10} {np:>5} {count['passed']:>7} {count['failed']:>7} {count['skipped']:>8}")
total = sum(counts.values(), collections.Counter())
print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped, on CUDA tensors through "
      "a Horovod without GPU operations (staged through host memory)")
for line in failures[:30] + [f"... and {len(failures) - 30} more: the logs"] * (len(failures) > 30) + problems:
    print(f"FAILED {line}")
sys.exit(1 if failures or problems or not total["passed"] else 0)
EOF
say "results in $out; exit status $status"
exit "$status"
