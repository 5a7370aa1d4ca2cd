"""Unit tests of the object-store pieces that need no server: URLs, catalogs from listings, schema upgrade."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from liquidfs import catalog as catalog_mod
from liquidfs.catalog import KIND_DIR, KIND_FILE, ROOT_ID, Catalog, CatalogError, build_from_objects
from liquidfs.s3 import S3Url
from liquidfs.stores.bucket import bucket_pair


def test_urls_parse_and_join() -> None:
    url = S3Url.parse("s3://datasets/cityscapes/")
    assert (url.bucket, url.prefix) == ("datasets", "cityscapes")
    assert str(url) == "s3://datasets/cityscapes"
    assert url.key(b"train/a.png") == "cityscapes/train/a.png"
    assert url.rel("cityscapes/train/a.png") == "train/a.png"
    whole = S3Url.parse("s3://datasets")
    assert whole.key("a.png") == "a.png" and str(whole) == "s3://datasets"
    with pytest.raises(ValueError):
        S3Url.parse("s3:///nobucket")
    with pytest.raises(ValueError):
        S3Url.parse("/local/dir")


def test_store_and_source_must_not_nest() -> None:
    assert bucket_pair("s3://b/cs", "s3://b/cs.liquid")[1].prefix == "cs.liquid"  # a sibling prefix is fine
    for store in ("s3://b/cs/liquid", "s3://b", "s3://b/cs"):
        with pytest.raises(CatalogError, match="contain"):
            bucket_pair("s3://b/cs", store)
    with pytest.raises(CatalogError, match="--store s3://"):
        bucket_pair("s3://b/cs", "/local/store")
    with pytest.raises(CatalogError, match="--store s3://"):
        bucket_pair("s3://b/cs", None)


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
