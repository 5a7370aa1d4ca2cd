"""Storage calls from the trio loop (``datapath.storage_calls``): opens that wait for storage wait side by side, not
behind one another or behind the reads' few threads; the thread hop itself."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pyfuse3
import pytest
import trio

from liquidfs.catalog.catalog import Catalog
from liquidfs.datapath import passthrough
from liquidfs.datapath.limits import OPEN_THREADS
from liquidfs.datapath.storage_calls import in_thread
from liquidfs.prepare import prepare
from liquidfs.stores.local.reader import StoreReader
from operations import FakeKernel, daemon_operations, passthrough_operations
from sample import make_sample


CTX = pyfuse3.RequestContext()
#: Opens at once, as many as a GPU node's loader workers (issue 40: 12 to 16).
READERS = 16


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("opens")
    make_sample(root / "data", count=READERS, width=32, height=24, seed=40)
    prepare(root / "data", root / "store", 1.0, progress=False)
    return root / "store"


class Together:
    """A storage call that returns only once ``READERS`` of them are in their worker threads at the same time:
    were opens serialized behind fewer threads (the reads' four, as before issue 40), the barrier breaks after its
    timeout and the opens fail. A disk's latency, 16 metadata reads in flight, stands in for the wait."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(READERS, timeout=20)
        self.calls = 0

    def wrap(self, real):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            if kwargs.get("cached_only"):
                raise BlockingIOError(11, "cold: not in the kernel's caches")  # as a cold dentry says
            self.calls += 1
            self.barrier.wait()
            return real(*args, **kwargs)
        return call


def _open_all_at_once(ops, nodes) -> list[pyfuse3.FileInfo]:  # type: ignore[no-untyped-def]
    opened: list[pyfuse3.FileInfo] = []

    async def main() -> None:
        async def open_one(node) -> None:  # type: ignore[no-untyped-def]
            opened.append(await ops.open(node.id, os.O_RDONLY, CTX))
        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(open_one, node)
        for info in opened:
            await ops.release(info.fh)

    trio.run(main)
    return opened


def test_cold_passthrough_opens_wait_for_storage_side_by_side(prepared: Path, monkeypatch) -> None:
    together = Together()
    monkeypatch.setattr(passthrough, "vouched", together.wrap(passthrough.vouched))
    monkeypatch.setattr(passthrough, "resolve", together.wrap(passthrough.resolve))
    catalog = Catalog.open(prepared, readonly=True)
    ops = passthrough_operations(catalog, StoreReader(catalog.source, prepared), FakeKernel())
    nodes = [n for n in catalog.files() if n.object]
    assert len(nodes) == READERS <= OPEN_THREADS
    assert len(_open_all_at_once(ops, nodes)) == READERS
    assert together.calls == READERS and not together.barrier.broken
    assert ops.stats.cold_opens == READERS and ops.stats.passthrough_opens == READERS


def test_cold_daemon_path_opens_wait_for_storage_side_by_side(prepared: Path) -> None:
    together = Together()
    catalog = Catalog.open(prepared, readonly=True)
    reader = StoreReader(catalog.source, prepared)
    reader.vouch = together.wrap(reader.vouch)  # type: ignore[method-assign]
    ops = daemon_operations(catalog, reader)
    nodes = [n for n in catalog.files() if n.object]
    assert len(_open_all_at_once(ops, nodes)) == READERS
    assert together.calls == READERS and not together.barrier.broken


def test_the_reads_keep_their_own_few_threads(prepared: Path) -> None:
    """Opens have a pool of their own: the reads' ``--threads`` stays what the user set."""
    catalog = Catalog.open(prepared, readonly=True)
    ops = daemon_operations(catalog, StoreReader(catalog.source, prepared), threads=3, open_threads=5)
    assert ops.calls.thread_limiter.total_tokens == 3 and ops.calls.open_limiter.total_tokens == 5


def test_the_hop_returns_raises_and_abandons_on_cancel() -> None:
    release = threading.Event()
    finished = threading.Event()

    def stuck() -> None:
        release.wait(10)
        finished.set()

    def fail() -> None:
        raise OSError(5, "boom")

    async def main() -> None:
        assert await in_thread(lambda: threading.get_ident()) != threading.get_ident()
        with pytest.raises(OSError, match="boom"):
            await in_thread(fail)
        with trio.move_on_after(0.05) as scope:
            await in_thread(stuck)  # cancelled: the caller goes on while the thread is still in it
        assert scope.cancelled_caught and not finished.is_set()
        release.set()
        await trio.to_thread.run_sync(finished.wait, 10)
        await trio.sleep(0.01)  # its late answer reaches the loop and is dropped, not delivered to this task

    trio.run(main)


class _Descriptor:
    """What a storage call hands back that holds a resource (a ``Backing``'s descriptor, a memfd)."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_what_a_call_returns_after_its_timeout_is_closed_not_leaked(prepared: Path) -> None:
    """An open's storage call answers past ``--io-timeout`` (a stalled NFS server that recovers): the open failed
    with EIO long before, and the descriptor the call returns at last is closed, not left open for good."""
    catalog = Catalog.open(prepared, readonly=True)
    ops = daemon_operations(catalog, StoreReader(catalog.source, prepared))
    ops.calls.io_timeout = 0.05
    node = next(iter(catalog.files()))
    release = threading.Event()
    late = _Descriptor()

    def stalled() -> _Descriptor:
        release.wait(10)
        return late

    async def main() -> None:
        with pytest.raises(OSError, match="did not answer"):
            await ops.calls.run(node, stalled, for_open=True)
        release.set()
        await trio.to_thread.run_sync(late.closed.wait, 10)
        answered = _Descriptor()
        assert await ops.calls.run(node, lambda: answered) is answered and not answered.closed.is_set()

    trio.run(main)
    assert late.closed.is_set()


def test_what_an_abandoned_call_returns_is_closed_off_the_loop() -> None:
    """The close of a late answer (a source's descriptor on a FUSE or NFS server that stopped answering, the
    reason it was abandoned) ran on the loop: every request of the mount waited for it."""
    loop_thread = threading.get_ident()
    closed_in: list[int] = []

    class Late:
        def close(self) -> None:
            closed_in.append(threading.get_ident())

    release = threading.Event()

    def stalled() -> Late:
        release.wait(10)
        return Late()

    async def main() -> None:
        with trio.move_on_after(0.05):
            await in_thread(stalled, lambda value: value.close())
        release.set()
        for _ in range(500):  # (a bound, not a measure)
            if closed_in:
                break
            await trio.sleep(0.01)

    trio.run(main)
    assert closed_in and closed_in[0] != loop_thread


def test_calls_queued_behind_stuck_ones_never_park_threads_past_max_stuck(prepared: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage hangs with many more calls in flight than threads: the queued ones passed the stuck checks before
    a slot was theirs, then each parked one more thread on the hung storage when those ahead timed out (384
    threads for 384 opens). Checked again once a slot is had: threads stuck stay at MAX_STUCK."""
    from liquidfs.datapath import storage_calls

    monkeypatch.setattr(storage_calls, "MAX_STUCK", 4)
    catalog = Catalog.open(prepared, readonly=True)
    ops = daemon_operations(catalog, StoreReader(catalog.source, prepared))
    calls = storage_calls.StorageCalls(ops.calls.reader, io_timeout=0.05, open_threads=2)
    nodes = list(catalog.files())[:12]
    release = threading.Event()
    entered = [0]

    def hung() -> None:
        entered[0] += 1
        release.wait(20)

    async def main() -> list[str]:
        failures: list[str] = []

        async def one(node) -> None:  # type: ignore[no-untyped-def]
            with pytest.raises(OSError) as failed:
                await calls.run(node, hung, for_open=True)
            failures.append(str(failed.value))

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(one, node)
        return failures

    try:
        failures = trio.run(main)
    finally:
        release.set()
    assert entered[0] == calls.stuck == 4  # two slots: two rounds of two, then every other call refused
    assert sum("storage reads are stuck" in f for f in failures) == len(nodes) - 4


def test_a_discard_whose_thread_cannot_start_raises_nothing_and_runs_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """The late answer's discard is handed over in a callback of trio's, where an exception ends the whole loop
    (TrioInternalError: a dead mount): a thread that cannot be started (a pids limit) raised there. Nothing is
    raised; the discard waits for the next that can start a thread, which runs both, in one thread."""
    from liquidfs.datapath import storage_calls

    discards = storage_calls._Discards()
    done: list[int] = []
    real_start = threading.Thread.start

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)
    discards.put(done.append, 1)  # raises nothing
    monkeypatch.setattr(threading.Thread, "start", real_start)
    finished = threading.Event()
    discards.put(lambda value: (done.append(value), finished.set()), 2)
    assert finished.wait(10) and done == [1, 2]
