#!/usr/bin/env bash
# hvdcomp's GPU kernels alone, in a few minutes, on a machine with an NVIDIA GPU and no Horovod build:
#
#   perf/gpu/gpu_kernels.sh [OUT_DIR]          # default OUT_DIR: perf/results/gpu-kernels
#   PYTHON=.venv/bin/python perf/gpu/gpu_kernels.sh OUT_DIR    # another interpreter (default: python3)
#   BENCH_METHODS="orq topk" perf/gpu/gpu_kernels.sh OUT_DIR      # the bench of these methods only
#
# It needs torch with CUDA, triton, pytest, numpy and pyyaml in PYTHON's environment (the lent GPU machines'
# image has them), neither Horovod nor an installed hvdcomp: hvdcomp runs from this checkout (PYTHONPATH).
#
# In this order, what the issues' targets need first, since a lent machine's time is short:
# 1. `bench compress --device cuda` (CUDA events, L2 flushed between calls) for every method (BENCH_METHODS: some),
#    the sparsifiers, the sketch and PowerSGD first, at 25,000,000 elements (fraction_of_copy: their speed against a
#    copy; PowerSGD gets a 5000 x 5000 matrix) and at 1,024 (compress_us + decompress_us), one process per method
#    (bench-cuda.jsonl, JSON lines; bench.log);
# 2. `profile --device cuda` of torchvision's ResNet-50, batch 64, bf16 autocast: per compressor the encode and
#    decode time summed over a step's gradients beside forward + backward (profile-resnet50-cuda.yaml,
#    profile.log); skipped, with the reason, where torchvision is missing or the profiler does not import here;
# 3. tests/test_triton.py on the GPU, compiled (TRITON_INTERPRET unset), against the CPU kernels (built here by
#    PyTorch's extension builder); each method's CUDA path runs under torch.cuda.set_sync_debug_mode("error"), so
#    that a host synchronization fails it; and tests/test_devices.py (every method on CUDA against its CPU path,
#    determinism, no host sync in compression; its tests that need Horovod skip where it is not installed)
#    (test_triton.log, every test's verdict; each failure's message in failures.txt as it fails,
#    perf/gpu/report_failures.py, kept where the stage's time limit cuts pytest off);
# 4. perf/gpu/buckets.py --device cuda: the same gradients' compression per step, each alone against in buckets of
#    25 MiB (bucket_cap_mb), per method (buckets.jsonl, buckets.log); and perf/gpu/checks.py --device cuda,
#    the optimizer's NaN/Inf check of the step's gradients both ways (checks.jsonl); and perf/gpu/selection.py, the
#    top-k selection over the whole tensor against over gathered candidates, by size (selection.jsonl); and
#    perf/gpu/kernel_times.py, the sparsifiers', the sketch's and PowerSGD's kernels at 25 M elements, each one's
#    device time by PyTorch's profiler, and top-k's and threshold's at 2^20, where the selection's CUDA-event time
#    (about 200 us) may be mostly the host's issuing: the kernels' own sum tells; and LGC's and PowerSGD's at 2^16, a
#    small layer, where the same comparison tells how much of their time is the host's (kernel_times.jsonl);
# then summary.txt (printed too): per method fraction_of_copy against the issues' targets and the 1,024-element
# times, and the stages the time left out. environment.txt records the GPU and the versions. At most 14 files in
# OUT_DIR. A failing stage does not stop the next ones; the exit status is then 1. It takes a few minutes on an H100
# or H200. Each stage has a time limit (STAGE_TIMEOUT_*, below, in seconds, to be set in the environment), cut to
# what is left of BUDGET_S (default 570 s) less 20 s for the summary, so that the script ends within BUDGET_S even
# where every stage hangs; a stage left fewer than 10 s is skipped and named in skipped.txt and the summary.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$repo/perf/results/gpu-kernels}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$repo"
py=${PYTHON:-python3}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the kernels compiled for the GPU, not interpreted
# the sparsifiers, the sketch and PowerSGD first, then the quantizers and fp16: where time runs short, the first ones
# will have run
methods=(randomk topk threshold dgc gravac sketch powersgd lgc terngrad qsgd signsgd efsignsgd onebit bingrad orq fp16)
STAGE_TIMEOUT_TESTS=${STAGE_TIMEOUT_TESTS:-180}
STAGE_TIMEOUT_BENCH=${STAGE_TIMEOUT_BENCH:-30}  # per method: 16 of them
STAGE_TIMEOUT_PROFILE=${STAGE_TIMEOUT_PROFILE:-150}
STAGE_TIMEOUT_BUCKETS=${STAGE_TIMEOUT_BUCKETS:-60}
STAGE_TIMEOUT_CHECKS=${STAGE_TIMEOUT_CHECKS:-30}
STAGE_TIMEOUT_SELECTION=${STAGE_TIMEOUT_SELECTION:-60}
STAGE_TIMEOUT_KERNEL_TIMES=${STAGE_TIMEOUT_KERNEL_TIMES:-60}
BUDGET_S=${BUDGET_S:-570}
status=0
say() { echo "gpu_kernels: $*"; }
# sets secs to a stage's limit: its own ($2), or what is left of BUDGET_S (20 s kept for the summary), whichever is
# less; fails, naming the stage ($1) in skipped.txt, where what is left is under 10 s (and under its own limit)
secs=0
time_for() {
    secs=$((BUDGET_S - SECONDS - 20))
    ((secs >= 10 || secs >= $2)) || { say "skipped, no time left: $1" | tee -a "$out/skipped.txt" >&2; return 1; }
    ((secs < $2)) || secs=$2
}

# 0. the GPU and the versions; nothing else can run without a CUDA device
{ nvidia-smi -L 2>&1 || true
  "$py" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuda available: {torch.cuda.is_available()}")' 2>&1 || true
  "$py" -c 'import triton; print(f"triton {triton.__version__}")' 2>&1 || true
} | tee "$out/environment.txt"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    say "$py's torch sees no CUDA device: nothing to check" >&2
    exit 1
fi

rm -f "$out/failures.txt" "$out/skipped.txt"

# 1. compression speed: 25 M elements against a copy, and 1,024 elements in microseconds
read -r -a bench_methods <<<"${BENCH_METHODS:-${methods[*]}}"  # BENCH_METHODS: some of them alone
say "1/4 bench compress --device cuda: ${bench_methods[*]}"
: >"$out/bench-cuda.jsonl"
: >"$out/bench.log"
for method in "${bench_methods[@]}"; do
    time_for "bench compress --method $method" "$STAGE_TIMEOUT_BENCH" || continue
    if ! timeout -k 5 "$secs" "$py" -m hvdcomp.tools.bench compress --method "$method" --device cuda \
        --numel 25000000 --numel 1024 --repeats 30 --json >>"$out/bench-cuda.jsonl" 2>>"$out/bench.log"; then
        status=1
        say "FAILED: bench compress --method $method (bench.log)" | tee -a "$out/bench.log" >&2
    fi
done

# 2. what the compressors add to a real model's step (optional: torchvision and the profiler's imports)
say "2/4 profile --model torchvision.models:resnet50 --device cuda"
if ! "$py" -c 'import torchvision' 2>/dev/null; then
    echo "skipped: torchvision is not installed" | tee "$out/profile.log"
elif ! why=$("$py" -c 'import hvdcomp.perfmodel.profile' 2>&1); then
    echo "skipped: hvdcomp.perfmodel.profile does not import here: ${why##*$'\n'}" | tee "$out/profile.log"
elif time_for "profile of ResNet-50" "$STAGE_TIMEOUT_PROFILE" && ! timeout -k 5 "$secs" "$py" -m hvdcomp.perfmodel.profile \
    --model torchvision.models:resnet50 --input-shape 3,224,224 --classes 1000 --batch-size 64 --autocast bf16 \
    --device cuda --methods "$(IFS=,; echo "${methods[*]}")" --out "$out/profile-resnet50-cuda.yaml" \
    2>&1 | tee "$out/profile.log"; then
    status=1
    say "FAILED: the ResNet-50 profile (profile.log)" >&2
fi

# 3. the Triton kernels' tests, compiled, no host synchronization allowed
say "3/4 tests/test_triton.py, tests/test_devices.py (every verdict in test_triton.log)"
# in parallel where pytest-xdist is installed: compiling the kernels' variants takes most of the time
parallel=()
"$py" -c 'import xdist' 2>/dev/null && parallel=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))")
# SIGINT at the limit: pytest then still prints why each test failed (a kill would lose it)
if time_for "tests/test_triton.py, tests/test_devices.py" "$STAGE_TIMEOUT_TESTS"; then
    REPORT_FAILURES="$out/failures.txt" PYTHONPATH="$PYTHONPATH:$repo/perf/gpu" \
        timeout -s INT -k 10 "$secs" "$py" -m pytest -p no:cacheprovider -p report_failures -v -rfEs --tb=short \
        "${parallel[@]}" tests/test_triton.py tests/test_devices.py -k "not test_reductions_on_one_rank" \
        >"$out/test_triton.log" 2>&1 || { status=1; say "FAILED: the Triton tests or the device tests" >&2; }
    tail -n 3 "$out/test_triton.log"
fi

# 4. a step's compression, each gradient alone against in buckets, the NaN/Inf check, the selection both ways and
# each kernel's device time
say "4/4 perf/gpu/buckets.py, checks.py --device cuda, selection.py and kernel_times.py"
if time_for buckets.py "$STAGE_TIMEOUT_BUCKETS"; then
    timeout -k 5 "$secs" "$py" perf/gpu/buckets.py --device cuda --repeats 10 --out "$out/buckets.jsonl" 2>&1 |
        tee "$out/buckets.log" || { status=1; say "FAILED: buckets (buckets.log)" >&2; }
fi
if time_for checks.py "$STAGE_TIMEOUT_CHECKS"; then
    timeout -k 5 "$secs" "$py" perf/gpu/checks.py --device cuda --out "$out/checks.jsonl" 2>&1 |
        tee -a "$out/buckets.log" || { status=1; say "FAILED: checks (buckets.log)" >&2; }
fi
if time_for selection.py "$STAGE_TIMEOUT_SELECTION"; then
    timeout -k 5 "$secs" "$py" perf/gpu/selection.py --out "$out/selection.jsonl" 2>&1 | tee -a "$out/buckets.log" ||
        { status=1; say "FAILED: selection (buckets.log)" >&2; }
fi
if time_for kernel_times.py "$STAGE_TIMEOUT_KERNEL_TIMES"; then
    timeout -k 5 "$secs" "$py" perf/gpu/kernel_times.py --out "$out/kernel_times.jsonl" 2>&1 | grep -v '^{' |
        tee -a "$out/buckets.log" || { status=1; say "FAILED: kernel_times (buckets.log)" >&2; }
fi
if time_for "kernel_times.py at 2^20" 20; then
    timeout -k 5 "$secs" "$py" perf/gpu/kernel_times.py --numel 1048576 --method topk --method threshold \
        --out "$out/kernel_times.jsonl" 2>&1 | grep -v '^{' | tee -a "$out/buckets.log" ||
        { status=1; say "FAILED: kernel_times at 2^20 (buckets.log)" >&2; }
fi
if time_for "kernel_times.py at 2^16" 20; then
    timeout -k 5 "$secs" "$py" perf/gpu/kernel_times.py --numel 65536 --method lgc --method powersgd \
        --out "$out/kernel_times.jsonl" 2>&1 | grep -v '^{' | tee -a "$out/buckets.log" ||
        { status=1; say "FAILED: kernel_times at 2^16 (buckets.log)" >&2; }
fi

# the summary: per method, speed against a copy (25 M) and time per call (1,024), from the JSON lines
"$py" - "$out/bench-cuda.jsonl" "${bench_methods[@]}" <<'EOF' 2>&1 | tee "$out/summary.txt" || status=1
import json
import sys

path, methods = sys.argv[1], sys.argv[2:]
# fraction_of_copy at 25 M elements, at least: the quantizers' issue (38) and the sparsifiers' (39)
targets = {"qsgd": 0.5, "signsgd": 0.5, "efsignsgd": 0.5, "onebit": 0.5, "bingrad": 0.5, "terngrad": 0.4, "orq": 0.25,
           "randomk": 0.5, "topk": 0.3, "threshold": 0.3, "dgc": 0.3, "powersgd": 0.3, "sketch": 0.25, "gravac": 0.25}
rows = {}
with open(path) as lines:
    for line in lines:
        row = json.loads(line)
        rows[row["method"], row["numel"]] = row
print(f"{'method':<10} {'25M: fraction_of_copy':>22} {'target':>7} {'1024: compress_us':>18} {'decompress_us':>14} "
      f"{'sum_us':>8} {'host_us (c+d)':>14}")
for method in methods:
    big, small = rows.get((method, 25_000_000)), rows.get((method, 1024))
    target = "-" if method not in targets else f"{targets[method]:.2f}"
    fraction = f"{big['fraction_of_copy']:.3f}" if big else "missing"
    if small:
        host = small["host_us"]["compress"] + small["host_us"]["decompress"]
        times = (f"{small['compress_us']:>18.1f} {small['decompress_us']:>14.1f} "
                 f"{small['compress_decompress_us']:>8.1f} {host:>14.1f}")
    else:
        times = f"{'missing':>18}"
    print(f"{method:<10} {fraction:>22} {target:>7} {times}")
print("(GPU times by CUDA events, L2 flushed, medians; host_us: the host's time to issue the calls)")
EOF
if [[ -f $out/profile-resnet50-cuda.yaml ]]; then
    grep -A "${#methods[@]}" '^per step' "$out/profile.log" | tee -a "$out/summary.txt" || true
fi
[[ -s $out/skipped.txt ]] && { echo "left out, the budget (BUDGET_S=$BUDGET_S) spent:"; cat "$out/skipped.txt"; } |
    tee -a "$out/summary.txt"
# (stage 4's lines but its JSON rows, which are in the .jsonl files)
[[ -s $out/buckets.log ]] && { echo "per step, each gradient alone against in buckets; the kernels' times:"
    grep -v '^{' "$out/buckets.log" || true; } | tee -a "$out/summary.txt"
say "results in $out; exit status $status"
exit "$status"
