"""The metrics endpoint in-process: its bounds (connections, time per connection, snapshots a second), its paths,
and that it serves off the trio loop (accepting and answering while the loop is blocked; 503 when the loop does
not compute a snapshot in time; its threads ended when its task is cancelled). Then its table (``metrics.defs``):
a row for every key both data paths' statistics produce, names as Prometheus' conventions want them, and the
text it renders (tests/system/test_prometheus.py has a real Prometheus scrape a real mount).

Each endpoint test runs ``serve_metrics`` on a free port in a trio loop and the client beside it in a worker
thread, with plain blocking sockets and generous timeouts that only keep a broken server from hanging the test.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import inspect
import logging
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pyfuse3
import pytest
import trio

from clusterfakes import FakeMemcached
from liquidfs.datapath.shared_inodes import SharedInodes
from liquidfs.fuse.peers import Peers, merged
from liquidfs.daemon import build as assemble
from liquidfs.policy.next_epoch import NextEpochCache
from liquidfs.catalog.build import build
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import ROOT_ID
from liquidfs.held.cluster import ClusterLevel
from liquidfs.held.disk import DiskLevel
from liquidfs.metrics.defs import COUNTER, EXPORTED_KEYS, INFO, METRICS, NOT_EXPORTED, prometheus_text, unlisted
from liquidfs.metrics.server import MetricsServer, MetricsStatistics, serve_metrics
from liquidfs.mix.share import Mix
from liquidfs.daemon.config import MountConfig
from liquidfs.stores.local.reader import StoreReader
from liquidfs.metrics.stats import MountStats

T = TypeVar("T")


class CountingValues:
    """A ``values()`` that counts its calls and reports the count, so a body tells which snapshot it came from."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict[str, object]:
        self.calls += 1
        return {"opens": self.calls, "bytes_read": 4096, "source": "not a number"}


def _with_server(client: Callable[[MetricsServer], T], values: Callable[[], dict[str, object]],
                 **options: object) -> T:
    async def main() -> T:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(functools.partial(serve_metrics, 0, values, **options))
            try:
                return await trio.to_thread.run_sync(client, server)
            finally:
                nursery.cancel_scope.cancel()

    return trio.run(main)


def _stats(server: MetricsServer) -> MetricsStatistics:
    return server.statistics()  # from any thread: the loop may be blocked (on purpose) meanwhile


def _metrics_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("liquidfs-metrics")]


class BlockedLoop:
    """Blocks the trio loop of ``token`` (a sync call on it that waits) until ``release()``, from a thread of its
    own; ``with`` it: blocked on entry, released on exit."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._blocked = threading.Event()
        self._released = threading.Event()
        self._thread = threading.Thread(target=trio.from_thread.run_sync, args=(self._block,),
                                        kwargs={"trio_token": token})

    def _block(self) -> None:
        self._blocked.set()
        self._released.wait(60)

    def __enter__(self) -> BlockedLoop:
        self._thread.start()
        assert self._blocked.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self._released.set()
        self._thread.join(30)


def _get(port: int, path: str = "/metrics", timeout: float = 30.0) -> tuple[bytes, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
        reply = b""
        while chunk := conn.recv(65536):  # the server closes the connection after its answer
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def _wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _accepted_fds(port: int) -> list[int]:
    """This process's descriptors of connections accepted on ``port`` (TCP sockets whose local address and port
    are the listener's, not the listener itself): the server's own objects, where a count of all open descriptors
    would also move with whatever else the process (an earlier test's thread, a logging handler) opens meanwhile.
    The address too, not the port alone: a flood's client bound to 127.0.0.2 can get the listener's port number
    as its own ephemeral port (CI counted 9 of 8 once)."""
    rows: list[tuple[str, str, str]] = []  # (local endpoint as /proc writes it, state, inode)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)  # the header
                rows += [(fields[1], fields[3], fields[9]) for fields in map(str.split, lines)]
        except FileNotFoundError:  # no IPv6 on this host
            pass
    listening = {local for local, state, _ in rows if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port}
    inodes = {f"socket:[{inode}]" for local, state, inode in rows if local in listening and state != "0A"}
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") in inodes:
                fds.append(int(name))
        except OSError:  # closed meanwhile
            pass
    return fds


def _idle_clients(port: int, count: int, into: list[socket.socket]) -> None:
    """``count`` connections that connect (or wait in the listen queue) and send nothing, added to ``into`` as
    they are made, so the caller closes every one even if a later one fails. They come from four loopback
    addresses in turn (all of 127/8 is this host), so they fill every slot before any peer meets its own bound."""
    for i in range(count):
        sock = socket.socket()
        into.append(sock)
        sock.bind((f"127.0.0.{1 + i % 4}", 0))
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))


def test_a_flood_of_idle_connections_holds_at_most_max_connections() -> None:
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        flood: list[socket.socket] = []
        try:
            threads = len(_metrics_threads())
            tasks = trio.from_thread.run_sync(trio.lowlevel.current_statistics).tasks_living
            _idle_clients(port, 200, flood)
            _wait_for(lambda: _stats(server).connections == 8)
            time.sleep(0.5)  # room for a server without a bound to accept more
            stats = _stats(server)
            assert stats.connections <= 8 and stats.peak_connections <= 8, stats
            # at most 8 accepted descriptors: the rest wait in the kernel's listen queue, not in the process
            assert 1 <= len(_accepted_fds(port)) <= 8, _accepted_fds(port)
            # served by the threads it started with (none per connection), and no task on the loop for them
            assert len(_metrics_threads()) == threads == 8 + 2  # the workers, the accept and the refresh thread
            assert trio.from_thread.run_sync(trio.lowlevel.current_statistics).tasks_living == tasks
        finally:
            for sock in flood:
                sock.close()
        head, body = _get(port)
        assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in body
        _wait_for(lambda: _stats(server).connections == 0)
        assert _stats(server).peak_connections <= 8
        _wait_for(lambda: not _accepted_fds(port))  # every descriptor the flood cost is given back

    _with_server(client, CountingValues(), max_connections=8)


def test_an_idle_connection_is_closed_after_the_time_limit() -> None:
    def client(server: MetricsServer) -> None:
        with socket.create_connection(("127.0.0.1", _stats(server).port), timeout=30) as idle:
            assert idle.recv(1) == b""  # closed by the server, without an answer
        assert _stats(server).connections == 0

    _with_server(client, CountingValues(), time_limit=0.3)


def test_a_scrape_gets_through_while_idle_connections_come_and_go() -> None:
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        idle: list[socket.socket] = []
        try:
            _idle_clients(port, 30, idle)
            _wait_for(lambda: _stats(server).connections == 4)
            # Waits for a slot that a timed-out idle connection gives back. From a peer of its own: one of the
            # idle ones' peers may hold its two connections when it is accepted, and be turned away (a reset).
            reply = _get_from("127.0.0.5", port, timeout=60)
            assert reply.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in reply
            assert _stats(server).peak_connections <= 4
        finally:
            for sock in idle:
                sock.close()

    _with_server(client, CountingValues(), max_connections=4, time_limit=0.3)


def test_a_scrape_flood_takes_at_most_one_snapshot_a_second() -> None:
    values = CountingValues()

    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        start = time.monotonic()
        bodies = [_get(port) for _ in range(100)]
        elapsed = time.monotonic() - start
        assert 1 <= values.calls <= elapsed + 1, (values.calls, elapsed)
        assert _stats(server).snapshots == values.calls
        assert all(head.startswith(b"HTTP/1.0 200") for head, _ in bodies)
        last = bodies[-1][1].decode()
        assert last == prometheus_text({"opens": values.calls, "bytes_read": 4096})
        # once the snapshot is older than a second, the next scrape computes a new one
        calls = values.calls
        time.sleep(1.1)
        assert f"liquidfs_opens_total {calls + 1}\n" in _get(port)[1].decode()

    _with_server(client, values)


def test_a_failing_values_answers_500_and_the_server_stays_up() -> None:
    fail = [True]

    def values() -> dict[str, object]:
        if fail[0]:
            raise RuntimeError("a bug in a statistics()")
        return {"opens": 3}

    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        assert _get(port)[0].startswith(b"HTTP/1.0 500")
        assert _get(port)[0].startswith(b"HTTP/1.0 500")  # the failure is cached too: no retry per scrape
        fail[0] = False
        time.sleep(1.1)
        head, body = _get(port)
        assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens_total 3\n" in body

    _with_server(client, values)


def test_other_paths_are_not_found() -> None:
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        for path in ("/", "/metrics", "/metrics?name[]=liquidfs_opens"):
            head, body = _get(port, path)
            assert head.startswith(b"HTTP/1.0 200") and b"Content-Type: text/plain; version=0.0.4" in head, path
            assert b"# TYPE liquidfs_opens_total counter\nliquidfs_opens_total " in body, path
        for path in ("/other", "/metricsx", "/metrics/x", "/favicon.ico"):
            head, body = _get(port, path)
            assert head.startswith(b"HTTP/1.0 404") and body == b"", path

    _with_server(client, CountingValues())


def test_metrics_listen_on_this_host_only_by_default() -> None:
    def client(server: MetricsServer) -> str:
        return _stats(server).address

    assert _with_server(client, CountingValues()) == "127.0.0.1"
    assert inspect.signature(serve_metrics).parameters["host"].default == "127.0.0.1"
    defaults = {f.name: f.default for f in dataclasses.fields(MountConfig)}
    assert defaults["metrics_address"] == "127.0.0.1"


def test_it_serves_while_the_loop_is_blocked_and_values_run_on_the_loop() -> None:
    on_threads: list[int] = []

    def values() -> dict[str, object]:
        on_threads.append(threading.get_ident())
        return {"opens": len(on_threads)}

    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        loop_thread = trio.from_thread.run_sync(threading.get_ident)
        head, body = _get(port)
        assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens_total 1\n" in body
        assert on_threads == [loop_thread]  # values() read the mount's state on its loop
        assert all(t.ident != loop_thread for t in _metrics_threads()) and len(_metrics_threads()) == 4 + 2
        with BlockedLoop(trio.from_thread.run_sync(trio.lowlevel.current_trio_token)):
            # The loop runs nothing now: connections are still accepted, read, answered (the snapshot is fresh:
            # max_age=60), and closed, all in the endpoint's threads.
            head, body = _get(port)
            assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens_total 1\n" in body
            assert _get(port, "/other")[0].startswith(b"HTTP/1.0 404")
            flood: list[socket.socket] = []
            try:
                _idle_clients(port, 50, flood)
                _wait_for(lambda: _stats(server).peak_connections == 4)
            finally:
                for sock in flood:
                    sock.close()
            _wait_for(lambda: _stats(server).connections == 0)  # the flood's connections, all closed
            assert _stats(server).requests == 3
        assert on_threads == [loop_thread]

    _with_server(client, values, max_connections=4, max_age=60)


def test_a_loop_that_does_not_compute_the_snapshot_in_time_answers_503() -> None:
    entered, release = threading.Event(), threading.Event()
    calls = [0]

    def values() -> dict[str, object]:  # blocks the loop it runs on until the client lets it go
        calls[0] += 1
        entered.set()
        release.wait(60)
        return {"opens": 7}

    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        try:
            assert _get(port)[0].startswith(b"HTTP/1.0 503")  # no answer from the loop within the time limit
            assert entered.is_set()
            with ThreadPoolExecutor(4) as pool:  # scrapes meanwhile wait for the same snapshot, then 503 too
                heads = [head for head, _ in pool.map(lambda _: _get(port), range(4))]
            assert all(head.startswith(b"HTTP/1.0 503") for head in heads), heads
            assert _get(port, "/other")[0].startswith(b"HTTP/1.0 404")  # other paths need no snapshot
            assert calls[0] == 1 and _stats(server).snapshots == 1  # one snapshot asked for, never a second
        finally:
            release.set()
        head, body = _get(port)  # the snapshot is done (or about to be: this scrape waits for it)
        assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens_total 7\n" in body
        assert calls[0] == 1 and _stats(server).requests == 7

    _with_server(client, values, time_limit=0.3, max_age=60)


def test_cancelling_serve_metrics_ends_its_threads_and_closes_its_sockets() -> None:
    assert not _metrics_threads()
    idle: list[socket.socket] = []

    async def main() -> int:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(functools.partial(serve_metrics, 0, CountingValues()))
            port = server.statistics().port
            assert len(_metrics_threads()) == 8 + 2  # accept, refresh, and one worker per slot
            _idle_clients(port, 3, idle)
            with trio.fail_after(30):
                while server.statistics().connections < 3:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        return port

    try:
        port = trio.run(main)
        # joined before serve_metrics returned (its wait is bounded: a thread left would still be alive here)
        assert not _metrics_threads()
        for sock in idle:  # the open connections were shut, not left to their time limit
            sock.setblocking(True)
            sock.settimeout(30)
            assert sock.recv(1) == b""
        try:
            socket.create_connection(("127.0.0.1", port), timeout=30).close()
        except ConnectionRefusedError:
            pass
        else:
            raise AssertionError("still listening")
    finally:
        for sock in idle:
            sock.close()


def _failing_accept(monkeypatch: pytest.MonkeyPatch, errnos: list[int]) -> None:
    """The endpoint's accept() fails with ``errnos``, one after the other, then works."""
    accept = socket.socket.accept

    def failing(sock: socket.socket) -> tuple[socket.socket, object]:
        if threading.current_thread().name == "liquidfs-metrics-accept" and errnos:
            raise OSError(errnos.pop(0), "injected")
        return accept(sock)

    monkeypatch.setattr(socket.socket, "accept", failing)


def test_accept_out_of_descriptors_is_waited_out(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    errnos = [errno.EMFILE, errno.ECONNABORTED, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS]
    _failing_accept(monkeypatch, errnos)

    def client(server: MetricsServer) -> None:
        head, body = _get(_stats(server).port)  # waits in the listen queue while accept fails
        assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens_total 1\n" in body
        assert not errnos and _stats(server).connections == 0 and _stats(server).peak_connections == 1

    with caplog.at_level("WARNING", logger="liquidfs.metrics.server"):
        _with_server(client, CountingValues())
    # the four capacity errors waited out (100 ms each) with a warning; ECONNABORTED (that connection only) not
    assert sum("accept failed" in r.getMessage() for r in caplog.records) == 4


def test_any_other_accept_error_ends_the_endpoint_never_the_mount(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An accept that fails for good (EINVAL, EBADF): the endpoint's threads and sockets go, ``serve_metrics``
    returns, and the mount's other tasks (here: one that keeps counting) go on."""
    _failing_accept(monkeypatch, [errno.EINVAL])
    client = socket.socket()
    ticks = 0

    async def serving_files() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serving_files)
                server = await nursery.start(functools.partial(serve_metrics, 0, CountingValues()))
                client.setblocking(False)
                client.connect_ex(("127.0.0.1", server.statistics().port))
                while _metrics_threads() or not any("stopped" in r.getMessage() for r in caplog.records):
                    await trio.sleep(0.01)
                seen = ticks
                await trio.sleep(0.1)
                assert ticks > seen  # the mount's work goes on
                nursery.cancel_scope.cancel()

    with caplog.at_level("ERROR", logger="liquidfs.metrics.server"):
        try:
            trio.run(main)
        finally:
            client.close()
    assert any("the mount serves on without it" in r.getMessage() and "[Errno 22] injected" in r.getMessage()
               for r in caplog.records)
    assert not _metrics_threads()


def _idle_from(address: str, port: int, count: int, into: list[socket.socket]) -> None:
    """``count`` connections from ``address`` (a loopback address: all of 127/8 is this host) that send nothing."""
    for _ in range(count):
        sock = socket.socket()
        into.append(sock)
        sock.bind((address, 0))
        sock.settimeout(30)
        sock.connect(("127.0.0.1", port))


def _get_from(address: str, port: int, timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(address, 0)) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return reply


def test_one_peer_holding_idle_connections_cannot_starve_the_scrapes() -> None:
    """A client that opened every slot's connection and sent nothing made every scrape wait for the time limit
    (and time out): one peer (one address) holds at most half the slots at once; each of its connections past
    that closes its oldest silent one, and a scrape from anywhere else gets a slot at once."""
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        idle: list[socket.socket] = []
        try:
            _idle_from("127.0.0.1", port, 4, idle)  # every slot of this server
            for sock in idle[:2]:  # past its two connections at a time (half of 4): the oldest closed unanswered
                assert sock.recv(1) == b""
            assert _stats(server).turned_away == 2 and _stats(server).max_per_peer == 2
            reply = _get_from("127.0.0.2", port, timeout=10)  # never waits for the idle one's time limit
            assert reply.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in reply
            assert _stats(server).peak_connections <= 4
        finally:
            for sock in idle:
                sock.close()

    _with_server(client, CountingValues(), max_connections=4, time_limit=60)


def _still_open(sock: socket.socket) -> bool:
    """Neither closed by the server nor sent anything: a read would wait."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


def test_scrapes_from_the_peer_of_idle_connections_close_its_oldest_idle_one() -> None:
    """On loopback every local user is one peer: with `nobody` holding its four idle connections, 0 of 10 local
    scrapes were answered (each closed at the cap). At the cap the new connection closes the peer's oldest one
    that has sent nothing, never itself."""
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        idle: list[socket.socket] = []
        try:
            _idle_from("127.0.0.1", port, 4, idle)  # the peer's four (half of the default eight)
            assert _stats(server).max_per_peer == 4
            _wait_for(lambda: _stats(server).connections == 4)
            first = _get_from("127.0.0.1", port, timeout=10)
            assert first.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in first
            assert idle[0].recv(1) == b""  # the oldest idle one made room
            assert all(_still_open(sock) for sock in idle[1:])
            # The shut one counts for its peer until its worker has closed it, a moment after the client sees
            # the shutdown: a scrape sent before then finds the peer at its cap again and closes the next idle
            # one (CI saw turned_away == 2). Wait until only the three idle ones are held.
            _wait_for(lambda: _stats(server).connections == 3)
            replies = [_get_from("127.0.0.1", port, timeout=10) for _ in range(9)]
            assert all(r.startswith(b"HTTP/1.0 200") for r in replies), replies
            # one made room for them all (each ended before the next): the other three idle ones stay, no scrape
            # was closed
            assert _stats(server).turned_away == 1 and all(_still_open(sock) for sock in idle[1:])
        finally:
            for sock in idle:
                sock.close()

    _with_server(client, CountingValues(), time_limit=60)


def test_connections_that_trickle_their_request_are_closed_for_a_scrape_of_their_peer() -> None:
    """One byte sent into each of the peer's four connections and no more: none was idle, so each local scrape
    was closed unanswered at the cap, until those connections' request deadline (a local user could renew them
    for good). A connection whose request head is not whole is closed for its peer's next one, as an idle one."""
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        trickling: list[socket.socket] = []
        try:
            _idle_from("127.0.0.1", port, 4, trickling)
            for sock in trickling:
                sock.sendall(b"G")
            _wait_for(lambda: _stats(server).connections == 4)
            time.sleep(0.2)  # each worker has read its byte
            reply = _get_from("127.0.0.1", port, timeout=10)
            assert reply.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in reply
            assert trickling[0].recv(1) == b"" and _stats(server).turned_away == 1
        finally:
            for sock in trickling:
                sock.close()

    _with_server(client, CountingValues(), time_limit=60, request_timeout=30)


def test_idle_clients_from_several_addresses_each_under_its_cap_cannot_starve_a_scrape() -> None:
    """Two peers with two idle connections each held every slot of 4, each under its own cap (two pods, or a local
    user binding 127.0.0.2 and .3): every scrape waited for their time limits, and they reconnected. With every
    slot taken and a scrape waiting, the oldest silent connection, whoever's, is closed for it."""
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        idle: list[socket.socket] = []
        try:
            _idle_from("127.0.0.2", port, 2, idle)
            _idle_from("127.0.0.3", port, 2, idle)
            _wait_for(lambda: _stats(server).connections == 4)
            reply = _get_from("127.0.0.4", port, timeout=30)  # the idle ones' time limit is 600 s
            assert reply.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in reply
            assert idle[0].recv(1) == b""  # the oldest made room
            assert _stats(server).peak_connections <= 4
        finally:
            for sock in idle:
                sock.close()

    _with_server(client, CountingValues(), max_connections=4, time_limit=600, request_timeout=600)


@pytest.mark.parametrize("request_head, answered", [
    (b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.0 200"),
    (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.0 405"),
    (b"GET /metrics HTTP/1.0\n\n", b"HTTP/1.0 200"),  # bare newlines, as some clients end a head
    (b"\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.0 200"),  # an empty line first: ignored
])
def test_a_head_is_its_head_other_methods_are_not_allowed(request_head: bytes, answered: bytes) -> None:
    """A HEAD was sent the whole body, a POST answered 200, and a head ended by bare newlines waited out the
    request time limit and was closed unanswered."""
    def client(server: MetricsServer) -> bytes:
        with socket.create_connection(("127.0.0.1", _stats(server).port), timeout=30) as conn:
            conn.sendall(request_head)
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
        return reply

    reply = _with_server(client, CountingValues(), request_timeout=30)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(answered), reply
    if request_head.startswith(b"HEAD"):
        assert body == b"" and b"Content-Length: 0" not in head, reply
    elif request_head.startswith(b"GET"):
        assert b"liquidfs_opens" in body


def test_a_connection_that_does_not_send_its_request_in_time_is_dropped() -> None:
    """The request line and headers have a deadline of their own, shorter than the connection's time limit:
    idle connections, and ones that trickle a byte at a time, give their slot back at it."""
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        with socket.create_connection(("127.0.0.1", port), timeout=30) as idle, \
                socket.create_connection(("127.0.0.1", port), timeout=30) as trickle:
            trickle.sendall(b"GET /metrics HTTP/1.1\r\n")  # a head never finished
            assert idle.recv(1) == b"" and trickle.recv(1) == b""  # closed without an answer
        _wait_for(lambda: _stats(server).connections == 0)
        head, body = _get(port)
        assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in body

    _with_server(client, CountingValues(), time_limit=60, request_timeout=0.3)


# -- the table (metricdefs) ---------------------------------------------------------------------------------------


class _Kernel:
    """Registers nothing: the passthrough path's backings are only counted here."""

    def __init__(self) -> None:
        self.registered = 0

    def register(self, fd: int) -> int:
        self.registered += 1
        return self.registered

    def unregister(self, backing_id: int) -> None:
        pass


@pytest.fixture(scope="module")
def every_statistics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``statistics()`` of a real ``Operations`` on each data path, built as a mount builds it with every part
    that adds keys (the memory cache level, the disk level, a mix), after each file was opened, read and
    released twice (two epochs)."""
    root = tmp_path_factory.mktemp("metricdefs")
    src = root / "src"
    (src / "d").mkdir(parents=True)
    for i in range(4):
        (src / "d" / f"{i}.bin").write_bytes(bytes([i]) * (3000 + i))
    store = root / "store"
    build(src, store)
    catalog = Catalog.open(store, readonly=True)
    reader = StoreReader(catalog.source, store)
    files, served, _, max_id = catalog.file_totals()
    found = {}
    for data_path in ("daemon", "passthrough"):
        disk = DiskLevel(reader, root / f"disk-{data_path}", NextEpochCache(served, served, files, max_id=max_id))
        cluster = ClusterLevel(disk, FakeMemcached(), 1.0)
        with ExitStack() as stack:
            stack.callback(disk.close)
            ops, _ = assemble.operations(
                MountConfig(source="src", mountpoint=Path("/mnt"), store="store"), catalog, cluster, MountStats(),
                stack, policy=NextEpochCache(served, served, files, max_id=max_id), data_path=data_path,
                kernel=_Kernel(), mix=Mix(0.5, 1.0), warm=reader.warm,
                levels=[disk, cluster])
            trio.run(_read_twice, ops)
            found[data_path] = ops.statistics()
    # mount --loops: the counters of two loops as the control file and /metrics sum them
    pairs = Peers.made(2)
    try:
        ops.join_loops(Peers(pairs, 0), SharedInodes(2))
        found["loops"] = merged([ops.statistics(), ops.statistics()])
    finally:
        Peers.close_pairs(pairs)
    catalog.close()
    return found


async def _read_twice(ops: Any) -> None:
    ctx = pyfuse3.RequestContext()
    d = await ops.lookup(ROOT_ID, b"d", ctx)
    for _ in range(2):
        for i in range(4):
            entry = await ops.lookup(d.st_ino, f"{i}.bin".encode(), ctx)
            fh = (await ops.open(entry.st_ino, os.O_RDONLY, ctx)).fh
            await ops.read(fh, 0, 1 << 16)
            await ops.release(fh)


def _paths(values: Mapping[str, object], prefix: str = "") -> Iterator[str]:
    for key, value in values.items():
        yield prefix + key
        if isinstance(value, Mapping):
            yield from _paths(value, prefix + key + ".")


@pytest.mark.parametrize("data_path", ["daemon", "passthrough", "loops"])
def test_every_key_the_statistics_produce_has_a_row_or_a_reason(every_statistics: dict[str, dict[str, Any]],
                                                                data_path: str) -> None:
    """A counter added to a statistics() without a row in ``metrics.defs.METRICS`` (or a reason in NOT_EXPORTED)
    fails here, before it can go missing from the dashboards."""
    values = every_statistics[data_path]
    assert values["opens"] == (16 if data_path == "loops" else 8)
    assert values["data_path"] == ("passthrough" if data_path == "loops" else data_path)
    assert list(unlisted(values)) == [], "keys without a row in metrics.defs.METRICS (or a reason in NOT_EXPORTED)"


def test_every_row_reads_a_key_the_statistics_produce(every_statistics: dict[str, dict[str, Any]]) -> None:
    """No row for a key that is gone (renamed, removed): it would export nothing, silently."""
    produced = {path for values in every_statistics.values() for path in _paths(values)}
    assert (EXPORTED_KEYS | set(NOT_EXPORTED)) - produced == set()


def test_the_names_follow_prometheus_conventions() -> None:
    names = [metric.name for metric in METRICS]
    assert len(names) == len(set(names))
    assert len(EXPORTED_KEYS) == sum(len(metric.sources()) for metric in METRICS), "a key read by two rows"
    assert not EXPORTED_KEYS & set(NOT_EXPORTED)
    for metric in METRICS:
        assert re.fullmatch(r"liquidfs_[a-z][a-z0-9_]*[a-z0-9]", metric.name), metric.name
        assert metric.name.endswith("_total") == (metric.kind == COUNTER), metric.name
        assert metric.name.endswith("_info") == (metric.kind == INFO), metric.name
        base = metric.name.removesuffix("_total")
        assert base.endswith(f"_{metric.unit}") if metric.unit else \
            not base.endswith(("_bytes", "_seconds", "_ratio")), metric.name
        assert metric.help.endswith(".") and "\n" not in metric.help, metric.name
        assert bool(metric.label) == (not isinstance(metric.keys, str) and metric.kind != INFO), metric.name
        if metric.label:
            assert re.fullmatch(r"[a-z][a-z_]*", metric.label), metric.name
            assert all(re.fullmatch(r"[a-z]+", value) for value, _ in metric.sources()), metric.name


def test_counters_are_counters_nested_values_and_levels_have_labels() -> None:
    text = prometheus_text({"opens": 7, "open_files": 2, "cache_hits_predicted": 5, "cache_misses_predicted": 3,
                            "cache_hits": 4, "disk_hits": 1,
                            "data_path": "daemon", "warmup": "", "source": "/data/x",
                            "mix": {"mode": "fixed", "share": 0.25, "reason": "fixed by --mix 0.25",
                                    "decisions": 0, "opens_raw": 2, "opens_original": 5},
                            "window_hit_ratio_sd": None, "epochs": {"1": {"reads": 4}}})
    assert "# HELP liquidfs_opens_total Opens of files.\n# TYPE liquidfs_opens_total counter\n" \
           "liquidfs_opens_total 7\n" in text
    assert "# TYPE liquidfs_open_files gauge\nliquidfs_open_files 2\n" in text
    assert 'liquidfs_cache_hits_total{level="memory"} 5\nliquidfs_cache_hits_total{level="disk"} 1\n' in text
    assert 'liquidfs_cache_misses_total{level="memory"} 3\n' in text
    assert "# TYPE liquidfs_mix_raw_ratio gauge\nliquidfs_mix_raw_ratio 0.25\n" in text
    assert 'liquidfs_mix_opens_total{served="raw"} 2\nliquidfs_mix_opens_total{served="original"} 5\n' in text
    assert 'liquidfs_mount_info{data_path="daemon",mix_mode="fixed"} 1\n' in text  # warmup "": no label
    # absent, None, and not exported (paths, sentences, histories): no sample, and no HELP/TYPE without one
    assert "window" not in text and "/data" not in text and "reason" not in text and "epochs" not in text
    assert " 4\n" not in text  # the net hits are not exported: a lost hit would lower them
    assert "liquidfs_cache_held_bytes" not in text
    types = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(types) == len(set(types)) and set(types) == set(re.findall(r"^(liquidfs_\w+)[{ ]", text, re.M))


def test_numbers_are_written_as_the_text_format_reads_them() -> None:
    text = prometheus_text({"stuck_reads": True, "mix": {"share": float("nan"), "prepared": float("inf")},
                            "cache_share": 1e-05, "data_path": 'a "b"\\c\nd'})
    assert "liquidfs_stuck_reads 1\n" in text and "liquidfs_mix_raw_ratio NaN\n" in text
    assert "liquidfs_mix_prepared_ratio +Inf\n" in text
    assert 'liquidfs_cache_budget_ratio{level="memory"} 1e-05\n' in text
    assert 'liquidfs_mount_info{data_path="a \\"b\\"\\\\c\\nd"} 1\n' in text


def test_a_key_without_a_row_is_exported_untyped_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    values = {"opens": 1, "unlisted_counter": 7, "unlisted_text": "x", "unlisted_part": {"held": 2, "ok": True}}
    with caplog.at_level(logging.WARNING, logger="liquidfs.metrics.defs"):
        text = prometheus_text(values)
        assert sorted(r.getMessage().split()[1] for r in caplog.records) == [
            "unlisted_counter", "unlisted_part.held", "unlisted_part.ok", "unlisted_text"]
        assert "exported untyped as liquidfs_unlisted_counter" in caplog.text
        caplog.clear()
        assert prometheus_text(values) == text and caplog.records == []  # logged once, exported every time
    assert "# TYPE liquidfs_unlisted_counter untyped\nliquidfs_unlisted_counter 7\n" in text
    assert "liquidfs_unlisted_part_held 2\n" in text and "liquidfs_unlisted_part_ok 1\n" in text
    assert "unlisted_text" not in text and "liquidfs_opens_total 1\n" in text


def test_every_request_type_the_fuse_layer_times_is_exported() -> None:
    from liquidfs.fuse.operations import REQUEST_TYPES
    from liquidfs.metrics.defs import REQUESTS

    assert set(REQUEST_TYPES) == set(REQUESTS) and "open" in REQUESTS and "release" in REQUESTS


def test_a_lost_hit_never_makes_an_exported_counter_go_down() -> None:
    """A predicted hit whose bytes were gone is a miss (``correct_miss``): the net hits in ``liquidfs stats`` go
    down by one, which Prometheus would read as a counter reset. The exported counters are the predicted hits and
    misses and the lost hits, each only growing, and (hits - lost) / (hits + misses) is the net ratio."""
    policy = NextEpochCache(4000, 4000, 4, max_id=10)
    for epoch in range(2):
        for file in range(1, 5):
            decision = policy.read(file, 1000)
    before = policy.summary()
    assert decision.hit and decision.epoch
    policy.correct_miss(decision.epoch, 1000)
    after = policy.summary()
    assert after["cache_hits"] == before["cache_hits"] - 1  # the net count, as stats shows it
    samples = {}
    for snapshot in (before, after):
        for line in prometheus_text(snapshot).splitlines():
            if line.startswith("liquidfs_cache_") and "_total{" in line:
                name, value = line.rsplit(" ", 1)
                samples.setdefault(name, []).append(float(value))
    assert all(b >= a for a, b in samples.values()), samples
    hits, lost = 'liquidfs_cache_hits_total{level="memory"}', 'liquidfs_cache_lost_hits_total{level="memory"}'
    misses = 'liquidfs_cache_misses_total{level="memory"}'
    assert samples[lost] == [0.0, 1.0]
    net = (samples[hits][1] - samples[lost][1]) / (samples[hits][1] + samples[misses][1])
    assert net == after["cache_hits"] / (after["cache_hits"] + after["cache_misses"])


def test_served_from_counts_each_level_and_refuses_an_unknown_one() -> None:
    stats = MountStats()
    for level, size in (("storage", 5), ("memory", 7), ("disk", 11), ("cluster", 13), ("cluster", 1)):
        stats.served_from(level, size)
    assert (stats.bytes_from_storage, stats.bytes_from_memory, stats.bytes_from_disk, stats.bytes_from_cluster) \
        == (5, 7, 11, 14)
    with pytest.raises(ValueError):
        stats.served_from("tape", 1)
