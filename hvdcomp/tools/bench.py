"""``hvdcomp bench compress``: wire size, speed and error of one compressor on one tensor, in one process.

    hvdcomp bench compress --method terngrad --numel 25000000 --device cpu --json
    hvdcomp bench compress --method qsgd --method fp16 --numel 25000000 --numel 1024 --device cuda --json

Reports bits per element on the wire (the packed payload, padding included), compress and decompress
throughput in GB/s of float32 input and time per call in microseconds (``compress_us``, ``decompress_us``: on a
small tensor, what matters is the time, not the throughput), the relative error ||D(C(x)) - x|| / ||x|| on a
Gaussian tensor, and the throughput of ``x.clone()`` measured in the same run as the reference for memory speed
(``fraction_of_copy``). The clone allocates its output as decompress does; on the CPU a fresh allocation of a large
tensor (over glibc's mmap threshold) faults its pages in on every call, so ``copy_into_gbps``, a copy into a buffer
allocated once, gives the memory's own speed beside it (on CUDA the caching allocator makes the two alike).
``--method`` and ``--numel`` may be repeated: one report per method and size, in one process (with ``--json``, one
JSON line each).

Times are the median of ``--repeats`` rounds after one warm-up, the copies, compress and decompress interleaved in each
round so that a change of load hits all alike; ``spread_us`` gives each one's fastest and slowest round.

* CPU: a host clock (``time.perf_counter``) around each call.
* CUDA: the GPU's own time, as ``triton.testing.do_bench`` measures it. Before each call a buffer larger than the
  L2 cache is zeroed (so that no call finds its input in L2, left there by the one before), then CUDA events are
  recorded around the call, and the host synchronizes once per round, not per call: a host clock with a
  synchronize around each call also times the synchronize's and the launch's latency, which inflate a short call
  (a 50 us copy). The host issues a call while the GPU is still zeroing the buffer, so its launch cost is hidden
  where it is shorter than that; the host's own time to issue each call (what a training step's CPU thread pays
  for it) is reported apart, in ``host_us``.

The compressor runs bare (no error feedback), as one rank would compress its own gradient; a method that
compresses only matrices (PowerSGD) gets the squarest matrix of ``--numel`` elements.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hvdcomp import wire
from hvdcomp.compressor import STEADY_STEP, Compressor, Context
from hvdcomp.config import make_compressor
from hvdcomp.methods import METHODS

#: the L2 flush buffer's least size: triton.testing.do_bench's (256 MB), at least twice the L2 cache
FLUSH_BYTES = 256 * 1024 * 1024


@dataclass
class Timing:
    """One timed function's samples in seconds: ``times`` by the clock of the device (the host's on CPU, CUDA
    events on CUDA), ``host`` by the host's clock around the call alone."""

    times: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def flush_bytes(l2_cache_bytes: int) -> int:
    """Size of the buffer zeroed between timed calls: at least twice the L2 cache, and no less than do_bench's."""
    return max(FLUSH_BYTES, 2 * l2_cache_bytes)


@functools.cache
def _flush_buffer(device: torch.device) -> torch.Tensor:
    """The L2 flush buffer of ``device``, allocated once per process (every method and size reuses it)."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return torch.empty(flush_bytes(l2) // 4, dtype=torch.int32, device=device)


def _timed_cpu(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Timing]:
    timings = {name: Timing() for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            timings[name].times.append(elapsed)
            timings[name].host.append(elapsed)
    return timings


def _timed_cuda(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int) -> dict[str, Timing]:
    timings = {name: Timing() for name in fns}
    flush = _flush_buffer(device)
    stream = torch.cuda.current_stream(device)
    for _ in range(repeats):
        events = {}
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()  # evicts the previous call's data from L2
            start.record(stream)
            issued = time.perf_counter()
            fn()
            timings[name].host.append(time.perf_counter() - issued)
            end.record(stream)
            events[name] = start, end
        torch.cuda.synchronize(device)  # once per round: the events are read after
        for name, (start, end) in events.items():
            timings[name].times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return timings


def timed(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int) -> dict[str, Timing]:
    """Each function timed ``repeats`` times in interleaved rounds (after one warm-up call each), so that a
    change of load hits all alike: by the host clock on CPU, by CUDA events with L2 flushed between calls on CUDA
    (the module docstring says why)."""
    for fn in fns.values():
        fn()  # warm-up: allocations, JIT compilation, lazy initialization
    if device.type != "cuda":
        return _timed_cpu(fns, repeats)
    torch.cuda.synchronize(device)
    return _timed_cuda(fns, device, repeats)


def clock_fields(device: torch.device) -> dict[str, Any]:
    """The JSON fields that say where and by which clock perf/'s rows were timed."""
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or platform.machine(),
        "threads": torch.get_num_threads(),
        "clock": "cuda events, L2 flushed" if device.type == "cuda" else "host",
    }


def timing_fields(timings: dict[str, Timing], unit: str = "ms") -> dict[str, Any]:
    """:func:`timed`'s results as JSON fields, per function its median ``{name}_{unit}``, its range
    ``{name}_spread_{unit}`` ([min, max]) and its median host time ``{name}_host_{unit}``; ``unit`` ms or us."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    fields: dict[str, Any] = {}
    for name, timing in timings.items():
        fields[f"{name}_{unit}"] = round(scale * timing.median, 3)
        fields[f"{name}_spread_{unit}"] = [round(scale * min(timing.times), 3), round(scale * max(timing.times), 3)]
        fields[f"{name}_host_{unit}"] = round(scale * statistics.median(timing.host), 3)
    return fields


def record(row: dict[str, Any], path: Path) -> None:
    """``row`` with the date (UTC) as a JSON line, printed and appended to ``path``: how perf/'s scripts keep their
    figures."""
    line = json.dumps({**row, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    print(line, flush=True)
    with path.open("a") as out:
        out.write(line + "\n")


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def bench_shape(compressor: Compressor, numel: int) -> torch.Size:
    """The shape a benchmark gives ``numel`` elements: flat, or for a method of matrices (PowerSGD) the squarest
    matrix of ``numel`` elements."""
    shape = torch.Size([numel])
    if not compressor.compresses(shape):
        rows = next(r for r in range(math.isqrt(numel), 0, -1) if numel % r == 0)
        shape = torch.Size([rows, numel // rows])
    return shape


def bench_compress(method: str, numel: int, device: str = "cpu", repeats: int = 5, seed: int = 0,
                   options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of ``method`` on a Gaussian tensor of ``numel`` float32 elements (the module docstring)."""
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch.cuda.is_available() is False on this machine")
    compressor = make_compressor(method, options, error_feedback=False)
    shape = bench_shape(compressor, numel)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(target)
    gigabytes = numel * 4 / 1e9
    ctx = Context.local(x, seed, step=STEADY_STEP)  # past any warm-up (DGC's sparsity stages)
    state = compressor.init_state(x, ctx)
    payload, meta = compressor.compress(x, state, ctx)
    # the error of this payload, before the timed calls reuse the state (PowerSGD's next compress orthogonalizes the
    # Q it sent in place)
    relative_error = ((compressor.decompress(payload, meta).float() - x).norm() / x.norm()).item()
    ready = torch.empty_like(x)
    timings = timed({"copy": lambda: x.clone(), "copy_into": lambda: ready.copy_(x),
                     "compress": lambda: compressor.compress(x, state, ctx),
                     "decompress": lambda: compressor.decompress(payload, meta)}, target, repeats)
    copy_s, compress_s, decompress_s = (timings[name].median for name in ("copy", "compress", "decompress"))
    both = gigabytes / (compress_s + decompress_s)
    return {
        "method": method,
        "options": options or {},
        "numel": numel,
        "shape": list(shape),
        **clock_fields(target),
        "repeats": repeats,
        "bits_per_element": wire.nbytes(wire.layout_of(payload)) * 8 / numel,
        "compress_gbps": gigabytes / compress_s,
        "decompress_gbps": gigabytes / decompress_s,
        "compress_decompress_gbps": both,
        "copy_gbps": gigabytes / copy_s,
        "copy_into_gbps": gigabytes / timings["copy_into"].median,
        "fraction_of_copy": both / (gigabytes / copy_s),
        "compress_us": _us(compress_s),
        "decompress_us": _us(decompress_s),
        "compress_decompress_us": _us(compress_s + decompress_s),
        "copy_us": _us(copy_s),
        "spread_us": {name: {"min": _us(min(t.times)), "max": _us(max(t.times))} for name, t in timings.items()},
        "host_us": {name: _us(statistics.median(t.host)) for name, t in timings.items()},
        "relative_error": relative_error,
        # False: in training the method would leave such a tensor dense (PowerSGD's [1, n], LGC's small k); timed all
        # the same, as its compress path runs
        "compresses": compressor.compresses(shape),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdcomp bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    compress = sub.add_parser("compress", help="compressors on one tensor each")
    compress.add_argument("--method", required=True, action="append", choices=sorted(METHODS),
                          help="a method (repeat the flag for several)")
    compress.add_argument("--numel", type=int, action="append",
                          help="the tensor's elements (repeat the flag for several; default 25000000)")
    compress.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    compress.add_argument("--repeats", type=int, default=5)
    compress.add_argument("--option", action="append", default=[], metavar="KEY=YAML",
                          help="a method option, e.g. --option ratio=0.001 (given to every --method)")
    compress.add_argument("--json", action="store_true", help="print one JSON object per method and size")
    args = parser.parse_args(argv)
    import yaml

    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--option {item!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    sizes = args.numel or [25_000_000]
    if min(sizes) < 1 or args.repeats < 1:
        parser.error("--numel and --repeats must be >= 1")
    for method in args.method:  # every method's options checked before any is timed
        make_compressor(method, options, error_feedback=False)
    for i, (method, numel) in enumerate((m, n) for m in args.method for n in sizes):
        result = bench_compress(method, numel, args.device, args.repeats, options=options)
        if not result["compresses"]:
            print(f"hvdcomp bench: {method} would leave a tensor of shape {tuple(result['shape'])} dense in training "
                  "(timed all the same)", file=sys.stderr)
        if args.json:
            print(json.dumps(result), flush=True)
            continue
        if i:
            print()
        for key, value in result.items():
            print(f"{key:>26}: {value:.4g}" if isinstance(value, float) else f"{key:>26}: {value}")
    return 0


if __name__ == "__main__":  # python -m hvdcomp.tools.bench compress ... (no installed console script needed)
    sys.exit(main())
