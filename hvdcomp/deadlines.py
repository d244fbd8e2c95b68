"""Deadlines: a rank that waits for the others longer than its deadline ends the job, saying what it waited for.

A rank or link lost in the middle of training otherwise hangs the job: Horovod's stall inspector only warns (and only
from the coordinator while it can still reach the others; its shutdown, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, is off by
default), NCCL has no timeout and waits forever inside a CUDA collective, and a Horovod blocked in a collective can
neither unwind nor shut down. So each of hvdcomp's waits for a collective (:func:`synchronize`) is bounded by a
deadline (:class:`Deadline`) that a watchdog thread keeps, not the blocked wait, which costs nothing extra: past it
the rank prints which collective it waited for, where the job stood and for how long, and exits with status 1;
mpirun and horovodrun then end the other ranks. A Horovod error (Gloo's own timeout, a peer gone) is re-raised
naming the collective, as the ``HorovodInternalError`` Elastic Horovod recovers from.

Where the job stood includes which ranks still answer: every rank listens on a TCP port of its own (:class:`Beacon`,
on the addresses it advertises), which the ranks exchange with their plans, and a rank whose wait timed out probes the
others' (:func:`answering`): a lost host's rank does not answer, a stalled one does.

Horovod is imported by the first wait, not with the module: :class:`Deadline` is configuration, built without it.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hvdcomp import check


@dataclass(frozen=True)
class Deadline:
    """How long a rank waits for one of hvdcomp's collectives before it ends the job with a message saying what
    it waited for (:func:`synchronize`): ``factor`` x the slowest step so far, at least ``floor_s``; until a step
    has completed (ranks start, import and build at different speeds), ``startup_s``.

    With the defaults a rank or link lost in steady training ends the job about 30 s later, where Horovod's stall
    inspector only warns (its shutdown, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, is off by default) and NCCL would wait
    forever. The deadline counts a rank's wait for the others: a rank that works alone between steps for longer
    (evaluation or a checkpoint on rank 0 only) makes the others wait that long, so such a job needs a larger
    ``floor_s`` (or ``deadline=None``). Under Elastic Horovod (HOROVOD_ELASTIC=1) the default is off: Gloo's own
    timeout then ends a blocked collective with the error that elastic recovery needs.
    """

    factor: float = 10.0
    floor_s: float = 30.0
    startup_s: float = 120.0

    def __post_init__(self) -> None:
        for key in ("factor", "floor_s", "startup_s"):
            check.number("Deadline", key, getattr(self, key), gt=0)

    def seconds(self, slowest_step_s: float | None) -> float:
        return self.startup_s if slowest_step_s is None else max(self.floor_s, self.factor * slowest_step_s)


#: the default: 10x the slowest step, at least 30 s; 120 s until a step has completed
DEFAULT_DEADLINE = Deadline()


class _Watchdog:
    """One thread per process that ends it when a wait outlives its deadline.

    The waiting thread blocks in ``hvd.synchronize`` (no polling: no added latency) after registering what it
    waits for; the watchdog checks twice a second and, past the deadline, prints what was waited for, where the
    job stood and how long, then exits with status 1: a Horovod blocked in a collective cannot unwind or shut
    down, and mpirun and horovodrun end the other ranks when one exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: tuple[str, Callable[[], str], float, float] | None = None
        self._thread: threading.Thread | None = None

    def watch(self, what: str, context: Callable[[], str], deadline_s: float) -> None:
        with self._lock:
            self._waiting = (what, context, deadline_s, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdcomp-deadline", daemon=True)
                self._thread.start()

    def clear(self) -> None:
        with self._lock:
            self._waiting = None

    def _run(self) -> None:
        import horovod.torch as hvd  # imported already: what it watches is a wait in Horovod (synchronize)

        while True:
            time.sleep(0.5)
            with self._lock:
                waiting = self._waiting
            if waiting is None:
                continue
            what, context, deadline_s, since = waiting
            waited = time.monotonic() - since
            if waited > deadline_s:
                try:  # whatever the message meets, the job ends
                    rank = hvd.rank() if hvd.is_initialized() else "?"
                except Exception:
                    rank = "?"
                where = _told(context)
                print(f"hvdcomp: rank {rank} on {socket.gethostname()} waited {waited:.1f} s for collective {what!r} "
                      f"{where}(deadline {deadline_s:.1f} s). A rank or its link is lost or stalled; ending the "
                      "job", file=sys.stderr, flush=True)
                os._exit(1)


_watchdog = _Watchdog()


def _told(context: Callable[[], str]) -> str:
    """``context()`` (where the job stood), or why it could not be told: a failure's message must not fail itself."""
    try:
        return context()
    except Exception as error:
        return f"(where the job stood could not be told: {error!r}) "


class Beacon:
    """A TCP port every rank listens on (accepting and closing connections in a daemon thread), so that a rank whose
    wait timed out can tell which of the others still answer: a rank whose host or link is lost does not, a rank
    that is alive but stalled (stuck in a step, or waiting too) does. It listens only on the addresses it advertises
    (one socket per address, all on one port), not on every interface. Started once per process, on first use."""

    _started: tuple[list[str], int] | None = None

    @classmethod
    def address(cls) -> tuple[list[str], int]:
        """This process's beacon: its host's IPv4 addresses (loopback last), each listened on, and their port."""
        if cls._started is None:
            addresses = _host_addresses()
            servers = _listen(addresses)
            if servers:
                threading.Thread(target=_serve, args=(servers,), name="hvdcomp-beacon", daemon=True).start()
            cls._started = (addresses, servers[0].getsockname()[1] if servers else 0)
        return cls._started


def _listen(addresses: list[str], tries: int = 10) -> list[socket.socket]:
    """A listening TCP socket on each of ``addresses``, all on one port: the first address's free port, which the others
    then take too (where one of them has it in use already, all again on another port)."""
    for _ in range(tries):
        servers: list[socket.socket] = []
        port = 0
        try:
            for address in addresses:
                server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                servers.append(server)
                server.bind((address, port))
                server.listen(64)
                port = server.getsockname()[1]
        except OSError as error:
            for server in servers:
                server.close()
            if error.errno != errno.EADDRINUSE:
                raise
        else:
            return servers
    raise OSError(errno.EADDRINUSE, f"hvdcomp's beacon found no port free on all of {', '.join(addresses)}")


def _serve(servers: list[socket.socket]) -> None:
    """Accepts and closes every connection to ``servers`` (a peer's probe: :func:`answering`), for good."""
    selector = selectors.DefaultSelector()
    for server in servers:
        selector.register(server, selectors.EVENT_READ, server)
    while True:
        for key, _ in selector.select():
            try:
                connection, _ = key.data.accept()
            except OSError:  # (no file descriptor left, for now: the connection waits in the queue)
                time.sleep(0.01)
                continue
            connection.close()


def _host_addresses() -> list[str]:
    """The IPv4 addresses of this host's interfaces (Linux's SIOCGIFADDR), loopback last."""
    import fcntl
    import struct

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            found.append(socket.inet_ntoa(packed[20:24]))
    return sorted(dict.fromkeys(found), key=lambda address: address.startswith("127."))  # each once


#: probes in flight at once (:func:`answering`): a large job's peers must not exhaust the open-file limit
PROBES_AT_ONCE = 256


def answering(peers: dict[int, tuple[list[str], int]], timeout_s: float = 2.0) -> tuple[list[int], list[int]]:
    """The ranks of ``peers`` (rank -> beacon) whose beacon answers a TCP connect within ``timeout_s`` at one of its
    addresses, and those that do not.

    The addresses are tried PROBES_AT_ONCE at a time (non-blocking connects, one wait of at most ``timeout_s`` for
    each batch): a lost host's ranks, whose connects go unanswered, cost one timeout together, not one each, which a
    failed wait's message (and Elastic Horovod's recovery after it) would wait for. A peer's loopback address is
    tried only where it advertises no other: on another host it would reach this one. A probe that finds no file
    descriptor left (the open-file limit, in a large job) is tried again once the others' are closed; one that cannot
    start otherwise (no route), or with none to be had at all, was not answered.
    """
    probes = [(rank, address, port) for rank, (addresses, port) in sorted(peers.items())
              for address in [a for a in addresses if not a.startswith("127.")] or addresses]
    yes: set[int] = set()
    while probes:
        batch = probes[:PROBES_AT_ONCE]
        answered, left = _answered(batch, timeout_s)
        if len(left) == len(batch):  # no descriptor to start any: the rest go unanswered
            break
        yes |= answered
        probes = [probe for probe in left + probes[PROBES_AT_ONCE:] if probe[0] not in yes]
    return sorted(yes), sorted(set(peers) - yes)


def _answered(probes: list[tuple[int, str, int]], timeout_s: float) -> tuple[set[int], list[tuple[int, str, int]]]:
    """The ranks of ``probes`` ((rank, address, port) each) one of whose connects succeeds within ``timeout_s``, and
    the probes not started for want of a file descriptor (the open-file limit)."""
    try:
        selector = selectors.DefaultSelector()
    except OSError:
        return set(), list(probes)
    yes: set[int] = set()
    unstarted: list[tuple[int, str, int]] = []
    try:
        for rank, address, port in probes:
            try:
                probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    unstarted.append((rank, address, port))
                continue
            try:
                probe.setblocking(False)
                status = probe.connect_ex((address, port))
            except OSError:
                status = -1
            if status in (0, errno.EINPROGRESS):
                selector.register(probe, selectors.EVENT_WRITE, rank)
            else:
                probe.close()
        end = time.monotonic() + timeout_s
        while selector.get_map() and (left := end - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                if key.data in yes:  # (its rank answered at another address in this round)
                    continue
                probe = key.fileobj
                assert isinstance(probe, socket.socket)
                if probe.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    yes.add(key.data)  # its rank's other probes are not waited for
                    done = [k for k in selector.get_map().values() if k.data == key.data]
                else:
                    done = [key]
                for finished in done:
                    selector.unregister(finished.fileobj)
                    finished.fileobj.close()  # type: ignore[union-attr]
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()
    return yes, unstarted


#: how often a rank polls an unfinished collective while more ranks share its host than it has cores
POLL_S = 0.0002
_oversubscribed = [False]


def share_host(ranks: int) -> None:
    """Tells :func:`synchronize` that ``ranks`` ranks run on this host (the optimizer counts them by host name when
    the ranks check their plans). Horovod's own wait spins, yielding, until the collective is done: the fastest wait
    with a core per rank. With more ranks than this rank may use cores, the spinning ranks take the cores that
    Horovod's background threads need to do the communication (many times slower under Gloo: perf/training/wait.py),
    so a wait then polls the collective and sleeps between polls, as Open MPI stops busy-polling when
    oversubscribed; from then on for the rest of the process (an optimizer over a process set counts only its own
    ranks)."""
    _oversubscribed[0] = _oversubscribed[0] or ranks > len(os.sched_getaffinity(0))


def synchronize(handle: int, what: str, deadline_s: float | None = None,
                context: Callable[[], str] = lambda: "") -> Any:
    """``hvd.synchronize(handle)``, bounded by ``deadline_s`` (None: unbounded) and with hvdcomp's context.

    Past the deadline this rank prints what it waited for (``what``, and ``context()``: where the job stood) and
    how long, and exits with status 1 (:class:`_Watchdog`): mpirun and horovodrun then end the other ranks. A
    Horovod error (a peer gone under Gloo, Gloo's own timeout) is re-raised as ``HorovodInternalError`` (what
    Elastic Horovod recovers from) naming ``what`` and ``context()``.
    """
    import horovod.torch as hvd
    from horovod.common.exceptions import HorovodInternalError

    if deadline_s is not None:
        _watchdog.watch(what, context, deadline_s)
    try:
        if _oversubscribed[0]:
            while not hvd.poll(handle):
                time.sleep(POLL_S)
        return hvd.synchronize(handle)
    except HorovodInternalError as error:  # (still one, whatever telling the context meets: Elastic recovers)
        raise HorovodInternalError(f"hvdcomp: collective {what!r} {_told(context)}failed: {error}") from error
    finally:
        if deadline_s is not None:
            _watchdog.clear()
