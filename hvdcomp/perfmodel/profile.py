"""``hvdcomp profile``: a model's measured compute profile, the input of ``hvdcomp predict``.

    hvdcomp profile --model synthetic --batch-size 128 --out profile.yaml
    launch/mpirun.sh -np 4 hvdcomp profile --model synthetic --out profile.yaml   # ranks sharing a host
    hvdcomp profile --model mypackage.nets:build --input-shape 3,224,224 --classes 1000 --batch-size 32
    hvdcomp profile --model mypackage.nets:build --batch mypackage.nets:sample --device cuda
    hvdcomp profile --model torchvision.models:resnet50 --input-shape 3,224,224 --classes 1000 --batch-size 64 \
        --autocast bf16 --device cuda

Any model: ``--model package.module:factory`` (a callable returning the model), with its input either as a shape
(``--input-shape``, random normal values, or token ids below ``--vocab``; targets are classes below ``--classes``)
or as ``--batch package.module:function`` (called with the batch size, returning ``(inputs, targets)``); the loss is
cross entropy (a classifier's logits) unless ``--loss package.module:function`` names another (called with the
outputs and the targets); ``--autocast bf16`` runs the forward pass and the loss under ``torch.autocast`` (mixed
precision; the gradients stay float32). From Python, :func:`profile` takes the model, a batch and any loss function.
On ``--device cuda`` (the model and batch on the rank's GPU) the step's phases are timed by the host clock, each
closed by a device synchronization; the time each gradient becomes ready is read from CUDA events recorded in its
hook (the hook runs when the host enqueues, not when the GPU is done); and each per-gradient cost (encoding,
decoding, the checks) by CUDA events around the call (:func:`median_ms`: a host clock stopped after a synchronize
would count the synchronize's own latency too, which inflates a short call).

For one model and per-rank batch size it measures forward, backward and optimizer-step time, each
gradient's size, the time it becomes ready in backward (a post-accumulate-grad hook per parameter, the
hook DistributedOptimizer starts its collectives from) and the cost of DistributedOptimizer's non-finite
check on it, and, for every compressor, on that model's own gradients and exactly as DistributedOptimizer
would configure it (``min_numel``, error feedback): bytes on the wire, the statistics computed in the hook
(TernGrad's scaler), encoding (packing included), decoding of one payload and of each further payload
(``aggregate``), as :mod:`hvdcomp.tools.bench` does for one tensor, and writing the averaged sum into the gradient;
and per compressor, what it adds to a step (:func:`step_totals`: the per-gradient encode and decode times summed
over the compressed gradients, and that as a fraction of forward + backward), which the command prints too.
Each time is the median of ``--repeats`` runs after warm-up. Under mpirun every rank measures at the same
time (barriers around each timed call), as ranks sharing a host's cores compute during training, and the
slowest rank's median is written (a synchronous step waits for it). Horovod is initialized there, as in
training: with the MPI controller its background thread polls MPI every cycle and takes CPU time from the
compute (on the emulated cluster, where all hosts share this machine's 2 cores, forward and backward ran
1.7x slower with it than without).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import inspect
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hvdcomp import extras, wire
from hvdcomp.compressor import STEADY_STEP, Compressor, Context, nonfinite
from hvdcomp.config import CompressionConfig, edges
from hvdcomp.methods import METHODS
from hvdcomp.perfmodel.schema import STEP_TOTALS, dump
from hvdcomp.workloads import WORKLOADS

PROBE_WORLD = 2  # the world size hvdcomp's choices are made for (only the collective depends on it)
#: ``--autocast``: mixed precision for the forward pass (ResNet-50's usual "batch 64, bf16 autocast")
AUTOCAST = {"bf16": torch.bfloat16}


class Ranks:
    """Ranks that measure together: an mpi4py communicator's, or this process alone (``comm`` None)."""

    def __init__(self, comm: Any = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank() if comm else 0
        self.size = comm.Get_size() if comm else 1

    @classmethod
    def launched(cls) -> Ranks:
        """The ranks of the mpirun job this process runs in (Horovod initialized), or this process alone."""
        if int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1:
            import horovod.torch as hvd

            with extras.required("perf", "hvdcomp profile across ranks"):
                from mpi4py import MPI

            hvd.init()  # its background thread runs beside the compute in training: let it run here too
            return cls(MPI.COMM_WORLD)
        return cls()

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()

    def slowest(self, value: float) -> float:
        if self.comm is None:
            return value
        from mpi4py import MPI

        return self.comm.allreduce(value, op=MPI.MAX)

    def wait(self, handle: int, name: str) -> Any:
        """The result of the Horovod collective ``handle`` (named ``name``) that these ranks timed: waited for
        without a deadline (``hvd.synchronize``)."""
        import horovod.torch as hvd

        return hvd.synchronize(handle)


class ProcessSetRanks(Ranks):
    """The ranks of a Horovod process set, measuring together through Horovod's own collectives (any controller:
    what a running job has); collectives are named under ``prefix``. ``wait(handle, name)`` waits for each of them,
    and for the collectives timed with these ranks (:meth:`Ranks.wait`): a running job's bounds the wait with its
    deadline (the hvdcomp optimizer's ``wait``); None waits without one. The barrier is an allreduce of one number,
    which no rank leaves before every rank has entered (``hvd.barrier`` has no asynchronous form to bound)."""

    def __init__(self, process_set: Any, prefix: str, wait: Callable[[int, str], Any] | None = None) -> None:
        import horovod.torch as hvd

        self.hvd, self.process_set, self.prefix, self._wait = hvd, process_set, prefix, wait
        self.comm = None
        self.rank, self.size = process_set.rank(), process_set.size()

    def wait(self, handle: int, name: str) -> Any:
        return self.hvd.synchronize(handle) if self._wait is None else self._wait(handle, name)

    def _max(self, value: float, name: str) -> float:
        name = f"{self.prefix}.{name}"
        return self.wait(self.hvd.allreduce_async(torch.tensor([value], dtype=torch.float64), op=self.hvd.Max,
                                                  name=name, process_set=self.process_set), name).item()

    def barrier(self) -> None:
        self._max(0.0, "barrier")

    def slowest(self, value: float) -> float:
        return self._max(value, "slowest")


CPU = torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA), so that a host clock times the kernels themselves."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dense_bytes(tensor: torch.Tensor) -> int:
    """The bytes the optimizer's dense allreduce sends of ``tensor``: bfloat16 travels as float32 (Horovod has no
    bfloat16 allreduce)."""
    return tensor.numel() * (4 if tensor.dtype == torch.bfloat16 else tensor.element_size())


def median_ms(fn: Callable[[], Any], repeats: int, ranks: Ranks, before: Callable[[], Any] | None = None,
              device: torch.device = CPU) -> float:
    """The slowest rank's median milliseconds of ``fn`` over ``repeats`` calls, each one after ``before`` (untimed),
    the device idle and every rank at a barrier.

    On CPU a host clock times each call. On CUDA, CUDA events recorded on the device's current stream around the
    call do: the GPU's time from the first queued kernel to the end of the last (the gaps where it waits for the
    host's launches included: a short call is launch-bound), without the latency of the synchronize that would stop
    a host clock (the device is synchronized after the end event, outside the timed span), which inflates a short
    call.
    """
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        _sync(device)
        ranks.barrier()
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return ranks.slowest(statistics.median(times) * 1e3)


#: a batch: the model's inputs (a tensor, or a tuple of them: ``model(*inputs)``) and the loss's targets
Batch = tuple[Any, Any]
LossFn = Callable[[Any, Any], torch.Tensor]


def _device_of(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    if parameter is None:
        raise ValueError("the model has no parameters: nothing to profile")
    return parameter.device


def local_device(name: str) -> torch.device:
    """``cpu``, or ``cuda``: this rank's GPU by its local rank (horovodrun's HOROVOD_LOCAL_RANK, Open MPI's, or
    LOCAL_RANK), the one ``hvdcomp train`` and ``hvdcomp probe`` use too."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: torch sees no CUDA device here")
    local = next((os.environ[key] for key in ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")
                  if key in os.environ), "0")
    return torch.device("cuda", int(local) % torch.cuda.device_count())


def _forward(model: nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """Mixed precision for the forward pass and the loss (``torch.autocast`` on the device's type), or none."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def measure_steps(model: nn.Module, batch: Batch, loss_fn: LossFn, repeats: int, ranks: Ranks,
                  autocast: torch.dtype | None = None) -> dict[str, Any]:
    """Forward, backward and optimizer-step times, and each gradient's readiness in backward, on the device the
    model's parameters are on; the forward pass and the loss under ``torch.autocast`` to ``autocast`` if given
    (the parameters and their gradients stay float32, as in mixed-precision training)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    device = _device_of(model)
    cuda = device.type == "cuda"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    inputs, targets = batch
    # per step, parameter -> when its gradient was ready: the host clock (CPU), or a CUDA event read after the step
    ready: list[dict[str, Any]] = []
    clock: dict[str, Any] = {"start": 0.0}

    def mark(name: str) -> None:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            ready[-1][name] = event
        else:
            ready[-1][name] = time.perf_counter() - clock["start"]

    handles = [p.register_post_accumulate_grad_hook(lambda _, name=name: mark(name)) for name, p in named]
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    try:
        for step in range(repeats + 2):
            ready.append({})
            optimizer.zero_grad()
            _sync(device)
            ranks.barrier()
            t0 = time.perf_counter()
            with _autocast(device, autocast):
                loss = loss_fn(_forward(model, inputs), targets)
            _sync(device)
            t1 = clock["start"] = time.perf_counter()
            if cuda:
                clock["event"] = torch.cuda.Event(enable_timing=True)
                clock["event"].record()
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
            optimizer.step()
            _sync(device)
            t3 = time.perf_counter()
            if cuda:  # this step's events, as seconds since backward began
                ready[-1] = {name: clock["event"].elapsed_time(event) / 1e3 for name, event in ready[-1].items()}
            if step >= 2:  # two warm-up steps
                for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    phases[key].append(value)
    finally:
        for handle in handles:
            handle.remove()
    timed = ready[2:]
    used = [(name, p) for name, p in named if p.grad is not None and all(name in step for step in timed)]
    unused = sorted({name for name, _ in named} - {name for name, _ in used})
    if unused and ranks.rank == 0:
        print(f"hvdcomp profile: parameters without a gradient in every step are left out (as if frozen): "
              f"{', '.join(unused)}", file=sys.stderr)
    gradients = [{"name": name, "numel": p.numel(), "bytes": dense_bytes(p),
                  "ready_ms": round(ranks.slowest(statistics.median(step[name] for step in timed) * 1e3), 4),
                  "check_ms": round(median_ms(lambda p=p: nonfinite([p.grad._values() if p.grad.is_sparse else p.grad]),
                                               repeats, ranks, device=device), 4)}
                 for name, p in used]
    gradients.sort(key=lambda g: g["ready_ms"])
    every = [p.grad._values() if p.grad.is_sparse else p.grad for _, p in used]
    result = {key: round(ranks.slowest(statistics.median(values) * 1e3), 4) for key, values in phases.items()}
    return {"forward_ms": result["forward"], "backward_ms": result["backward"], "optimizer_ms": result["optimizer"],
            "check_all_ms": round(median_ms(lambda: nonfinite(every), repeats, ranks, device=device), 4),
            "gradients": gradients}


def measure_encoded(compressor: Compressor, grad: torch.Tensor, repeats: int, ranks: Ranks) -> dict[str, Any]:
    """Wire bytes and costs of ``compressor`` (as DistributedOptimizer wraps it) on one gradient."""
    ctx = Context.local(grad, step=STEADY_STEP)
    state = compressor.init_state(grad, ctx)
    gated = compressor.agree(grad, state, ctx) is not None
    shared: dict[str, Any] = {}

    def statistics_() -> None:
        request = compressor.agree(grad, state, ctx)
        shared["value"] = None if request is None else request.values

    def encode() -> Any:
        payload = compressor.compress(grad, state, ctx, shared.get("value"))[0]
        return payload if compressor.summable else wire.pack(payload)

    shared_ms = median_ms(statistics_, repeats, ranks, device=grad.device) if gated else 0.0
    encode_ms = median_ms(encode, repeats, ranks, before=statistics_ if gated else None, device=grad.device)
    if gated:
        statistics_()
    payload, meta = compressor.compress(grad, state, ctx, shared.get("value"))
    summed = (compressor.decompress(payload, meta) if compressor.summable
              else compressor.aggregate([payload], meta)).view_as(grad)
    target = grad.clone()
    finish_ms = median_ms(lambda: torch.div(summed, PROBE_WORLD, out=target), repeats, ranks, device=grad.device)
    extra_ms = 0.0
    part_bytes = [part.numel() * part.element_size() for part in payload]
    if compressor.summable or compressor.reduction is not None:  # allreduced as they are
        wire_bytes = sum(part_bytes)
        decode_ms = median_ms(lambda: compressor.decompress(payload, meta), repeats, ranks, device=grad.device)
    else:
        wire_bytes = wire.nbytes(wire.layout_of(payload)) + (0 if compressor.fixed_size else 8 * len(payload))
        decode_ms = median_ms(lambda: compressor.aggregate([payload], meta), repeats, ranks, device=grad.device)
        four_ms = median_ms(lambda: compressor.aggregate([payload] * 4, meta), repeats, ranks, device=grad.device)
        extra_ms = max(four_ms - decode_ms, 0.0) / 3
    return {"wire_bytes": int(wire_bytes), "part_bytes": part_bytes, "shared_ms": round(shared_ms, 4),
            "encode_ms": round(encode_ms, 4), "decode_ms": round(decode_ms, 4),
            "decode_extra_payload_ms": round(extra_ms, 4), "finish_ms": round(finish_ms, 4)}


def measure_compressor(method: str | Mapping[str, Any], named: list[tuple[str, torch.Tensor]], repeats: int,
                       ranks: Ranks, world: int = PROBE_WORLD, edge: set[str] | None = None) -> dict[str, Any]:
    """One compressor (a method's name, or a compression config) on every gradient it would compress at ``world``
    ranks, ``edge`` being the model's first and last layers' parameters (default: from ``named``'s order);
    ``{}`` if it compresses none of them."""
    config = CompressionConfig.parse(method)
    entry: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    edge = edges([name for name, _ in named]) if edge is None else edge
    for name, grad in named:
        compressor = config.choose(name, grad.shape, world, edge=name in edge).compressor
        if compressor is None:
            continue
        entry[name] = measure_encoded(compressor, grad, repeats, ranks)
        ctx = Context.local(grad)
        summary = {"summable": compressor.summable, "fixed_size": compressor.fixed_size,
                   "recompressible": compressor.recompressible, "sparse_payload": compressor.sparse_payload,
                   "checks_input": not compressor.keeps_nonfinite,
                   "shared_before_encode": compressor.agree(grad, compressor.init_state(grad, ctx), ctx) is not None,
                   **({"reduction": compressor.reduction} if compressor.reduction else {}),
                   "options": compressor.settings()}
    if not entry:
        return {}
    return {**summary, "gradients": entry}


def step_totals(gradients: Mapping[str, Mapping[str, Any]], compute_ms: float) -> dict[str, float]:
    """What a compressor adds to each training step of one rank, from its per-gradient costs: the sums over the
    model's compressed gradients of ``encode_ms`` and of ``decode_ms`` (one payload per gradient), and the two
    together as a fraction of ``compute_ms`` (forward + backward). The per-gradient figures stay the model's input;
    these sums are for people: the overhead a user sees, where a per-tensor time of microseconds hides it."""
    encode = sum(g["encode_ms"] for g in gradients.values())
    decode = sum(g["decode_ms"] for g in gradients.values())
    fraction = (encode + decode) / compute_ms if compute_ms > 0 else 0.0
    return dict(zip(STEP_TOTALS, (round(encode, 4), round(decode, 4), round(fraction, 5)), strict=True))


def profile(model: nn.Module, batch: Batch, loss_fn: LossFn | None = None, *, methods: Sequence[str] | None = None,
            repeats: int = 10, ranks: Ranks | None = None, name: str = "model",
            batch_size: int | None = None, autocast: torch.dtype | None = None) -> dict[str, Any]:
    """The profile document of ``model`` (see the module docstring), for ``hvdcomp predict``.

    It trains ``model`` for ``repeats + 2`` steps of SGD with momentum (the timed steps; batch norm's statistics move
    too): profile a copy of a model that is to go on training. Parameters that get no gradient in every step are left
    out, as frozen ones are, and named on stderr.

    Args:
        model: the model, on the device to profile it on (CPU or the rank's GPU).
        batch: ``(inputs, targets)`` of one rank's batch, on that device; ``inputs`` is a tensor or a tuple of them.
        loss_fn: ``loss_fn(model(inputs), targets)``; cross entropy by default.
        methods: the compressors to measure on the model's own gradients (default: every registered one).
        repeats: timed runs per measurement (the median is kept), after warm-up.
        ranks: the mpirun job whose ranks measure at the same time (default: this process, or the job it runs in).
        name: the model's name in the document.
        batch_size: samples per batch (default: the targets' first dimension).
        autocast: run the forward pass and the loss under ``torch.autocast`` to this dtype (``torch.bfloat16``);
            the gradients, and so every compressor's input, stay float32.
    """
    ranks = ranks or Ranks.launched()
    loss_fn = loss_fn or nn.functional.cross_entropy
    methods = [m for m in METHODS if m != "none"] if methods is None else list(methods)
    targets = batch[1]
    if batch_size is None:
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0:
            raise ValueError("profile: give batch_size where the targets are not a tensor with a batch dimension")
        batch_size = int(targets.shape[0])
    device = _device_of(model)
    described = (f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
                 f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    document: dict[str, Any] = {"kind": "profile", "model": name, "batch_size": batch_size,
                                "device": described}
    if autocast is not None:
        document["autocast"] = str(autocast).removeprefix("torch.")
    document.update(measure_steps(model, batch, loss_fn, repeats, ranks, autocast))
    compute_ms = document["forward_ms"] + document["backward_ms"]
    # sparse gradients (bow's embedding) densified, as DistributedOptimizer hands them to every method but the sketch
    # (the parameters measure_steps kept: one without a gradient in some step is left out, as there)
    kept = {gradient["name"] for gradient in document["gradients"]}
    named = [(key, p.grad.detach().to_dense() if p.grad.is_sparse else p.grad.detach().clone())
             for key, p in model.named_parameters() if key in kept]
    compressors = {}
    for method in methods:
        measured = measure_compressor(method, named, repeats, ranks)
        if measured:
            gradients = measured.pop("gradients")
            compressors[method] = {**measured, **step_totals(gradients, compute_ms), "gradients": gradients}
    document["compressors"] = compressors
    document["measured"] = {"ranks_measuring_at_once": ranks.size, "repeats": repeats, "torch": str(torch.__version__),
                            "date": datetime.date.today().isoformat(), "statistic": "median, slowest rank",
                            "clock": "cuda events" if device.type == "cuda" else "host"}
    return document


def workload_batch(model_name: str, batch_size: int | None, seed: int = 0) -> tuple[nn.Module, Batch]:
    """A built-in workload's model and a batch of its training data (``batch_size`` per rank, default its own)."""
    workload = WORKLOADS[model_name](seed)
    index = torch.arange(batch_size or workload.batch_size) % len(workload.data.train_x)
    return workload.model, (workload.data.train_x[index], workload.data.train_y[index])


class UsageError(ValueError):
    """A command-line value ``hvdcomp profile`` cannot use (not an error raised inside the user's own code)."""


class UserCodeError(RuntimeError):
    """An error raised inside the user's factory or batch function: shown with its traceback, not as a usage error
    (``hvdcomp``'s command line reports ValueErrors in one line)."""


def _call_user(function: Callable[..., Any], spec: str, *args: Any) -> Any:
    try:
        return function(*args)
    except Exception as error:
        raise UserCodeError(f"{spec} raised {type(error).__name__}: {error}") from error


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """``package.module:name`` -> the callable it names (an error that says what is wrong otherwise)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"{what} must be package.module:callable; got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"{what}: cannot import {module_name!r}: {error}") from error
    found = getattr(module, attribute, None)
    if not callable(found):
        raise UsageError(f"{what}: {module_name} has no callable {attribute!r}")
    return found


def custom_batch(batch_size: int, input_shape: str | None, classes: int, vocab: int | None,
                 batch_fn: str | None) -> Batch:
    """The batch of a user's model: ``batch_fn(batch_size)``, or random inputs of ``input_shape`` (normal values,
    or token ids below ``vocab``) with class targets below ``classes``."""
    if batch_fn is not None:
        made = _call_user(load_callable(batch_fn, "--batch"), f"--batch {batch_fn}", batch_size)
        if not isinstance(made, (tuple, list)) or len(made) != 2:
            raise UsageError(f"--batch {batch_fn} must return (inputs, targets); got {type(made).__name__}")
        return made[0], made[1]
    if input_shape is None:
        raise UsageError("a --model given as package.module:factory needs --input-shape or --batch")
    try:
        shape = [int(n) for n in input_shape.split(",")]
    except ValueError:
        raise UsageError(f"--input-shape must be comma-separated integers; got {input_shape!r}") from None
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, vocab, (batch_size, *shape), generator=generator) if vocab else
              torch.randn(batch_size, *shape, generator=generator))
    return inputs, torch.randint(0, classes, (batch_size,), generator=generator)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdcomp profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help=f"a built-in workload ({', '.join(sorted(WORKLOADS))}) or package.module:factory")
    parser.add_argument("--batch-size", type=int, help="per rank (default: the workload's; 32 for a factory's model)")
    parser.add_argument("--input-shape", help="a factory's model: one sample's input shape, e.g. 3,224,224")
    parser.add_argument("--classes", type=int, default=10, help="a factory's model: targets below this (default 10)")
    parser.add_argument("--vocab", type=int, help="a factory's model: integer inputs (token ids) below this")
    parser.add_argument("--batch", help="a factory's model: package.module:function(batch_size) -> (inputs, targets)")
    parser.add_argument("--loss", help="package.module:function(outputs, targets) -> loss (default: cross entropy)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where to profile (cuda: the rank's GPU, by its local rank)")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST),
                        help="the forward pass and the loss under torch.autocast to this dtype (mixed precision; "
                             "the gradients stay float32)")
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
    if args.repeats < 1 or (args.batch_size is not None and args.batch_size < 1) or args.classes < 1:
        parser.error("--repeats, --batch-size and --classes must be >= 1")
    if args.vocab is not None and args.vocab < 1:
        parser.error("--vocab must be >= 1")
    try:
        device = local_device(args.device)
        if args.model in WORKLOADS:
            model, batch = workload_batch(args.model, args.batch_size)
        else:
            torch.manual_seed(0)
            factory = load_callable(args.model, "--model")
            try:
                inspect.signature(factory).bind()
            except TypeError:
                raise UsageError(f"--model {args.model} must be callable without arguments") from None
            except ValueError:  # no signature to read (a builtin): call it and see
                pass
            model = _call_user(factory, f"--model {args.model}")
            if not isinstance(model, nn.Module):
                raise UsageError(f"--model {args.model} returned {type(model).__name__}, not a torch.nn.Module")
            batch = custom_batch(args.batch_size or 32, args.input_shape, args.classes, args.vocab, args.batch)
        loss_fn = load_callable(args.loss, "--loss") if args.loss else None
    except UsageError as error:  # what the user's own code raises goes on, with its traceback
        parser.error(str(error))
    ranks = Ranks.launched()
    document = profile(model.to(device), _to(batch, device), loss_fn, methods=methods, repeats=args.repeats,
                       ranks=ranks, name=args.model, autocast=AUTOCAST[args.autocast] if args.autocast else None)
    if ranks.rank == 0:
        dump(document, args.out, f"hvdcomp profile of {args.model}, batch {document['batch_size']} per rank "
                                 f"(measured; times in ms are medians of the slowest rank)")
        print(summary(document, args.out))
    return 0


def summary(document: Mapping[str, Any], path: str) -> str:
    """What ``hvdcomp profile`` prints: the step's phases, then per compressor its encode and decode time per step
    beside forward + backward (the overhead a user sees)."""
    autocast = f" ({document['autocast']} autocast)" if "autocast" in document else ""
    lines = [f"hvdcomp profile: wrote {path}: forward {document['forward_ms']:.2f} ms, backward "
             f"{document['backward_ms']:.2f} ms{autocast}, {len(document['gradients'])} gradients, compressors "
             f"{', '.join(document['compressors']) or 'none'}"]
    if document["compressors"]:
        lines.append(f"per step, summed over the compressed gradients (clock: {document['measured']['clock']}):")
    for method, entry in document["compressors"].items():
        lines.append(f"  {method:<10} encode {entry['step_encode_ms']:8.3f} ms  decode {entry['step_decode_ms']:8.3f}"
                     f" ms  ({len(entry['gradients'])} gradients)  = {100 * entry['step_fraction_of_compute']:.2f}%"
                     f" of forward + backward")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m hvdcomp.perfmodel.profile ... (no installed console script needed)
    sys.exit(main())
