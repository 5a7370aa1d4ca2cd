"""A catalog's schema: its tables, the version it is at, and the migration of a catalog of an older one.

A catalog of a version this liquidfs does not know is refused (``CatalogError``), never guessed at.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

#: Bumped whenever the schema changes; a catalog of another version is refused, never guessed at.
SCHEMA_VERSION = 5
#: Meta key: how local files were identified when the catalog was scanned (``file_version``).  A catalog whose
#: files lack it (older than schema version 3) is rescanned before it is used.
FILE_IDENTITY = "file_identity"
IDENTITY_INO_CTIME = "size,mtime,ino,ctime"
#: Meta key: the directories a local scan could not list (shown empty) for a reason that may pass (EIO, EMFILE, a
#: stale NFS handle). A catalog with any is rescanned at its next use, even where no directory's mtime changed.
UNLISTED = "unlisted_directories"

TABLES = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE nodes (
    id INTEGER PRIMARY KEY,
    parent INTEGER NOT NULL,
    name BLOB NOT NULL,
    path BLOB NOT NULL,          -- relative to the source root, b'' for the root
    kind INTEGER NOT NULL,
    mode INTEGER NOT NULL,
    size INTEGER NOT NULL,       -- source size at scan time
    mtime_ns INTEGER NOT NULL,   -- source mtime at scan time
    nsubdirs INTEGER NOT NULL DEFAULT 0,
    target BLOB,                 -- symlink target, verbatim
    repr INTEGER NOT NULL DEFAULT 0,
    served_size INTEGER,         -- size served when repr is raw
    object TEXT,                 -- store-relative name of the raw object
    checksum TEXT,               -- BLAKE2b-256 hex digest of the raw object (before version 5: xxh3-64)
    etag TEXT,                   -- the source's version: an object's ETag, or a local file's (file_version)
    object_stamp TEXT            -- the raw object's identity when prepare wrote or checked it (object_stamp)
);
-- What prepare learnt about each image, keyed by path and the source's identity, so it survives rescans.
CREATE TABLE expansions (
    path BLOB PRIMARY KEY,
    src_size INTEGER NOT NULL,
    src_mtime_ns INTEGER NOT NULL,
    format TEXT,
    object TEXT,                 -- NULL when the image was refused
    raw_size INTEGER,
    checksum TEXT,
    reason TEXT,                 -- why it was refused, NULL when expanded
    src_etag TEXT,               -- the source's version when it was expanded (as nodes.etag)
    object_stamp TEXT            -- the object's identity when it was written or its bytes last checked
);
-- A directory's entries packed for its listings (catalog/listings.py), where meta 'listings' says so.
CREATE TABLE listings (
    parent INTEGER NOT NULL,
    last INTEGER NOT NULL,       -- the id of the chunk's last entry
    entries BLOB NOT NULL
);
"""
#: The indexes of ``nodes`` and ``listings``: a build makes them once its rows are in (one sort, instead of a
#: B-tree insert per row).
INDEXES = (
    "CREATE UNIQUE INDEX nodes_parent_name ON nodes(parent, name)",
    "CREATE INDEX nodes_parent ON nodes(parent)",
    "CREATE UNIQUE INDEX listings_parent_last ON listings(parent, last)",
)


class CatalogError(Exception):
    """A catalog that cannot be used: missing, corrupt or from an incompatible version."""


#: The columns a scan writes (``_INSERT``), and those a node is read from.
SCANNED_COLUMNS = (
    "id, parent, name, path, kind, mode, size, mtime_ns, nsubdirs, target, repr, served_size, object, checksum, etag"
)
NODE_COLUMNS = SCANNED_COLUMNS + ", object_stamp"
EXPANSION_COLUMNS = "src_size, src_mtime_ns, format, object, raw_size, checksum, reason, src_etag, object_stamp"


def schema_version(value: object) -> int | None:
    """A catalog's ``schema_version`` (its meta value) as a number; None where there is none or it is not one: a
    catalog may be anyone's, and a value it holds is not taken for a number on its word."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        return None
    try:
        return int(value)
    except ValueError:
        return None


def migrate(path: Path, found: int) -> None:
    """Version 2 added the ETags of object-store sources; version 3 records local files' versions there too;
    version 4 each raw object's own identity (``object_stamp``) instead of a store-wide seal time; version 5 raw
    objects' BLAKE2b-256 digests instead of xxh3 ones (the bump keeps a liquidfs that checks xxh3 from reading
    them: it would fail every raw object).

    A local catalog of an older version gains empty columns and no ``file_identity``: ``is_fresh`` then says it
    must be rescanned, and prepare re-expands its images (their old identity cannot be trusted). Objects without a
    stamp are served only once their checksum is checked, until a prepare has read them whole again. The xxh3
    digests of a catalog before version 5 are kept as they are, and vouch for no bytes a writer may have chosen
    (``reader.check_raw``): only an object a stamp vouches for is still served raw, until a prepare has made
    its objects again and recorded their BLAKE2b digests."""
    log.info("upgrading catalog %s from schema version %d to %d", path, found, SCHEMA_VERSION)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA trusted_schema=OFF")  # the catalog may be anyone's: its schema runs nothing here
    try:
        db.execute("BEGIN IMMEDIATE")
        version = schema_version(db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
        if version is None:
            raise sqlite3.DatabaseError("its schema version changed while it was upgraded")
        for table, column in (("nodes", "etag"), ("expansions", "src_etag"),
                              ("nodes", "object_stamp"), ("expansions", "object_stamp")):
            have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            if column not in have:  # each version's columns, whichever of them this file lacks
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")
        if version < SCHEMA_VERSION:
            db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
        db.execute("COMMIT")
    except sqlite3.DatabaseError as exc:
        raise CatalogError(f"cannot upgrade {path}: {exc}; remove it and run prepare/mount again") from exc
    finally:
        db.close()
