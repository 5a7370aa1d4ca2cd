"""The FUSE layer (``fs.Operations``) driven in-process, without a mount: lookups, attributes, the control file,
errors as errnos, the open-file budget, over a real catalog and store."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import stat
import threading
from contextlib import ExitStack
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.testing

from liquidfs.catalog.build import build
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import CONTROL_ID, CONTROL_NAME, ROOT_ID
from liquidfs.daemon import build as assemble
from liquidfs.fuse.operations import Operations
from liquidfs.metrics.stats import MountStats
from liquidfs.stores.local.reader import StoreReader
from operations import config, daemon_operations, ops_over, small_tree

CTX = pyfuse3.RequestContext()


@pytest.fixture
def ops(tmp_path: Path) -> Operations:
    return small_tree(tmp_path)


def run(fn, *args):
    return trio.run(fn, *args)

def test_lookup_getattr_open_read_release(ops: Operations) -> None:
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    assert d.st_mode & 0o040000 and d.st_nlink == 2
    a = run(ops.lookup, d.st_ino, b"a.bin", CTX)
    assert a.st_size == 5000 and a.st_mode & 0o222 == 0
    assert run(ops.getattr, a.st_ino, CTX).st_size == 5000
    fi = run(ops.open, a.st_ino, os.O_RDONLY, CTX)
    assert run(ops.read, fi.fh, 4990, 100) == b"A" * 10
    run(ops.release, fi.fh)
    assert ops.stats.opens == 1 and ops.stats.bytes_read == 10
    assert ops.inodes.lookups(a.st_ino) == 1 and ops.inodes.known == 2
    run(ops.forget, [(a.st_ino, 1)])
    assert ops.inodes.get(a.st_ino) is None and ops.inodes.lookups(a.st_ino) == 0 and ops.inodes.known == 1

def test_names_and_attributes_outlive_an_epoch_the_control_files_never_kept(ops: Operations) -> None:
    # Past its entry timeout the kernel asks again at every open (a LOOKUP per file): an epoch of a large dataset
    # lasts longer than the 300 s there were. A size that changes is dropped by the open that serves it.
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    a = run(ops.lookup, d.st_ino, b"a.bin", CTX)
    for entry in (d, a, run(ops.getattr, a.st_ino, CTX)):
        assert entry.entry_timeout >= 86_400 and entry.attr_timeout >= 86_400
    control = run(ops.lookup, ROOT_ID, CONTROL_NAME, CTX)
    assert control.entry_timeout == 0 and control.attr_timeout == 0  # its statistics change at every read


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_attributes_show_the_rows_kind_and_no_write_or_set_id_bits(ops: Operations, kind: str) -> None:
    """Shown with the daemon's owner (root), a source user's set-user-ID program ran as root on a mount made
    with -o suid; a row (the store's writer's) whose mode names a device made the kernel an inode of one. The
    row's kind gives the type, and its read, execute and sticky bits alone are shown."""
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    entry = d if kind == "directory" else run(ops.lookup, d.st_ino, b"a.bin", CTX)
    node = ops.catalog.get(entry.st_ino)
    assert node is not None
    shown = ops._attrs(dataclasses.replace(node, mode=stat.S_IFCHR | 0o7777))
    assert shown.st_mode == (stat.S_IFDIR if kind == "directory" else stat.S_IFREG) | 0o1555


def test_missing_names_and_writes(ops: Operations) -> None:
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.lookup, ROOT_ID, b"nope", CTX)
    assert info.value.errno == errno.ENOENT
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        with pytest.raises(pyfuse3.FUSEError) as info:
            run(ops.open, b.st_ino, flags, CTX)
        assert info.value.errno == errno.EROFS
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.unlink, ROOT_ID, b"b.txt", CTX)
    assert info.value.errno == errno.EROFS

def test_unexpected_exceptions_become_eio(ops: Operations, caplog: pytest.LogCaptureFixture) -> None:
    def broken(node):
        raise RuntimeError("a bug")

    ops.data_path.reader.open = broken  # type: ignore[method-assign]
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    fh = run(ops.open, b.st_ino, os.O_RDONLY, CTX).fh  # read at its first read (``_read_later``)
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.read, fh, 0, 4096)
    assert info.value.errno == errno.EIO and ops.stats.errors == 1
    ops.data_path.reader.vouch = broken  # type: ignore[method-assign]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # a fault met at every open (a catalog row of the wrong type): one traceback
            with pytest.raises(pyfuse3.FUSEError) as info:
                run(ops.open, b.st_ino, os.O_RDONLY, CTX)
            assert info.value.errno == errno.EIO
    assert ops.stats.errors == 4 and caplog.text.count("Traceback") == 1

@pytest.mark.parametrize("code", [errno.ENOSYS, 700, 5000])
def test_a_storage_error_the_kernel_would_take_for_more_is_answered_eio(ops: Operations, code: int) -> None:
    """ENOSYS to an OPEN (a FUSE or network source's answer, a seccomp filter's) told the kernel this filesystem
    has no OPEN: it sent none again, nor RELEASE, and every read after carried no handle. Numbers no errno has
    were a reply the kernel refuses (the caller left waiting) or libfuse's ERANGE."""
    def failing(node, **kwargs):
        raise OSError(code, "from storage")

    ops.data_path.reader.vouch = failing  # type: ignore[method-assign]
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.open, b.st_ino, os.O_RDONLY, CTX)
    assert info.value.errno == errno.EIO


def test_a_lookup_whose_row_cannot_be_answered_counts_no_reference(ops: Operations) -> None:
    """A row whose attributes fail (a mode of the wrong type, from a store another user wrote) answers the LOOKUP
    with EIO: the kernel holds no reference to forget, so none is counted (it would keep the inode's record for
    good, and the count of inodes known wrong)."""
    import dataclasses

    b = ops.catalog.lookup(ROOT_ID, b"b.txt")
    assert b is not None
    known = ops.inodes.known
    lookup = ops.catalog.lookup
    ops.catalog.lookup = lambda parent, name: dataclasses.replace(  # type: ignore[method-assign]
        lookup(parent, name), mode="0o100644")
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    assert info.value.errno == errno.EIO
    assert ops.inodes.lookups(b.id) == 0 and ops.inodes.known == known

def test_source_deleted_is_enoent(ops: Operations, tmp_path: Path) -> None:
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    (tmp_path / "src" / "b.txt").unlink()
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.open, b.st_ino, os.O_RDONLY, CTX)
    assert info.value.errno == errno.ENOENT

def test_control_entry(ops: Operations) -> None:
    entry = run(ops.lookup, ROOT_ID, CONTROL_NAME, CTX)
    assert entry.st_ino == CONTROL_ID
    fi = run(ops.open, CONTROL_ID, os.O_RDONLY, CTX)
    assert fi.direct_io
    values = json.loads(bytes(run(ops.read, fi.fh, 0, 1 << 20)))
    assert values["pid"] == os.getpid() and "cache_budget" in values
    vfs = run(ops.statfs, CTX)
    assert vfs.f_files == 2

def test_open_files_are_bounded_and_past_the_bound_an_open_fails_with_enfile(tmp_path: Path) -> None:
    """Every open file may hold a descriptor and memory in the daemon: without a bound, a user opening files
    without closing them exhausted either. Past the budget (``OpenBudget.max_files``) an open fails with ENFILE; a close makes room."""
    files = {f"f{i}": bytes([i]) * 1000 for i in range(4)}
    ops = ops_over(tmp_path, files, None)
    ops.open_budget.max_files = 3
    handles = [run(ops.open, run(ops.lookup, ROOT_ID, f"f{i}".encode(), CTX).st_ino, os.O_RDONLY, CTX)
               for i in range(3)]
    last = run(ops.lookup, ROOT_ID, b"f3", CTX).st_ino
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.open, last, os.O_RDONLY, CTX)
    assert info.value.errno == errno.ENFILE
    run(ops.release, handles[0].fh)
    fi = run(ops.open, last, os.O_RDONLY, CTX)
    assert bytes(run(ops.read, fi.fh, 0, 1 << 20)) == files["f3"]

def test_past_the_opens_in_flight_an_open_fails_at_once_with_eagain(tmp_path: Path) -> None:
    """With every FUSE worker waiting in an open for a hung storage, nothing else was answered. Past
    ``max_opens`` opens in flight (here two, held as if waiting for storage) an open fails at once with EAGAIN,
    counted; a lookup, a getattr and the control file still answer, and once an open ends the next one is
    served."""
    files = {f"f{i}": bytes([i]) * 1000 for i in range(2)}
    ops = ops_over(tmp_path, files, None)
    ops.calls.max_opens = 2
    ino = run(ops.lookup, ROOT_ID, b"f0", CTX).st_ino
    waiting = [ops.calls.opening(0), ops.calls.opening(0)]
    for held in waiting:
        held.__enter__()
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.open, ino, os.O_RDONLY, CTX)
    assert info.value.errno == errno.EAGAIN
    assert run(ops.lookup, ROOT_ID, b"f1", CTX).st_size == 1000 and run(ops.getattr, ino, CTX).st_size == 1000
    control = run(ops.open, CONTROL_ID, os.O_RDONLY, CTX)
    values = json.loads(bytes(run(ops.read, control.fh, 0, 1 << 20)))
    assert values["opens_in_flight"] == 2 and values["opens_refused"] == 1 and values["opens"] == 0
    assert ops.open_budget.taken == 0  # the refused open gave its slot of the open-file budget back
    waiting.pop().__exit__(None, None, None)
    fi = run(ops.open, ino, os.O_RDONLY, CTX)
    assert bytes(run(ops.read, fi.fh, 0, 1 << 20)) == files["f0"]
    assert ops.calls.opens_in_flight == 1 and ops.statistics()["opens_refused"] == 1


class _As:
    """The request context of a FUSE request from ``uid`` (pyfuse3's own cannot be made with other ids)."""

    def __init__(self, uid: int) -> None:
        self.uid, self.gid, self.pid, self.umask = uid, uid, 4242, 0o022

def test_one_users_opens_stuck_on_storage_never_refuse_another_users(tmp_path: Path) -> None:
    """One user's opens stuck on a slow source could take every open the mount lets wait for storage, and every
    other user's open got EAGAIN. A user other than root and the mount's own holds at most half of them: its
    next open fails at once with EAGAIN (counted apart), while another user's and root's are served."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 1000)
    build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    gate = threading.Event()

    source_inode = (src / "f").stat().st_ino

    def may_read(node: object, uid: int, gid: int, pid: int) -> int:
        if uid == 1000:
            gate.wait(10)  # the stuck source (a bound only so that a failing run ends)
        return source_inode

    ops, _ = assemble.operations(config(allow_other=True), catalog, StoreReader(catalog.source, tmp_path / "store"),
                                 MountStats(), ExitStack(), may_read=may_read)
    ops.calls.max_opens = 4  # a share of 2 for a user other than root and the mount's
    ino = run(ops.lookup, ROOT_ID, b"f", CTX).st_ino

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(ops.open, ino, os.O_RDONLY, _As(1000))
            with trio.fail_after(30):  # a bound only so that a failing run ends
                while ops.calls.opens_in_flight < 2:
                    await trio.sleep(0.01)
            with pytest.raises(pyfuse3.FUSEError) as info:
                await ops.open(ino, os.O_RDONLY, _As(1000))
            assert info.value.errno == errno.EAGAIN
            other = await ops.open(ino, os.O_RDONLY, _As(1001))
            assert bytes(await ops.read(other.fh, 0, 1 << 20)) == b"x" * 1000
            await ops.open(ino, os.O_RDONLY, CTX)
            values = ops.statistics()
            assert values["opens_refused"] == 1 and values["opens_refused_share"] == 1, values
            assert values["opens_in_flight"] == 2
            gate.set()

    run(main)
    assert ops.calls.opens_in_flight == 0 and ops.stats.opens == 4


def _open_until_refused(ops: Operations, ino: int, ctx: object, at_most: int) -> tuple[list[int], int]:
    """Open ``ino`` as ``ctx`` until an open fails (``at_most`` times at most): the handles, and the errno."""
    held: list[int] = []
    for _ in range(at_most):
        try:
            held.append(run(ops.open, ino, os.O_RDONLY, ctx).fh)
        except pyfuse3.FUSEError as exc:
            return held, exc.errno
    return held, 0

def test_one_user_cannot_hold_every_open_file(tmp_path: Path) -> None:
    """The open-file budget was the mount's, whoever held it: one user opening one file 18,976 times left every
    other user, root included, with ENFILE. A user other than root and the mount's own holds at most a share of
    it (half of what is not kept back), and the last eighth stays for root and the mount's user, whoever else
    opens what. A close gives the slot back to whoever it was; a refused or failed open takes none."""
    ops = ops_over(tmp_path, {"f": b"x" * 1000}, None)
    ops.open_budget.max_files = 16  # 2 kept back for root and the mount's user; 7 at most for any one other user
    ino = run(ops.lookup, ROOT_ID, b"f", CTX).st_ino
    greedy, held_errno = _open_until_refused(ops, ino, _As(1000), 16)
    assert (len(greedy), held_errno) == (7, errno.ENFILE)
    other, _ = _open_until_refused(ops, ino, _As(1001), 7)  # another user still opens, as many
    assert len(other) == 7
    assert _open_until_refused(ops, ino, _As(1002), 1) == ([], errno.ENFILE)  # only the part kept back is left
    root, _ = _open_until_refused(ops, ino, CTX, 2)  # root (and the mount's user) still open
    assert len(root) == 2 and _open_until_refused(ops, ino, CTX, 1) == ([], errno.ENFILE)  # the whole budget
    for fh in (*root, greedy.pop()):
        run(ops.release, fh)
    assert _open_until_refused(ops, ino, _As(1001), 1) == ([], errno.ENFILE)  # its share: full
    greedy += _open_until_refused(ops, ino, _As(1000), 1)[0]  # the slot given back is its owner's again
    assert len(greedy) == 7
    for fh in greedy + other:
        run(ops.release, fh)
    # An open that fails (the source is gone) gives its slot back too.
    (tmp_path / "src" / "f").unlink()
    for _ in range(10):
        assert _open_until_refused(ops, ino, _As(1000), 1) == ([], errno.ENOENT)
    assert ops.open_budget.taken == 0 and ops.open_budget.held_by(1000) == 0


def test_each_request_type_is_counted_and_timed(tmp_path: Path) -> None:
    """Where the loop's time goes (issue 28's profile): count and wall time always, the loop CPU of a request's
    own steps with --time-requests, errors included."""
    timed = small_tree(tmp_path)  # builds the store; opened again below with CPU times
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    ops = daemon_operations(catalog, StoreReader(catalog.source, tmp_path / "store"))
    ops.time_requests = True
    for each in (timed, ops):
        a = run(each.lookup, run(each.lookup, ROOT_ID, b"d", CTX).st_ino, b"a.bin", CTX)
        fi = run(each.open, a.st_ino, os.O_RDONLY, CTX)
        assert run(each.read, fi.fh, 0, 100) == b"A" * 100
        run(each.release, fi.fh)
        with pytest.raises(pyfuse3.FUSEError):
            run(each.lookup, ROOT_ID, b"missing", CTX)
        requests = each.statistics()["requests"]
        assert requests["lookup"]["count"] == 3 and requests["open"]["count"] == 1
        assert requests["read"]["count"] == 1 and requests["release"]["count"] == 1
        assert requests["statfs"] == {"count": 0, "wall_s": 0.0, "cpu_s": 0.0}
        assert all(requests[r]["wall_s"] > 0 for r in ("lookup", "open", "read", "release"))
    cpu = ops.statistics()["requests"]
    assert all(0 < cpu[r]["cpu_s"] <= cpu[r]["wall_s"] for r in ("lookup", "open", "read", "release"))
    assert timed.statistics()["requests"]["open"]["cpu_s"] == 0.0  # not asked for: not measured


def test_an_open_after_a_lookup_asks_nothing_of_the_catalog(ops: Operations, monkeypatch) -> None:
    """The open and getattr that follow a lookup find its catalog row kept (a query costs the loop ~13 us); the
    rows kept are the latest lookups', a bounded number (a find over ten million files looks up every one), and
    an older one is queried again."""
    from liquidfs.datapath import inodes

    monkeypatch.setattr(inodes, "ROWS_KEPT", 1)
    queries: list[int] = []
    real_get = ops.catalog.get

    def counting_get(inode: int):
        queries.append(inode)
        return real_get(inode)

    ops.catalog.get = counting_get  # type: ignore[method-assign]
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    run(ops.getattr, b.st_ino, CTX)
    fi = run(ops.open, b.st_ino, os.O_RDONLY, CTX)
    assert run(ops.read, fi.fh, 0, 100) == b"hello\n"
    run(ops.release, fi.fh)
    assert queries == []
    run(ops.forget, [(b.st_ino, 1)])
    assert ops.inodes.get(b.st_ino) is None
    run(ops.lookup, ROOT_ID, b"d", CTX)  # the one row kept is d's now
    assert run(ops.getattr, b.st_ino, CTX).st_size == 6 and queries == [b.st_ino]


def test_inodes_only_looked_up_cost_a_word_each_and_the_rows_kept_are_bounded(ops: Operations, monkeypatch) -> None:
    """A find over ten million files makes the kernel hold every inode: what the mount keeps of one it only
    looked up is its count of lookups in an array, no record; the rows kept are bounded."""
    import dataclasses

    from liquidfs.datapath import inodes
    from liquidfs.metrics.stats import MountStats

    monkeypatch.setattr(inodes, "ROWS_KEPT", 10)
    table = inodes.Inodes(MountStats(), max_id=5)
    row = ops.catalog.get(ROOT_ID)
    assert row is not None
    for inode in range(2, 100):  # past max_id: the array grows
        table.looked_up(dataclasses.replace(row, id=inode))
    table.looked_up(dataclasses.replace(row, id=7))
    assert len(table) == 0 and len(table._rows) == 10 and table.known == 98
    assert table.lookups(7) == 2 and table.lookups(1000) == 0
    assert table.node(99) is not None and table.node(2) is None  # the oldest rows went first
    table.forget(7, 2)
    table.forget(1000, 1)  # never looked up: nothing to forget
    assert table.known == 97 and table.lookups(7) == 0


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_lookups_of_ten_million_ids_take_no_memory_until_touched() -> None:
    """One word per catalog id is kept for the kernel's lookups; its pages are resident only once written (a
    mount's start, and each loop of --loops, would otherwise hold 80 MB at ten million files)."""
    before = _resident_bytes()
    from liquidfs.datapath.inodes import Inodes

    inodes = Inodes(MountStats(), 10_000_000)
    assert _resident_bytes() - before < 20 << 20
    assert inodes.lookups(9_999_999) == 0 and inodes.lookups(20_000_000) == 0


def test_a_release_while_another_open_of_the_inode_waits_does_not_let_its_record_go(tmp_path: Path) -> None:
    """A second open of a file waits for storage while the first is released: the record that open fills (its
    page-cached handle, its size) stays the inode's, where a later open looks for it."""
    ops = ops_over(tmp_path, {"f": b"F" * 3000}, None)
    ino = run(ops.lookup, ROOT_ID, b"f", CTX).st_ino
    assert ops.data_path is not None
    real_open = ops.data_path.open
    storage = trio.Event()

    async def slow_open(*args, **kwargs):
        await storage.wait()
        return await real_open(*args, **kwargs)

    async def main() -> None:
        first = await ops.open(ino, os.O_RDONLY, CTX)
        ops.data_path.open = slow_open  # type: ignore[method-assign]
        second = []
        async with trio.open_nursery() as nursery:
            async def open_again() -> None:
                second.append(await ops.open(ino, os.O_RDONLY, CTX))
            nursery.start_soon(open_again)
            await trio.testing.wait_all_tasks_blocked()
            await ops.release(first.fh)
            storage.set()
        handle = ops.open_files[second[0].fh]
        assert ops.inodes.get(ino) is handle.inode
        assert bytes(await ops.read(second[0].fh, 0, 4096)) == b"F" * 3000
        await ops.release(second[0].fh)
        assert ops.inodes.get(ino) is None  # idle once released: let go as before

    run(main)


@pytest.mark.needs_root("the caller's check takes another user's credentials")
@pytest.mark.parametrize("data_path", ["daemon", "passthrough"])
def test_a_file_renamed_over_the_one_checked_is_never_served_to_the_caller(reachable_tmp: Path, data_path: str) -> None:
    """--allow-other: the caller's check opened the path as the caller, and the open served whatever the path led
    to a moment later. A user who may rename in the directory opened their own file and, once it was checked,
    renamed another user's 0600 file over it: served. Only the inode checked is served; the rest is EACCES."""
    from liquidfs.stores.local.reader import StoreReader
    from operations import FakeKernel

    tmp_path = reachable_tmp  # the caller must reach the source's root: pytest's own directories are root's
    src = tmp_path / "src"
    src.mkdir()
    (src / "mine.txt").write_bytes(b"nobody's own\n")
    (src / "secret.txt").write_bytes(b"root's alone\n")
    (src / "secret.txt").chmod(0o600)
    os.chmod(src, 0o777)  # anyone may rename in it (no sticky bit)
    build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    reader = StoreReader(catalog.source, tmp_path / "store")
    swap = [False]

    def checked_then_swapped(node: object, uid: int, gid: int, pid: int) -> int | None:
        found = reader.readable_inode(node, uid, gid, pid)  # type: ignore[arg-type]
        if swap[0]:
            os.replace(src / "secret.txt", src / "mine.txt")  # between the check and the open
        return found

    ops, _ = assemble.operations(config(allow_other=True), catalog, reader, MountStats(), ExitStack(),
                                 may_read=checked_then_swapped, data_path=data_path,
                                 kernel=FakeKernel() if data_path == "passthrough" else None)
    mine = run(ops.lookup, ROOT_ID, b"mine.txt", CTX).st_ino
    nobody = _As(65534)
    info = run(ops.open, mine, os.O_RDONLY, nobody)  # its own file, as it is: served
    run(ops.release, info.fh)
    swap[0] = True
    with pytest.raises(pyfuse3.FUSEError) as refused:
        run(ops.open, mine, os.O_RDONLY, nobody)
    assert refused.value.errno == errno.EACCES
    assert not ops.open_files and ops.open_budget.taken == 0
