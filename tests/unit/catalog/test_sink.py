"""Where a catalog being built is written (``catalog.sink``): the helper process's failures reach the build as
one clear error, a failed build leaves the catalog it would have replaced, and no helper outlives its build."""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import pytest
from catalogs import written

from liquidfs.catalog import build as build_module
from liquidfs.catalog import sink as sink_module
from liquidfs.catalog.build import build, build_from_objects
from liquidfs.catalog.catalog import CATALOG_NAME, Catalog
from liquidfs.catalog.sink import HelperFailed, LocalSink, ProcessSink


def _tree(root: Path, files: int) -> Path:
    (root / "d").mkdir(parents=True)
    for i in range(files):
        (root / "d" / f"{i:04d}.png").write_bytes(b"")
    return root


def test_a_helper_runs_the_statements_it_is_sent_and_commits_them(tmp_path: Path) -> None:
    sink = ProcessSink(tmp_path / "c.sqlite")
    sink.script("CREATE TABLE t (a INTEGER, b BLOB, c TEXT); CREATE TABLE u (x);")
    sink.execute("BEGIN")
    sink.many("INSERT INTO t VALUES (?, ?, ?)", [(i, bytes([i % 256]), None if i % 2 else str(i)) for i in range(300)])
    sink.execute("CREATE INDEX t_a ON t(a)")
    sink.commit()
    db = sqlite3.connect(tmp_path / "c.sqlite")
    assert db.execute("SELECT count(*), sum(a), count(c) FROM t").fetchone() == (300, sum(range(300)), 150)
    assert db.execute("SELECT b FROM t WHERE a=299").fetchone() == (b"+",)
    db.close()


def test_a_statement_the_helper_cannot_run_fails_the_build_with_its_reason(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The error names SQLite's complaint; the catalog the build would have replaced stays, and nothing of the
    catalog in the making (its file, its lock) is left in the store."""
    src, store = _tree(tmp_path / "src", 30), tmp_path / "store"
    build(src, store)
    before = sorted(p.name for p in store.iterdir())
    (src / "d" / "new.png").write_bytes(b"")
    monkeypatch.setattr(build_module, "_BATCH", 8)
    monkeypatch.setattr(build_module, "usable_cores", lambda: 2)
    monkeypatch.setattr(build_module, "_INSERT_ENTRY", "INSERT INTO no_such_table VALUES (?)")
    with pytest.raises(HelperFailed, match="no such table: no_such_table"):
        build(src, store)
    assert sorted(p.name for p in store.iterdir()) == before == [CATALOG_NAME]
    catalog = Catalog.open(store, readonly=True)
    try:
        assert catalog.db.execute("SELECT count(*) FROM nodes WHERE name=?", (b"new.png",)).fetchone() == (0,)
    finally:
        catalog.close()


def test_a_helper_killed_from_outside_is_a_clear_error_not_a_broken_pipe(tmp_path: Path) -> None:
    sink = ProcessSink(tmp_path / "c.sqlite")
    sink.execute("CREATE TABLE t (a INTEGER)")
    os.kill(sink._process.pid, signal.SIGKILL)
    sink._process.wait()
    with pytest.raises(HelperFailed, match=f"exited with {-signal.SIGKILL}: no reason given"):
        sink.many("INSERT INTO t VALUES (?)", [(1,)])
    sink.abort()  # after its failure too: nothing left open


def test_a_helper_whose_builder_stops_before_the_commit_exits_having_committed_nothing(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    sink = ProcessSink(path)
    sink.execute("CREATE TABLE t (a INTEGER)")
    sink.execute("BEGIN")
    sink.many("INSERT INTO t VALUES (?)", [(1,)])
    sink._close_stdin()  # as when the builder dies: the pipe's end, and no commit
    assert sink._process.wait(timeout=30) == 1
    sink.abort()
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM t").fetchone() == (0,)
    db.close()


def test_an_aborted_build_leaves_no_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           helpers: list[ProcessSink]) -> None:
    """A build interrupted in its walk (here: a lstat that raises what no OSError handler catches) kills its
    helper and removes its catalog in the making."""
    src, store = _tree(tmp_path / "src", 30), tmp_path / "store"
    monkeypatch.setattr(build_module, "_BATCH", 8)
    monkeypatch.setattr(build_module, "usable_cores", lambda: 2)
    calls = iter(range(1000))

    def file_version(st: os.stat_result) -> str:
        if next(calls) == 20:
            raise KeyboardInterrupt
        return "v"

    monkeypatch.setattr(build_module, "file_version", file_version)
    with pytest.raises(KeyboardInterrupt):
        build(src, store)
    assert len(helpers) == 1 and helpers[0]._process.returncode is not None
    assert list(store.iterdir()) == []


def test_a_small_build_writes_in_its_own_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    monkeypatch.setattr(build_module, "ProcessSink", lambda path: made.append("helper"))
    monkeypatch.setattr(build_module, "LocalSink", lambda path: made.append("local") or LocalSink(path))
    build(_tree(tmp_path / "src", 30), tmp_path / "store")
    assert made == ["local"]


def test_an_object_stores_large_listing_goes_through_the_helper_as_a_small_one_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helpers: list[ProcessSink]) -> None:
    listing = [(f"train/c{i % 3}/{i:03d}.png", i, f'"e{i}"', 1_000 + i) for i in range(40)]
    build_from_objects(iter(listing), tmp_path / "small", "s3://b/x")
    monkeypatch.setattr(build_module, "_BATCH", 8)
    monkeypatch.setattr(build_module, "usable_cores", lambda: 2)
    build_from_objects(iter(listing), tmp_path / "large", "s3://b/x")
    assert len(helpers) == 1 and helpers[0]._process.returncode == 0
    assert written(tmp_path / "large") == written(tmp_path / "small")


def test_a_helper_that_cannot_start_leaves_the_build_to_its_own_process(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter starts but cannot run the script (here: a file that is not there): no word from it, so the
    build writes its rows itself, the same rows."""
    src = _tree(tmp_path / "src", 30)
    build(src, tmp_path / "small")
    monkeypatch.setattr(sink_module, "__file__", str(tmp_path / "no-such-helper.py"))
    with pytest.raises(OSError, match="no-such-helper.py"):
        ProcessSink(tmp_path / "c.sqlite")
    made: list[str] = []
    monkeypatch.setattr(build_module, "LocalSink", lambda path: made.append("local") or LocalSink(path))
    monkeypatch.setattr(build_module, "_BATCH", 8)
    monkeypatch.setattr(build_module, "usable_cores", lambda: 2)
    build(src, tmp_path / "large")
    assert made == ["local"]
    assert written(tmp_path / "large")[:2] == written(tmp_path / "small")[:2]


def test_a_link_planted_at_the_name_of_a_catalog_in_the_making_is_never_followed(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A store directory another user may write: they see the lock of a catalog in the making and plant a link at
    its name, to a file root would then make (``/etc/nologin``). The build refuses the name (it makes the file
    itself, where nothing was), and nothing is made where the link points."""
    store = tmp_path / "store"
    store.mkdir()
    target = tmp_path / "nologin"
    monkeypatch.setattr(build_module, "unique", lambda prefix: f"{prefix}0123456789abcdef")
    os.symlink(target, store / f"{CATALOG_NAME}.new-0123456789abcdef")
    with pytest.raises(FileExistsError):
        build(_tree(tmp_path / "src", 3), store)
    assert not target.exists() and not os.path.lexists(target)
    assert sorted(p.name for p in store.iterdir()) == [f"{CATALOG_NAME}.new-0123456789abcdef"]  # the link, as it was
