"""An emulated cluster on one machine: N hosts as Linux network namespaces on one switch, links shaped with tc.

    hvdcomp cluster up --hosts 4 --rate 100mbit --delay 1ms
    hvdcomp cluster run -- hvdcomp train --workload synthetic --compression terngrad
    hvdcomp cluster down

Topology. Host ``i`` is the network namespace ``<name>-h<i>`` with loopback and one interface, ``eth0``,
address ``10.213.0.<i+1>/24``. Its eth0 is one end of a veth pair whose other end, port ``h<i>``, is enslaved
to the bridge ``br0`` of a namespace of its own, ``<name>-sw`` (the switch). No interface of the machine's
own namespace joins the cluster, so the cluster reaches nothing else and nothing else reaches it; clusters
of different names are isolated from each other (they may use the same addresses). IPv6 is off in every
namespace, so only loopback and the hosts' IPv4 addresses carry traffic.

Links. Every link is shaped in both directions, as a switch port would be: a token bucket (tc-tbf(8)) at
``rate`` on the host's eth0 (what the host sends) and on the switch port (what it receives), so a host
receiving from several peers at once still gets ``rate`` in all. ``delay`` and ``loss`` (tc-netem(8)) sit
under the host's sending bucket: a packet from host A to host B is delayed by ``delay`` once (round trip
2 x delay) and lost with probability ``loss``. Rates use tc's units (``kbit``, ``mbit``, ``gbit``: powers of
1000); tbf counts Ethernet frames, so TCP goodput is about 1448/1514 = 95.6% of the rate at MTU 1500.

Ranks. :meth:`Cluster.launch_command` runs one rank per host. mpirun itself starts inside host 0 (its PMIx
server and ORTE must listen on an address the other hosts can reach) and each rank enters its own host
through ``ip netns exec`` (mpirun's MPMD form: one ``-np 1`` application context per host). Namespaces do
not separate /dev/shm or Unix sockets, so Open MPI is held to TCP on the cluster's subnet: ``pml ob1`` (no
UCX), ``btl tcp,self`` (no vader shared memory), ``btl_tcp_if_include``/``oob_tcp_if_include`` and, in the
environment of mpirun and the ranks, ``PMIX_MCA_ptl_tcp_if_include`` (Open MPI 4.1 FAQ, "TCP";
PMIx ptl/tcp parameters). With ``controller="gloo"``, :func:`gloo_driver` does what ``horovodrun --gloo``
does, inside host 0: it starts Horovod's rendezvous server there and one rank per host with Horovod's
environment (``HOROVOD_GLOO_RENDEZVOUS_ADDR`` host 0's address, ``HOROVOD_GLOO_IFACE=eth0``, the slot
variables). horovodrun itself cannot: when every host is local it insists on the interface holding
127.0.0.1 (``get_local_interfaces`` in ``horovod/runner/driver/driver_service.py``), which no other host reaches.
Horovod 0.28.1 also opens each process set's Gloo context without ``HOROVOD_GLOO_IFACE``
(``GlooContext::InitializeForProcessSet`` reads the new context's empty ``gloo_iface_``), so Gloo falls back
to the address of the machine's hostname: each host therefore gets its own /etc/hosts (``ip netns exec``
mounts /etc/netns/<host>/hosts over /etc/hosts) in which the hostname is the host's address, and which
also names every host of the cluster.

Sources: ip-netns(8), ip-link(8) (veth, bridge), tc-tbf(8), tc-netem(8); Horovod 0.28.1's
``horovod/runner/gloo_run.py`` (``launch_gloo``) for the Gloo launch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: the hosts' subnet; every cluster is isolated in its own namespaces, so every cluster can use it
SUBNET = "10.213.0.0/24"
INTERFACE = "eth0"
MAX_HOSTS = 250
STATE_DIR = Path("/run/hvdcomp-cluster")
NETNS_ETC = Path("/etc/netns")
REPO = Path(__file__).resolve().parents[2]
CONTROLLERS = ("mpi", "gloo")

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DELAY = re.compile(r"^\d+(?:\.\d+)?(us|ms|s)$")
_LOSS = re.compile(r"^(\d+(?:\.\d+)?)%$")
_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class ClusterError(RuntimeError):
    """The cluster cannot be created, found or used; the message says why and what to do."""


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    interface: str = INTERFACE

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host (its network namespace)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True)
class Cluster:
    name: str
    hosts: list[Host]
    subnet: str
    rate: str
    delay: str
    loss: str | None

    @property
    def switch(self) -> str:
        """The namespace of the bridge that joins the hosts."""
        return f"{self.name}-sw"

    @property
    def rate_bps(self) -> float:
        """The link rate in bits per second."""
        return parse_rate(self.rate)

    def launch_command(self, command: list[str], env: dict[str, str] | None = None,
                       controller: str = "mpi", elastic: tuple[int, str] | None = None) -> list[str]:
        """The argv that runs ``command`` as one rank per host, every byte between ranks on the shaped links.

        ``env`` is exported to every rank. ``controller`` is ``mpi`` (Open MPI's mpirun, Horovod's MPI
        controller) or ``gloo`` (horovodrun --gloo). ``elastic`` (Gloo only): (the fewest ranks, a host discovery
        script printing the available hosts' ``ADDRESS:1``) for Elastic Horovod (:func:`elastic_driver`).
        """
        if elastic is not None and controller != "gloo":
            raise ValueError("launch_command: Elastic Horovod runs on the gloo controller only")
        if not command:
            raise ValueError("launch_command: empty command")
        env = dict(env or {})
        for key in env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ValueError(f"launch_command: invalid environment variable name {key!r}")
        first = self.hosts[0]
        if controller == "mpi":
            mpirun = REPO / "launch" / "mpirun.sh"
            if not mpirun.exists():
                raise ClusterError(f"{mpirun} not found: launch_command needs hvdcomp's source checkout")
            pmix = f"PMIX_MCA_ptl_tcp_if_include={self.subnet}"
            flags = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "coll", "^sm",
                     "--mca", "btl_tcp_if_include", self.subnet, "--mca", "oob_tcp_if_include", self.subnet]
            exports = [pmix, *(f"{key}={value}" for key, value in env.items())]
            contexts: list[str] = []
            for host in self.hosts:  # -x in MPMD form reaches the first context only: env(1) in each
                contexts += [":", "-np", "1", *host.command(["env", *exports, *command])]
            return first.command(["env", pmix, str(mpirun), *flags, *contexts[1:]])
        if controller == "gloo":
            exports = [f"--env={key}={value}" for key, value in env.items()]
            if elastic is not None:
                exports += [f"--min-np={elastic[0]}", f"--host-discovery-script={elastic[1]}"]
            return first.command([sys.executable, "-m", "hvdcomp.tools.cluster", f"--name={self.name}", *exports,
                                  "--", *command])
        raise ValueError(f"launch_command: unknown controller {controller!r}; valid: {', '.join(CONTROLLERS)}")


def parse_rate(rate: str) -> float:
    """A tc rate (``100mbit``) in bits per second."""
    match = _RATE.match(rate)
    if not match:
        raise ValueError(f"rate: {rate!r} is not a tc rate; give a number and one of "
                         f"{', '.join(_RATE_SCALE)} (e.g. 100mbit, 1gbit, 10gbit)")
    bps = float(match.group(1)) * _RATE_SCALE[match.group(2)]
    if bps < 8000:
        raise ValueError(f"rate: {rate!r} is below 8kbit, too slow to carry a TCP connection")
    return bps


def _validate(hosts: int, rate: str, delay: str, loss: str | None, name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"name: {name!r} must be 1-12 lowercase letters and digits, starting with a letter")
    if not 2 <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts: {hosts} must be between 2 and {MAX_HOSTS}")
    parse_rate(rate)
    if not _DELAY.match(delay):
        raise ValueError(f"delay: {delay!r} is not a tc time; give a number and one of us, ms, s (e.g. 1ms)")
    if loss is not None:
        match = _LOSS.match(loss)
        if not match or not 0 <= float(match.group(1)) < 100:
            raise ValueError(f"loss: {loss!r} must be a percentage in [0%, 100%) (e.g. 0.1%)")


def _check_system() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (network namespaces, veth pairs, tc); "
                           "run as root or with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` not found on PATH ({os.environ.get('PATH', '')}); "
                               "install iproute2 (apt-get install iproute2) or add /usr/sbin to PATH")


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def _namespaces(name: str) -> list[str]:
    listed = _run("ip", "netns", "list").split()
    pattern = re.compile(rf"^{re.escape(name)}-(sw|h\d+)$")
    return [ns for ns in listed if pattern.match(ns)]


def _state_file(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def _shape(namespace: str, device: str, rate: str, delay: str | None, loss: str | None) -> None:
    """A token bucket at ``rate`` on ``device``'s egress, with netem (delay, loss) under it if asked."""
    bytes_per_s = parse_rate(rate) / 8
    burst = max(int(bytes_per_s / 250), 64 * 1024)  # one 4 ms timer tick of traffic, and 64 KiB GSO frames
    limit = max(int(bytes_per_s * 0.1), 4 * burst)  # 100 ms of queue
    _run("tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "handle", "1:", "tbf",
         "rate", rate, "burst", str(burst), "limit", str(limit))
    netem = []
    if delay is not None:
        netem += ["delay", delay]
    if loss is not None:
        netem += ["loss", loss]
    if netem:
        try:
            _run("tc", "-n", namespace, "qdisc", "replace", "dev", device, "parent", "1:1", "handle", "10:",
                 "netem", *netem, "limit", "100000")
        except ClusterError as error:
            if "unknown" not in str(error):
                raise
            raise ClusterError("delay and loss need tc's netem qdisc, which this kernel lacks "
                               "(CONFIG_NET_SCH_NETEM); use --delay 0ms and no --loss here") from error


def _add_namespace(namespace: str) -> None:
    """A network namespace with loopback up and IPv6 off (no link-local addresses, no router solicitations)."""
    _run("ip", "netns", "add", namespace)
    _run("ip", "netns", "exec", namespace, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
         "net.ipv6.conf.default.disable_ipv6=1")
    _run("ip", "-n", namespace, "link", "set", "lo", "up")


def _write_hosts_file(host: Host, members: list[Host]) -> None:
    """/etc/hosts as the host sees it (``ip netns exec`` bind-mounts /etc/netns/NS/hosts over /etc/hosts):
    this machine's hostname is the host's own address, and every host answers to its namespace name."""
    lines = ["127.0.0.1 localhost", f"{host.address} {socket.gethostname()}"]
    lines += [f"{member.address} {member.namespace}" for member in members]
    directory = NETNS_ETC / host.namespace
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "hosts").write_text("\n".join(lines) + "\n")


def up(hosts: int, rate: str = "1gbit", delay: str = "0ms", loss: str | None = None,
       name: str = "hvdc") -> Cluster:
    """Creates ``hosts`` hosts on one switch with every link shaped; an existing cluster ``name`` goes first."""
    _validate(hosts, rate, delay, loss, name)
    _check_system()
    down(name)
    switch = f"{name}-sw"
    network = SUBNET.rsplit(".", 1)[0]
    members = [Host(f"{name}-h{i}", f"{network}.{i + 1}") for i in range(hosts)]
    try:
        _add_namespace(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        slow = delay if float(delay.rstrip("mus")) > 0 else None  # 0ms: no netem
        for i, host in enumerate(members):
            port = f"h{i}"
            _add_namespace(host.namespace)
            _run("ip", "-n", host.namespace, "link", "add", INTERFACE, "type", "veth", "peer", "name", port,
                 "netns", switch)
            _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
            _run("ip", "-n", host.namespace, "link", "set", INTERFACE, "up")
            _write_hosts_file(host, members)
            _shape(host.namespace, INTERFACE, rate, slow, loss)
            _shape(switch, port, rate, None, None)
        cluster = Cluster(name, members, SUBNET, rate, delay, loss)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        _state_file(name).write_text(json.dumps(asdict(cluster)))
    except BaseException:
        down(name)
        raise
    return cluster


def down(name: str = "hvdc") -> None:
    """Stops what still runs on the hosts of cluster ``name`` and removes it; no cluster is not an error."""
    if not _NAME.match(name):
        raise ValueError(f"name: {name!r} must be 1-12 lowercase letters and digits, starting with a letter")
    _check_system()
    namespaces = _namespaces(name)
    pids = {int(pid) for ns in namespaces for pid in _run("ip", "netns", "pids", ns).split()}
    for sig in (signal.SIGTERM, signal.SIGKILL):  # the hosts power off: their processes end
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if Path(f"/proc/{pid}").exists()}
            time.sleep(0.05)
    for ns in namespaces:
        _run("ip", "netns", "delete", ns)
    for directory in NETNS_ETC.glob(f"{name}-h*"):
        if re.match(rf"^{re.escape(name)}-h\d+$", directory.name):
            shutil.rmtree(directory)
    _state_file(name).unlink(missing_ok=True)


def status(name: str = "hvdc") -> Cluster | None:
    """The cluster ``name`` as it runs now, or None if there is none."""
    if not _NAME.match(name):
        raise ValueError(f"name: {name!r} must be 1-12 lowercase letters and digits, starting with a letter")
    _check_system()
    namespaces = set(_namespaces(name))
    state = _state_file(name)
    if not namespaces and not state.exists():
        return None
    if not state.exists():
        raise ClusterError(f"cluster {name!r} is incomplete (namespaces {sorted(namespaces)} without its state "
                           f"file {state}); remove it with `hvdcomp cluster down --name {name}`")
    saved = json.loads(state.read_text())
    cluster = Cluster(**{**saved, "hosts": [Host(**host) for host in saved["hosts"]]})
    missing = {cluster.switch, *(host.namespace for host in cluster.hosts)} - namespaces
    if missing:
        raise ClusterError(f"cluster {name!r} is incomplete: namespaces {sorted(missing)} are gone; "
                           f"remove it with `hvdcomp cluster down --name {name}` and bring it up again")
    return cluster


_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
server.settimeout(float(sys.argv[2]))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
connection.settimeout(float(sys.argv[2]))
received, first = 0, None
while chunk := connection.recv(1 << 20):
    first = first or time.perf_counter()
    received += len(chunk)
print(received, time.perf_counter() - first, flush=True)
"""

_SENDER = """
import socket, sys
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
block, left = bytes(1 << 20), int(sys.argv[3])
while left > 0:
    connection.sendall(block[:left])
    left -= len(block)
connection.close()
"""


def throughput(cluster: Cluster, source: int = 0, destination: int = 1, nbytes: int = 20_000_000,
               timeout: float = 60) -> float:
    """TCP goodput in bits/s of one stream of ``nbytes`` from host ``source`` to host ``destination``,
    timed at the receiver from the first byte to the last."""
    for index in (source, destination):
        if not 0 <= index < len(cluster.hosts):
            raise ValueError(f"host {index} does not exist; cluster {cluster.name!r} has hosts "
                             f"0..{len(cluster.hosts) - 1}")
    if source == destination:
        raise ValueError("source and destination must be different hosts")
    target = cluster.hosts[destination]
    receiver = subprocess.Popen(target.command([sys.executable, "-c", _RECEIVER, target.address, str(timeout)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        port = receiver.stdout.readline().strip()
        if not port:
            raise ClusterError(f"throughput receiver on {target.namespace} failed: {receiver.stderr.read()}")
        subprocess.run(cluster.hosts[source].command(
            [sys.executable, "-c", _SENDER, target.address, port, str(nbytes), str(timeout)]),
            check=True, capture_output=True, timeout=timeout)
        output, errors = receiver.communicate(timeout=timeout)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.communicate()
    fields = output.split()
    if receiver.returncode != 0 or len(fields) != 2 or int(fields[0]) != nbytes:
        raise ClusterError(f"throughput receiver on {target.namespace} got {fields[:1]} of {nbytes} bytes: "
                           f"{errors.strip()}")
    return nbytes * 8 / float(fields[1])


def gloo_driver(cluster: Cluster, command: list[str], env: dict[str, str] | None = None) -> int:
    """Runs ``command`` as one Horovod Gloo rank per host, as ``horovodrun --gloo`` would; call it inside host 0.

    Returns the first nonzero exit status of a rank (the other ranks are then stopped), or 0.
    """
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    by_address = {host.address: host for host in cluster.hosts}
    plan = get_host_assignments(parse_hosts(",".join(f"{address}:1" for address in by_address)), len(by_address))
    server = RendezvousServer()
    port = server.start()
    server.init(plan)
    common = {key: str(value) for key, value in
              create_run_env_vars(cluster.hosts[0].address, [INTERFACE], port).items()}
    ranks = [subprocess.Popen(by_address[slot.hostname].command(command),
                              env={**os.environ, **common, **create_slot_env_vars(slot), "PYTHONUNBUFFERED": "1",
                                   **(env or {})}) for slot in plan]
    status_code = 0
    try:
        while any(rank.poll() is None for rank in ranks):
            failed = [rank.returncode for rank in ranks if rank.returncode not in (None, 0)]
            if failed:
                status_code = failed[0]
                break
            time.sleep(0.1)
        status_code = status_code or next((rank.returncode for rank in ranks if rank.returncode), 0)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.terminate()
        for rank in ranks:
            try:
                rank.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rank.kill()
                rank.wait()
        server.stop()
    return status_code


def elastic_driver(cluster: Cluster, command: list[str], discovery_script: str, min_np: int,
                   env: dict[str, str] | None = None) -> int:
    """Runs ``command`` under Elastic Horovod (Gloo) on the cluster's hosts, as ``horovodrun --gloo --min-np
    MIN_NP --max-np HOSTS --host-discovery-script SCRIPT`` would; call it inside host 0.

    The discovery script prints the hosts available now, one ``ADDRESS:1`` per line (the cluster's addresses);
    each rank runs in its host's namespace. Returns 0, or 1 with Horovod's message when the job failed."""
    import shlex

    from horovod.runner.common.util import safe_shell_exec
    from horovod.runner.elastic.discovery import HostDiscoveryScript
    from horovod.runner.elastic.settings import ElasticSettings
    from horovod.runner.gloo_run import launch_gloo_elastic
    from horovod.runner.http.http_server import RendezvousServer

    by_address = {host.address: host for host in cluster.hosts}
    settings = ElasticSettings(discovery=HostDiscoveryScript(discovery_script, 1), min_num_proc=min_np,
                               max_num_proc=len(cluster.hosts), elastic_timeout=600, reset_limit=None,
                               num_proc=len(cluster.hosts), nics=[INTERFACE])

    def in_namespace(run_command: str, slot_info: Any, events: list[Any]) -> tuple[int, float]:
        argv = by_address[slot_info.hostname].command(["sh", "-c", run_command])
        exit_code = safe_shell_exec.execute(" ".join(shlex.quote(part) for part in argv), index=slot_info.rank,
                                            events=events)
        return exit_code, time.time()

    def interfaces(driver: Any) -> list[str]:
        driver.wait_for_available_slots(min_np)
        return [INTERFACE]

    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        launch_gloo_elastic(command, in_namespace, settings, environment, interfaces, RendezvousServer(),
                            sys.executable)
    except RuntimeError as error:
        print(f"hvdcomp cluster: elastic job failed: {error}", file=sys.stderr)
        return 1
    return 0


def _environment(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise ValueError(f"--env: {pair!r} is not NAME=VALUE")
        env[key] = value
    return env


def describe(cluster: Cluster) -> str:
    loss = f", loss {cluster.loss}" if cluster.loss else ""
    lines = [f"cluster {cluster.name}: {len(cluster.hosts)} hosts on {cluster.subnet}, every link {cluster.rate} "
             f"each way, delay {cluster.delay}{loss} (switch namespace {cluster.switch})"]
    lines += [f"  {host.namespace:<12} {host.address:<15} {host.interface}" for host in cluster.hosts]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdcomp cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="hvdc", help="the cluster's name (default: hvdc)")
    actions = parser.add_subparsers(dest="action", required=True)
    start = actions.add_parser("up", help="bring up (or replace) the cluster")
    start.add_argument("--hosts", type=int, required=True)
    start.add_argument("--rate", default="1gbit", help="link rate in tc units, e.g. 100mbit, 1gbit, 10gbit")
    start.add_argument("--delay", default="0ms", help="one-way delay added to each host's sending side")
    start.add_argument("--loss", help="packet loss on each host's sending side, e.g. 0.1%%")
    start.add_argument("--json", action="store_true", help="print the cluster as JSON")
    actions.add_parser("down", help="stop what runs on the hosts and remove the cluster")
    show = actions.add_parser("status", help="describe the cluster, or say there is none (exit status 1)")
    show.add_argument("--json", action="store_true")
    run = actions.add_parser("run", help="run a command as one rank per host: hvdcomp cluster run -- CMD...")
    run.add_argument("--controller", choices=CONTROLLERS, default="mpi")
    run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="exported to every rank")
    run.add_argument("command", nargs=argparse.REMAINDER)
    probe = actions.add_parser("probe", help="measure TCP goodput of one stream between two hosts")
    probe.add_argument("--source", type=int, default=0)
    probe.add_argument("--destination", type=int, default=1)
    probe.add_argument("--bytes", type=int, default=20_000_000)
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            cluster = up(args.hosts, args.rate, args.delay, args.loss, args.name)
            print(json.dumps(asdict(cluster)) if args.json else describe(cluster))
            return 0
        if args.action == "down":
            down(args.name)
            return 0
        cluster = status(args.name)
        if cluster is None:
            print(f"no cluster named {args.name!r}; start one with `hvdcomp cluster up --hosts N`",
                  file=sys.stderr)
            return 1
        if args.action == "status":
            print(json.dumps(asdict(cluster)) if args.json else describe(cluster))
            return 0
        if args.action == "probe":
            goodput = throughput(cluster, args.source, args.destination, args.bytes)
            print(json.dumps({"source": args.source, "destination": args.destination, "bytes": args.bytes,
                              "goodput_bps": goodput, "rate_bps": cluster.rate_bps,
                              "goodput_over_rate": goodput / cluster.rate_bps}))
            return 0
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run: give the command after --, e.g. hvdcomp cluster run -- hvdcomp train")
        env = _environment(args.env)
        return subprocess.run(cluster.launch_command(command, env, args.controller)).returncode
    except ClusterError as error:
        print(f"hvdcomp cluster: error: {error}", file=sys.stderr)
        return 2


def _gloo_main(argv: list[str]) -> int:
    """``python -m hvdcomp.tools.cluster --name NAME [--env K=V]... -- CMD``: :func:`gloo_driver`, run by
    :meth:`Cluster.launch_command` inside host 0."""
    parser = argparse.ArgumentParser(prog="python -m hvdcomp.tools.cluster")
    parser.add_argument("--name", required=True)
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--min-np", type=int, help="elastic: the fewest ranks the job goes on with")
    parser.add_argument("--host-discovery-script", help="elastic: prints the available hosts' ADDRESS:1")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cluster = status(args.name)
    if cluster is None:
        raise ClusterError(f"no cluster named {args.name!r}")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.host_discovery_script:
        return elastic_driver(cluster, command, args.host_discovery_script, args.min_np or 1,
                              _environment(args.env))
    return gloo_driver(cluster, command, _environment(args.env))


if __name__ == "__main__":
    sys.exit(_gloo_main(sys.argv[1:]))
