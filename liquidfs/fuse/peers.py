"""A mount's other loops (``mount --loops N``), as one loop sees them: whose each file handle is, and the requests
that reach this loop for another's handle, forwarded there.

The kernel hands each request to whichever loop reads the FUSE device first, so the RELEASE of a file opened in
one loop, or a READ of it that still reaches the daemon, may arrive in another. A handle's low bits name the loop
that made it (``fh_of``); such a request is sent to that loop, which answers it as its own: a RELEASE at once
(nothing is said back to the kernel but that it was done), a READ with its bytes or errno sent back, and the
statistics the control file shows are gathered from every loop.

Each loop reads one end of a ``SOCK_SEQPACKET`` socket pair made before the fork; every loop holds the other
ends, to send to it. Nothing else holds them: no name, no address, nothing another user could reach.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

log = logging.getLogger(__name__)

#: A handle's low bits name its loop (``shared_inodes.MAX_LOOPS`` loops at most).
LOOP_BITS = 5
#: Socket buffers asked for: a forwarded READ's answer travels in one message, so a READ larger than what the
#: buffer granted (``net.core.wmem_max`` caps it without CAP_NET_ADMIN) is asked for in parts (``Peers.read``).
_BUFFER = (4 << 20) + 4096
_SO_SNDBUFFORCE, _SO_RCVBUFFORCE = 32, 33  # <asm-generic/socket.h>; not in the socket module
#: Seconds a forwarded READ or a loop's statistics are waited for before the request fails (EIO) or the loop is
#: left out: a loop that does not answer in this long is stuck or gone.
ANSWER_TIMEOUT = 30.0
STATS_TIMEOUT = 2.0

_RELEASE, _READ, _STATS, _ANSWER = b"R", b"D", b"S", b"A"
_FH = struct.Struct("<q")
_ASK = struct.Struct("<qBqqI")  # request id, from loop, fh, offset, size
_ASK_STATS = struct.Struct("<qB")  # request id, from loop
_REPLY = struct.Struct("<qi")  # request id, errno (0: the payload follows)


def fh_of(local: int, loop: int) -> int:
    return local << LOOP_BITS | loop


def loop_of(fh: int) -> int:
    return fh & ((1 << LOOP_BITS) - 1)


class PeerError(OSError):
    pass


@dataclass
class _Waiting:
    done: trio.Event = field(default_factory=trio.Event)
    error: int = 0
    payload: bytes = b""


class Served(Protocol):
    """What a loop answers for the others (``fuse.operations.Operations``): a release, a read (its bytes, or an
    error with the errno to answer), its statistics."""

    async def release(self, fh: Any) -> None: ...

    async def read(self, fh: Any, off: int, size: int) -> Any: ...

    def statistics(self) -> dict[str, Any]: ...


class Peers:
    """Loop ``index`` of ``count``'s ends of the sockets between the loops (``Peers.made`` before the fork, then
    ``Peers.mine`` in each loop)."""

    def __init__(self, pairs: list[tuple[socket.socket, socket.socket]], index: int,
                 first_pid: int | None = None) -> None:
        self.count = len(pairs)
        self.index = index
        #: The first loop's pid: the mount's daemon, which the control file names in every loop (``umount`` waits
        #: for it), whichever loop answers.
        self.first_pid = os.getpid() if first_pid is None else first_pid
        self._send = [pair[0] for pair in pairs]
        self._room = [trio.Lock() for _ in pairs]  # one waiter for room at a time on each socket (``_put``)
        self._receive = pairs[index][1]
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[int, _Waiting]] = {}
        self._gone: set[int] = set()
        # The largest answer one message carries: a quarter of the send buffer granted (the kernel counts its own
        # overhead against it), never less than a page.
        self.max_answer = max(4096, min(s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for s in self._send) // 4)
        self.forwarded = 0  # requests sent to another loop
        self.answered = 0   # requests answered for another loop

    @staticmethod
    def made(count: int) -> list[tuple[socket.socket, socket.socket]]:
        """One socket pair per loop, before the fork: end 0 sends to it, end 1 is its to read."""
        pairs = []
        for _ in range(count):
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            for sock in (a, b):
                sock.setblocking(False)
                for forced, option in ((_SO_SNDBUFFORCE, socket.SO_SNDBUF), (_SO_RCVBUFFORCE, socket.SO_RCVBUF)):
                    try:  # past net.core.[rw]mem_max where CAP_NET_ADMIN allows it, else up to it
                        sock.setsockopt(socket.SOL_SOCKET, forced, _BUFFER)
                    except OSError:
                        sock.setsockopt(socket.SOL_SOCKET, option, _BUFFER)
            pairs.append((a, b))
        return pairs

    @staticmethod
    def close_pairs(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
        """Every end of ``pairs`` closed (what ``made`` made, where no loop was forked from it: tests)."""
        for pair in pairs:
            for sock in pair:
                sock.close()

    @classmethod
    def mine(cls, pairs: list[tuple[socket.socket, socket.socket]], index: int) -> Peers:
        """Loop ``index``'s view after the fork (in the child itself: its parent is the first loop): the other
        loops' reading ends closed here."""
        for i, (_, receive) in enumerate(pairs):
            if i != index:
                receive.close()
        return cls(pairs, index, os.getpid() if index == 0 else os.getppid())

    def owner(self, fh: int) -> int | None:
        """The loop that made ``fh`` where it is another than this one."""
        loop = loop_of(fh)
        return None if loop == self.index or loop >= self.count else loop

    # -- asking the others ---------------------------------------------------------------------------------

    async def release(self, fh: int) -> None:
        loop = self.owner(fh)
        if loop is None or loop in self._gone:
            return  # a gone loop's backings were reaped with it
        try:
            await self._put(loop, _RELEASE + _FH.pack(fh))
        except PeerError as exc:  # nothing to answer the kernel but done: the backing stays until the loop goes
            log.warning("release of a file of loop %d not forwarded: %s", loop, exc.strerror)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of ``fh`` as its loop reads them, asked for in parts no larger than one
        message carries; fewer only at the end of the file (a short READ is the end of the file to the kernel)."""
        parts: list[bytes] = []
        done = 0
        while done < size:
            want = min(size - done, self.max_answer)
            part = await self._read_part(fh, offset + done, want)
            parts.append(part)
            done += len(part)
            if len(part) < want:
                break
        return b"".join(parts)

    async def _read_part(self, fh: int, offset: int, size: int) -> bytes:
        loop = self.owner(fh)
        if loop is None or loop in self._gone:
            raise PeerError(errno.EIO, "the loop that opened it is gone")
        return await self._request(loop, lambda ask_id: _READ + _ASK.pack(ask_id, self.index, fh, offset, size),
                                   ANSWER_TIMEOUT)

    async def statistics(self) -> list[dict[str, Any]]:
        """Every other loop's statistics that came within ``STATS_TIMEOUT``."""
        found: list[dict[str, Any]] = []

        async def one(loop: int) -> None:
            try:
                found.append(json.loads(await self._request(
                    loop, lambda ask_id: _STATS + _ASK_STATS.pack(ask_id, self.index), STATS_TIMEOUT)))
            except (OSError, ValueError) as exc:
                log.debug("loop %d's statistics: %s", loop, exc)

        async with trio.open_nursery() as nursery:
            for loop in range(self.count):
                if loop != self.index and loop not in self._gone:
                    nursery.start_soon(one, loop)
        return found

    async def _request(self, loop: int, message: Callable[[int], bytes], timeout: float) -> bytes:
        """``message`` (made for its ask id) sent to ``loop``, and its answer, within ``timeout`` in all (the send's
        wait for room too: a stuck loop's full socket held the statistics of every control-file open for the
        send's own 30 s on top of their 2). Waited for from before the send (an answer may come before the send
        returns), and no longer once it fails or is answered: a send that failed left its entry for good."""
        ask_id, waiting = next(self._ids), _Waiting()
        self._waiting[ask_id] = (loop, waiting)
        try:
            with trio.move_on_after(timeout):
                await self._put(loop, message(ask_id))
                await waiting.done.wait()
        finally:
            self._waiting.pop(ask_id, None)
        if not waiting.done.is_set():
            raise PeerError(errno.EIO, "the loop that opened it did not answer")
        if waiting.error:
            raise PeerError(waiting.error, os.strerror(waiting.error))
        return waiting.payload

    async def _put(self, loop: int, message: bytes) -> None:
        """Send ``message`` to ``loop``, waiting at most ``ANSWER_TIMEOUT`` for room: a loop stuck so long that
        its socket stays full must not take this loop's tasks with it (a release lost leaks one backing; a dead
        mount is worse). Any failure is a ``PeerError``.

        Every task of this loop sends to ``loop`` on one socket, and trio lets one task at a time wait for a
        socket's room (a second raises ``BusyResourceError``): those that find it full wait their turn on
        ``loop``'s lock, and later ones queue behind them. Most sends find room at once, nobody waiting, and take
        no lock (no checkpoint either)."""
        sock = self._send[loop]
        room = self._room[loop]
        with trio.move_on_after(ANSWER_TIMEOUT):
            # (not ahead of one waiting for room: under load it would wait its whole timeout, its release lost)
            if not room.locked() and self._sent(loop, sock, message):
                return
            async with room:
                while not self._sent(loop, sock, message):
                    await trio.lowlevel.wait_writable(sock)
                return
        log.warning("loop %d took no request for %.0f s: one left unsent", loop, ANSWER_TIMEOUT)
        raise PeerError(errno.EIO, f"loop {loop} does not take requests")

    def _sent(self, loop: int, sock: socket.socket, message: bytes) -> bool:
        """``message`` sent to ``loop`` now; False where its socket has no room for it."""
        try:
            sock.send(message)
        except BlockingIOError:
            return False
        except (BrokenPipeError, ConnectionError) as exc:
            self.gone(loop)
            raise PeerError(errno.EIO, f"loop {loop} is gone") from exc
        except OSError as exc:  # EMSGSIZE and the like: this request cannot be sent
            raise PeerError(exc.errno or errno.EIO, f"to loop {loop}: {exc.strerror}") from exc
        self.forwarded += 1
        return True

    @property
    def gone_loops(self) -> frozenset[int]:
        """The loops that ended (``gone``)."""
        return frozenset(self._gone)

    def gone(self, loop: int) -> None:
        """``loop`` ended: what waits for it fails, and nothing is sent to it again."""
        self._gone.add(loop)
        for _, (owner, waiting) in list(self._waiting.items()):
            if owner == loop and not waiting.done.is_set():
                waiting.error = errno.EIO
                waiting.done.set()

    # -- answering them --------------------------------------------------------------------------------

    async def serve(self, served: Served) -> None:
        """Answer the other loops' requests for this loop's handles until cancelled."""
        buffer = bytearray(_BUFFER)
        async with trio.open_nursery() as nursery:
            while True:
                await trio.lowlevel.wait_readable(self._receive)
                while True:
                    try:
                        length = self._receive.recv_into(buffer)
                    except BlockingIOError:
                        break
                    except OSError as exc:  # never seen; the loop itself goes on serving the kernel
                        log.error("the socket from the other loops failed (%s): their requests for this loop's "
                                  "files are no longer answered", exc)
                        return
                    if not length:
                        return
                    message = bytes(buffer[:length])
                    kind, body = message[:1], message[1:]
                    try:
                        if kind == _RELEASE:
                            nursery.start_soon(self._release, served, _FH.unpack(body)[0])
                        elif kind == _READ:
                            nursery.start_soon(self._read, served, *_ASK.unpack(body))
                        elif kind == _STATS:
                            nursery.start_soon(self._stats, served, *_ASK_STATS.unpack(body))
                        elif kind == _ANSWER:
                            self._answered(body)
                        else:
                            log.warning("a message of unknown kind %r from another loop", kind)
                    except struct.error:
                        log.warning("a malformed message of kind %r from another loop", kind)

    async def _release(self, served: Served, fh: int) -> None:
        self.answered += 1
        try:
            await served.release(fh)
        except Exception as exc:  # the handler logged it (a FUSEError): nothing to tell anyone
            log.debug("release of %d for another loop: %r", fh, exc)

    async def _read(self, served: Served, ask_id: int, loop: int, fh: int, offset: int, size: int) -> None:
        self.answered += 1
        try:
            data = await served.read(fh, offset, min(size, self.max_answer))
            reply = _REPLY.pack(ask_id, 0) + bytes(data)
        except OSError as exc:
            reply = _REPLY.pack(ask_id, exc.errno or errno.EIO)
        except Exception as exc:  # pyfuse3.FUSEError: its errno
            reply = _REPLY.pack(ask_id, getattr(exc, "errno", errno.EIO) or errno.EIO)
        if not await self._reply(loop, reply) and len(reply) > _REPLY.size:
            await self._reply(loop, _REPLY.pack(ask_id, errno.EIO))  # the bytes could not go: an error can

    async def _stats(self, served: Served, ask_id: int, loop: int) -> None:
        self.answered += 1
        try:
            reply = _REPLY.pack(ask_id, 0) + json.dumps(served.statistics()).encode()
        except Exception:  # a counter that cannot be written: said here, the asker leaves this loop out
            log.exception("statistics for another loop")
            reply = _REPLY.pack(ask_id, errno.EIO)
        await self._reply(loop, reply)  # one that cannot go: the asker's wait ends in its timeout

    async def _reply(self, loop: int, reply: bytes) -> bool:
        if loop >= self.count or loop in self._gone:
            return False
        try:
            await self._put(loop, _ANSWER + reply)
            return True
        except PeerError as exc:
            log.debug("answer to loop %d: %s", loop, exc)
            return False

    def _answered(self, body: bytes) -> None:
        ask_id, error = _REPLY.unpack_from(body)
        entry = self._waiting.get(ask_id)
        if entry is None:
            return  # timed out meanwhile
        waiting = entry[1]
        waiting.error, waiting.payload = error, body[_REPLY.size:]
        waiting.done.set()


def merged(values: list[dict[str, Any]]) -> dict[str, Any]:
    """The statistics of every loop as one: counters summed, anything else (names, states, the dataset's totals)
    as the first loop (``loop`` 0) has it, whichever loop answered (every loop names the mount's daemon as
    ``pid``); each loop's own pid (``loop_pid``) and opens under ``loops``, in order."""
    values = sorted(values, key=lambda v: v.get("loop", 0))
    first = dict(values[0])
    for other in values[1:]:
        _add(first, other)
    first["loops"] = [{"loop": v.get("loop", 0), "pid": v.get("loop_pid", v.get("pid")), "opens": v.get("opens")}
                      for v in values]
    return first


#: Keys whose values are the mount's or the dataset's, not a loop's count (``share`` and ``prepared``: the mix's,
#: the same in every loop).
_NOT_SUMMED = frozenset({"pid", "started_at", "files", "dataset_bytes", "loops", "loop", "loop_pid", "share",
                         "prepared"})


def plus(values: dict[str, Any], counts: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``counts`` added to the counters it has (the loops that ended: ``metrics.defs.counters``)."""
    if not counts:
        return values
    total = dict(values)
    _add(total, counts)
    return total


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        mine = into.get(key)
        if key in _NOT_SUMMED:
            continue
        if isinstance(mine, dict) and isinstance(value, dict):
            into[key] = dict(mine)
            _add(into[key], value)
        elif isinstance(mine, (int, float)) and not isinstance(mine, bool) \
                and isinstance(value, (int, float)) and not isinstance(value, bool):
            into[key] = mine + value
