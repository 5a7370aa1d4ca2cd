"""Metadata read ahead (``lookahead.MetadataAhead``): a cold directory's files warmed once, in a worker thread,
bounded; and what ``warm`` does for the opens that follow."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from liquidfs.fuse import lookahead
from liquidfs.catalog.build import build
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import ROOT_ID, Node
from liquidfs.datapath.shared_inodes import SharedInodes
from liquidfs.fuse.lookahead import MetadataAhead
from liquidfs.stores.local.reader import StoreReader


def _tree(tmp_path: Path, dirs: int = 3, files: int = 5) -> Catalog:
    src = tmp_path / "src"
    for d in range(dirs):
        (src / f"d{d}").mkdir(parents=True)
        for f in range(files):
            (src / f"d{d}" / f"f{f}.bin").write_bytes(b"x" * 100)
    build(src, tmp_path / "store")
    return Catalog.open(tmp_path / "store", readonly=True)


def _dir(catalog: Catalog, name: bytes) -> int:
    found = catalog.lookup(ROOT_ID, name)
    assert found is not None
    return found.id


def test_a_cold_directory_is_warmed_once(tmp_path: Path) -> None:
    catalog = _tree(tmp_path)
    warmed: list[bytes] = []
    ahead = MetadataAhead(catalog.path, lambda node: warmed.append(node.path))
    d0, d1 = _dir(catalog, b"d0"), _dir(catalog, b"d1")
    for _ in range(4):  # every lookup in d0 reaches the daemon; the directory is warmed once
        ahead.looked_up(d0)
    ahead.looked_up(d1)
    ahead.stop()
    assert sorted(warmed) == sorted([b"d0/f%d.bin" % i for i in range(5)] + [b"d1/f%d.bin" % i for i in range(5)])
    assert ahead.statistics().values() == {"lookahead_directories": 2, "lookahead_files": 10,
                                          "lookahead_helper": 0, "lookahead_rows_hit": 0,
                                          "lookahead_left_to_others": 0}


def test_a_directorys_files_are_warmed_in_parallel(tmp_path: Path) -> None:
    """Each warm waits until ``WARMERS`` of them wait together: warmed one after another, the first would wait
    alone until its barrier broke."""
    catalog = _tree(tmp_path, dirs=1, files=3 * lookahead.WARMERS)
    together = threading.Barrier(lookahead.WARMERS, timeout=20)
    warmed: list[bytes] = []

    def warm(node) -> None:
        together.wait()
        warmed.append(node.path)

    ahead = MetadataAhead(catalog.path, warm)
    ahead.looked_up(_dir(catalog, b"d0"))
    ahead.stop()
    assert not together.broken and len(warmed) == 3 * lookahead.WARMERS
    assert ahead.statistics().values() == {"lookahead_directories": 1, "lookahead_files": 3 * lookahead.WARMERS,
                                          "lookahead_helper": 0, "lookahead_rows_hit": 0,
                                          "lookahead_left_to_others": 0}


def test_each_thread_warms_a_run_of_neighbours_in_the_directorys_order(tmp_path: Path) -> None:
    """Threads on neighbouring files contend for the same inode blocks (``lookahead.WARMERS``): each thread takes
    a run of the directory's files, one after another, not every n-th file."""
    files = 5 * lookahead.WARMERS
    catalog = _tree(tmp_path, dirs=1, files=files)
    together = threading.Barrier(lookahead.WARMERS, timeout=20)  # and still all threads at once
    by_thread: dict[int, list[int]] = {}

    def warm(node) -> None:
        mine = by_thread.setdefault(threading.get_ident(), [])
        if not mine:
            together.wait()
        mine.append(node.id)

    ahead = MetadataAhead(catalog.path, warm)
    ahead.looked_up(_dir(catalog, b"d0"))
    ahead.stop()
    assert not together.broken and len(by_thread) == lookahead.WARMERS
    order = sorted(i for ids in by_thread.values() for i in ids)  # the directory's order: its rows' ids
    assert len(order) == files
    for ids in by_thread.values():
        start = order.index(ids[0])
        assert ids == order[start:start + len(ids)] and len(ids) == 5, by_thread


def test_a_directory_is_warmed_again_after_a_while_and_the_queue_is_bounded(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = _tree(tmp_path, dirs=lookahead.MAX_QUEUED + 10, files=1)
    release = threading.Event()
    warmed: list[bytes] = []

    def slow(node) -> None:
        release.wait(10)
        warmed.append(node.path)

    ahead = MetadataAhead(catalog.path, slow)
    monkeypatch.setattr(lookahead, "AGAIN_AFTER", 0.0)  # a directory may be warmed again at once
    d0 = _dir(catalog, b"d0")
    for _ in range(3):
        ahead.looked_up(d0)  # queued once: a directory queued or being warmed is not queued again
    for d in range(1, lookahead.MAX_QUEUED + 10):
        ahead.looked_up(_dir(catalog, b"d%d" % d))  # the worker is stuck on d0: the queue fills to its bound
    release.set()
    ahead.stop()
    assert len(warmed) == lookahead.MAX_QUEUED  # the first taken by the worker, the rest queued behind it
    assert warmed.count(b"d0/f0.bin") == 1


def _settle(ahead: MetadataAhead) -> None:
    """The warms queued done: the worker ends after what is queued, and starts anew at the next."""
    ahead._queue.put(None)
    assert ahead._thread is not None
    ahead._thread.join(10)
    ahead._thread = None


def test_an_open_gone_cold_warms_its_directory_again_unless_warmed_just_now(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A LOOKUP warms a directory once a minute; an open that found its source's inode cold (the kernel dropped
    what the last warm brought in) warms it again, once the last warm ended ``AGAIN_DROPPED`` seconds ago (not
    ``AGAIN_COLD``: that warm warmed every file, so the kernel dropped them since)."""
    catalog = _tree(tmp_path, dirs=1, files=2)
    warmed: list[bytes] = []
    ahead = MetadataAhead(catalog.path, lambda node: warmed.append(node.path))
    d0 = _dir(catalog, b"d0")
    [f0, _] = catalog.children(d0)
    monkeypatch.setattr(lookahead, "AGAIN_DROPPED", 60.0)
    monkeypatch.setattr(lookahead, "AGAIN_COLD", 60.0)
    ahead.looked_up(d0)
    _settle(ahead)
    ahead.looked_up(d0)  # within AGAIN_AFTER: no second warm for a LOOKUP
    ahead.went_cold(f0)  # within AGAIN_DROPPED of the warm's end: none either
    if ahead._thread is not None:
        _settle(ahead)
    assert len(warmed) == 2
    monkeypatch.setattr(lookahead, "AGAIN_DROPPED", 0.0)
    ahead.went_cold(f0)  # AGAIN_COLD has not passed: a whole warm's drop is not held to it
    _settle(ahead)
    assert len(warmed) == 4 and ahead.statistics().values()["lookahead_directories"] == 2
    ahead.stop()


def test_a_directory_whose_warm_left_a_file_cold_is_warmed_again_only_after_again_cold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose warm fails (gone, refused) has every open go cold, whatever is warmed: after such a warm, an
    open gone cold warms the directory again only ``AGAIN_COLD`` after it, not ``AGAIN_DROPPED``, or each of
    those opens would warm the whole directory again."""
    catalog = _tree(tmp_path, dirs=1, files=3)
    warmed: list[bytes] = []

    def warm(node) -> None:
        if node.path.endswith(b"f1.bin"):
            raise OSError(2, "gone")
        warmed.append(node.path)

    ahead = MetadataAhead(catalog.path, warm)
    d0 = _dir(catalog, b"d0")
    f1 = catalog.lookup(d0, b"f1.bin")
    assert f1 is not None
    monkeypatch.setattr(lookahead, "AGAIN_DROPPED", 0.0)
    monkeypatch.setattr(lookahead, "AGAIN_COLD", 60.0)
    ahead.looked_up(d0)
    _settle(ahead)
    assert len(warmed) == 2
    ahead.went_cold(f1)
    assert ahead._thread is None and len(warmed) == 2  # nothing queued
    monkeypatch.setattr(lookahead, "AGAIN_COLD", 0.0)
    ahead.went_cold(f1)
    _settle(ahead)
    assert len(warmed) == 4
    ahead.stop()


def test_a_warm_that_fails_costs_only_the_hint(tmp_path: Path) -> None:
    catalog = _tree(tmp_path, dirs=1, files=3)

    def broken(node) -> None:
        raise OSError(5, "gone")

    ahead = MetadataAhead(catalog.path, broken)
    ahead.looked_up(_dir(catalog, b"d0"))
    ahead.stop()
    assert ahead.statistics().values() == {"lookahead_directories": 1, "lookahead_files": 0,
                                          "lookahead_helper": 0, "lookahead_rows_hit": 0,
                                          "lookahead_left_to_others": 0}


@pytest.mark.needs_root("/proc/sys/vm/drop_caches")
def test_warm_brings_what_an_open_on_the_loop_walks_into_the_kernels_caches(tmp_path: Path) -> None:
    catalog = _tree(tmp_path, dirs=1, files=1)
    reader = StoreReader(catalog.source, tmp_path / "store")
    node = catalog.lookup(_dir(catalog, b"d0"), b"f0.bin")
    assert node is not None
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2\n")  # dentries and inodes
    with pytest.raises(BlockingIOError):
        reader.open_source(node, cached_only=True)  # cold: the loop would hand this open to a thread
    reader.warm(node)
    os.close(reader.open_source(node, cached_only=True))  # warm: answered on the loop
    reader.close()


def test_the_rows_read_ahead_answer_the_lookups_that_follow_once_each_and_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = _tree(tmp_path, dirs=2, files=5)
    ahead = MetadataAhead(catalog.path, lambda node: None, catalog_id=catalog.file_id)
    d0, d1 = _dir(catalog, b"d0"), _dir(catalog, b"d1")
    ahead.looked_up(d0)
    ahead.stop()
    for f in range(5):  # the very rows a query finds, each taken once
        assert ahead.row(d0, b"f%d.bin" % f) == catalog.lookup(d0, b"f%d.bin" % f)
        assert ahead.row(d0, b"f%d.bin" % f) is None
    assert ahead.row(d1, b"f0.bin") is None  # a directory not read ahead
    assert ahead.statistics().values()["lookahead_rows_hit"] == 5
    monkeypatch.setattr(lookahead, "HOT_ROWS", 3)
    bounded = MetadataAhead(catalog.path, lambda node: None, catalog_id=catalog.file_id)
    bounded.looked_up(d0)
    bounded.looked_up(d1)
    bounded.stop()
    kept = [(d, f) for d in (d0, d1) for f in range(5) if bounded.row(d, b"f%d.bin" % f) is not None]
    assert kept == [(d1, 2), (d1, 3), (d1, 4)]  # the newest


def test_a_lookup_after_the_read_ahead_asks_nothing_of_the_catalog(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import pyfuse3
    import trio

    from operations import daemon_operations

    catalog = _tree(tmp_path, dirs=1, files=4)
    ops = daemon_operations(catalog, StoreReader(catalog.source, tmp_path / "store"))
    ops.lookahead = MetadataAhead(catalog.path, lambda node: None, catalog_id=catalog.file_id)
    ctx = pyfuse3.RequestContext()
    d0 = trio.run(ops.lookup, ROOT_ID, b"d0", ctx).st_ino
    first = trio.run(ops.lookup, d0, b"f0.bin", ctx)  # a cold directory: read ahead, its rows kept
    ops.lookahead.stop()
    asked: list[bytes] = []
    query = catalog.lookup
    monkeypatch.setattr(catalog, "lookup", lambda parent, name: asked.append(name) or query(parent, name))
    entries = [trio.run(ops.lookup, d0, b"f%d.bin" % f, ctx) for f in range(4)]
    assert asked == []  # every file's row was read ahead when f0.bin's lookup found the directory cold
    assert [e.st_ino for e in entries] == [n.id for n in sorted(catalog.children(d0), key=lambda n: n.name)]
    assert entries[0].st_size == first.st_size == 100 and all(e.st_size == 100 for e in entries)


def test_rows_of_a_catalog_replaced_since_the_mount_opened_its_own_answer_no_lookup(tmp_path: Path) -> None:
    # prepare renames a new catalog over the path while a mount runs: a file added before d0's shifts every id
    # after it, and a row of the new file would hand the kernel another file's inode. The warms still happen.
    catalog = _tree(tmp_path, dirs=1, files=3)
    assert catalog.file_id is not None
    d0 = _dir(catalog, b"d0")
    (tmp_path / "src" / "a0.bin").write_bytes(b"new")
    build(tmp_path / "src", tmp_path / "store")
    warmed: list[bytes] = []
    ahead = MetadataAhead(catalog.path, lambda node: warmed.append(node.path), catalog_id=catalog.file_id)
    ahead.looked_up(d0)  # d0's id in the mount's catalog; the new file's d0 has another
    newer = Catalog.open(tmp_path / "store", readonly=True)
    ahead.looked_up(_dir(newer, b"d0"))
    ahead.stop()
    assert sorted(warmed) == [b"d0/f%d.bin" % f for f in range(3)]  # warmed all the same
    for parent in (d0, _dir(newer, b"d0")):
        assert all(ahead.row(parent, b"f%d.bin" % f) is None for f in range(3))
    assert newer.file_id != catalog.file_id


def _one_of_loops(catalog: Catalog, shared: SharedInodes, clock: list[float],
                  warm: Callable[[Node], None]) -> MetadataAhead:
    """A loop's read-ahead (``mount --loops``) joined to the others through ``shared``, on the clock ``clock``."""
    ahead = MetadataAhead(catalog.path, warm, catalog_id=catalog.file_id)
    ahead.join_loops(lambda directory, within: shared.claim_directory(directory, clock[0], within,
                                                                       lookahead.WARM_CLAIM),
                     lambda directory, rest: shared.directory_warmed(directory, clock[0] + rest))
    return ahead


def test_loops_warm_a_directory_once_and_each_keeps_its_rows(tmp_path: Path) -> None:
    """mount --loops: the lookups of one directory reach every loop; one loop reads its inodes from the disk
    (each had, at once, with its helper's threads contending for the same inode blocks), and every loop keeps the
    rows for its own lookups that follow there. An open gone cold in another loop re-warms it only once that
    warm has ended, ``AGAIN_COLD`` after it."""
    catalog = _tree(tmp_path, dirs=1, files=5)
    shared = SharedInodes(2)
    clock = [100.0]
    warmed: list[tuple[int, bytes]] = []
    first_warm_started, first_warm_may_end = threading.Event(), threading.Event()

    def warm(index: int, node) -> None:
        if index == 0:
            first_warm_started.set()
            first_warm_may_end.wait(20)
        warmed.append((index, node.path))

    def loop(index: int) -> MetadataAhead:
        return _one_of_loops(catalog, shared, clock, lambda node: warm(index, node))

    d0 = _dir(catalog, b"d0")
    f0 = catalog.lookup(d0, b"f0.bin")
    assert f0 is not None
    first = loop(0)
    first.looked_up(d0)
    assert first_warm_started.wait(20)  # loop 0 claimed d0 and is warming it
    second = loop(1)
    second.looked_up(d0)  # the same directory's lookups reach the other loop: its rows only
    second.stop()
    assert second.row(d0, b"f1.bin") == catalog.lookup(d0, b"f1.bin")
    assert second.statistics().values()["lookahead_left_to_others"] == 1
    # loop 0's warm is still running, longer than AGAIN_COLD: an open gone cold in loop 1 leaves it to loop 0
    clock[0] += lookahead.AGAIN_COLD + 0.5
    cold = loop(1)
    cold.went_cold(f0)
    cold.stop()
    assert warmed == []
    first_warm_may_end.set()
    first.stop()
    assert sorted(path for _, path in warmed) == [b"d0/f%d.bin" % i for i in range(5)]
    assert {index for index, _ in warmed} == {0}
    assert first.row(d0, b"f1.bin") == catalog.lookup(d0, b"f1.bin")
    # once it ended, a cold open in loop 1 more than AGAIN_COLD later warms it there
    clock[0] += lookahead.AGAIN_COLD + 0.5
    again = loop(1)
    again.went_cold(f0)
    again.stop()
    assert len([1 for index, _ in warmed if index == 1]) == 5


def test_loops_wait_out_the_rest_after_a_warm_another_loop_took_long_over(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """mount --loops: a directory whose warm took long rests ``RESTS`` times as long after it in every loop, not
    only in the one that warmed it: another loop's cold open a second after it ended had warmed it again."""
    from types import SimpleNamespace

    catalog = _tree(tmp_path, dirs=1, files=2)
    shared = SharedInodes(2)
    clock = [100.0]
    monkeypatch.setattr(lookahead, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    warmed: list[int] = []

    def warm(index: int) -> None:
        warmed.append(index)
        clock[0] += 1.5  # 3 s a warm of its two files: it rests 12 s

    def loop(index: int) -> MetadataAhead:
        return _one_of_loops(catalog, shared, clock, lambda node: warm(index))

    d0 = _dir(catalog, b"d0")
    f0 = catalog.lookup(d0, b"f0.bin")
    assert f0 is not None
    first = loop(0)
    first.looked_up(d0)
    first.stop()
    assert warmed == [0, 0]
    clock[0] = 105.0  # past AGAIN_COLD after its end, within its rest
    other = loop(1)
    other.went_cold(f0)
    other.stop()
    assert warmed == [0, 0] and other.statistics().values()["lookahead_left_to_others"] == 1
    clock[0] = 116.5
    later = loop(1)
    later.went_cold(f0)
    later.stop()
    assert warmed.count(1) == 2


def test_re_warms_asked_for_soon_after_one_another_back_off_and_start_anew_after_a_quiet_while(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel drops a directory's inodes as fast as they are read, every open there goes cold soon
    after each warm: each re-warm asked for within twice ``AGAIN_COLD`` of the last warm's end doubles the bound
    (``AGAIN_DROPPED`` up to ``AGAIN_COLD``: then no more warms than one a second), and one asked for later (a
    drop of its own) is held to ``AGAIN_DROPPED`` again. Cold opens every 0.25 s (or every 0.9 s) for 20 s warm
    it at most once a second once the bound has grown."""
    from types import SimpleNamespace

    catalog = _tree(tmp_path, dirs=1, files=2)
    clock = [100.0]
    monkeypatch.setattr(lookahead, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    warms: list[float] = []  # when each warm of the directory ran (its first file)
    ahead = MetadataAhead(catalog.path, lambda node: node.name == b"f0.bin" and warms.append(clock[0]))
    d0 = _dir(catalog, b"d0")
    f0 = catalog.lookup(d0, b"f0.bin")
    assert f0 is not None
    ahead.looked_up(d0)
    _settle(ahead)  # a whole warm, ended at 100.0

    def cold_at(moment: float) -> bool:
        """Whether an open gone cold at ``moment`` warms the directory again."""
        clock[0] = moment
        before = len(warms)
        ahead.went_cold(f0)
        if ahead._thread is not None:
            _settle(ahead)
        return len(warms) > before

    assert not cold_at(100.05)       # within AGAIN_DROPPED (0.1)
    assert cold_at(100.15)           # right at it: the bound doubles to 0.2
    assert not cold_at(100.3)        # 0.15 after that warm's end
    assert cold_at(100.36)           # 0.21: the bound doubles to 0.4
    assert not cold_at(100.7)
    assert cold_at(100.77)           # 0.41: 0.8
    assert cold_at(101.6)            # 0.83: 1.0, AGAIN_COLD, and no more
    assert not cold_at(102.5)
    assert cold_at(102.65)           # 1.05: still 1.0
    assert not cold_at(103.5)
    assert cold_at(110.0)            # well after (two seconds or more): a drop of its own, the bound back to 0.1
    assert cold_at(110.15)
    assert len(warms) == 8
    # The kernel drops the directory constantly, and its opens come every 0.25 s, or every 0.9 s, for 20 s.
    for start, spacing, opens in ((120.0, 0.25, 81), (150.0, 0.9, 23)):
        warmed_before = len(warms)
        rewarmed = [moment for moment in (start + spacing * i for i in range(opens)) if cold_at(moment)]
        assert len(warms) - warmed_before == len(rewarmed)
        assert len(rewarmed) <= 20 + 4, rewarmed  # one a second, and the bound's growth at first
        assert all(later - earlier >= 0.99 for earlier, later in itertools.pairwise(rewarmed[4:])), rewarmed
    ahead.stop()


def test_a_directory_whose_warm_took_long_rests_four_times_as_long_before_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flat directory of a million files takes a long while to warm: neither its LOOKUPs (each file's first
    reaches the daemon in the first epoch) nor its opens gone cold warm it again before ``RESTS`` times as long
    as the last warm took has passed since it ended. A short warm is held only to the other bounds."""
    from types import SimpleNamespace

    catalog = _tree(tmp_path, dirs=1, files=2)
    clock = [100.0]
    monkeypatch.setattr(lookahead, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(lookahead, "AGAIN_AFTER", 0.0)
    monkeypatch.setattr(lookahead, "AGAIN_DROPPED", 0.0)
    monkeypatch.setattr(lookahead, "AGAIN_COLD", 0.5)
    step = [1.5]  # the clock's seconds a file's warm takes
    warms: list[float] = []  # when each warm of the directory began (its first file)

    def warm(node) -> None:
        if node.name == b"f0.bin":
            warms.append(clock[0])
        clock[0] += step[0]

    ahead = MetadataAhead(catalog.path, warm)
    d0 = _dir(catalog, b"d0")
    f0 = catalog.lookup(d0, b"f0.bin")
    assert f0 is not None

    def asked_at(moment: float, ask: Callable[[], None]) -> bool:
        """Whether ``ask`` at ``moment`` warms the directory again."""
        clock[0] = moment
        before = len(warms)
        ask()
        if ahead._thread is not None:
            _settle(ahead)
        return len(warms) > before

    lookup, cold = (lambda: ahead.looked_up(d0)), (lambda: ahead.went_cold(f0))
    assert asked_at(100.0, lookup)  # 3 s a warm (two files, 1.5 s each): ended at 103, rests 12 s
    assert not asked_at(104.0, lookup) and not asked_at(114.9, cold) and not asked_at(114.9, lookup)
    step[0] = 0.01
    assert asked_at(115.1, cold)  # 0.02 s a warm: no rest past the other bounds
    assert asked_at(115.2, lookup) and asked_at(115.3, cold)
    assert len(warms) == 4
    ahead.stop()


def test_a_read_ahead_that_cannot_start_its_thread_or_open_the_catalog_is_off_never_a_failed_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A hint's failure costs the hint: no thread to be had (a pids limit), or a catalog its thread cannot open
    (descriptors short). The lookup that asked goes on, nothing stays queued for good, and the unmount's stop
    does not fail on a thread never started."""
    catalog = _tree(tmp_path)
    d0, d1 = _dir(catalog, b"d0"), _dir(catalog, b"d1")
    warmed: list[bytes] = []
    start = threading.Thread.start

    def no_thread(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    ahead = MetadataAhead(catalog.path, lambda node: warmed.append(node.path))
    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", no_thread)
        ahead.looked_up(d0)
    ahead.looked_up(d1)  # off for good: no thread tried again at each lookup
    ahead.stop()
    assert warmed == [] and not ahead._busy and threading.Thread.start is start

    ahead = MetadataAhead(tmp_path / "gone" / "catalog.sqlite", lambda node: warmed.append(node.path))
    ahead.looked_up(d0)
    assert ahead._thread is not None
    ahead._thread.join(10)
    ahead.looked_up(d1)
    ahead.stop()
    assert warmed == [] and not ahead._busy
    assert sum("the mount goes on without it" in r.getMessage() for r in caplog.records) == 2


def test_directories_that_no_longer_decide_anything_are_forgotten(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory a sample: millions of them looked up once. Past REMEMBERED_DIRECTORIES, those looked up
    longer than AGAIN_AFTER ago (and warmed longer than twice AGAIN_COLD ago) are dropped, recent ones kept."""
    monkeypatch.setattr(lookahead, "REMEMBERED_DIRECTORIES", 4)
    catalog = _tree(tmp_path, dirs=4, files=1)
    dirs = [_dir(catalog, b"d%d" % d) for d in range(4)]
    ahead = MetadataAhead(catalog.path, lambda node: None)
    ahead._warmed_prune_at = ahead._done_prune_at = 4
    long_ago = lookahead.time.monotonic() - lookahead.AGAIN_AFTER - 1
    old = range(10_000, 10_004)  # directories of an hour before
    ahead._warmed_at.update(dict.fromkeys(old, long_ago))
    ahead._done_at.update(dict.fromkeys(old, long_ago))
    ahead._whole.update(old)
    ahead._again.update(dict.fromkeys(old, 0.2))
    for d in dirs:
        ahead.looked_up(d)
    ahead.stop()
    assert set(ahead._warmed_at) == set(dirs) and set(ahead._done_at) == set(dirs)
    assert not ahead._whole & set(old) and not ahead._again.keys() & set(old)


def test_a_warm_that_failed_rests_nothing_and_no_rest_is_past_max_rest(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm that stalled on storage, then failed, held the directory off four times as long (in every loop);
    and an hour's stall held it off four hours. A failure rests nothing; no rest is past ``MAX_REST``."""
    from types import SimpleNamespace

    assert lookahead._rest_after(3600.0) == lookahead.MAX_REST and lookahead._rest_after(0.1) == 0.0
    catalog = _tree(tmp_path, dirs=1, files=2)
    clock = [100.0]
    monkeypatch.setattr(lookahead, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(lookahead, "AGAIN_AFTER", 0.0)
    rests: list[float] = []

    def stalls_then_fails(node: object) -> None:
        clock[0] += 100.0
        raise RuntimeError("a helper's bug")  # (not an OSError: the warm of the directory fails)

    ahead = MetadataAhead(catalog.path, stalls_then_fails)
    ahead.join_loops(lambda directory, within: True, lambda directory, rest: rests.append(rest))
    monkeypatch.setattr(ahead, "_warm_directory", lambda *args, **kwargs: stalls_then_fails(None))
    d0 = _dir(catalog, b"d0")
    ahead.looked_up(d0)
    _settle(ahead)
    assert rests == [0.0] and not ahead._rest_until  # another warm may come at once
    ahead.stop()
