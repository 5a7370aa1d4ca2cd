"""The catalog: one SQLite file describing a dataset tree, the single source of truth for the mount's view.

Every directory, regular file and symlink of the source gets a row with a stable id that doubles as its inode
number, its parent id and name (indexed for ``lookup``), its mode, size and mtime at scan time and, once
``prepare`` has run, which representation is served (original bytes or an expanded raw object).

The catalog never loads the tree into Python objects: the mount asks SQLite for one row or one page of a
directory at a time, so a 1.28 M-file ImageNet tree costs a few MB of daemon memory.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import xxhash

from ..sysio.locks import HeldLock, abandoned, unique

log = logging.getLogger(__name__)

#: Bumped whenever the schema changes; a catalog of another version is refused, never guessed at.
SCHEMA_VERSION = 5
#: Meta key: how local files were identified when the catalog was scanned (``file_version``).  A catalog whose
#: files lack it (older than schema version 3) is rescanned before it is used.
FILE_IDENTITY = "file_identity"
_IDENTITY_INO_CTIME = "size,mtime,ino,ctime"
CATALOG_NAME = "catalog.sqlite"
ROOT_ID = 1  # pyfuse3.ROOT_INODE

KIND_FILE = 0
KIND_DIR = 1
KIND_SYMLINK = 2

REPR_ORIGINAL = 0
REPR_RAW = 1

_SCHEMA = """
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
CREATE UNIQUE INDEX nodes_parent_name ON nodes(parent, name);
CREATE INDEX nodes_parent ON nodes(parent);
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
"""


class CatalogError(Exception):
    """A catalog that cannot be used: missing, corrupt or from an incompatible version."""


@dataclass(frozen=True, slots=True)
class Node:
    id: int
    parent: int
    name: bytes
    path: bytes
    kind: int
    mode: int
    size: int
    mtime_ns: int
    nsubdirs: int
    target: bytes | None
    representation: int          # REPR_ORIGINAL or REPR_RAW: which bytes are served
    served_size: int | None
    object: str | None
    checksum: str | None
    etag: str | None = None
    #: The raw object's identity (``object_stamp``) when prepare wrote it or last read it whole and checked it:
    #: what lets a stat vouch for it. None: only its checksum can.
    object_stamp: str | None = None

    @property
    def served_raw(self) -> bool:
        return self.representation == REPR_RAW

    @property
    def nlink(self) -> int:
        return 2 + self.nsubdirs if self.kind == KIND_DIR else 1

    @property
    def size_served(self) -> int:
        """The size a reader sees: the raw object's when it is served, else the source's."""
        if self.served_raw and self.served_size is not None:
            return self.served_size
        return self.size


class ExpansionRow(NamedTuple):
    """What prepare learnt of one image (a row of ``expansions``): the source version it saw, and the object it
    wrote or why it refused."""

    src_size: int
    src_mtime_ns: int
    format: str | None
    object: str | None       # None when refused
    raw_size: int | None
    checksum: str | None
    reason: str | None       # why it was refused; None when expanded
    src_etag: str | None
    object_stamp: str | None = None  # the object's identity when written or last checked (``object_stamp``)

    def describes(self, node: Node) -> bool:
        """Whether it was learnt of the version of the source ``node`` describes."""
        return (self.src_size, self.src_mtime_ns, self.src_etag) == (node.size, node.mtime_ns, node.etag)


#: The columns a scan writes (``_INSERT``), and those a node is read from.
_SCANNED_COLUMNS = (
    "id, parent, name, path, kind, mode, size, mtime_ns, nsubdirs, target, repr, served_size, object, checksum, etag"
)
_NODE_COLUMNS = _SCANNED_COLUMNS + ", object_stamp"
#: A regular file's size as served: its raw object's where it has one, else its source's.
_SERVED = "CASE WHEN repr=1 AND served_size IS NOT NULL THEN served_size ELSE size END"


_EXPANSION_COLUMNS = "src_size, src_mtime_ns, format, object, raw_size, checksum, reason, src_etag, object_stamp"


def cache_home() -> Path:
    """This user's directory for liquidfs's local state (``$XDG_CACHE_HOME/liquidfs``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "liquidfs"


def default_store_dir(source: str | os.PathLike[str]) -> Path:
    """Where the catalog of a source lives when no ``--store`` is given: outside the source, per source path."""
    import hashlib

    key = hashlib.sha256(os.fsencode(os.path.abspath(source))).hexdigest()[:16]
    return cache_home() / key


def _connect(path: Path, readonly: bool, immutable: bool = False) -> sqlite3.Connection:
    if readonly:
        # The path is quoted into the URI: a '#', '?' or '%' in --store would otherwise name another file.
        # immutable: SQLite takes no lock and reads no change counter per query (half a lookup's 14 us, and a read
        # of the disk per query once the page cache is dropped); for a mount's catalog, which nothing writes in
        # place (prepare writes a new file and renames it over: the mount keeps the one it opened).
        uri = f"file:{urllib.parse.quote(os.fsdecode(os.path.abspath(path)))}?mode=ro" + \
            ("&immutable=1" if immutable else "")
        db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
    else:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    # A catalog is written by whoever can write the store: its schema must not run functions (views,
    # triggers, defaults) as the root daemon that reads it.
    db.execute("PRAGMA trusted_schema=OFF")
    db.execute("PRAGMA cache_size=-16000")  # 16 MB page cache: lookups of hot directories stay in memory
    return db


def file_version(st: os.stat_result) -> str:
    """What, besides size and mtime, tells a local file apart from any other content at the same path.

    Size and mtime alone can be put back (``touch -d``, ``cp -p``, ``rsync -t``): a file rewritten that way would
    keep a stale raw object in service.  The inode number changes with a replaced file and the ctime with any
    write, truncation, rename or mode change, and neither can be set back by an unprivileged user.
    """
    return f"ino:{st.st_ino}:ctime:{st.st_ctime_ns}"


def object_key(node: Node) -> str:
    """The hex digest a raw object of ``node`` is named by (``expansion.object_name``): the path and identity of
    its source, so a changed source gets a new object, and a catalog row can only name the object of its own
    source (``stores.local.reader.StoreReader.open_object``), never another image's."""
    identity = b"%s\0%d\0%d" % (node.path, node.size, node.mtime_ns)
    if node.etag is not None:
        identity += b"\0" + node.etag.encode()
    return xxhash.xxh3_128_hexdigest(identity)


def object_stamp(st: os.stat_result) -> str:
    """What tells a raw object apart from any other content under its name: its inode, ctime and size. Any write,
    truncation, rename or replacement changes one of them, and none can be set back by anyone but root."""
    return f"ino:{st.st_ino}:ctime:{st.st_ctime_ns}:size:{st.st_size}"


def _migrate(path: Path, found: int) -> None:
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
        version = int(db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
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


class Catalog:
    """Read and write access to one catalog file."""

    def __init__(self, path: Path, db: sqlite3.Connection, *, immutable: bool = False) -> None:
        self.path = path
        self.db = db
        #: Never written in place while open (a mount's catalog): what is computed from it once holds.
        self.immutable = immutable
        self._totals: tuple[int, int, int, int] | None = None

    # -- opening -----------------------------------------------------------------------------------

    @classmethod
    def open(cls, store_dir: str | os.PathLike[str], *, readonly: bool = False, immutable: bool = False) -> Catalog:
        return cls.open_path(Path(store_dir) / CATALOG_NAME, readonly=readonly, immutable=immutable)

    @classmethod
    def open_path(cls, path: Path, *, readonly: bool = False, immutable: bool = False) -> Catalog:
        """``immutable`` (with ``readonly``): the file is never written in place while open (a mount's)."""
        if not path.exists():
            raise CatalogError(f"no catalog at {path}")
        try:
            db = _connect(path, readonly, immutable and readonly)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise CatalogError(f"{path} is not a liquidfs catalog: {exc}") from exc
        if row is not None and row[0] in ("1", "2", "3", "4"):
            db.close()
            _migrate(path, int(row[0]))
            return cls.open_path(path, readonly=readonly, immutable=immutable)
        if row is None or int(row[0]) != SCHEMA_VERSION:
            found = row[0] if row else "none"
            db.close()
            raise CatalogError(
                f"{path} has catalog schema version {found}, this liquidfs reads version {SCHEMA_VERSION}; "
                "remove it (or use another --store) and run prepare/mount again"
            )
        return cls(path, db, immutable=immutable and readonly)

    def close(self) -> None:
        self.db.close()

    # -- metadata ----------------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    @property
    def source(self) -> bytes:
        value = self.meta("source")
        assert value is not None
        return os.fsencode(value)

    # -- queries used by the mount -----------------------------------------------------------------

    def get(self, node_id: int) -> Node | None:
        row = self.db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE id=?", (node_id,)).fetchone()
        return Node(*row) if row else None

    def lookup(self, parent: int, name: bytes) -> Node | None:
        row = self.db.execute(
            f"SELECT {_NODE_COLUMNS} FROM nodes WHERE parent=? AND name=?", (parent, name)
        ).fetchone()
        return Node(*row) if row else None

    def children(self, parent: int, after_id: int = 0, limit: int = 256) -> list[Node]:
        """One page of a directory in id order; ``after_id`` is the last id of the previous page."""
        rows = self.db.execute(
            f"SELECT {_NODE_COLUMNS} FROM nodes WHERE parent=? AND id>? AND id!=parent ORDER BY id LIMIT ?",
            (parent, after_id, limit),
        ).fetchall()
        return [Node(*row) for row in rows]

    def file_totals(self) -> tuple[int, int, int, int]:
        """(regular files, bytes served over them, bytes of their sources, highest id in the catalog). A scan of
        every row (~2 s at ten million files): an immutable catalog's are computed once."""
        if self._totals is not None:
            return self._totals
        files, served, source = self.db.execute(
            f"SELECT count(*), coalesce(sum({_SERVED}), 0), coalesce(sum(size), 0) FROM nodes WHERE kind=0"
        ).fetchone()
        max_id = self.db.execute("SELECT coalesce(max(id), 1) FROM nodes").fetchone()[0]
        if self.immutable:
            self._totals = files, served, source, max_id
        return files, served, source, max_id

    def paged_bytes(self, pages: Iterable[int]) -> dict[int, int]:
        """For each page size of ``pages``: the bytes of every regular file as served, each rounded up to whole
        pages and to one at least (what a level that holds files in pages takes for all of them: the budget's
        percentages are of that, ``policy.budget``). One scan of every row, as ``file_totals``."""
        sizes = sorted({max(1, int(page)) for page in pages})
        if not sizes:
            return {}
        columns = ", ".join(f"coalesce(sum(max(1, ({_SERVED} + ? - 1) / ?) * ?), 0)" for _ in sizes)
        row = self.db.execute(f"SELECT {columns} FROM nodes WHERE kind=0",
                              [page for page in sizes for _ in range(3)]).fetchone()
        return dict(zip(sizes, (int(value) for value in row)))

    def raw_bytes(self) -> int:
        """Bytes of the raw objects the catalog serves (the share a cluster level holds is of these)."""
        row = self.db.execute("SELECT coalesce(sum(served_size), 0) FROM nodes WHERE kind=0 AND repr=? AND "
                              "served_size IS NOT NULL", (REPR_RAW,)).fetchone()
        return int(row[0])

    def files(self) -> Iterator[Node]:
        """Every regular file, in id order (streamed, not loaded at once)."""
        cursor = self.db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE kind=0 ORDER BY id")
        for row in cursor:
            yield Node(*row)

    def directories(self) -> list[tuple[bytes, int]]:
        """(path, mtime_ns) of every directory: few enough to hold even for ImageNet (1,000)."""
        return self.db.execute("SELECT path, mtime_ns FROM nodes WHERE kind=1").fetchall()

    # -- what prepare learnt and chose ---------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            # SQLite rolls back by itself on some errors (a full disk, an I/O error): a ROLLBACK then would raise
            # "no transaction is active" in place of the error that says what happened.
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    def expansions(self) -> dict[bytes, ExpansionRow]:
        rows = self.db.execute(f"SELECT path, {_EXPANSION_COLUMNS} FROM expansions").fetchall()
        return {row[0]: ExpansionRow(*row[1:]) for row in rows}

    def record_expansions(self, learnt: Iterable[tuple[bytes, ExpansionRow]]) -> None:
        rows = [(path, *row) for path, row in learnt]
        if not rows:
            return  # no write transaction (and its lock) for nothing
        with self.transaction():
            self.db.executemany(f"INSERT OR REPLACE INTO expansions(path, {_EXPANSION_COLUMNS}) "
                                "VALUES (?,?,?,?,?,?,?,?,?,?)", rows)

    def select_raw(self, chosen: Iterable[tuple[bytes, ExpansionRow]], ratio: float) -> None:
        """Serve exactly the ``chosen`` images raw, in one transaction. Each carries its object's stamp as it was
        recorded when the object was written or last checked: nothing here vouches for an object it did not read
        (``StoreReader.object_sealed``)."""
        with self.transaction():
            self.db.execute("UPDATE nodes SET repr=0, served_size=NULL, object=NULL, checksum=NULL, "
                            "object_stamp=NULL WHERE repr=1")
            self.db.executemany(
                "UPDATE nodes SET repr=1, served_size=?, object=?, checksum=?, object_stamp=? "
                "WHERE path=? AND kind=0",
                [(x.raw_size, x.object, x.checksum, x.object_stamp, path) for path, x in chosen])
            self.set_meta("ratio", repr(ratio))

    def surplus_objects(self) -> list[tuple[bytes, str]]:
        """(path, object) of the expansions no node serves any more."""
        return self.db.execute("SELECT path, object FROM expansions WHERE object IS NOT NULL "
                               "AND object NOT IN (SELECT object FROM nodes WHERE repr=1)").fetchall()

    def forget_expansions(self, paths: Iterable[bytes]) -> None:
        with self.transaction():
            self.db.executemany("DELETE FROM expansions WHERE path=?", [(p,) for p in paths])

    def expanded_objects(self) -> tuple[set[str], int]:
        """The objects prepare wrote and still knows of, and their bytes."""
        rows = self.db.execute("SELECT object, raw_size FROM expansions WHERE object IS NOT NULL").fetchall()
        return {obj for obj, _ in rows}, sum(size or 0 for _, size in rows)

    def is_fresh(self) -> bool:
        """True when no directory of the source gained, lost or renamed an entry since the scan.

        Adding, removing or renaming an entry changes its directory's mtime, so stat-ing the directories (not
        listing them) is enough; a file whose content changed in place is caught per file at open.
        """
        if self.meta(FILE_IDENTITY) != _IDENTITY_INO_CTIME:
            return False  # scanned by an older liquidfs: its files' identities are too weak to reuse
        root = self.source
        for rel, mtime_ns in self.directories():
            try:
                st = os.stat(os.path.join(root, rel) if rel else root)
            except OSError:
                return False
            if st.st_mtime_ns != mtime_ns:
                return False
        return True


# -- building ---------------------------------------------------------------------------------------


@dataclass
class ScanReport:
    files: int = 0
    directories: int = 0
    symlinks: int = 0
    ignored: int = 0
    seconds: float = 0.0


_INSERT = f"INSERT INTO nodes({_SCANNED_COLUMNS}) VALUES ({','.join('?' * 15)})"


class _Writer:
    """A new catalog being written next to the current one; ``finish`` swaps it in atomically."""

    def __init__(self, store_dir: str | os.PathLike[str]) -> None:
        self.store = Path(store_dir)
        self.store.mkdir(parents=True, exist_ok=True)
        self.final = self.store / CATALOG_NAME
        _remove_abandoned(self.store)
        self.tmp, self.lock = _in_the_making(self.store)
        self.db = sqlite3.connect(self.tmp, isolation_level=None)
        # The previous catalog is ATTACHed to carry over what prepare learnt: it may be anyone's, and its schema
        # must run nothing here (as every catalog read, ``_connect``).
        self.db.execute("PRAGMA trusted_schema=OFF")
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA synchronous=OFF")
        self.db.executescript(_SCHEMA)
        self.db.execute("BEGIN")
        self.rows: list[tuple[object, ...]] = []

    def add(self, row: tuple[object, ...]) -> None:
        self.rows.append(row)
        if len(self.rows) >= 10_000:
            self.flush()

    def flush(self) -> None:
        self.db.executemany(_INSERT, self.rows)
        self.rows.clear()

    def finish(self, meta: dict[str, str], previous: Path | None = None) -> None:
        """Commit, carry over what prepare learnt from ``previous`` (default: the catalog being replaced), swap."""
        self.flush()
        meta = {"schema_version": str(SCHEMA_VERSION), "scanned_at": str(time.time()), **meta}
        self.db.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", list(meta.items()))
        self.db.execute("COMMIT")
        _carry_over_expansions(self.db, previous or self.final)
        self.db.close()
        # The rename is the commit point: a mount that has the old catalog open keeps reading the old file.
        os.replace(self.tmp, self.final)
        self.lock.release()


class WorkingCopy:
    """A private copy of a store's catalog that ``publish`` puts in its place with one rename.

    A running mount reads the catalog file it opened at start: a change made in place (a new selection, rows
    half-updated) would show it a store that never existed as a whole. Changes are made here and become the
    store's catalog atomically; mounts already running keep reading the old file, a consistent snapshot.
    """

    def __init__(self, store_dir: Path) -> None:
        self.final = store_dir / CATALOG_NAME
        self.path, self.lock = _in_the_making(store_dir)
        try:
            source = _connect(self.final, readonly=True)
            try:
                copy = sqlite3.connect(self.path)
                with copy:
                    source.backup(copy)
                copy.close()
            finally:
                source.close()
            self.catalog = Catalog.open_path(self.path)
        except BaseException:
            self.discard()
            raise

    def publish(self) -> None:
        self.catalog.close()
        os.replace(self.path, self.final)
        self.lock.release()

    def discard(self) -> None:
        if hasattr(self, "catalog"):
            self.catalog.close()
        self.path.unlink(missing_ok=True)
        self.lock.release()


def _in_the_making(store: Path) -> tuple[Path, HeldLock]:
    """A name of its own for a catalog being written, and a lock held while it is: two writers on one store (two
    prepares, a prepare and a mount's rescan), even in other PID namespaces, never touch each other's catalog in
    the making, and one whose writer died is found by its free lock (``_remove_abandoned``)."""
    path = store / unique(f"{CATALOG_NAME}.new-")
    return path, HeldLock(Path(f"{path}.lock"))


def _remove_abandoned(store: Path) -> None:
    """Catalogs in the making whose writer died (their lock is free), with SQLite's side files."""
    for lock in store.glob(f"{CATALOG_NAME}.new-*.lock"):
        if abandoned(lock):
            tmp = Path(str(lock)[:-len(".lock")])
            for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm"), Path(f"{tmp}-journal"), lock):
                leftover.unlink(missing_ok=True)


def build(source: str | os.PathLike[str], store_dir: str | os.PathLike[str]) -> ScanReport:
    """Scan ``source`` into a new catalog in ``store_dir``, replacing any previous one atomically.

    What ``prepare`` learnt (the ``expansions`` table) is carried over, so a rescan never redoes expansions of
    unchanged files. Entries that are neither files, directories nor symlinks (sockets, fifos, devices) are not
    shown: a dataset has no use for them and serving them through FUSE is unsafe.
    """
    started = time.monotonic()
    root = os.fsencode(os.path.abspath(source))
    root_st = os.stat(root)
    if not stat.S_ISDIR(root_st.st_mode):
        raise NotADirectoryError(f"{source} is not a directory")
    writer = _Writer(store_dir)
    report = ScanReport()
    next_id = ROOT_ID + 1
    # Each stack item: (directory id, absolute path, relative path); subdir counts are patched after.
    nsubdirs: dict[int, int] = {}
    dir_rows: dict[int, tuple[int, int, bytes, bytes, int, int, int, int]] = {
        ROOT_ID: (ROOT_ID, ROOT_ID, b"", b"", KIND_DIR, root_st.st_mode, root_st.st_size, root_st.st_mtime_ns)
    }
    stack: list[tuple[int, bytes, bytes]] = [(ROOT_ID, root, b"")]
    while stack:
        dir_id, abs_dir, rel_dir = stack.pop()
        try:
            entries = sorted(os.scandir(abs_dir), key=lambda e: e.name)
        except OSError as exc:
            log.warning("cannot list %r: %s; shown empty", abs_dir, exc)
            entries = []
        subdirs = 0
        for entry in entries:
            name = entry.name
            rel = rel_dir + b"/" + name if rel_dir else name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as exc:
                log.warning("cannot stat %r: %s; not shown", entry.path, exc)
                report.ignored += 1
                continue
            mode = st.st_mode
            node_id = next_id
            next_id += 1
            if stat.S_ISDIR(mode):
                subdirs += 1
                report.directories += 1
                dir_rows[node_id] = (node_id, dir_id, name, rel, KIND_DIR, mode, st.st_size, st.st_mtime_ns)
                stack.append((node_id, entry.path, rel))
            elif stat.S_ISREG(mode):
                report.files += 1
                writer.add((node_id, dir_id, name, rel, KIND_FILE, mode, st.st_size, st.st_mtime_ns, 0,
                            None, REPR_ORIGINAL, None, None, None, file_version(st)))
            elif stat.S_ISLNK(mode):
                report.symlinks += 1
                target = os.readlink(entry.path)
                writer.add((node_id, dir_id, name, rel, KIND_SYMLINK, mode, len(target), st.st_mtime_ns, 0,
                            target, REPR_ORIGINAL, None, None, None, None))
            else:
                report.ignored += 1
                next_id -= 1
                continue
        nsubdirs[dir_id] = subdirs
    for r in dir_rows.values():
        writer.add((*r, nsubdirs.get(r[0], 0), None, REPR_ORIGINAL, None, None, None, None))
    writer.finish({"source": os.fsdecode(root), FILE_IDENTITY: _IDENTITY_INO_CTIME})
    report.seconds = time.monotonic() - started
    log.info(
        "catalog of %s: %d files, %d directories, %d symlinks in %.2f s",
        os.fsdecode(root), report.files, report.directories, report.symlinks, report.seconds,
    )
    return report


#: Files and directories of an object-store tree: read-only, as the mount shows them.
OBJECT_FILE_MODE = stat.S_IFREG | 0o444
OBJECT_DIR_MODE = stat.S_IFDIR | 0o555


def build_from_objects(objects: Iterable[tuple[str, int, str, int]], store_dir: str | os.PathLike[str],
                       source: str, *, previous: Path | None = None) -> ScanReport:
    """A catalog of an object-store tree from its listing: ``(relative key, size, etag, mtime_ns)`` items.

    Directories are the ``/``-separated prefixes of the keys (an object store has no directories of its own);
    a directory's mtime is its newest object's. Keys a filesystem cannot show (empty, ``.`` or ``..``
    components, a name that is also a directory, over 255 bytes) are left out with a warning, never renamed.
    """
    started = time.monotonic()
    writer = _Writer(store_dir)
    report = ScanReport()
    # path -> [id, parent id, newest mtime, subdirectory count]
    dirs: dict[bytes, list[int]] = {b"": [ROOT_ID, ROOT_ID, 0, 0]}
    files: dict[bytes, tuple[object, ...]] = {}
    next_id = ROOT_ID + 1

    def directory(path: bytes) -> list[int] | None:
        nonlocal next_id
        found = dirs.get(path)
        if found is not None:
            return found
        if path in files:
            return None
        parent_path, _, _ = path.rpartition(b"/")
        parent = directory(parent_path)
        if parent is None:
            return None
        parent[3] += 1
        dirs[path] = [next_id, parent[0], 0, 0]
        next_id += 1
        report.directories += 1
        return dirs[path]

    for rel, size, etag, mtime_ns in objects:
        path = rel.encode("utf-8", "surrogateescape")
        parts = path.split(b"/")
        if path.endswith(b"/") and size == 0 and all(p not in (b"", b".", b"..") for p in parts[:-1]):
            directory(path[:-1])  # a "folder" marker object made by consoles and s3fs: an empty directory
            continue
        parent_path, _, name = path.rpartition(b"/")
        if any(p in (b"", b".", b"..") or len(p) > 255 for p in parts) or path in dirs:
            log.warning("object %r cannot be shown as a file; left out", rel)
            report.ignored += 1
            continue
        parent = directory(parent_path)
        if parent is None:
            log.warning("object %r lies below a file of the same name; left out", rel)
            report.ignored += 1
            continue
        files[path] = (next_id, parent[0], name, path, KIND_FILE, OBJECT_FILE_MODE, size, mtime_ns, 0,
                       None, REPR_ORIGINAL, None, None, None, etag)
        next_id += 1
        report.files += 1
        walk = parent_path
        while True:  # a directory is as new as its newest object, like a directory's mtime after a write
            entry = dirs[walk]
            entry[2] = max(entry[2], mtime_ns)
            if not walk:
                break
            walk = walk.rpartition(b"/")[0]
    for row in files.values():
        writer.add(row)
    for path, (node_id, parent_id, mtime_ns, subdirs) in dirs.items():
        writer.add((node_id, parent_id, path.rpartition(b"/")[2], path, KIND_DIR, OBJECT_DIR_MODE, 0, mtime_ns,
                    subdirs, None, REPR_ORIGINAL, None, None, None, None))
    writer.finish({"source": source, "source_kind": "s3"}, previous)
    report.seconds = time.monotonic() - started
    log.info("catalog of %s: %d objects, %d directories in %.2f s", source, report.files, report.directories,
             report.seconds)
    return report


def _carry_over_expansions(db: sqlite3.Connection, previous: Path) -> None:
    """Copy prepare's knowledge from the catalog being replaced, and re-apply the chosen representations."""
    if not previous.exists():
        return
    try:
        db.execute("ATTACH DATABASE ? AS old", (str(previous),))
    except sqlite3.DatabaseError:
        return
    try:
        db.execute("BEGIN")
        version = db.execute("SELECT value FROM old.meta WHERE key='schema_version'").fetchone()
        if version is None or int(version[0]) not in (1, 2, 3, 4, SCHEMA_VERSION):
            db.execute("ROLLBACK")
            return
        etag = "src_etag" if int(version[0]) >= 2 else "NULL"
        stamp = "object_stamp" if int(version[0]) >= 4 else "NULL"  # older objects: checked by their checksum
        db.execute(
            "INSERT INTO expansions(path, src_size, src_mtime_ns, format, object, raw_size, checksum, reason, "
            f"src_etag, object_stamp) SELECT path, src_size, src_mtime_ns, format, object, raw_size, checksum, "
            f"reason, {etag}, {stamp} FROM old.expansions"
        )
        for key in ("ratio", "seed"):
            row = db.execute("SELECT value FROM old.meta WHERE key=?", (key,)).fetchone()
            if row:
                db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, row[0]))
        # A file keeps its raw representation only if it is still the file that was expanded.
        db.execute(
            """UPDATE nodes SET repr=1, served_size=e.raw_size, object=e.object, checksum=e.checksum,
                                object_stamp=e.object_stamp
               FROM (SELECT o.path, x.raw_size, x.object, x.checksum, x.src_size, x.src_mtime_ns, x.src_etag,
                            x.object_stamp
                     FROM old.nodes o JOIN expansions x ON x.path=o.path
                     WHERE o.repr=1 AND x.object=o.object) AS e
               WHERE nodes.path=e.path AND nodes.kind=0
                 AND nodes.size=e.src_size AND nodes.mtime_ns=e.src_mtime_ns AND nodes.etag IS e.src_etag"""
        )
        db.execute("COMMIT")
    except sqlite3.DatabaseError as exc:
        log.warning("could not carry over prepare's state from %s: %s", previous, exc)
        db.execute("ROLLBACK")
    finally:
        db.execute("DETACH DATABASE old")


def open_or_build(source: str | os.PathLike[str], store_dir: str | os.PathLike[str],
                  *, rescan: bool = False) -> Catalog:
    """The catalog for ``source`` in ``store_dir``: reused when fresh, (re)built otherwise."""
    path = Path(store_dir) / CATALOG_NAME
    if path.exists() and not rescan:
        catalog = Catalog.open(store_dir)
        same_source = catalog.source == os.fsencode(os.path.abspath(source))
        if same_source and catalog.is_fresh():
            log.info("reusing catalog %s", path)
            return catalog
        catalog.close()
        if not same_source:
            raise CatalogError(
                f"{path} describes {os.fsdecode(catalog.source)}, not {os.path.abspath(source)}; "
                "use another --store"
            )
        log.info("source changed since the last scan: rescanning")
    build(source, store_dir)
    return Catalog.open(store_dir)
