"""Where a method's compress and decompress spend the GPU's time: each kernel's share, by PyTorch's profiler.

    python perf/gpu/kernel_times.py [--numel 25000000] [--method topk ...] [--out perf/results/kernel_times.jsonl]

``bench compress --device cuda`` gives a method's total against a copy; this names the kernels behind it, on the same
Gaussian tensor (PowerSGD: the squarest matrix), past warm-up, over ``--repeats`` calls of each. One JSON line per
method and call (compress, decompress): every kernel's name, calls and summed device time, largest first, and the time
per call between CUDA events around the calls (without the profiler): where it exceeds the kernels' sum, the device
waited for the host to issue them. For the sketch, one more call, ``rows by PyTorch``: its rows found as before
``sketch_rows`` (``any``, ``nonzero``, the indexing and the cast), to compare in the same run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hvdcomp.compressor import STEADY_STEP, Context
from hvdcomp.config import make_compressor
from hvdcomp.tools.bench import bench_shape, clock_fields, record

_DEFAULT = ("topk", "threshold", "dgc", "gravac", "sketch", "powersgd")


def _rows_by_pytorch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.any(1).nonzero().view(-1)
    return x[rows].reshape(-1), rows.to(torch.int32)


def kernel_times(method: str, numel: int, repeats: int) -> list[dict]:
    """Per call (compress, decompress) of ``method`` on ``numel`` entries: its kernels' device time per call."""
    compressor = make_compressor(method, None, error_feedback=False)
    shape = bench_shape(compressor, numel)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).cuda()
    ctx = Context.local(x, 0, step=STEADY_STEP)
    state = compressor.init_state(x, ctx)
    payload, meta = compressor.compress(x, state, ctx)
    calls = {"compress": lambda: compressor.compress(x, state, ctx),
             "decompress": lambda: compressor.decompress(payload, meta)}
    if method == "sketch":
        calls["rows by PyTorch"] = lambda: _rows_by_pytorch(x.reshape(compressor.items(x.shape), -1))
    rows = []
    for call, fn in calls.items():
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        event_us = start.elapsed_time(end) * 1e3 / repeats
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                fn()
            torch.cuda.synchronize()
        kernels = sorted(((e.key, e.count // repeats, e.device_time_total / repeats)
                          for e in prof.key_averages() if e.device_time_total > 0), key=lambda r: -r[2])
        rows.append({"method": method, "call": call, "numel": numel, "shape": list(shape),
                     **clock_fields(x.device), "repeats": repeats,
                     "device_us": round(sum(us for _, _, us in kernels), 3), "event_us": round(event_us, 3),
                     "kernels": [{"name": name[:120], "calls": count, "us": round(us, 3)}
                                 for name, count, us in kernels]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--method", action="append", help=f"(default: {' '.join(_DEFAULT)})")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("perf/results/kernel_times.jsonl"))
    args = parser.parse_args()
    for method in args.method or _DEFAULT:
        for row in kernel_times(method, args.numel, args.repeats):
            record(row, args.out)
            print(f"{method} {row['call']}: {row['device_us']:.1f} us of kernels per call, {row['event_us']:.1f} us "
                  "between CUDA events (the difference: the device waiting for the host's launches)")
            for kernel in row["kernels"][:8]:
                print(f"    {kernel['us']:9.1f} us  {kernel['calls']:3d}x  {kernel['name']}", flush=True)


if __name__ == "__main__":
    main()
