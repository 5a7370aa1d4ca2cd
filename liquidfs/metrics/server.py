"""A minimal Prometheus text endpoint (``--metrics-port``), served off the mount's trio loop.

A full HTTP stack would be a dependency for one GET; this answers ``/`` and ``/metrics`` with the current values
(anything else with 404; a HEAD with the head alone, a method other than GET and HEAD with 405) and closes the
connection, which is all a Prometheus scraper needs. What the values are
called, their kinds and units, is ``metrics.defs``' table; this module only serves its text.

The mount's trio loop answers FUSE requests: whatever the endpoint costs there is time a read waits for. So it
runs in threads of its own, with blocking sockets, and the loop does nothing per connection (no accept, no
read, no send, no task): a scrape flood, or clients that connect and hang, cannot take the loop's time. The
loop's one part is computing a snapshot of the values (``values()``, which builds the control file's JSON: it
reads the mount's state, which only the loop may touch), at most once per ``max_age`` seconds; the threads
render it and reuse the rendered answer for every scrape meanwhile. A scrape that finds it older than that asks
the loop for one new snapshot (``trio.from_thread.run_sync``, from a thread of its own) and waits for it; the
scrapes that come while it is computed wait for the same one, so a flood never asks for two. If the loop does
not compute it within the connection's time limit (it is stuck), the scrape is answered 503 instead of waiting.

The threads share the GIL with the loop, so everything they may cost is still bounded:

- at most ``max_connections`` connections are open at a time, served by as many worker threads (a fixed pool).
  The accept thread takes a slot *before* it accepts, so a flood waits in the kernel's listen queue (``backlog``
  long; the kernel drops the rest) instead of turning into threads and descriptors here;
- each connection has ``time_limit`` seconds in all (reading, waiting for a snapshot, answering), and
  ``request_timeout`` of them to send its request line and headers, so slow and idle clients give their slot
  back soon; a request is read up to 8 KiB;
- one peer (an IPv4 address, or an IPv6 /64: one host's) holds at most ``max_per_peer`` connections at once, so
  a client that keeps connections open and idle cannot hold every slot and make every scrape wait. At the cap a
  new connection closes that peer's oldest one that has not sent its whole request head (idle, or trickling it),
  never itself: on the default loopback address every local user is one peer, and a scraper (which sends its
  request as soon as it is connected) must not be turned away because another user holds such connections. Only
  where all of the peer's connections are being answered is the new one closed as it is accepted;
- with every slot taken (idle clients from several addresses, each under its own cap) and a connection waiting
  to be accepted, the oldest connection that has not sent its request head, whoever's, is closed for it after
  ``_SLOT_WAIT``; and accepts are at most one per ``_ACCEPT_SPACING``, each being Python beside the loop;
- accept failing for want of descriptors or memory (EMFILE, ENFILE, ENOMEM, ENOBUFS) is waited out (100 ms),
  not fatal.

``serve_metrics`` is the task the mount starts: it binds, starts the threads, and when cancelled stops them
(a stop flag, the listening and open sockets shut, the threads joined, a second at most) so the mount exits
promptly.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import queue
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from ..sysio.short import short_of_resources
from ..sysio.thread_names import METRICS, name_this_thread
from .defs import prometheus_text

log = logging.getLogger(__name__)

# What it fails with for the one connection it was accepting (reset, refused by a firewall): go on at once.
# trio's SocketListener, which served this before, ignored the same ones.
_ACCEPT_IGNORED_ERRNOS = {getattr(errno, name) for name in (
    "EPERM", "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET", "EHOSTUNREACH",
    "EOPNOTSUPP", "ENETUNREACH", "ENOSR", "ESOCKTNOSUPPORT", "EPROTONOSUPPORT", "ETIMEDOUT", "ECONNRESET",
) if hasattr(errno, name)}

_MAX_REQUEST = 8192   # bytes of a request read at most (its head, up to the blank line)
_STOP_TIMEOUT = 1.0   # seconds serve_metrics waits for its threads to end when cancelled

_NOT_FOUND = b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_NOT_ALLOWED = (b"HTTP/1.0 405 Method Not Allowed\r\nAllow: GET, HEAD\r\nContent-Length: 0\r\n"
                b"Connection: close\r\n\r\n")
#: The least time between two accepts (at most 200 a second): each is Python that takes the interpreter's lock
#: from the loop, and a client connecting and closing in a loop took a third of the loop's time (its worst stall
#: 0.2 -> 16 ms); the rest wait in the kernel's listen queue, which drops what it cannot hold.
_ACCEPT_SPACING = 0.005
#: With every slot taken and a connection waiting to be accepted: how long the accept thread waits for a slot
#: before it closes the oldest connection that has not sent its request (whoever's) to make one.
_SLOT_WAIT = 0.1
_FAILED = b"HTTP/1.0 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_UNAVAILABLE = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True)
class MetricsStatistics:
    address: str            # where it listens (the first listener's address)
    port: int
    max_connections: int
    max_per_peer: int
    connections: int        # open now
    peak_connections: int   # the most ever open at once
    requests: int           # requests answered (200, 404, 405, 500 or 503)
    snapshots: int          # calls of values(): at most one per max_age
    turned_away: int        # connections closed at their peer's max_per_peer: its oldest silent one, else the new


def _peer(address: Any) -> str:
    """Whom a connection counts against (``max_per_peer``): its IPv4 address (an IPv4-mapped IPv6 one too), or
    the /64 of an IPv6 address, since one host is given a whole /64 to pick addresses from."""
    host = str(address[0] if isinstance(address, tuple) else address)
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class MetricsServer:
    """The endpoint's state: its slots, its cached answer, its counters and its threads.

    Everything here is shared by the accept thread, the worker threads, the refresh thread and the trio loop
    (``statistics()``), so it is read and written under one lock; ``_changed`` (its condition) is notified when
    a slot is given back, a snapshot is wanted or done, and when the server stops."""

    def __init__(self, values: Callable[[], dict[str, object]], *, max_connections: int = 8,
                 time_limit: float = 5.0, max_age: float = 1.0, request_timeout: float = 2.0,
                 max_per_peer: int | None = None) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._values = values
        self._max_connections = max_connections
        # Half the slots by default: one greedy client leaves the other half to everyone else, and a few scrapes
        # at once from one address (all local clients are 127.0.0.1) are still served side by side.
        self._max_per_peer = max(1, max_connections // 2 if max_per_peer is None else max_per_peer)
        self._time_limit = time_limit
        # A scraper sends its request as soon as it is connected: a request head not in after this long is a
        # client holding a slot for nothing (the whole time limit is for waiting on a snapshot, too).
        self._request_timeout = request_timeout
        self._max_age = max_age
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._slots_taken = 0              # taken by the accept thread before it accepts, given back on close
        self._answer = b""
        self._answered_at = float("-inf")  # time.monotonic() when the last snapshot was asked for
        self._refreshing = False           # a snapshot is asked for and not done yet
        self._stopping = False
        self._open: set[socket.socket] = set()
        self._per_peer: dict[str, int] = {}  # connections open now per peer (those with any)
        # Open connections that have not sent their whole request head yet, and their peers, oldest first: those
        # closed at a peer's cap. (Those that had sent nothing, at first: a local user holding its peer's
        # connections each one byte into a request refused every local scrape.)
        self._silent: dict[socket.socket, str] = {}
        self._turned_away = 0
        self._address: tuple[str, int] = ("", 0)
        self._connections = 0
        self._peak = 0
        self._requests = 0
        self._snapshots = 0
        self._listeners: list[socket.socket] = []
        # Accepted connections for the workers: the socket, its peer, when it was accepted (time.monotonic()).
        self._pending: queue.SimpleQueue[tuple[socket.socket, str, float] | None] = queue.SimpleQueue()
        self._accept_thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._refresher: threading.Thread | None = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._error: BaseException | None = None
        self._failed = trio.Event()        # set (on the loop) when a thread met an error that must end the server

    def statistics(self) -> MetricsStatistics:
        """The counters, from any thread."""
        with self._lock:
            return MetricsStatistics(address=self._address[0], port=self._address[1],
                                     max_connections=self._max_connections, max_per_peer=self._max_per_peer,
                                     connections=self._connections, peak_connections=self._peak,
                                     requests=self._requests, snapshots=self._snapshots,
                                     turned_away=self._turned_away)

    # -- starting and stopping (from the trio loop) ----------------------------------------------------------

    def start(self, listeners: list[socket.socket], token: trio.lowlevel.TrioToken) -> None:
        """Serve on ``listeners`` (bound, listening; the server owns them now) from threads of its own; the
        snapshots are computed on the loop of ``token``."""
        self._token = token
        self._listeners = listeners
        self._address = listeners[0].getsockname()[:2]
        for listener in listeners:
            listener.setblocking(False)  # a connection reset between poll and accept must not block the thread
        self._wakeup = socket.socketpair()
        self._refresher = threading.Thread(target=self._refresh_loop, name="liquidfs-metrics-refresh",
                                           daemon=True)
        self._workers = [threading.Thread(target=self._worker, name=f"liquidfs-metrics-{i}", daemon=True)
                         for i in range(self._max_connections)]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="liquidfs-metrics-accept",
                                               daemon=True)
        for thread in (self._refresher, *self._workers, self._accept_thread):
            thread.start()
        log.info("metrics on http://%s:%d/metrics (at most %d connections, %d per peer)", *self._address,
                 self._max_connections, self._max_per_peer)

    def stop(self, timeout: float = _STOP_TIMEOUT) -> None:
        """Stop serving and wait (``timeout`` seconds at most) for the threads to end. Blocking, and the refresh
        thread may be waiting for the loop: call it in a thread (``serve_metrics`` does), not on the loop."""
        deadline = time.monotonic() + timeout
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
            for conn in self._open:  # wakes the workers blocked reading or sending; they close them
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._wakeup is not None:
            try:
                self._wakeup[1].send(b"\0")  # wakes the accept thread from its poll
            except OSError:
                pass
        if self._accept_thread is not None and self._accept_thread.ident is not None:
            self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        # Only now: a connection the accept thread queued as it stopped comes before these, and gets closed.
        for _ in self._workers:
            self._pending.put(None)
        for thread in (*self._workers, self._refresher):
            if thread is not None and thread.ident is not None:  # started (start() may have failed half-way)
                thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in (self._accept_thread, *self._workers, self._refresher) if t and t.is_alive()]
        if left:
            log.warning("metrics: threads still running after %.1f s: %s", timeout, ", ".join(left))
        if self._accept_thread is None or not self._accept_thread.is_alive():
            for sock in (*self._listeners, *(self._wakeup or ())):
                sock.close()

    def _fail(self, exc: BaseException) -> None:
        """An error that ends ``serve_metrics``: the endpoint stops, the mount serves on (a KeyboardInterrupt
        is raised on the loop)."""
        with self._lock:
            if self._error is None:
                self._error = exc
        assert self._token is not None
        try:
            self._token.run_sync_soon(self._failed.set)
        except trio.RunFinishedError:
            pass

    # -- the accept thread -----------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        name_this_thread(METRICS)
        assert self._wakeup is not None
        selector = selectors.DefaultSelector()
        try:
            for listener in self._listeners:
                selector.register(listener, selectors.EVENT_READ)
            selector.register(self._wakeup[0], selectors.EVENT_READ)
            accepted_at = float("-inf")
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._stopping,
                                           max(0.0, accepted_at + _ACCEPT_SPACING - time.monotonic()))
                    while self._slots_taken >= self._max_connections and not self._stopping:
                        # Every slot taken by clients from several addresses (pods, 127.0.0.2 and on), each under
                        # its own cap, while a scrape waits to be accepted: the oldest connection that has not
                        # sent its request makes room, whoever's (they made every scrape wait for their time
                        # limits, again and again). Never one being answered.
                        if not self._changed.wait(_SLOT_WAIT) and self._someone_waits():
                            self._close_oldest_silent(None)
                    if self._stopping:
                        return
                    self._slots_taken += 1
                    accepted_at = time.monotonic()
                try:
                    accepted = self._accept_one(selector)
                except OSError as exc:
                    self._give_back_slot()
                    if not short_of_resources(exc):  # out of descriptors or memory: wait, then go on
                        raise
                    log.warning("metrics: accept failed (%s); trying again in 100 ms", exc)
                    with self._changed:
                        self._changed.wait_for(lambda: self._stopping, 0.1)
                    continue
                except BaseException:
                    self._give_back_slot()
                    raise
                if accepted is None:
                    self._give_back_slot()
                    continue
                conn, peer = accepted
                with self._changed:
                    if self._stopped():  # stop() has shut the open ones already: this one is never served
                        self._slots_taken -= 1
                        conn.close()
                        return
                    held = self._per_peer.get(peer, 0)
                    refused = held >= self._max_per_peer and not self._close_oldest_silent(peer)
                    if refused:
                        # Its peer's connections are all mid-request: this one is closed unread, the slot free
                        # for the next in the queue.
                        self._slots_taken -= 1
                        self._turned_away += 1
                    else:
                        self._per_peer[peer] = held + 1
                        self._open.add(conn)
                        self._silent[conn] = peer
                        self._connections += 1
                        self._peak = max(self._peak, self._connections)
                if refused:
                    log.debug("metrics: %s holds %d connections already; closed another", peer, held)
                    conn.close()
                    continue
                self._pending.put((conn, peer, time.monotonic()))
        except BaseException as exc:
            if not self._stopping:
                log.exception("metrics: the accept thread failed")
                self._fail(exc)
        finally:
            selector.close()

    def _accept_one(self, selector: selectors.BaseSelector) -> tuple[socket.socket, str] | None:
        """A connection and its peer (``_peer``), or None where there was none to accept after all (or the
        server stops)."""
        for key, _ in selector.select():
            listener = key.fileobj
            if isinstance(listener, socket.socket) and listener in self._listeners:
                try:
                    conn, address = listener.accept()
                except BlockingIOError:
                    return None
                except OSError as exc:
                    if exc.errno in _ACCEPT_IGNORED_ERRNOS:
                        log.debug("metrics: accept: %s", exc)
                        return None
                    raise
                return conn, _peer(address)
        return None

    def _someone_waits(self) -> bool:
        """Whether a connection waits in a listener's queue (a poll, never a wait; ``poll``, not ``select``: a
        daemon holding many files has its listener's descriptor past 1024, which ``select`` refuses)."""
        poller = select.poll()
        for listener in self._listeners:
            poller.register(listener, select.POLLIN)
        try:
            return bool(poller.poll(0))
        except OSError:
            return False

    def _close_oldest_silent(self, peer: str | None) -> bool:
        """Shut ``peer``'s (None: anyone's) oldest connection that has not sent its whole request head (its worker
        then closes it and gives its slot back); False where it has none. Under the lock, so its worker has not
        closed it yet."""
        oldest = next((conn for conn, owner in self._silent.items() if peer is None or owner == peer), None)
        if oldest is None:
            return False
        del self._silent[oldest]
        self._turned_away += 1
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # its worker's recv (or its first one, if still queued) sees EOF
        except OSError:
            pass
        log.debug("metrics: closed the oldest idle connection (%s) for a new one", peer or "every slot taken")
        return True

    def _stopped(self) -> bool:
        """``_stopping`` read anew (another thread sets it; a plain test would be narrowed by the check above)."""
        return self._stopping

    def _give_back_slot(self) -> None:
        with self._changed:
            self._slots_taken -= 1
            self._changed.notify_all()

    # -- the worker threads ----------------------------------------------------------------------------------

    def _worker(self) -> None:
        name_this_thread(METRICS)
        while (item := self._pending.get()) is not None:
            conn, peer, accepted = item
            try:
                self._serve(conn, accepted + self._time_limit, accepted + self._request_timeout)
            except OSError as exc:  # a reset, or the time limit (socket.timeout is an OSError)
                log.debug("metrics client: %s", exc)
            except Exception:  # never let a worker die: its slot's connections would go unanswered
                log.exception("metrics: serving a connection failed")
            finally:
                with self._changed:
                    # Closed under the lock: stop() never shuts a closed socket, and once the client sees the
                    # close, statistics() no longer counts the connection.
                    self._open.discard(conn)
                    self._silent.pop(conn, None)
                    conn.close()
                    self._connections -= 1
                    if self._per_peer[peer] > 1:
                        self._per_peer[peer] -= 1
                    else:
                        del self._per_peer[peer]  # the peers with connections now, not every one ever seen
                    self._slots_taken -= 1
                    self._changed.notify_all()

    def _serve(self, conn: socket.socket, deadline: float, request_deadline: float) -> None:
        request = b""
        while b"\r\n\r\n" not in request and b"\n\n" not in request and len(request) < _MAX_REQUEST:
            remaining = min(deadline, request_deadline) - time.monotonic()
            if remaining <= 0:
                return  # the request deadline (or the time limit): closed without an answer
            conn.settimeout(remaining)
            chunk = conn.recv(min(4096, _MAX_REQUEST - len(request)))
            if not chunk:
                return
            request += chunk
        # Its request is whole: no longer one closed for its peer's next connection (one that trickles its bytes
        # is, as one that sends none).
        with self._lock:
            self._silent.pop(conn, None)
        request = request.lstrip(b"\r\n")  # (an empty line before the request line is ignored, RFC 9112 2.2)
        method, path = request.split(b" ", 2)[:2] if request.count(b" ") >= 2 else (b"GET", b"/")
        found = path.split(b"?")[0] in (b"/", b"/metrics")
        with self._lock:
            self._requests += 1
        if method not in (b"GET", b"HEAD"):
            reply = _NOT_ALLOWED
        else:
            reply = self.answer(deadline) if found else _NOT_FOUND
            if method == b"HEAD":  # its head only: what a GET would answer, without the body
                reply = reply.partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
        # What is left of the time limit; none left (a 503 at the limit): only what the socket takes at once.
        conn.settimeout(max(0.0, deadline - time.monotonic()))
        conn.sendall(reply)

    def answer(self, deadline: float) -> bytes:
        """The answer to a scrape: 200, or 500 where ``values()`` failed, or 503 where the loop did not compute
        a snapshot by ``deadline`` (``time.monotonic()``). A new snapshot is asked for only when the last one
        is older than ``max_age``; a scrape that comes while one is computed waits for that one."""
        with self._changed:
            if not self._refreshing and time.monotonic() - self._answered_at >= self._max_age:
                self._refreshing = True
                self._answered_at = time.monotonic()
                self._changed.notify_all()  # the refresh thread
            while self._refreshing and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return _UNAVAILABLE
                self._changed.wait(remaining)
            return _UNAVAILABLE if self._refreshing else self._answer  # still computing: the server stops

    # -- the refresh thread ----------------------------------------------------------------------------------

    def _refresh_loop(self) -> None:
        """Computes the snapshots asked for, one at a time: ``values()`` on the loop, the text here."""
        name_this_thread(METRICS)
        while True:
            with self._changed:
                while not self._refreshing and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
                self._snapshots += 1
            answer = _FAILED
            try:
                answer = self._render(trio.from_thread.run_sync(self._values, trio_token=self._token))
            except trio.RunFinishedError:  # the loop is gone: the server is stopping
                answer = _UNAVAILABLE
            except Exception:
                # A bug in a statistics() must not end the mount: scrapes fail, the mount stays.
                log.exception("metrics: computing the values failed")
            except BaseException as exc:  # a KeyboardInterrupt met on the loop: give it back to the loop
                self._fail(exc)
            finally:
                with self._changed:
                    self._answer = answer
                    self._refreshing = False
                    self._changed.notify_all()

    @staticmethod
    def _render(values: dict[str, object]) -> bytes:
        body = prometheus_text(values).encode()
        return (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body


async def serve_metrics(port: int, values: Callable[[], dict[str, object]], host: str = "127.0.0.1", *,
                        max_connections: int = 8, time_limit: float = 5.0, max_age: float = 1.0,
                        request_timeout: float = 2.0, max_per_peer: int | None = None, backlog: int = 16,
                        task_status: trio.TaskStatus[MetricsServer] = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on ``host:port`` (port 0: any free one) and serve, from threads of its own, until cancelled;
    ``nursery.start`` returns the ``MetricsServer``, once it listens, for its ``statistics()``.

    ``values()`` is called on this task's loop, at most once per ``max_age`` seconds; it must return a snapshot
    (a dict it does not change afterwards: it is rendered in another thread)."""
    server = MetricsServer(values, max_connections=max_connections, time_limit=time_limit, max_age=max_age,
                           request_timeout=request_timeout, max_per_peer=max_per_peer)
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    sockets: list[socket.socket] = []
    try:
        for listener in listeners:
            sockets.append(socket.socket(fileno=listener.socket.detach()))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        for sock in sockets:
            sock.close()
        raise
    try:
        server.start(sockets, trio.lowlevel.current_trio_token())
        task_status.started(server)
        await server._failed.wait()
        assert server._error is not None
        if not isinstance(server._error, Exception):  # a KeyboardInterrupt met on the loop: the loop's
            raise server._error
        # An accept that fails for good (EBADF, EINVAL: a bug, or the kernel's): the endpoint ends, the mount
        # serves on without it. A scraper sees the target down; a loader would have seen its files gone.
        log.error("metrics: the endpoint on port %d stopped (%s); the mount serves on without it",
                  server.statistics().port, server._error)
    finally:
        with trio.CancelScope(shield=True):
            # A limiter of its own: the default one's threads may all be busy (reads stuck on storage), and the
            # mount must not wait for one of them to end before it can exit.
            await trio.to_thread.run_sync(server.stop, limiter=trio.CapacityLimiter(1))
