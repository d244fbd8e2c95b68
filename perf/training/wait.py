"""How long a rank waits for a small collective: Horovod's own wait (``hvd.synchronize``, which spins, yielding,
until the collective is done) against hvdcomp's wait on a host with more ranks than cores
(:func:`hvdcomp.deadlines.synchronize` after :func:`hvdcomp.deadlines.share_host`: it polls, sleeping between polls).
Each round times ``--calls`` allreduces of 10 floats one after the other with one of the waits, the two alternated
round by round; rank 0 prints one JSON line: each wait's median time per allreduce over the rounds, with its range.

    launch/mpirun.sh -np 4 .venv/bin/python perf/training/wait.py --out perf/results/wait.jsonl
    .venv/bin/horovodrun --gloo -np 4 -H localhost:4 .venv/bin/python perf/training/wait.py \
        --out perf/results/wait.jsonl

(and ``-np 2``). hvdcomp polls only where the ranks on a host outnumber its cores; with a core per rank it keeps
Horovod's wait.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import horovod.torch as hvd
import torch

from hvdcomp import deadlines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=100, help="allreduces per round")
    parser.add_argument("--out", help="append the JSON line to this file too")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    deadlines.share_host(cores + 1)  # deadlines.synchronize polls from here on
    waits = {"horovod (spin)": hvd.synchronize,
             "hvdcomp (poll)": lambda handle: deadlines.synchronize(handle, "wait.bench")}
    tensor = torch.ones(10)
    times: dict[str, list[float]] = {label: [] for label in waits}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for label in (list(waits) if round_ % 2 else list(reversed(waits))):
            start = time.perf_counter()
            for call in range(args.calls):
                waits[label](hvd.allreduce_async(tensor, name=f"wait.{label}.{round_}.{call}"))
            if round_:
                times[label].append((time.perf_counter() - start) / args.calls * 1e3)
    if hvd.rank() == 0:
        controller = "mpi" if hvd.mpi_enabled() else "gloo"
        row = {"ranks": hvd.size(), "local_ranks": hvd.local_size(), "cores": cores, "controller": controller,
               "calls": args.calls, "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               **{f"{label} ms": {"median": round(statistics.median(values), 3),
                                  "range": [round(min(values), 3), round(max(values), 3)]}
                  for label, values in times.items()}}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
