"""The optional second level of held bytes on local disk (``mount --disk-cache DIR --disk-cache-size SIZE``).

For nodes with local NVMe in front of a remote object store: the same next-epoch policy as the memory level
(``policy.next_epoch.NextEpochCache``), one level down. It sees only what the memory level misses, so its quota is
taken of those bytes (dataset minus the memory budget) and it never keeps a file the memory level keeps for the next
epoch: the two levels hold disjoint sets and together serve (memory + disk) / dataset of every epoch locally.

It wraps the mount's reader (the local store's ``StoreReader`` or the S3 backend's ``S3Reader``) and runs in the
same worker threads, so its bookkeeping is locked. Files are written once (temporary name, then rename) into a
directory of this mount's own, removed at unmount, and reached only through its descriptor, held from the
start (where others may write the directory it is in, they can rename it or put a link at its name: root then
wrote files where the link pointed); each hit is checked against the xxh3 digest taken when the file
was written (``stores.reader.private_digest``, not the BLAKE2b of raw objects: only this mount writes that directory, so
the digest catches damage, not bytes anyone chose), and a file that fails (or went missing) is read from the store
again: the disk never serves bytes the store did not. It is a level of held bytes like the memory levels
(``held.base.Level``), and a reader in front of the store's (``stores.reader.Reader``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..catalog.nodes import Node
from ..metrics.stats import Statistics
from ..policy.next_epoch import Decision, NextEpochCache
from ..stores.reader import Content, InFront, Reader, private_digest, source_changed_now
from ..sysio.directio import POOL, read_span
from ..sysio.locks import HeldLock, abandoned, unique
from .base import Level

log = logging.getLogger(__name__)

_PREFIX = "liquidfs-"
#: Seconds ``statistics`` waits for the level's lock on the loop (held for microseconds, or across a disk's
#: rename or unlink: as long as the disk takes).
STATISTICS_WAIT = 0.05
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class _Entry:
    digest: str
    raw: bool
    size: int


@dataclass(frozen=True, slots=True)
class DiskStatistics(Statistics):
    prefix = "disk_"

    budget: int
    held_bytes: int
    held_files: int
    hits: int
    hit_bytes: int
    lost: int          # held files found gone or damaged at a hit: read from the store again
    write_errors: int
    epochs: object     # the policy's per-epoch counters (``NextEpochCache.summary``'s "epochs")


class DiskLevel(Level[_Entry], InFront):
    """Files held on a local disk, checked at every hit; a reader in front of ``inner``, asked in worker threads
    (so its bookkeeping is under ``_lock``)."""

    def __init__(self, inner: Reader, root: Path, policy: NextEpochCache,
                 memory_holds: Callable[[int], bool] = lambda node_id: False) -> None:
        Level.__init__(self, policy)
        InFront.__init__(self, inner)
        self.memory_holds = memory_holds
        self._lock: threading.Lock = threading.Lock()  # (a Lock: ``statistics`` waits for it with a timeout)
        #: Worker threads using ``_dir_fd`` now (``_directory``), and whether ``close`` has run: the descriptor is
        #: closed by whichever ends last. A storage call abandoned at its timeout may still be writing when the
        #: mount closes; closed under it, its number could name another directory by then, where root would
        #: make or remove files.
        self._users = 0
        self._closed = False
        self.hits = 0
        self.hit_bytes = 0
        self.lost = 0
        self.write_errors = 0
        self._said: set[str] = set()  # the kinds of failure said at warning (``_say``)
        self._written = -1  # the last file written, its pages to let go at the next write (``_drop_later``)
        self._unremoved = 0  # evicted files the disk would not remove (EIO, EROFS)
        self._told = self._counted()  # what ``statistics`` tells while the lock is held long
        # Checked again here, where the daemon makes and sweeps it: the command checked it before a scan that may
        # take minutes. Before it is made (where it would be made), and once it is there.
        why = root_refusal(root)
        if why is not None:
            raise OSError(errno.EPERM, why)
        root.mkdir(parents=True, exist_ok=True)
        self._root_fd = _held_root(root)
        try:
            # A file takes the disk's whole blocks (a 100-byte file 4 KiB): charged so, a budget of bytes held
            # files worth 40 times more of the disk than --disk-cache-size said. Before anything is held. The
            # filesystem's fragment size (st_blksize is the preferred I/O size: an NFS mount's wsize, a MiB).
            block = os.fstatvfs(self._root_fd).f_frsize
            policy.charge_files(page=min(max(_MIN_BLOCK, block), _MAX_BLOCK), overhead=0)
            _remove_stale(self._root_fd)
            name = unique(_PREFIX)
            self.dir = root / name  # what messages name
            # Everything below the root is reached through its descriptor (``_through``): a writer of the
            # directory above it (README's 0777 emptyDir) who renames the root and puts a link at its name
            # meanwhile chose where root made its directory, its lock and every file it cached.
            self._held_dir = _through(self._root_fd) / name
            # Held while this mount lives, and from before its directory is made: another mount starting at the
            # same moment sweeps (``_remove_stale``) no directory whose lock is not yet there.
            self._alive = HeldLock(_through(self._root_fd) / f"{name}.lock")
            try:
                self._held_dir.mkdir(mode=0o700, exist_ok=False)
                self._dir_fd = _own_directory(self._held_dir)
            except BaseException:
                self._alive.release()
                raise
        except BaseException:
            os.close(self._root_fd)
            raise

    # -- the reader interface (the rest: ``InFront``'s) ------------------------------------------------------

    def open(self, node: Node) -> Content:
        decision = self.decide(node.id, node.size_served)
        try:
            return self._open_decided(node, decision)
        except BaseException:
            # (a source gone at the check of a hit, a failed read from storage) The room the policy gave it, with
            # no copy to fill it; or a hit's copy the policy let go at this read, which nothing else would remove
            # from the disk (no later open of the file is a hit that looks at it again).
            if decision.hold:
                self.drop(node.id)
            else:
                self._forget_unless_held(node.id)
            raise

    def _open_decided(self, node: Node, decision: Decision) -> Content:
        """``open`` once the policy has counted it."""
        entry = self.get(node.id) if decision.hit else None
        if entry is not None and (entry.raw, entry.size) != (node.served_raw, node.size_served):
            # Held as the other representation (the mix moved since it was stored): not what this open serves
            # (a deferred open of the original would fail its first read on the raw bytes, every epoch)
            self._forget(node.id)
            entry = None
            self.lost_hit(decision, node.size_served)
        if entry is not None and (changed := self._source_changed(node)) is not None:
            # the source changed after this level stored its bytes: they are stale, never served
            log.info("disk cache: %s: %s; reading it again", os.fsdecode(node.path), changed)
            self._forget(node.id)
            entry = None
            self.lost_hit(decision, node.size_served)
        if entry is not None:
            content = self._read(node, entry)
            if content is not None:
                if not decision.hold:
                    self._forget_unless_held(node.id)
                return content
            self.lost_hit(decision, node.size_served)
        content = self.inner.open(node)
        # Not a source changed since the scan (``content.version``): the next hit's check finds it changed, so its
        # copy would be written every epoch, never served, and push out copies that would.
        wanted = decision.hold and not self.memory_holds(node.id) and content.version is None
        if wanted and content.data is not None and not content.fallback and content.size == node.size_served:
            if self._write(node, content):
                return content
        if decision.hold:
            self.drop(node.id)
        else:
            self._forget_unless_held(node.id)
        return content

    def _source_changed(self, node: Node) -> str | None:
        """Whether ``node``'s source changed since the catalog's row, asked of storage itself at each hit
        (``stores.reader.source_changed_now``: a local stat; an object store's HEAD): a copy on this disk
        outlives the epoch it was read in, and is held again at its hits, so an object store's "the next miss
        checks" never came, and an overwritten object was served as its old bytes for epochs. A HEAD is a
        fraction of the GET the hit saves. A source gone fails the open (FileNotFoundError); one that cannot be
        asked is a change: read from the store, which answers for itself, never served unchecked."""
        try:
            return source_changed_now(self.inner, node)
        except FileNotFoundError:
            raise
        except OSError as exc:
            return f"its source cannot be checked ({exc})"

    def _drop_later(self, fd: int) -> None:
        """``fd`` (a file just written, its writeback begun) held until the next file's write, then its pages
        let go again and it closed: the advice right after a buffered write drops none of its dirty pages (a
        review saw 64 of 64 MiB still cached), which the sidecar's memory cgroup is charged for. -1: the last
        one's now (``close``)."""
        with self._lock:
            # (once the level is closed, a write that ends after it is let go at once: nothing would later)
            now = [self._written] + ([fd] if self._closed else [])
            self._written = -1 if self._closed else fd
        for written in now:
            if written >= 0:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(written, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(written)

    def _say(self, kind: str, message: str, *args: object) -> None:
        """``message`` at warning the first time a failure of its ``kind`` is met, at debug after: a full or
        failing disk fails every write or read, and a warning each time filled the log (``liquidfs stats``
        counts them: ``write_errors``, ``lost``)."""
        with self._lock:
            first = kind not in self._said
            self._said.add(kind)
        log.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def _forget_unless_held(self, file: int) -> None:
        """Let go of ``file``'s copy, which this open's decision did not hold, unless the policy holds it again
        (another open re-admitted and wrote it while this one read: its copy is the new one)."""
        with self._lock:
            if file not in self.policy.held:
                self._forget_held(file)

    # -- the level interface (``held.base.Level``'s, but for these) -----------------------------------------

    def held_raw(self, node: Node) -> bool | None:
        entry = self.get(node.id)
        return None if entry is None else entry.raw

    def _count_lost(self) -> None:
        self.lost += 1

    # -- files ---------------------------------------------------------------------------------------------

    def _path(self, node_id: int) -> Path:
        """What messages name (every file is reached through ``_dir_fd``)."""
        return self.dir / f"{node_id}"

    @contextlib.contextmanager
    def _directory(self) -> Iterator[int]:
        """``_dir_fd``, not closed until the caller is done with it; OSError (EBADF) once the level is closed."""
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, "the disk cache is closed", str(self.dir))
            self._users += 1
        try:
            yield self._dir_fd
        finally:
            with self._lock:
                self._users -= 1
                self._close_if_unused()

    def _close_if_unused(self) -> None:
        """Under ``_lock``: the descriptor closed once the level is and nobody uses it."""
        if self._closed and self._users == 0 and self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def _read(self, node: Node, entry: _Entry) -> Content | None:
        try:
            with self._directory() as dir_fd:
                fd = os.open(f"{node.id}", os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            self._say(f"read {exc.errno}", "disk cache: %s: %s; reading the store", self._path(node.id), exc.strerror)
            return None
        try:
            if os.fstat(fd).st_size != entry.size:
                data = None
            else:
                data = read_span(fd, 0, entry.size)  # no further than what was written
        except OSError as exc:
            self._say(f"read {exc.errno}", "disk cache: %s: %s; reading the store", self._path(node.id), exc.strerror)
            return None
        finally:
            os.close(fd)
        if data is None or len(data) != entry.size or private_digest(data) != entry.digest:
            if data is not None:
                POOL.give(data)  # never served: the buffer may take the next file
            self._say("damaged", "disk cache: %s changed on disk; reading the store", self._path(node.id))
            return None
        with self._lock:
            self.hits += 1
            self.hit_bytes += len(data)
        return Content(size=len(data), raw=entry.raw, data=data, level="disk", pooled=True)

    def _write(self, node: Node, content: Content) -> bool:
        """Whether nothing is left to undo: the file written and held, or let go by the policy while it was read
        and written (then not kept: it would lie on disk outside the budget, where no eviction removes it).
        False: it could not be written."""
        assert content.data is not None
        name = f"{node.id}"
        tmp = unique(f"{name}.tmp-")  # two opens of one file write two files: the later rename wins
        try:
            with self._directory() as dir_fd:
                try:
                    kept = self._write_in(dir_fd, node.id, name, tmp, content)
                except OSError:
                    _unlink(tmp, dir_fd)
                    raise
                if not kept:
                    _unlink(tmp, dir_fd)
        except OSError as exc:
            with self._lock:
                self.write_errors += 1
            self._say(f"write {exc.errno}", "disk cache: cannot write %s: %s", self._path(node.id), exc.strerror)
            return False
        return True

    def _write_in(self, dir_fd: int, node_id: int, name: str, tmp: str, content: Content) -> bool:
        """``_write``'s file, written as ``tmp`` and renamed to ``name`` where the policy still holds it."""
        assert content.data is not None
        with self._lock:
            if self._closed:  # (one made once the close listed the directory: its second listing removes it)
                return False
        # Made outside the lock: a disk that stalls the create must not stall every open's ``decide`` with it.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o600, dir_fd=dir_fd)
        with open(fd, "wb") as f:
            f.write(content.data)
            f.flush()
            # The file need not survive a crash (the directory is this mount's own): no fsync, and its pages
            # are let go so the page cache holds no third copy (where the filesystem can: else they stay). Dirty
            # pages are not let go: the advice starts their writeback, and is given again once that has had
            # time, at the next file's write (``_drop_later``).
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self._drop_later(os.dup(fd))
        entry = _Entry(private_digest(content.data), content.raw, content.size)
        with self._lock:
            # Decided and renamed under the lock: an eviction (``decide``) sees the file held or not there. Not
            # after the close, which has emptied the directory (the caller removes the copy).
            kept = node_id in self.policy.held and not self._closed
            if kept:
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                self._held[node_id] = entry
        return kept

    def _let_go(self, file: int, value: _Entry) -> None:
        # Under the lock that popped the entry: ``_write``'s rename (under it too) is before both or after both,
        # so a file another open re-admitted is never removed with the entry of the copy it replaced. (Under
        # it, the descriptor is not closed meanwhile: ``_close_if_unused``.)
        if self._dir_fd >= 0 and not _unlink(f"{file}", self._dir_fd):
            # Its bytes stay on the disk, past the budget the policy now counts free: said, the first at warning.
            self._unremoved += 1
            log.log(logging.WARNING if self._unremoved == 1 else logging.DEBUG,
                    "disk cache: cannot remove %s (%d so far): the disk holds more than --disk-cache-size says",
                    self._path(file), self._unremoved)

    # -- lifecycle and statistics ------------------------------------------------------------------------

    def close(self) -> None:
        """Its files removed through its descriptor, then the directory, if its name still names it; the
        descriptor closed once no worker thread uses it any more (one abandoned at its timeout may)."""
        with self._lock:
            # Closed before the listing: a worker abandoned at its timeout that renamed its file in after it (it
            # asked ``_closed`` first) left the directory, with a cached file, behind the unmount (ENOTEMPTY).
            self._closed = True
            self._users += 1  # this use of the descriptor (``_directory`` lends none once closed)
            dir_fd = self._dir_fd
        try:
            if dir_fd >= 0:
                mine = os.fstat(dir_fd)
                for again in (False, True):
                    for name in os.listdir(dir_fd):
                        _unlink(name, dir_fd)
                    there = os.stat(self._held_dir, follow_symlinks=False)
                    if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
                        break
                    try:
                        os.rmdir(self._held_dir)
                        break
                    except OSError as exc:
                        # A worker that asked ``_closed`` just before the close made its file after the listing:
                        # listed and removed again (its rename finds the level closed).
                        if exc.errno != errno.ENOTEMPTY or again:
                            raise
        except OSError as exc:
            log.warning("disk cache: removing %s: %s", self.dir, exc.strerror)
        finally:
            with self._lock:
                self._users -= 1
                self._close_if_unused()
            self._drop_later(-1)
            try:
                self._alive.release()  # (its name unlinked through the root's descriptor: before it is closed)
            finally:
                if self._root_fd >= 0:
                    os.close(self._root_fd)
                    self._root_fd = -1

    def statistics(self) -> DiskStatistics:
        """The level's counters; asked on the trio loop (``/metrics``, the control file), so never waiting long
        for ``_lock``, which a worker holds across the disk's renames and unlinks: on a disk that hangs, the
        last figures told, not a loop stopped and every request of the mount with it."""
        if not self._lock.acquire(timeout=STATISTICS_WAIT):
            log.debug("disk cache: its lock is held (the disk is slow): the last statistics told")
            return self._told
        try:
            self._told = self._counted()
        finally:
            self._lock.release()
        return self._told

    def _counted(self) -> DiskStatistics:
        """The counters as they are (under ``_lock``, but at the start)."""
        return DiskStatistics(budget=self.policy.budget, held_bytes=self.policy.held_bytes,
                              held_files=len(self.policy.held), hits=self.hits, hit_bytes=self.hit_bytes,
                              lost=self.lost, write_errors=self.write_errors, epochs=self.policy.summary()["epochs"])


def _unlink(name: str, dir_fd: int) -> bool:
    """Whether ``name`` is gone (or was never there)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def root_refusal(root: Path) -> str | None:
    """Why ``--disk-cache`` may not be ``root``, or None. The mount (as root) makes its directory there, and
    removes every ``liquidfs-*`` directory there whose lock nobody holds: someone else than root and this user who
    owns the directory, or may remove entries from it (a lock among them: a live mount's directory then swept
    by the next), would choose what root removes and where it writes. Sticky (/tmp) keeps others from root's
    entries. Nothing to check where it is not there yet (this process makes it, under liquidfs's umask)."""
    from ..catalog.store_dir import making_refusal, moved_refusal

    try:
        st = os.stat(root)
    except (FileNotFoundError, NotADirectoryError):
        # Made by the mount: not through a link, nor below a directory, that someone else may point elsewhere.
        missing = making_refusal(root, "give a directory only root and you may write", modes=False)
        return None if missing is None else f"--disk-cache {missing}"
    except OSError as exc:
        return f"--disk-cache {root}: {exc.strerror}"
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return f"--disk-cache {root}: not a directory"
    if st.st_uid not in (0, os.geteuid()):
        return (f"--disk-cache {root}: owned by uid {st.st_uid}, who could choose what this mount removes and "
                "writes there: give a directory of root's or yours")
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return (f"--disk-cache {root}: group or others may remove what a mount keeps there (mode {mode:o}, not "
                "sticky): chmod go-w it, or give another")
    # Named through a link, or below a directory, of someone else's, who may point or move it elsewhere after
    # this check: they would choose where root writes and what it sweeps. By owner only, not mode: a directory
    # of root's that others may write above it (a pod's emptyDir, 0777, with the cache the mount makes below
    # it, as mount/README.md sets it up) lets its writers rename the cache, not choose where root's files go.
    moved = moved_refusal(root, st, "it", "the mount would write and remove where they chose; give a "
                          "directory only root and you may rename", modes=False)
    return None if moved is None else f"--disk-cache {moved}"


def _own_directory(path: Path) -> int:
    """A descriptor of the directory this mount has just made at ``path``: no link, this user's, owner-only and
    empty (another mount's directory, or another user's, renamed to its name is refused)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or os.listdir(fd):
        os.close(fd)
        raise OSError(errno.EPERM, "not the directory this mount made (replaced meanwhile?)", str(path))
    return fd


#: The least a cached file is charged: a block of the common filesystems; and the most (a filesystem saying more
#: is taken to pack small files).
_MIN_BLOCK, _MAX_BLOCK = 4096, 65536


def _held_root(root: Path) -> int:
    """A descriptor of the directory ``root`` names, judged by ``root_refusal`` while held (the name, through any
    link ``root_refusal`` judged the way to, still the directory held once judged); OSError (EPERM: why) where
    it may not be the cache's root."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        why = root_refusal(root)
        if why is None:
            named, held = os.stat(root), os.fstat(root_fd)
            if (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino):
                why = f"--disk-cache {root}: replaced while it was checked"
        if why is not None:
            raise OSError(errno.EPERM, why)
    except BaseException:
        os.close(root_fd)
        raise
    return root_fd


def _through(fd: int) -> Path:
    """A path that reaches what ``fd`` holds whatever its name names now (``/proc/self/fd``'s link), for the calls
    that take paths (``HeldLock``, ``mkdir``): the components below it are walked from the descriptor. (Without
    /proc, the calls through it fail: the mount says so, never works elsewhere.)"""
    return Path(f"/proc/self/fd/{fd}")


def _remove_stale(root_fd: int) -> None:
    """Directories of mounts that died without unmounting: nobody holds their lock any more. Only this daemon's
    user's own (0700, on the root's filesystem, no link), their locks looked at and everything removed below the
    root's descriptor ``root_fd``: in a root others may write in (a sticky /tmp, an emptyDir of 0777), another
    user's ``liquidfs-notes`` directory is theirs, and a name swapped for a link meanwhile leads nowhere."""
    try:
        device = os.fstat(root_fd).st_dev
        with os.scandir(root_fd) as entries:
            names = [entry.name for entry in entries if entry.name.startswith(_PREFIX)]
        for name in names:
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except OSError:
                continue
            if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077
                    or st.st_dev != device):
                continue
            lock = f"{name}.lock"
            if abandoned(lock, dir_fd=root_fd):
                shutil.rmtree(name, dir_fd=root_fd, ignore_errors=True)
                _unlink(lock, root_fd)
    except OSError as exc:  # a sweep is housekeeping: the mount goes on
        log.debug("disk cache: sweeping: %s", exc)
