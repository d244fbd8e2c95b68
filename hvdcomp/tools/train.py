"""``hvdcomp train``: data-parallel training with compressed gradients, run under mpirun or horovodrun.

    mpirun -np 2 hvdcomp train --workload digits --compression terngrad --compare dense

Each rank trains on its shard of the data (the same shuffle on every rank, a different slice), gradients
are reduced by :func:`hvdcomp.DistributedOptimizer`, and rank 0 shows a progress bar per epoch and ends with
a table and a JSON summary: step time, samples/s, bytes a rank sent per step (the mean over ranks) against dense
float32, and test accuracy. ``--compare dense`` first runs the same job uncompressed, with the same seeds.

A job file (``--config job.yaml``) holds these settings of the flags, the others being flags only (flags given
explicitly win)::

    workload: synthetic
    epochs: 2
    batch_size: 64        # per rank
    lr: 0.01
    seed: 0
    compression: {method: terngrad, options: {clip: 2.5}, dense: ["6.*"]}  # the classifier

``--compression auto`` chooses per tensor on the running job (:mod:`hvdcomp.auto`); the plan it settled on is printed
after the table and saved in the summary (``auto``). Its measuring steps count in the step times and the time to
the target.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import horovod.torch as hvd
import torch
import yaml
from torch import nn

from hvdcomp import auto, check
from hvdcomp.config import CompressionConfig
from hvdcomp.deadlines import DEFAULT_DEADLINE, Deadline
from hvdcomp.distributed import DistributedOptimizer
from hvdcomp.elastic import TorchState
from hvdcomp.methods import METHODS
from hvdcomp.workloads import WORKLOADS, Dataset

JOB_KEYS = ("workload", "epochs", "batch_size", "lr", "seed", "compression")
#: steps between commits of the elastic state (and at each epoch's end): what a reset loses at most
COMMIT_EVERY = 10


@dataclass
class Summary:
    """What one run measured (rank 0's view; the parameters are identical on every rank)."""

    method: str
    workload: str
    ranks: int
    epochs: int
    steps: int
    mean_step_s: float
    median_step_s: float
    samples_per_s: float
    bytes_per_rank_per_step: float
    dense_fp32_bytes_per_step: int
    compression_ratio: float | None  # None on one rank: nothing is reduced (as in Horovod), nothing sent
    final_loss: float
    test_accuracy: float
    #: per step, for methods whose plan changes (GraVAC): the agreed step time and, per tensor, the CF in force,
    #: what was sent (a CF or "dense") and the gain
    trace: list[dict[str, Any]] | None = None
    #: --elastic: per reset, the world size after it and the seconds from the last step completed before the fault
    #: to the first step completed after it (detection, re-rendezvous, state sync, the steps redone)
    resets: list[dict[str, Any]] | None = None
    #: --target: the test accuracy aimed at, and the training time (the slowest rank's steps, evaluation excluded)
    #: and epoch at whose end the model first reached it (None if it did not)
    target_accuracy: float | None = None
    time_to_target_s: float | None = None
    target_epoch: int | None = None
    #: compression: auto: the plan it settled on, per tensor, with the predicted and measured step times and every
    #: plan tried (DistributedOptimizer.auto_report(); rank 0's, the same on every rank but the seconds it took)
    auto: dict[str, Any] | None = None
    #: --target: the test accuracy at the end of each epoch (each rank's evaluation of the same model)
    epoch_accuracy: list[float] | None = None


class Progress:
    """A one-line progress bar on stderr, drawn by rank 0 only."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.start = time.perf_counter()

    def update(self, done: int, loss: float) -> None:
        if not self.enabled or (done < self.total and not sys.stderr.isatty()):  # logs get one line per epoch
            return
        width = 30
        filled = width * done // max(self.total, 1)
        rate = (time.perf_counter() - self.start) / max(done, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                         f"loss {loss:.4f} {rate * 1e3:.0f} ms/step")
        if done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def load_job(path: str) -> dict[str, Any]:
    with open(path) as stream:
        job = yaml.safe_load(stream) or {}
    if not isinstance(job, Mapping):
        raise ValueError(f"{path}: a job file must be a mapping of settings; got {type(job).__name__}")
    for key in job:
        if key not in JOB_KEYS:
            raise ValueError(f"{path}: unknown key {key!r}; valid: {', '.join(JOB_KEYS)}")
    if "workload" in job and job["workload"] not in WORKLOADS:
        raise ValueError(f"{path}: unknown workload {job['workload']!r}; valid: {', '.join(WORKLOADS)}")
    for key, least in (("epochs", 1), ("batch_size", 1), ("seed", 0)):
        if job.get(key) is not None:
            check.integer(path, key, job[key], ge=least)
    if job.get("lr") is not None:  # YAML reads 1e-2 as text (its floats need a dot: 1.0e-2)
        check.number(path, "lr", job["lr"], gt=0, expected="a positive number" + (
            " (YAML reads 1e-2 as text: write 1.0e-2)" if isinstance(job["lr"], str) else ""))
    return dict(job)


def evaluate(model: nn.Module, data: Dataset) -> float:
    model.eval()
    with torch.no_grad():
        predictions = model(data.test_x).argmax(dim=1)
    model.train()
    return (predictions == data.test_y).float().mean().item()


def pick_device(name: str) -> torch.device:
    """``auto``: this rank's GPU (``hvd.local_rank()``, of those it sees) where every rank can have one, else the
    CPU.

    Horovod's NCCL operations need a GPU per rank (two ranks on one GPU fail: "Duplicate GPU detected"): the ranks
    compare their GPUs' UUIDs (a rank may see only its own GPU: CUDA_VISIBLE_DEVICES per rank, Slurm's
    --gpus-per-task), and decide alike. Under Elastic Horovod, where a rank joining later could not take part, each
    rank counts: more ranks on its host than GPUs it sees, unless CUDA_VISIBLE_DEVICES gives it one of its own. A
    Horovod built without GPU operations stages CUDA tensors through host memory, so there ranks may share GPUs. On the
    CPU, ranks on one host share its cores: unless OMP_NUM_THREADS says otherwise, each rank gets cores / local ranks
    threads, since more threads than cores make every parallel kernel thrash.
    """
    why = None if name == "cpu" else _no_gpu_per_rank()
    if why is not None and name == "cuda":
        raise ValueError(f"--device cuda: {why}")
    if why not in (None, NO_CUDA) and hvd.rank() == 0:  # (a machine without CUDA trains on the CPU unsaid)
        print(f"hvdcomp train: --device auto: {why}; training on the CPU", file=sys.stderr)
    if name == "cpu" or why is not None:
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
        return torch.device("cpu")
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


#: pick_device's reason where this machine has no CUDA
NO_CUDA = "torch.cuda.is_available() is False on this machine"


def _no_gpu_per_rank() -> str | None:
    """Why the ranks cannot train on GPUs (:func:`pick_device`), or None where they can: under NCCL the same answer
    on every rank (one allgather of each rank's host and GPU, outside Elastic Horovod, where a rank that joins later
    would wait in it alone)."""
    gpu = None
    if torch.cuda.is_available():
        gpu = str(torch.cuda.get_device_properties(hvd.local_rank() % torch.cuda.device_count()).uuid)
    if not hvd.nccl_built():
        return None if gpu is not None else NO_CUDA
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        if gpu is None:
            return NO_CUDA
        gpus, ranks = torch.cuda.device_count(), hvd.local_size()
        own = len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]) == 1
        return _shared(ranks, gpus) if ranks > gpus and not own else None
    every = hvd.allgather_object((socket.gethostname(), gpu), name="hvdcomp.train.gpus")
    lacking = [rank for rank, (_, other) in enumerate(every) if other is None]
    if lacking:
        return f"torch.cuda.is_available() is False on rank{'s' if len(lacking) > 1 else ''} " + ", ".join(
            map(str, lacking))
    if len(set(every)) < len(every):
        return _shared(len(every), len(set(every)))
    return None


def _shared(ranks: int, gpus: int) -> str:
    return (f"{ranks} ranks on {gpus} GPU{'s' if gpus > 1 else ''}, and this Horovod's NCCL operations need a GPU per "
            "rank: start at most as many ranks on a host as it has GPUs (or use a Horovod built without GPU "
            "operations, where ranks can share one: docs/operations.md)")


def method_name(compression: Any) -> str:
    if isinstance(compression, Mapping):
        return str(compression.get("method", "none"))
    return str(compression)


def run(workload_name: str, compression: Any, epochs: int | None, batch_size: int | None, lr: float | None,
        seed: int, show_progress: bool = True, device: str = "auto",
        deadline: Deadline | float | None = DEFAULT_DEADLINE, elastic: bool = False,
        target_accuracy: float | None = None) -> Summary:
    """Trains one workload with one compression setting; every rank returns the same summary (under ``elastic``,
    every rank that ends the job: step counts and times are each rank's own).

    ``elastic``: under Elastic Horovod (``horovodrun --gloo --min-np ...``): model, optimizer, epoch and step are an
    :class:`hvdcomp.elastic.TorchState`, committed every COMMIT_EVERY steps and at each epoch's end; after a reset
    (a host lost or added) the optimizer rebuilds its plan (:meth:`hvdcomp.DistributedOptimizer.reset`), the data
    is re-sharded for the new world, and training goes on from the last commit at the same step of the epoch (the
    new shards' steps: some samples of that epoch are seen twice or not at all). Steps redone after a reset count
    again in the summary's steps and times.

    ``target_accuracy``: the test set is evaluated after every epoch (outside the timed steps; every rank holds the
    same model) and the training time at which the accuracy first reached it is reported.
    """
    workload = WORKLOADS[workload_name](seed)
    epochs = workload.epochs if epochs is None else epochs
    batch_size = workload.batch_size if batch_size is None else batch_size
    lr = workload.lr if lr is None else lr
    if epochs < 1 or batch_size < 1 or not 0 < lr < math.inf:
        raise ValueError(f"epochs and batch_size must be >= 1 and lr a finite number > 0; got {epochs}, {batch_size}, "
                         f"{lr}")
    target = pick_device(device)
    model = workload.model.to(target)
    data = workload.data.to(target)
    if not elastic:  # elastic: the state's sync() broadcasts, on every (re)start
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def steps_per_epoch() -> int:
        shard = len(data.train_x) // hvd.size()
        if shard // batch_size == 0:
            raise ValueError(f"batch_size {batch_size} is larger than each rank's shard of {shard} samples")
        return shard // batch_size

    compression = with_epochs(compression, None if elastic else steps_per_epoch())
    optimizer = DistributedOptimizer(sgd(model, compression, lr, hvd.size()),
                                     named_parameters=model.named_parameters(), compression=compression,
                                     deadline=deadline)
    trace: list[dict[str, Any]] = []
    loss_fn = nn.CrossEntropyLoss()
    step_times: list[float] = []
    losses = [torch.zeros(())]
    resets: list[dict[str, Any]] = []
    last_step = {"end": time.perf_counter(), "after_reset": False}
    epoch_ends: list[float] = []  # this rank's training time (its steps' times) at the end of each epoch
    reached: dict[str, int] = {}  # the epoch at whose end the target was first reached (rank 0's evaluation)
    epoch_accuracy: list[float] = []  # --target: the test accuracy at each epoch's end

    def train_epochs(state: Any) -> None:
        for epoch in range(state.epoch, epochs):
            rank, size, per_epoch = hvd.rank(), hvd.size(), steps_per_epoch()
            shard = len(data.train_x) // size
            order = torch.randperm(len(data.train_x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
            mine = order.to(target)[rank * shard:(rank + 1) * shard]
            progress = Progress(per_epoch, f"{method_name(compression):>9} epoch {epoch + 1}/{epochs}",
                                show_progress and rank == 0)
            for step in range(min(state.batch, per_epoch), per_epoch):
                batch = mine[step * batch_size:(step + 1) * batch_size]
                start = time.perf_counter()
                optimizer.zero_grad()
                loss = loss_fn(model(data.train_x[batch]), data.train_y[batch])
                loss.backward()
                optimizer.step()
                if target.type == "cuda":
                    torch.cuda.synchronize(target)
                step_times.append(time.perf_counter() - start)
                if last_step["after_reset"]:
                    resets.append({"ranks": size, "recovery_s": time.perf_counter() - last_step["end"]})
                    if rank == 0:
                        print(f"hvdcomp train: elastic reset: training goes on with {size} ranks from epoch "
                              f"{epoch + 1}, step {step + 1}, {resets[-1]['recovery_s']:.1f} s after the last step "
                              "before the fault", file=sys.stderr, flush=True)
                    last_step["after_reset"] = False
                last_step["end"] = time.perf_counter()
                losses[0] = loss
                progress.update(step + 1, loss.item())
                record_decisions(optimizer, epoch * per_epoch + step, step_times[-1], trace)
                if elastic and (step + 1) % COMMIT_EVERY == 0:
                    state.batch = step + 1
                    state.commit()
            state.epoch, state.batch = epoch + 1, 0
            epoch_ends.append(sum(step_times))
            if target_accuracy is not None:
                epoch_accuracy.append(evaluate(model, data))
                if not reached and epoch_accuracy[-1] >= target_accuracy:
                    reached["epoch"] = epoch + 1
            if elastic:
                state.commit()

    if elastic:
        state = TorchState(model, optimizer, epoch=0, batch=0)
        state.register_reset_callbacks([lambda: last_step.update(after_reset=True),
                                        lambda: follow_world(optimizer, hvd.size())])
        hvd.elastic.run(train_epochs)(state)
    else:
        train_epochs(SimpleNamespace(epoch=0, batch=0))
    steps = len(step_times)
    timed = step_times[1:] or step_times  # the first step warms up
    mean_step = sum(timed) / len(timed)
    # the mean over ranks: gathered payloads (top-k's on the CPU, threshold's) differ in size per rank
    per_step = hvd.allreduce(torch.tensor([optimizer.bytes_sent / max(steps, 1)], dtype=torch.float64), op=hvd.Average,
                             name=f"train.bytes.{method_name(compression)}").item()
    dense_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    final_loss = hvd.allreduce(losses[0].detach(), name=f"train.loss.{method_name(compression)}").item()
    size = hvd.size()
    to_target, target_epoch = None, None
    if target_accuracy is not None:  # rank 0's evaluation decides (every rank holds the same model); the slowest
        # rank's training time to the end of that epoch counts: every step's time, the first one's included
        target_epoch = hvd.broadcast_object(reached.get("epoch"), root_rank=0,
                                            name=f"train.target_epoch.{method_name(compression)}")
        mine = epoch_ends[target_epoch - 1] if target_epoch is not None else 0.0
        slowest = hvd.allreduce(torch.tensor([mine]), op=hvd.Max, name=f"train.to_target.{method_name(compression)}")
        to_target = slowest.item() if target_epoch is not None else None
    return Summary(method_name(compression), workload_name, size, epochs, steps, mean_step,
                   statistics.median(timed), batch_size * size / mean_step, per_step, dense_bytes,
                   dense_bytes / per_step if per_step else None, final_loss, evaluate(model, data),
                   trace or None, resets if elastic else None, target_accuracy, to_target, target_epoch,
                   optimizer.auto_report(), epoch_accuracy if target_accuracy is not None else None)


def with_epochs(compression: Any, steps_per_epoch: int | None) -> Any:
    """The compression setting with the options its methods' papers count in epochs (``epoch_options``) set to
    ``steps_per_epoch`` where the setting does not give them, at the top level and in each override (which
    inherits the method and options as :mod:`hvdcomp.config` reads them), and in each of ``auto``'s ``candidates``
    (those auto takes by default run with their step defaults). Such an option may also be given in
    epochs, as its name with ``_epochs`` in place of ``_steps`` (or added: LGC's ``train_epochs: 2``, GraVAC's
    ``interval_epochs: 1``). Anything malformed is left as it is, for ``DistributedOptimizer`` to reject with its
    message. ``steps_per_epoch`` None (Elastic Horovod, where an epoch's steps change with the world and every rank,
    a joining one too, must plan alike): the methods' own step defaults stay, and an option in epochs is refused."""
    setting = {"method": compression} if isinstance(compression, str) else compression
    if not isinstance(setting, Mapping):
        return compression  # a Compressor object

    def filled(method: Any, options: Any) -> Any:
        keys = METHODS[method].epoch_options if isinstance(method, str) and method in METHODS else ()
        if not keys or not (options is None or isinstance(options, Mapping)):
            return options
        given = dict(options or {})
        for key in keys:
            in_epochs = f"{key.removesuffix('_steps')}_epochs"
            epochs = given.pop(in_epochs, None)
            if steps_per_epoch is None:
                if epochs is not None:
                    raise ValueError(f"{method}'s {in_epochs}: under --elastic an epoch's steps change with the "
                                     f"number of ranks; give {key} (steps) instead")
                continue
            if isinstance(epochs, (int, float)) and not isinstance(epochs, bool) and epochs >= 0:
                given.setdefault(key, round(epochs * steps_per_epoch))
            elif epochs is not None:
                given[in_epochs] = epochs  # for the method to reject by name
        if steps_per_epoch is None:
            return given or options
        return {key: steps_per_epoch for key in keys} | given

    top_method = setting.get("method", "none")
    result = dict(setting)
    auto_options = setting.get("options")
    candidates = (auto_options.get("candidates") if top_method == "auto" and isinstance(auto_options, Mapping)
                  else None)
    if isinstance(candidates, Mapping):  # auto's, each filled
        result["options"] = {**auto_options, "candidates": {method: filled(method, options)
                                                            for method, options in candidates.items()}}
        return result
    top_options = filled(top_method, setting.get("options"))
    if top_options is not None:
        result["options"] = top_options
    overrides = setting.get("overrides")
    if isinstance(overrides, list):
        result["overrides"] = []
        for entry in overrides:
            if isinstance(entry, Mapping) and ("method" in entry or "options" in entry):
                method = entry.get("method", top_method)
                options = entry.get("options", None if "method" in entry else top_options)
                options = filled(method, options)
                entry = {**entry, **({"options": options} if options is not None else {})}
            result["overrides"].append(entry)
    return result


def sgd(model: nn.Module, compression: Any, lr: float, size: int) -> torch.optim.SGD:
    """SGD with momentum 0.9, except for the parameters whose method applies momentum itself (momentum correction,
    with its own 0.9: DGC, and top-k, threshold, random-k and the sign family at their defaults): they are in a group
    of their own (``applies_momentum``), with momentum 0 in a world of ``size`` ranks (:func:`follow_world`)."""
    config = CompressionConfig.parse(compression)
    groups: dict[bool, list[nn.Parameter]] = {False: [], True: []}
    for name, param in model.named_parameters():
        compressor = config.choose(name, param.shape, max(size, 2)).compressor
        groups[compressor is not None and compressor.applies_momentum].append(param)
    optimizer = torch.optim.SGD([{"params": params, "momentum": 0.9, "applies_momentum": own}
                                 for own, params in groups.items() if params], lr=lr)
    follow_world(optimizer, size)
    return optimizer


def follow_world(optimizer: torch.optim.Optimizer, size: int) -> None:
    """The momentum of :func:`sgd`'s groups in a world of ``size`` ranks: 0 where the method applies it, 0.9 on one
    rank, which reduces nothing (nothing applies momentum there but SGD). An elastic reset calls it for the new
    world, before the optimizer rebuilds its plan (which checks it). Where a group's momentum changes, its parameters'
    momentum buffers go: a rank joining the job has none for a group at 0 (the elastic state's sync then creates
    what each rank lacks, and broadcasts rank 0's)."""
    momentum = 0.0 if size > 1 else 0.9
    for group in optimizer.param_groups:
        if group.get("applies_momentum") and group["momentum"] != momentum:
            group["momentum"] = momentum
            for p in group["params"]:
                optimizer.state.pop(p, None)


def record_decisions(optimizer: Any, step: int, step_time: float, trace: list[dict[str, Any]]) -> None:
    """Appends this step's decisions (GraVAC's CF, LGC's stage: ``optimizer.decisions()``) and this rank's step time
    to ``trace``, where some tensor's method decides something."""
    tensors = optimizer.decisions()
    if tensors:
        trace.append({"step": step, "step_time": step_time, "tensors": tensors})


def deadline_arg(text: str) -> Deadline | float | None:
    """``--deadline``: auto (:class:`Deadline`), off, or a positive number of seconds."""
    if text == "auto":
        return DEFAULT_DEADLINE
    if text == "off":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < math.inf:  # (no limit: off)
        raise argparse.ArgumentTypeError(f"must be auto, off or a positive finite number of seconds; got {text!r}")
    return seconds


def table(summaries: list[Summary]) -> str:
    target = next((s.target_accuracy for s in summaries if s.target_accuracy is not None), None)
    label = "" if target is None else f" {f'to {target * 100:g}%':>15}"
    header = (f"{'method':>10} {'ranks':>5} {'steps':>6} {'step ms':>9} {'samples/s':>10} "
              f"{'MB/rank/step':>13} {'vs fp32':>8} {'test acc':>9}{label}")
    rows = [header, "-" * len(header)]
    for s in summaries:
        reached = ""
        if target is not None:
            reached = " " + (f"{s.time_to_target_s:.2f} s (ep. {s.target_epoch})" if s.time_to_target_s is not None
                             else "not reached").rjust(15)
        rows.append(f"{s.method:>10} {s.ranks:>5} {s.steps:>6} {s.mean_step_s * 1e3:>9.1f} "
                    f"{s.samples_per_s:>10.1f} {s.bytes_per_rank_per_step / 1e6:>13.3f} "
                    f"{'-' if s.compression_ratio is None else f'{s.compression_ratio:.1f}x':>8} "
                    f"{s.test_accuracy * 100:>8.2f}%{reached}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdcomp train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help="default: digits")
    parser.add_argument("--compression", help="a method name (see hvdcomp.METHODS), or auto (chosen per tensor on the "
                                              "running job); default: terngrad")
    parser.add_argument("--config", help="a job YAML file (see above)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int, help="per rank")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int, help="the model's initial weights and the data's order (default 0); the "
                                                 "compressors' draws take the compression config's seed (default 0)")
    parser.add_argument("--compare", choices=["dense"], help="also run the uncompressed baseline")
    parser.add_argument("--json", metavar="PATH", help="also write the summaries to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--deadline", default="auto", type=deadline_arg,
                        help="seconds a rank waits for a collective before ending the job with a message; auto "
                             "(10x the slowest step, at least 30 s; 120 s until a step completes) or off")
    parser.add_argument("--elastic", action="store_true",
                        help="train under Elastic Horovod (horovodrun --gloo --min-np N --host-discovery-script ...): "
                             "a host lost or added resets the job to the last commit and training goes on; the "
                             "auto deadline is then off (Gloo's timeout ends a blocked collective)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: each rank's GPU (hvd.local_rank()) where CUDA is available, else the CPU")
    parser.add_argument("--target", type=float, metavar="ACCURACY",
                        help="evaluate after every epoch and report the training time to this test accuracy (0-1): "
                             "the slowest rank's steps up to the end of the first epoch that reached it, the first "
                             "(warm-up) step included, evaluation excluded; the JSON summary lists each epoch's "
                             "test accuracy (epoch_accuracy)")
    args = parser.parse_args(argv)
    if args.target is not None and not 0 < args.target <= 1:
        parser.error(f"--target must be an accuracy in (0, 1]; got {args.target}")
    if args.target is not None and args.elastic:
        parser.error("--target is not kept across elastic resets: give it without --elastic")
    # known before the job, not after it; by the rank that writes it (rank 0: the launchers' variables, before
    # hvd.init) only, as the folder may exist on its host alone
    launched_rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if args.json and launched_rank == "0" and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json {args.json}: its folder does not exist")
    if args.compare and args.elastic:  # a host joining during the compressed run would start in the dense one
        parser.error("--compare runs two jobs one after the other, which Elastic Horovod's joining hosts cannot "
                     "follow: give it without --elastic")
    job = load_job(args.config) if args.config else {}
    if args.compression is not None and "compression" in job:
        parser.error("give the compression either with --compression or in the --config file, not both")
    settings = {key: getattr(args, key) if getattr(args, key) is not None else job.get(key)
                for key in ("workload", "epochs", "batch_size", "lr", "seed")}
    compression = args.compression or job.get("compression", "terngrad")
    CompressionConfig.parse(compression)  # bad names and values fail here, before any rank starts work

    hvd.init()
    runs = ([("dense", "none")] if args.compare else []) + [("compressed", compression)]
    summaries = [run(settings["workload"] or "digits", setting, settings["epochs"], settings["batch_size"],
                     settings["lr"], settings["seed"] or 0, show_progress=not args.no_progress,
                     device=args.device, elastic=args.elastic, deadline=args.deadline, target_accuracy=args.target)
                 for _, setting in runs]
    if hvd.rank() == 0:
        print(table(summaries))
        for summary in summaries:
            if summary.auto is not None:
                print(auto.table(summary.auto))
        if args.compare:
            dense, compressed = summaries
            to_target = ""
            if dense.time_to_target_s is not None and compressed.time_to_target_s is not None:
                to_target = (f"{dense.time_to_target_s / compressed.time_to_target_s:.2f}x time to "
                             f"{args.target * 100:g}%; ")
            fewer = ("" if compressed.compression_ratio is None  # one rank: nothing was sent
                     else f"{compressed.compression_ratio:.1f}x fewer bytes; ")
            print(f"speedup over dense: {to_target}{dense.mean_step_s / compressed.mean_step_s:.2f}x step time; "
                  f"{fewer}accuracy "
                  f"{(compressed.test_accuracy - dense.test_accuracy) * 100:+.2f} points")
        report = json.dumps([asdict(s) for s in summaries])
        print(report)
        if args.json:
            with open(args.json, "w") as stream:
                stream.write(report + "\n")
    return 0
