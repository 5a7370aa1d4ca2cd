"""A dataset in a local directory, its catalog and raw objects in a store directory (``Store``).

Layout of a store directory::

    catalog.sqlite            the catalog mounts read (replaced whole by prepare: ``catalog.build.WorkingCopy``)
    objects/ab/<hash>.bmp     raw objects (.jp2 for JPEG 2000), written to a temporary name, fsynced, renamed
    profile.json              what ``prepare --ratio auto`` measured: ``mount --mix adaptive`` starts there
    prepare.lock, mounts.lock prepares (and a mount's scans) take turns; a running mount keeps prepare from
                              deleting its objects
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ...catalog.build import WorkingCopy, current_catalog, open_or_build
from ...catalog.catalog import CATALOG_NAME, CHANGED, Catalog, check_utf8, default_store_dir
from ...catalog.identity import file_version, object_stamp, stored_ns
from ...catalog.nodes import Node
from ...catalog.schema import CatalogError
from ...catalog.store_dir import check_store_dir, make_store_dir
from ...catalog.store_dir import refusal as store_dir_refusal
from ...expand.expansion import OBJECTS, OBJECTS_OPEN_TO_OTHERS, expand_one, is_image, verify_one
from ...expand.rawformats import DEFAULT, NAMES, RAW_FORMATS, SUFFIX_PATTERN
from ...sysio.directio import read_span
from ...sysio.locks import MOUNTS_LOCK, PREPARE_LOCK, PrivateDir, exclusive_lock, shared_lock
from ...sysio.paths import (open_below, open_dir, open_regular, open_to_others, renamed_only_by_its_writer,
                            stat_below)
from ...sysio.safefiles import replace_file
from ..base import Job, Preparation, refused_unread
from ..reader import OBJECT_NAME, Reader, same_file, unfit_raw_row
from ..sample import Below, ProfileError, Sample, measure_load
from .reader import StoreReader

log = logging.getLogger(__name__)

#: The directories of profiles' samples (``LocalStore.profile_sample``), in the store.
SAMPLE_PREFIX = "profile-sample-"
#: The profile ``prepare --ratio auto`` ran, kept in the store: the adaptive mix starts at its choice.
PROFILE_NAME = "profile.json"


#: A directory opened to list and unlink in, never through a link at its name.
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: The subdirectories of ``objects`` prepare makes (``expand.expansion.object_name``).
_SUBDIR = re.compile(r"[0-9a-f]{2}")
#: What a killed expansion leaves of an object (``expand.expansion.expand_one``: ``<object>.<locks.unique("tmp-")>``).
_LEFTOVER = re.compile(rf"objects/([0-9a-f]{{2}}/[0-9a-f]{{32}}{SUFFIX_PATTERN}\.tmp-[0-9a-f]{{16}})")


#: Seconds a mount waits for a running prepare (or another scan) before it uses a catalog that is only behind the
#: source as it stands (``LocalStore._one_writer``): another mount's scan is done by then, a prepare may take hours.
AS_IT_STANDS_AFTER = 10.0
#: Seconds between two looks at the prepare's lock and the catalog while waiting for them.
LOCK_POLL = 0.5


def _file_identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or written: its inode, mtime and size (None: no file there)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _trusted_catalog(path: Path) -> os.stat_result:
    """The stat of the catalog file at ``path`` if it may name the source root on its own word: a regular file
    owned by this user or root, writable by nobody else; CatalogError saying why not and what to do otherwise."""
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise CatalogError(f"{path} is not a regular file (a link?): refused")
    if st.st_uid not in (os.geteuid(), 0):
        raise CatalogError(
            f"{path} is owned by uid {st.st_uid}, not by you: the source it names is not taken on its word "
            f"(whoever writes it would choose what is read); run this as uid {st.st_uid}, or take the store over "
            "(chown, chmod go-w) once you have checked it")
    if st.st_mode & 0o022:
        raise CatalogError(
            f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): the source it names is not taken "
            "on its word; chmod go-w it once you have checked it")
    return st


def _check_readable(path: Path) -> None:
    """PermissionError naming ``path`` where this user cannot read the catalog there (a store prepared by
    another user is owner-only): SQLite says only "unable to open database file", as if it were no catalog."""
    if os.path.lexists(path) and not os.access(path, os.R_OK, effective_ids=True):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))


def _object_entry(obj: str) -> tuple[str, str] | None:
    """(subdirectory, file name) below the objects directory of a name prepare gives an object
    (``reader.OBJECT_NAME``) or of a killed run's leftover of one; None for anything else."""
    found = OBJECT_NAME.fullmatch(obj) or _LEFTOVER.fullmatch(obj)
    if found is None:
        return None
    sub, name = found.group(1).split("/")
    return sub, name


def _open_subdir(objects_fd: int, sub: str, store_dir: Path) -> int | None:
    """``objects/<sub>`` opened below the objects directory's descriptor, never through a link (None if not)."""
    try:
        return os.open(sub, _DIRECTORY_FLAGS, dir_fd=objects_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("%s/%s/%s: %s; left as it is", store_dir, OBJECTS, sub, exc.strerror)
        return None


def _unlink_regular(dir_fd: int, name: str, label: str) -> None:
    """Unlink ``name`` in ``dir_fd`` if it is a regular file. Between the check and the unlink it may become a
    link: unlinkat then removes the link itself, never what it points at."""
    try:
        if stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=dir_fd)
        else:
            log.warning("%s: not a regular file; not deleted", label)
    except FileNotFoundError:
        pass


class LocalStore:
    default_threads = 4
    raw_formats: tuple[str, ...] = NAMES  # every one, in the order prepare tries them
    stamps_objects = True
    shares_by_modes = True

    def __init__(self, source: Path, store_dir: Path | None = None) -> None:
        self.source = source
        self.store_dir = store_dir if store_dir is not None else default_store_dir(source)
        self.label = str(self.store_dir)
        self._subdirs: dict[str, os.stat_result] = {}  # objects/<sub>, stat-ed once by ``exists``
        self._held: tuple[int, int] | None = None  # the first reader's directories (``reader``), for the process
        self._root_fd: int | None = None  # the source root, held while a prepare runs (``since_scan``)
        self._root_id: tuple[int, int] | None = None  # its (st_dev, st_ino), which the workers check

    @classmethod
    def given(cls, source: str | os.PathLike[str], store: str | os.PathLike[str] | None) -> LocalStore:
        """Local directories as the user gave them (the store defaulting to this user's cache directory for the
        source)."""
        if store is not None:
            check_utf8(store, "the store's path")  # before anything is made there (``connect`` checks it again)
        return cls(Path(source).absolute(), None if store is None else Path(store).absolute())

    @classmethod
    def prepared(cls, store: str | os.PathLike[str]) -> LocalStore:
        """The store at ``store``, its source the one its catalog names: taken on the catalog's word only when
        whoever runs this (or root) owns the catalog and nobody else can write it. A writer of the store would
        otherwise choose which root a root ``verify`` opens files below (``/``)."""
        store_dir = Path(store).absolute()
        path = store_dir / CATALOG_NAME
        check_store_dir(store_dir, writing=False)
        try:
            before = _trusted_catalog(path)
        except FileNotFoundError:
            before = None  # Catalog.open says there is none
        _check_readable(path)
        catalog = Catalog.open(store_dir, readonly=True)
        try:
            source = catalog.source
        finally:
            catalog.close()
        after = _trusted_catalog(path)
        if before is None or (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
            raise CatalogError(f"{path} was replaced while it was read: refused; run this again")
        return cls(Path(os.fsdecode(source)), store_dir)

    def _check_source(self) -> None:
        """A source that is not a directory, said so before anything is written (the scan would say it with a
        raw errno and a bytes path)."""
        if not self.source.is_dir():
            if self.source.exists():
                raise NotADirectoryError(f"source {self.source}: not a directory")
            raise FileNotFoundError(f"source {self.source}: no such directory")
        # A store in its source shows in the source's listing (its catalog, its objects, a catalog in the making),
        # and changes it at every write: each scan found the source changed. A source in its store is among the
        # files a prepare removes as no longer used. Compared where the links lead, as the scan and the writes go.
        source, store = os.path.realpath(self.source), os.path.realpath(self.store_dir)
        if os.path.commonpath((source, store)) in (source, store):
            raise CatalogError(f"the store {self.store_dir} and the source {self.source} must not contain each "
                               "other: give a --store outside the source")

    def source_root(self, catalog: Catalog) -> bytes:
        """The source root to open what ``catalog`` names below: this store's source, which the catalog must name
        (a writer of the store can rewrite its catalog's ``meta.source``; it never chooses the root)."""
        given = os.fsencode(os.path.abspath(self.source))
        if catalog.source != given:
            raise CatalogError(
                f"{self.store_dir / CATALOG_NAME} names the source {os.fsdecode(catalog.source)}, not "
                f"{os.fsdecode(given)}: refused (the store may have been written by someone else); check the "
                "store, or prepare the source into another --store")
        return given

    @property
    def source_label(self) -> str:
        return str(self.source)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.source)!r}, {str(self.store_dir)!r})"

    # -- prepare ---------------------------------------------------------------------------------------

    @contextmanager
    def preparing(self, progress: bool) -> Iterator[Preparation]:
        self._check_source()
        # Checked before anything is made: through a link someone else may point elsewhere, root made the
        # store's directories where they chose, then refused.
        make_store_dir(self.store_dir)
        check_store_dir(self.store_dir, writing=True)  # before its lock is made there
        held = exclusive_lock(self.store_dir / PREPARE_LOCK, wait=False)
        if held is None:  # prepares of one store run one after another: the next reuses what the first did
            log.warning("another prepare (or a mount's scan) of %s is running: waiting for it", self.store_dir)
            held = exclusive_lock(self.store_dir / PREPARE_LOCK)
        assert held is not None
        try:
            _check_readable(self.store_dir / CATALOG_NAME)
            objects = self.store_dir / OBJECTS
            if objects.is_dir() and open_to_others(objects.stat()):
                # Checked before anything is reused: a run that writes nothing would not meet it in a worker.
                raise OSError(errno.EPERM, OBJECTS_OPEN_TO_OTHERS, str(objects))
            open_or_build(self.source, self.store_dir, progress=progress).close()
            work = WorkingCopy(self.store_dir)
            try:
                # The copy prepare reads its source root from (``catalog.source``) must name this source: the
                # catalog may have been replaced since open_or_build checked it.
                self._root_fd = open_dir(self.source_root(work.catalog))
                root_st = os.fstat(self._root_fd)
                self._root_id = (root_st.st_dev, root_st.st_ino)
                # After a failure the catalog is published all the same: the selection is unchanged, and what was
                # expanded is known to the next run.
                published = False  # a publish begun

                def publish() -> None:
                    nonlocal published
                    published = True
                    self._objects_durable()
                    work.publish()

                def keep_after_failure() -> None:
                    # Never a publish that failed tried again: a second fsync after a writeback error says 0 on
                    # Linux, and the catalog would be published after its objects failed to reach the disk.
                    if not published:
                        publish()

                yield Preparation(work.catalog, publish, keep_after_failure=keep_after_failure)
            finally:
                if self._root_fd is not None:
                    os.close(self._root_fd)
                    self._root_fd = self._root_id = None
                work.discard()  # after a publish: nothing left to do
        finally:
            os.close(held)

    def since_scan(self, node: Node) -> Node | None:
        """One stat of the file, walked below the source root as every open walks it (no link followed)."""
        if self._root_fd is None:
            return None
        try:
            st = stat_below(self._root_fd, node.path, os.fsencode(self.source))
        except OSError:
            return None  # gone, or a directory on the way replaced: its directory changed, a scan will say
        if not stat.S_ISREG(st.st_mode) or same_file(node, st):
            return None
        return dataclasses.replace(node, size=st.st_size, mtime_ns=stored_ns(st.st_mtime_ns), etag=file_version(st),
                                   mode=st.st_mode)

    def expansion_job(self, root: bytes, node: Node, obj: str, raw_formats: tuple[str, ...]) -> Job:
        # The workers reach the root by its path: they check it is still the directory this run holds open.
        return expand_one, (root, node.path, str(self.store_dir), obj, node.size, node.mtime_ns, node.etag,
                            raw_formats, self._root_id)

    def exists(self, obj: str, size: int | None = None, stamp: str | None = None) -> bool:
        # A catalog row names it: only a name prepare gives counts, never a path anywhere else. And only where a
        # mount would serve it (``StoreReader.may_serve``): else a worker writes it anew, and says why it cannot.
        if OBJECT_NAME.fullmatch(obj) is None:
            return False
        try:
            st = os.stat(self.store_dir / obj, follow_symlinks=False)
            sub = obj.rsplit("/", 1)[0]
            if sub not in self._subdirs:
                self._subdirs[sub] = os.stat(self.store_dir / sub, follow_symlinks=False)
        except OSError:
            return False
        return (stat.S_ISREG(st.st_mode) and renamed_only_by_its_writer(self._subdirs[sub], st.st_uid)
                and (size is None or st.st_size == size) and (stamp is None or object_stamp(st) == stamp))

    def delete(self, objs: list[str]) -> None:
        """Remove these objects (or leftovers of killed runs) from the objects directory, and nothing else.

        The names come from the catalog and from ``stray``, and a store writer controls both the catalog and what
        is in the objects directory, while prepare runs as root: only names prepare gives are deleted (never an
        absolute path or a '..'), each with unlinkat below the objects directory opened without following links
        (a subdirectory swapped for a link to /etc is skipped), and only regular files.
        """
        by_sub: dict[str, list[str]] = {}
        refused: list[str] = []
        for obj in objs:
            entry = _object_entry(obj)
            if entry is None:
                refused.append(obj)
            else:
                by_sub.setdefault(entry[0], []).append(entry[1])
        if refused:
            log.warning("%d object names in the catalog of %s are not names prepare gives (first: %r): not deleted",
                        len(refused), self.store_dir, refused[0])
        with self._objects_dir() as objects_fd:
            if objects_fd is None:
                return
            for sub, names in by_sub.items():
                sub_fd = _open_subdir(objects_fd, sub, self.store_dir)
                if sub_fd is None:
                    continue
                try:
                    for name in names:
                        _unlink_regular(sub_fd, name, f"{OBJECTS}/{sub}/{name}")
                finally:
                    os.close(sub_fd)

    @contextmanager
    def deleting(self) -> Iterator[bool]:
        # Every mount of this store holds MOUNTS_LOCK shared from before it opens the catalog until it ends:
        # taken here, no mount runs, and none can start until the new catalog is in place.
        held = exclusive_lock(self.store_dir / MOUNTS_LOCK, wait=False)
        if held is None:
            log.info("a mount of %s is running: surplus objects are kept for it", self.store_dir)
        try:
            yield held is not None
        finally:
            if held is not None:
                os.close(held)

    def stray(self, kept: set[str]) -> list[str]:
        """Objects and leftovers of killed runs below the objects directory that ``kept`` does not name: listed
        through descriptors opened without following links (as ``delete`` removes them), names prepare gives
        only."""
        found: list[str] = []
        with self._objects_dir() as objects_fd:
            if objects_fd is None:
                return found
            for sub in os.listdir(objects_fd):
                if _SUBDIR.fullmatch(sub) is None:
                    continue
                sub_fd = _open_subdir(objects_fd, sub, self.store_dir)
                if sub_fd is None:
                    continue
                try:
                    found.extend(obj for name in os.listdir(sub_fd)
                                 if (obj := f"{OBJECTS}/{sub}/{name}") not in kept and _object_entry(obj))
                finally:
                    os.close(sub_fd)
        return found

    def _objects_durable(self) -> None:
        """Every subdirectory of the objects directory synced, before the catalog naming their new objects is
        published: each object is fsynced before its rename, but the rename is the directory's, and after a power
        cut a published catalog could name an object that never reached the disk (served as its original, at
        another size than its lookup said). Once per run, not per object: 256 directories at most."""
        with self._objects_dir() as objects_fd:
            if objects_fd is None:
                return
            for name in os.listdir(objects_fd):
                if _SUBDIR.fullmatch(name) is None:
                    continue
                try:
                    sub = os.open(name, _DIRECTORY_FLAGS, dir_fd=objects_fd)
                except OSError:  # (a link a store writer put there: nothing of this run's is in it)
                    continue
                try:
                    os.fsync(sub)
                finally:
                    os.close(sub)
            os.fsync(objects_fd)

    @contextmanager
    def _objects_dir(self) -> Iterator[int | None]:
        """The objects directory, opened once and never through a link (None when there is none to use)."""
        path = self.store_dir / OBJECTS
        try:
            fd = os.open(path, _DIRECTORY_FLAGS)
        except FileNotFoundError:
            yield None
            return
        except OSError as exc:  # ELOOP: a link a store writer put there; ENOTDIR: a file
            log.warning("%s: %s; no object is deleted", path, exc.strerror)
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)

    # -- verify ----------------------------------------------------------------------------------------

    def verify_jobs(self) -> tuple[list[Node], Callable[[Node], Job]]:
        catalog = Catalog.open(self.store_dir, readonly=True)
        try:
            nodes = [n for n in catalog.files() if n.served_raw]
            root = self.source_root(catalog)
        finally:
            catalog.close()

        def job(n: Node) -> Job:
            # The names the mount opens (``StoreReader._object_below``), nothing else below the store.
            unfit = unfit_raw_row(n)
            name = OBJECT_NAME.fullmatch(str(n.object))
            if unfit is not None or name is None:
                return refused_unread, (f"{unfit}: a mount serves the original",)
            return verify_one, (root, n.path, str(self.store_dir / OBJECTS / name.group(1)), str(n.checksum),
                                n.size, n.mtime_ns, n.etag)

        return nodes, job

    # -- profile ---------------------------------------------------------------------------------------

    def profile_sample(self, count: int, jobs: int, seed: int = 0, raw_format: str = DEFAULT.name,
                       max_bytes: int | None = None) -> Sample:
        """Expanded into a ``profile-sample-*`` directory of this run's own inside the store, on its device."""
        from ...expand import formats  # NumPy and Pillow: the profile's, not every mount's that opens a store

        self._check_source()
        make_store_dir(self.store_dir)
        check_store_dir(self.store_dir, writing=True)  # the sample is expanded there
        _check_readable(self.store_dir / CATALOG_NAME)
        self._catalog_ready(rescan=False, progress=False)
        catalog = Catalog.open(self.store_dir, readonly=True)
        try:
            root = self.source_root(catalog)
            nodes = [n for n in catalog.files() if is_image(n.name)]
        finally:
            catalog.close()
        if not nodes:
            raise ProfileError("no PNG/JPEG images in the source")
        random.Random(seed).shuffle(nodes)
        # A directory of this run's own: profiles run at once on one store (a Job's pods) must not share or
        # delete each other's sample. Its lock is held while this run lives; a killed run's is removed here.
        private = PrivateDir(self.store_dir, SAMPLE_PREFIX)
        scratch = private.path
        opened: list[int] = []

        def cleanup() -> None:
            for fd in opened:
                os.close(fd)
            private.remove()

        # Both directories stay open for the sample's timed reads, which open each file below them as the mount
        # does (``stores.sample.Below``): the dataset's owner may swap a file for a link to a FIFO or a device.
        try:
            opened.append(root_fd := open_dir(root))
            opened.append(scratch_fd := os.open(scratch, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        except BaseException:
            cleanup()
            raise

        sample = Sample([], [], scratch, load=lambda items, seconds: measure_load(items, seconds, jobs),
                        cleanup=cleanup)
        try:
            for node in nodes:
                if sample.full(count, jobs, max_bytes):
                    break
                try:  # read as the mount reads: below the root, no link followed, the file the catalog recorded
                    fd = open_below(root_fd, node.path, root)
                    try:
                        if not same_file(node, os.fstat(fd)):
                            continue
                        data = bytes(read_span(fd, 0, node.size))  # no further than the size checked
                    finally:
                        os.close(fd)
                except OSError as exc:
                    log.warning("profile: skipping %r: %s", node.path, exc)
                    continue
                result = formats.expand(data, to=raw_format)
                if result.data is None:
                    continue
                name = f"{node.id}{RAW_FORMATS[raw_format].suffix}"
                # created in this run's own directory, by descriptor: never through a link planted in it
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=scratch_fd)
                with open(out, "wb") as written:
                    written.write(result.data)
                    # On the disk before it is timed: an O_DIRECT read of pages still dirty waits for their
                    # writeback, and the raw files timed at 642-801 MB/s where synced ones ran at 944-1285.
                    written.flush()
                    os.fsync(written.fileno())
                # Timed where the mount will read it, opened as the mount opens it.
                sample.originals.append(Below(root_fd, node.path, root, size=len(data)))
                sample.raws.append(Below(scratch_fd, os.fsencode(name), os.fsencode(scratch), size=len(result.data)))
                sample.original_data.append(data)
                sample.raw_data.append(result.data)
        except BaseException:
            sample.cleanup()
            raise
        if not sample.raws:
            sample.cleanup()
            raise ProfileError("none of the sampled images can be expanded losslessly")
        return sample

    def keep_profile(self, text: str) -> None:
        # replaced whole, never written through a link a store writer put at its name
        replace_file(self.store_dir / PROFILE_NAME, text.encode())

    def local_dirs(self) -> tuple[Path, Path] | None:
        return Path(self.source), Path(self.store_dir)

    def profile_choice(self) -> float | None:
        path = self.store_dir / PROFILE_NAME
        try:
            # a regular file only, no link: a FIFO there would hang the mount that reads it at start
            with open(open_regular(path), "rb") as f:
                chosen = json.loads(f.read(1 << 20))["chosen"]
        except FileNotFoundError:
            return None
        # (RecursionError: JSON nested past the interpreter's stack, which whoever owns the store may write)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            log.warning("%s: unreadable (%s); the adaptive mix starts in the middle of the prepared range", path,
                        type(exc).__name__ if isinstance(exc, RecursionError) else exc)
            return None
        # (a bool is an int to isinstance: ``true`` is no share)
        if isinstance(chosen, bool) or not isinstance(chosen, (int, float)) or not 0 <= chosen <= 1:
            log.warning("%s: 'chosen' is not a share in [0, 1]; ignored", path)
            return None
        return float(chosen)

    # -- mount -----------------------------------------------------------------------------------------

    def mount_catalog(self, *, rescan: bool, progress: bool = True) -> Path:
        self._check_source()
        _check_readable(self.store_dir / CATALOG_NAME)
        self._catalog_ready(rescan=rescan, progress=progress)
        return self.store_dir

    def _catalog_ready(self, *, rescan: bool, progress: bool) -> None:
        """The store's catalog of the source, (re)built where it is stale or a rescan is asked for, by one writer
        at a time. A scan beside a running prepare would rename its catalog over the one the prepare publishes
        at its end, or be renamed over: what the prepare expanded and chose, or what the scan saw, forgotten.
        So a scan takes the prepare's lock (``_one_writer``).

        A catalog only behind the source in a store this process may not write (another user's: ``store_dir``)
        is used as it stands, with a warning; one that must be scanned, or a --rescan, is refused there."""
        check_store_dir(self.store_dir, writing=False)
        state = CHANGED
        if not rescan:
            found, state = current_catalog(self.source, self.store_dir)
            if found is not None:
                found.close()
                return
        why = store_dir_refusal(self.store_dir, writing=True)
        if why is not None:
            if rescan or state != CHANGED:
                raise CatalogError(why)
            log.warning("%s: its catalog is behind the source and is used as it stands (what changed since its "
                        "last scan shows after a scan by the store's owner): %s", self.store_dir, why)
            return
        make_store_dir(self.store_dir)
        with self._one_writer(state, rescan=rescan) as scan:
            if scan:
                open_or_build(self.source, self.store_dir, rescan=rescan, progress=progress).close()

    @contextmanager
    def _one_writer(self, state: str, *, rescan: bool) -> Iterator[bool]:
        """The prepare's lock held for a scan of the catalog in ``state`` (``current_catalog``'s): True to scan,
        False where the catalog is used as it is.

        While a prepare (or another scan) holds it, the catalog is looked at again whenever its file changes:
        fresh (the other's scan is done), it is used. A catalog only behind the source (CHANGED) is used as it
        stands after ``AS_IT_STANDS_AFTER`` seconds, with a warning, rather than waiting for a prepare of hours;
        none yet, one that must be scanned again, or a --rescan waits. Where the lock cannot be had at all (a
        filesystem without locks, a lock file of another user's), the scan runs without it, as it always did."""
        lock = self.store_dir / PREPARE_LOCK
        since = time.monotonic()
        seen = _file_identity(self.store_dir / CATALOG_NAME)
        said = False
        while True:
            try:
                held = exclusive_lock(lock, wait=False)
            except OSError as exc:
                log.warning("%s: %s; scanning the source without it", lock, exc.strerror)
                yield True
                return
            if held is not None:
                break
            if not said:
                log.warning("a prepare (or a scan) of %s is running: waiting for it before scanning the source",
                            self.store_dir)
                said = True
            if not rescan:  # a --rescan waits in any case
                now_seen = _file_identity(self.store_dir / CATALOG_NAME)
                if now_seen != seen:
                    seen = now_seen
                    found, state = current_catalog(self.source, self.store_dir)
                    if found is not None:
                        found.close()
                        yield False
                        return
            if not rescan and state == CHANGED and time.monotonic() - since >= AS_IT_STANDS_AFTER:
                log.warning("%s: its catalog is used as it stands while the prepare runs: what changed in the "
                            "source since its last scan shows after it (mount --rescan)", self.store_dir)
                yield False
                return
            time.sleep(LOCK_POLL)
        try:
            yield True
        finally:
            os.close(held)

    def found_catalog(self) -> Path:
        # The daemon a mount starts finds the catalog its parent made ready: checked here again, as the catalog
        # is the store writer's to rewrite in between.
        _check_readable(self.store_dir / CATALOG_NAME)
        catalog = Catalog.open(self.store_dir, readonly=True)
        try:
            self.source_root(catalog)
        finally:
            catalog.close()
        return self.store_dir

    def hold_for_mount(self, catalog_dir: Path) -> None:
        # Held until this process ends: prepare deletes no object while any mount of the store runs, so every
        # object the catalog opened next names stays (a new selection replaces the catalog file; this mount
        # keeps reading the one it opened).
        try:
            shared_lock(catalog_dir / MOUNTS_LOCK)
        except OSError as exc:
            log.warning("cannot lock %s (%s): a prepare of this store may delete objects this mount serves",
                        catalog_dir / MOUNTS_LOCK, exc.strerror)

    def reader(self, catalog: Catalog, threads: int, io_timeout: float) -> Reader:
        """A reader over the directories the first reader of this process opened (each loop of ``mount --loops``,
        forked after the first loop's, makes its own): every loop serves the same tree, whatever was renamed since
        (the paths are resolved once, at mount)."""
        made = StoreReader(self.source_root(catalog), self.store_dir, held=self._held)
        if self._held is None:
            self._held = (os.dup(made.root_fd), os.dup(made.objects_fd) if made.objects_fd >= 0 else -1)
        return made
