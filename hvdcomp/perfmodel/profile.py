"""``hvdcomp profile``: a model's measured compute profile, the input of ``hvdcomp predict``.

    hvdcomp profile --model synthetic --batch-size 128 --out profile.yaml
    launch/mpirun.sh -np 4 hvdcomp profile --model synthetic --out profile.yaml   # ranks sharing a host

For one model and per-rank batch size it measures forward, backward and optimizer-step time, each
gradient's size, the time it becomes ready in backward (a post-accumulate-grad hook per parameter, the
hook DistributedOptimizer starts its collectives from) and the cost of DistributedOptimizer's non-finite
check on it, and, for every compressor, on that model's own gradients and exactly as DistributedOptimizer
would configure it (``min_numel``, error feedback): bytes on the wire, the statistics computed in the hook
(TernGrad's scaler), encoding (packing included), decoding of one payload and of each further payload
(``aggregate``), as :mod:`hvdcomp.tools.bench` does for one tensor, and writing the averaged sum into the gradient.
Each time is the median of ``--repeats`` runs after warm-up. Under mpirun every rank measures at the same
time (barriers around each timed call), as ranks sharing a host's cores compute during training, and the
slowest rank's median is written (a synchronous step waits for it). Horovod is initialized there, as in
training: with the MPI controller its background thread polls MPI every cycle and takes CPU time from the
compute (on the emulated cluster, where all hosts share this machine's 2 cores, forward and backward ran
1.7x slower with it than without).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hvdcomp import wire
from hvdcomp.compressor import STEADY_STEP, Compressor, Context
from hvdcomp.config import CompressionConfig, edges
from hvdcomp.methods import METHODS
from hvdcomp.optimizer import nonfinite
from hvdcomp.perfmodel.schema import dump
from hvdcomp.tools.workloads import WORKLOADS

PROBE_WORLD = 2  # the world size hvdcomp's choices are made for (only the collective depends on it)


class Ranks:
    """The ranks of an mpirun job, or this process alone."""

    def __init__(self) -> None:
        self.comm: Any = None
        if int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1:
            import horovod.torch as hvd
            from mpi4py import MPI

            self.comm = MPI.COMM_WORLD
            hvd.init()  # its background thread runs beside the compute in training: let it run here too
        self.rank = self.comm.Get_rank() if self.comm else 0
        self.size = self.comm.Get_size() if self.comm else 1

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()

    def slowest(self, value: float) -> float:
        if self.comm is None:
            return value
        from mpi4py import MPI

        return self.comm.allreduce(value, op=MPI.MAX)


def _median_ms(fn: Callable[[], Any], repeats: int, ranks: Ranks, before: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        ranks.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return ranks.slowest(statistics.median(times) * 1e3)


def measure_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, repeats: int, ranks: Ranks) -> dict[str, Any]:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    ready: dict[str, list[float]] = {name: [] for name, _ in named}
    clock = {"start": 0.0}
    for name, p in named:
        p.register_post_accumulate_grad_hook(
            lambda _, name=name: ready[name].append(time.perf_counter() - clock["start"]))
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for step in range(repeats + 2):
        optimizer.zero_grad()
        ranks.barrier()
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t1 = clock["start"] = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if step >= 2:  # two warm-up steps
            for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                phases[key].append(value)
    gradients = [{"name": name, "numel": p.numel(), "bytes": p.numel() * p.element_size(),
                  "ready_ms": round(ranks.slowest(statistics.median(ready[name][2:]) * 1e3), 4),
                  "check_ms": round(_median_ms(lambda p=p: nonfinite(p.grad._values() if p.grad.is_sparse else p.grad),
                                               repeats, ranks), 4)}
                 for name, p in named]
    gradients.sort(key=lambda g: g["ready_ms"])
    result = {key: round(ranks.slowest(statistics.median(values) * 1e3), 4) for key, values in phases.items()}
    return {"forward_ms": result["forward"], "backward_ms": result["backward"], "optimizer_ms": result["optimizer"],
            "gradients": gradients}


def measure_encoded(compressor: Compressor, grad: torch.Tensor, repeats: int, ranks: Ranks) -> dict[str, Any]:
    """Wire bytes and costs of ``compressor`` (as DistributedOptimizer wraps it) on one gradient."""
    inner = compressor.unwrapped()
    ctx = Context.local(grad, step=STEADY_STEP)
    state = compressor.init_state(grad, ctx)
    gated = compressor.agree(grad, state, ctx) is not None
    shared: dict[str, Any] = {}

    def statistics_() -> None:
        request = compressor.agree(grad, state, ctx)
        shared["value"] = None if request is None else request.values

    def encode() -> Any:
        payload = compressor.compress(grad, state, ctx, shared.get("value"))[0]
        return payload if inner.summable else wire.pack(payload)

    shared_ms = _median_ms(statistics_, repeats, ranks) if gated else 0.0
    encode_ms = _median_ms(encode, repeats, ranks, before=statistics_ if gated else None)
    if gated:
        statistics_()
    payload, meta = compressor.compress(grad, state, ctx, shared.get("value"))
    summed = (inner.decompress(payload, meta) if inner.summable else inner.aggregate([payload], meta)).view_as(grad)
    target = grad.clone()
    finish_ms = _median_ms(lambda: torch.div(summed, PROBE_WORLD, out=target), repeats, ranks)
    extra_ms = 0.0
    part_bytes = [part.numel() * part.element_size() for part in payload]
    if inner.summable or inner.reduction is not None:  # allreduced as they are
        wire_bytes = sum(part_bytes)
        decode_ms = _median_ms(lambda: inner.decompress(payload, meta), repeats, ranks)
    else:
        wire_bytes = wire.nbytes(wire.layout_of(payload)) + (0 if inner.fixed_size else 8 * len(payload))
        decode_ms = _median_ms(lambda: inner.aggregate([payload], meta), repeats, ranks)
        four_ms = _median_ms(lambda: inner.aggregate([payload] * 4, meta), repeats, ranks)
        extra_ms = max(four_ms - decode_ms, 0.0) / 3
    return {"wire_bytes": int(wire_bytes), "part_bytes": part_bytes, "shared_ms": round(shared_ms, 4),
            "encode_ms": round(encode_ms, 4), "decode_ms": round(decode_ms, 4),
            "decode_extra_payload_ms": round(extra_ms, 4), "finish_ms": round(finish_ms, 4)}


def measure_compressor(method: str, named: list[tuple[str, torch.Tensor]], repeats: int,
                       ranks: Ranks) -> dict[str, Any]:
    """One compressor on every gradient it would compress; ``{}`` if it compresses none of them."""
    config = CompressionConfig.parse(method)
    entry: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    edge = edges([name for name, _ in named])
    for name, grad in named:
        compressor = config.choose(name, grad.shape, PROBE_WORLD, edge=name in edge).compressor
        if compressor is None:
            continue
        entry[name] = measure_encoded(compressor, grad, repeats, ranks)
        inner = compressor.unwrapped()
        ctx = Context.local(grad)
        summary = {"summable": inner.summable, "fixed_size": inner.fixed_size, "sparse_payload": inner.sparse_payload,
                   "checks_input": not compressor.keeps_nonfinite,
                   "shared_before_encode": compressor.agree(grad, compressor.init_state(grad, ctx), ctx) is not None,
                   **({"reduction": inner.reduction} if inner.reduction else {}),
                   "options": {k: v for k, v in vars(inner).items() if not k.startswith("_")}}
    if not entry:
        return {}
    return {**summary, "gradients": entry}


def profile(model_name: str, batch_size: int | None, repeats: int, methods: list[str], seed: int = 0,
            ranks: Ranks | None = None) -> dict[str, Any]:
    """The profile document of ``model_name`` (see the module docstring)."""
    ranks = ranks or Ranks()
    workload = WORKLOADS[model_name](seed)
    batch_size = batch_size or workload.batch_size
    index = torch.arange(batch_size) % len(workload.data.train_x)
    x, y = workload.data.train_x[index], workload.data.train_y[index]
    model = workload.model
    document: dict[str, Any] = {"kind": "profile", "model": model_name, "batch_size": batch_size,
                                "device": f"cpu ({platform.processor() or platform.machine()}, "
                                          f"{torch.get_num_threads()} threads)"}
    document.update(measure_steps(model, x, y, repeats, ranks))
    # sparse gradients (bow's embedding) densified, as DistributedOptimizer hands them to every method but the sketch
    named = [(name, p.grad.detach().to_dense() if p.grad.is_sparse else p.grad.detach().clone())
             for name, p in model.named_parameters() if p.grad is not None]
    compressors = {}
    for method in methods:
        measured = measure_compressor(method, named, repeats, ranks)
        if measured:
            compressors[method] = measured
    document["compressors"] = compressors
    document["measured"] = {"ranks_measuring_at_once": ranks.size, "repeats": repeats, "torch": str(torch.__version__),
                            "date": datetime.date.today().isoformat(), "statistic": "median, slowest rank"}
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdcomp profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--batch-size", type=int, help="per rank (default: the workload's)")
    parser.add_argument("--repeats", type=int, default=10)
    compressed = sorted(m for m in METHODS if m != "none")
    parser.add_argument("--methods", default=",".join(compressed),
                        help=f"comma-separated compressors to measure (default: {','.join(compressed)})")
    parser.add_argument("--out", default="profile.yaml")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        if method not in compressed:
            parser.error(f"--methods: unknown compressor {method!r}; valid: {', '.join(compressed)}")
    if args.repeats < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--repeats and --batch-size must be >= 1")
    ranks = Ranks()
    document = profile(args.model, args.batch_size, args.repeats, methods, ranks=ranks)
    if ranks.rank == 0:
        dump(document, args.out, f"hvdcomp profile of {args.model}, batch {document['batch_size']} per rank "
                                 f"(measured; times in ms are medians of the slowest rank)")
        print(f"hvdcomp profile: wrote {args.out}: forward {document['forward_ms']:.2f} ms, backward "
              f"{document['backward_ms']:.2f} ms, {len(document['gradients'])} gradients, compressors "
              f"{', '.join(document['compressors']) or 'none'}")
    return 0
