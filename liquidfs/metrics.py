"""A minimal Prometheus text endpoint (``--metrics-port``), with bounded cost to the mount's trio loop.

A full HTTP stack would be a dependency for one GET; this answers ``/`` and ``/metrics`` with the current values
(anything else with 404) and closes the connection, which is all a Prometheus scraper needs.

It runs on the mount's own loop, the one that answers FUSE requests, so everything it may cost is bounded:

- at most ``max_connections`` connections are open at a time. The accept loop takes a slot *before* it accepts,
  so a flood waits in the kernel's listen queue (``backlog`` long; the kernel drops the rest) instead of turning
  into tasks and descriptors here, and accepting costs the loop nothing while the slots are taken;
- each connection has ``time_limit`` seconds in all (reading, answering), so slow clients give their slot back;
- the stats (``values()``, which builds the control file's JSON) are computed at most once per ``max_age``
  seconds and the rendered text reused, so a scrape flood costs at most one snapshot a second.

What is left per connection is an accept, a read and a send of ready bytes. A thread with its own server would
take that off the loop, but not off the GIL the loop shares with it, and it would add a second event loop and a
shutdown handshake between the two; with the bounds above there is nothing left for it to save.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from .stats import prometheus_text

log = logging.getLogger(__name__)

# What accept() fails with when the process or the system is out of descriptors or memory: wait, then go on.
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}

_NOT_FOUND = b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_FAILED = b"HTTP/1.0 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True)
class MetricsStatistics:
    address: str            # where it listens (the first listener's address)
    port: int
    max_connections: int
    connections: int        # open now
    peak_connections: int   # the most ever open at once
    requests: int           # requests answered (200, 404 or 500)
    snapshots: int          # calls of values(): at most one per max_age


class MetricsServer:
    """The endpoint's state: its slots, its cached answer and its counters. Everything runs on one trio loop."""

    def __init__(self, values: Callable[[], dict[str, object]], *, max_connections: int = 8,
                 time_limit: float = 5.0, max_age: float = 1.0) -> None:
        self._values = values
        self._max_connections = max_connections
        self._slots = trio.Semaphore(max_connections)  # taken by the accept loop, given back by the connection
        self._time_limit = time_limit
        self._max_age = max_age
        self._answer = b""
        self._answered_at = float("-inf")
        self._address = ("", 0)
        self._connections = 0
        self._peak = 0
        self._requests = 0
        self._snapshots = 0

    def statistics(self) -> MetricsStatistics:
        return MetricsStatistics(address=self._address[0], port=self._address[1],
                                 max_connections=self._max_connections, connections=self._connections,
                                 peak_connections=self._peak, requests=self._requests, snapshots=self._snapshots)

    def answer(self) -> bytes:
        """The answer to a scrape (200, or 500 where ``values()`` failed), rendered again only when the last one is
        older than ``max_age``."""
        now = trio.current_time()
        if now - self._answered_at >= self._max_age:
            # No await from here to the assignments: concurrent scrapes see either the old answer or the new one.
            self._snapshots += 1
            self._answered_at = now
            try:
                body = prometheus_text(self._values()).encode()
            except Exception:
                # A bug in a statistics() must not end the loop the mount runs on: scrapes fail, the mount stays.
                log.exception("metrics: computing the values failed")
                self._answer = _FAILED
            else:
                self._answer = (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body
        return self._answer

    async def serve(self, listeners: list[trio.SocketListener], *,
                    task_status: trio.TaskStatus[MetricsServer] = trio.TASK_STATUS_IGNORED) -> None:
        self._address = listeners[0].socket.getsockname()[:2]
        log.info("metrics on http://%s:%d/metrics (at most %d connections)", *self._address, self._max_connections)
        task_status.started(self)
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            await self._slots.acquire()
            try:
                stream = await listener.accept()
            except OSError as exc:
                self._slots.release()
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                log.warning("metrics: accept failed (%s); trying again in 100 ms", exc)
                await trio.sleep(0.1)
                continue
            except BaseException:
                self._slots.release()
                raise
            self._connections += 1
            self._peak = max(self._peak, self._connections)
            nursery.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(self._time_limit):
                await self._answer_request(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("metrics client: %s", exc)
        finally:
            self._connections -= 1
            self._slots.release()
            await stream.aclose()

    async def _answer_request(self, stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request and len(request) < 8192:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            request += chunk
        path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/"
        found = path.split(b"?")[0] in (b"/", b"/metrics")
        self._requests += 1
        await stream.send_all(self.answer() if found else _NOT_FOUND)


async def serve_metrics(port: int, values: Callable[[], dict[str, object]], host: str = "127.0.0.1", *,
                        max_connections: int = 8, time_limit: float = 5.0, max_age: float = 1.0,
                        backlog: int = 16,
                        task_status: trio.TaskStatus[MetricsServer] = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on ``host:port`` (port 0: any free one) and serve until cancelled; ``nursery.start`` returns the
    ``MetricsServer``, once it listens, for its ``statistics()``."""
    server = MetricsServer(values, max_connections=max_connections, time_limit=time_limit, max_age=max_age)
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    try:
        await server.serve(listeners, task_status=task_status)
    finally:
        for listener in listeners:
            listener.socket.close()  # not aclose(): a cancelled task's await would stop before the next one
