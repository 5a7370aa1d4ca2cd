"""The catalog: one SQLite file describing a dataset tree, the single source of truth for the mount's view.

Every directory, regular file and symlink of the source gets a row with a stable id that doubles as its inode
number, its parent id and name (indexed for ``lookup``), its mode, size and mtime at scan time and, once
``prepare`` has run, which representation is served (original bytes or an expanded raw object).

The catalog never loads the tree into Python objects: the mount asks SQLite for one row or one page of a
directory at a time, so a 1.28 M-file ImageNet tree costs a few MB of daemon memory.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import stat
import urllib.parse
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..sysio.home import cache_home
from ..sysio.paths import mounted_below, open_dir, stat_below
from . import listings
from .nodes import CONTROL_ID, KIND_FILE, REPR_RAW, ROOT_ID, ExpansionRow, Node
from .schema import (EXPANSION_COLUMNS, FILE_IDENTITY, IDENTITY_INO_CTIME, NODE_COLUMNS, SCHEMA_VERSION,
                     UNLISTED, CatalogError, migrate, schema_version)
from .store_dir import check_store_dir
from .store_dir import refusal as store_dir_refusal

log = logging.getLogger(__name__)

CATALOG_NAME = "catalog.sqlite"
#: ``Catalog.staleness``: a directory of the source changed since the scan (the catalog is behind, still sound).
CHANGED = "changed"
#: ``Catalog.staleness``: the catalog must be scanned again before it is used (an older liquidfs's, or a directory
#: its scan could not list).
MUST_RESCAN = "must-rescan"
#: A regular file's size as served: its raw object's where it has one, else its source's.
_SERVED = "CASE WHEN repr=1 AND served_size IS NOT NULL THEN served_size ELSE size END"
#: A page of a directory's entries in id order after the id given (the root is its own parent: not its entry).
_PAGE_OF_CHILDREN = "FROM nodes WHERE parent=? AND id>? AND id!=parent ORDER BY id LIMIT ?"


def default_store_dir(source: str | os.PathLike[str]) -> Path:
    """Where the catalog of a source lives when no ``--store`` is given: outside the source, per source path."""
    import hashlib

    key = hashlib.sha256(os.fsencode(os.path.abspath(source))).hexdigest()[:16]
    return cache_home() / key


def check_utf8(path: str | os.PathLike[str], what: str = "the path") -> None:
    """CatalogError where ``path`` (``what`` it is, for the message) is not UTF-8: SQLite takes a file's name as
    UTF-8 text, and one of other bytes ended in a UnicodeEncodeError traceback."""
    try:
        os.fsdecode(os.path.abspath(path)).encode()
    except UnicodeEncodeError:
        raise CatalogError(f"{os.fsdecode(path)!r}: {what} is not UTF-8, which SQLite cannot open; give the store "
                           "through a link of a UTF-8 name") from None


def connect(path: Path, readonly: bool, immutable: bool = False) -> sqlite3.Connection:
    check_utf8(path)
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
    # And its pages may be damaged or made to mislead: each cell's size checked as it is read, as SQLite advises
    # for files from others (0.2 us of a lookup's 7, measured: /tmp/s41/cellcheck.py in BENCHMARKS.md).
    db.execute("PRAGMA cell_size_check=ON")
    db.execute("PRAGMA cache_size=-16000")  # 16 MB page cache: lookups of hot directories stay in memory
    return db



def _file_id(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``path``; None where there is no file (as ``Path.exists`` says False)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EBADF):
            return None
        raise
    return st.st_dev, st.st_ino


#: Ids a catalog's rows may leave unused past twice their count (a build leaves none).
_ID_SLACK = 1024


class Catalog:
    """Read and write access to one catalog file."""

    def __init__(self, path: Path, db: sqlite3.Connection, *, immutable: bool = False,
                 file_id: tuple[int, int] | None = None) -> None:
        self.path = path
        self.db = db
        #: Never written in place while open (a mount's catalog): what is computed from it once holds.
        self.immutable = immutable
        #: The (st_dev, st_ino) of the file this connection reads, where known for sure (``open_path``): prepare
        #: renames a new catalog over the path while a mount runs, and a second connection opened by the path
        #: later may read another file than the mount's (``MetadataAhead`` checks before its rows answer lookups).
        self.file_id = file_id
        self._totals: tuple[int, int, int, int] | None = None

    # -- opening -----------------------------------------------------------------------------------

    @classmethod
    def open(cls, store_dir: str | os.PathLike[str], *, readonly: bool = False, immutable: bool = False) -> Catalog:
        return cls.open_path(Path(store_dir) / CATALOG_NAME, readonly=readonly, immutable=immutable)

    @classmethod
    def open_path(cls, path: Path, *, readonly: bool = False, immutable: bool = False) -> Catalog:
        """``immutable`` (with ``readonly``): the file is never written in place while open (a mount's). A catalog
        read in a store this process may not write (another user's: ``store_dir``) is always read so: SQLite then
        neither rolls back a journal it finds beside it nor makes a WAL's files there, as this process."""
        # (whether the caller asked for immutable or not: a mount asks, and read the rows a write left half-done)
        if readonly and store_dir_refusal(path.parent, writing=True) is not None:
            immutable = True
            # Read as it is, a catalog with a write of its owner's left beside it (a journal to roll back, a WAL
            # not yet folded in) would show rows never committed, or old ones: refused until its owner opens it.
            for side in (f"{path}-journal", f"{path}-wal"):
                if os.path.lexists(side) and os.lstat(side).st_size:
                    raise CatalogError(f"{path}: a write of its owner's is left beside it ({os.path.basename(side)}): "
                                       "not read until its owner opens it once (mount or prepare it as that user)")
        before = _file_id(path)
        if before is None:
            raise CatalogError(f"no catalog at {path}")
        try:
            db = connect(path, readonly, immutable and readonly)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise CatalogError(f"{path} is not a liquidfs catalog ({exc}): a damaged one (a crash while it was "
                               "written) is made again by `liquidfs mount --rescan`, or removed") from exc
        # The file the connection opened is the path's before and after it was opened: else a rename came between,
        # and which file it reads is not known.
        file_id = before if _file_id(path) == before else None
        version = schema_version(row[0]) if row is not None else None
        if version in (1, 2, 3, 4):
            db.close()
            check_store_dir(path.parent, writing=True)  # upgraded in place, its journal beside it
            migrate(path, version)
            return cls.open_path(path, readonly=readonly, immutable=immutable)
        if version != SCHEMA_VERSION:
            found = str(row[0])[:40] if row else "none"
            db.close()
            raise CatalogError(
                f"{path} has catalog schema version {found}, this liquidfs reads version {SCHEMA_VERSION}; "
                "remove it (or use another --store) and run prepare/mount again"
            )
        return cls(path, db, immutable=immutable and readonly, file_id=file_id)

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
        try:
            value = self.meta("source")
        except sqlite3.DatabaseError as exc:  # a meta table damaged past the page its version was read from
            raise CatalogError(f"{self.path} is not a liquidfs catalog ({exc})") from exc
        if not isinstance(value, str) or not value or "\0" in value:
            raise CatalogError(f"{self.path}: names no source it describes (a damaged or foreign catalog)")
        return os.fsencode(value)

    # -- queries used by the mount -----------------------------------------------------------------

    def get(self, node_id: int) -> Node | None:
        row = self.db.execute(f"SELECT {NODE_COLUMNS} FROM nodes WHERE id=?", (node_id,)).fetchone()
        return Node(*row) if row else None

    def lookup(self, parent: int, name: bytes) -> Node | None:
        row = self.db.execute(
            f"SELECT {NODE_COLUMNS} FROM nodes WHERE parent=? AND name=?", (parent, name)
        ).fetchone()
        return Node(*row) if row else None

    def children(self, parent: int, after_id: int = 0, limit: int = 256) -> list[Node]:
        """One page of a directory in id order; ``after_id`` is the last id of the previous page."""
        rows = self.db.execute(f"SELECT {NODE_COLUMNS} {_PAGE_OF_CHILDREN}", (parent, after_id, limit)).fetchall()
        return [Node(*row) for row in rows]

    def child_entries(self, parent: int, after_id: int = 0, limit: int = 128) -> list[tuple[int, bytes, int]]:
        """One page of a directory's (id, name, mode) in id order: all a plain listing's entry carries, without
        a ``Node`` of every column for each (most of a READDIRPLUS entry's cost at ten million files)."""
        rows: list[tuple[int, bytes, int]] = self.db.execute(
            f"SELECT id, name, mode {_PAGE_OF_CHILDREN}", (parent, after_id, limit)).fetchall()
        return rows

    @functools.cached_property
    def has_listings(self) -> bool:
        """Whether every directory's entries are packed in ``listings`` (``catalog.listings``)."""
        try:
            return self.meta(listings.META_KEY) == listings.FORMAT and self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='listings'").fetchone() is not None
        except sqlite3.DatabaseError:
            return False

    def listing_chunks(self, parent: int, after_id: int = 0) -> Iterator[tuple[int, bytes | None]]:
        """The packed chunks of ``parent`` that hold entries after the id ``after_id``, each with the id of its
        last entry (its key), one query each as the listing takes them (``has_listings`` catalogs only). None for
        a chunk that is not one (longer than a build writes, not a blob, a key that is not an integer): the
        listing is to go on another way."""
        while True:
            row = self.db.execute(
                "SELECT last, CASE WHEN length(entries) <= ? THEN entries END FROM listings "
                "WHERE parent=? AND last>? ORDER BY last LIMIT 1", (listings.longest_chunk(), parent, after_id)
            ).fetchone()
            if row is None:
                return
            if not isinstance(row[0], int) or not isinstance(row[1], bytes):
                yield after_id, None
                return
            after_id = row[0]
            yield after_id, row[1]

    def file_totals(self) -> tuple[int, int, int, int]:
        """(regular files, bytes served over them, bytes of their sources, highest id in the catalog). A scan of
        every row (~2 s at ten million files): an immutable catalog's are computed once."""
        if self._totals is not None:
            return self._totals
        # One scan of every row: the files' sums, and the ids' range and count beside them.
        try:
            totals = self.db.execute(
                f"SELECT coalesce(sum(kind=0), 0), coalesce(sum(CASE WHEN kind=0 THEN {_SERVED} END), 0), "
                "coalesce(sum(CASE WHEN kind=0 THEN size END), 0), count(*), coalesce(min(id), 1), "
                "coalesce(max(id), 1) FROM nodes").fetchone()
        except sqlite3.OperationalError as exc:
            if "integer overflow" not in str(exc):  # (a disk's error says nothing of the catalog's rows)
                raise
            raise CatalogError(f"{self.path}: {exc} in its files' sizes (a damaged or foreign catalog); remove it "
                               "and mount or prepare again") from None
        # A catalog someone else wrote, its table defined by them, may hold an id or a size that is text or a
        # float: it shows in the sums (a float) or the ids' range (text sorts past every number), and is refused
        # here, at the mount's start, never met as a TypeError in what the totals size. (A negative size the
        # kernel refuses itself: EIO at its lookup.)
        if not all(type(value) is int for value in totals):
            raise CatalogError(f"{self.path}: ids or sizes that are not whole numbers (a damaged or foreign "
                               "catalog); remove it and mount or prepare again")
        files, served, source, rows, min_id, max_id = totals
        # Ids index the mount's per-file arrays (``datapath.inodes``, the cache policy's): a build numbers its rows
        # from the root on, so an id far past their count is a row someone else wrote, not an array to map.
        if min_id < ROOT_ID or max_id > 2 * rows + _ID_SLACK or max_id >= CONTROL_ID:
            raise CatalogError(f"{self.path}: node ids {min_id}..{max_id} for {rows} rows: not numbered as a build "
                               "numbers them (a damaged or foreign catalog); remove it and mount or prepare again")
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

    def served_sizes(self, after_id: int = 0, limit: int = 65536) -> list[tuple[int, int]]:
        """One page of (id, bytes served) of the regular files in id order, after the id ``after_id``: a choice
        among every file (``warm_up``) without a ``Node`` of each (6.6 s and 650 MB a million files)."""
        rows: list[tuple[int, int]] = self.db.execute(
            f"SELECT id, {_SERVED} FROM nodes WHERE kind=0 AND id>? ORDER BY id LIMIT ?", (after_id, limit)).fetchall()
        return rows

    def files(self) -> Iterator[Node]:
        """Every regular file, in id order (streamed, not loaded at once)."""
        cursor = self.db.execute(f"SELECT {NODE_COLUMNS} FROM nodes WHERE kind=0 ORDER BY id")
        for row in cursor:
            yield Node(*row)

    def directories(self) -> list[tuple[object, object, object]]:
        """(path, mtime_ns, version) of every directory as its row holds them (not checked: a path should be bytes;
        no version in a catalog of an older liquidfs): few enough to hold even for ImageNet (1,000)."""
        return self.db.execute("SELECT path, mtime_ns, etag FROM nodes WHERE kind=1").fetchall()

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
        rows = self.db.execute(f"SELECT path, {EXPANSION_COLUMNS} FROM expansions").fetchall()
        return {row[0]: ExpansionRow(*row[1:]) for row in rows}

    def record_expansions(self, learnt: Iterable[tuple[bytes, ExpansionRow]]) -> None:
        rows = [(path, *row) for path, row in learnt]
        if not rows:
            return  # no write transaction (and its lock) for nothing
        with self.transaction():
            self.db.executemany(f"INSERT OR REPLACE INTO expansions(path, {EXPANSION_COLUMNS}) "
                                "VALUES (?,?,?,?,?,?,?,?,?,?)", rows)

    def select_raw(self, chosen: Iterable[tuple[int, ExpansionRow]], ratio: float) -> None:
        """Serve exactly the ``chosen`` images (by node id) raw, in one transaction. Each carries its object's stamp
        as it was recorded when the object was written or last checked: nothing here vouches for an object it did
        not read (``StoreReader.object_sealed``). By id, the table's key: by path, which no index holds, each
        update read the whole table (20,000 images: 23 s; a million: days)."""
        with self.transaction():
            self.db.execute("UPDATE nodes SET repr=0, served_size=NULL, object=NULL, checksum=NULL, "
                            "object_stamp=NULL WHERE repr=1")
            self.db.executemany(
                "UPDATE nodes SET repr=1, served_size=?, object=?, checksum=?, object_stamp=? "
                "WHERE id=? AND kind=0",
                [(x.raw_size, x.object, x.checksum, x.object_stamp, ident) for ident, x in chosen])
            self.set_meta("ratio", repr(ratio))

    def refresh_file(self, node: Node) -> None:
        """Record a file's size, mtime, version and mode as ``node`` says them now (a file changed in place since
        the scan, which its directory's mtime does not show: ``Store.since_scan``). The mode too: a row whose
        version is the file's as it is now, after a chmod, showed the scan's mode, and nothing said it changed."""
        with self.transaction():
            self.db.execute("UPDATE nodes SET size=?, mtime_ns=?, etag=?, mode=? WHERE id=? AND kind=?",
                            (node.size, node.mtime_ns, node.etag, node.mode, node.id, KIND_FILE))

    def surplus_objects(self) -> list[tuple[bytes, str]]:
        """(path, object) of the expansions no node serves any more (a served row without an object, which no
        build writes, must not make every one look served: ``x NOT IN (..., NULL)`` is never true)."""
        return self.db.execute("SELECT path, object FROM expansions WHERE object IS NOT NULL AND object NOT IN "
                               "(SELECT object FROM nodes WHERE repr=1 AND object IS NOT NULL)").fetchall()

    def forget_expansions(self, paths: Iterable[bytes]) -> None:
        with self.transaction():
            self.db.executemany("DELETE FROM expansions WHERE path=?", [(p,) for p in paths])

    def expanded_objects(self) -> tuple[set[str], int]:
        """The objects prepare wrote and still knows of, and their bytes."""
        rows = self.db.execute("SELECT object, raw_size FROM expansions WHERE object IS NOT NULL").fetchall()
        return {obj for obj, _ in rows}, sum(size or 0 for _, size in rows)

    def is_fresh(self) -> bool:
        """True when no directory of the source gained, lost or renamed an entry since the scan (``staleness``)."""
        return self.staleness() is None

    def _names(self, rel: bytes) -> bool:
        """Whether the catalog has an entry at ``rel`` (a lookup per component, by the index a LOOKUP uses)."""
        node: Node | None = None
        parent = ROOT_ID
        for name in rel.split(b"/"):
            node = self.lookup(parent, name)
            if node is None:
                return False
            parent = node.id
        return node is not None

    def staleness(self) -> str | None:
        """None when no directory of the source gained, lost or renamed an entry since the scan; else why the
        catalog is stale: ``CHANGED`` (a directory changed: the catalog is still sound, only behind), or
        ``MUST_RESCAN`` (it must be scanned again before it is used).

        Adding, removing or renaming an entry changes its directory's mtime, so stat-ing the directories (not
        listing them) is enough; a file whose content changed in place is caught per file at open.
        """
        if self.meta(FILE_IDENTITY) != IDENTITY_INO_CTIME:
            return MUST_RESCAN  # scanned by an older liquidfs: its files' identities are too weak to reuse
        if self.meta(UNLISTED) not in (None, "0"):
            return MUST_RESCAN  # a directory the scan could not list is shown empty: tried again
        from .identity import file_version, stored_ns  # here: `umount` and `stats` read no catalog, and load no xxhash

        mounted = mounted_below(self.source)  # the scan shows none: one there now is a change, never stat-ed
        if any(self._names(rel) for rel in mounted):  # on a file too (a bind mount, a user's FUSE mount)
            return CHANGED
        try:
            root = open_dir(self.source)
        except OSError:
            return CHANGED
        try:
            for rel, mtime_ns, version in self.directories():
                # Below the root as the scan walks (whoever writes the source or the store chooses the names): no
                # link followed (one into a FUSE mount that never answers would hang this root command for good),
                # never above the root or onto another filesystem; a row no walk takes is a change.
                if not isinstance(rel, bytes) or rel in mounted:
                    return CHANGED
                try:
                    st = os.fstat(root) if rel == b"" else stat_below(root, rel)
                except OSError as exc:  # catalog_parts refuses a path that leaves the root (EIO)
                    if exc.errno == errno.ENAMETOOLONG:
                        continue  # past PATH_MAX: the scan could not list it either (shown empty), every time
                    return CHANGED
                if not stat.S_ISDIR(st.st_mode) or stored_ns(st.st_mtime_ns) != mtime_ns:
                    return CHANGED
                if version is not None and version != file_version(st):
                    return CHANGED  # its mtime put back (`touch -d`, a restore), or its modes changed
        finally:
            os.close(root)
        return None
