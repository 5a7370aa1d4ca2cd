"""The daemon data path (``daemonpath.DaemonPath``) driven in-process through the FUSE layer, without a mount:
whole-file reads, the next-epoch cache's bytes in memory, buffers lent and let go, chunks read again and checked,
pages pushed to the kernel, deferred first reads, raw objects and their stamps."""

from __future__ import annotations

import errno
import os
import time
from contextlib import ExitStack
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.testing

from liquidfs.catalog.build import build
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import ROOT_ID
from liquidfs.datapath.storage_calls import OPENS_PER_USER_SHARE, StorageCalls
from liquidfs.fuse.operations import Operations
from liquidfs.stores.local.reader import StoreReader
from forge import xxh3_twins
from operations import daemon_operations, ops_over, small_tree

CTX = pyfuse3.RequestContext()


def run(fn, *args):
    return trio.run(fn, *args)


@pytest.fixture
def ops(tmp_path: Path) -> Operations:
    return small_tree(tmp_path)


CTX = pyfuse3.RequestContext()

def test_cache_holds_bytes_for_the_next_epoch(ops: Operations) -> None:
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    a = run(ops.lookup, d.st_ino, b"a.bin", CTX)
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    for _ in range(3):  # three epochs over two files; the budget holds both
        for inode in (a.st_ino, b.st_ino):
            fi = run(ops.open, inode, os.O_RDONLY, CTX)
            run(ops.read, fi.fh, 0, 1 << 20)
            run(ops.release, fi.fh)
    assert set(ops.data_path.held.held_items()) == {a.st_ino, b.st_ino}
    assert ops.stats.bytes_from_memory == 2 * 5006 and ops.stats.bytes_from_storage == 5006
    assert ops.policy is not None and ops.policy.stats.hits == 4

def test_a_kept_file_opened_and_never_read_is_not_held(ops: Operations) -> None:
    """Files are read at their first read: the cache holds a file it decided to keep once its bytes are there,
    and lets the decision go if the file is closed unread (its budget must not count bytes it does not have)."""
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    fi = run(ops.open, b.st_ino, os.O_RDONLY, CTX)
    assert ops.open_files[fi.fh].decision.hold and ops.open_files[fi.fh].content.deferred
    assert ops.policy is not None and b.st_ino in ops.policy.held
    run(ops.release, fi.fh)
    assert b.st_ino not in ops.data_path.held.held_items() and b.st_ino not in ops.policy.held
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    a = run(ops.lookup, d.st_ino, b"a.bin", CTX)
    fi = run(ops.open, a.st_ino, os.O_RDONLY, CTX)
    assert a.st_ino not in ops.data_path.held.held_items()  # not yet read
    assert bytes(run(ops.read, fi.fh, 0, 4096)) == b"A" * 4096
    run(ops.release, fi.fh)
    assert bytes(ops.data_path.held.held_items()[a.st_ino]) == b"A" * 5000 and a.st_ino in ops.policy.held

def _read_whole(ops: Operations, name: bytes) -> bytes:
    ino = run(ops.lookup, ROOT_ID, name, CTX).st_ino
    fi = run(ops.open, ino, os.O_RDONLY, CTX)
    try:
        return bytes(run(ops.read, fi.fh, 0, 1 << 20))
    finally:
        run(ops.release, fi.fh)

FILES = {f"x{i}": bytes([i]) * 300_000 for i in range(1, 5)}

def test_closed_files_lend_their_buffers_to_the_next(tmp_path: Path) -> None:
    from liquidfs.sysio.directio import POOL

    ops = ops_over(tmp_path, FILES, None)
    before = POOL.reused
    for _ in range(2):
        for name, data in FILES.items():
            assert _read_whole(ops, name.encode()) == data
    assert POOL.reused - before >= 7  # every open after the first found a buffer to reuse

def test_a_held_buffer_is_never_lent(tmp_path: Path) -> None:
    from liquidfs.sysio.directio import POOL

    ops = ops_over(tmp_path / "held", FILES, 1.0)  # the cache holds every file it reads
    for name, data in FILES.items():
        assert _read_whole(ops, name.encode()) == data
    assert len(ops.data_path.held.held_items()) == 4
    held = {id(view.obj) for view in ops.data_path.held.held_items().values()}
    assert not held & {id(buf) for _, buf, _ in POOL._free}
    # Other files opened and closed now borrow every free buffer there is; the held bytes must not change.
    others = {f"y{i}": bytes([100 + i]) * 300_000 for i in range(6)}
    lender = ops_over(tmp_path / "other", others, None)
    before = POOL.reused
    for name, data in others.items():
        assert _read_whole(lender, name.encode()) == data
    assert POOL.reused > before
    for name, data in FILES.items():  # hits: the held bytes are intact
        assert _read_whole(ops, name.encode()) == data
    assert ops.stats.bytes_from_memory == sum(map(len, FILES.values()))

def test_a_chunk_rewritten_to_its_xxh3_twin_after_the_bytes_were_let_go_is_refused(tmp_path: Path) -> None:
    """The daemon path lets go of a file's bytes once read and keeps a tag of each chunk; a chunk asked for again
    is read from storage and must match. A writer of the storage who rewrites a chunk after the open checked the
    file, to bytes with the same xxh3 (made in a moment: ``forge.xxh3_twins``), got them served when the tags were
    xxh3 (issue 38); the keyed tags refuse them: EIO, never bytes other than those the reader already had."""
    first, twin = xxh3_twins(os.urandom(1 << 20))
    data = first + os.urandom(1 << 20)
    ops = ops_over(tmp_path, {"a": data}, None)
    ino = run(ops.lookup, ROOT_ID, b"a", CTX).st_ino
    fi = run(ops.open, ino, os.O_RDONLY, CTX)
    handle = ops.open_files[fi.fh]
    served = b"".join(bytes(run(ops.read, fi.fh, off, 1 << 20)) for off in range(0, len(data), 1 << 20))
    assert served == data and handle.content.data is None  # let go: only the chunks' tags are kept
    source = tmp_path / "src" / "a"
    stat = source.stat()
    with open(source, "r+b") as f:  # rewritten in place, its size and mtime as they were
        f.write(twin)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(pyfuse3.FUSEError) as refused:
        run(ops.read, fi.fh, 4096, 4096)  # the kernel lost a page of the first chunk and asks again
    assert refused.value.errno == errno.EIO
    assert bytes(run(ops.read, fi.fh, 1 << 20, 4096)) == data[1 << 20:(1 << 20) + 4096]  # the other chunk is intact
    run(ops.release, fi.fh)


def test_bytes_read_whole_are_let_go_and_read_again_if_asked(tmp_path: Path) -> None:
    data = os.urandom(3_000_000)
    ops = ops_over(tmp_path, {"a": data, "b": os.urandom(10)}, None)
    ino = run(ops.lookup, ROOT_ID, b"a", CTX).st_ino
    fi = run(ops.open, ino, os.O_RDONLY, CTX)
    handle = ops.open_files[fi.fh]
    served = b"".join(bytes(run(ops.read, fi.fh, off, 1 << 20)) for off in range(0, len(data), 1 << 20))
    assert served == data and handle.content.data is None  # the open file holds no bytes any more

    async def two_reads_at_once() -> list[bytes]:
        out: list[bytes] = [b"", b""]

        async def one(i: int, off: int) -> None:
            out[i] = bytes(await ops.read(fi.fh, off, 1 << 20))

        async with trio.open_nursery() as nursery:  # the kernel's readahead sends reads concurrently
            nursery.start_soon(one, 0, 0)
            nursery.start_soon(one, 1, 1 << 20)
        return out

    assert trio.run(two_reads_at_once) == [data[: 1 << 20], data[1 << 20: 2 << 20]]
    # only the chunks asked for are read again, each once, not the whole file for each read
    assert ops.stats.refetches == 2 and ops.stats.bytes_refetched == 2 << 20
    # the kernel asks for the next lost pages of the same chunk: served from the piece just read
    assert bytes(run(ops.read, fi.fh, 2 << 20, 4096)) == data[2 << 20: (2 << 20) + 4096]
    assert ops.stats.refetches == 3 and ops.stats.bytes_refetched == len(data)  # the last chunk is short
    assert bytes(run(ops.read, fi.fh, (2 << 20) + 8192, 1 << 20)) == data[(2 << 20) + 8192:]
    assert ops.stats.refetches == 3
    assert run(ops.read, fi.fh, len(data), 4096) == b""
    run(ops.release, fi.fh)
    assert not ops.data_path._pieces

def test_a_file_changed_before_it_is_read_again_fails_with_eio(tmp_path: Path) -> None:
    data = os.urandom(500_000)
    ops = ops_over(tmp_path, {"a": data}, None)
    ino = run(ops.lookup, ROOT_ID, b"a", CTX).st_ino
    fi = run(ops.open, ino, os.O_RDONLY, CTX)
    assert bytes(run(ops.read, fi.fh, 0, 1 << 20)) == data
    changed = bytearray(data)
    changed[1000] ^= 1
    path = tmp_path / "src" / "a"
    st = path.stat()
    path.write_bytes(changed)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only the bytes tell
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.read, fi.fh, 0, 4096)
    assert info.value.errno == errno.EIO

def test_only_the_chunks_asked_for_are_checked_again(tmp_path: Path) -> None:
    """A change in one chunk fails the reads of that chunk only: the others still match what was served."""
    from liquidfs.stores.reader import CHUNK

    data = os.urandom(3 * CHUNK - 10)
    ops = ops_over(tmp_path, {"a": data}, None)
    ino = run(ops.lookup, ROOT_ID, b"a", CTX).st_ino
    fh = run(ops.open, ino, os.O_RDONLY, CTX).fh
    assert b"".join(bytes(run(ops.read, fh, off, CHUNK)) for off in range(0, len(data), CHUNK)) == data
    path = tmp_path / "src" / "a"
    st = path.stat()
    changed = bytearray(data)
    changed[2 * CHUNK + 5] ^= 1
    path.write_bytes(changed)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert bytes(run(ops.read, fh, 100, 4096)) == data[100:4196]
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.read, fh, 2 * CHUNK, 4096)
    assert info.value.errno == errno.EIO
    with pytest.raises(pyfuse3.FUSEError):  # a read across the changed chunk fails as a whole
        run(ops.read, fh, 2 * CHUNK - 4096, 8192)
    assert bytes(run(ops.read, fh, CHUNK, 4096)) == data[CHUNK:CHUNK + 4096]
    run(ops.release, fh)

def test_files_opened_but_not_read_keep_a_bounded_total(tmp_path: Path) -> None:
    """Like DALI's shuffle buffer: many files opened long before they are read. Past the bound, files are read
    at their first read instead of at open; nothing is read twice."""
    ops = ops_over(tmp_path, FILES, None)
    ops.data_path.reader.vouch = lambda node, cached_only=False: None  # type: ignore[method-assign]  # like an object store's
    ops.data_path.max_open_bytes = 700_000  # room for two of the four 300 kB files
    handles = {}
    for name in FILES:
        ino = run(ops.lookup, ROOT_ID, name.encode(), CTX).st_ino
        handles[name] = run(ops.open, ino, os.O_RDONLY, CTX).fh
    loaded = [h for h in ops.open_files.values() if h.content.data is not None]
    assert len(loaded) == 2 and ops.stats.deferred == 2 and ops.data_path._open_bytes == 600_000
    for name, data in reversed(FILES.items()):  # deferred ones first
        assert bytes(run(ops.read, handles[name], 0, 1 << 20)) == data
        assert ops.data_path._open_bytes <= ops.data_path.max_open_bytes
    assert ops.stats.refetches == 0 and ops.stats.open_evictions == 0
    assert ops.stats.bytes_from_storage == sum(map(len, FILES.values()))  # each file read once
    for fh in handles.values():
        run(ops.release, fh)
    assert ops.data_path._open_bytes == 0 and not ops.data_path._open_bytes_of

def test_a_deferred_file_changed_before_its_first_read_fails_with_eio(tmp_path: Path) -> None:
    ops = ops_over(tmp_path, FILES, None)
    ino = run(ops.lookup, ROOT_ID, b"x1", CTX).st_ino
    fh = run(ops.open, ino, os.O_RDONLY, CTX).fh
    assert ops.open_files[fh].content.deferred
    (tmp_path / "src" / "x1").write_bytes(b"shorter")
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.read, fh, 0, 4096)
    assert info.value.errno == errno.EIO

class _Kernel:
    """Stands in for the kernel's side of ``notify_store``: stores wait in ``pending`` until the test lets the
    kernel take them (``deliver``), as they wait in the notifier thread in a mount."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, int, bytes, object]] = []
        self.views: list[memoryview] = []
        self.pages: dict[int, bytes] = {}

    def store(self, inode: int, offset: int, data: memoryview, done) -> None:
        self.pending.append((inode, offset, bytes(data), done))
        self.views.append(data)

    def invalidate(self, inode: int, attr_only: bool = False) -> None:
        pass

    def stop(self) -> None:
        pass

    def deliver(self, ok: bool = True) -> None:
        for inode, offset, data, done in self.pending:
            if ok:
                self.pages[inode] = data
            done(ok)  # type: ignore[operator]
        self.pending.clear()

def _push_ops(tmp_path: Path, files: dict[str, bytes]) -> tuple[Operations, _Kernel]:
    ops = ops_over(tmp_path, files, None)
    kernel = _Kernel()
    ops.notifier = ops.data_path.notifier = kernel  # type: ignore[assignment]
    return ops, kernel

def _open(ops: Operations, name: bytes) -> int:
    return run(ops.open, run(ops.lookup, ROOT_ID, name, CTX).st_ino, os.O_RDONLY, CTX).fh

def test_the_rest_of_a_file_goes_to_the_kernel_at_its_first_read(tmp_path: Path) -> None:
    from liquidfs.sysio.directio import POOL

    data = os.urandom(3_000_000)
    ops, kernel = _push_ops(tmp_path, {"a": data, "b": os.urandom(3_000_000)})
    fh = _open(ops, b"a")
    handle = ops.open_files[fh]
    assert bytes(run(ops.read, fh, 0, 1 << 20)) == data[: 1 << 20]
    [(_, offset, pushed, _)] = kernel.pending
    assert offset == 1 << 20 and pushed == data[1 << 20:]  # whole pages, exactly the file's bytes
    assert handle.content.data is not None  # kept until the kernel has copied them
    kernel.deliver()
    assert handle.content.data is None and handle.chunks is not None
    assert ops.stats.bytes_pushed == len(data) - (1 << 20) and ops.data_path._open_bytes == 0
    before = POOL.reused
    fh_b = _open(ops, b"b")  # the buffer the push freed serves the next file
    run(ops.read, fh_b, 0, 4096)
    assert POOL.reused == before + 1
    run(ops.release, fh_b)
    # Should the kernel lose the pages and ask again, the file is read again and checked against its digest.
    assert bytes(run(ops.read, fh, 2 << 20, 1 << 20)) == data[2 << 20: 3 << 20]
    assert ops.stats.refetches == 1
    run(ops.release, fh)

def test_a_buffer_is_not_lent_before_the_kernel_has_copied_it(tmp_path: Path) -> None:
    from liquidfs.sysio.directio import POOL

    data = os.urandom(3_000_000)
    ops, kernel = _push_ops(tmp_path, {"a": data, "b": os.urandom(3_000_000)})
    fh = _open(ops, b"a")
    run(ops.read, fh, 0, 1 << 20)
    run(ops.release, fh)  # closed while the store is still queued
    pushing = kernel.views[0].obj
    assert all(buf is not pushing for _, buf, _ in POOL._free)
    fh_b = _open(ops, b"b")
    run(ops.read, fh_b, 0, 4096)
    assert ops.open_files[fh_b].content.data.obj is not pushing  # type: ignore[union-attr]
    run(ops.release, fh_b)
    kernel.deliver()
    assert kernel.pages and kernel.pages[next(iter(kernel.pages))] == data[1 << 20:]
    assert any(buf is pushing for _, buf, _ in POOL._free)  # back only now

def test_a_failed_push_keeps_serving_from_memory(tmp_path: Path) -> None:
    data = os.urandom(3_000_000)
    ops, kernel = _push_ops(tmp_path, {"a": data})
    fh = _open(ops, b"a")
    run(ops.read, fh, 0, 1 << 20)
    kernel.deliver(ok=False)  # e.g. the kernel forgot the inode
    served = b"".join(bytes(run(ops.read, fh, off, 1 << 20)) for off in range(1 << 20, len(data), 1 << 20))
    assert served == data[1 << 20:] and ops.stats.refetches == 0 and ops.stats.bytes_pushed == 0
    run(ops.release, fh)

def test_an_open_waits_for_the_stores_queued_by_an_earlier_open(tmp_path: Path) -> None:
    """The kernel drops a file's pages when an open without keep_cache is answered; a store from an earlier
    open that landed after that could leave bytes of a source that has changed since."""
    data = os.urandom(3_000_000)
    ops, kernel = _push_ops(tmp_path, {"a": data})
    ino = run(ops.lookup, ROOT_ID, b"a", CTX).st_ino
    opened: list[int] = []

    async def scenario() -> None:
        fh = (await ops.open(ino, os.O_RDONLY, CTX)).fh
        await ops.read(fh, 0, 1 << 20)
        assert kernel.pending

        async def second_open() -> None:
            opened.append((await ops.open(ino, os.O_RDONLY, CTX)).fh)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second_open)
            await trio.testing.wait_all_tasks_blocked()
            # still waiting for the kernel to take the first open's store
            assert not opened and ops.inodes[ino].pushes.done.statistics().tasks_waiting == 1
            kernel.deliver()
        assert opened
        await ops.release(fh)
        await ops.release(opened[0])

    trio.run(scenario)

def test_an_open_that_supersedes_another_waits_for_the_store_it_queued_meanwhile(tmp_path: Path) -> None:
    """An older open's read while a newer open waits for storage queues a store of the old bytes; the newer open
    supersedes it, and is answered only once that store has landed: after its answer, its private mapping of
    the file (read through the page cache, direct_io or not) would have found the old bytes' pages."""
    import threading

    old = os.urandom(3_000_000)
    ops, kernel = _push_ops(tmp_path, {"a": old})
    ino = run(ops.lookup, ROOT_ID, b"a", CTX).st_ino
    reader = ops.data_path.reader
    real_open = reader.open
    go = threading.Event()

    def open_when_told(node):  # type: ignore[no-untyped-def]
        go.wait(30)
        return real_open(node)

    opened: list[pyfuse3.FileInfo] = []

    async def scenario() -> None:
        first = (await ops.open(ino, os.O_RDONLY, CTX)).fh
        await ops.read(first, 0, 4096)
        kernel.deliver(ok=False)  # not taken: its bytes stay with the open, pushed again at its next read
        (tmp_path / "src" / "a").write_bytes(os.urandom(len(old)))  # rewritten in place, same size
        reader.open = open_when_told

        async def new_open() -> None:
            opened.append(await ops.open(ino, os.O_RDONLY, CTX))

        async with trio.open_nursery() as nursery:
            for _ in range(2):  # the second, beside the one that supersedes, finds that done already
                nursery.start_soon(new_open)
            await trio.testing.wait_all_tasks_blocked()  # the new opens wait for storage
            assert bytes(await ops.read(first, 4096, 4096)) == old[4096:8192]
            assert kernel.pending  # the old bytes' store, queued
            go.set()
            with trio.move_on_after(10):
                while not opened and ops.inodes[ino].pushes.done.statistics().tasks_waiting < 2:
                    await trio.sleep(0.01)
            assert not opened, "answered with the old bytes' store still to land"
            kernel.deliver()
        assert len(opened) == 2 and any(info.direct_io for info in opened)
        with pytest.raises(pyfuse3.FUSEError):  # superseded
            await ops.read(first, 8192, 4096)
        await ops.release(first)
        for info in opened:
            await ops.release(info.fh)

    trio.run(scenario)


def test_opens_that_waited_for_the_same_stores_see_each_other_before_they_are_answered(tmp_path: Path) -> None:
    """B (the old bytes) and C (the source rewritten in place since, same size) both waited for A's store to
    land; C looked for opens of other bytes before B had registered, and B after C had not: both went on
    reading, B through the page cache, C direct_io, whose private mapping faults through the same pages (found by
    review). The last to register now looks again after its wait, and supersedes the other."""
    ops, kernel = _push_ops(tmp_path, {"x": b"A" * 3_000_000})
    ino = run(ops.lookup, ROOT_ID, b"x", CTX).st_ino
    (tmp_path / "src" / "x").write_bytes(b"B" * 3_000_000)  # changed since the scan, same size

    async def scenario() -> None:
        first = await ops.open(ino, os.O_RDONLY, CTX)
        await ops.read(first.fh, 0, 4096)  # queues a store of its bytes
        assert kernel.pending
        opened: dict[str, pyfuse3.FileInfo] = {}

        async def open_as(name: str) -> None:
            opened[name] = await ops.open(ino, os.O_RDONLY, CTX)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_as, "b")  # the same bytes as the first: waits for its store
            pushes = ops.inodes[ino].pushes
            while pushes.done.statistics().tasks_waiting < 1:
                await trio.sleep(0.01)
            (tmp_path / "src" / "x").write_bytes(b"C" * 3_000_000)  # rewritten in place, same size
            nursery.start_soon(open_as, "c")
            while pushes.done.statistics().tasks_waiting < 2:
                await trio.sleep(0.01)
            kernel.deliver()
        readable = []
        for name in ("b", "c"):
            try:
                readable.append((name, bytes(await ops.read(opened[name].fh, 8192, 4))))
            except pyfuse3.FUSEError as exc:
                assert exc.errno == errno.EIO
        assert len(readable) == 1, readable  # one of the two is superseded: never both read on
        for info in (first, *opened.values()):
            await ops.release(info.fh)

    trio.run(scenario)


def test_held_files_are_checked_inline_only_on_a_local_source(tmp_path: Path) -> None:
    ops = ops_over(tmp_path, FILES, 1.0)
    for name, data in FILES.items():  # the cache now holds every file
        assert _read_whole(ops, name.encode()) == data
    hops: list[int] = []
    real_blocking = ops.calls.run

    async def counting(node, fn, *args, **kw):  # type: ignore[no-untyped-def]
        hops.append(node.id)
        return await real_blocking(node, fn, *args, **kw)

    ops.calls.run = counting  # type: ignore[method-assign]
    ops.data_path.reader.inline_check = True  # type: ignore[union-attr]
    assert _read_whole(ops, b"x1") == FILES["x1"] and hops == []
    ops.data_path.reader.inline_check = False  # type: ignore[union-attr]  # NFS, FUSE: a stat may hang
    assert _read_whole(ops, b"x1") == FILES["x1"] and len(hops) == 1
    os.utime(tmp_path / "src" / "x1", ns=(1, 1))  # a changed source is caught inline too
    ops.data_path.reader.inline_check = True  # type: ignore[union-attr]
    from_memory = ops.stats.bytes_from_memory
    assert _read_whole(ops, b"x1") == FILES["x1"] and ops.stats.bytes_from_memory == from_memory  # read anew


# -- files opened now and read at their first read -----------------------------------------------------------

def _raw_ops(tmp_path: Path, **options: object) -> tuple[Operations, list, Path]:
    """Every image of a small sample served raw, each object stamped by the prepare that wrote it."""
    from liquidfs.prepare import prepare
    from sample import make_sample

    src = make_sample(tmp_path / "src", count=3, width=256, height=128, seed=8)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    raw = [n for n in catalog.files() if n.served_raw]
    assert len(raw) == 3 and all(n.object_stamp for n in raw)
    reader = StoreReader(catalog.source, store)
    return daemon_operations(catalog, reader, **options), raw, store

def _set_stamp(store: Path, node, stamp: str | None) -> None:
    """Write ``stamp`` into ``node``'s catalog row, as a store writer (or an older liquidfs) could."""
    import sqlite3

    db = sqlite3.connect(store / "catalog.sqlite")
    with db:
        db.execute("UPDATE nodes SET object_stamp=? WHERE id=?", (stamp, node.id))
    db.close()

def _break_unseen(store: Path, node) -> None:
    """Damage no stat shows (a bad disk sector) in ``node``'s raw object: its stamp as if taken after it."""
    from liquidfs.catalog.identity import object_stamp

    obj = store / str(node.object)
    changed = bytearray(obj.read_bytes())
    changed[-10] ^= 0xFF
    obj.write_bytes(changed)
    _set_stamp(store, node, object_stamp(obj.stat()))

def _open_node(ops: Operations, node) -> int:
    return run(ops.open, node.id, os.O_RDONLY, CTX).fh

def test_raw_objects_as_prepare_left_them_are_read_at_their_first_read(tmp_path: Path) -> None:
    ops, raw, store = _raw_ops(tmp_path)
    handles = [_open_node(ops, n) for n in raw]
    assert ops.stats.deferred == 3 and ops.stats.bytes_from_storage == 0  # the opens read nothing
    for node, fh in zip(raw, handles):
        assert bytes(run(ops.read, fh, 0, 1 << 20)) == (store / str(node.object)).read_bytes()
        run(ops.release, fh)
    assert ops.stats.fallbacks == 0 and ops.stats.opens_raw == 3

def test_an_object_changed_after_prepare_is_checked_at_open_and_the_original_served(tmp_path: Path) -> None:
    ops, raw, store = _raw_ops(tmp_path)
    node = raw[0]
    obj = store / str(node.object)
    st = obj.stat()
    changed = bytearray(obj.read_bytes())
    changed[-10] ^= 0xFF
    obj.write_bytes(changed)
    os.utime(obj, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back; the ctime still tells
    fh = _open_node(ops, node)
    original = (tmp_path / "src" / os.fsdecode(node.path)).read_bytes()
    assert ops.stats.deferred == 0 and ops.stats.fallbacks == 1
    assert bytes(run(ops.read, fh, 0, 1 << 22)) == original
    for other in raw[1:]:  # the others are still read later, raw
        assert ops.open_files[_open_node(ops, other)].content.deferred

def test_an_object_broken_unseen_fails_its_first_read_and_the_next_open_serves_the_original(
        tmp_path: Path) -> None:
    """Damage no stat shows (a bad disk sector): as if the object's stamp had been taken after it."""
    ops, raw, store = _raw_ops(tmp_path)
    node = raw[0]
    _break_unseen(store, node)
    fh = _open_node(ops, node)
    assert ops.open_files[fh].content.deferred
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.read, fh, 0, 4096)
    assert info.value.errno == errno.EIO  # never a byte of the broken object, nor an original of another size
    assert ops.stats.fallbacks == 1 and ops.stats.errors == 1
    read = ops.stats.bytes_from_storage
    with pytest.raises(pyfuse3.FUSEError):  # the kernel retries page by page: failed at once, not read again
        run(ops.read, fh, 4096, 4096)
    assert ops.stats.bytes_from_storage == read and ops.stats.errors == 1
    fh = _open_node(ops, node)
    assert not ops.open_files[fh].content.deferred
    assert bytes(run(ops.read, fh, 0, 1 << 22)) == (tmp_path / "src" / os.fsdecode(node.path)).read_bytes()

def test_a_fallback_at_the_first_read_of_a_direct_io_open_outlives_another_opens_release(tmp_path: Path) -> None:
    """--page-cache direct: the inode's record stays while any open of it is open (not only page-cached ones), so
    the fallback its first read finds is the next open's too: served the original, not deferred to EIO again."""
    ops, raw, store = _raw_ops(tmp_path, page_cache="direct")
    node = raw[0]
    _break_unseen(store, node)
    first, second = _open_node(ops, node), _open_node(ops, node)
    assert ops.open_files[first].direct_io and ops.open_files[first].content.deferred
    run(ops.release, second)
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.read, first, 0, 4096)
    assert info.value.errno == errno.EIO and ops.stats.fallbacks == 1
    fh = _open_node(ops, node)
    assert not ops.open_files[fh].content.deferred
    assert bytes(run(ops.read, fh, 0, 1 << 22)) == (tmp_path / "src" / os.fsdecode(node.path)).read_bytes()

def test_an_object_without_a_stamp_is_read_at_open(tmp_path: Path) -> None:
    ops, raw, store = _raw_ops(tmp_path)
    _set_stamp(store, raw[0], None)  # prepared by an older liquidfs
    fh = _open_node(ops, raw[0])
    assert not ops.open_files[fh].content.deferred and ops.stats.bytes_from_storage > 0

def test_a_held_file_whose_source_changed_is_opened_without_keep_cache(ops: Operations, tmp_path: Path) -> None:
    """A hit whose source changed is read again from storage; its open used to still say keep_cache (from the
    stale held bytes), so the kernel kept the old pages beside the new ones."""
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    for _ in range(3):  # held by the next-epoch cache
        fi = run(ops.open, b.st_ino, os.O_RDONLY, CTX)
        run(ops.read, fi.fh, 0, 1 << 20)
        run(ops.release, fi.fh)
    assert b.st_ino in ops.data_path.held.held_items()
    fi = run(ops.open, b.st_ino, os.O_RDONLY, CTX)
    assert fi.keep_cache  # an unchanged hit keeps its pages
    run(ops.release, fi.fh)
    source = tmp_path / "src" / "b.txt"
    st = source.stat()
    source.write_bytes(b"HELLO\n")  # same size, mtime put back: the ctime and content differ
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    fi = run(ops.open, b.st_ino, os.O_RDONLY, CTX)
    assert not fi.keep_cache
    assert bytes(run(ops.read, fi.fh, 0, 1 << 20)) == b"HELLO\n"
    run(ops.release, fi.fh)

def test_an_open_whose_storage_read_fails_gives_back_the_room_the_policy_gave_it(ops: Operations) -> None:
    """The policy makes room for a file at its open; where the read then fails (EIO, a timeout), no bytes fill
    it: the room is given back at once, not charged to the budget until the file's next open an epoch later."""
    assert ops.data_path is not None and ops.data_path.held is not None
    policy = ops.data_path.held.policy
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    a = run(ops.lookup, d.st_ino, b"a.bin", CTX)
    reader = ops.data_path.reader  # type: ignore[attr-defined]
    opening = reader.open

    def failing(node):  # type: ignore[no-untyped-def]
        raise OSError(errno.EIO, "Input/output error")

    async def read_now(node, record, decision):  # type: ignore[no-untyped-def]
        return False  # read at open (as an object store's file, or past the open-bytes bound), not deferred

    ops.data_path._read_later = read_now  # type: ignore[attr-defined]
    reader.open = failing
    with pytest.raises(pyfuse3.FUSEError):
        run(ops.open, a.st_ino, os.O_RDONLY, CTX)
    assert a.st_ino not in policy.held and policy.held_bytes == 0
    reader.open = opening
    fi = run(ops.open, a.st_ino, os.O_RDONLY, CTX)
    assert bytes(run(ops.read, fi.fh, 0, 1 << 20)) == b"A" * 5000
    run(ops.release, fi.fh)

def test_direct_io_opens_count_against_the_open_bytes_bound(tmp_path: Path) -> None:
    """--page-cache direct keeps each open file's bytes in the daemon (every read reaches it); those bytes were
    outside the open-bytes bound, so open files could hold any amount of memory."""
    files = {f"f{i}": bytes([i + 1]) * 300_000 for i in range(6)}
    src = tmp_path / "src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    ops = daemon_operations(catalog, StoreReader(catalog.source, tmp_path / "store"), page_cache="direct",
                            open_bytes=700_000)
    handles = []
    for name in files:
        fi = run(ops.open, run(ops.lookup, ROOT_ID, name.encode(), CTX).st_ino, os.O_RDONLY, CTX)
        assert bytes(run(ops.read, fi.fh, 0, 4096)) == files[name][:4096]
        handles.append(fi)
    held = sum(h.content.size for h in ops.open_files.values() if h.content.data is not None)
    assert held <= 700_000 + 300_000, f"{held} bytes held by open files"
    for fi, name in zip(handles, files):  # bytes let go are read again, and still right
        assert bytes(run(ops.read, fi.fh, 100_000, 50_000)) == files[name][100_000:150_000]
        run(ops.release, fi.fh)

def test_an_open_of_other_bytes_beside_a_page_cached_open_never_shares_its_pages(tmp_path: Path) -> None:
    """The kernel keeps one page cache per inode. An open served raw, read through the page cache, went on
    answering the kernel's reads (readahead, a fault of its map) with the raw object after the source changed
    and a later open served the original at the size the kernel was told: that open's reads found the raw
    object's pages, cut to the original's size (found by soak --attacker). The later open now bypasses the page
    cache, and the older one's further reads fail."""
    ops, raw, store = _raw_ops(tmp_path)
    node = raw[0]
    b = _open_node(ops, node)  # a loader's open, served raw
    raw_bytes = bytes(run(ops.read, b, 0, 1 << 22))
    assert raw_bytes == (store / str(node.object)).read_bytes() and not ops.open_files[b].direct_io
    src = tmp_path / "src" / os.fsdecode(node.path)  # the source rewritten in place, its mtime put back
    st, data = src.stat(), src.read_bytes()
    fd = os.open(src, os.O_WRONLY)
    os.write(fd, data)
    os.close(fd)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    a = run(ops.open, node.id, os.O_RDONLY, CTX)  # falls back: another size, so direct_io
    assert a.direct_io
    run(ops.release, a.fh)
    a2 = run(ops.open, node.id, os.O_RDONLY, CTX)  # the original again, at the size the kernel was told now
    # the raw open no longer answers the kernel's reads of this inode: nothing refills its pages with the raw
    # object (a2's open dropped those there were), so the original's reads through them are its own
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.read, b, 0, 1 << 17)
    assert info.value.errno == errno.EIO
    assert bytes(run(ops.read, a2.fh, 0, 1 << 22)) == data
    run(ops.release, b)
    run(ops.release, a2.fh)
    a3 = run(ops.open, node.id, os.O_RDONLY, CTX)
    assert not a3.direct_io  # nothing else open: the page cache is the original's alone
    run(ops.release, a3.fh)


def test_a_direct_io_open_of_other_bytes_is_superseded_too(tmp_path: Path) -> None:
    """A private mapping of a direct_io file faults through the inode's one page cache with that open's bytes (the
    kernel's ``fuse_file_mmap``; DALI maps files privately): an open that fell back to the original (its object
    away a moment, direct_io for its other size) was never recorded, never superseded by the raw open that came
    next, and went on answering reads, the original's pages under the raw one's (found by review)."""
    ops, raw, store = _raw_ops(tmp_path)
    node = raw[0]
    obj = store / str(node.object)
    os.rename(obj, f"{obj}.away")
    original = run(ops.open, node.id, os.O_RDONLY, CTX)
    os.rename(f"{obj}.away", obj)
    served_raw = run(ops.open, node.id, os.O_RDONLY, CTX)
    assert original.direct_io and not ops.open_files[original.fh].content.raw
    _only_the_newer_reads(ops, original.fh, served_raw.fh, obj.read_bytes())


def _only_the_newer_reads(ops: Operations, older: int, newer: int, expected: bytes, at: int = 0) -> None:
    """The newer open reads ``expected``; the older one, which it superseded, fails its read at ``at`` with EIO.
    Both released."""
    try:
        assert bytes(run(ops.read, newer, 0, len(expected))) == expected
        with pytest.raises(pyfuse3.FUSEError) as refused:
            run(ops.read, older, at, 4)
        assert refused.value.errno == errno.EIO
    finally:
        run(ops.release, older)
        run(ops.release, newer)


def test_a_file_the_policy_let_go_while_it_was_read_is_not_held(tmp_path: Path) -> None:
    """Between an open's decision to hold its file and the storage read's end, another job's read may take the
    file's room (the policy lets it go): its bytes must not be held then, outside the budget."""
    ops = ops_over(tmp_path, FILES, 1.0)
    data = ops.data_path
    ino = run(ops.lookup, ROOT_ID, b"x1", CTX).st_ino
    reading = trio.Event()
    go_on = trio.Event()
    real_run = data.calls.run

    async def slow_run(node, func, *args, **kw):
        if node.id == ino and not reading.is_set():
            reading.set()
            await go_on.wait()
        return await real_run(node, func, *args, **kw)

    data.calls.run = slow_run

    async def main() -> None:
        opened: list = []

        async def open_and_read() -> None:  # read at open, or at its first read where the open defers it
            info = await ops.open(ino, os.O_RDONLY, CTX)
            opened.append(info)
            await ops.read(info.fh, 0, 4096)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(open_and_read)
                await reading.wait()
                assert ino in data.held.policy.held  # decided: held
                data.held.policy.drop(ino)  # let go meanwhile (what another job's read does)
                go_on.set()
        await ops.release(opened[0].fh)

    trio.run(main)
    assert ino not in data.held.held_items()


# -- the bounds on opens waiting for storage (``StorageCalls.opening``) --------------------------------------

class _NoReader:
    """``opening`` reads nothing: a reader that would say so if it were asked."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"opening used the reader's {name}")


def test_a_user_holds_at_most_its_share_root_and_the_mounts_user_the_whole() -> None:
    """A user other than root and the daemon's own gets EAGAIN past its share of the opens in flight (counted in
    ``opens_refused`` and ``opens_refused_share``) while another user still opens; root and the daemon's user
    are bound by the total only; an open that ends gives its place back to its own uid."""
    calls = StorageCalls(_NoReader(), max_opens=8)  # type: ignore[arg-type]
    share = int(8 * OPENS_PER_USER_SHARE)
    with ExitStack() as held:
        for _ in range(share):
            held.enter_context(calls.opening(1000))
        with pytest.raises(OSError) as info, calls.opening(1000):
            pass
        assert info.value.errno == errno.EAGAIN and "uid 1000" in str(info.value)
        assert (calls.opens_refused, calls.opens_refused_share) == (1, 1)
        with calls.opening(1001):  # another user still opens
            assert calls.opens_in_flight == share + 1
        for uid in (0, os.getuid()):  # root's and the daemon's own: past a share, up to the total
            with ExitStack() as privileged:
                for _ in range(8 - share):
                    privileged.enter_context(calls.opening(uid))
                with pytest.raises(OSError), calls.opening(uid):  # the total: refused, not by a share
                    pass
        assert (calls.opens_refused, calls.opens_refused_share) == (1 + 2, 1)
    assert calls.opens_in_flight == 0
    with ExitStack() as again:  # every place given back: the user has its whole share again
        for _ in range(share):
            again.enter_context(calls.opening(1000))

@pytest.mark.parametrize("page", [1, 2, 65536])
def test_the_warm_up_reads_the_catalog_a_page_at_a_time_and_chooses_among_every_file(
        ops: Operations, monkeypatch: pytest.MonkeyPatch, page: int) -> None:
    """The ids and sizes read in pages (the loop answers between them): a page of one row, or two, gives the
    choice every file, as one page does; what is chosen is held."""
    from liquidfs.datapath import base

    path = ops.data_path
    assert path is not None and path.held is not None
    monkeypatch.setattr(base, "WARM_UP_PAGE", page)
    everything = [(n.id, n.size_served) for n in ops.catalog.files()]
    assert len(everything) >= 2
    files, total = run(base.warm_up, path, ops.catalog)
    assert (files, total) == (len(everything), sum(size for _, size in everything))
    assert set(path.held.held_items()) == {file for file, _ in everything}


def test_a_file_the_warm_up_cannot_read_costs_only_that_file(ops: Operations, monkeypatch: pytest.MonkeyPatch) -> None:
    """--warmup runs in the mount's nursery after ready: a fault of one file (a row of the wrong type from a store
    someone else wrote, a failed read) skips that file; one that stops the whole warm-up leaves it "failed", and
    the mount answering."""
    from liquidfs.daemon import serve
    from liquidfs.datapath.base import warm_up

    path = ops.data_path
    assert path is not None
    warm = path.warm_one

    async def broken_row(node):  # type: ignore[no-untyped-def]
        if node.path == b"d/a.bin":
            raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")
        return await warm(node)

    path.warm_one = broken_row  # type: ignore[method-assign]
    files, total = run(warm_up, path, ops.catalog)
    assert files == 1 and total == len(b"hello\n")

    async def stopped(*args: object) -> tuple[int, int]:
        raise ValueError("no files to choose from")

    monkeypatch.setattr(serve, "warm_up_path", stopped)
    run(serve.warm_up, ops)
    assert ops.stats.warmup == "failed"


def test_an_open_of_a_source_rewritten_in_place_at_its_size_supersedes_the_older_opens(tmp_path: Path) -> None:
    """An open held in the cache (pages kept) serves the file as it was; the source rewritten in place, same
    size: a new open reads the new bytes, and the two never share the inode's page cache (the older one's next
    read is EIO, the new one bypasses it). They did: (raw, size) alike, a torn image for the new reader."""
    ops = small_tree(tmp_path)
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    a = run(ops.lookup, d.st_ino, b"a.bin", CTX)
    for _ in range(3):  # held by the cache
        info = run(ops.open, a.st_ino, os.O_RDONLY, CTX)
        run(ops.read, info.fh, 0, 1 << 20)
        run(ops.release, info.fh)
    first = run(ops.open, a.st_ino, os.O_RDONLY, CTX)
    before = bytes(run(ops.read, first.fh, 0, 4096))
    path = tmp_path / "src" / "d" / "a.bin"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(b"Z" * size)
    second = run(ops.open, a.st_ino, os.O_RDONLY, CTX)
    assert second.direct_io and before != b"Z" * 4096
    _only_the_newer_reads(ops, first.fh, second.fh, b"Z" * size, at=4096)


def test_a_read_of_a_superseded_open_in_flight_answers_no_bytes_and_pushes_none(tmp_path: Path) -> None:
    """A first read waiting on storage with the old bytes in hand while the file changes and another open
    supersedes it: answered EIO, and nothing of it is pushed into the page cache the new open reads."""
    ops = ops_over(tmp_path, {"x": b"A" * 300_000}, None)
    reader = ops.data_path.reader
    real_open = reader.open
    slow = [True]

    def open_slowly(node):  # type: ignore[no-untyped-def]
        content = real_open(node)
        if slow[0]:
            slow[0] = False
            time.sleep(0.5)  # in a worker thread: the old bytes in hand, the reply still to come
        return content

    reader.open = open_slowly
    stored: list[int] = []
    ops.notifier.store = lambda ino, off, data, done: stored.append(off)  # type: ignore[method-assign]

    async def main() -> BaseException | None:
        x = await ops.lookup(ROOT_ID, b"x", CTX)
        first = await ops.open(x.st_ino, os.O_RDONLY, CTX)
        failed: list[BaseException] = []

        async def read_first() -> None:
            try:
                await ops.read(first.fh, 0, 4096)
            except pyfuse3.FUSEError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_first)
            await trio.sleep(0.2)
            (tmp_path / "src" / "x").write_bytes(b"Z" * 200_000)  # another size: the next open supersedes
            second = await ops.open(x.st_ino, os.O_RDONLY, CTX)
        await ops.release(first.fh)
        await ops.release(second.fh)
        return failed[0] if failed else None

    failed = trio.run(main)
    assert isinstance(failed, pyfuse3.FUSEError) and failed.errno == errno.EIO, failed
    assert stored == []


def test_a_hit_held_as_the_other_representation_is_read_from_storage(tmp_path: Path) -> None:
    """A hit whose held bytes are the other representation than the open serves (an original held, where the
    open is served raw: as another open of the file, served meanwhile, is) is not served under this open's label,
    where its pages would share the inode's page cache with that open's other bytes: the open reads storage."""
    from liquidfs.policy.next_epoch import NextEpochCache

    ops, raw, store = _raw_ops(tmp_path, cache=NextEpochCache(1 << 26, 1 << 26, 8, max_id=64))
    node = raw[0]
    level = ops.data_path.held
    assert level is not None
    for _ in range(2):  # two epochs: the policy holds it
        fh = _open_node(ops, node)
        run(ops.read, fh, 0, 1 << 22)
        run(ops.release, fh)
    assert node.id in level.held_items()
    original = (tmp_path / "src" / os.fsdecode(node.path)).read_bytes()
    padded = original + b"\0" * (int(node.served_size) - len(original))  # an original at the raw object's size
    level.hold(node.id, memoryview(padded), raw=False)
    fh = _open_node(ops, node)
    assert bytes(run(ops.read, fh, 0, 1 << 22)) == (store / str(node.object)).read_bytes()
    run(ops.release, fh)


@pytest.mark.parametrize("held_again", [True, False])
def test_a_hit_whose_open_fails_leaves_no_bytes_held(ops: Operations, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, held_again: bool) -> None:
    """A hit whose source is gone fails (ENOENT): the held bytes go with it, whether the policy holds the file
    again (its room, now empty) or not (it let the file go at this read: the bytes stayed held, counted by no
    budget, until the file's next sound open)."""
    import dataclasses

    a = run(ops.lookup, run(ops.lookup, ROOT_ID, b"d", CTX).st_ino, b"a.bin", CTX)
    for _ in range(2):
        fi = run(ops.open, a.st_ino, os.O_RDONLY, CTX)
        run(ops.read, fi.fh, 0, 1 << 20)
        run(ops.release, fi.fh)
    data = ops.data_path
    assert data is not None and data.held is not None and a.st_ino in data.held.held_items()
    decide = data._decide
    monkeypatch.setattr(data, "_decide", lambda *args: dataclasses.replace(decide(*args), hold=held_again))
    (tmp_path / "src" / "d" / "a.bin").unlink()
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.open, a.st_ino, os.O_RDONLY, CTX)
    assert info.value.errno == errno.ENOENT
    assert a.st_ino not in data.held.held_items() and a.st_ino not in data.held.policy.held


def test_a_file_renamed_over_a_deferred_open_before_its_first_read_is_never_served(tmp_path: Path) -> None:
    """An open vouched for by a stat reads the file at its first read: another file of the same size renamed over
    it in between (or the file rewritten in place at its size) was served under the open, an --allow-other
    caller's included, whose check had passed on the file it opened. The first read fails (EIO)."""
    ops = ops_over(tmp_path, {"a.bin": b"A" * 100, "b.bin": b"B" * 100}, None)
    a = run(ops.lookup, ROOT_ID, b"a.bin", CTX).st_ino
    fi = run(ops.open, a, os.O_RDONLY, CTX)
    assert ops.open_files[fi.fh].content.deferred
    os.replace(tmp_path / "src" / "b.bin", tmp_path / "src" / "a.bin")
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.read, fi.fh, 0, 4096)
    assert info.value.errno == errno.EIO
    run(ops.release, fi.fh)
