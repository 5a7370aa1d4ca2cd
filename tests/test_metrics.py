"""The metrics endpoint in-process: its bounds (connections, time per connection, snapshots a second) and its paths.

Each test runs ``serve_metrics`` on a free port in a trio loop and the client beside it in a worker thread, with
plain blocking sockets and generous timeouts that only keep a broken server from hanging the test.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from liquidfs.metrics import MetricsServer, MetricsStatistics, serve_metrics
from liquidfs.mount import MountConfig
from liquidfs.stats import prometheus_text

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
    return trio.from_thread.run_sync(server.statistics)  # read on the server's loop, from the client's thread


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


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _idle_clients(port: int, count: int, into: list[socket.socket]) -> None:
    """``count`` connections that connect (or wait in the listen queue) and send nothing, added to ``into`` as
    they are made, so the caller closes every one even if a later one fails."""
    for _ in range(count):
        sock = socket.socket()
        into.append(sock)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))


def test_a_flood_of_idle_connections_holds_at_most_max_connections() -> None:
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        before = _open_fds()
        flood: list[socket.socket] = []
        try:
            _idle_clients(port, 200, flood)
            _wait_for(lambda: _stats(server).connections == 8)
            time.sleep(0.5)  # room for a server without a bound to accept more
            stats = _stats(server)
            assert stats.connections <= 8 and stats.peak_connections <= 8, stats
            # the process holds the 200 client sockets and at most 8 accepted ones, not one per connection
            assert _open_fds() - before <= 200 + 8 + 4, (_open_fds(), before)
        finally:
            for sock in flood:
                sock.close()
        head, body = _get(port)
        assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in body
        _wait_for(lambda: _stats(server).connections == 0)
        assert _stats(server).peak_connections <= 8
        _wait_for(lambda: _open_fds() <= before)  # every descriptor the flood cost is given back

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
            head, body = _get(port, timeout=60)  # waits for a slot that a timed-out idle connection gives back
            assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens" in body
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
        assert f"liquidfs_opens {calls + 1}\n" in _get(port)[1].decode()

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
        assert head.startswith(b"HTTP/1.0 200") and b"liquidfs_opens 3\n" in body

    _with_server(client, values)


def test_other_paths_are_not_found() -> None:
    def client(server: MetricsServer) -> None:
        port = _stats(server).port
        for path in ("/", "/metrics", "/metrics?name[]=liquidfs_opens"):
            head, body = _get(port, path)
            assert head.startswith(b"HTTP/1.0 200") and b"Content-Type: text/plain; version=0.0.4" in head, path
            assert b"# TYPE liquidfs_opens gauge\nliquidfs_opens " in body, path
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
