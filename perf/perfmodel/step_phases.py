"""Where one training step's time goes, per rank: forward, backward (with hvdcomp's hooks) and ``step()``.

    .venv/bin/hvdcomp cluster up --hosts 2 --rate 1gbit
    .venv/bin/hvdcomp cluster run -- env OMP_NUM_THREADS=1 \\
        .venv/bin/python perf/perfmodel/step_phases.py topk [--batch-size 128]

The loop of ``hvdcomp train --workload synthetic`` with ``hvdcomp.DistributedOptimizer(compression=METHOD)``
for 10 steps; each rank prints one JSON line with the median of each phase over steps 3 to 10 (ms), to set
beside the phases of :func:`hvdcomp.perfmodel.timeline.simulate` (``forward_s``, ``backward_s``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.torch as hvd
import torch

import hvdcomp
from hvdcomp.workloads import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    workload = WORKLOADS["synthetic"](0)
    model, data, batch = workload.model, workload.data, args.batch_size
    optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                             named_parameters=model.named_parameters(), compression=args.method)
    loss_fn = torch.nn.CrossEntropyLoss()
    phases: dict[str, list[float]] = {"forward_ms": [], "backward_ms": [], "step_ms": []}
    for step in range(10):
        start = (step * hvd.size() + hvd.rank()) * batch % (len(data.train_x) - batch)
        x, y = data.train_x[start:start + batch], data.train_y[start:start + batch]
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if step >= 2:
            for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                phases[key].append(value * 1e3)
    print(json.dumps({"rank": hvd.rank(), "method": args.method, "batch_size": batch,
                      **{key: round(statistics.median(values), 1) for key, values in phases.items()}}), flush=True)


if __name__ == "__main__":
    main()
