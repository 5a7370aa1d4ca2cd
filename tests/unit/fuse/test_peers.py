"""``fuse.peers``: a request for another loop's handle reaches that loop over the sockets made before the fork."""

from __future__ import annotations

import errno
import socket
import struct
from typing import Any

import pytest
import trio
import trio.testing

from liquidfs.fuse.peers import PeerError, Peers, fh_of, loop_of, merged, plus


class Loop:
    """What a loop answers (``Operations`` in a mount)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.released: list[int] = []

    async def release(self, fh: int) -> None:
        self.released.append(fh)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        if off < 0:
            raise OSError(errno.EINVAL, "no")
        return (self.name.encode() * size)[:size]

    def statistics(self) -> dict[str, Any]:
        return {"pid": self.name, "opens": 3, "files": 10, "requests": {"open": {"count": 2}}, "data_path": "x"}


def test_a_handle_names_its_loop() -> None:
    assert loop_of(fh_of(12345, 7)) == 7 and fh_of(1, 0) != fh_of(1, 1)


def test_release_read_and_statistics_reach_the_loop_that_opened() -> None:
    pairs = Peers.made(3)
    peers = [Peers(pairs, i) for i in range(3)]
    loops = [Loop(f"L{i}") for i in range(3)]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for p, loop in zip(peers, loops):
                nursery.start_soon(p.serve, loop)
            fh = fh_of(9, 2)
            assert peers[2].owner(fh) is None and peers[0].owner(fh) == 2
            await peers[0].release(fh)
            assert await peers[1].read(fh, 0, 5) == b"L2L2L"
            with pytest.raises(PeerError) as failed:
                await peers[1].read(fh, -1, 5)
            assert failed.value.errno == errno.EINVAL
            big = await peers[0].read(fh_of(1, 1), 0, 1 << 20)  # a whole 1 MiB read in one message
            assert len(big) == 1 << 20
            found = await peers[0].statistics()
            assert sorted(s["pid"] for s in found) == ["L1", "L2"]
            await trio.sleep(0.05)
            assert loops[2].released == [fh]
            peers[0].gone(2)
            with pytest.raises(PeerError):
                await peers[0].read(fh, 0, 1)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)


def test_merged_statistics_sum_counters_and_keep_the_first_loops_own() -> None:
    a, b = Loop("a").statistics(), Loop("b").statistics()
    a["loop"], b["loop"] = 0, 1
    values = merged([b, a])  # answered by loop 1: the pid is still the first loop's (the mount's daemon)
    assert values["opens"] == 6 and values["requests"]["open"]["count"] == 4
    assert values["files"] == 10 and values["pid"] == "a" and values["data_path"] == "x" and values["loop"] == 0
    assert values["loops"] == [{"loop": 0, "pid": "a", "opens": 3}, {"loop": 1, "pid": "b", "opens": 3}]
    # a fixed mix: its counts summed, its share (the same in every loop) as it is
    for value in (a, b):
        value["mix"] = {"mode": "fixed", "share": 0.5, "prepared": 1.0, "opens_raw": 2, "opens_original": 1}
    values = merged([a, b])
    assert values["mix"] == {"mode": "fixed", "share": 0.5, "prepared": 1.0, "opens_raw": 4, "opens_original": 2}


def test_a_read_larger_than_a_message_is_asked_for_in_parts() -> None:
    """Where the socket buffers granted are small (net.core.wmem_max without CAP_NET_ADMIN), a forwarded READ
    still comes back whole: in parts, never cut short (a short READ is the end of the file to the kernel)."""
    import socket

    pairs = Peers.made(2)
    for pair in pairs:
        for sock in pair:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    peers = [Peers(pairs, i) for i in range(2)]
    assert peers[0].max_answer < 1 << 20

    class Counting(Loop):
        async def read(self, fh: int, off: int, size: int) -> bytes:
            return bytes((off + i) % 251 for i in range(min(size, 3_000_000 - off)))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peers[0].serve, Loop("L0"))  # where the answers come back
            nursery.start_soon(peers[1].serve, Counting("L1"))
            got = await peers[0].read(fh_of(5, 1), 1000, 1 << 20)
            assert got == bytes((1000 + i) % 251 for i in range(1 << 20))
            tail = await peers[0].read(fh_of(5, 1), 3_000_000 - 10, 1 << 20)  # the file's end: what there is
            assert len(tail) == 10
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)


def test_a_request_whose_send_fails_leaves_nothing_waiting() -> None:
    """A send that fails (a stuck loop's full socket past its timeout, a broken pipe) is no request waited for:
    its entry went with it, not one more every read and every statistics gathering for as long as the mount lives."""
    pairs = Peers.made(2)
    peers = Peers(pairs, 0)

    async def failing(loop: int, message: bytes) -> None:
        raise PeerError(errno.EIO, "the loop's socket stayed full")

    peers._put = failing  # type: ignore[method-assign]

    async def main() -> None:
        for _ in range(3):
            with pytest.raises(PeerError):
                await peers.read(fh_of(1, 1), 0, 10)
        assert await peers.statistics() == []

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)
    assert peers._waiting == {}


def _filled(sock: socket.socket) -> int:
    """``sock`` sent to until it has no room: how many messages that took."""
    sent = 0
    try:
        while True:
            sock.send(b"x" * 4096)
            sent += 1
    except BlockingIOError:
        return sent


def test_releases_that_find_a_loops_socket_full_all_reach_it_once_it_has_room() -> None:
    """Every task of a loop sends to another on one socket; trio lets one task at a time wait for its room. Two
    releases that both found it full each got there: without their turn, the second raised BusyResourceError,
    a release lost (its backing leaked), and an answer's the same way ended the loop that sent it."""
    pairs = Peers.made(2)
    peers = Peers(pairs, 0)
    full = _filled(pairs[1][0])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for local in (1, 2, 3):
                nursery.start_soon(peers.release, fh_of(local, 1))
            await trio.sleep(0.05)  # each found the socket full and waits
            assert peers.forwarded == 0
            for _ in range(full):  # loop 1 reads what filled it
                pairs[1][1].recv(1 << 16)
        got = []
        while True:
            try:
                got.append(pairs[1][1].recv(1 << 16))
            except BlockingIOError:
                break
        assert sorted(got) == sorted(b"R" + struct.pack("<q", fh_of(local, 1)) for local in (1, 2, 3))

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)
    assert peers.forwarded == 3


def test_a_send_never_overtakes_one_waiting_for_room() -> None:
    """Under load a new send found room first, every time some was made, and the one waiting for room waited its
    whole timeout (its release lost). One that finds a send waiting queues behind it."""
    pairs = Peers.made(2)
    peers = Peers(pairs, 0)
    full = _filled(pairs[1][0])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peers.release, fh_of(1, 1))
            await trio.testing.wait_all_tasks_blocked()  # it waits for room, holding its turn
            for _ in range(full):  # room now
                pairs[1][1].recv(1 << 16)
            await peers.release(fh_of(2, 1))  # at once, before the waiting one is woken
        got = [pairs[1][1].recv(1 << 16) for _ in range(2)]
        assert got == [b"R" + struct.pack("<q", fh_of(local, 1)) for local in (1, 2)]

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)


def test_a_loop_slow_to_answer_keeps_its_share_of_the_metrics() -> None:
    """A loop that did not answer within the gathering's timeout (busy) was left out of that gathering: every
    counter's total dipped, which a scraper takes for a reset. It keeps its last statistics; one gone is left
    out."""
    from types import SimpleNamespace

    from liquidfs.fuse.operations import Operations

    answers = [[{"loop": 1, "opens": 5, "open_files": 3}, {"loop": 2, "opens": 7}], [{"loop": 2, "opens": 8}], []]
    gone: set[int] = set()
    seen: list[list[dict[str, Any]]] = []

    async def statistics() -> list[dict[str, Any]]:
        return answers.pop(0) if answers else []

    ops = SimpleNamespace(peers=SimpleNamespace(statistics=statistics, gone_loops=gone), other_loops=[],
                          ended_loops={})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Operations.gather_loops, ops, 0.01)
            for expected in ([5, 7], [5, 8]):
                with trio.fail_after(5):
                    while [v["opens"] for v in ops.other_loops] != expected:
                        await trio.sleep(0.001)
                seen.append(list(ops.other_loops))
            gone.add(1)
            with trio.fail_after(5):
                while [v["opens"] for v in ops.other_loops] != [8]:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert [[v["loop"] for v in each] for each in seen] == [[1, 2], [1, 2]]
    # The loop gone leaves its counters in the totals (no exported counter goes down), not its gauges
    assert ops.ended_loops == {"opens": 5}
    totals = plus(merged([{"loop": 0, "opens": 1, "open_files": 1}, *ops.other_loops]), ops.ended_loops)
    assert totals["opens"] == 1 + 8 + 5 and totals["open_files"] == 1


def test_statistics_of_a_loop_whose_socket_stays_full_wait_only_their_own_timeout() -> None:
    """A stuck loop's full socket: the send waited its own 30 s before the 2 s of the answer's wait began, so
    every control-file open (``liquidfs stats``, ``umount``'s pid lookup) and every gathering waited ~32 s. The
    statistics' timeout bounds the send too (trio's clock, jumped: no wall-clock time)."""
    from liquidfs.fuse import peers as peers_module

    pairs = Peers.made(2)
    peers = Peers(pairs, 0)
    _filled(pairs[1][0])

    async def main() -> float:
        started = trio.current_time()
        assert await peers.statistics() == []
        return trio.current_time() - started

    try:
        took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        Peers.close_pairs(pairs)
    assert took == pytest.approx(peers_module.STATS_TIMEOUT) and took < peers_module.ANSWER_TIMEOUT
    assert peers._waiting == {}
