"""The method states in an optimizer's checkpoint: ``state_dict()["hvdcomp"]``, one entry per compressed parameter,
and whether an entry fits the optimizer that loads it (:meth:`hvdcomp.optimizer._DistributedOptimizer.load_state_dict`).

A method state belongs to one rank of one world, under one method, bucket and set of options: residuals hold what
that rank has not sent yet, PowerSGD's Q is shaped by its rank option, a bucket's state by its members. Loading it
anywhere else would not fail at once: it would count residuals twice or fail deep in the next step. So each entry
names its method, world size, rank and bucket, and :func:`check_entry`, :func:`check_all_taken` and :func:`check_fits`
refuse, by parameter and with the way out, what does not fit. Horovod-free: the optimizer passes what it knows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hvdcomp.compressor import State
from hvdcomp.config import Choice

#: every refusal's way out
AFRESH = "drop the checkpoint's 'hvdcomp' entry to start the method states afresh"


def method_of(choice: Choice) -> str:
    """A compressed parameter's method as its entry names it: the reduction, the compressor (a memory's wrapper too)
    and the method, e.g. ``allgather:ErrorFeedback:topk``: their states differ, not their options' (:func:`check_fits`
    compares those states' shapes)."""
    compressor = choice.compressor
    assert compressor is not None and choice.reduction is not None
    return f"{choice.reduction.name}:{type(compressor).__name__}:{compressor.unwrapped().name}"


def entry(step: int, state: State, bucket: str, choice: Choice, size: int, rank: int) -> dict[str, Any]:
    """One parameter's entry: its step counter and method state, the bucket it is in (its members share one state,
    saved with the first), and what the state belongs to."""
    return {"step": step, "state": state, "bucket": bucket, "method": method_of(choice), "size": size, "rank": rank}


def check_entry(name: str, saved: Mapping[str, Any] | None, choice: Choice, bucket: str, size: int,
                rank: int) -> None:
    """Raises where parameter ``name``'s entry ``saved`` (None: the checkpoint has none) lacks its step or state, or
    belongs to another method, world size, rank or bucket than this optimizer's; an entry without a method, size or
    rank (an older hvdcomp's) is taken as matching it, one without a bucket as alone."""
    if saved is None:
        raise ValueError(f"checkpoint has no hvdcomp state for parameter {name!r} (a job that did not compress it "
                         f"saved it: dense, one rank, or compression: auto); {AFRESH}")
    missing = [key for key in ("step", "state") if key not in saved]
    if missing:
        raise ValueError(f"checkpoint's hvdcomp entry for parameter {name!r} has no {' or '.join(missing)}: not one "
                         f"that state_dict() saved; {AFRESH}")
    method = method_of(choice)
    if saved.get("method", method) != method:
        raise ValueError(f"checkpoint's parameter {name!r} was compressed by {saved['method']}, here by {method}: its "
                         f"method state does not carry over. Resume with the checkpoint's compression config, or "
                         f"{AFRESH}")
    if saved.get("size", size) != size:
        raise ValueError(f"checkpoint's parameter {name!r} was compressed by a job of {saved['size']} ranks, this one "
                         f"has {size}: a rank's method state belongs to its world. Resume with as many ranks, or "
                         f"{AFRESH}")
    if saved.get("rank", rank) != rank:
        raise ValueError(f"checkpoint's parameter {name!r} holds rank {saved['rank']}'s method state, this is rank "
                         f"{rank}: its residuals would count twice. Each rank resumes from the state_dict() it saved, "
                         f"or {AFRESH}")
    if saved.get("bucket", "") != bucket:
        raise ValueError(f"checkpoint's parameter {name!r} was compressed {_bucket_text(saved['bucket'])}, here "
                         f"{_bucket_text(bucket)}: the bucket_cap_mb of the compression config must be the "
                         "checkpoint's (one saved by an hvdcomp that compressed this method alone whatever "
                         "bucket_cap_mb resumes with bucket_cap_mb: 0)")


def check_all_taken(saved: Mapping[str, Any], compressed: set[str]) -> None:
    """Raises where the checkpoint holds a method state for a parameter that this optimizer does not compress: it
    would be dropped, and with it what its residuals had not sent yet."""
    left = sorted(set(saved) - compressed)
    if left:
        named = ", ".join(f"{name!r} ({saved[name].get('method', 'compressed')})" for name in left)
        raise ValueError(f"checkpoint holds hvdcomp method state for parameter{'s' if len(left) > 1 else ''} {named}, "
                         f"which this optimizer does not compress (dense here, one rank, outside the process set, or "
                         f"no such name): its residuals would be lost. Resume with the checkpoint's compression config "
                         f"and world, or {AFRESH}")


def check_fits(name: str, saved: State, fresh: State) -> None:
    """Raises where a saved method state does not fit a fresh one of this optimizer's (:func:`_misfit`)."""
    different = _misfit(saved, fresh)
    if different:
        raise ValueError(f"checkpoint's parameter {name!r}: its method state's {different}: an option that shapes it "
                         "(PowerSGD's rank, a method's momentum, a bucket's members) differs. Resume with the "
                         f"checkpoint's compression config, or {AFRESH}")


def to_device(value: Any, device: torch.device) -> Any:
    """A loaded state with its tensors on ``device`` (the parameter's)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [to_device(item, device) for item in value]
    return value


def _bucket_text(bucket: str) -> str:
    return f"in the bucket of {bucket!r}" if bucket else "alone"


def _misfit(saved: Any, fresh: Any, path: str = "") -> str | None:
    """Where a saved method state does not fit a fresh one, described for an error message (None where it does): a
    tensor of another shape, an entry the fresh state has and the saved one lacks, or a list of states (a bucket's
    members, two-phase's chunks) of another length. A state may gain entries and list items as it trains (GraVAC's
    gains), which fit."""
    if isinstance(saved, torch.Tensor) and isinstance(fresh, torch.Tensor):
        if saved.shape != fresh.shape:
            return f"{path or 'tensor'} is {list(saved.shape)} there, {list(fresh.shape)} here"
        return None
    if isinstance(saved, dict) and isinstance(fresh, dict):
        missing = [key for key in fresh if key not in saved]
        if missing:
            return f"{path}[{missing[0]!r}] is missing there"
        pairs = [(f"{path}[{key!r}]", saved[key], fresh[key]) for key in fresh]
    elif isinstance(saved, list | tuple) and isinstance(fresh, list | tuple):
        if len(saved) != len(fresh) and any(isinstance(item, dict) for item in (*saved, *fresh)):
            return f"{path or 'list'} holds {len(saved)} states there, {len(fresh)} here"
        pairs = [(f"{path}[{i}]", a, b) for i, (a, b) in enumerate(zip(saved, fresh, strict=False))]
    else:
        return None
    for where, a, b in pairs:
        different = _misfit(a, b, where)
        if different:
            return different
    return None
