"""Elastic Horovod with hvdcomp on the emulated cluster: ``hvdcomp train --elastic`` on 3 hosts, one host's rank
killed mid-training (a crashed or preempted worker; the host dropped from the discovery script's list too; a lost
link's slower recovery is measured by perf/cluster/faults.py). Training must go on with two ranks, every compressor
plan rebuilt for the new world (two-phase TernGrad: its chunk states depend on the rank count, so a stale one
fails), reset once only, and reach the accuracy of an uninterrupted run (the same job on 3 ranks over shared memory)
within 1 point.

Needs root and iproute2; skipped, with the reason, where network namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import BIN, Ranks, run_ranks
from test_cluster import NAME, await_fault, follow, namespaces_unavailable

from hvdcomp.tools import cluster

pytestmark = pytest.mark.multirank

JOB = "workload: digits\nepochs: {epochs}\ncompression: {{method: terngrad, collective: two_phase}}\n"


def elastic_run(folder: Path, label: str, fault_after_s: float | None, epochs: int = 60, fault: str = "link",
                while_recovering: Callable[[], object] | None = None) -> tuple[dict, str]:
    """One elastic job (:data:`JOB`) on a fresh 3-host cluster at 1 Gbit/s, with a fault on host 2
    ``fault_after_s`` after the start (None: as soon as the job's second epoch has begun, read from its progress):
    the host leaves the discovery list and

    * ``link``: its switch port goes down. Gloo's timeout (HOROVOD_GLOO_TIMEOUT_SECONDS, 30 s by default) is how
      the others learn that it is gone, and the cut-off rank's own re-rendezvous may fail slowly too
      (perf/cluster/faults.py measures the recovery);
    * ``kill``: its processes are killed (SIGKILL: a crashed or preempted worker). The ranks connected to it fail
      at once, any other at Gloo's timeout.

    ``while_recovering`` (if given) runs right after the fault, while the survivors wait."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    if fault not in ("link", "kill"):
        raise ValueError(f"fault: {fault!r}; valid: link, kill")
    name = f"{NAME}e"
    try:
        hosts = cluster.up(3, rate="1gbit", name=name)
        listing = folder / f"{label}.hosts"
        listing.write_text("".join(f"{host.address}:1\n" for host in hosts.hosts))
        discover = folder / f"{label}.discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {listing}\n")
        discover.chmod(0o755)
        job, summary = folder / "job.yaml", folder / f"{label}.json"
        job.write_text(JOB.format(epochs=epochs))
        command = [str(BIN / "hvdcomp"), "train", "--elastic", "--config", str(job), "--json", str(summary),
                   *(["--no-progress"] if fault_after_s is not None else [])]
        process, lines, reader = follow(hosts.launch_command(command, env={"OMP_NUM_THREADS": "1"},
                                                             controller="gloo", elastic=(2, str(discover))))
        try:
            await_fault(process, lines, reader, fault_after_s)
            listing.write_text("".join(f"{host.address}:1\n" for host in hosts.hosts[:2]))
            if fault == "link":
                subprocess.run(["ip", "netns", "exec", hosts.switch, "ip", "link", "set", "h2", "down"], check=True)
            else:
                pids = subprocess.run(["ip", "netns", "pids", hosts.hosts[2].namespace], capture_output=True,
                                      text=True, check=True).stdout.split()
                subprocess.run(["kill", "-9", *pids], check=False)  # one may have exited meanwhile
            if while_recovering is not None:
                while_recovering()
            process.wait(timeout=400)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):  # (await_fault may have ended it already)
                os.killpg(process.pid, 9)
            raise
        reader.join(10)
        output = "".join(lines)
    finally:
        cluster.down(name)
    assert process.returncode == 0, output[-4000:]
    (result,) = json.loads(summary.read_text())
    return result, output


def test_training_goes_on_when_a_host_is_lost(tmp_path: Path) -> None:
    job, summary = tmp_path / "uninterrupted.yaml", tmp_path / "uninterrupted.json"
    job.write_text(JOB.format(epochs=30))
    reference: list[Ranks] = []

    def uninterrupted() -> None:  # 15 s alone; while the survivors recover and train on
        reference.append(run_ranks([str(BIN / "hvdcomp"), "train", "--config", str(job), "--no-progress", "--json",
                                    str(summary)], 3))

    # 30 epochs; host 2's rank killed as soon as the second has begun
    faulted, output = elastic_run(tmp_path, "faulted", fault_after_s=None, epochs=30, fault="kill",
                                  while_recovering=uninterrupted)
    (result,) = reference
    assert result.returncode == 0, result.output[-3000:]
    (uninterrupted_run,) = json.loads(summary.read_text())
    assert uninterrupted_run["ranks"] == 3, uninterrupted_run
    assert faulted["ranks"] == 2, faulted
    assert [reset["ranks"] for reset in faulted["resets"]] == [2], faulted["resets"]
    assert "hvdcomp train: elastic reset: training goes on with 2 ranks" in output
    assert abs(faulted["test_accuracy"] - uninterrupted_run["test_accuracy"]) <= 0.01, (uninterrupted_run, faulted)
