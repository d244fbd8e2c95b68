"""Faults: time from a lost host to the job's end (each controller), and Elastic Horovod's recovery time.

    .venv/bin/python perf/cluster/faults.py [--repeats 3]

``exit``: issue 16's fault on the emulated cluster (tests/test_cluster.py's ``lost_link``: 2 hosts at 1 Gbit/s,
``hvdcomp train --workload digits --compression terngrad`` at its default deadline, one host's switch port taken
down 15 s into training); the time from the fault to the launcher's exit, under mpirun (MPI controller) and
horovodrun's Gloo controller.
``elastic``: ``hvdcomp train --elastic`` on 3 emulated hosts (Elastic Horovod over Gloo, at least 2 ranks; as
tests/test_elastic.py), host 2's switch port taken down and the host dropped from discovery 15 s in; the recovery
time the summary reports (last step before the fault to the first step after the reset) and the final accuracy.
Rows go to perf/results/faults.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "perf" / "results" / "faults.jsonl"
sys.path.insert(0, str(REPO / "tests"))  # the faults are the tests' (tests/test_cluster.py, tests/test_elastic.py)


def exit_after_fault(controller: str) -> dict:
    from test_cluster import lost_link

    returncode, ended, output = lost_link(controller, "hvdfault", wait_s=300)
    message = next((line for line in output.splitlines() if "hvdcomp: rank" in line and "waited" in line), "")
    return {"kind": "exit", "controller": controller, "seconds": ended, "returncode": returncode,
            "message": message[message.index("hvdcomp: rank"):] if message else None,
            # what the figure counts: the job ended, failing, with hvdcomp's deadline message (not killed at wait_s)
            "ended_at_deadline": returncode not in (None, 0) and bool(message)}


def elastic_recovery() -> dict:
    from test_elastic import elastic_run

    with tempfile.TemporaryDirectory() as folder:
        result, _ = elastic_run(Path(folder), "faulted", fault_after_s=15)
    return {"kind": "elastic", "ranks_after": result["ranks"], "resets": result["resets"],
            "recovery_s": result["resets"][0]["recovery_s"], "test_accuracy": result["test_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for _ in range(args.repeats):
        for measure in (lambda: exit_after_fault("mpi"), lambda: exit_after_fault("gloo"), elastic_recovery):
            rows.append({**measure(), "time": stamp})
            print(json.dumps(rows[-1]), flush=True)
            with open(RESULTS, "a") as stream:
                stream.write(json.dumps(rows[-1]) + "\n")
    for kind, key in (("exit", "controller"), ("elastic", "kind")):
        groups: dict[str, list[float]] = {}
        for row in rows:
            if row["kind"] == kind:
                groups.setdefault(row[key], [])
                if kind == "elastic" or row["ended_at_deadline"]:
                    groups[row[key]].append(row["seconds" if kind == "exit" else "recovery_s"])
        for label, values in groups.items():
            failed = sum(row["kind"] == kind and row[key] == label for row in rows) - len(values)
            spread = f"median {statistics.median(values):.1f} s [{min(values):.1f}-{max(values):.1f}]" if values else ""
            print(f"{kind} {label}: {spread}{f'; {failed} runs did not end at the deadline' if failed else ''}")


if __name__ == "__main__":
    sys.exit(main())
