"""What a built catalog holds, read back for the tests that compare two builds."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.schema import NODE_COLUMNS


class Written(NamedTuple):
    nodes: list[tuple[object, ...]]  # every row of ``NODE_COLUMNS``, by id
    listings: list[tuple[object, ...]]  # the packed listings' chunks in the order they were written
    meta: dict[str, str]  # but the scan's time, which no two builds share


def written(store: Path) -> Written:
    """The catalog in ``store``, as its build wrote it."""
    catalog = Catalog.open(store, readonly=True)
    try:
        db = catalog.db
        return Written(
            db.execute(f"SELECT {NODE_COLUMNS} FROM nodes ORDER BY id").fetchall(),
            db.execute("SELECT rowid, parent, last, entries FROM listings ORDER BY rowid").fetchall(),
            dict(db.execute("SELECT key, value FROM meta WHERE key != 'scanned_at'").fetchall()),
        )
    finally:
        catalog.close()
