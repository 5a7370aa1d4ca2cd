"""The read side of a catalog (``catalog.catalog``): what it computes once, and what it records of expansions."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from liquidfs.catalog.build import build, build_from_objects
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import ExpansionRow
from liquidfs.catalog.schema import CatalogError


def test_an_immutable_catalogs_totals_are_computed_once(tmp_path: Path) -> None:
    """A mount's catalog never changes while open: the scan of every row behind ``file_totals`` (~1.4 s at ten
    million files, asked by the FUSE layer and the cache alike) is done once; a writable one is asked afresh."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"x" * 10)
    build(src, tmp_path / "store")
    queries: list[str] = []
    for immutable, scans in ((True, 1), (False, 2)):
        catalog = Catalog.open(tmp_path / "store", readonly=True, immutable=immutable)
        catalog.db.set_trace_callback(queries.append)
        assert catalog.file_totals() == catalog.file_totals() == (1, 10, 10, 2)
        assert sum("count(*)" in q for q in queries) == scans, queries
        catalog.close()
        queries.clear()


class _FullDisk:
    """A connection whose bulk insert meets a full disk as SQLite does: it rolls the transaction back itself,
    then raises."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)

    def executemany(self, sql: str, rows: object) -> sqlite3.Cursor:
        self.db.execute("ROLLBACK")
        raise sqlite3.OperationalError("database or disk is full")


def test_a_full_disk_while_recording_expansions_is_the_error_reported(tmp_path: Path) -> None:
    build_from_objects(iter([("a.png", 10, '"e1"', 1)]), tmp_path, "s3://b/x")
    cat = Catalog.open(tmp_path)
    try:
        cat.db = _FullDisk(cat.db)  # type: ignore[assignment]
        row = ExpansionRow(10, 1, "png", "o/a", 99, "c", None, '"e1"')
        with pytest.raises(sqlite3.OperationalError, match="^database or disk is full$"):
            cat.record_expansions([(b"a.png", row)])
        assert not cat.db.in_transaction
        cat.db = cat.db.db  # type: ignore[attr-defined]
        cat.record_expansions([(b"a.png", row)])  # the catalog is usable afterwards
        assert b"a.png" in cat.expansions()
    finally:
        cat.close()


def _select_raw_steps(tmp_path: Path, files: int) -> int:
    """SQLite's steps (thousands of its VM's instructions) for ``select_raw`` of every file of a tree of
    ``files``: the work itself, whatever the machine's speed."""
    src = tmp_path / f"src{files}"
    src.mkdir()
    for i in range(files):
        (src / f"{i:05d}.png").write_bytes(b"x")
    store = tmp_path / f"store{files}"
    build(src, store)
    catalog = Catalog.open(store)
    try:
        chosen = [(n.id, ExpansionRow(1, 0, "bmp", f"objects/00/{n.id:032x}.bmp", 3, "c" * 64, None, None))
                  for n in catalog.files()]
        steps = [0]

        def count() -> int:
            steps[0] += 1
            return 0

        catalog.db.set_progress_handler(count, 1000)
        catalog.select_raw(chosen, 1.0)
        catalog.db.set_progress_handler(None, 1000)
        assert sum(n.served_raw for n in catalog.files()) == files
        return steps[0]
    finally:
        catalog.close()


def test_the_selection_is_written_in_work_linear_in_the_files(tmp_path: Path) -> None:
    """Each selected file was updated by its path, which no index holds: every update read the whole table (a
    prepare of 20,000 images spent 23 s there; a million, days). Twice the files: about twice the work."""
    small, large = _select_raw_steps(tmp_path, 2000), _select_raw_steps(tmp_path, 4000)
    assert large < 3 * max(small, 1), (small, large)


def test_a_served_row_without_an_object_leaves_the_unused_objects_surplus(tmp_path: Path) -> None:
    """``x NOT IN (..., NULL)`` is never true: one served row with no object (none a build writes) made every
    object look served, and prepare removed none of them again, its store growing for good."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"x" * 10)
    build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store")
    with catalog.transaction():
        catalog.db.execute("INSERT INTO expansions(path, src_size, src_mtime_ns, object) VALUES (?, 1, 1, 'ab/unused')",
                           (b"gone",))
        catalog.db.execute("UPDATE nodes SET repr=1, object=NULL WHERE path=?", (b"a",))
    assert catalog.surplus_objects() == [(b"gone", "ab/unused")]
    catalog.close()


@pytest.mark.parametrize("readonly", [True, False])
def test_every_catalog_connection_checks_its_cells_and_runs_nothing_of_the_schema(tmp_path: Path,
                                                                                 readonly: bool) -> None:
    """A catalog is written by whoever can write the store: SQLite's advice for files from others."""
    src = tmp_path / "src"
    src.mkdir()
    build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=readonly)
    pragmas = {name: catalog.db.execute(f"PRAGMA {name}").fetchone()[0] for name in ("cell_size_check",
                                                                                      "trusted_schema")}
    assert pragmas == {"cell_size_check": 1, "trusted_schema": 0}
    catalog.close()


@pytest.mark.parametrize("readonly", [True, False])
def test_a_catalog_whose_path_is_not_utf8_is_refused_with_a_message(tmp_path: Path, readonly: bool) -> None:
    """SQLite takes a file's name as UTF-8: a store named in other bytes (``verify --store``, a default store
    under a cache directory of such a name) ended in a UnicodeEncodeError traceback."""
    src = tmp_path / "src"
    src.mkdir()
    build(src, tmp_path / "store")
    named = os.fsdecode(os.fsencode(str(tmp_path)) + b"/st\xff")
    os.rename(tmp_path / "store", named)
    with pytest.raises(CatalogError, match="the path is not UTF-8"):
        Catalog.open(named, readonly=readonly)
