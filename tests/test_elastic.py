"""Elastic Horovod with hvdcomp: ``hvdcomp train --elastic`` under ``horovodrun --gloo --min-np``.

Three "hosts" on this machine (localhost, 127.0.0.1 and the machine's own name: three host names Horovod tells apart,
all local), one rank each. Mid-training one host's rank is killed and the host leaves the discovery script's list;
training must go on with two ranks, every compressor plan rebuilt for the new world (two-phase TernGrad: its chunk
states depend on the rank count), and reach the accuracy of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN

pytestmark = pytest.mark.multirank

JOB = "workload: digits\nepochs: 30\ncompression: {method: terngrad, collective: two_phase}\n"


def three_local_hosts() -> list[str]:
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this machine's name {name!r} does not resolve: three local host names are needed")
    local = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    if address not in local and not address.startswith("127."):
        pytest.skip(f"this machine's name {name!r} resolves to {address}, not one of its addresses")
    return ["localhost", "127.0.0.1", name]


def elastic_run(tmp_path: Path, label: str, kill_after_s: float | None) -> tuple[dict, str]:
    hosts = three_local_hosts()
    listing = tmp_path / f"{label}.hosts"
    listing.write_text("".join(f"{host}:1\n" for host in hosts))
    discover = tmp_path / f"{label}.discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {listing}\n")
    discover.chmod(0o755)
    job, summary = tmp_path / "job.yaml", tmp_path / f"{label}.json"
    job.write_text(JOB)
    argv = [str(BIN / "horovodrun"), "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3",
            "--host-discovery-script", str(discover), str(BIN / "hvdcomp"), "train", "--elastic", "--config", str(job),
            "--no-progress", "--json", str(summary)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        if kill_after_s is not None:
            time.sleep(kill_after_s)
            lost = hosts[1]
            listing.write_text("".join(f"{host}:1\n" for host in hosts if host != lost))
            killed = [pid for pid in rank_pids() if f"HOROVOD_HOSTNAME={lost}" in environment(pid)]
            assert killed, "no rank of the lost host was found: the job ended before the fault?"
            for pid in killed:
                os.kill(pid, 9)
        output, _ = process.communicate(timeout=300)
    except BaseException:
        os.killpg(process.pid, 9)
        raise
    assert process.returncode == 0, output[-4000:]
    (result,) = json.loads(summary.read_text())
    return result, output


def rank_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "hvdcomp train --elastic"], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def environment(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def test_training_goes_on_when_a_host_is_lost(tmp_path: Path) -> None:
    uninterrupted, _ = elastic_run(tmp_path, "uninterrupted", None)
    assert uninterrupted["ranks"] == 3 and uninterrupted["resets"] == [], uninterrupted
    faulted, output = elastic_run(tmp_path, "faulted", kill_after_s=8)
    assert faulted["ranks"] == 2, faulted
    assert [reset["ranks"] for reset in faulted["resets"]] == [2], faulted["resets"]
    assert "hvdcomp train: elastic reset: training goes on with 2 ranks" in output
    assert abs(faulted["test_accuracy"] - uninterrupted["test_accuracy"]) <= 0.01, (uninterrupted, faulted)
