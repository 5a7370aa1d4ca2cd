"""Writing a catalog: the walk of a local tree or the listing of an object store into a new catalog, and a
working copy that prepare changes; either becomes the store's catalog with one rename, what prepare learnt
carried over."""

from __future__ import annotations

import contextlib
import errno
import logging
import operator
import os
import sqlite3
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from ..sysio.cgroups import usable_cores
from ..sysio.locks import HeldLock, abandoned, unique
from ..sysio.paths import MountsBelow, open_dir_below
from ..sysio.progress import Progress
from ..sysio.short import SHORT_OF_RESOURCES
from . import listings
from .catalog import CATALOG_NAME, Catalog, connect
from .identity import INT64_MAX, file_version, stored_ns
from .nodes import CONTROL_NAME, KIND_DIR, KIND_FILE, KIND_SYMLINK, REPR_ORIGINAL, ROOT_ID
from .scan import START_AFTER, Warmer
from .schema import (FILE_IDENTITY, IDENTITY_INO_CTIME, INDEXES, SCANNED_COLUMNS, SCHEMA_VERSION, TABLES,
                     UNLISTED, CatalogError, schema_version)
from .sink import LocalSink, ProcessSink, Sink
from .store_dir import check_store_dir, make_store_dir
from .store_dir import refusal as store_dir_refusal

log = logging.getLogger(__name__)


@dataclass
class ScanReport:
    files: int = 0
    directories: int = 0
    symlinks: int = 0
    ignored: int = 0
    unlisted: int = 0  # directories that could not be listed for a reason that may pass (``_PASSING``)
    seconds: float = 0.0


_INSERT = f"INSERT INTO nodes({SCANNED_COLUMNS}) VALUES ({','.join('?' * 15)})"
#: A file's or symlink's row of a local tree; what a scan never sets is written by SQLite, not bound per row (a
#: fifth of an insert's time went to binding all 15 values).
_INSERT_ENTRY = ("INSERT INTO nodes(id, parent, name, path, kind, mode, size, mtime_ns, target, etag, nsubdirs, repr) "
                 f"VALUES (?,?,?,?,?,?,?,?,?,?,0,{REPR_ORIGINAL})")
_FIRST = operator.itemgetter(0)
_RECORD = listings.RECORD.pack
#: Seconds a build's progress waits before it shows: a build done by then never shows any.
PROGRESS_DELAY = 2.0
#: Rows bound in one ``executemany``.
_BATCH = 10_000
_INSERT_LISTING = "INSERT INTO listings(parent, last, entries) VALUES (?, ?, ?)"
#: Bytes of packed listings held before they are written (about the rows' ``_BATCH``).
_LISTING_BYTES = 1 << 20


class _Writer:
    """A new catalog being written next to the current one; ``finish`` swaps it in atomically."""

    def __init__(self, store_dir: str | os.PathLike[str], *, rescue: bool = True) -> None:
        self.store = Path(store_dir)
        make_store_dir(self.store)
        check_store_dir(self.store, writing=True)  # before a leftover is looked at
        self.final = self.store / CATALOG_NAME
        # Copies of runs that died: what their prepares learnt is merged into this catalog at its finish, then
        # they go (an abort leaves them to the next writer). Not where the store's writers take no lock (an
        # object store's node copy, refreshed by each mount): another's copy there is no dead prepare's.
        self.abandoned = _abandoned(self.store) if rescue else []
        self.tmp, self.lock = _in_the_making(self.store)
        self.sink: Sink | None = None  # made at the first flush, once the build's size says which
        self.rows: list[tuple[object, ...]] = []
        self.entries: list[tuple[object, ...]] = []
        self.listings: list[tuple[int, int, bytes]] = []
        self.listing_bytes = 0

    def _open(self, large: bool) -> Sink:
        """The sink of a build that filled a batch (``large``) is a helper process, where a second core is ours
        to use; a small one's is SQLite here (a process costs more to start than its rows to insert)."""
        sink: Sink | None = None
        if large and usable_cores() > 1:
            try:
                sink = ProcessSink(self.tmp)
            except OSError as exc:
                log.info("the catalog is written in the builder's process (no helper: %s)", exc)
        sink = sink or LocalSink(self.tmp)
        try:
            sink.execute("PRAGMA trusted_schema=OFF")  # as every catalog connection (``connect``)
            sink.execute("PRAGMA journal_mode=OFF")
            sink.execute("PRAGMA synchronous=OFF")
            sink.execute("PRAGMA threads=2")  # the sorts of the indexes made at the end, on two cores
            sink.script(TABLES)
            sink.execute("BEGIN")
        except BaseException:
            sink.abort()
            raise
        return sink

    def add(self, row: tuple[object, ...]) -> None:
        """A row of every scanned column (``SCANNED_COLUMNS``)."""
        self.rows.append(row)
        if len(self.rows) >= _BATCH:
            self.flush()

    def add_entry(self, row: tuple[object, ...]) -> None:
        """A local file's or symlink's row (``_INSERT_ENTRY``)."""
        self.entries.append(row)
        if len(self.entries) >= _BATCH:
            self.flush()

    def add_listing(self, parent: int, ids: Sequence[int], records: Sequence[bytes]) -> None:
        """A directory's packed entries (``listings.record``), of the ascending ``ids``, one each."""
        for last, chunk in listings.chunks(ids, records):
            self.listings.append((parent, last, chunk))
            self.listing_bytes += len(chunk)
            if self.listing_bytes >= _LISTING_BYTES or len(self.listings) >= _BATCH:
                self.flush()  # within a directory too: a batch is bounded however many entries one has

    def flush(self, *, last: bool = False) -> None:
        if self.sink is None:  # a build that fills a batch before its end is a large one
            self.sink = self._open(large=not last)
        for statement, rows in ((_INSERT, self.rows), (_INSERT_ENTRY, self.entries), (_INSERT_LISTING, self.listings)):
            if rows:
                self.sink.many(statement, rows)
                rows.clear()
        self.listing_bytes = 0

    def finish(self, meta: dict[str, str], previous: Path | None = None) -> None:
        """Index, commit, carry over what prepare learnt from ``previous`` (default: the catalog being replaced),
        swap."""
        self.flush(last=True)
        assert self.sink is not None
        for index in INDEXES:  # in the transaction (``executescript`` would commit it first)
            self.sink.execute(index)
        meta = {"schema_version": str(SCHEMA_VERSION), "scanned_at": str(time.time()), **meta}
        self.sink.many("INSERT INTO meta(key, value) VALUES (?, ?)", list(meta.items()))
        self.sink.commit()
        db = sqlite3.connect(self.tmp, isolation_level=None)
        try:
            # The previous catalog is ATTACHed to carry over what prepare learnt: it may be anyone's, and its schema
            # must run nothing here. A file nobody reads yet: no fsync, and a journal in memory only, which its
            # ROLLBACK needs.
            db.execute("PRAGMA trusted_schema=OFF")
            db.execute("PRAGMA journal_mode=MEMORY")
            db.execute("PRAGMA synchronous=OFF")
            carried = _carry_over_expansions(db, previous or self.final)
            rescued = _rescue_expansions(db, self.abandoned)
        finally:
            db.close()
        # The rename is the commit point: a mount that has the old catalog open keeps reading the old file.
        _replace(self.tmp, self.final, durable=carried or bool(rescued))
        _remove_copies(rescued)
        self.lock.release()

    def abort(self) -> None:
        """The build failed: its catalog in the making goes, the current one stays."""
        if self.sink is not None:
            self.sink.abort()
        self.tmp.unlink(missing_ok=True)
        self.lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            return
        self.abort()  # a failed walk or listing, an interrupt included: nothing half-written stays
        if isinstance(exc, sqlite3.Error):  # a full disk, most likely: said in one line, naming the store
            raise CatalogError(f"cannot write the catalog in {self.store}: {exc}") from exc


class WorkingCopy:
    """A private copy of a store's catalog that ``publish`` puts in its place with one rename.

    A running mount reads the catalog file it opened at start: a change made in place (a new selection, rows
    half-updated) would show it a store that never existed as a whole. Changes are made here and become the
    store's catalog atomically; mounts already running keep reading the old file, a consistent snapshot.
    """

    def __init__(self, store_dir: Path) -> None:
        self.final = store_dir / CATALOG_NAME
        self.published = False
        self._rescued: list[Path] = []  # the dead runs' copies taken over, removed once this one is published
        # Copies of killed prepares (as large as the catalog each: gigabytes at ten million files), which only a
        # scan's writer removed, and a fresh catalog is not scanned again.
        check_store_dir(store_dir, writing=True)  # before a leftover is looked at, as _Writer's
        abandoned = _abandoned(store_dir)
        self.path, self.lock = _in_the_making(store_dir)
        try:
            source = connect(self.final, readonly=True)
            try:
                copy = sqlite3.connect(self.path, isolation_level=None)
                try:
                    source.backup(copy)
                    # A prepare killed outright (SIGKILL, the OOM killer, a power cut) recorded what it learnt in
                    # its copy alone: taken over here, or every image it expanded was decoded again to adopt its
                    # object, and an image that kills workers was tried again.
                    copy.execute("PRAGMA trusted_schema=OFF")
                    self._rescued = _rescue_expansions(copy, abandoned)
                finally:
                    copy.close()
            finally:
                source.close()
            self.catalog = Catalog.open_path(self.path)
        except BaseException:
            self.discard()
            raise

    def publish(self) -> None:
        """The copy in the store's catalog's place; once (a second call, after a failure that came after the
        first, does nothing)."""
        if self.published or not self.path.exists():  # (an interrupt after the rename, before the flag)
            return
        self.catalog.close()
        _replace(self.path, self.final, durable=True)  # what a prepare learnt: hours of work, its only record
        self.published = True
        self.lock.release()
        _remove_copies(self._rescued)  # (a copy discarded instead leaves them to the next writer)

    def discard(self) -> None:
        if hasattr(self, "catalog"):
            self.catalog.close()
        self.path.unlink(missing_ok=True)
        self.lock.release()


def _replace(tmp: Path, final: Path, *, durable: bool) -> None:
    """``tmp`` renamed over ``final``. ``durable``: its pages on disk before the rename, and the rename on disk
    after, so a crash leaves the old catalog or the new one, never the new name on pages never written (a catalog
    that holds what prepare learnt; one of a tree alone is scanned again in seconds, and is not waited for)."""
    if durable:
        _fsync(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    os.replace(tmp, final)
    if durable:
        _fsync(final.parent, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _in_the_making(store: Path) -> tuple[Path, HeldLock]:
    """A name of its own for a catalog being written, and a lock held while it is: two writers on one store (two
    prepares, a prepare and a mount's rescan), even in other PID namespaces, never touch each other's catalog in
    the making, and one whose writer died is found by its free lock (``_abandoned``).

    The file is made here, empty, owner-only, where no file or link was (``O_EXCL | O_NOFOLLOW``): SQLite opens
    a name and follows a link there, and in a store whose directory others may write, a link planted at the name
    (seen from its lock file) would have had root make or write a file wherever it pointed. Where others may
    rename in the directory, they could swap the file made for a link after it is made: refused
    (``store_dir``)."""
    check_store_dir(store, writing=True)
    path = store / unique(f"{CATALOG_NAME}.new-")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    try:
        return path, HeldLock(Path(f"{path}.lock"))
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _abandoned(store: Path) -> list[Path]:
    """Catalogs in the making whose writer died (their lock is free). Looked at by a writer of the store (which
    holds its writers' lock): none of them is another's live copy, nor becomes one."""
    return [Path(str(lock)[:-len(".lock")]) for lock in store.glob(f"{CATALOG_NAME}.new-*.lock") if abandoned(lock)]


def _remove_copies(copies: Sequence[Path]) -> None:
    """Catalogs in the making of ``_abandoned``, with SQLite's side files and their locks."""
    for tmp in copies:
        for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm"), Path(f"{tmp}-journal"), Path(f"{tmp}.lock")):
            leftover.unlink(missing_ok=True)


#: The expansions table's columns (``schema``), named: a copy's are taken by name, never by their order.
_EXPANSION_COLUMNS = ("path, src_size, src_mtime_ns, format, object, raw_size, checksum, reason, src_etag, "
                      "object_stamp")


#: SQLite's result codes for a file that is no database, or a damaged one: a copy left so is passed over (and
#: removed); any other failure (a full disk, an I/O error) keeps it for the next writer, and is raised.
_UNREADABLE = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB


def _rescue_expansions(db: sqlite3.Connection, copies: Sequence[Path]) -> list[Path]:
    """What the prepares that wrote ``copies`` (catalogs in the making of runs that died) learnt, put in ``db``'s
    expansions where it differs from what it holds (theirs is newer: every copy older than the last writer's
    start went then); the copies done with, to be removed once ``db`` is in place: each merged, or passed over
    where it cannot be read (torn by the death; SQLite rolls back what its journal says first) or is of another
    schema. Each row is checked again where it is used (prepare reuses an expansion only of the same source, with
    its object there as recorded), as the catalog's own are."""
    done: list[Path] = []
    for copy in copies:
        if not copy.exists():  # (gone meanwhile: an ATTACH would make an empty file at its name)
            continue
        try:
            db.execute("ATTACH DATABASE ? AS dead", (str(copy),))
            try:
                row = db.execute("SELECT value FROM dead.meta WHERE key='schema_version'").fetchone()
                if row is not None and schema_version(row[0]) == SCHEMA_VERSION:
                    # Only what differs: a prepare's copy is a whole catalog, its rows the same as these but a few.
                    count = db.execute(f"INSERT OR REPLACE INTO main.expansions({_EXPANSION_COLUMNS}) "
                                       f"SELECT {_EXPANSION_COLUMNS} FROM dead.expansions EXCEPT "
                                       f"SELECT {_EXPANSION_COLUMNS} FROM main.expansions").rowcount
                    if count > 0:
                        log.info("took over %d images' expansions from %s, left by a run that died", count,
                                 copy.name)
            finally:
                _detach(db, "dead")
        except sqlite3.DatabaseError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in _UNREADABLE:
                raise  # kept: the only record of what that run learnt
            log.warning("cannot read %s, left by a run that died: %s", copy, exc)
        done.append(copy)
    return done


def build(source: str | os.PathLike[str], store_dir: str | os.PathLike[str], *, progress: bool = False) -> ScanReport:
    """Scan ``source`` into a new catalog in ``store_dir``, replacing any previous one atomically.

    What ``prepare`` learnt (the ``expansions`` table) is carried over, so a rescan never redoes expansions of
    unchanged files. Entries that are neither files, directories nor symlinks (sockets, fifos, devices) are not
    shown: a dataset has no use for them and serving them through FUSE is unsafe.

    Ids are given depth first, each directory's entries in name order. A helper reads the inodes of the
    directories the walk wants next (``scan.Warmer``): it only makes them warm; every row is what this walk read.
    Each directory's entries are packed for its listings too (``listings``). ``progress``: the entries walked on
    stderr, where the walk is a long one (``sysio.progress``: a bar on a terminal, a line now and then on a log).
    """
    started = time.monotonic()
    root = os.fsencode(os.path.abspath(source))
    try:  # the catalog names its source as text: said now, not after a walk of ten million files
        root.decode("utf-8")
    except UnicodeDecodeError:
        raise CatalogError(f"{os.fsdecode(root)!r}: the source's path is not UTF-8, which a catalog cannot name; "
                           "give it through a link of a UTF-8 name (names below it may be any bytes)") from None
    # The root as named (a link there is the user's choice); every directory below is reached from it, never
    # through a link (``sysio.paths.open_dir_below``), as the mount reaches the files.
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise NotADirectoryError(f"{source} is not a directory") from None
    try:
        with _Writer(store_dir) as writer:
            report = _walk(root, root_fd, writer, progress)
    finally:
        os.close(root_fd)
    report.seconds = time.monotonic() - started
    log.info(
        "catalog of %s: %d files, %d directories (%d could not be listed for now), %d symlinks in %.2f s",
        os.fsdecode(root), report.files, report.directories, report.unlisted, report.symlinks, report.seconds,
    )
    return report


def _walk(root: bytes, root_fd: int, writer: _Writer, progress: bool) -> ScanReport:
    """``build``'s walk of ``root`` (open at ``root_fd``) into ``writer``, finished.

    The daemon reads what others write: the owner of a source may swap a directory for a link (to /root, to /)
    while it is walked. Each directory is opened below the root without following any link, checked to be the
    one its parent's listing found, and its entries are stat-ed and read relative to that descriptor: a swapped
    directory is shown empty, and nothing outside the source is ever listed."""
    report = ScanReport()
    root_st = os.fstat(root_fd)
    next_id = ROOT_ID + 1
    # Directories' rows wait for their subdirectory counts: one row per directory, few even at ten million files.
    nsubdirs: dict[int, int] = {}
    # (A directory's version, as a file's: its inode and ctime, which a listing's change moves and a `touch -d`
    # that puts the mtime back cannot: ``Catalog.staleness``.)
    dir_rows: dict[int, tuple[int, int, bytes, bytes, int, int, int, int, str]] = {
        ROOT_ID: (ROOT_ID, ROOT_ID, b"", b"", KIND_DIR, root_st.st_mode, root_st.st_size,
                  stored_ns(root_st.st_mtime_ns), file_version(root_st))
    }
    # Each stack item: (directory id, absolute path, relative path, (st_dev, st_ino) as its parent's listing found it).
    stack: list[tuple[int, bytes, bytes, tuple[int, int]]] = [(ROOT_ID, root, b"", (root_st.st_dev, root_st.st_ino))]
    seen = files = 0
    bar: Progress | None = None  # once the build is large enough to start its helpers
    with Warmer(root_fd) as warmer, contextlib.ExitStack() as closing:
        mounts = _mounts_below(root, closing)
        while stack:
            dir_id, abs_dir, rel_dir, listed_as = stack.pop()
            warmer.taken(rel_dir)
            mounted = mounts.refresh() if mounts is not None else frozenset()
            if seen >= START_AFTER:
                warmer.start()
                warmer.expect(item[2] for item in reversed(stack[-warmer.ahead:]))
                if progress and bar is None:
                    bar = closing.enter_context(
                        Progress(f"scanning {os.fsdecode(root)}", "entries", initial=seen, delay=PROGRESS_DELAY))
            dir_fd, entries, failed = _listing(root, root_fd, rel_dir, listed_as)
            report.unlisted += failed in _PASSING
            seen += len(entries)
            if bar is not None:
                bar.update(len(entries))
            subdirs = 0
            first_id = next_id
            records: list[bytes] = []  # the directory's listing (catalog.listings): an id each, from first_id on
            try:
                for name, entry in entries:
                    row: tuple[int, int, int, int, bytes | None, str | None] | None
                    rel = rel_dir + b"/" + name if rel_dir else name
                    if not listings.fit_name(name):  # over NAME_MAX: a FUSE source's (sshfs) may list one
                        log.warning("%r: a name no entry of the mount can have; not shown", abs_dir + b"/" + name)
                        report.ignored += 1
                        continue
                    if rel == CONTROL_NAME:  # the mount's own control file: this entry could never be reached
                        log.warning("%r: the mount's control file has this name; not shown", abs_dir + b"/" + name)
                        report.ignored += 1
                        continue
                    if rel in mounted:  # (its stat would go to the filesystem mounted there: never, as root)
                        log.warning("%r: another filesystem is mounted there; not shown", abs_dir + b"/" + name)
                        report.ignored += 1
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                        mode = st.st_mode
                        if stat.S_ISREG(mode):
                            row = (KIND_FILE, mode, st.st_size, stored_ns(st.st_mtime_ns), None, file_version(st))
                            files += 1
                        elif stat.S_ISDIR(mode):
                            row = None
                        elif stat.S_ISLNK(mode):
                            target = os.readlink(name, dir_fd=dir_fd)
                            row = (KIND_SYMLINK, mode, len(target), stored_ns(st.st_mtime_ns), target, None)
                            report.symlinks += 1
                        else:
                            report.ignored += 1
                            continue
                    except OSError as exc:
                        log.warning("cannot read %r: %s; not shown", abs_dir + b"/" + name, exc)
                        report.ignored += 1
                        report.unlisted += exc.errno in _PASSING  # (a hiccup: the next use scans again)
                        continue
                    records.append(_RECORD(next_id, mode, len(name)) + name)
                    if row is None:
                        subdirs += 1
                        dir_rows[next_id] = (next_id, dir_id, name, rel, KIND_DIR, mode, st.st_size,
                                             stored_ns(st.st_mtime_ns), file_version(st))
                        stack.append((next_id, abs_dir + b"/" + name, rel, (st.st_dev, st.st_ino)))
                    else:
                        writer.add_entry((next_id, dir_id, name, rel, *row))
                    next_id += 1
            finally:  # however the entries' loop ends (a full disk at a flush, an interrupt)
                if dir_fd >= 0:
                    os.close(dir_fd)
            nsubdirs[dir_id] = subdirs
            writer.add_listing(dir_id, range(first_id, next_id), records)
    report.directories, report.files = len(dir_rows) - 1, files
    for r in dir_rows.values():
        writer.add((*r[:8], nsubdirs.get(r[0], 0), None, REPR_ORIGINAL, None, None, None, r[8]))
    writer.finish({"source": os.fsdecode(root), FILE_IDENTITY: IDENTITY_INO_CTIME,
                   listings.META_KEY: listings.FORMAT, UNLISTED: str(report.unlisted)})
    return report


def _mounts_below(root: bytes, closing: contextlib.ExitStack) -> MountsBelow | None:
    """The mount points below ``root``, followed through the walk (None where /proc cannot tell: then none)."""
    try:
        return closing.enter_context(contextlib.closing(MountsBelow(root)))
    except OSError as exc:
        log.debug("no mount table to read (%s): mount points below the source are not told apart", exc)
        return None


#: Errors of a directory's listing that may pass (a flaky disk or server, descriptors or memory short, a directory
#: replaced while scanned): a catalog with one is scanned again at its next use. Others (EACCES, EXDEV for another
#: filesystem inside the source, ELOOP) would fail every scan the same way: each would be a whole rescan for none.
_PASSING = SHORT_OF_RESOURCES | {errno.EIO, errno.EINTR, errno.EAGAIN, errno.ESTALE, errno.ETIMEDOUT}


def _listing(root: bytes, root_fd: int, rel_dir: bytes,
             listed_as: tuple[int, int]) -> tuple[int, list[tuple[bytes, os.DirEntry[str]]], int | None]:
    """The directory ``rel_dir`` opened (its descriptor, which the caller closes) and its entries by name in
    name order (bytes: a descriptor's listing names them in str), each one's ``stat`` relative to it, and None
    (EAGAIN where a name was listed twice, shown once); (-1, [], errno) where it cannot be listed or is no longer
    the directory its parent's listing found (``listed_as``, ESTALE): shown empty."""
    try:
        dir_fd = open_dir_below(root_fd, rel_dir, root)
    except OSError as exc:
        log.warning("cannot list %s: %s; shown empty", exc.filename, exc.strerror)
        return -1, [], exc.errno
    try:
        st = os.fstat(dir_fd)
        if (st.st_dev, st.st_ino) != listed_as:
            raise OSError(errno.ESTALE, "replaced while the source was scanned")
        with os.scandir(dir_fd) as found:
            entries = sorted(((os.fsencode(entry.name), entry) for entry in found), key=_FIRST)
        once = [each for i, each in enumerate(entries) if i == 0 or each[0] != entries[i - 1][0]]
        if len(once) < len(entries):
            # A name deleted and made again while listed, which a directory's hash order may return twice (NFS,
            # a FUSE source): one entry each (the catalog's names are unique), scanned again at the next use.
            log.warning("%r listed a name twice (changed while listed): shown once, scanned again at the next use",
                        root + b"/" + rel_dir if rel_dir else root)
            return dir_fd, once, errno.EAGAIN
        return dir_fd, entries, None
    except OSError as exc:
        os.close(dir_fd)
        log.warning("cannot list %r: %s; shown empty", root + b"/" + rel_dir if rel_dir else root, exc)
        return -1, [], exc.errno


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
    with _Writer(store_dir, rescue=False) as writer:
        report = _objects_into(objects, writer, source, previous)
    report.seconds = time.monotonic() - started
    log.info("catalog of %s: %d objects, %d directories in %.2f s", source, report.files, report.directories,
             report.seconds)
    return report


def _unshowable_key(parts: Sequence[bytes]) -> bool:
    """An object's key (its components) with one that no directory entry can be named, or that names the mount's
    control file at its root (the mount answers that name itself: the object could never be reached)."""
    return parts[0] == CONTROL_NAME or any(map(_unshowable, parts))


def _unshowable(part: bytes) -> bool:
    """A component of an object's key that no directory entry can be named."""
    return part in (b"", b".", b"..") or len(part) > 255 or b"\0" in part


def _objects_into(objects: Iterable[tuple[str, int, str, int]], writer: _Writer, source: str,
                  previous: Path | None) -> ScanReport:
    """``build_from_objects``' listing into ``writer``, finished."""
    report = ScanReport()
    # path -> [id, parent id, newest mtime, subdirectory count]
    dirs: dict[bytes, list[int]] = {b"": [ROOT_ID, ROOT_ID, 0, 0]}
    files: dict[bytes, tuple[object, ...]] = {}
    next_id = ROOT_ID + 1

    def directory(path: bytes) -> list[int] | None:
        """The directory at ``path``, made with those missing above it; None below a file. A loop, not a call a
        component: a store that takes long keys gives thousands ('a/' * 1200), past Python's recursion limit."""
        nonlocal next_id
        missing: list[bytes] = []
        while (found := dirs.get(path)) is None:
            if path in files:
                return None
            missing.append(path)
            path = path.rpartition(b"/")[0]
        for each in reversed(missing):
            found[3] += 1
            dirs[each] = found = [next_id, found[0], 0, 0]
            next_id += 1
            report.directories += 1
        return found

    for rel, size, etag, mtime_ns in objects:
        path = rel.encode("utf-8", "surrogateescape")
        parts = path.split(b"/")
        if path.endswith(b"/") and size == 0 and not _unshowable_key(parts[:-1]):
            directory(path[:-1])  # a "folder" marker object made by consoles and s3fs: an empty directory
            continue
        parent_path, _, name = path.rpartition(b"/")
        if _unshowable_key(parts) or path in dirs or not 0 <= size <= INT64_MAX:
            log.warning("object %r (%d bytes) cannot be shown as a file; left out", rel, size)
            report.ignored += 1
            continue
        parent = directory(parent_path)
        mtime_ns = stored_ns(mtime_ns)  # a LastModified after 2262
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
    # Each directory's entries for its packed listing: an object store's are not numbered one directory at a time,
    # so they are gathered here (~1 us an object).
    children: dict[int, list[tuple[int, int, bytes]]] = {}
    for row in files.values():
        writer.add(row)
        children.setdefault(row[1], []).append((row[0], OBJECT_FILE_MODE, row[2]))  # type: ignore[arg-type]
    for path, (node_id, parent_id, mtime_ns, subdirs) in dirs.items():
        name = path.rpartition(b"/")[2]
        writer.add((node_id, parent_id, name, path, KIND_DIR, OBJECT_DIR_MODE, 0, mtime_ns,
                    subdirs, None, REPR_ORIGINAL, None, None, None, None))
        if node_id != ROOT_ID:
            children.setdefault(parent_id, []).append((node_id, OBJECT_DIR_MODE, name))
    for parent_id, entries in children.items():
        entries.sort()
        writer.add_listing(parent_id, [entry[0] for entry in entries], [listings.record(*entry) for entry in entries])
    writer.finish({"source": source, "source_kind": "s3", listings.META_KEY: listings.FORMAT}, previous)
    return report


#: SQLite's primary result code for a write that found no room (``sqlite3.Error.sqlite_errorcode`` & 0xFF).
SQLITE_FULL = 13


def _carry_over_expansions(db: sqlite3.Connection, previous: Path) -> bool:
    """Copy prepare's knowledge from the catalog being replaced, and re-apply the chosen representations; whether
    there was any."""
    if not previous.exists():
        return False
    try:
        db.execute("ATTACH DATABASE ? AS old", (str(previous),))
    except sqlite3.DatabaseError:
        return False
    try:
        db.execute("BEGIN")
        row = db.execute("SELECT value FROM old.meta WHERE key='schema_version'").fetchone()
        version = schema_version(row[0]) if row is not None else None
        if version not in (1, 2, 3, 4, SCHEMA_VERSION):
            db.execute("ROLLBACK")
            return False
        assert version is not None
        etag = "src_etag" if version >= 2 else "NULL"
        stamp = "object_stamp" if version >= 4 else "NULL"  # older objects: checked by their checksum
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
        carried: bool = db.execute("SELECT EXISTS (SELECT 1 FROM expansions)").fetchone()[0] == 1
        db.execute("COMMIT")
        return carried
    except sqlite3.DatabaseError as exc:
        if db.in_transaction:  # (SQLite may have rolled back itself: a ROLLBACK then fails in its place)
            db.execute("ROLLBACK")
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == SQLITE_FULL:
            # The new catalog's disk is full (just after a prepare wrote its objects, likely): not a previous
            # catalog to do without. Put in place, the new one would drop what every prepare learnt.
            raise
        log.warning("could not carry over prepare's state from %s: %s", previous, exc)
        return False
    finally:
        _detach(db, "old")


def _detach(db: sqlite3.Connection, name: str) -> None:
    """The database ``name`` ATTACHed to ``db`` let go, after the transaction left open, if any. An interrupt
    (Ctrl-C, a stop signal's exception) inside it leaves it open, where a DETACH fails ("database old is
    locked"): that error replaced the interrupt, reported as a catalog that cannot be written. No error of this
    clean-up replaces what is raised."""
    with contextlib.suppress(sqlite3.Error):
        if db.in_transaction:
            db.execute("ROLLBACK")
        db.execute(f"DETACH DATABASE {name}")


#: ``current_catalog``: the catalog describes the source as it is now.
FRESH = "fresh"
#: ``current_catalog``: the store has no catalog yet.
MISSING = "missing"


def current_catalog(source: str | os.PathLike[str], store_dir: str | os.PathLike[str]) -> tuple[Catalog | None, str]:
    """(the catalog in ``store_dir``, ``FRESH``) where it describes ``source`` as it is now; else (None, why):
    ``MISSING``, or ``Catalog.staleness``'s reason. CatalogError where it describes another source."""
    path = Path(store_dir) / CATALOG_NAME
    check_store_dir(Path(store_dir), writing=False)
    if not path.exists():
        return None, MISSING
    # Read-write (an old schema is upgraded in place) only where this process may write the store.
    catalog = Catalog.open(store_dir, readonly=store_dir_refusal(Path(store_dir), writing=True) is not None)
    try:
        described = catalog.source
        if described != os.fsencode(os.path.abspath(source)):
            raise _of_another_source(path, described, source)
    except CatalogError:
        catalog.close()
        raise
    try:
        stale = catalog.staleness()
    except sqlite3.DatabaseError as exc:
        # Pages a crash left unwritten, past the few the open read: said as the open says it, never a traceback.
        catalog.close()
        raise CatalogError(f"{path} is damaged ({exc}): a damaged catalog (a crash while it was written) is made "
                           "again by `liquidfs mount --rescan`, or removed") from exc
    if stale is None:
        return catalog, FRESH
    catalog.close()
    return None, stale


def _of_this_source(source: str | os.PathLike[str], store_dir: str | os.PathLike[str]) -> None:
    """CatalogError where the catalog in ``store_dir`` describes another source: a rescan must not put this
    source's in its place (a prepare of this source would then take the other's objects for surplus and remove
    them). One that cannot be read is replaced (a rescan is the way out of a damaged catalog)."""
    path = Path(store_dir) / CATALOG_NAME
    if not path.exists():
        return
    try:  # its meta row alone, whatever its schema's version (a newer liquidfs's catalog is not a damaged one)
        db = connect(path, readonly=True, immutable=True)
        try:
            row = db.execute("SELECT value FROM meta WHERE key='source'").fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return
    described = row[0] if row is not None else None
    if isinstance(described, str) and described and os.fsencode(described) != os.fsencode(os.path.abspath(source)):
        raise _of_another_source(path, os.fsencode(described), source)


def _of_another_source(path: Path, described: bytes, source: str | os.PathLike[str]) -> CatalogError:
    return CatalogError(f"{path} describes {os.fsdecode(described)}, not {os.path.abspath(source)}; "
                        "use another --store")


def open_or_build(source: str | os.PathLike[str], store_dir: str | os.PathLike[str],
                  *, rescan: bool = False, progress: bool = False) -> Catalog:
    """The catalog for ``source`` in ``store_dir``: reused when fresh, (re)built otherwise."""
    if rescan:
        _of_this_source(source, store_dir)
    if not rescan:
        catalog, state = current_catalog(source, store_dir)
        if catalog is not None:
            log.info("reusing catalog %s", Path(store_dir) / CATALOG_NAME)
            return catalog
        if state != MISSING:
            log.info("source changed since the last scan: rescanning")
    build(source, store_dir, progress=progress)
    return Catalog.open(store_dir)
