"""The catalog (``liquidfs.catalog``) on its own: built from an object store's listing, what it keeps of
expansions across rebuilds, schema upgrades, and the writers of a catalog in the making."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from forge import as_before_blake2b

from liquidfs import catalog as catalog_mod
from liquidfs.catalog import KIND_DIR, KIND_FILE, ROOT_ID, Catalog, _Writer, build, build_from_objects, open_or_build


def _tree(cat: Catalog) -> dict[bytes, tuple[int, int, int | None]]:
    rows = cat.db.execute("SELECT path, kind, size, nsubdirs, etag FROM nodes").fetchall()
    return {path: (kind, size, nsubdirs, etag) for path, kind, size, nsubdirs, etag in rows}


def test_catalog_from_a_listing(tmp_path: Path) -> None:
    listing = [
        ("train/aachen/a.png", 10, '"e1"', 1_000),
        ("train/aachen/b.png", 20, '"e2"', 3_000),
        ("train/bochum/c.png", 30, '"e3"', 2_000),
        ("empty-folder/", 0, '"d"', 500),          # a console's folder marker: an empty directory
        ("README.txt", 5, '"e4"', 100),
        ("bad//double-slash", 1, '"x"', 1),          # an empty component: cannot be a path
        ("bad/../escape", 1, '"x"', 1),
        ("README.txt/child", 1, '"x"', 1),           # below a file of the same name
        ("train", 1, '"x"', 1),                      # a file named like a directory
    ]
    report = build_from_objects(iter(listing), tmp_path, "s3://b/cs")
    assert (report.files, report.ignored) == (4, 4)
    cat = Catalog.open(tmp_path)
    try:
        tree = _tree(cat)
        assert tree[b""][0] == KIND_DIR and tree[b""][2] == 2  # train and empty-folder; nothing made for bad keys
        assert tree[b"train"][:3] == (KIND_DIR, 0, 2)
        assert tree[b"train/aachen/b.png"] == (KIND_FILE, 20, 0, '"e2"')
        assert tree[b"empty-folder"][0] == KIND_DIR
        assert b"bad/../escape" not in tree and b"README.txt/child" not in tree
        aachen = cat.lookup(cat.lookup(ROOT_ID, b"train").id, b"aachen")  # type: ignore[union-attr]
        assert aachen is not None and aachen.mtime_ns == 3_000  # a directory is as new as its newest object
        assert cat.meta("source") == "s3://b/cs" and cat.meta("source_kind") == "s3"
        assert cat.lookup(aachen.id, b"a.png").mode == catalog_mod.OBJECT_FILE_MODE  # type: ignore[union-attr]
    finally:
        cat.close()


def test_expansions_follow_the_etag(tmp_path: Path) -> None:
    """A rebuilt listing keeps an image raw only while its object has the ETag prepare expanded."""
    build_from_objects(iter([("a.png", 10, '"e1"', 1), ("b.png", 10, '"e2"', 1)]), tmp_path, "s3://b/x")
    cat = Catalog.open(tmp_path)
    cat.db.execute("INSERT INTO expansions VALUES (?,?,?,?,?,?,?,?,?,?)", (b"a.png", 10, 1, "png", "o/a", 99, "c", None, '"e1"', None))
    cat.db.execute("INSERT INTO expansions VALUES (?,?,?,?,?,?,?,?,?,?)", (b"b.png", 10, 1, "png", "o/b", 99, "c", None, '"e2"', None))
    cat.db.execute("UPDATE nodes SET repr=1, served_size=99, object='o/'||substr(name,1,1), checksum='c' WHERE kind=0")
    cat.close()
    # b.png was overwritten with content of the same size (and the same second): only its ETag tells.
    build_from_objects(iter([("a.png", 10, '"e1"', 1), ("b.png", 10, '"e9"', 1)]), tmp_path, "s3://b/x")
    cat = Catalog.open(tmp_path)
    try:
        served = dict(cat.db.execute("SELECT name, repr FROM nodes WHERE kind=0").fetchall())
        assert served == {b"a.png": 1, b"b.png": 0}
    finally:
        cat.close()


def test_version_1_catalogs_are_upgraded(tmp_path: Path) -> None:
    build_from_objects(iter([("a.png", 10, '"e1"', 1)]), tmp_path, "s3://b/x")
    path = tmp_path / catalog_mod.CATALOG_NAME
    db = sqlite3.connect(path)
    db.executescript(  # the tables as version 1 had them: without the ETag columns
        "CREATE TABLE n1 AS SELECT id, parent, name, path, kind, mode, size, mtime_ns, nsubdirs, target, repr, "
        "served_size, object, checksum FROM nodes; DROP TABLE nodes; ALTER TABLE n1 RENAME TO nodes; "
        "CREATE TABLE e1 AS SELECT path, src_size, src_mtime_ns, format, object, raw_size, checksum, reason "
        "FROM expansions; DROP TABLE expansions; ALTER TABLE e1 RENAME TO expansions;")
    db.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    db.commit()
    db.close()
    cat = Catalog.open(tmp_path, readonly=True)
    try:
        assert cat.meta("schema_version") == str(catalog_mod.SCHEMA_VERSION)
        assert cat.lookup(ROOT_ID, b"a.png").etag is None  # type: ignore[union-attr]
    finally:
        cat.close()


def test_a_local_catalog_of_version_2_is_rescanned_for_file_versions(tmp_path: Path) -> None:
    """Version 2 identified local files by size and mtime only: such a catalog is upgraded, then rescanned (its
    raw objects are not reused under the weaker identity) before anything serves or expands from it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    store = tmp_path / "store"
    open_or_build(src, store).close()
    db = sqlite3.connect(store / catalog_mod.CATALOG_NAME)
    db.execute("UPDATE nodes SET etag=NULL")
    db.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    db.execute("DELETE FROM meta WHERE key=?", (catalog_mod.FILE_IDENTITY,))
    db.commit()
    db.close()
    catalog = open_or_build(src, store)
    try:
        node = catalog.lookup(catalog_mod.ROOT_ID, b"a.txt")
        assert node is not None and node.etag == catalog_mod.file_version((src / "a.txt").stat())
        assert catalog.meta("schema_version") == str(catalog_mod.SCHEMA_VERSION)
    finally:
        catalog.close()


def test_a_catalog_with_xxh3_digests_serves_raw_only_objects_a_stamp_vouches_for(tmp_path: Path) -> None:
    """A catalog from before BLAKE2b (schema version 4) records xxh3 digests, which a writer of the store can match
    with other bytes: after the upgrade they vouch for no object touched since prepare (its original is served,
    with a reason that says to run prepare again). One whose stamp still vouches is served raw as before."""
    from liquidfs.prepare import prepare
    from liquidfs.stores.local.reader import StoreReader
    from sample import make_sample

    src = make_sample(tmp_path / "src", count=2, width=64, height=32, seed=4)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    assert as_before_blake2b(store) == 2
    catalog = Catalog.open(store, readonly=True)
    reader = StoreReader(catalog.source, store)
    try:
        kept, touched = [n for n in catalog.files() if n.served_raw]
        assert len(kept.checksum or "") == 16  # kept as it was: never taken for a BLAKE2b digest
        os.chmod(store / str(touched.object), 0o640)  # its bytes as they were, its stamp no longer vouching
        content = reader.open(touched)
        assert not content.raw and bytes(content.data or b"") == (src / os.fsdecode(touched.path)).read_bytes()
        assert content.fallback is not None and "liquidfs prepare" in content.fallback
        content.close()
        content = reader.open(kept)
        assert content.raw and bytes(content.data or b"") == (store / str(kept.object)).read_bytes()
        content.close()
        assert int(catalog.meta("schema_version") or 0) > 4  # a liquidfs that checks xxh3 refuses it now
    finally:
        reader.close()
        catalog.close()


def test_two_catalog_writers_on_one_store_in_one_pid_never_swap_each_others_work(tmp_path: Path) -> None:
    """Two prepares in different PID namespaces can have the same PID: their catalogs in the making used to be
    one file (``catalog.sqlite.new-<pid>``), so the second deleted the first's and the first renamed the
    second's half-written catalog into place."""
    store = tmp_path / "store"
    first, second = _Writer(store), _Writer(store)
    assert first.tmp != second.tmp
    first.finish({"writer": "first"})
    assert Catalog.open(store, readonly=True).meta("writer") == "first"
    second.finish({"writer": "second"})
    catalog = Catalog.open(store, readonly=True)
    assert catalog.meta("writer") == "second"
    catalog.close()
    assert sorted(p.name for p in store.iterdir()) == ["catalog.sqlite"]  # no lock or work file left


def test_an_abandoned_catalog_in_the_making_is_removed_a_live_one_is_not(tmp_path: Path) -> None:
    store = tmp_path / "store"
    alive = _Writer(store)
    dead = _Writer(store)
    dead.db.close()
    dead.lock.release(remove=False)  # as if its process died: the lock file stays, nobody holds it
    _Writer(store).finish({})
    names = {p.name for p in store.iterdir()}
    assert alive.tmp.name in names and dead.tmp.name not in names
    alive.finish({})


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
        row = catalog_mod.ExpansionRow(10, 1, "png", "o/a", 99, "c", None, '"e1"')
        with pytest.raises(sqlite3.OperationalError, match="^database or disk is full$"):
            cat.record_expansions([(b"a.png", row)])
        assert not cat.db.in_transaction
        cat.db = cat.db.db  # type: ignore[attr-defined]
        cat.record_expansions([(b"a.png", row)])  # the catalog is usable afterwards
        assert b"a.png" in cat.expansions()
    finally:
        cat.close()
