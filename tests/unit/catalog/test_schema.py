"""A catalog's schema (``catalog.schema``): catalogs of older versions upgraded, and what they still vouch for."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pytest
from forge import as_before_blake2b

from liquidfs.catalog.build import build_from_objects, open_or_build
from liquidfs.catalog.catalog import CATALOG_NAME, Catalog
from liquidfs.catalog.identity import file_version
from liquidfs.catalog.nodes import ROOT_ID
from liquidfs.catalog.schema import FILE_IDENTITY, SCHEMA_VERSION, CatalogError


def _version_1(store: Path) -> None:
    """A catalog in ``store`` as version 1 wrote it."""
    build_from_objects(iter([("a.png", 10, '"e1"', 1)]), store, "s3://b/x")
    db = sqlite3.connect(store / CATALOG_NAME)
    db.executescript(  # the tables as version 1 had them: without the ETag columns
        "CREATE TABLE n1 AS SELECT id, parent, name, path, kind, mode, size, mtime_ns, nsubdirs, target, repr, "
        "served_size, object, checksum FROM nodes; DROP TABLE nodes; ALTER TABLE n1 RENAME TO nodes; "
        "CREATE TABLE e1 AS SELECT path, src_size, src_mtime_ns, format, object, raw_size, checksum, reason "
        "FROM expansions; DROP TABLE expansions; ALTER TABLE e1 RENAME TO expansions;")
    db.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    db.commit()
    db.close()


def test_version_1_catalogs_are_upgraded(tmp_path: Path) -> None:
    _version_1(tmp_path)
    cat = Catalog.open(tmp_path, readonly=True)
    try:
        assert cat.meta("schema_version") == str(SCHEMA_VERSION)
        assert cat.lookup(ROOT_ID, b"a.png").etag is None  # type: ignore[union-attr]
    finally:
        cat.close()


@pytest.mark.needs_root("a chown of the store to another user")
def test_a_catalog_is_upgraded_in_place_only_where_this_user_may_write_its_store(tmp_path: Path) -> None:
    """An upgrade writes the catalog, and SQLite's journal beside it, by name: not in a store whose owner (or
    group, or others) may make names there that root would write through."""
    store = tmp_path / "store"
    _version_1(store)
    os.chown(store, 65534, 65534)
    with pytest.raises(CatalogError, match=f"{re.escape(str(store))}: owned by uid 65534"):
        Catalog.open(store, readonly=True)
    with sqlite3.connect(store / CATALOG_NAME) as db:
        assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("1",)
    os.chown(store, 0, 0)
    store.chmod(0o770)
    with pytest.raises(CatalogError, match="group or others may write it"):
        Catalog.open(store, readonly=True)
    store.chmod(0o700)
    Catalog.open(store, readonly=True).close()


def test_a_local_catalog_of_version_2_is_rescanned_for_file_versions(tmp_path: Path) -> None:
    """Version 2 identified local files by size and mtime only: such a catalog is upgraded, then rescanned (its
    raw objects are not reused under the weaker identity) before anything serves or expands from it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    store = tmp_path / "store"
    open_or_build(src, store).close()
    db = sqlite3.connect(store / CATALOG_NAME)
    db.execute("UPDATE nodes SET etag=NULL")
    db.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    db.execute("DELETE FROM meta WHERE key=?", (FILE_IDENTITY,))
    db.commit()
    db.close()
    catalog = open_or_build(src, store)
    try:
        node = catalog.lookup(ROOT_ID, b"a.txt")
        assert node is not None and node.etag == file_version((src / "a.txt").stat())
        assert catalog.meta("schema_version") == str(SCHEMA_VERSION)
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


def test_a_catalog_whose_schema_version_is_no_number_is_refused_in_one_line_and_replaced(tmp_path: Path) -> None:
    """The catalog may be anyone's: a version that is not a number is no version this liquidfs reads (a
    CatalogError saying so, not a ValueError), and a rescan replaces it, carrying nothing over from it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(b"png")
    open_or_build(src, tmp_path / "store").close()
    path = tmp_path / "store" / CATALOG_NAME
    for value in ("x", "5.5", b"5"):
        db = sqlite3.connect(path)
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (value,))
        db.commit()
        db.close()
        with pytest.raises(CatalogError, match="schema version"):
            Catalog.open(tmp_path / "store", readonly=True)
        open_or_build(src, tmp_path / "store", rescan=True).close()  # the carry-over skips it
        catalog = Catalog.open(tmp_path / "store", readonly=True)
        assert catalog.meta("schema_version") == str(SCHEMA_VERSION) and catalog.lookup(ROOT_ID, b"a.png")
        catalog.close()


@pytest.mark.needs_root("a chown of the directory above the store to another user")
def test_no_catalog_is_written_in_a_store_another_user_may_move_away(tmp_path: Path) -> None:
    """Root's store in a directory another user owns (their home), or one group or others may write without the
    sticky bit: they may rename the store and put a directory of theirs at its name, with a link where SQLite opens
    the catalog in the making by name. Refused for writing; a sticky directory (/tmp) does not let them."""
    from liquidfs.catalog.build import open_or_build
    from liquidfs.catalog.store_dir import refusal

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    home = tmp_path / "home"
    store = home / "deeper" / "store"
    store.mkdir(parents=True, mode=0o700)
    os.chown(home, 65534, 65534)
    with pytest.raises(CatalogError, match=f"{re.escape(str(home))} is owned by uid 65534, who may move the store"):
        open_or_build(src, store)
    assert not any(store.iterdir())
    assert refusal(store, writing=False) is None  # taken as another user's store is: read, never written
    os.chown(home, 0, 0)
    home.chmod(0o777)
    assert "group or others may write" in str(refusal(store, writing=True))
    home.chmod(0o1777)  # sticky: others cannot rename root's directory in it
    open_or_build(src, store).close()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / "link").symlink_to(store)  # the store named through a link others may replace
    assert "group or others may write" in str(refusal(shared / "link", writing=True))
