"""The disk cache level driven without a mount: a fake store under it, the real policy and real files."""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from liquidfs.held import disk as disk_module
from liquidfs.policy.budget import DatasetCost
from liquidfs.policy.next_epoch import Decision, NextEpochCache
from liquidfs.catalog.nodes import KIND_FILE, REPR_ORIGINAL, Node
from liquidfs.held.disk import DiskLevel
from liquidfs.stores.reader import Content
from liquidfs.sysio.locks import HeldLock

SIZE = 4096  # a block: each file charged its bytes, as the disk takes them
FILES = 100


class FakeStore:
    inline_check = True

    def __init__(self) -> None:
        self.opens = 0

    def open(self, node: Node) -> Content:
        self.opens += 1
        data = bytes([node.id % 251]) * SIZE
        return Content(size=len(data), raw=False, data=memoryview(data))

    def check_source(self, node: Node, st: object = None) -> str | None:
        return None

    def read_span(self, node: Node, raw: bool, start: int, end: int) -> memoryview:
        return memoryview(bytes([node.id % 251]) * SIZE)[start:end]


def _node(i: int) -> Node:
    return Node(i, 1, b"f%d" % i, b"f%d" % i, KIND_FILE, 0o100444, SIZE, 0, 0, None, REPR_ORIGINAL, None, None, None)


def _policy(budget: int) -> NextEpochCache:
    """A disk level's policy of ``budget`` bytes, the dataset's cost in blocks known as the catalog gives it."""
    return NextEpochCache(budget, SIZE * FILES, FILES, max_id=FILES + 1,
                          cost=DatasetCost(FILES, {1: SIZE * FILES, SIZE: SIZE * FILES}))


def _level(tmp_path: Path, share: float, memory: set[int] | None = None) -> tuple[DiskLevel, FakeStore]:
    store = FakeStore()
    policy = _policy(int(share * SIZE * FILES))
    held = memory if memory is not None else set()
    return DiskLevel(store, tmp_path, policy, memory_holds=held.__contains__), store


def _sweep(root: Path) -> None:
    """What another mount's start sweeps in ``root``."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        disk_module._remove_stale(fd)
    finally:
        os.close(fd)


def _epoch(level: DiskLevel, rng: random.Random) -> None:
    order = list(range(2, FILES + 2))
    rng.shuffle(order)
    for i in order:
        content = level.open(_node(i))
        assert bytes(content.data) == bytes([i % 251]) * SIZE  # type: ignore[arg-type]


def test_a_constant_share_of_each_later_epoch_comes_from_disk(tmp_path: Path) -> None:
    level, store = _level(tmp_path, 0.3)
    rng = random.Random(2)
    _epoch(level, rng)
    assert store.opens == FILES and level.hits == 0
    files = list(level.dir.iterdir())
    assert len(files) == 30 and sum(f.stat().st_size for f in files) == 30 * SIZE  # exactly the budget
    for epoch in (2, 3):
        before = store.opens
        _epoch(level, rng)
        assert store.opens - before == 70, epoch
    assert level.hits == 60 and len(list(level.dir.iterdir())) == 30
    level.close()
    assert not level.dir.exists()


def test_a_damaged_file_is_read_from_the_store_again(tmp_path: Path) -> None:
    level, store = _level(tmp_path, 1.0)
    rng = random.Random(3)
    _epoch(level, rng)
    victim = level.dir / "7"
    victim.write_bytes(b"\0" * SIZE)  # same size, other bytes
    (level.dir / "8").unlink()
    before = store.opens
    _epoch(level, rng)  # every byte still checked by _epoch
    assert store.opens - before == 2 and level.lost == 2


def test_files_the_memory_level_keeps_are_not_kept_twice(tmp_path: Path) -> None:
    memory = set(range(2, 52))  # the memory level keeps half the files for the next epoch
    level, _ = _level(tmp_path, 0.5, memory)
    _epoch(level, random.Random(4))
    kept = {int(f.name) for f in level.dir.iterdir()}
    assert kept and not kept & memory


def test_a_hit_of_an_object_stores_file_asks_the_bucket_whether_its_source_changed(tmp_path: Path) -> None:
    """An object store's ``check_source`` asks nothing (a memory hit's request would cost more than the hit);
    a copy on the disk outlives its epoch and is held again at its hits, so "the next miss checks" never came:
    an overwritten object was served as its old bytes for epochs. Each disk hit asks (``source_changed_now``:
    one HEAD); a change, or a bucket that cannot say, is a lost hit read from the store."""

    class Bucket(FakeStore):
        def __init__(self) -> None:
            super().__init__()
            self.asked = 0
            self.changed: set[int] = set()
            self.unreachable = False

        def source_changed_now(self, node: Node) -> str | None:
            self.asked += 1
            if self.unreachable:
                raise OSError(errno.EIO, "the bucket does not answer")
            return "source object changed since prepare" if node.id in self.changed else None

    bucket = Bucket()
    policy = _policy(SIZE * FILES)
    level = DiskLevel(bucket, tmp_path, policy)
    rng = random.Random(5)
    _epoch(level, rng)
    assert bucket.asked == 0 and bucket.opens == FILES  # misses: the store's open checks
    bucket.changed = {7, 9}
    _epoch(level, rng)
    assert bucket.asked == FILES and level.hits == FILES - 2 and bucket.opens == FILES + 2
    bucket.changed.clear()
    bucket.unreachable = True
    before = bucket.opens
    _epoch(level, rng)
    assert bucket.opens - before == FILES  # nothing served unchecked
    level.close()


def test_a_source_changed_since_the_scan_is_never_written(tmp_path: Path) -> None:
    """An original rewritten in place at its size is served at its new version (``Content.version``); the next
    hit's check of the source finds it changed since the catalog's row, so a copy of it was written every epoch,
    never served, and pushed out copies that would have been."""

    class Rewritten(FakeStore):
        def open(self, node: Node) -> Content:
            return dataclasses.replace(super().open(node), version=(1, 2, 3, 4))

    store = Rewritten()
    policy = _policy(SIZE * FILES)
    level = DiskLevel(store, tmp_path, policy)
    _epoch(level, random.Random(6))
    assert not list(level.dir.iterdir()) and level.write_errors == 0
    level.close()


def test_stale_directories_of_dead_mounts_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "liquidfs-999999999"
    dead.mkdir(mode=0o700)
    (dead / "3").write_bytes(b"x")
    level, _ = _level(tmp_path, 0.1)
    assert not dead.exists() and level.dir.exists()


@pytest.mark.needs_root("a directory of another user")
def test_the_sweep_removes_only_the_daemons_own_directories(tmp_path: Path) -> None:
    """In a cache root others may write in (a sticky /tmp, a 0777 emptyDir), a ``liquidfs-*`` directory of
    another user, one others may enter (never one a mount made: 0700) or a link to one is not a dead mount's."""
    tmp_path.chmod(0o1777)
    theirs = tmp_path / "liquidfs-alices-notes"
    theirs.mkdir(mode=0o700)
    (theirs / "todo.txt").write_text("mine")
    os.chown(theirs, 65534, 65534)
    public = tmp_path / "liquidfs-public"
    public.mkdir(mode=0o755)
    (public / "f").write_bytes(b"x")
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (target / "f").write_bytes(b"x")
    (tmp_path / "liquidfs-link").symlink_to(target)
    _sweep(tmp_path)
    assert (theirs / "todo.txt").exists() and (public / "f").exists() and (target / "f").exists()


def test_a_levels_directory_never_exists_without_its_held_lock(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Another mount starting at the same moment sweeps every directory whose lock it can take (or finds
    missing): the lock is held before the directory is made, so no sweeper sees one of a live mount unlocked."""
    seen: list[bool] = []

    class SeeingLock(HeldLock):
        def __init__(self, path: Path) -> None:
            seen.append(any(p.is_dir() for p in tmp_path.iterdir()))  # a level's directory there already?
            super().__init__(path)

    monkeypatch.setattr(disk_module, "HeldLock", SeeingLock)
    level, _ = _level(tmp_path, 0.1)
    assert seen == [False] and level.dir.is_dir()
    _sweep(tmp_path)  # a second mount's sweep
    assert level.dir.is_dir()


def test_parts_of_files_read_again_come_from_the_store(tmp_path: Path) -> None:
    """The fs reads part of a let-go file again through the level; this level may have dropped it since."""
    level, store = _level(tmp_path, 0.0)
    assert bytes(level.read_span(_node(9), False, 100, 300)) == bytes([9]) * 200
    level.close()


def test_a_hit_whose_source_changed_is_never_served(tmp_path: Path) -> None:
    """Hits used to skip the source check: a file changed after the disk level stored it was served stale."""
    level, store = _level(tmp_path, 1.0)
    changed: set[int] = set()
    store.check_source = lambda node, st=None: "changed" if node.id in changed else None  # type: ignore[method-assign]
    rng = random.Random(3)
    _epoch(level, rng)
    opens = store.opens
    changed.add(5)
    _epoch(level, rng)  # every file is a hit but the changed one, which is read from the store again
    assert store.opens == opens + 1 and level.lost == 1 and level.hits == FILES - 1



def test_a_file_held_as_the_other_representation_is_no_hit(tmp_path: Path) -> None:
    """Under --mix the share moves: a file stored while served as its original, opened once served raw (or the
    other way), is read from the store, never served as the bytes of the other representation (a deferred open
    failed its first read on them, every epoch)."""
    from liquidfs.catalog.nodes import REPR_RAW

    level, store = _level(tmp_path, 1.0)
    rng = random.Random(4)
    _epoch(level, rng)
    opens = store.opens
    as_raw = dataclasses.replace(_node(7), representation=REPR_RAW, served_size=SIZE * 3, object="objects/x")
    store.open = lambda node: Content(size=SIZE * 3, raw=True, data=memoryview(b"r" * SIZE * 3))  # type: ignore[method-assign]
    content = level.open(as_raw)
    assert content.raw and content.size == SIZE * 3 and content.level == "storage"
    assert store.opens == opens and level.lost == 1  # (the replaced open counts nothing)


def test_a_link_put_at_the_levels_name_is_never_written_through(tmp_path: Path) -> None:
    """Where others may write the directory the level's is in, they can rename it and put a link at its name
    (to /etc/cron.d): every file is reached through the directory's descriptor, so nothing is written, read or
    removed there, and the level goes on in its own directory."""
    level, store = _level(tmp_path / "shared", 1.0)
    rng = random.Random(5)
    _epoch(level, rng)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "7").write_bytes(b"the victim's own")
    moved = tmp_path / "shared" / "moved"
    level.dir.rename(moved)
    level.dir.symlink_to(victim)
    before = store.opens
    _epoch(level, rng)  # hits, still checked, from the renamed directory
    assert store.opens == before and level.hits == FILES
    level._forget(7)
    level._write(_node(7), store.open(_node(7)))
    assert sorted(p.name for p in victim.iterdir()) == ["7"] and (victim / "7").read_bytes() == b"the victim's own"
    level.close()
    assert (victim / "7").exists() and not list(moved.iterdir())


def test_a_file_let_go_while_it_was_read_is_not_left_on_disk(tmp_path: Path) -> None:
    """Another job's read may take a file's room while its bytes are read from storage and written: the level
    then keeps no file of it, which nothing would evict, outside the budget."""
    level, store = _level(tmp_path, 1.0)
    node = _node(5)
    read = store.open

    def let_go_meanwhile(n: Node) -> Content:
        level.drop(n.id)  # the policy's room given to another read, as decide's eviction does
        return read(n)

    store.open = let_go_meanwhile  # type: ignore[method-assign]
    assert bytes(level.open(node).data or b"") == bytes([5]) * SIZE
    assert list(level.dir.iterdir()) == [] and level.held_items() == {}
    store.open = read  # type: ignore[method-assign]
    level.open(_node(6))
    assert [f.name for f in level.dir.iterdir()] == ["6"]
    level.close()


def test_a_directory_renamed_to_the_levels_name_is_refused_unless_empty(tmp_path: Path) -> None:
    """Between the mkdir and the open, a directory with files in it (a live mount's) put at the name is not the
    one this mount made."""
    made = tmp_path / "liquidfs-x"
    made.mkdir(mode=0o700)
    os.close(disk_module._own_directory(made))
    (made / "7").write_bytes(b"x")
    with pytest.raises(OSError, match="not the directory this mount made"):
        disk_module._own_directory(made)


class _ThenOnce:
    """The level's lock, running ``meanwhile`` once right after the next hold of it ends: another thread's open
    that takes the lock next."""

    def __init__(self, level: DiskLevel, meanwhile: Callable[[], None]) -> None:
        self._lock, self._meanwhile, self._level = level._lock, meanwhile, level

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self._level._lock = self._lock  # once
        self._meanwhile()


def _readmit(level: DiskLevel, node: Node, data: bytes) -> Callable[[], None]:
    """Another open of ``node`` that read it from the store and writes it (``_write``: renamed under the lock if the
    policy holds it then)."""
    return lambda: level._write(node, Content(size=len(data), raw=False, data=memoryview(data)))


def test_a_file_readmitted_while_another_open_evicts_it_keeps_its_new_copy(tmp_path: Path) -> None:
    """The evicted files of one open are let go in the lock hold that evicted them: let go after it, the file
    another open re-admitted (and renamed into place) in between would lose its new copy while the policy holds it."""
    level, _ = _level(tmp_path, 1.0)
    level.open(_node(5))
    read = level.policy.read
    level.policy.read = lambda file, size, job=0: dataclasses.replace(  # type: ignore[method-assign]
        read(file, size, job), evicted=(5,))
    new = bytes([99]) * SIZE
    level._lock = _ThenOnce(level, _readmit(level, _node(5), new))  # type: ignore[assignment]
    level.decide(6, SIZE)
    assert 5 in level.policy.held and 5 in level.held_items()
    assert (level.dir / "5").read_bytes() == new
    level.close()


def test_a_file_readmitted_while_it_is_dropped_is_not_left_behind(tmp_path: Path) -> None:
    """A drop lets go of the entry, the file and the policy's room in one hold: a re-admission between them would
    leave an entry the policy does not hold (outside the budget, never evicted)."""
    level, _ = _level(tmp_path, 1.0)
    level.open(_node(5))
    level._lock = _ThenOnce(level, _readmit(level, _node(5), bytes([99]) * SIZE))  # type: ignore[assignment]
    level.drop(5)
    assert 5 not in level.policy.held
    assert level.held_items() == {} and list(level.dir.iterdir()) == []
    level.close()


def test_an_open_not_held_leaves_the_copy_another_open_readmitted_meanwhile(tmp_path: Path) -> None:
    """An open whose decision holds nothing lets the file's copy go after its read; another open that re-admitted
    the file and wrote it while this one read keeps its copy."""
    from liquidfs.policy.next_epoch import Decision

    level, store = _level(tmp_path, 1.0)
    node = _node(5)
    read, opening = level.policy.read, store.open
    level.policy.read = lambda file, size, job=0: Decision(hit=False, hold=False, epoch=1)  # type: ignore[method-assign]

    def readmitted_meanwhile(n: Node) -> Content:
        level.policy.read = read  # type: ignore[method-assign]
        assert level.decide(n.id, SIZE).hold
        _readmit(level, n, bytes([5]) * SIZE)()
        return opening(n)

    store.open = readmitted_meanwhile  # type: ignore[method-assign]
    level.open(node)
    assert 5 in level.policy.held and 5 in level.held_items() and (level.dir / "5").exists()
    level.close()


@pytest.mark.parametrize("held_again", [True, False])
def test_a_hit_whose_open_fails_leaves_no_copy_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        held_again: bool) -> None:
    """A hit whose source is gone fails (FileNotFoundError): its copy goes with it, whether the policy holds the
    file again (its room, now empty) or not (it let the file go at this read: the copy stayed on the disk,
    counted by no budget, as no later open of the file was a hit that looked at it again)."""
    level, store = _level(tmp_path, 1.0)
    _epoch(level, random.Random(5))
    assert 9 in level.held_items()
    read = level.policy.read

    def read_of_9_not_held_again(file: int, *args: object) -> Decision:
        decision = read(file, *args)
        if file == 9 and not held_again:  # the policy lets it go at this read (its next use is too far)
            level.policy.drop(file)
            decision = dataclasses.replace(decision, hold=False)
        return decision

    monkeypatch.setattr(level.policy, "read", read_of_9_not_held_again)

    def gone(node: Node, st: object = None) -> str | None:
        raise FileNotFoundError(2, "No such file or directory", os.fsdecode(node.path))

    store.check_source = gone  # type: ignore[method-assign]
    with pytest.raises(FileNotFoundError):
        level.open(_node(9))
    assert 9 not in level.held_items() and 9 not in level.policy.held
    assert not any(p.name == "9" for p in tmp_path.rglob("*"))


def test_the_levels_directory_stays_open_until_a_write_under_way_ends(tmp_path: Path) -> None:
    """A storage call abandoned at its timeout may still be writing a file when the mount closes the level: its
    directory's descriptor, closed under it, could by then be the number of another directory, where root would
    make or remove files. Closed once that write ends; a write after the close is refused."""
    level, _ = _level(tmp_path, 1.0)
    writing = level._directory()
    dir_fd = writing.__enter__()  # a worker thread's write, under way
    level.close()
    os.fstat(dir_fd)  # still open: the write goes on where it began
    writing.__exit__(None, None, None)
    with pytest.raises(OSError) as info:
        os.fstat(dir_fd)
    assert info.value.errno == errno.EBADF
    assert not level._write(_node(3), Content(size=SIZE, raw=False, data=memoryview(b"x" * SIZE)))


def test_a_write_under_way_when_the_level_closes_keeps_nothing(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that took the directory before the close, and renamed its file after it, left a file in the
    directory the close had emptied (and its entry)."""
    level, _ = _level(tmp_path, 1.0)
    level.decide(3, SIZE)  # held by the policy
    writing = level._directory()
    dir_fd = writing.__enter__()
    digest = disk_module.private_digest

    def closed_meanwhile(data: object) -> object:
        # The close comes once the file is written, before its rename (it waits for this write to end to
        # close the descriptor): only the check at the rename can keep it out.
        level._closed = True
        return digest(data)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_module, "private_digest", closed_meanwhile)
    try:
        kept = level._write_in(dir_fd, 3, "3", "3.tmp-x", Content(size=SIZE, raw=False,
                                                                  data=memoryview(b"x" * SIZE)))
        assert not kept and "3" not in os.listdir(dir_fd) and 3 not in level.held_items()
    finally:
        writing.__exit__(None, None, None)


@pytest.mark.parametrize("worker", ["renames", "creates"])
def test_a_write_that_renames_while_the_close_empties_the_directory_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker: str) -> None:
    """A worker abandoned at its timeout renamed its file in after the close had listed the directory (the close
    said it was closed only at its end), or one that asked just before the close made its temporary file after
    the listing: the rmdir failed (ENOTEMPTY), and the directory, with cached bytes, outlived the unmount."""
    level, _ = _level(tmp_path, 1.0)
    level.decide(3, SIZE)  # held by the policy
    writing = level._directory()
    dir_fd = writing.__enter__()
    real_listdir = os.listdir
    kept: list[bool] = []

    def listed_then_written(path: object) -> list[str]:
        names = real_listdir(path)  # type: ignore[call-overload]
        if path == dir_fd and not kept:  # the close's listing: the worker writes right after it
            if worker == "renames":
                kept.append(level._write_in(dir_fd, 3, "3", "3.tmp-x", Content(size=SIZE, raw=False,
                                                                             data=memoryview(b"x" * SIZE))))
            else:
                os.close(os.open("3.tmp-y", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=dir_fd))
                kept.append(False)
        return names  # type: ignore[no-any-return]

    monkeypatch.setattr(os, "listdir", listed_then_written)
    try:
        level.close()
    finally:
        writing.__exit__(None, None, None)
        monkeypatch.undo()
    assert kept == [False] and not level.dir.exists()


def test_statistics_never_wait_for_a_worker_stuck_on_the_disk(tmp_path: Path) -> None:
    """They are asked on the trio loop (``/metrics``, the control file), and a worker holds the level's lock across
    the disk's renames and unlinks: on a disk that hangs the loop stopped, and every request of the mount with it.
    The last figures are told instead."""
    level, _ = _level(tmp_path, 1.0)
    level.open(_node(2))
    told = level.statistics()
    assert told.held_files == 1
    stuck, release = threading.Event(), threading.Event()

    def worker_on_a_hung_disk() -> None:
        with level._lock:
            level.hits += 1  # counted under the lock: told once it is let go
            stuck.set()
            release.wait(10)  # (past it, the statistics waited for the lock: they tell the new hit)

    worker = threading.Thread(target=worker_on_a_hung_disk)
    worker.start()
    try:
        assert stuck.wait(10)
        assert level.statistics() == told  # not waiting for the worker: it still holds the lock
    finally:
        release.set()
        worker.join()
    level.open(_node(3))
    assert level.statistics().held_files == 2 and level.statistics().hits == 1
    level.close()


def test_an_evicted_file_the_disk_will_not_remove_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Every unlink error was swallowed: on a disk that fails them (EIO, EROFS) the files the policy let go stayed,
    past --disk-cache-size, and nothing said so."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "a-directory").mkdir()
        assert not disk_module._unlink("a-directory", fd)  # EISDIR: not removed
        assert disk_module._unlink("never-there", fd)  # gone already: nothing to say
    finally:
        os.close(fd)
    level, _ = _level(tmp_path / "cache", 0.1)
    monkeypatch.setattr(disk_module, "_unlink", lambda name, dir_fd: False)
    with caplog.at_level("DEBUG", logger="liquidfs.held.disk"):
        rng = random.Random(4)
        for _ in range(3):  # files held for an epoch that passed are let go for the next ones
            _epoch(level, rng)
    said = [r for r in caplog.records if "cannot remove" in r.getMessage()]
    assert said and [r.levelname for r in said].count("WARNING") == 1, said
    level.close()


def test_the_daemon_checks_the_directory_it_sweeps_as_it_makes_its_own(tmp_path: Path) -> None:
    """The command checks --disk-cache before a scan that may take minutes, and a directory not there yet was not
    checked: made by someone else meanwhile (others may write it, not sticky), root swept it all the same."""
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o777)
    stale = root / "liquidfs-dead"
    stale.mkdir(mode=0o700)  # as a mount makes its own
    with pytest.raises(OSError, match="group or others may remove what a mount keeps there"):
        _level(root, 0.3)
    assert stale.is_dir()  # nothing swept
    root.chmod(0o1777)  # sticky, as /tmp
    level, _ = _level(root, 0.3)
    assert not stale.exists()
    level.close()


def test_a_full_disk_is_said_once_at_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A full cache disk fails every write: each was a warning (1,000 opens, 1,000 records); the first of a kind
    is, the rest are counted (``write_errors``) and said at debug."""
    import logging

    level, _ = _level(tmp_path, 1.0)

    def full(*args: object) -> bool:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(level, "_write_in", full)
    caplog.set_level(logging.DEBUG, logger="liquidfs.held.disk")
    _epoch(level, random.Random(7))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "cannot write" in r.getMessage()]
    assert len(warned) == 1 and level.write_errors == FILES
    level.close()


def test_a_root_renamed_and_replaced_by_a_link_while_the_level_starts_changes_nothing_of_where_it_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's emptyDir (0777) lets its writers rename the cache's root: renamed, and a link to their directory
    put at its name between the check and the making, root made its directory, its lock and every cached file
    where the link pointed. Everything below the root is reached through the descriptor held when it was
    judged."""
    volume = tmp_path / "volume"
    volume.mkdir()
    volume.chmod(0o777)
    root, moved, theirs = volume / "cache", volume / "cache-moved", tmp_path / "theirs"
    theirs.mkdir()
    sweep = disk_module._remove_stale

    def swap_then_sweep(*args: object) -> None:
        root.rename(moved)
        root.symlink_to(theirs)
        sweep(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_module, "_remove_stale", swap_then_sweep)
    level, _ = _level(root, 1.0)
    _epoch(level, random.Random(8))
    assert not list(theirs.iterdir())
    made = [p for p in moved.iterdir() if p.is_dir()]
    assert len(made) == 1 and len(list(made[0].iterdir())) == FILES
    level.close()
    assert not list(theirs.iterdir()) and not list(moved.iterdir())  # its directory and lock gone


def test_a_cache_root_named_through_a_link_is_the_directory_it_leads_to(tmp_path: Path) -> None:
    """``--disk-cache`` named through a link (to a directory root_refusal judges): the directory it leads to, as
    the command's check took it; never a mount that fails after its scan with "Not a directory"."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    level, _ = _level(tmp_path / "link", 1.0)
    _epoch(level, random.Random(9))
    made = [p for p in real.iterdir() if p.is_dir()]
    assert len(made) == 1 and len(list(made[0].iterdir())) == FILES
    level.close()
    assert not list(real.iterdir())


def test_a_held_file_is_charged_the_disk_blocks_it_takes(tmp_path: Path) -> None:
    """A 100-byte file takes a 4 KiB block of the disk: charged its bytes, a budget of 40 blocks held all 100
    such files (400 KiB on the disk, ten times what --disk-cache-size said). Charged whole blocks, 40 at most."""
    small = 100

    class SmallFiles(FakeStore):
        def open(self, node: Node) -> Content:
            return Content(size=small, raw=False, data=memoryview(bytes([node.id % 251]) * small))

    policy = NextEpochCache(40 * 4096, small * FILES, FILES, max_id=FILES + 1,
                            cost=DatasetCost(FILES, {1: small * FILES, 4096: 4096 * FILES}))
    level = DiskLevel(SmallFiles(), tmp_path, policy)
    for i in range(2, FILES + 2):
        level.open(dataclasses.replace(_node(i), size=small))
    kept = list(level.dir.iterdir())
    assert 0 < len(kept) <= 40 and sum(-(-f.stat().st_size // 4096) * 4096 for f in kept) <= 40 * 4096
    level.close()


def test_a_written_files_pages_are_let_go_again_once_its_writeback_had_time(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """POSIX_FADV_DONTNEED right after a buffered write drops none of the dirty pages (64 of 64 MiB stayed
    cached): a third copy of every file, charged to the sidecar's memory cgroup. The advice starts their
    writeback; it is given again at the next file's write, and at the close for the last; nothing stays open."""
    advised: list[int] = []  # the inode of each file advised
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            advised.append(os.fstat(fd).st_ino)
        real(fd, offset, length, advice)

    monkeypatch.setattr(disk_module.os, "posix_fadvise", recording)
    level, _ = _level(tmp_path, 1.0)
    level.open(_node(2))
    first = (level.dir / "2").stat().st_ino
    assert advised == [first]
    level.open(_node(3))
    second = (level.dir / "3").stat().st_ino
    assert advised == [first, second, first]  # the first's pages again, at the second's write
    before = len(os.listdir("/proc/self/fd"))
    level.close()
    assert advised[-1] == second and len(os.listdir("/proc/self/fd")) < before
