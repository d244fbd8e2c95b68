"""The emulated cluster (hvdcomp/tools/cluster.py): links shaped to the set rate, and real ranks training across them.

Needs root and iproute2; skipped, with the reason, where network namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO

from hvdcomp.tools import cluster

BIN = Path(sys.executable).parent
NAME = f"hvdt{os.getpid() % 100000}"  # one cluster per test session; concurrent sessions do not collide


def namespaces_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"{NAME}-probe"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create a network namespace here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], check=True)
    return None


@pytest.fixture(scope="module")
def hosts():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    try:
        yield cluster.up(2, rate="100mbit", name=NAME)
    finally:
        cluster.down(NAME)


def wire_bytes(host: cluster.Host) -> tuple[int, int]:
    """Bytes received and sent on the host's link so far (its eth0 counters)."""
    output = subprocess.run(host.command(["cat", "/proc/net/dev"]), capture_output=True, text=True,
                            check=True).stdout
    for line in output.splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == host.interface:
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise AssertionError(f"no {host.interface} in {host.namespace}: {output}")


def run(argv: list[str], timeout: float) -> str:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        raise AssertionError(f"{argv[:8]}... did not finish within {timeout} s:\n{output[-4000:]}") from None
    assert process.returncode == 0, output[-4000:]
    return output


def test_cluster_comes_up(hosts: cluster.Cluster) -> None:
    assert cluster.status(NAME) == hosts
    assert [host.address for host in hosts.hosts] == ["10.213.0.1", "10.213.0.2"]
    for host in hosts.hosts:
        addresses = subprocess.run(["ip", "-n", host.namespace, "-o", "addr"], capture_output=True, text=True,
                                   check=True).stdout
        assert f"inet {host.address}/24" in addresses
        assert "inet6" not in addresses.replace("inet6 ::1/128", "")  # loopback and the host's address only
        qdisc = subprocess.run(["tc", "-n", host.namespace, "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True, check=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc


@pytest.mark.parametrize(("source", "destination"), [(0, 1), (1, 0)])
def test_throughput_matches_the_rate(hosts: cluster.Cluster, source: int, destination: int) -> None:
    goodput = cluster.throughput(hosts, source, destination, nbytes=15_000_000, timeout=30)
    assert 0.8 * hosts.rate_bps <= goodput <= 1.2 * hosts.rate_bps, f"{goodput / 1e6:.1f} Mbit/s at 100mbit"


@pytest.mark.multirank
@pytest.mark.parametrize("controller", cluster.CONTROLLERS)
def test_train_across_hosts(hosts: cluster.Cluster, controller: str, tmp_path: Path) -> None:
    """A 2-host `hvdcomp train` completes, and its gradient traffic crossed the shaped links."""
    before = [wire_bytes(host) for host in hosts.hosts]
    summary = tmp_path / "summary.json"
    command = [str(BIN / "hvdcomp"), "train", "--workload", "digits", "--epochs", "1", "--compression", "terngrad",
               "--no-progress", "--json", str(summary)]
    run(hosts.launch_command(command, controller=controller), timeout=180)
    [result] = json.loads(summary.read_text())
    assert result["ranks"] == 2 and result["test_accuracy"] > 0.5, result
    sent = result["bytes_per_rank_per_step"] * result["steps"]
    for host, (received_before, sent_before) in zip(hosts.hosts, before, strict=True):
        received, transmitted = wire_bytes(host)
        assert transmitted - sent_before >= sent, (host.namespace, transmitted - sent_before, sent)
        assert received - received_before >= sent, (host.namespace, received - received_before, sent)


@pytest.mark.multirank
@pytest.mark.parametrize("controller", cluster.CONTROLLERS)
def test_auto_keeps_a_plan_that_pays_and_drops_one_that_does_not(hosts: cluster.Cluster, controller: str) -> None:
    """compression: auto across 2 hosts at 100 Mbit/s (tests/ranks.py's auto scenario asserts in every rank): a plan
    that pays is chosen, the same on both ranks, and kept; one that measures slower than dense falls back to dense."""
    output = run(hosts.launch_command([sys.executable, str(REPO / "tests" / "ranks.py"), "auto"],
                                      controller=controller), timeout=300)
    assert re.findall(r"auto OK rank (\d)", output) and set(re.findall(r"auto OK rank (\d)", output)) == {"0", "1"}, \
        output[-4000:]
    assert "kept" in output and "dropped" in output, output[-4000:]


@pytest.mark.multirank
def test_the_main_job_runs_on_an_emulated_cluster() -> None:
    """launch/demo.sh (the README's main job) trains across 2 emulated hosts at 100 Mbit/s and prints dense's and
    TernGrad's time to 95% side by side, then trains with compression: auto and prints the plan it settled on, then
    removes its cluster."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    name = f"{NAME}d"  # this session's own: another session's demo is not replaced
    # 540 s, under pytest's 600: on a timeout run() ends the demo's whole process group (pytest's own timeout would
    # leave it, and its cluster, running)
    output = run(["env", f"DEMO_CLUSTER={name}", "bash", str(REPO / "launch" / "demo.sh")], timeout=540)
    assert "2 emulated hosts (network namespaces), each linked at 100 Mbit/s" in output, output[-3000:]
    rows = [line.split() for line in output.splitlines() if line.split()[:1] in (["none"], ["terngrad"])]
    assert [row[0] for row in rows] == ["none", "terngrad"] and all("(ep." in " ".join(row) for row in rows), rows
    assert re.search(r"speedup over dense: [0-9.]+x time to 95%", output), output[-3000:]
    assert re.search(r"^ +auto +2 ", output, re.MULTILINE) and "auto's plan at 2 ranks: " in output, output[-3000:]
    assert re.search(r"dense step: measured [0-9.]+ ms, predicted [0-9.]+ ms", output), output[-3000:]
    assert f"{name}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="rate: '100' is not a tc rate"):
        cluster.up(2, rate="100", name=NAME)
    with pytest.raises(ValueError, match="hosts: 1 must be between 2"):
        cluster.up(1, name=NAME)
    with pytest.raises(ValueError, match="name: 'Bad_name'"):
        cluster.up(2, name="Bad_name")
    with pytest.raises(ValueError, match="loss: '150%'"):
        cluster.up(2, loss="150%", name=NAME)
    assert cluster.parse_rate("1.5gbit") == 1.5e9


def test_launch_command_runs_one_rank_per_host(hosts: cluster.Cluster) -> None:
    argv = hosts.launch_command(["python", "x.py"], env={"A": "1"})
    assert argv[:4] == ["ip", "netns", "exec", f"{NAME}-h0"]
    for flag in ("btl", "tcp,self", "pml", "ob1", "btl_tcp_if_include", hosts.subnet):
        assert flag in argv
    contexts = " ".join(argv).split(" : ")
    assert len(contexts) == 2
    for rank, context in enumerate(contexts):
        assert f"ip netns exec {NAME}-h{rank} env PMIX_MCA_ptl_tcp_if_include={hosts.subnet} A=1 python x.py" \
            in context
    with pytest.raises(ValueError, match="unknown controller 'ssh'"):
        hosts.launch_command(["true"], controller="ssh")


def follow(argv: list[str]) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """Starts ``argv`` in a process group of its own, and a thread that collects its output's lines as they come."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return process, lines, reader


def await_fault(process: subprocess.Popen, lines: list[str], reader: threading.Thread,
                fault_after_s: float | None) -> None:
    """Returns when a fault is due in the job ``process``: ``fault_after_s`` from now, or (None) as soon as its second
    epoch has begun (read from its progress in ``lines``). A job that ended first, or never got there in 300 s, fails
    the test (and is killed)."""
    start = time.monotonic()
    while process.poll() is None and time.monotonic() - start < 300:
        if (time.monotonic() - start >= fault_after_s if fault_after_s is not None
                else any("epoch 2/" in line for line in lines)):
            return
        time.sleep(0.2)
    os.killpg(process.pid, 9)
    process.wait()
    reader.join(10)
    raise AssertionError(f"the job ended (or never began its second epoch) before the fault:\n{''.join(lines)[-3000:]}")


def lost_link(controller: str, name: str, wait_s: float, fault_after_s: float | None = 15,
              deadline: str = "auto") -> tuple[int | None, float, str]:
    """Issue 16's fault: ``hvdcomp train`` (digits, terngrad, ``--deadline deadline``) on a fresh 2-host cluster at
    1 Gbit/s, host 1's switch port taken down ``fault_after_s`` in (None: as soon as the job's second epoch has begun,
    read from its progress). Returns the launcher's status (None if it was still running ``wait_s`` after the fault:
    then it is killed), the seconds from the fault to its end, and its output."""
    try:
        hosts = cluster.up(2, rate="1gbit", name=name)
        command = [str(BIN / "hvdcomp"), "train", "--workload", "digits", "--epochs", "400", "--compression",
                   "terngrad", "--deadline", deadline, *(["--no-progress"] if fault_after_s is not None else [])]
        process, lines, reader = follow(hosts.launch_command(command, controller=controller))
        await_fault(process, lines, reader, fault_after_s)
        subprocess.run(["ip", "netns", "exec", hosts.switch, "ip", "link", "set", "h1", "down"], check=True)
        fault = time.monotonic()
        try:
            returncode = process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            returncode = None
        ended = time.monotonic() - fault
        reader.join(10)
        return returncode, ended, "".join(lines)
    finally:
        cluster.down(name)


@pytest.mark.multirank
@pytest.mark.parametrize("controller", cluster.CONTROLLERS)
def test_a_lost_link_ends_the_job_within_the_bound(controller: str) -> None:
    """Issue 16's fault (:func:`lost_link`), at a 10 s deadline: every surviving rank names the collective it waited
    for and the rank that no longer answers, and the job ends with a non-zero status within 25 s. (At the default
    deadline, its 30 s floor here, perf/cluster/faults.py measures the same fault.)"""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    returncode, ended, output = lost_link(controller, f"{NAME}f", wait_s=60, fault_after_s=None, deadline="10")
    assert returncode not in (None, 0) and ended < 25, (returncode, ended, output[-3000:])
    # hvdcomp's deadline, or (Gloo) Gloo's own error for the collective re-raised with hvdcomp's context, if first
    where = (r"'hvdcomp\.[^']+' in step \d+ \(every rank was last heard from together in step \d+, [\d.]+ s ago; "
             r"ranks this rank cannot reach now: (1|0); ")  # each side of the lost link names the other
    assert re.search(rf"hvdcomp: rank \d on \S+ waited \d+\.\d s for collective {where}", output) or (
        controller == "gloo" and re.search(rf"hvdcomp: collective {where}.*failed", output)), output[-3000:]
