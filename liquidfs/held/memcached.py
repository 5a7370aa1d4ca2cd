"""A strict client of memcached's text protocol for the cluster level (``held.cluster``): what a peer answers is
trusted no more than the peer, so no answer can stall a fetch past its deadline or make it buffer more than the
object it asked for.

Anyone may be a peer (a pod with the right labels, a local user on a port memcached left), and a general client
buffers whatever length a peer announces and times out per ``recv``, not per fetch: a trickled answer held an open
for as long as the peer liked. Here each call has one deadline for all of it (connect, request, header, body),
every socket wait is bounded by the time left, a value's announced length is checked against the one expected
before a byte of it is read, and the body is read into a buffer of exactly that size. Anything else a peer says is
an error of that call (``PeerError``) and its connection is closed; a peer that fails ``FAILURES_TO_SKIP`` calls in
a row (an answer past ``SLOW_SHARE`` of the deadline counts, though it is used) is left out for ``SKIP_FOR``
seconds (``Skipped``), then tried again.

Objects are placed as pymemcache's ``HashClient`` places them (its ``RendezvousHash`` over ``HOST:PORT`` names),
so mounts of two versions agree on where each object is.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import TypeVar

from pymemcache.client.rendezvous import RendezvousHash

from ..sysio.short import short_of_resources

log = logging.getLogger(__name__)

#: Seconds a call may take in all, and of them a connection: past them it is a miss (a slow peer must never
#: stall an open by more than a storage read would).
CONNECT_TIMEOUT = 0.2
TIMEOUT = 1.0
#: Calls failed in a row after which a memcached is left out, and the seconds it is left out for.
FAILURES_TO_SKIP = 3
SKIP_FOR = 5.0
#: The share of its deadline past which a call that succeeded counts as a failure all the same, where that long
#: passed between the request sent and the answer's first line (not its first byte: one byte at once and the rest
#: of the line late was never slow): a memcached that answers every call just inside it (a slow or hostile one)
#: cost each open of its keys two deadlines (a fetch and a store) without ever being left out. (The value's own
#: time on the wire is not counted: 5 MB values at 16 threads over 1 GbE take 0.7 s.)
SLOW_SHARE = 0.5
#: Idle connections kept to each memcached (about one per worker thread of the mount).
MAX_IDLE = 16
#: The longest line a memcached answers with ("VALUE <key of at most 250> <flags> <bytes>", "STORED"): a longer
#: one is no memcached's.
MAX_LINE = 512
#: What memcached takes as a key: 1 to 250 printable bytes, no space.
_KEY = re.compile(rb"[\x21-\x7e]{1,250}")
_TRAILER = b"\r\nEND\r\n"
#: Lines of a ``stats`` answer read at most (memcached 1.6 sends about 90): past them it is no memcached's.
MAX_STATS_LINES = 400

Clock = Callable[[], float]
T = TypeVar("T")


class PeerError(Exception):
    """A call a memcached did not answer as memcached does, in time: a miss, counted."""


class WrongLength(PeerError):
    """A value announced with another length than the object's: never read."""


class Closed(PeerError):
    """The memcached closed the connection."""


class Skipped(PeerError):
    """The memcached that holds the key is left out for a while (it failed repeatedly)."""


class _Stream:
    """One exchange on a connection, under one deadline: reads bounded by the time left and by the caller's
    buffers."""

    def __init__(self, sock: socket.socket, deadline: float, clock: Clock) -> None:
        self.sock = sock
        self.deadline = deadline
        self.clock = clock
        self.pending = b""  # read past the last line, not yet asked for (at most MAX_LINE bytes)
        self.received = 0  # bytes the peer sent in this exchange
        #: When the request was sent whole, and when the answer's first line was whole: how long the memcached took
        #: to answer, apart from the time the value took on the wire either way (``SLOW_SHARE``).
        self.sent_at: float | None = None
        self.answered_at: float | None = None

    def _left(self) -> float:
        left = self.deadline - self.clock()
        if left <= 0:
            raise PeerError("timed out")
        self.sock.settimeout(left)
        return left

    def send(self, *parts: bytes | bytearray | memoryview) -> None:
        """``parts`` sent in order, gathered by the kernel (``sendmsg``): a value joined to its header was a
        third copy of a sealed object in memory (the plaintext, the sealed one, the joined one)."""
        views = [memoryview(part).cast("B") for part in parts if len(part)]
        while views:
            self._left()
            sent = self.sock.sendmsg(views)
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0], sent = views[0][sent:], 0
        self.sent_at = self.clock()

    def _recv_into(self, view: memoryview) -> int:
        self._left()
        got = self.sock.recv_into(view)
        if got == 0:
            raise Closed("connection closed")
        self.received += got
        return got

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        buf = bytearray(MAX_LINE)
        view = memoryview(buf)
        filled = len(self.pending)
        buf[:filled] = self.pending
        while (end := buf.find(b"\r\n", 0, filled)) < 0:
            if filled == MAX_LINE:
                raise PeerError("an answer line past %d bytes" % MAX_LINE)
            filled += self._recv_into(view[filled:])
        self.pending = bytes(buf[end + 2:filled])
        if self.answered_at is None:
            self.answered_at = self.clock()
        return bytes(buf[:end])

    def exactly(self, view: memoryview) -> None:
        """Fill ``view``: what was read ahead, then the socket."""
        taken = min(len(self.pending), len(view))
        view[:taken] = self.pending[:taken]
        self.pending = self.pending[taken:]
        while taken < len(view):
            taken += self._recv_into(view[taken:])


class Peer:
    """One memcached: its idle connections and its record of failures."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.name = f"{host}:{port}"  # as HashClient names it: the rendezvous hash is of this
        self._lock = threading.Lock()
        self._idle: deque[socket.socket] = deque()
        self.failures = 0  # calls failed in a row
        self.skip_until = 0.0
        self.closed = False

    def connection(self, deadline: float, connect_timeout: float, clock: Clock) -> tuple[socket.socket, bool]:
        """An idle connection (and True), else a new one (and False)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        left = min(connect_timeout, deadline - clock())
        if left <= 0:
            raise PeerError("timed out")
        # An address, never a name: a literal is connected to without asking any resolver.
        sock = socket.create_connection((self.host, self.port), timeout=left)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def give_back(self, sock: socket.socket) -> None:
        """A connection whose exchange ended cleanly: kept for the next call."""
        with self._lock:
            if not self.closed and len(self._idle) < MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = list(self._idle), deque()
        for sock in idle:
            sock.close()

    def forget_inherited(self) -> None:
        """In a forked child: the parent's idle connections closed here (``_close_inherited``), the lock new
        (another thread of the parent may have held it at the fork)."""
        self._lock = threading.Lock()
        idle, self._idle = list(self._idle), deque()
        for sock in idle:
            sock.close()

    def skipped(self, now: float) -> bool:
        return now < self.skip_until

    def failed(self, now: float, why: str) -> None:
        with self._lock:
            self.failures += 1
            skip = self.failures >= FAILURES_TO_SKIP
            if skip:
                self.skip_until = now + SKIP_FOR
                idle, self._idle = list(self._idle), deque()
        if skip:
            for sock in idle:  # a peer that fails keeps no connection: the next try connects anew
                sock.close()
            if self.failures == FAILURES_TO_SKIP:
                log.warning("cluster: memcached %s failed %d times in a row (%s): left out for %g s at a time "
                            "until it answers", self.name, self.failures, why, SKIP_FOR)

    def answered(self) -> None:
        with self._lock:  # (a failed() of another thread in between must not be lost)
            again, self.failures, self.skip_until = self.failures >= FAILURES_TO_SKIP, 0, 0.0
        if again:
            log.info("cluster: memcached %s answers again", self.name)


class MemcachedWire:
    """``get``, ``set`` and ``close`` over the memcacheds ``servers`` (addresses), each call within ``timeout``
    seconds in all; a key goes to the memcached rendezvous hashing picks."""

    def __init__(self, servers: Iterable[tuple[str, int]], *, timeout: float = TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT, clock: Clock = time.monotonic) -> None:
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.clock = clock
        self.clients: dict[str, Peer] = {}
        for host, port in servers:
            peer = Peer(host, port)
            self.clients[peer.name] = peer
        self.hasher = RendezvousHash(nodes=list(self.clients))
        self._handed_over: set[str] = set()  # peers a later client took over (``take_peers_of``): not closed here
        _WIRES.add(self)

    def take_peers_of(self, old: MemcachedWire) -> None:
        """The peers this client shares with ``old`` (the memcacheds that stayed when a name resolved anew), taken
        over with their record of failures, their skip and their idle connections: one memcached joining or
        leaving gave every other a clean record (a dead one straight back in service) and new connections.
        ``old`` goes on using them for its calls in flight, and its close leaves them open."""
        for name in self.clients:
            peer = old.clients.get(name)
            if peer is not None and not peer.closed:
                self.clients[name] = peer
                old._handed_over.add(name)

    def limits(self) -> dict[str, int | None]:
        """Each memcached's ``limit_maxbytes`` (what its ``-m`` lets it hold, from ``stats``), None for one that
        did not tell, each asked as ``get`` and ``set`` ask (one deadline, bounded lines, failures counted)."""

        def exchange(stream: _Stream) -> int | None:
            stream.send(b"stats\r\n")
            limit = None
            for _ in range(MAX_STATS_LINES):
                line = stream.line()
                if line == b"END":
                    return limit
                name, _, value = line.removeprefix(b"STAT ").partition(b" ")
                if name == b"limit_maxbytes" and _number(value):
                    limit = int(value)
            raise PeerError(f"a stats answer past {MAX_STATS_LINES} lines")

        found: dict[str, int | None] = {}
        for name, peer in self.clients.items():
            try:
                found[name] = self._call_on(peer, exchange)
            except PeerError as exc:
                log.warning("cluster: %s did not tell its size (stats): %s", name, exc)
                found[name] = None
        return found

    def peer_of(self, key: str) -> Peer | None:
        name = self.hasher.get_node(key)
        return self.clients.get(name) if name is not None else None

    def get(self, key: str, length: int) -> bytearray | None:
        """The value of ``key``, which must be ``length`` bytes; None where the memcached holds none. Raises
        ``PeerError`` (``WrongLength``, ``Skipped``) for anything else."""
        wire_key = _checked(key)

        def exchange(stream: _Stream) -> bytearray | None:
            stream.send(b"get " + wire_key + b"\r\n")
            header = stream.line()
            if header == b"END":
                return None
            parts = header.split(b" ")
            if len(parts) != 4 or parts[0] != b"VALUE" or parts[1] != wire_key or not _number(parts[2]) \
                    or not _number(parts[3]):
                raise PeerError(f"not an answer to get: {header[:80]!r}")
            if int(parts[3]) != length:
                raise WrongLength(f"a value of {int(parts[3])} bytes, expected {length}")
            value = bytearray(length)
            stream.exactly(memoryview(value))
            trailer = bytearray(len(_TRAILER))
            stream.exactly(memoryview(trailer))
            if trailer != _TRAILER:
                raise PeerError("a value not followed by END")
            return value

        return self._call(key, exchange)

    def set(self, key: str, value: bytes | bytearray | memoryview) -> bool | None:
        """True where the memcached stored ``value`` under ``key``; False where it refused it for now (out of
        memory, NOT_STORED), None where it is too large for it (past its -I): a memcached that refuses says so and
        is not at fault. Raises ``PeerError`` for anything else."""
        wire_key = _checked(key)

        def exchange(stream: _Stream) -> bool | None:
            stream.send(b"set %s 0 0 %d\r\n" % (wire_key, len(value)), value, b"\r\n")
            answer = stream.line()
            if answer == b"STORED":
                return True
            if answer.startswith(b"SERVER_ERROR object too large"):
                return None
            if answer in (b"NOT_STORED", b"SERVER_ERROR out of memory storing object"):
                return False
            raise PeerError(f"not an answer to set: {answer[:80]!r}")

        return self._call(key, exchange)

    def close(self) -> None:
        for name, peer in self.clients.items():
            if name not in self._handed_over:
                peer.close()

    def _call(self, key: str, exchange: Callable[[_Stream], T]) -> T:
        peer = self.peer_of(key)
        if peer is None:
            raise PeerError("no memcached")
        return self._call_on(peer, exchange)

    def _call_on(self, peer: Peer, exchange: Callable[[_Stream], T]) -> T:
        now = self.clock()
        if peer.skipped(now):
            raise Skipped(f"{peer.name} is left out for a while")
        deadline = now + self.timeout
        while True:
            sock: socket.socket | None = None
            reused = False
            stream: _Stream | None = None
            try:
                sock, reused = peer.connection(deadline, self.connect_timeout, self.clock)
                stream = _Stream(sock, deadline, self.clock)
                result = exchange(stream)
                if stream.pending:
                    raise PeerError("more than the answer")  # out of step: the connection cannot be used again
            except (OSError, PeerError) as exc:
                if sock is not None:
                    sock.close()
                if reused and stream is not None and stream.received == 0 and _dropped(exc):
                    continue  # an idle connection the memcached let go of (a restart): a new one, same deadline
                if isinstance(exc, WrongLength):
                    # The memcached answered as one: the value is what someone stored there, and anyone may. Held
                    # against the peer, three such values would have left it out for everyone's keys (and its
                    # stores out, so nothing would overwrite them). Nor does it clear the peer's failures: calls
                    # that time out between such values still leave it out. Its connection goes: the body unread.
                    raise
                if short_of_resources(exc):
                    raise PeerError(f"{peer.name}: {exc}") from exc  # this node's want, not the peer's fault
                peer.failed(self.clock(), str(exc))
                if isinstance(exc, PeerError):
                    raise
                raise PeerError(f"{peer.name}: {exc}") from exc
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            # How long it took to begin its answer once asked: a large value's time on the wire (in either way)
            # is the network's and the value's, not a slow memcached's.
            took = (stream.answered_at - stream.sent_at if stream.answered_at is not None and
                    stream.sent_at is not None else self.clock() - now)
            if took > self.timeout * SLOW_SHARE:
                sock.close()
                peer.failed(self.clock(), f"began its answer {took:.2f} s after the request, past "
                                          f"{SLOW_SHARE:.0%} of the call's deadline")
            else:
                peer.answered()
                peer.give_back(sock)
            return result


#: Every wire of this process, for ``_close_inherited``.
_WIRES: weakref.WeakSet[MemcachedWire] = weakref.WeakSet()


def _close_inherited() -> None:
    """In a forked child (each loop of ``--loops`` builds a wire of its own): the parent's idle connections closed
    here. A copy kept in the child held each open after the parent closed it, and the child held descriptors it
    never uses."""
    for wire in list(_WIRES):
        for peer in wire.clients.values():
            peer.forget_inherited()


os.register_at_fork(after_in_child=_close_inherited)


def _dropped(exc: BaseException) -> bool:
    """Whether ``exc`` is a connection closed by the other end (not a timeout, not a wrong answer)."""
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, Closed))


def _checked(key: str) -> bytes:
    """``key`` as memcached takes it; a key it would not take is a bug of the caller, never sent."""
    wire_key = key.encode("utf-8")
    if not _KEY.fullmatch(wire_key):
        raise ValueError(f"not a memcached key: {key!r}")
    return wire_key


def _number(text: bytes) -> bool:
    return 0 < len(text) <= 20 and text.isdigit()
