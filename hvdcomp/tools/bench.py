"""``hvdcomp bench compress``: wire size, speed and error of one compressor on one tensor, in one process.

    hvdcomp bench compress --method terngrad --numel 25000000 --device cpu --json

Reports bits per element on the wire (the packed payload, padding included), compress and decompress
throughput in GB/s of float32 input, the relative error ||D(C(x)) - x|| / ||x|| on a Gaussian tensor, and the
throughput of ``x.clone()`` measured in the same run as the reference for memory speed. Times are the median
of ``--repeats`` rounds after one warm-up, copy, compress and decompress interleaved in each round so that a
change of load hits all three alike; CUDA runs synchronize around each timed call. The compressor runs
bare (no error feedback), as one rank would compress its own gradient; a method that compresses only matrices
(PowerSGD) gets the squarest matrix of ``--numel`` elements.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hvdcomp import wire
from hvdcomp.compressor import STEADY_STEP, Context
from hvdcomp.config import make_compressor
from hvdcomp.methods import METHODS


def _timed(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each function, timed in interleaved rounds so that load changes hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_compress(method: str, numel: int, device: str = "cpu", repeats: int = 5, seed: int = 0,
                   options: dict[str, Any] | None = None) -> dict[str, Any]:
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch.cuda.is_available() is False on this machine")
    compressor = make_compressor(method, options, error_feedback=False)
    shape = torch.Size([numel])
    if not compressor.compresses(shape):  # a method for matrices (PowerSGD): the squarest matrix of numel
        rows = next(r for r in range(math.isqrt(numel), 0, -1) if numel % r == 0)
        shape = torch.Size([rows, numel // rows])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(target)
    gigabytes = numel * 4 / 1e9
    ctx = Context.local(x, seed, step=STEADY_STEP)  # past any warm-up (DGC's sparsity stages)
    state = compressor.init_state(x, ctx)
    payload, meta = compressor.compress(x, state, ctx)
    timings = _timed({"copy": lambda: x.clone(), "compress": lambda: compressor.compress(x, state, ctx),
                      "decompress": lambda: compressor.decompress(payload, meta)}, target, repeats)
    copy_s, compress_s, decompress_s = timings["copy"], timings["compress"], timings["decompress"]
    decoded = compressor.decompress(payload, meta).float()
    relative_error = ((decoded - x).norm() / x.norm()).item()
    both = gigabytes / (compress_s + decompress_s)
    return {
        "method": method,
        "options": options or {},
        "numel": numel,
        "shape": list(shape),
        "device": str(target),
        "device_name": torch.cuda.get_device_name(target) if target.type == "cuda" else platform.processor()
        or platform.machine(),
        "threads": torch.get_num_threads(),
        "bits_per_element": wire.nbytes(wire.layout_of(payload)) * 8 / numel,
        "compress_gbps": gigabytes / compress_s,
        "decompress_gbps": gigabytes / decompress_s,
        "compress_decompress_gbps": both,
        "copy_gbps": gigabytes / copy_s,
        "fraction_of_copy": both / (gigabytes / copy_s),
        "relative_error": relative_error,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdcomp bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    compress = sub.add_parser("compress", help="one compressor on one tensor")
    compress.add_argument("--method", required=True, choices=sorted(METHODS))
    compress.add_argument("--numel", type=int, default=25_000_000)
    compress.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    compress.add_argument("--repeats", type=int, default=5)
    compress.add_argument("--option", action="append", default=[], metavar="KEY=YAML",
                          help="a method option, e.g. --option ratio=0.001")
    compress.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    import yaml

    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--option {item!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    if args.numel < 1 or args.repeats < 1:
        parser.error("--numel and --repeats must be >= 1")
    result = bench_compress(args.method, args.numel, args.device, args.repeats, options=options)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}: {value:.4g}" if isinstance(value, float) else f"{key:>26}: {value}")
    return 0
