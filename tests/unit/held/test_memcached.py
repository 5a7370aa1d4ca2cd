"""The strict memcached client of the cluster level against fake peers on real loopback sockets: a peer that
trickles, lies about a length, answers garbage or nothing costs one call its deadline at most, never more memory
than the object, never a wrong value; a peer that fails repeatedly is left out for a while, then tried again."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from liquidfs.held.memcached import (FAILURES_TO_SKIP, MAX_LINE, SKIP_FOR, SLOW_SHARE, MemcachedWire, PeerError,
                                    Skipped, WrongLength)

#: Seconds a call may take in these tests: short, so a stalled call is seen; a trickle takes far longer in all.
DEADLINE = 0.3
KEY = "liquidfs2:00aa:5"
#: What a lying peer sends, made once: tracemalloc sees the peer's threads too.
CHUNK = b"x" * 65536


class FakePeer:
    """A TCP server on 127.0.0.1 that answers each request line with ``answer(peer, conn, request)`` (a set's data
    block is read first), one thread per connection; it counts connections and the bytes it sent."""

    def __init__(self, answer: Callable[[FakePeer, socket.socket, bytes], None]) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self.sent = 0
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.wires: list[MemcachedWire] = []  # the clients of this peer: closed with it
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        try:
            while not self.stop.is_set():
                line = stream.readline(1024)
                if not line:
                    return
                self.requests.append(line)
                if line.startswith(b"set "):
                    stream.read(int(line.split()[4]) + 2)
                self.answer(self, conn, line)
        except OSError:
            return
        finally:
            conn.close()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        for wire in self.wires:
            wire.close()
        self.stop.set()
        self.thread.join(5)
        for thread in self.threads:
            thread.join(5)
        self.listener.close()


@pytest.fixture
def peers() -> Iterator[Callable[[Callable[[FakePeer, socket.socket, bytes], None]], FakePeer]]:
    made: list[FakePeer] = []

    def make(answer: Callable[[FakePeer, socket.socket, bytes], None]) -> FakePeer:
        made.append(FakePeer(answer))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def _wire(peer: FakePeer, **kwargs: object) -> MemcachedWire:
    peer.wires.append(MemcachedWire([("127.0.0.1", peer.port)], timeout=DEADLINE, **kwargs))  # type: ignore[arg-type]
    return peer.wires[-1]


def _value(body: bytes) -> Callable[[FakePeer, socket.socket, bytes], None]:
    whole = b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (KEY.encode(), len(body), body)  # made once (tracemalloc)

    def answer(peer: FakePeer, conn: socket.socket, request: bytes) -> None:
        if request.startswith(b"get "):
            peer.send(conn, whole)
        else:
            peer.send(conn, b"STORED\r\n")
    return answer


def test_a_value_of_the_expected_length_is_read_and_the_connection_kept(peers) -> None:  # type: ignore[no-untyped-def]
    peer = peers(_value(b"hello"))
    wire = _wire(peer)
    assert wire.get(KEY, 5) == b"hello" and wire.get(KEY, 5) == b"hello"
    assert wire.set(KEY, b"hello") is True
    assert peer.connections == 1 and peer.requests[0] == f"get {KEY}\r\n".encode()


def test_a_miss_is_none(peers) -> None:  # type: ignore[no-untyped-def]
    peer = peers(lambda p, conn, request: p.send(conn, b"END\r\n"))
    assert _wire(peer).get(KEY, 5) is None


def test_a_trickled_value_is_a_miss_within_the_deadline(peers) -> None:  # type: ignore[no-untyped-def]
    """One byte every 20 ms: each recv answers well within any per-recv timeout, the whole value would take
    20 s. The fetch gives up at its deadline, having read a small part of it."""
    length = 1000

    def trickle(peer: FakePeer, conn: socket.socket, request: bytes) -> None:
        peer.send(conn, b"VALUE %s 0 %d\r\n" % (KEY.encode(), length))
        for _ in range(length):
            if peer.stop.is_set():
                return
            peer.send(conn, b"x")
            time.sleep(0.02)

    peer = peers(trickle)
    wire = _wire(peer)
    with pytest.raises(PeerError, match="timed out"):
        wire.get(KEY, length)
    # Given up long before the peer was done: far fewer bytes sent than the value's (a generous bound: at 20 ms a
    # byte the 0.3 s deadline lets ~15 through; only a fetch that waited 10 s or more would see half).
    assert peer.sent < length // 2


def test_a_peer_that_never_answers_is_a_miss_within_the_deadline(peers) -> None:  # type: ignore[no-untyped-def]
    peer = peers(lambda p, conn, request: None)
    wire = _wire(peer)
    with pytest.raises(PeerError, match="timed out"):
        wire.get(KEY, 5)
    with pytest.raises(PeerError, match="timed out"):
        wire.set(KEY, b"hello")


@pytest.mark.parametrize("announced", [4, 6, 10**12, 10**19])
def test_a_length_other_than_the_expected_is_refused_before_its_body(peers, announced: int) -> None:  # type: ignore[no-untyped-def]
    """The body follows, endlessly: a client that read it would wait for its deadline (a timeout, not
    ``WrongLength``); one that buffered what was announced would take a terabyte."""

    def lie(peer: FakePeer, conn: socket.socket, request: bytes) -> None:
        peer.send(conn, b"VALUE %s 0 %d\r\n" % (KEY.encode(), announced))
        while not peer.stop.is_set():
            peer.send(conn, CHUNK)

    peer = peers(lie)
    wire = _wire(peer)
    tracemalloc.start()
    try:
        with pytest.raises(WrongLength):
            wire.get(KEY, 5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 1024  # a header's buffer, never the announced body


def test_values_of_another_length_never_leave_their_memcached_out(peers) -> None:  # type: ignore[no-untyped-def]
    """Anyone who reaches a memcached may store a value of any length at a key they can guess: each is refused
    (``WrongLength``: the cluster counts it as rejected), and the memcached, which answered as one, is still
    asked, however many there are; the next value of the right length is read on a new connection."""
    answers = [b"hello!", b"hello!", b"hello!", b"hello!", b"hello"]

    def planted(peer: FakePeer, conn: socket.socket, request: bytes) -> None:
        body = answers.pop(0)
        peer.send(conn, b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (KEY.encode(), len(body), body))

    peer = peers(planted)
    wire = _wire(peer)
    for _ in range(FAILURES_TO_SKIP + 1):
        with pytest.raises(WrongLength):
            wire.get(KEY, 5)
    assert wire.get(KEY, 5) == b"hello" and not answers


def test_the_reader_allocates_no_more_than_the_expected_size(peers) -> None:  # type: ignore[no-untyped-def]
    body = bytes(range(256)) * 4096  # 1 MiB
    peer = peers(_value(body))
    wire = _wire(peer)
    tracemalloc.start()
    try:
        assert wire.get(KEY, len(body)) == body
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(body) + 64 * 1024  # the value's own buffer, read into in place


@pytest.mark.parametrize("answer", [
    b"HELLO\r\n",
    b"ERROR\r\n",
    b"SERVER_ERROR busy\r\n",
    b"VALUE liquidfs2:other:5 0 5\r\nhello\r\nEND\r\n",  # another key's value
    b"VALUE " + KEY.encode() + b" 0 -5\r\nhello\r\nEND\r\n",
    b"VALUE " + KEY.encode() + b" 0 +5\r\nhello\r\nEND\r\n",
    b"VALUE " + KEY.encode() + b" x 5\r\nhello\r\nEND\r\n",
    b"VALUE " + KEY.encode() + b" 0 5 7\r\nhello\r\nEND\r\n",
    b"VALUE " + KEY.encode() + b" 0 5\r\nhelloEND\r\n\r\n",  # the body not where it ends
    b"VALUE " + KEY.encode() + b" 0 5\r\nhello\r\nEND\r\nVALUE",  # more than the answer
    b"VALUE " + KEY.encode() + b" 0 5\r\nhel",  # cut short: the connection closed
    b"x" * (MAX_LINE + 10) + b"\r\n",  # a line no memcached answers with
])
def test_an_answer_that_is_not_memcacheds_is_a_failure_never_a_value(peers, answer: bytes) -> None:  # type: ignore[no-untyped-def]
    def garbage(peer: FakePeer, conn: socket.socket, request: bytes) -> None:
        peer.send(conn, answer)
        if answer.endswith(b"hel"):
            conn.shutdown(socket.SHUT_WR)

    peer = peers(garbage)
    with pytest.raises(PeerError):
        _wire(peer).get(KEY, 5)


def test_a_peer_that_fails_repeatedly_is_left_out_for_a_while_then_tried_again(peers) -> None:  # type: ignore[no-untyped-def]
    good = _value(b"hello")
    state = {"answer": lambda p, conn, request: p.send(conn, b"HELLO\r\n")}
    peer = peers(lambda p, conn, request: state["answer"](p, conn, request))
    now = [100.0]
    wire = _wire(peer, clock=lambda: now[0])
    for _ in range(FAILURES_TO_SKIP):
        with pytest.raises(PeerError) as failed:
            wire.get(KEY, 5)
        assert not isinstance(failed.value, Skipped)
    connections = peer.connections
    for _ in range(5):
        with pytest.raises(Skipped):
            wire.get(KEY, 5)
        with pytest.raises(Skipped):
            wire.set(KEY, b"hello")
    assert peer.connections == connections and len(peer.requests) == FAILURES_TO_SKIP  # not even connected to
    now[0] += SKIP_FOR + 0.1
    state["answer"] = good  # answers again
    assert wire.get(KEY, 5) == b"hello"
    for _ in range(FAILURES_TO_SKIP - 1):  # the count starts again from nothing
        state["answer"] = lambda p, conn, request: p.send(conn, b"HELLO\r\n")
        with pytest.raises(PeerError) as failed:
            wire.get(KEY, 5)
        assert not isinstance(failed.value, Skipped)


def test_a_peer_that_answers_just_inside_its_deadline_is_left_out_for_a_while(peers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A memcached that answered every call just inside its deadline cost each open of its keys two deadlines (a
    fetch and a store), and was never left out. Its answers are used, and count as failures: after
    ``FAILURES_TO_SKIP`` of them it is left out as one that fails. (The answer's first byte is stamped as having
    come that late after the request: the time it took, on the wire's own clock, without a race of threads.)"""
    from liquidfs.held import memcached

    receive = memcached._Stream._recv_into

    def late(stream: memcached._Stream, view: memoryview) -> int:
        first = not stream.received
        got = receive(stream, view)
        if first and stream.sent_at is not None:
            stream.answered_at = stream.sent_at + DEADLINE * (SLOW_SHARE + 0.1)
        return got

    monkeypatch.setattr(memcached._Stream, "_recv_into", late)
    wire = _wire(peers(_value(b"hello")))
    for _ in range(FAILURES_TO_SKIP):
        assert wire.get(KEY, 5) == b"hello"
    with pytest.raises(Skipped):
        wire.get(KEY, 5)


def test_a_dead_peer_is_a_failure_and_an_idle_connection_it_dropped_is_not(peers) -> None:  # type: ignore[no-untyped-def]
    def once(peer: FakePeer, conn: socket.socket, request: bytes) -> None:
        _value(b"hello")(peer, conn, request)
        conn.shutdown(socket.SHUT_RDWR)  # then gone, as a restarted memcached's connections are

    peer = peers(once)
    wire = _wire(peer)
    for _ in range(FAILURES_TO_SKIP + 2):
        assert wire.get(KEY, 5) == b"hello"  # each time on a new connection, no failure counted
    assert peer.connections == FAILURES_TO_SKIP + 2
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    dead = MemcachedWire([("127.0.0.1", port)], timeout=DEADLINE)
    with pytest.raises(PeerError):
        dead.get(KEY, 5)
    dead.close()


def test_a_store_too_large_for_the_memcached_is_not_its_fault(peers) -> None:  # type: ignore[no-untyped-def]
    peer = peers(lambda p, conn, request: p.send(conn, b"SERVER_ERROR object too large for cache\r\n"))
    wire = _wire(peer)
    for _ in range(FAILURES_TO_SKIP + 1):
        assert wire.set(KEY, b"hello") is None  # too large: a lasting refusal, said apart from "for now"
    assert peer.connections == 1


def test_keys_memcached_would_not_take_are_never_sent() -> None:
    wire = MemcachedWire([("127.0.0.1", 1)])
    for key in ("a b", "a\r\nflush_all", "", "x" * 251, "é"):
        with pytest.raises(ValueError):
            wire.get(key, 5)


def test_a_store_sends_its_header_value_and_end_in_order_whatever_the_socket_takes_at_once() -> None:
    """A value is sent beside its header (no joined copy of a sealed object): parts larger than the socket's
    buffer, sent in pieces, reach the peer whole and in order."""
    from liquidfs.held.memcached import _Stream

    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    value = bytes(range(256)) * 12_000  # ~3 MB, many times the buffer
    received = bytearray()

    def read_all() -> None:
        while chunk := theirs.recv(65536):
            received.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    try:
        _Stream(ours, time.monotonic() + 30, time.monotonic).send(b"set k 0 0 %d\r\n" % len(value),
                                                                   memoryview(value), b"", b"\r\n")
    finally:
        ours.close()
        reader.join(30)
        theirs.close()
    assert bytes(received) == b"set k 0 0 %d\r\n" % len(value) + value + b"\r\n"


def test_a_peer_that_sends_a_byte_at_once_and_the_rest_of_its_answer_late_is_slow(peers) -> None:  # type: ignore[no-untyped-def]
    """The slow rule timed the answer's first byte: 'E' at once and 'ND' just inside the deadline was never slow,
    and such a peer cost each open of its keys a deadline for good. Its first line whole is what is timed."""
    def trickled(peer: FakePeer, conn: socket.socket, request: bytes) -> None:
        peer.send(conn, b"E")
        time.sleep(SLOW_SHARE + 0.2)  # of the wire's 1 s
        peer.send(conn, b"ND\r\n")

    peer = peers(trickled)
    # a deadline of its own: the rest of the line comes at 70 % of it, 0.3 s before it ends (a loaded machine's
    # threads late by a few tens of milliseconds must not make the answer a timeout)
    wire = MemcachedWire([("127.0.0.1", peer.port)], timeout=1.0)
    peer.wires.append(wire)
    for _ in range(FAILURES_TO_SKIP):
        assert wire.get(KEY, 5) is None  # answered (a miss), used, and slow
    with pytest.raises(Skipped):
        wire.get(KEY, 5)


def test_a_planted_value_between_failures_does_not_clear_them(peers) -> None:  # type: ignore[no-untyped-def]
    """Anyone may store a value of another length at a guessable key: one fetched between a peer's failures is
    no answer of a working peer, and the peer that keeps failing is left out all the same."""
    answers = [b"HELLO\r\n", b"VALUE %s 0 6\r\nhello!\r\nEND\r\n" % KEY.encode(), b"HELLO\r\n", b"HELLO\r\n"]
    peer = peers(lambda p, conn, request: p.send(conn, answers.pop(0)))
    wire = _wire(peer)
    with pytest.raises(PeerError):
        wire.get(KEY, 5)
    with pytest.raises(WrongLength):
        wire.get(KEY, 5)
    for _ in range(FAILURES_TO_SKIP - 1):
        with pytest.raises(PeerError) as failed:
            wire.get(KEY, 5)
        assert not isinstance(failed.value, Skipped)
    with pytest.raises(Skipped):
        wire.get(KEY, 5)


def test_this_node_out_of_descriptors_is_no_failure_of_the_peer(peers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import errno

    from liquidfs.held import memcached

    wire = _wire(peers(_value(b"hello")))
    monkeypatch.setattr(memcached.socket, "create_connection",
                        lambda *a, **kw: (_ for _ in ()).throw(OSError(errno.EMFILE, "Too many open files")))
    for _ in range(FAILURES_TO_SKIP + 1):
        with pytest.raises(PeerError, match="Too many open files") as failed:
            wire.get(KEY, 5)
        assert not isinstance(failed.value, Skipped)
    monkeypatch.undo()
    assert wire.get(KEY, 5) == b"hello"


def test_a_forked_child_keeps_no_copy_of_the_parents_idle_connections(peers) -> None:  # type: ignore[no-untyped-def]
    """Each loop of --loops is a fork that builds a wire of its own: a copy of the parent's idle connection in it
    kept the connection open after the parent closed it, and a descriptor it never uses."""
    import os

    peer = peers(_value(b"hello"))
    wire = _wire(peer)
    assert wire.get(KEY, 5) == b"hello"
    (idle,) = next(iter(wire.clients.values()))._idle
    pid = os.fork()
    if pid == 0:  # the child: its copy closed at the fork (a closed socket's fileno() is -1)
        os._exit(0 if idle.fileno() == -1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert wire.get(KEY, 5) == b"hello" and peer.connections == 1  # the parent's own, still in use
