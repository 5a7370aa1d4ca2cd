"""A local tree's build packs every directory's entries (``catalog.listings``): the same (id, name, mode) as its
rows, in id order, in chunks keyed by their last id; other catalogs say they have none."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from liquidfs.catalog import listings
from liquidfs.catalog.build import build, build_from_objects
from liquidfs.catalog.catalog import CATALOG_NAME, Catalog


def rows_of(catalog: Catalog, parent: int) -> list[tuple[int, bytes, int]]:
    return catalog.child_entries(parent, 0, 1_000_000)


def packed_of(catalog: Catalog, parent: int, after: int = 0) -> list[tuple[int, bytes, int]]:
    return [(ident, name, mode) for _, chunk in catalog.listing_chunks(parent, after)
            for ident, mode, name, _, _ in listings.read(chunk, 0, after)]


@pytest.fixture
def catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Catalog:
    monkeypatch.setattr(listings, "CHUNK", 7)  # several chunks of a small directory
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "empty").mkdir()
    for i in range(23):
        (src / "a" / f"{i:03d}\xe9.png").write_bytes(b"x")
    (src / "a" / "b" / "one").write_bytes(b"1")
    os.symlink("a/000\xe9.png", src / "link")
    os.mkfifo(src / "a" / "fifo")  # not shown: not packed either
    (src / "top.txt").write_bytes(b"t")
    build(src, tmp_path / "store")
    return Catalog.open(tmp_path / "store", readonly=True)


def test_every_directory_packed_as_its_rows(catalog: Catalog) -> None:
    assert catalog.has_listings
    directories = [row[0] for row in catalog.db.execute("SELECT id FROM nodes WHERE kind=1")]
    assert len(directories) == 4
    for parent in directories:
        assert packed_of(catalog, parent) == rows_of(catalog, parent), parent
    a = catalog.lookup(1, b"a")
    assert a is not None and len(rows_of(catalog, a.id)) == 24  # 23 files and b, not the fifo
    lasts = [row[0] for row in catalog.db.execute("SELECT last FROM listings WHERE parent=? ORDER BY last",
                                                  (a.id,))]
    ids = [row[0] for row in rows_of(catalog, a.id)]
    assert lasts == [ids[6], ids[13], ids[20], ids[23]]  # chunks of 7, keyed by their last entry


def test_a_listing_resumed_anywhere_starts_after_that_entry(catalog: Catalog) -> None:
    a = catalog.lookup(1, b"a")
    assert a is not None
    rows = rows_of(catalog, a.id)
    for i, (ident, _, _) in enumerate(rows):
        assert packed_of(catalog, a.id, ident) == rows[i + 1:]


def test_an_object_stores_catalog_is_packed_as_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its ids are not given one directory at a time (a key's directories get theirs when first seen)."""
    monkeypatch.setattr(listings, "CHUNK", 3)
    keys = [f"train/c{i % 3}/img{i:02d}.png" for i in range(20)] + ["README", "val/a.png", "train/zz.png"]
    build_from_objects(iter((key, 10, f'"e{i}"', 1) for i, key in enumerate(keys)), tmp_path, "s3://b/x")
    objects = Catalog.open(tmp_path, readonly=True)
    assert objects.has_listings
    directories = [row[0] for row in objects.db.execute("SELECT id FROM nodes WHERE kind=1")]
    assert len(directories) == 6  # the root, train, its three cities, val
    for parent in directories:
        assert packed_of(objects, parent) == rows_of(objects, parent) != [], parent


def test_a_catalog_of_before_is_listed_from_its_rows(catalog: Catalog) -> None:
    """No table, no meta: as a catalog an older liquidfs built."""
    path = Path(catalog.path)
    catalog.close()
    db = sqlite3.connect(path)
    with db:
        db.execute("DROP TABLE listings")
        db.execute("DELETE FROM meta WHERE key=?", (listings.META_KEY,))
    db.close()
    assert not Catalog.open(path.parent, readonly=True).has_listings
    assert path.name == CATALOG_NAME


@pytest.mark.parametrize("chunk", [
    listings.record(5, 0o100644, b"a") + b"\x01",                       # a head cut short
    listings.record(5, 0o100644, b"a")[:-1],                             # a name cut short
    listings.RECORD.pack(5, 0o100644, 0),                                # an empty name
    listings.record(5, 0o100644, b"a\0b"),                               # a NUL in the name
    listings.record(5, 0o100644, b"a/b"),                                # a '/' in the name
    listings.record(5, 0o40755, b".."),                                  # a name the kernel makes itself
    listings.RECORD.pack(5, 0o100644, 256) + b"x" * 256,                  # a name over 255 bytes
    listings.record(5, 0o100644, b"a") + listings.record(5, 0o100644, b"b"),  # ids not ascending
    listings.record(2**63, 0o100644, b"a"),                               # an id no inode number can be
])
def test_a_malformed_record_is_refused(chunk: bytes) -> None:
    with pytest.raises(listings.MalformedRecord) as refused:
        list(listings.read(chunk))
    assert 0 <= refused.value.pos < len(chunk)


def test_records_ascend_where_they_are_passed_over_too() -> None:
    """As the C reader: a record below the one before is malformed even where both lie at or below ``after``."""
    chunk = listings.record(5, 0o100644, b"a") + listings.record(3, 0o100644, b"b") + listings.record(9, 0, b"c")
    with pytest.raises(listings.MalformedRecord):
        list(listings.read(chunk, after=6))
