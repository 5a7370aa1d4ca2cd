"""The passthrough data path driven in-process: backings chosen and checked, shared per inode, kept in memfds.

The kernel is a fake that records registrations; the mount suite shows the real one (``test_passthrough.py``).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import time
import stat
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.testing

from liquidfs.datapath.backing import memfd_copy, memfd_with, resolve
from liquidfs.policy.next_epoch import NextEpochCache
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import ROOT_ID
from liquidfs.fuse.operations import Operations
from liquidfs.held.base import MEMFD_OVERHEAD, PAGE, MemfdLevel
from liquidfs.prepare import prepare
from liquidfs.stores.local.reader import StoreReader
from operations import FakeKernel, passthrough_operations
from sample import make_sample

CTX = pyfuse3.RequestContext()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Shared by the module's tests: none may change a source (its ctime would say so for good)."""
    return _prepared(tmp_path_factory.mktemp("pt"))


def _prepared(root: Path, count: int = 6) -> tuple[Path, Path]:
    src = root / "data"
    make_sample(src, count=count, width=64, height=48, seed=3)
    store = root / "store"
    prepare(src, store, 0.5, progress=False)
    prepare(src, store, 0.5, progress=False)  # reuses every object unread: their stamps stay as written
    return src, store


def _ops(store: Path, *, cache: bool = False, verify: bool = False) -> tuple[Operations, FakeKernel]:
    catalog = Catalog.open(store, readonly=True)
    reader = StoreReader(catalog.source, store)
    files, served, _, max_id = catalog.file_totals()
    room = served + files * (PAGE + MEMFD_OVERHEAD)  # all of it, at what memfds cost
    policy = NextEpochCache(room, served, files, max_id=max_id) if cache else None
    kernel = FakeKernel()
    ops = passthrough_operations(catalog, reader, kernel, cache=policy, verify_reads=verify)
    return ops, kernel


def _images(where: Operations | Catalog) -> list:
    catalog = where.catalog if isinstance(where, Operations) else where
    return [n for n in catalog.files() if n.path.endswith((b".png", b".bmp", b".jpg"))]


def _expected(src: Path, store: Path, node) -> bytes:
    return (store / node.object).read_bytes() if node.object else (src / os.fsdecode(node.path)).read_bytes()


def _serve_each(ops: Operations, kernel: FakeKernel, src: Path, store: Path, nodes: list) -> None:
    """Each of ``nodes`` opened, its backing checked to hold the bytes it serves, and released."""

    async def main() -> None:
        for node in nodes:
            info = await ops.open(node.id, os.O_RDONLY, CTX)
            assert info.backing_id > 0 and not info.direct_io
            assert kernel.read(info.backing_id) == _expected(src, store, node)
            await ops.release(info.fh)

    trio.run(main)


def test_every_open_is_answered_with_a_backing_holding_the_served_bytes(prepared) -> None:
    src, store = prepared
    ops, kernel = _ops(store)
    _serve_each(ops, kernel, src, store, _images(ops))
    assert not kernel.files  # every backing closed at its last release
    assert ops.stats.backing_object >= 1 and ops.stats.backing_source >= 1
    assert ops.stats.read_requests == 0 and ops.stats.data_path == "passthrough"


def test_concurrent_opens_share_one_backing_closed_at_the_last_release(prepared) -> None:
    src, store = prepared
    ops, kernel = _ops(store)
    node = next(n for n in _images(ops) if n.object)

    async def main() -> None:
        infos = []
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                async def one() -> None:
                    infos.append(await ops.open(node.id, os.O_RDONLY, CTX))
                nursery.start_soon(one)
        assert len({i.backing_id for i in infos}) == 1 and kernel.registered == 1
        await ops.release(infos[0].fh)
        await ops.release(infos[1].fh)
        assert len(kernel.files) == 1
        # a READ that still reaches the daemon is answered from the same backing
        assert await ops.read(infos[2].fh, 0, 16) == _expected(src, store, node)[:16]
        await ops.release(infos[2].fh)
        assert not kernel.files

    trio.run(main)


def test_a_touched_or_damaged_object_is_never_passed_through(prepared, tmp_path: Path) -> None:
    src, store = prepared
    import shutil
    store2 = tmp_path / "store"
    shutil.copytree(store, store2)  # copies: every object is another inode now, its stamp no longer matches
    ops, kernel = _ops(store2)
    node = next(n for n in _images(ops) if n.object)
    obj = store2 / node.object
    data = bytearray(obj.read_bytes())
    data[-1] ^= 0xFF
    obj.write_bytes(bytes(data))

    async def main() -> bytes:
        info = await ops.open(node.id, os.O_RDONLY, CTX)
        try:
            return kernel.read(info.backing_id)
        finally:
            await ops.release(info.fh)

    served = trio.run(main)
    assert served == (src / os.fsdecode(node.path)).read_bytes()  # the original, not the damaged object
    assert ops.stats.fallbacks == 1 and ops.stats.backing_memfd == 1


def test_a_changed_source_serves_the_original_at_its_new_size(tmp_path: Path) -> None:
    src, store = _prepared(tmp_path)  # its own: a changed source stays changed (ctime)
    ops, kernel = _ops(store)
    node = next(n for n in _images(ops) if n.object)
    path = src / os.fsdecode(node.path)
    before = path.read_bytes()
    path.write_bytes(before + b"x")

    async def main() -> tuple[bytes, int]:
        info = await ops.open(node.id, os.O_RDONLY, CTX)
        try:
            return kernel.read(info.backing_id), (await ops.getattr(node.id, CTX)).st_size
        finally:
            await ops.release(info.fh)

    served, size = trio.run(main)
    assert served == before + b"x" and size == len(before) + 1


@pytest.mark.parametrize("change", ["replaced", "edited"])
@pytest.mark.parametrize("served", ["raw", "original", "original-in-memory"])
@pytest.mark.parametrize("since_scan", [False, True], ids=["catalog-version", "changed-since-scan"])
def test_an_open_that_joins_a_backing_checks_the_source_again(tmp_path: Path, change: str, served: str,
                                                              since_scan: bool) -> None:
    """A backing shared by the opens of its inode (a raw object, an original's own descriptor, or a copy of it in
    a memfd): an open made after the source changed (replaced by another file, or edited in place) fails, never
    the old image; once the opens are closed, the next first open serves the new file. A replaced original's
    descriptor (its old inode, unchanged) or a memfd copy said nothing of the change: joined, it served the old.
    ``since_scan``: the first open already served a source changed since the scan (its original, of a version
    the catalog does not describe), which the join checks the source against: the join served it unchecked."""
    src, store = _prepared(tmp_path)  # its own: a changed source stays changed (ctime)
    ops, kernel = _ops(store, verify=served == "original-in-memory")  # verify_reads: every backing a memfd
    node = next(n for n in _images(ops) if bool(n.object) == (served == "raw"))
    path = src / os.fsdecode(node.path)
    if since_scan:
        path.write_bytes(path.read_bytes() + b"since the scan")
    first_served = path.read_bytes() if since_scan else _expected(src, store, node)
    new = path.read_bytes() + b"new"

    async def main() -> bytes:
        first = await ops.open(node.id, os.O_RDONLY, CTX)
        assert kernel.read(first.backing_id) == first_served
        if change == "replaced":
            (src / "replacement").write_bytes(new)
            os.replace(src / "replacement", path)
        else:
            path.write_bytes(new)
        with pytest.raises(pyfuse3.FUSEError) as refused:
            await ops.open(node.id, os.O_RDONLY, CTX)
        assert refused.value.errno == errno.EIO
        await ops.release(first.fh)
        assert not kernel.files and ops.open_budget.taken == 0 and not ops.open_files  # none left by the refusal
        return await _served_by_a_new_open(ops, kernel, node)

    assert trio.run(main) == new
    assert ops.data_path.statistics().values()["passthrough_open_inodes"] == 0


async def _served_by_a_new_open(ops: Operations, kernel: FakeKernel, node) -> bytes:  # type: ignore[no-untyped-def]
    """What an open of ``node`` made now serves, read from its backing; released."""
    again = await ops.open(node.id, os.O_RDONLY, CTX)
    try:
        return kernel.read(again.backing_id)
    finally:
        await ops.release(again.fh)


def test_a_join_checks_a_source_descriptor_on_a_remote_filesystem_off_the_loop(
        prepared, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fstat of a source on NFS or FUSE may wait on its server: a second open of an open file re-checks its
    backing in a worker thread there, never on the loop every request waits for (a local one: inline)."""
    import threading

    from liquidfs.datapath import passthrough as passthrough_module

    _, store = prepared
    ops, _ = _ops(store)
    node = next(n for n in _images(ops) if not n.object)  # an original: its backing is the source's descriptor
    where: list[bool] = []
    real = passthrough_module.still_sound

    def recorded(backing):  # type: ignore[no-untyped-def]
        where.append(threading.current_thread() is threading.main_thread())
        return real(backing)

    monkeypatch.setattr(passthrough_module, "still_sound", recorded)

    async def twice() -> None:
        first = await ops.open(node.id, os.O_RDONLY, CTX)
        second = await ops.open(node.id, os.O_RDONLY, CTX)
        await ops.release(second.fh)
        await ops.release(first.fh)

    trio.run(twice)
    monkeypatch.setattr(ops.data_path.reader, "inline_check", False)
    trio.run(twice)
    assert where == [True, False], where


def test_an_open_that_joins_and_fails_to_be_counted_leaves_no_backing_behind(
        prepared, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy failing on a second open of an open file (a defect of ours, never the reader's): that open is an
    EIO, and the backing goes with the first open's release, not kept for an open that was never answered."""
    _, store = prepared
    ops, kernel = _ops(store, cache=True)
    node = _images(ops)[0]
    held = ops.data_path.held

    async def main() -> None:
        first = await ops.open(node.id, os.O_RDONLY, CTX)

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a defect in the policy")

        monkeypatch.setattr(held, "decide", broken)
        with pytest.raises(pyfuse3.FUSEError) as refused:
            await ops.open(node.id, os.O_RDONLY, CTX)
        assert refused.value.errno == errno.EIO
        monkeypatch.undo()
        await ops.release(first.fh)

    trio.run(main)
    assert ops.data_path.statistics().values()["passthrough_open_inodes"] == 0
    assert not ops.open_files and ops.open_budget.taken == 0


def test_verify_reads_serves_checked_memfds(prepared) -> None:
    src, store = prepared
    ops, kernel = _ops(store, verify=True)

    async def main() -> None:
        for node in _images(ops):
            info = await ops.open(node.id, os.O_RDONLY, CTX)
            fd = kernel.files[info.backing_id]
            assert Path(f"/proc/self/fd/{fd}").readlink().name.startswith("memfd:")
            assert kernel.read(info.backing_id) == _expected(src, store, node)
            await ops.release(info.fh)

    trio.run(main)
    assert ops.stats.backing_memfd == len(_images(ops))


def test_next_epoch_cache_keeps_memfds_and_hits_serve_them(prepared) -> None:
    src, store = prepared
    ops, kernel = _ops(store, cache=True)  # a budget of the whole dataset: everything is kept
    nodes = _images(ops)
    memory = ops.data_path.held
    _serve_each(ops, kernel, src, store, nodes)
    held = memory.statistics().values()
    assert held["memfd_files"] == len(nodes) and held["memfd_bytes"] == sum(n.size_served for n in nodes)
    assert held["memfd_bytes"] <= memory.budget
    for _ in range(2):
        _serve_each(ops, kernel, src, store, nodes)  # epochs 2 and 3 read every file through the memfds
    assert ops.stats.bytes_from_memory == 2 * held["memfd_bytes"]
    assert memory.policy.stats.hits == 2 * len(nodes)


def test_memfds_are_sealed_copies(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789" * 1000)
    with open(path, "rb") as f:
        fd = memfd_copy(f.fileno(), 10_000)
    try:
        assert os.pread(fd, 20_000, 0) == path.read_bytes()
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1)
    finally:
        os.close(fd)
    fd = memfd_with(b"abc")
    assert os.pread(fd, 10, 0) == b"abc" and stat.S_ISREG(os.fstat(fd).st_mode)
    os.close(fd)


@pytest.mark.parametrize("name", [
    "é".encode() * 127 + b"x",     # 255 bytes of 2-byte UTF-8 characters (127 of them)
    "漢".encode() * 85,            # 255 bytes of 3-byte characters: 85 characters, under any character cut
    "é".encode() * 127 + b"\xff",  # no UTF-8: a character cut left its 255 bytes whole too
    b"\xff\xfe" * 127 + b"\x80",   # no UTF-8 at all
], ids=["2-byte", "3-byte", "undecodable", "no-utf8"])
def test_memfds_take_any_legal_file_name(tmp_path: Path, name: bytes) -> None:
    """A memfd is named after the file it serves; memfd_create takes 249 bytes of name, a file name may have 255:
    a name cut by characters (200 of them) still had 255 bytes, and its memfd-backed opens failed with EINVAL."""
    assert len(name) == 255
    for path in (name, b"d/" + name):
        fd = memfd_with(b"abc", path)
        try:
            assert os.pread(fd, 10, 0) == b"abc"
            label = os.fsencode(os.readlink(f"/proc/self/fd/{fd}"))
            assert label.startswith(b"/memfd:") and name.startswith(label[len(b"/memfd:"):].split(b" (deleted)")[0])
        finally:
            os.close(fd)
    with open(__file__, "rb") as f:
        fd = memfd_copy(f.fileno(), 3, name)
    os.close(fd)


def test_first_open_failing_fails_its_waiters_and_leaves_no_entry(prepared, tmp_path: Path) -> None:
    src, store = prepared
    ops, kernel = _ops(store)

    def refuse(fd: int) -> int:
        raise OSError(errno.EPERM, "no")

    kernel.register = refuse  # type: ignore[method-assign]
    node = _images(ops)[0]

    async def main() -> None:
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.open(node.id, os.O_RDONLY, CTX)
        assert info.value.errno == errno.EPERM
        assert ops.data_path.statistics().values()["passthrough_open_inodes"] == 0

    trio.run(main)


def test_resolve_refuses_an_object_swapped_for_a_link(prepared, tmp_path: Path) -> None:
    src, store = prepared
    import shutil
    store2 = tmp_path / "store"
    shutil.copytree(store, store2)
    catalog = Catalog.open(store2, readonly=True)
    node = next(n for n in catalog.files() if n.object)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours" * 100)
    obj = store2 / node.object
    obj.unlink()
    obj.symlink_to(secret)
    reader = StoreReader(catalog.source, store2)
    backing = resolve(reader, node)
    assert backing is not None
    try:
        assert os.pread(backing.fd, 1 << 20, 0) == (src / os.fsdecode(node.path)).read_bytes()
        assert backing.fallback
    finally:
        backing.close()
    assert ROOT_ID == 1


@pytest.mark.needs_root("a chown of the objects to another user")
def test_an_object_another_user_can_write_is_copied_not_passed_through(tmp_path: Path) -> None:
    """The kernel reads a passed-through object live while it is open: one its owner (not the mount's user) or
    its group could write in place would reach readers already holding it. Such objects are read whole into a
    sealed memfd (checksum checked); those only the mount's user can write are passed through."""
    src, store = _prepared(tmp_path)
    import sqlite3

    from liquidfs.catalog.identity import object_stamp

    db = sqlite3.connect(store / "catalog.sqlite")
    with db:
        for obj in (store / "objects").rglob("*.bmp"):
            os.chown(obj, 65534, 65534)
            # stamped again after the chown (which moves the ctime): only the owner now differs
            db.execute("UPDATE nodes SET object_stamp=? WHERE object=?",
                       (object_stamp(obj.stat()), str(obj.relative_to(store))))
    db.close()
    ops, kernel = _ops(store)

    async def main() -> None:
        for node in _images(ops):
            if not node.object:
                continue
            info = await ops.open(node.id, os.O_RDONLY, CTX)
            fd = kernel.files[info.backing_id]
            assert Path(f"/proc/self/fd/{fd}").readlink().name.startswith("memfd:"), node.path
            assert kernel.read(info.backing_id) == _expected(src, store, node)
            await ops.release(info.fh)

    trio.run(main)
    assert ops.stats.backing_object == 0 and ops.stats.backing_memfd > 0


def test_both_data_paths_serve_what_choose_decides(tmp_path: Path) -> None:
    """One decision for both paths: the passthrough backing (``vouched``, else ``resolve``) and the daemon path's
    whole read (``StoreReader.open``) and deferral (``vouch``) agree with ``StoreReader.choose`` for a sound
    raw object, a missing one, one damaged after prepare, a changed source, and an original."""
    from liquidfs.datapath.backing import vouched
    from liquidfs.catalog.nodes import REPR_RAW

    src, store = _prepared(tmp_path, count=10)
    catalog = Catalog.open(store, readonly=True)
    reader = StoreReader(catalog.source, store)
    raw = [n for n in catalog.files() if n.served_raw]
    original = next(n for n in _images(catalog) if n.representation != REPR_RAW)
    sound, missing, damaged, changed = raw[:4]
    (store / str(missing.object)).unlink()
    obj = store / str(damaged.object)
    data = bytearray(obj.read_bytes())
    data[-1] ^= 0xFF
    obj.write_bytes(data)  # in place: a later ctime, the checksum no longer matches
    source = src / os.fsdecode(changed.path)
    source.write_bytes(source.read_bytes())  # same bytes, a new ctime: no longer the file prepare expanded
    expected = {  # node -> (served raw, a stat vouches, fallback)
        sound.id: (True, True, None), missing.id: (False, True, "raw object missing"),
        damaged.id: (True, False, None), changed.id: (False, False, "source changed since prepare"),
        original.id: (False, True, None)}
    for node in (sound, missing, damaged, changed, original):
        chosen = reader.choose(node)
        assert (chosen.raw, chosen.sealed, chosen.fallback) == expected[node.id], node.path
        chosen.close()
        backing = vouched(reader, node) or resolve(reader, node, vouch=False)
        content = reader.open(node)
        try:
            assert backing is not None and backing.raw == content.raw
            if node is damaged:  # read whole, the checksum fails: the original on both paths
                assert backing.kind == "memfd" and not content.raw and content.fallback == backing.fallback
            else:
                assert backing.kind == ("object" if chosen.raw else "source")
                assert content.raw == chosen.raw and content.fallback == chosen.fallback == backing.fallback
            assert reader.vouch(node) == (chosen.sealed and chosen.fallback is None)
        finally:
            backing.close()
            content.close()
    reader.close()
    catalog.close()


def test_a_stock_pyfuse3_is_explained_to_a_non_root_user_without_sending_them_to_rebuild_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """install.sh skips the passthrough build without root; the mount's reason sent such a user back to it."""
    from liquidfs.datapath import passthrough

    monkeypatch.delattr(pyfuse3, "passthrough_open", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = passthrough.built_in()
    assert why is not None and "needs root" in why and "install.sh" not in why
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "install.sh" in (passthrough.built_in() or "")


@pytest.mark.parametrize("large", [True, False], ids=["large", "small"])
def test_released_backings_are_closed_off_the_loop_and_none_is_left(prepared, monkeypatch, large) -> None:
    """A released source or object backing is handed to a worker thread (its pages dropped, then closed): the
    loop never waits for the kernel's page drop. A large one at once; small ones in batches, and a batch that
    never fills is closed once the releases stop. Every descriptor is closed by the time the path stops."""
    from liquidfs.datapath import backing
    from liquidfs.datapath import passthrough

    monkeypatch.setattr(passthrough, "CLOSE_OFF_LOOP", 0 if large else 1 << 40)
    monkeypatch.setattr(backing, "CLOSE_BATCH", 4)
    src, store = prepared
    ops, kernel = _ops(store)
    released = 3 * len(_images(ops))
    assert released % 4, "a batch must be left unfilled"
    # What the closer is handed, and the file each descriptor was: this test's own descriptors, not a count of
    # the process's (which the garbage of earlier tests moves: CI counted 3 fewer at the end than at the start).
    closer = ops.data_path._closer
    handed: list[tuple[int, tuple[int, int]]] = []

    def recorded(hand_over):  # type: ignore[no-untyped-def]
        def hand(fd: int, *, drop: bool) -> None:
            st = os.fstat(fd)
            handed.append((fd, (st.st_dev, st.st_ino)))
            hand_over(fd, drop=drop)
        return hand

    closer.close, closer.close_soon = recorded(closer.close), recorded(closer.close_soon)

    async def main() -> None:
        for _ in range(3):
            for node in _images(ops):
                info = await ops.open(node.id, os.O_RDONLY, CTX)
                await ops.release(info.fh)
        with trio.fail_after(10):  # the last, unfilled batch too, with no release after it
            while ops.data_path.statistics().values()["closes_pending"]:
                await trio.sleep(0.01)

    trio.run(main)
    assert closer.closed == released == len(handed)
    ops.data_path.close()
    for fd, was in handed:  # closed: the number free, or taken since by another file
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        assert (st.st_dev, st.st_ino) != was, f"descriptor {fd} of a released backing is still open"
    assert not kernel.files and ops.stats.backing_source and ops.stats.backing_object


def test_the_closer_closes_a_batch_when_full_or_quiet_and_all_at_stop(tmp_path: Path, monkeypatch) -> None:
    from liquidfs.datapath import backing

    monkeypatch.setattr(backing, "CLOSE_WAIT", 3600.0)  # quiet never comes: only a full batch or stop closes
    monkeypatch.setattr(backing, "CLOSE_BATCH", 3)
    closer = backing.Closer()
    fds = [os.open(tmp_path, os.O_RDONLY) for _ in range(5)]

    def closed(fd: int) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return True
        return False

    for fd in fds[:2]:
        closer.close_soon(fd, drop=False)
    time.sleep(0.2)
    assert closer.pending == 2 and not any(map(closed, fds[:2]))  # a batch begun waits for more
    closer.close_soon(fds[2], drop=False)  # full
    deadline = time.monotonic() + 10
    while closer.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closer.closed == 3 and all(map(closed, fds[:3]))
    closer.close_soon(fds[3], drop=False)
    closer.close_soon(fds[4], drop=False)
    closer.stop()
    assert closer.pending == 0 and closer.closed == 5 and all(map(closed, fds))


def test_a_close_that_fails_leaves_the_closer_closing_the_next(tmp_path: Path) -> None:
    """A descriptor whose close fails (a FUSE or NFS source's flush error; here one that is no descriptor) is
    counted and passed: the thread that closed it died with it before, and every descriptor handed over after
    it stayed open until the mount ran out of them."""
    from liquidfs.datapath import backing

    closer = backing.Closer()
    valid = os.open(tmp_path, os.O_RDONLY)
    closer.close(1 << 20, drop=True)  # past fs.nr_open's default: never an open descriptor, EBADF
    closer.close(valid, drop=True)
    deadline = time.monotonic() + 10
    while closer.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closer.pending == 0 and closer.closed == 2
    with pytest.raises(OSError):
        os.fstat(valid)
    closer.stop()


def _all_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every open's walk on the loop finds its metadata cold (EAGAIN), as after a drop of the kernel's caches."""
    from liquidfs.datapath import passthrough

    real = passthrough.vouched

    def cold(*args, **kwargs):
        if kwargs.get("cached_only"):
            raise BlockingIOError(11, "not in the kernel's caches")
        return real(*args, **kwargs)

    monkeypatch.setattr(passthrough, "vouched", cold)


def _served_telling_cold_opens(prepared: tuple[Path, Path]) -> tuple[Operations, list[bytes], list]:
    """Every image served once (``_serve_each``), and the paths the read-ahead was told went cold, in order."""
    src, store = prepared
    ops, kernel = _ops(store)
    told: list[bytes] = []
    ops.data_path.on_cold_open = lambda node: told.append(node.path)
    nodes = _images(ops)
    _serve_each(ops, kernel, src, store, nodes)
    return ops, told, nodes


def test_an_open_whose_metadata_is_cold_goes_to_a_thread_and_tells_the_read_ahead(prepared, monkeypatch) -> None:
    """Where the kernel's caches cannot answer the walk, the open is done in a worker thread, counted, and the
    metadata read-ahead is told (``on_cold_open``), so the directory's other files are warmed again."""
    _all_cold(monkeypatch)
    ops, told, nodes = _served_telling_cold_opens(prepared)
    assert told == [n.path for n in nodes] and ops.stats.cold_opens == len(nodes)


async def _opened(ops: Operations, node_id: int, outcomes: list) -> None:
    """An open of ``node_id``: its FileInfo, or the errno it failed with, appended to ``outcomes``."""
    try:
        outcomes.append(await ops.open(node_id, os.O_RDONLY, CTX))
    except pyfuse3.FUSEError as exc:
        outcomes.append(exc.errno)


def test_opens_that_arrive_while_the_first_waits_for_storage_wait_for_its_decision(prepared, monkeypatch) -> None:
    """The first open of an inode decides its backing; opens of it that arrive while that open waits for storage
    (cold: in a worker thread) wait for the decision and share it, its backing or its failure."""
    _all_cold(monkeypatch)
    src, store = prepared
    node = next(n for n in _images(Catalog.open(store, readonly=True)) if n.object)

    async def opened_at_once(ops: Operations) -> list:
        outcomes: list = []
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(_opened, ops, node.id, outcomes)
        return outcomes

    ops, kernel = _ops(store)
    infos = trio.run(opened_at_once, ops)
    assert len({i.backing_id for i in infos}) == 1 and kernel.registered == 1 and ops.stats.cold_opens == 1
    assert kernel.read(infos[0].backing_id) == _expected(src, store, node)

    def refuse(fd: int) -> int:
        raise OSError(errno.EPERM, "no")

    ops, kernel = _ops(store)
    kernel.register = refuse  # type: ignore[method-assign]
    assert trio.run(opened_at_once, ops) == [errno.EPERM] * 3
    assert ops.stats.cold_opens == 1  # the waiters failed with the first's failure, not with their own
    assert ops.data_path.statistics().values()["passthrough_open_inodes"] == 0


def test_opens_that_waited_for_an_interrupted_first_open_open_for_themselves(prepared) -> None:
    """The first open of an inode cancelled while it waits for storage (its reader interrupted): the opens that
    waited for its decision are served (before: EIO, a failure of no file), and a later open of the inode never
    takes a past failure."""
    src, store = prepared
    ops, kernel = _ops(store)
    node = next(n for n in _images(ops) if n.object)
    path = ops.data_path
    real_backing = path._backing
    stuck = trio.Event()
    first = [True]

    async def backing_stuck_once(*args):
        if first[0]:
            first[0] = False
            stuck.set()
            await trio.sleep_forever()
        return await real_backing(*args)

    path._backing = backing_stuck_once
    served: list = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            interrupted = trio.CancelScope()

            async def first_open() -> None:
                with interrupted:
                    await ops.open(node.id, os.O_RDONLY, CTX)

            async def waiting_open() -> None:
                served.append(await ops.open(node.id, os.O_RDONLY, CTX))

            nursery.start_soon(first_open)
            await stuck.wait()
            for _ in range(2):
                nursery.start_soon(waiting_open)
            await trio.testing.wait_all_tasks_blocked()
            interrupted.cancel()
        assert len({i.backing_id for i in served}) == 1 and kernel.read(served[0].backing_id) == _expected(
            src, store, node)
        for info in served:
            await ops.release(info.fh)
        assert path.statistics().values()["passthrough_open_inodes"] == 0

    trio.run(main)


def test_a_fault_of_the_first_open_fails_its_waiters_once_and_a_late_one_leaves_no_backing(prepared) -> None:
    """Only an interrupted first open has its waiters open again: a fault (a bug) fails them with EIO, each
    without trying the fault again. A failure after the backing was registered lets it go: nothing left in the
    kernel, no descriptor."""
    src, store = prepared
    ops, kernel = _ops(store)
    node = next(n for n in _images(ops) if n.object)
    path = ops.data_path
    real_backing = path._backing
    calls = [0]
    deciding = trio.Event()
    go_on = trio.Event()

    async def faulty_backing(*args):
        calls[0] += 1
        deciding.set()
        await go_on.wait()
        raise RuntimeError("a bug")

    path._backing = faulty_backing
    outcomes: list = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_opened, ops, node.id, outcomes)
            await deciding.wait()
            for _ in range(2):
                nursery.start_soon(_opened, ops, node.id, outcomes)
            await trio.testing.wait_all_tasks_blocked()
            go_on.set()

    trio.run(main)
    assert outcomes == [errno.EIO] * 3 and calls[0] == 1
    assert path.statistics().values()["passthrough_open_inodes"] == 0

    path._backing = real_backing

    def failing_keep(*args) -> None:
        raise RuntimeError("a bug after the registration")

    path._decide_keep = failing_keep
    outcomes.clear()
    trio.run(_opened, ops, node.id, outcomes)
    assert outcomes == [errno.EIO] and kernel.registered == 1 and kernel.files == {}
    assert path.statistics().values()["passthrough_open_inodes"] == 0


def test_a_cold_open_does_not_ask_the_reader_again_whether_it_lends_descriptors(prepared, monkeypatch) -> None:
    """Whether the reader lends its descriptors is found once, when the data path is made: an ``isinstance`` of
    the runtime protocol looks up each of its members (19 us of Python on 3.11), and every cold open, in a worker
    thread holding the interpreter's lock, had paid it. Every ``isinstance`` against the protocol counted: one
    when the path is made, none more while every file is served cold."""
    from liquidfs.datapath import backing, passthrough
    from liquidfs.stores.reader import LendsDescriptors

    checks = []

    class Counting(type):
        def __instancecheck__(cls, instance: object) -> bool:
            checks.append(1)
            return isinstance(instance, LendsDescriptors)

    class CountedLendsDescriptors(metaclass=Counting):
        pass

    monkeypatch.setattr(backing, "LendsDescriptors", CountedLendsDescriptors)
    monkeypatch.setattr(passthrough, "LendsDescriptors", CountedLendsDescriptors)
    _all_cold(monkeypatch)
    src, store = prepared
    ops, kernel = _ops(store)
    assert len(checks) == 1  # found when the path was made
    nodes = _images(ops)
    _serve_each(ops, kernel, src, store, nodes)
    assert ops.stats.cold_opens == len(nodes) and ops.stats.backing_object + ops.stats.backing_source == len(nodes)
    assert len(checks) == 1


def test_without_cached_walks_no_open_is_tried_on_the_loop_nor_counted_cold(prepared, monkeypatch) -> None:
    """Without openat2's RESOLVE_CACHED (before 5.12) a walk cannot ask for the kernel's caches only: tried on the
    loop, each open failed at once, counted as cold, and had the read-ahead warm its directory again, for nothing.
    Such a kernel's opens go to a worker thread as they are, and serve the same bytes."""
    from liquidfs.datapath import passthrough

    monkeypatch.setattr(passthrough, "CACHED_WALKS", False)
    ops, told, nodes = _served_telling_cold_opens(prepared)
    assert ops.data_path.lender is None
    assert told == [] and ops.stats.cold_opens == 0 and ops.stats.opens == len(nodes)


def test_assembled_with_a_read_ahead_cold_opens_reach_it(prepared) -> None:
    from contextlib import ExitStack

    from liquidfs.daemon import build as assemble
    from liquidfs.metrics.stats import MountStats
    from operations import config

    _, store = prepared
    catalog = Catalog.open(store, readonly=True)
    for data_path in ("passthrough", "at init"):
        with ExitStack() as stack:
            ops, built = assemble.operations(config(), catalog, StoreReader(catalog.source, store), MountStats(),
                                             stack, data_path=data_path, kernel=FakeKernel(), warm=lambda node: None)
            path = ops.data_path if data_path == "passthrough" else built.passthrough_path(FakeKernel())
            assert ops.lookahead is not None and path.on_cold_open == ops.lookahead.went_cold


def _every_file_kept(prepared: tuple[Path, Path]) -> tuple[Operations, FakeKernel, list, MemfdLevel]:
    """A cached mount's operations after an epoch that kept every file in a memfd: its kernel, images and level."""
    src, store = prepared
    ops, kernel = _ops(store, cache=True)
    nodes = _images(ops)
    _serve_each(ops, kernel, src, store, nodes)
    assert ops.data_path is not None and isinstance(ops.data_path.held, MemfdLevel)
    return ops, kernel, nodes, ops.data_path.held


def test_a_hit_whose_memfd_is_let_go_while_its_source_is_checked_still_serves_its_bytes(prepared) -> None:
    """While a hit waits for its source's check, another job's read may take the held file's room and the level
    closes its memfd: the open serves its own descriptor of the memfd, taken before the wait. (It dup'ed the
    level's descriptor after the wait: EBADF, or, had the number been reused meanwhile, another file's bytes.)"""
    src, store = prepared
    ops, kernel, nodes, level = _every_file_kept(prepared)
    node = nodes[0]
    assert level.get(node.id) is not None
    checking = trio.Event()
    go_on = trio.Event()
    real = ops.data_path.calls.source_changed

    async def slow_check(checked):
        checking.set()
        await go_on.wait()
        return await real(checked)

    ops.data_path.calls.source_changed = slow_check
    opened: list = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def open_it() -> None:
                opened.append(await ops.open(node.id, os.O_RDONLY, CTX))
            nursery.start_soon(open_it)
            await checking.wait()
            level.drop(node.id)  # let go meanwhile: its memfd closed
            reused = os.open(src / os.fsdecode(nodes[1].path), os.O_RDONLY)  # may take the freed number
            go_on.set()
        info = opened[0]
        assert kernel.read(info.backing_id) == _expected(src, store, node)
        await ops.release(info.fh)
        os.close(reused)

    trio.run(main)
    assert ops.stats.errors == 0


def _reopen_while_kept(ops: Operations, kernel: FakeKernel, src: Path, store: Path,
                       before_reopen: Callable[[], None] = lambda: None,
                       while_waiting: Callable[[], None] = lambda: None) -> int:
    """Epoch 1 read with the first file's copy into a memfd (at its release) held up until the first file is
    opened again, for epoch 2: that open served and checked. The bytes read from storage meanwhile."""
    node = _images(ops)[0]
    path = ops.data_path
    copying = trio.Event()
    go_on = trio.Event()
    real_copy = path.blocking_copy
    first = [True]

    async def slow_copy(backing, digest=False):
        if first[0]:  # the first file's copy only
            first[0] = False
            copying.set()
            await go_on.wait()
        return await real_copy(backing, digest)

    path.blocking_copy = slow_copy
    from_storage = [0]

    async def main() -> None:
        info = await ops.open(node.id, os.O_RDONLY, CTX)  # epoch 1: held for the next
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.release, info.fh)  # its copy into a memfd now waits on go_on
            await copying.wait()
            for f in _images(ops)[1:]:  # the epoch's other files: the next read of node opens epoch 2
                other = await ops.open(f.id, os.O_RDONLY, CTX)
                await ops.release(other.fh)
            before_reopen()
            from_storage[0] = ops.stats.bytes_from_storage
            opened: list = []

            async def reopen() -> None:
                opened.append(await ops.open(node.id, os.O_RDONLY, CTX))

            nursery.start_soon(reopen)
            await trio.sleep(0.05)
            while_waiting()
            go_on.set()
        again = opened[0]
        assert kernel.read(again.backing_id) == _expected(src, store, node)
        await ops.release(again.fh)
        from_storage[0] = ops.stats.bytes_from_storage - from_storage[0]

    trio.run(main)
    return from_storage[0]


def test_a_hit_opened_while_its_last_release_is_still_being_kept_waits_for_the_memfd(prepared) -> None:
    """DALI reopens a file soon after its last release: the release's copy into a memfd (a worker thread) may
    not be done yet. The open the policy counts as a hit waits for it, rather than reading storage (a lost hit:
    6-27 of 256 in an epoch of four DALI shards, its hit ratio 0.23 of 0.30)."""
    src, store = prepared
    ops, kernel = _ops(store, cache=True)  # a budget for all: the hit is held again
    assert _reopen_while_kept(ops, kernel, src, store) == 0
    summary = ops.data_path.held.statistics().values()
    assert summary["cache_lost_hits"] == 0 and summary["cache_hits"] >= 1
    assert ops.data_path.held.get(_images(ops)[0].id) is not None


def test_a_hit_not_held_again_still_gets_the_memfd_its_last_release_was_keeping(prepared) -> None:
    """As above, but the policy does not hold the file again at that hit (its share of the next epoch is kept
    already): the hit took the file out of the policy, and the copy, once done, was closed as unwanted while the
    open that waited for it read storage (a lost hit: 3 of 768 in CI's DALI shards). The copy goes to that open."""
    src, store = prepared
    ops, kernel = _ops(store, cache=True)
    level = ops.data_path.held

    def keep_no_more() -> None:
        level.policy.share = 0.0  # nothing more is kept for epoch 3: the hit is not held again

    assert _reopen_while_kept(ops, kernel, src, store, keep_no_more) == 0, "the hit read storage"
    summary = level.statistics().values()
    assert summary["cache_lost_hits"] == 0 and summary["cache_hits"] >= 1, summary
    # served, then let go: the level holds what the policy does, no more
    assert level.get(_images(ops)[0].id) is None and set(level.held_items()) == set(level.policy.held)
    assert summary["memfd_bytes"] == sum(h.size for h in level.held_items().values())


def test_a_hit_whose_file_is_let_go_while_it_waits_for_the_copy_is_served_and_the_copy_not_kept(prepared) -> None:
    """The hit held the file again, but another read took its room while the copy was made: the copy serves the
    open that waited, and is not kept behind the policy's back (the level holds what the policy does)."""
    src, store = prepared
    ops, kernel = _ops(store, cache=True)
    level = ops.data_path.held
    node = _images(ops)[0]
    assert _reopen_while_kept(ops, kernel, src, store, while_waiting=lambda: level.policy.drop(node.id)) == 0
    summary = level.statistics().values()
    assert summary["cache_lost_hits"] == 0, summary
    assert level.get(node.id) is None and set(level.held_items()) == set(level.policy.held)


def test_a_hit_whose_memfd_copy_is_held_up_past_keep_wait_is_served_from_storage(prepared, monkeypatch) -> None:
    """The copy its last release makes is stuck (a slow backing, its threads busy): the open counted as a hit
    waits KEEP_WAIT at most, then reads storage, the miss it then is; the copy, once done, leaves the level
    holding what the policy does."""
    from liquidfs.datapath import passthrough

    monkeypatch.setattr(passthrough, "KEEP_WAIT", 0.01)
    src, store = prepared
    ops, kernel = _ops(store, cache=True)
    level = ops.data_path.held
    assert _reopen_while_kept(ops, kernel, src, store) > 0, "the open waited for the copy"
    summary = level.statistics().values()
    assert summary["cache_lost_hits"] == 1, summary
    assert set(level.held_items()) == set(level.policy.held)


def test_a_release_whose_copy_into_memory_is_stuck_gives_up_past_the_io_timeout(prepared, monkeypatch) -> None:
    """The copy of a kept file into a memfd at its last release reads the source or object: one that stopped
    answering held that RELEASE for good (and, past four, every kept file's, and the unmount). Abandoned past
    --io-timeout: the release returns, the file is not kept, and the copy's memfd is closed once it ends."""
    import threading

    from liquidfs.datapath import passthrough

    src, store = prepared
    ops, kernel = _ops(store, cache=True)
    path = ops.data_path
    path.calls.io_timeout = 0.2
    entered, stuck, ended = threading.Event(), threading.Event(), threading.Event()
    made: list[int] = []
    real_copy = passthrough._copy_of

    def stuck_copy(fd: int, size: int, digest: bool):  # type: ignore[no-untyped-def]
        entered.set()
        try:
            stuck.wait(30)
            copied = real_copy(fd, size, digest)
            made.append(copied[0])
            return copied
        finally:
            ended.set()

    monkeypatch.setattr(passthrough, "_copy_of", stuck_copy)
    node = _images(ops)[0]

    async def main() -> None:
        info = await ops.open(node.id, os.O_RDONLY, CTX)  # epoch 1: kept for the next, copied at its release
        with trio.fail_after(20):
            await ops.release(info.fh)
        assert entered.is_set() and path.held.get(node.id) is None and node.id not in path.held.policy.held
        stuck.set()
        ended.wait(30)
        await trio.sleep(0.1)  # the abandoned copy's memfd is closed on the loop

    trio.run(main)
    # its own descriptor of the file, whatever the release closed meanwhile: the late copy ends, and is closed
    assert made and all(not os.path.exists(f"/proc/self/fd/{fd}") or "memfd:" not in os.readlink(
        f"/proc/self/fd/{fd}") for fd in made)
    assert path._copies_stuck == 0


def test_a_copy_whose_thread_cannot_start_keeps_no_descriptor_and_is_not_stuck(prepared, monkeypatch) -> None:
    """No thread to copy in (a pids limit): its descriptor stayed open and the copy counted stuck for good, and
    four of them failed every later copy of the mount."""
    src, store = prepared
    ops, kernel = _ops(store)
    path = ops.data_path
    node = _images(ops)[0]

    def no_thread(*args: object, **kwargs: object) -> None:
        raise RuntimeError("can't start new thread")

    async def main() -> None:
        backing = await path.calls.run(node, path._resolve, node)
        try:
            before = len(os.listdir("/proc/self/fd"))
            monkeypatch.setattr(trio.lowlevel, "start_thread_soon", no_thread)
            for _ in range(5):
                with pytest.raises(RuntimeError):
                    await path.blocking_copy(backing)
            monkeypatch.undo()
            assert len(os.listdir("/proc/self/fd")) == before and path._copies_stuck == 0
        finally:
            backing.close()

    trio.run(main)


def test_a_file_rewritten_while_it_is_copied_into_memory_is_not_kept(tmp_path: Path, monkeypatch) -> None:
    """The copy a level keeps (and serves at later hits, which check the source, not the copy) was taken with no
    look at the file after it: one rewritten while it was read was held torn (found by review)."""
    from liquidfs.datapath import passthrough

    src, store = _prepared(tmp_path, count=2)  # its own: a file's stamp is moved here
    ops, kernel = _ops(store)
    path = ops.data_path
    node = _images(ops)[0]
    real_copy = passthrough._copy_of

    def copy_while_rewritten(fd: int, size: int, digest: bool) -> tuple[int, int | None]:
        made = real_copy(fd, size, digest)
        os.utime(fd, ns=(1, 1))  # its stamp moved: as a writer's would, mid-copy
        return made

    async def main() -> None:
        backing = await path.calls.run(node, path._resolve, node)
        try:
            before = len(os.listdir("/proc/self/fd"))
            monkeypatch.setattr(passthrough, "_copy_of", copy_while_rewritten)
            with pytest.raises(OSError) as refused:
                await path.blocking_copy(backing)
            assert refused.value.errno == errno.EIO and "while it was copied" in str(refused.value)
            assert len(os.listdir("/proc/self/fd")) == before  # the torn copy closed
        finally:
            backing.close()

    trio.run(main)


def test_a_copy_cancelled_before_its_thread_starts_keeps_no_descriptor(prepared) -> None:
    """Its own descriptor of the file was taken before its turn at the copies' limiter: a copy cancelled while
    it waited for one (its reader interrupted) left that descriptor open for good."""
    from liquidfs.datapath import passthrough

    src, store = prepared
    ops, kernel = _ops(store)
    path = ops.data_path
    node = _images(ops)[0]

    async def main() -> None:
        backing = await path.calls.run(node, path._resolve, node)
        holders = [object() for _ in range(passthrough.COPY_THREADS)]
        try:
            before = len(os.listdir("/proc/self/fd"))
            for holder in holders:  # every slot taken
                await path._copies.acquire_on_behalf_of(holder)
            with trio.move_on_after(0.1):
                await path.blocking_copy(backing)
            assert len(os.listdir("/proc/self/fd")) == before and path._copies_stuck == 0
        finally:
            for holder in holders:
                path._copies.release_on_behalf_of(holder)
            backing.close()

    trio.run(main)


def _two_loops(store: Path, kernel: FakeKernel, verify_reads: tuple[bool, bool] = (True, True)
               ) -> tuple[list[Operations], list]:
    """Two loops of one mount (``mount --loops 2``) over ``store``, files read whole (--verify-reads; each loop's
    as ``verify_reads`` says), and the socket pairs between them (``Peers.close_pairs`` them)."""
    from liquidfs.datapath.shared_inodes import SharedInodes
    from liquidfs.fuse.peers import Peers

    shared = SharedInodes(2)
    pairs = Peers.made(2)
    loops = []
    for index in range(2):
        catalog = Catalog.open(store, readonly=True)
        ops = passthrough_operations(catalog, StoreReader(catalog.source, store), kernel,
                                     verify_reads=verify_reads[index])
        ops.join_loops(Peers(pairs, index), shared)
        assert ops.data_path is not None
        ops.data_path.join_loops(shared, index)  # type: ignore[attr-defined]
        loops.append(ops)
    return loops, pairs


def _shared_across_loops(loops: list[Operations], pairs: list, kernel: FakeKernel, node,  # type: ignore[no-untyped-def]
                         src: Path, then: Callable[[], None] = lambda: None) -> None:
    """``node`` opened in loop 0, then in loop 1: the second finds the first's backing (nothing registered again),
    of the source's bytes (``then`` checks more); released in both, it goes with the last."""
    from liquidfs.fuse.peers import Peers

    async def main() -> None:
        first = await loops[0].open(node.id, os.O_RDONLY, CTX)
        second = await loops[1].open(node.id, os.O_RDONLY, CTX)
        assert second.backing_id == first.backing_id and kernel.registered == 1
        assert kernel.read(first.backing_id) == (src / os.fsdecode(node.path)).read_bytes()
        then()
        await loops[0].release(first.fh)
        assert first.backing_id in kernel.files  # loop 1 still has it open
        await loops[1].release(second.fh)
        assert kernel.files == {}

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)


def test_two_loops_share_one_backing_of_a_file_read_whole(prepared: tuple[Path, Path]) -> None:
    """mount --loops: opens of one file in two loops at once share the backing the first registered, where each
    loop read the file whole into a memfd of its own (an original here, with --verify-reads; an object store's
    files): the kernel allows one backing per inode, and one loop's later opens share its first one's too."""
    src, store = prepared
    kernel = FakeKernel()
    loops, pairs = _two_loops(store, kernel)
    node = next(n for n in loops[0].catalog.files() if not n.object)
    _shared_across_loops(loops, pairs, kernel, node, src)


def test_a_release_drops_a_files_pages_only_where_no_other_loop_serves_it(prepared: tuple[Path, Path]) -> None:
    """mount --loops: the pages of a served file are the file's, whichever loop's descriptor reads them; loop 0's
    release while loop 1's reader is still reading the file dropped them under that reader (read again from the
    disk). The last release across the loops drops them."""
    from liquidfs.fuse.peers import Peers

    _, store = prepared
    kernel = FakeKernel()
    loops, pairs = _two_loops(store, kernel, (False, False))
    node = next(n for n in _images(loops[0]) if n.object)  # a raw object: the store's file, served as it is
    drops: list[tuple[int, bool]] = []  # (loop, drop) of each served file let go
    for index, ops in enumerate(loops):
        closer = ops.data_path._closer  # type: ignore[union-attr]
        for name in ("close", "close_soon"):
            real = getattr(closer, name)
            setattr(closer, name, lambda fd, *, drop, real=real, index=index: drops.append((index, drop)) or
                    real(fd, drop=drop))

    async def main() -> None:
        first = await loops[0].open(node.id, os.O_RDONLY, CTX)
        second = await loops[1].open(node.id, os.O_RDONLY, CTX)
        assert second.backing_id == first.backing_id
        await loops[0].release(first.fh)
        await loops[1].release(second.fh)

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)
    assert drops == [(0, False), (1, True)]


@pytest.mark.parametrize("memfd_first", [True, False], ids=["memfd-then-file", "file-then-memfd"])
def test_two_loops_share_one_backing_of_the_same_bytes_in_a_memfd_and_the_file(prepared: tuple[Path, Path],
                                                                              memfd_first: bool) -> None:
    """mount --loops: one loop's open of a file holds a memfd of its bytes (a hit of its cache; here a checked
    read) while another loop's holds the file itself (or the other way round): the next epoch's open of a file
    read at the end of the last finds that open's RELEASE still pending. Their identities differ (a digest, an
    inode) and the second failed with EIO; its bytes are made the other kind and share the backing."""
    from liquidfs.datapath.backing import content_digest, resolve

    src, store = prepared
    kernel = FakeKernel()
    loops, pairs = _two_loops(store, kernel, (False, False))
    node = next(n for n in _images(loops[0]) if not n.object)  # its source serves it, as the file itself
    memfd_loop = loops[0 if memfd_first else 1].data_path

    async def read_whole(node, decision):  # type: ignore[no-untyped-def]  # as a hit of the loop's cache would
        made = resolve(memfd_loop.reader, node, verify_reads=True)
        made.digest = content_digest(made.fd, made.size)
        return made

    memfd_loop._backing = read_whole  # type: ignore[method-assign, union-attr]

    def recast_once() -> None:
        assert loops[1].stats.backings_recast == 1 and loops[0].stats.backings_recast == 0

    _shared_across_loops(loops, pairs, kernel, node, src, recast_once)


def test_two_loops_holding_two_files_never_copy_one_into_memory(tmp_path: Path) -> None:
    """A source replaced (another inode) while another loop's open holds the old file: both are files, so the bytes
    differ, and the open fails (EIO) at once; it was copied whole into memory first, to the same end."""
    from liquidfs.fuse.peers import Peers

    src, store = _prepared(tmp_path)
    kernel = FakeKernel()
    loops, pairs = _two_loops(store, kernel, (False, False))
    node = next(n for n in _images(loops[0]) if not n.object)
    path = src / os.fsdecode(node.path)

    copied: list[int] = []

    async def never(backing, digest=False):  # type: ignore[no-untyped-def]
        copied.append(backing.size)
        raise OSError(errno.EIO, "copied into memory")

    loops[1].data_path.blocking_copy = never  # type: ignore[union-attr]

    async def main() -> None:
        first = await loops[0].open(node.id, os.O_RDONLY, CTX)
        replacement = path.with_name(path.name + ".new")
        replacement.write_bytes(path.read_bytes())
        os.utime(replacement, ns=(node.mtime_ns, node.mtime_ns))
        replacement.rename(path)
        with pytest.raises(pyfuse3.FUSEError) as refused:
            await loops[1].open(node.id, os.O_RDONLY, CTX)
        assert refused.value.errno == errno.EIO and copied == [] and loops[1].stats.backings_recast == 0
        await loops[0].release(first.fh)

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)


def test_copies_into_memory_stuck_past_their_bound_refuse_the_next_at_once(prepared, monkeypatch) -> None:
    """Copies abandoned past --io-timeout whose threads have not ended: past COPY_THREADS of them the next copy
    fails at once (EIO) instead of parking one more thread on the storage that does not answer."""
    import threading

    from liquidfs.datapath import passthrough

    src, store = prepared
    ops, kernel = _ops(store)
    path = ops.data_path
    path.calls.io_timeout = 0.1
    monkeypatch.setattr(passthrough, "COPY_THREADS", 1)
    stuck = threading.Event()
    real_copy = passthrough._copy_of
    monkeypatch.setattr(passthrough, "_copy_of", lambda fd, size, digest: (stuck.wait(30), real_copy(fd, size,
                                                                                                    digest))[1])
    node = _images(ops)[0]

    async def main() -> None:
        backing = await ops.data_path.calls.run(node, path._resolve, node)
        try:
            for _ in range(2):  # the first is abandoned past the timeout, the second refused at once
                with pytest.raises(OSError) as failed:
                    await path.blocking_copy(backing)
            assert "copies into memory are stuck" in str(failed.value) and path._copies_stuck == 1
        finally:
            backing.close()
        stuck.set()
        with trio.fail_after(30):
            while path._copies_stuck:
                await trio.sleep(0.01)

    trio.run(main)


def test_two_loops_never_share_a_backing_of_other_bytes_of_one_size(tmp_path: Path) -> None:
    """mount --loops, files read whole into memfds (--verify-reads, an object store): the second loop's open of a
    file the first has open shares its backing only where its own copy holds the same bytes. An original edited
    in place, same size, between the two loops' reads: the second open fails (EIO, its source changed), never
    the first loop's older bytes; once the first is released it serves the new ones."""
    from liquidfs.fuse.peers import Peers

    src, store = _prepared(tmp_path)  # its own: a changed source stays changed (ctime)
    kernel = FakeKernel()
    loops, pairs = _two_loops(store, kernel)
    node = next(n for n in loops[0].catalog.files() if not n.object)
    path = src / os.fsdecode(node.path)
    old = path.read_bytes()
    new = bytes(b ^ 0xFF for b in old)

    async def main() -> None:
        first = await loops[0].open(node.id, os.O_RDONLY, CTX)
        path.write_bytes(new)  # in place: the same inode, the same size
        with pytest.raises(pyfuse3.FUSEError) as refused:
            await loops[1].open(node.id, os.O_RDONLY, CTX)
        assert refused.value.errno == errno.EIO and kernel.read(first.backing_id) == old
        await loops[0].release(first.fh)
        again = await loops[1].open(node.id, os.O_RDONLY, CTX)
        assert kernel.read(again.backing_id) == new
        await loops[1].release(again.fh)
        assert kernel.files == {}

    try:
        trio.run(main)
    finally:
        Peers.close_pairs(pairs)


def test_a_loop_joined_to_others_leaves_a_directory_another_claimed(prepared: tuple[Path, Path]) -> None:
    """mount --loops: each loop's read-ahead asks the loops' shared memory whether it warms a directory's inodes
    (``Operations.join_loops``); one another loop claimed is left to it, its rows still read."""
    from liquidfs.datapath.shared_inodes import SharedInodes
    from liquidfs.fuse.lookahead import AGAIN_AFTER, MetadataAhead
    from liquidfs.fuse.peers import Peers

    src, store = prepared
    catalog = Catalog.open(store, readonly=True)
    warmed: list[bytes] = []
    ops = passthrough_operations(catalog, StoreReader(catalog.source, store), FakeKernel())
    ops.lookahead = MetadataAhead(catalog.path, lambda node: warmed.append(node.path), catalog_id=catalog.file_id)
    shared, pairs = SharedInodes(2), Peers.made(2)
    try:
        ops.join_loops(Peers(pairs, 0), shared)
        node = next(iter(catalog.files()))
        assert shared.claim_directory(node.parent, time.monotonic(), AGAIN_AFTER)  # loop 1 is warming it
        ops.lookahead.looked_up(node.parent)
        ops.lookahead.stop()
        assert warmed == [] and ops.lookahead.row(node.parent, node.name) == node
        assert ops.lookahead.statistics().values()["lookahead_left_to_others"] == 1
    finally:
        Peers.close_pairs(pairs)


def test_sizes_let_go_across_loops_are_dropped_from_the_kernel(tmp_path: Path) -> None:
    """mount --loops: where the shared table of sizes told fills, the sizes of files no loop has open are let go,
    and every loop says the catalog's size of them again; the kernel, which keeps attributes for a day, is told
    to drop the ones it holds (else a ``stat`` went on saying a size no loop says)."""
    from liquidfs.catalog.build import build
    from liquidfs.datapath.shared_inodes import SharedInodes

    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"f{i}.bin").write_bytes(b"x" * 100)
    build(src, tmp_path / "store")
    for i in range(10):  # each changed in place since: served as it is now, 101 bytes, not the catalog's 100
        with open(src / f"f{i}.bin", "ab") as f:
            f.write(b"y")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    ops = passthrough_operations(catalog, StoreReader(catalog.source, tmp_path / "store"), FakeKernel())
    shared = SharedInodes(2, size_slots=8)
    ops.inodes.shared = shared
    assert ops.data_path is not None
    ops.data_path.join_loops(shared, 0)  # type: ignore[attr-defined]
    dropped: list[int] = []

    class Notifier:
        def invalidate(self, inode: int, attr_only: bool = False) -> None:
            assert attr_only
            dropped.append(inode)

        async def new_size(self, inode: int) -> None:
            pass

    ops.notifier = Notifier()  # type: ignore[assignment]
    nodes = sorted((n for n in catalog.files()), key=lambda n: n.id)

    async def main() -> None:
        for node in nodes:
            info = await ops.open(node.id, os.O_RDONLY, CTX)
            await ops.release(info.fh)

    trio.run(main)
    assert dropped, "the table never filled: nothing was let go"
    for inode in dropped:
        node = next(n for n in nodes if n.id == inode)
        assert shared.size(inode) is None and ops.inodes.size_told(node) == 100  # what a GETATTR says now
    assert sorted(dropped) == sorted(n.id for n in nodes if shared.size(n.id) is None)


async def _read_each(ops: Operations, nodes: list) -> None:
    """Each of ``nodes`` opened and released, in order."""
    for node in nodes:
        info = await ops.open(node.id, os.O_RDONLY, CTX)
        await ops.release(info.fh)


async def _open_beside(ops: Operations, kernel: FakeKernel, prepared: tuple[Path, Path], node, pending) -> None:
    """``node`` opened again while ``pending`` (its open before) is still here: the one backing serves its bytes;
    then both released."""
    again = await ops.open(node.id, os.O_RDONLY, CTX)
    assert again.backing_id == pending.backing_id
    assert kernel.read(again.backing_id) == _expected(*prepared, node)
    await ops.release(pending.fh)
    await ops.release(again.fh)


def test_an_open_of_a_file_whose_last_release_is_still_queued_is_counted_in_the_next_epoch(prepared) -> None:
    """The kernel sends a RELEASE in the background: the next epoch's open of a file read at the last one's end
    may come while its old open is still here, sharing its backing. It is a read of that epoch all the same (CI:
    170 of 1,500 went uncounted, the epoch short), and its decision says whether the file is kept at release."""
    src, store = prepared
    ops, kernel = _ops(store, cache=True)  # a budget for all: every file is held again at each hit
    nodes = _images(ops)
    level = ops.data_path.held
    last = nodes[-1]

    async def main() -> None:
        await _read_each(ops, nodes[:-1])  # epoch 1
        pending = await ops.open(last.id, os.O_RDONLY, CTX)  # its release not sent yet
        await _read_each(ops, nodes[:-1])  # epoch 2, the last file last
        await _open_beside(ops, kernel, (src, store), last, pending)

    trio.run(main)
    epochs = level.policy.summary()["epochs"]
    assert epochs["1"]["reads"] == epochs["2"]["reads"] == len(nodes), epochs
    assert epochs["2"]["hits"] == len(nodes), epochs
    # held again at that read: kept at the last release, the level holding what the policy does
    assert level.get(last.id) is not None and set(level.held_items()) == set(level.policy.held)
    assert not kernel.files


def test_a_shared_open_not_held_again_lets_the_levels_memfd_go(prepared) -> None:
    """As above, but that read holds the file no more (its epoch's share is kept already): at the last release
    the backing closes and the level holds what the policy does, no memfd of it left behind."""
    src, store = prepared
    ops, kernel = _ops(store, cache=True)
    nodes = _images(ops)
    level = ops.data_path.held
    last = nodes[-1]

    async def main() -> None:
        await _read_each(ops, nodes)  # epoch 1: all held
        await _read_each(ops, nodes[:-1])  # epoch 2
        pending = await ops.open(last.id, os.O_RDONLY, CTX)  # a hit of epoch 2, held again for epoch 3
        assert level.get(last.id) is not None
        level.policy.share = 0.0  # nothing more is kept
        await _read_each(ops, nodes[:-1])  # epoch 3
        await _open_beside(ops, kernel, (src, store), last, pending)

    trio.run(main)
    epochs = level.policy.summary()["epochs"]
    assert epochs["3"]["reads"] == epochs["3"]["hits"] == len(nodes), epochs
    assert level.get(last.id) is None and set(level.held_items()) == set(level.policy.held)
    assert not kernel.files


def test_a_raw_file_served_as_its_original_by_the_mix_is_told_its_size_again_if_its_told_size_was_let_go(
        prepared: tuple[Path, Path]) -> None:
    """mount --loops with a fixed --mix below the store's: a file the mix serves as its original is told the
    original's size in the shared table; another loop's tell may let that size go (no loop has a backing of it
    yet) while this open waits for storage. The open then compares what it serves with what the kernel would say
    now (the catalog's raw size), tells it again: a stat never says the raw size of an original's bytes (a DALI
    mmap of that many bytes faults past the end)."""
    from liquidfs.datapath.shared_inodes import SharedInodes
    from liquidfs.mix.share import Mix

    _, store = prepared
    ops, _ = _ops(store)
    shared = SharedInodes(2)
    ops.inodes.shared = shared
    assert ops.data_path is not None
    ops.data_path.join_loops(shared, 0)  # type: ignore[attr-defined]
    ops.mix = Mix(0.0, 0.5)  # every prepared file served as its original
    raw = next(n for n in _images(ops) if n.served_raw)
    opening = ops.data_path.open

    async def let_go_meanwhile(node, record, fh, job):  # type: ignore[no-untyped-def]
        shared.tell(raw.id, None)  # as another loop's sweep (``_forget_closed_sizes``) lets it go
        return await opening(node, record, fh, job)

    ops.data_path.open = let_go_meanwhile  # type: ignore[method-assign]

    async def main() -> None:
        info = await ops.open(raw.id, os.O_RDONLY, CTX)
        served = ops.open_files[info.fh].content.size
        assert served == raw.size != raw.size_served
        assert shared.size(raw.id) == served and ops.inodes.size_told(raw) == served
        await ops.release(info.fh)

    trio.run(main)
    # The size is the shared table's alone: the kernel's FORGET may reach another loop, so a size kept in this
    # loop's record would keep the record for as long as the mount lives.
    assert raw.id not in ops.inodes._records and ops.inodes.size_told(raw) == raw.size


def test_an_open_that_fails_before_the_mix_counted_it_releases_no_other_opens_count(
        prepared: tuple[Path, Path]) -> None:
    """An open whose view failed before the mix counted it released the mix's count all the same: another open of
    the file, still served, lost its count, and the next open could be given the other representation (another
    size) beside it."""
    from liquidfs.mix.share import Mix

    _, store = prepared
    ops, _ = _ops(store)
    ops.mix = Mix(1.0, 1.0)
    raw = next(n for n in _images(ops) if n.served_raw)

    async def main() -> None:
        first = await ops.open(raw.id, os.O_RDONLY, CTX)
        assert ops.mix is not None and ops.mix.is_open(raw.id)
        view_held = ops.mix.view_held

        def broken(node, held):  # type: ignore[no-untyped-def]
            raise RuntimeError("a bug before the view")

        ops.mix.view_held = broken  # type: ignore[method-assign]
        with pytest.raises(pyfuse3.FUSEError):
            await ops.open(raw.id, os.O_RDONLY, CTX)
        ops.mix.view_held = view_held  # type: ignore[method-assign]
        assert ops.mix.is_open(raw.id)  # the first open's count stands
        await ops.release(first.fh)
        assert not ops.mix.is_open(raw.id)

    trio.run(main)


def test_a_hit_whose_descriptor_cannot_be_taken_leaves_no_memfd_held(prepared, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A hit not held again lets the level's memfd go once the open has its own descriptor of it: where that dup
    failed (EMFILE), the memfd stayed held, counted by no budget, until the file was next kept."""
    ops, kernel, nodes, level = _every_file_kept(prepared)
    node = nodes[0]
    held = level.get(node.id)
    assert held is not None
    read = level.policy.read

    def not_held_again(file, *args):  # type: ignore[no-untyped-def]
        decision = read(file, *args)
        if file == node.id:
            level.policy.drop(file)
            decision = dataclasses.replace(decision, hold=False)
        return decision

    monkeypatch.setattr(level.policy, "read", not_held_again)
    dup = os.dup

    def no_more_descriptors(fd: int) -> int:
        if fd == held.fd:
            raise OSError(errno.EMFILE, "Too many open files")
        return dup(fd)

    monkeypatch.setattr(os, "dup", no_more_descriptors)
    with pytest.raises(pyfuse3.FUSEError) as info:
        trio.run(ops.open, node.id, os.O_RDONLY, CTX)
    monkeypatch.setattr(os, "dup", dup)
    assert info.value.errno == errno.EMFILE
    assert level.get(node.id) is None and node.id not in level.policy.held


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
def test_an_open_that_joins_and_fails_after_the_first_open_closed_lets_the_backing_go(tmp_path: Path,
                                                                                        cache: bool) -> None:
    """The first open of a raw object is released while a second open, joined to its backing, checks the source;
    the source changed meanwhile and the second open fails. It was the backing's last open, and nothing let the
    backing go: its id stayed registered and its descriptor open (with several loops, the slot too: every later
    open of the file, in any loop, failed with EIO). Now the next open serves the changed source. With a cache,
    the room the policy gave the file to keep goes back (nothing was kept)."""
    src, store = _prepared(tmp_path)  # its own: a changed source stays changed (ctime)
    ops, kernel = _ops(store, cache=cache)
    node = next(n for n in _images(ops) if n.object)
    path = src / os.fsdecode(node.path)
    new = path.read_bytes() + b"new"
    assert ops.data_path is not None
    checking, go_on = trio.Event(), trio.Event()
    real = ops.data_path.calls.source_changed

    async def slow_check(checked, version=None):  # type: ignore[no-untyped-def]
        checking.set()
        await go_on.wait()
        return await real(checked, version)

    async def main() -> bytes:
        first = await ops.open(node.id, os.O_RDONLY, CTX)
        ops.data_path.calls.source_changed = slow_check  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            async def second() -> None:
                with pytest.raises(pyfuse3.FUSEError) as refused:
                    await ops.open(node.id, os.O_RDONLY, CTX)
                assert refused.value.errno == errno.EIO
            nursery.start_soon(second)
            await checking.wait()
            await ops.release(first.fh)  # the first open closed: the second is the backing's last
            path.write_bytes(new)
            go_on.set()
        ops.data_path.calls.source_changed = real  # type: ignore[method-assign]
        assert not kernel.files  # the backing let go: its id and descriptor
        held = ops.data_path.held
        assert held is None or (node.id not in held.policy.held and held.get(node.id) is None)
        return await _served_by_a_new_open(ops, kernel, node)

    assert trio.run(main) == new
    assert not kernel.files and ops.data_path.statistics().values()["passthrough_open_inodes"] == 0


def test_a_source_whose_inode_number_passes_2_63_is_served_with_several_loops(
        prepared: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """An inode number at or past 2**63 (overlayfs with xino, some NFS and FUSE sources): the loops' shared table
    packs a backing's identity as signed 64-bit numbers, and every open of such a file under --loops failed
    (struct.error, EIO)."""
    from liquidfs.datapath.shared_inodes import SharedInodes

    src, store = prepared
    ops, kernel = _ops(store)
    assert ops.data_path is not None
    ops.data_path.join_loops(SharedInodes(2), 0)  # type: ignore[attr-defined]
    node = next(n for n in _images(ops) if not n.object)  # served from the source's own descriptor
    real_fstat = os.fstat
    source_ino = os.stat(src / os.fsdecode(node.path)).st_ino

    def big_inode(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if st.st_ino != source_ino:
            return st
        fields = list(st)
        fields[stat.ST_INO] = (1 << 64) - 5
        # the named fields besides (st_mtime_ns...): a stat_result of the ten alone has them None
        return os.stat_result(fields, {name: getattr(st, name) for name in dir(st) if name.startswith("st_")})

    monkeypatch.setattr(os, "fstat", big_inode)
    info = trio.run(ops.open, node.id, os.O_RDONLY, CTX)
    monkeypatch.setattr(os, "fstat", real_fstat)
    assert kernel.read(info.backing_id) == (src / os.fsdecode(node.path)).read_bytes()
    trio.run(ops.release, info.fh)


def test_a_hit_whose_source_changed_since_it_was_held_counts_as_a_lost_hit(tmp_path: Path) -> None:
    """The copy the policy held is stale (its source rewritten since): the open reads storage, and counted as a
    hit it overstated the window's hit ratio (cache_hits 4 with one served from storage, no lost hit)."""
    src, store = _prepared(tmp_path, count=3)  # its own: a source is rewritten here
    ops, kernel = _ops(store, cache=True)
    nodes = _images(ops)

    async def main() -> None:
        for node in nodes:  # epoch 1: each held for the next
            info = await ops.open(node.id, os.O_RDONLY, CTX)
            await ops.release(info.fh)
        path = src / os.fsdecode(nodes[0].path)
        path.write_bytes(path.read_bytes())  # rewritten: another version of the same bytes
        info = await ops.open(nodes[0].id, os.O_RDONLY, CTX)  # epoch 2: the policy's hit
        await ops.release(info.fh)

    trio.run(main)
    summary = ops.data_path.held.statistics().values()
    assert summary["cache_lost_hits"] == 1, summary


def test_a_keep_that_fails_other_than_by_an_oserror_gives_the_room_back(prepared) -> None:
    """The copy at a release ended by a cancel (an unmount) or a fault: the policy still counted the file held,
    its room charged, and its next open was a lost hit. The room is given back whatever ended the copy."""
    src, store = prepared
    ops, kernel = _ops(store, cache=True)
    node = _images(ops)[0]
    level = ops.data_path.held

    async def broken_copy(backing: object, digest: bool = False) -> tuple[int, int]:
        raise RuntimeError("a fault in the copy")

    ops.data_path.blocking_copy = broken_copy  # type: ignore[method-assign]

    async def main() -> None:
        info = await ops.open(node.id, os.O_RDONLY, CTX)
        assert node.id in level.policy.held
        with pytest.raises(Exception):
            await ops.release(info.fh)

    trio.run(main)
    assert node.id not in level.policy.held and level.get(node.id) is None
