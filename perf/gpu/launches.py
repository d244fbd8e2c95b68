"""Launches per tensor: the device work one training step issues for one small gradient, per method, counted.

    .venv/bin/python perf/gpu/launches.py [--numel 1024] [--method topk ...] [--show-ops]

On a small tensor a GPU finishes each kernel in a few microseconds, so a method's cost there is its number of
launches (about 5 to 10 us each from the host): issue 39's "launches per tensor". This counts them for each method's
CUDA path, with no GPU needed: the method's default reduction runs end to end on one rank (its requests answered as a
job of one rank would: the collectives themselves are not counted), in steady state (the third step, past any
warm-up: LGC's stage 3), with error feedback as the method's defaults have it, on a Gaussian tensor of ``--numel``
elements (PowerSGD: its squarest matrix).

Counted:

* ``triton``: launches of hvdcomp's Triton kernels;
* ``aten``: PyTorch operators that run device work (a kernel, a copy or a fill), seen through a
  ``TorchDispatchMode``; views, reshapes, allocations and other metadata-only operators are not counted;
* ``syncs``: operators that, on CUDA, make the host wait for the device (``.item()``, ``nonzero``, a boolean mask's
  selection): on CPU tensors nothing waits, but on CUDA each one stalls the training step's host thread.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` and
``HVDCOMP_KERNELS=triton`` are set here before hvdcomp is imported), which takes the CUDA path's code: the same
launches. With a GPU the tensors are on it and the kernels compiled. A PyTorch operator may launch more than one
kernel on CUDA (a reduction over a large tensor, a sort), so ``aten`` is a lower bound there; timings belong to
``hvdcomp bench compress --device cuda`` (perf/gpu/gpu_kernels.sh), not to this count.

Rows go to perf/results/launches.jsonl (one JSON line per method).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "perf" / "results" / "launches.jsonl"
CUDA = torch.cuda.is_available()
if not CUDA:  # before hvdcomp.kernels.gpu is imported: its kernels are then defined for the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HVDCOMP_KERNELS"] = "triton"

import triton  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hvdcomp import reductions  # noqa: E402
from hvdcomp.compressor import STEADY_STEP, Context  # noqa: E402
from hvdcomp.config import make_compressor  # noqa: E402
from hvdcomp.methods import METHODS  # noqa: E402
from hvdcomp.requests import Agree, Read, Reduction, one_rank  # noqa: E402
from hvdcomp.tools.bench import bench_shape  # noqa: E402

#: operators that only make views, allocate or read metadata: no device work
NO_WORK = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select",
           "unsqueeze", "squeeze", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow",
           "diagonal", "unflatten", "view_as", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty",
           "new_empty_strided", "resize_", "set_", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
           "sym_storage_offset", "is_same_size", "_to_copy_meta", "chunk", "_has_compatible_shallow_copy_type",
           "dim", "size", "stride", "numel", "contiguous_meta", "real", "view_as_real", "_local_scalar_dense_meta"}
#: operators that wait for the device on CUDA (the host needs a value or a size that the device computes)
SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2",
         "repeat_interleave", "tolist"}


class Launches(TorchDispatchMode):
    """Counts the operators dispatched while active, by name, apart from those inside a Triton launch (the
    interpreter's own tensor handling), and the Triton launches themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.triton: Counter[str] = Counter()
        self._inside = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self._inside and not _on_host(args):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def kernel(self, name: str) -> None:
        self.triton[name] += 1

    def summary(self) -> dict[str, Any]:
        work = {name: n for name, n in self.ops.items() if name not in NO_WORK}
        return {"triton": sum(self.triton.values()), "aten": sum(work.values()),
                "syncs": sum(n for name, n in work.items() if name in SYNCS),
                "ops": dict(sorted(work.items())), "kernels": dict(sorted(self.triton.items()))}


_counting: list[Launches] = []
#: the values answered on the host (``Agree.host``, ``Read``), kept alive, and their storages: what a method does
#: with them there is not device work
_host_values: list[torch.Tensor] = []
_host_storages: set[int] = set()


@contextlib.contextmanager
def _not_counted() -> Iterator[None]:
    """Operators run here are not counted (as inside a Triton launch)."""
    if _counting:
        _counting[-1]._inside += 1
    try:
        yield
    finally:
        if _counting:
            _counting[-1]._inside -= 1


def _on_host(args: tuple) -> bool:
    """Whether ``args`` hold tensors, all of them values answered on the host (or views of them)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.untyped_storage().data_ptr() in _host_storages for t in tensors)


def _count_triton_launches() -> None:
    """Wraps the launch of every Triton kernel (compiled, or interpreted) to count it, and to stop counting the
    operators it runs inside (the interpreter copies its arguments); and ``Tensor.tolist``, a read on the host that
    bypasses the operators' dispatch, to count it as a sync."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for cls in (JITFunction, InterpretedFunction):
        run = cls.run

        def counted(self: Any, *args: Any, _run: Any = run, **kwargs: Any) -> Any:
            if not _counting or kwargs.get("warmup"):
                return _run(self, *args, **kwargs)
            mode = _counting[-1]
            mode.kernel(getattr(self, "__name__", "kernel"))
            mode._inside += 1
            try:
                return _run(self, *args, **kwargs)
            finally:
                mode._inside -= 1

        cls.run = counted
    tolist = torch.Tensor.tolist

    def read(self: torch.Tensor) -> Any:  # a copy to the host that no operator dispatch shows
        if _counting and not _counting[-1]._inside and not _on_host((self,)):
            _counting[-1].ops["tolist"] += 1
        return tolist(self)

    torch.Tensor.tolist = read


def answer(request: Any) -> Any:
    """What a job of one rank receives for ``request``."""
    if isinstance(request, Read) or (isinstance(request, Agree) and request.host):  # the step's one transfer, for
        with _not_counted():  # every parameter: not counted per tensor
            _host_values.append(request.values.cpu().clone())
        _host_storages.add(_host_values[-1].untyped_storage().data_ptr())
        return _host_values[-1]
    return one_rank(request)


#: options a method is counted with, beyond its defaults: LGC's guard never sends it back to stage 2 (on a Gaussian
#: tensor its autoencoder, trained one step, reconstructs too poorly for the default bound, 0.9), so that the counted
#: step is stage 3, the steady state issue 39's target is about
OPTIONS: dict[str, dict[str, Any]] = {"lgc": {"max_error": 1e9}}


def drive(steps: Reduction) -> torch.Tensor:
    result: Any = None
    while True:
        try:
            request = next(steps) if result is None else steps.send(result)
        except StopIteration as done:
            return done.value
        result = answer(request)


def count(method: str, numel: int, device: torch.device, options: dict[str, Any] | None = None,
          batch: int = 1, bucket: bool = False) -> dict[str, Any]:
    """One steady step of ``method``'s default reduction on one rank, counted; ``batch`` > 1: that many tensors of one
    shape reduced together, the counts then per tensor: as the reduction's batch (PowerSGD's
    ``batch_tensors_with_same_shape``), or with ``bucket`` as a bucket of the config's ``bucket_cap_mb``."""
    compressor = make_compressor(method, options)
    shape = bench_shape(compressor, numel)
    reduction = reductions.make(reductions.choose(compressor, "auto", 2), compressor)
    generator = torch.Generator().manual_seed(0)
    xs = [torch.randn(shape, generator=generator).to(device) for _ in range(batch)]
    states = [reduction.init_state(x, Context.local(x, seed=1, name=f"tensor{i}", step=STEADY_STEP))
              for i, x in enumerate(xs)]
    if bucket:
        states = [reduction.init_bucket_state(xs, Context.local(xs[0], seed=1, name="tensor0", step=STEADY_STEP))]
    _host_values.clear()
    _host_storages.clear()

    def step(at: int, counted: Launches | None) -> None:
        contexts = [Context.local(x, seed=1, name=f"tensor{i}", step=at) for i, x in enumerate(xs)]
        grads = [x.clone() for x in xs]  # the reduction may work in place: a fresh copy, not counted
        with counted if counted is not None else contextlib.nullcontext():
            drive(reduction.reduce_bucket(grads, states[0], contexts[0]) if bucket else
                  reduction.reduce(grads[0], states[0], contexts[0]) if batch == 1 else
                  reduction.reduce_batch(grads, states, contexts))

    # two steps first: lazily built buffers and caches, and a state made afresh past the warm-up catching up
    # (LGC's: its autoencoder trains once, then enters stage 3, where the counted step is)
    steady = STEADY_STEP + compressor.steady_from()
    step(STEADY_STEP, None)
    step(steady, None)
    mode = Launches()
    _counting.append(mode)
    try:
        step(steady + 1, mode)
    finally:
        _counting.pop()
    summary = mode.summary()
    return {"method": method, "options": options or {}, "batch": batch, "bucket": bucket, "reduction": reduction.name,
            "numel": numel,
            "shape": list(shape), "path": "cuda" if device.type == "cuda" else
            "triton interpreter (the CUDA path, on CPU tensors)",
            **summary, "per_tensor": (summary["triton"] + summary["aten"]) / batch,
            "torch_version": torch.__version__, "triton_version": triton.__version__}


def commit() -> str:
    """This tree's commit, with ``+changes`` where the working tree differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout
    return head.strip() + ("+changes" if dirty.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--method", action="append", choices=sorted(METHODS), help="default: every method")
    parser.add_argument("--show-ops", action="store_true", help="print each method's operators and kernels")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    _count_triton_launches()
    device = torch.device("cuda" if CUDA else "cpu")
    rows = [count(method, args.numel, device, OPTIONS.get(method)) for method in (args.method or sorted(METHODS))]
    if "powersgd" in (args.method or METHODS):
        rows.append(count("powersgd", args.numel, device, {"batch_tensors_with_same_shape": True}, batch=4))
        rows.append(count("powersgd", args.numel, device, batch=4, bucket=True))  # each matrix factored alone
    if "lgc" in (args.method or METHODS):
        rows.append(count("lgc", args.numel, device, OPTIONS["lgc"], batch=4, bucket=True))
    if "sketch" in (args.method or METHODS):
        rows.append(count("sketch", args.numel, device, batch=4, bucket=True))  # dense: one vote, one allreduce
    print(f"{'method':>18} {'reduction':>10} {'triton':>6} {'aten':>5} {'syncs':>5} {'per tensor':>10}  (one step of "
          f"tensors of {args.numel} elements)")
    for row in rows:
        together = "bucket" if row["bucket"] else "batch"
        label = row["method"] + (f" {together} {row['batch']}" if row["batch"] > 1 else "")
        print(f"{label:>18} {row['reduction']:>10} {row['triton']:>6} {row['aten']:>5} {row['syncs']:>5} "
              f"{row['per_tensor']:>10.1f}")
        if args.show_ops:
            print(f"{'':>20}kernels {row['kernels']}\n{'':>20}operators {row['ops']}")
    stamp, tree = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()), commit()
    with args.out.open("a") as out:
        for row in rows:
            out.write(json.dumps({**row, "time": stamp, "commit": tree}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
