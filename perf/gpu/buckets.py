"""A step's compression per gradient against in buckets (the config's ``bucket_cap_mb``), on ResNet-50's gradients.

    .venv/bin/python perf/gpu/buckets.py [--device cuda] [--cap-mb 25] [--method topk ...] [--repeats 10]

On a GPU a method spends most of a small gradient's compression issuing its kernels from the host (docs/gpu.md:
ResNet-50's 76 compressed gradients cost 24% to 112% of forward + backward). ``bucket_cap_mb`` compresses the
gradients of one method concatenated, a bucket at a time. This times both ways, per method, on the gradients of
torchvision's ResNet-50 (its parameters' shapes, in its order; Gaussian values), as DistributedOptimizer runs them with
the default ``min_numel``:

* ``per_tensor``: each compressed gradient encoded (statistics, compression, the wire's packing for gathered
  payloads) and decoded (the sum of one payload), one after another, as ``hvdcomp profile`` measures them;
* ``buckets``: the same, each bucket (:meth:`hvdcomp.config.CompressionConfig.buckets`, in reverse model order) as one
  tensor, its concatenation included; gradients left alone by the buckets as before.

PowerSGD and the sketch method reduce a bucket their own way (PowerSGD factors each matrix and sums the Ps and Qs of
all together; the sketch sums each gradient's rows as alone, with one vote and one allreduce for the bucket): both
ways run their reductions as one rank's step runs them (:func:`hvdcomp.requests.run_one_rank_step`: each allreduce's
sum this rank's own tensors, the sketch's vote answered in one copy to the host for the step).

Both are one function per step, timed in interleaved rounds by ``hvdcomp.tools.bench.timed`` (CUDA events with L2
flushed between calls on a GPU; the host clock on CPU). The methods' states are kept across calls (residuals grow), as
in training. Rows go to perf/results/buckets.jsonl (one JSON line per method and device).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hvdcomp import wire
from hvdcomp.compressor import STEADY_STEP, Compressor, Context
from hvdcomp.config import Choice, CompressionConfig, edges
from hvdcomp.methods import METHODS
from hvdcomp.reductions import ReductionMethod
from hvdcomp.requests import Reduction, run_one_rank_step
from hvdcomp.tools.bench import clock_fields, timed, timing_fields

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "perf" / "results" / "buckets.jsonl"
#: ResNet-50's parameter count (torchvision.models.resnet50)
RESNET50_PARAMETERS = 25_557_032


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """torchvision's ``resnet50()`` parameters' names and shapes, in its order (bottlenecks of 3, 4, 6 and 3 blocks,
    expansion 4, 1,000 classes); checked against torchvision where it is installed."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)),
                                                 ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True), start=1):
        for block in range(blocks):
            name = f"layer{layer}.{block}"
            for conv, (out, into, kernel) in enumerate(((planes, inplanes, 1), (planes, planes, 3),
                                                        (planes * 4, planes, 1)), start=1):
                shapes += [(f"{name}.conv{conv}.weight", (out, into, kernel, kernel)),
                           (f"{name}.bn{conv}.weight", (out,)), (f"{name}.bn{conv}.bias", (out,))]
            if block == 0:
                shapes += [(f"{name}.downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                           (f"{name}.downsample.1.weight", (planes * 4,)), (f"{name}.downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    return [*shapes, ("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def _torchvision_shapes() -> list[tuple[str, tuple[int, ...]]] | None:
    try:
        import torchvision
    except ImportError:
        return None
    return [(name, tuple(p.shape)) for name, p in torchvision.models.resnet50().named_parameters()]


def _coder(compressor: Compressor, tensor: torch.Tensor, seed: str) -> Callable[[torch.Tensor], Any]:
    """One gradient's (or bucket's) encode and decode, with its own state, as a function of the tensor."""
    ctx = Context.local(tensor, name=seed, step=STEADY_STEP)
    state = compressor.init_state(tensor, ctx)

    def code(x: torch.Tensor) -> Any:
        request = compressor.agree(x, state, ctx)
        payload, meta = compressor.compress(x, state, ctx, None if request is None else request.values)
        if compressor.summable:
            return compressor.decompress(payload, meta)
        wire.pack(payload)
        return compressor.aggregate([payload], meta)
    return code


def _bucket_coder(choice: Choice, members: list[torch.Tensor], seed: str) -> Callable[[list[torch.Tensor]], Any]:
    """A gradient's or a bucket's encode and decode, with its own state, as a function of the gradients: :func:`_coder`
    of the gradient, or of the bucket's concatenation."""
    if len(members) == 1:
        one = _coder(choice.compressor, members[0], seed)
        return lambda grads: one(grads[0])
    code = _coder(choice.compressor, torch.cat([grad.reshape(-1) for grad in members]), seed)

    def concatenated(grads: list[torch.Tensor]) -> Any:
        return code(torch.cat([grad.reshape(-1) for grad in grads])).split([grad.numel() for grad in grads])
    return concatenated


def _reducer(choice: Choice, members: list[torch.Tensor], seed: str) -> Callable[[list[torch.Tensor]], Reduction]:
    """For a reduction that reduces a bucket its own way: one gradient's (``members`` of one) or a bucket's reduction,
    with its own state, as a function of the gradients."""
    reduction = choice.reduction
    assert reduction is not None
    ctx = Context.local(members[0], name=seed, step=STEADY_STEP)
    if len(members) == 1:
        state = reduction.init_state(members[0], ctx)
        return lambda grads: reduction.reduce(grads[0], state, ctx)
    bucket_state = reduction.init_bucket_state(members, ctx)
    return lambda grads: reduction.reduce_bucket(grads, bucket_state, ctx)


def planned(method: str, device: torch.device, cap_mb: float
            ) -> tuple[list[tuple[str, torch.Tensor, Choice]], list[list[int]]]:
    """ResNet-50's gradients that ``method`` compresses (Gaussian values on ``device``, in reverse model order: the
    order backward readies them in), each with its name and choice, and the config's buckets of them (positions)."""
    config = CompressionConfig.parse({"method": method, "bucket_cap_mb": cap_mb})
    generator = torch.Generator().manual_seed(0)
    edge = edges([name for name, _ in resnet50_shapes()])  # what LGC (dense_edges) leaves dense, as in training
    compressed = []
    for name, shape in reversed(resnet50_shapes()):
        grad = torch.randn(shape, generator=generator).to(device)
        choice = config.choose(name, grad.shape, 2, edge=name in edge)
        if choice.compressor is not None:
            compressed.append((name, grad, choice))
    return compressed, config.buckets([(grad, choice) for _, grad, choice in compressed])


def measure(method: str, device: torch.device, cap_mb: float, repeats: int) -> dict[str, Any]:
    compressed, buckets = planned(method, device, cap_mb)
    in_bucket = {position for bucket in buckets for position in bucket}
    if not compressed:
        raise SystemExit(f"{method} compresses none of ResNet-50's gradients")
    # PowerSGD and the sketch method: their reductions, run as one rank's step runs them; the others: their codecs
    own_way = type(compressed[0][2].reduction).reduce_bucket is not ReductionMethod.reduce_bucket
    make = _reducer if own_way else _bucket_coder

    def made(unit: list[int]) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
        grads = [compressed[position][1] for position in unit]
        return grads, make(compressed[unit[0]][2], grads, compressed[unit[0]][0])

    alone = [made([position]) for position in range(len(compressed))]
    units = [alone[position] for position in range(len(compressed)) if position not in in_bucket]
    units += [made(bucket) for bucket in buckets]

    def step(of: list[tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]]) -> None:
        done = [run(grads) for grads, run in of]
        if own_way:
            run_one_rank_step(done)

    def step_per_tensor() -> None:
        step(alone)

    def step_buckets() -> None:
        step(units)

    timings = timed({"per_tensor": step_per_tensor, "buckets": step_buckets}, device, repeats)
    row: dict[str, Any] = {
        "method": method, "model": "resnet50", **clock_fields(device), "repeats": repeats, "bucket_cap_mb": cap_mb,
        "gradients": len(compressed), "compressed_numel": sum(grad.numel() for _, grad, _ in compressed),
        "buckets": len(buckets), "bucket_sizes": [len(bucket) for bucket in buckets],
        "alone": len(compressed) - len(in_bucket), **timing_fields(timings),
    }
    row["buckets_over_per_tensor"] = round(row["buckets_ms"] / row["per_tensor_ms"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cap-mb", type=float, default=25.0, help="bucket_cap_mb (default 25, DDP's)")
    parser.add_argument("--method", action="append", help="a method (default: every one)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    known = _torchvision_shapes()
    if known is not None and known != resnet50_shapes():
        raise SystemExit("resnet50_shapes() differs from torchvision's resnet50(): fix it")
    assert sum(torch.Size(shape).numel() for _, shape in resnet50_shapes()) == RESNET50_PARAMETERS
    device = torch.device(args.device)
    methods = args.method or [m for m in METHODS if m != "none"]
    with args.out.open("a") as out:
        for method in methods:
            started = time.perf_counter()
            row = measure(method, device, args.cap_mb, args.repeats)
            row["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            print(f"{method:<10} {row['gradients']} gradients, {row['buckets']} buckets {row['bucket_sizes']} + "
                  f"{row['alone']} alone: per tensor {row['per_tensor_ms']:.2f} ms {row['per_tensor_spread_ms']}, "
                  f"buckets {row['buckets_ms']:.2f} ms {row['buckets_spread_ms']} "
                  f"({row['buckets_over_per_tensor']:.3f}x; {time.perf_counter() - started:.0f} s)", flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()  # each method's row kept where the stage's time limit ends the rest
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
