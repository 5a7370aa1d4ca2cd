"""Building a catalog (``catalog.build``): from an object store's listing, what it keeps of expansions across
rebuilds, and the writers of a catalog in the making."""

from __future__ import annotations

from pathlib import Path

from liquidfs.catalog.build import OBJECT_FILE_MODE, _Writer, build_from_objects
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import KIND_DIR, KIND_FILE, ROOT_ID


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
        assert cat.lookup(aachen.id, b"a.png").mode == OBJECT_FILE_MODE  # type: ignore[union-attr]
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
