"""Opening what a catalog names, without following any link on the way and without leaving the root it is
below (a store's catalog is written by whoever can write the store; the daemon that opens it runs as root), and
which filesystem a path lives on.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import stat
from dataclasses import dataclass

from . import mountinfo

#: Filesystems on which a stat of a file looked up moments before is answered from the kernel's caches, never by a
#: device or a server that may hang: a source on one of them is checked at open on the trio thread.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "ramfs", "overlay"})


def filesystem_type(path: bytes | str, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` lives on (the longest mount point above it in /proc/self/mountinfo)."""
    real = os.path.realpath(os.fsdecode(path))
    best, found = -1, None
    for _, mount, fstype in _mounts(mountinfo):
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:  # later lines are mounted over earlier ones at the same point
            best, found = len(mount), fstype
    return found


def filesystem_type_of(fd: int, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem the file held at ``fd`` is on, by its device in /proc/self/mountinfo (not by
    a path, which may name something else by now); None where no mount shows that device."""
    device = os.fstat(fd).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    return next((fstype for shown, _, fstype in _mounts(mountinfo) if shown == wanted), None)


def mounted_below(root: bytes | str, mountinfo: str | None = None) -> frozenset[bytes]:
    """The paths, relative to ``root``, of the mount points strictly below it (in this process's mount namespace):
    directories another filesystem is mounted on. A walk of a tree never stats one: the stat goes to the filesystem
    mounted there, and one of a user's FUSE mounts (on a directory of theirs in a dataset) may never answer."""
    prefix = os.fsencode(os.path.realpath(os.fsdecode(root))).rstrip(b"/") + b"/"
    return frozenset(point[len(prefix):] for point in (os.fsencode(mount) for _, mount, _ in _mounts(mountinfo))
                     if point.startswith(prefix) and len(point) > len(prefix))


class MountsBelow:
    """``mounted_below(root)``, read again where the mount table changed (a poll of /proc/self/mountinfo, which
    the kernel marks at every mount and unmount of the namespace): for a walk that lasts minutes."""

    def __init__(self, root: bytes | str) -> None:
        self.root = root
        self._fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLPRI | select.POLLERR)
            self.rels = self._read()
        except BaseException:  # (an interrupt amid the read): the table's descriptor goes with it
            os.close(self._fd)
            raise

    def _read(self) -> frozenset[bytes]:
        os.lseek(self._fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(self._fd, 1 << 16):
            chunks.append(chunk)
        return mounted_below(self.root, b"".join(chunks).decode("utf-8", "surrogateescape"))

    def refresh(self) -> frozenset[bytes]:
        """The mount points below the root now (one poll where nothing changed)."""
        if self._poll.poll(0):
            self.rels = self._read()
        return self.rels

    def close(self) -> None:
        os.close(self._fd)


def _mounts(table: str | None) -> list[tuple[str, str, str]]:
    """(device as major:minor, mount point, filesystem type) of each line of the mountinfo ``table`` (default:
    this process's; none where it cannot be read). A mount point that is no UTF-8 as its bytes escaped."""
    found = mountinfo.mounts() if table is None else mountinfo.parse(table.encode("utf-8", "surrogateescape"))
    return [(f"{m.major}:{m.minor}", os.fsdecode(m.point), m.fstype.decode("utf-8", "replace")) for m in found]


def catalog_parts(rel: bytes) -> list[bytes]:
    """The components of a path read from a catalog, which whoever writes the store controls: refused (EIO)
    unless every component names an entry below its directory (no '..', '.', empty or absolute component, no NUL:
    the system calls would read the path only up to it, a name the row does not say)."""
    parts = rel.split(b"/")
    if not rel or b"\0" in rel or any(part in (b"", b".", b"..") for part in parts):
        raise OSError(errno.EIO, "a catalog path that leaves its root: refused", os.fsdecode(rel))
    return parts


# openat2(2) (Linux >= 5.6): the whole no-link, stay-below walk in one syscall, and (RESOLVE_CACHED, 5.12) an
# EAGAIN instead of a wait when a dentry or inode on the way is not in memory. Not in the os module (3.11).
_SYS_OPENAT2 = 437  # the same number on every architecture (the generic syscall table)
_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH, _RESOLVE_CACHED = \
    0x01, 0x02, 0x04, 0x08, 0x20
#: Every walk below a root: no link of any kind, never above the root, never onto another filesystem. The last
#: matters as much as the links: a walk that reaches the mount itself (a mount point inside its own source, or a
#: directory bind-mounted there) waits for a LOOKUP that the daemon's loop, busy with this walk, never answers.
_RESOLVE_BELOW = _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


_NR_OPENAT2 = ctypes.c_long(_SYS_OPENAT2)
_HOW_SIZE = ctypes.c_size_t(ctypes.sizeof(_OpenHow))
#: One open_how per (flags, resolve): the kernel only reads it, and the few combinations used are made once (the
#: ctypes objects of a call cost more than its syscall on the loop's hot path: issue 40).
_HOWS: dict[tuple[int, int], _OpenHow] = {}


def _openat2(dir_fd: int, rel: bytes, flags: int, resolve: int) -> int:
    how = _HOWS.get((flags, resolve))
    if how is None:
        how = _HOWS[flags, resolve] = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(_NR_OPENAT2, ctypes.c_int(dir_fd), rel, ctypes.byref(how), _HOW_SIZE)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(fd)


def _opens_with(resolve: int) -> bool:
    """Whether openat2 takes ``resolve`` here (EINVAL where the kernel knows no flag of it, ENOSYS without it)."""
    try:
        os.close(_openat2(-100, b".", os.O_PATH | os.O_CLOEXEC, resolve))  # AT_FDCWD
    except OSError as exc:
        return exc.errno == errno.EAGAIN  # known, but "." was not cached
    return True


#: openat2 with the walk's flags (5.6). Probed apart from RESOLVE_CACHED (5.12): one probe of both took a 5.6-5.11
#: kernel for one without openat2, and every walk there took the weaker one-component-at-a-time way.
HAS_OPENAT2 = _opens_with(_RESOLVE_BELOW)
#: A walk that asks for the kernel's caches only (EAGAIN where it would wait for the disk): what lets an open be
#: made on the loop itself (``datapath.storage_calls.StorageCalls.inline_or_run``).
CACHED_WALKS = HAS_OPENAT2 and _opens_with(_RESOLVE_CACHED)


def renamed_only_by_its_writer(directory: os.stat_result, owner: int) -> bool:
    """Whether, in the directory ``directory`` (its stat), nobody but root and ``owner`` (a file's owner, who
    wrote it) may rename or replace entries: a store's objects are trusted at their names only there
    (``stores.local.reader.StoreReader.may_serve``, ``expand.expansion``)."""
    return stat.S_ISDIR(directory.st_mode) and not directory.st_mode & 0o022 and directory.st_uid in (0, owner)


def open_to_others(directory: os.stat_result) -> bool:
    """Whether users other than the owner may rename entries of ``directory`` they do not own: group or others
    may write it, and no sticky bit keeps them to their own."""
    return bool(directory.st_mode & 0o022) and not directory.st_mode & stat.S_ISVTX


def open_dir(path: bytes | str | os.PathLike[str]) -> int:
    """A directory held open (O_PATH) for opening paths below it, resolved once."""
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def open_below(dir_fd: int, rel: bytes, where: bytes | str = b"", *, cached_only: bool = False) -> int:
    """Open the regular file ``rel`` below the directory held at ``dir_fd`` for reading, without following any
    symlink on the way, without leaving it (``catalog_parts``) and without crossing into another filesystem.

    The catalog shows symlinks as symlinks; a path that has become one since the scan (a file or a directory
    swapped for a link to /etc/shadow, or into the mount itself, in a source writable by others) is refused
    (ELOOP, or ENOTDIR for a directory on the way), never read through. Resolving below a descriptor held from
    mount time also means a source root renamed or swapped for a link while the mount runs changes nothing.
    O_NONBLOCK keeps an entry swapped for a FIFO from blocking the open; anything but a regular file is refused.
    ``cached_only``: BlockingIOError (EAGAIN) rather than waiting for the disk, where a dentry or an inode on the
    way is not in memory (for opens on the trio thread; the caller retries in a worker thread).
    """
    return open_below_stat(dir_fd, rel, where, cached_only=cached_only)[0]


def open_below_stat(dir_fd: int, rel: bytes, where: bytes | str = b"", *,
                    cached_only: bool = False) -> tuple[int, os.stat_result]:
    """``open_below``, and the stat its check of the file took (an open that needs both makes one fstat, not two:
    issue 40, every syscall of an open on the loop counts)."""
    file = _walk(dir_fd, rel, where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                 cached_only)
    return _regular_stat(file, where, rel)


def stat_below(dir_fd: int, rel: bytes, where: bytes | str = b"", *, cached_only: bool = False) -> os.stat_result:
    """The stat of ``rel`` below ``dir_fd`` (a link at its end is stat-ed as the link), walked as ``open_below``
    walks: no link on the way, never above the root or onto another filesystem. A path ``stat`` walks through
    links in every component but the last; this one never does."""
    fd = path_below(dir_fd, rel, where, cached_only=cached_only)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def path_below(dir_fd: int, rel: bytes, where: bytes | str = b"", *, cached_only: bool = False) -> int:
    """An O_PATH descriptor of ``rel`` below ``dir_fd`` (a link at its end: the link), walked as ``stat_below``
    walks."""
    return _walk(dir_fd, rel, where, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, cached_only)


def open_dir_below(dir_fd: int, rel: bytes, where: bytes | str = b"") -> int:
    """The directory ``rel`` below the one held at ``dir_fd`` (b"": that one itself, which must be open for
    reading) opened for listing, reached as ``open_below`` reaches a file: a directory swapped for a link since
    it was listed is refused (ELOOP or ENOTDIR), never listed through."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    return _walk(dir_fd, rel, where, flags, False) if rel else os.dup(dir_fd)


@dataclass(frozen=True, slots=True)
class Listed:
    """An entry of a directory ``list_below`` listed: its name, and whether it is a directory or a regular file
    (no link followed), decided while the directory was open."""

    name: str
    is_dir: bool
    is_file: bool


def list_below(dir_fd: int, rel: bytes, where: bytes | str = b"") -> list[Listed]:
    """The entries of the directory ``rel`` below the one held at ``dir_fd`` (``open_dir_below``). Each entry's
    type is the listing's (d_type), or, where the filesystem gives none (DT_UNKNOWN: XFS without ftype, some
    FUSE, NFS and CIFS), a stat relative to the directory: taken here, while it is open. A ``DirEntry`` kept for
    later stat-ed through a descriptor closed by then (EBADF), or another directory's that took its number.
    An entry that cannot be told is neither."""
    fd = open_dir_below(dir_fd, rel, where)
    try:
        with os.scandir(fd) as listing:
            return [Listed(entry.name, *_kind(entry)) for entry in listing]
    finally:
        os.close(fd)


def _kind(entry: os.DirEntry[str]) -> tuple[bool, bool]:
    try:
        return entry.is_dir(follow_symlinks=False), entry.is_file(follow_symlinks=False)
    except OSError:
        return False, False


def _named(where: bytes | str, rel: bytes) -> str:
    """The path an error names (made only for one: every open of the loop's hot path would pay for it)."""
    return os.fsdecode(os.path.join(os.fsencode(where), rel)) if where else os.fsdecode(rel)


def _walk(dir_fd: int, rel: bytes, where: bytes | str, flags: int, cached_only: bool) -> int:
    """``rel`` below ``dir_fd`` opened with ``flags``: one openat2 where the kernel has it, else one component at a
    time (O_NOFOLLOW, and the device compared with the root's at each step: no link, no other filesystem)."""
    *dirs, name = catalog_parts(rel)
    if cached_only and not CACHED_WALKS:
        raise BlockingIOError(errno.EAGAIN, "no cached-only walk here: opened in a worker thread", _named(where, rel))
    if HAS_OPENAT2:
        try:
            return _openat2(dir_fd, rel, flags, _RESOLVE_BELOW | (_RESOLVE_CACHED if cached_only else 0))
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                # (without RESOLVE_CACHED: an O_NONBLOCK open that met a lease another process holds on the file)
                why = "not in the kernel's caches" if cached_only else "the file is leased by another process"
                raise BlockingIOError(errno.EAGAIN, why, _named(where, rel)) from None
            raise OSError(exc.errno, exc.strerror, _named(where, rel)) from None
    device = os.fstat(dir_fd).st_dev
    fd = dir_fd
    try:
        for part in dirs:
            inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = inner
            if os.fstat(fd).st_dev != device:
                raise OSError(errno.EXDEV, "crosses into another filesystem")
        file = os.open(name, flags, dir_fd=fd)
        if os.fstat(file).st_dev != device:
            os.close(file)
            raise OSError(errno.EXDEV, "crosses into another filesystem")
        return file
    except OSError as exc:  # name the whole path, not the component os.open was given
        raise OSError(exc.errno, exc.strerror, _named(where, rel)) from None
    finally:
        if fd != dir_fd:
            os.close(fd)


class RootReplaced(OSError):
    """The directory a root's path names is not the one it named when the caller's run began."""


def open_under(root: bytes, rel: bytes, identity: tuple[int, int] | None = None) -> int:
    """``open_below`` a root given by path, resolved once for this one open (prepare's and verify's workers).
    ``identity``: the root's (st_dev, st_ino) as the run's coordinator holds it open; another directory at the
    path now (a link repointed, a parent renamed by whoever may write it) raises ``RootReplaced``, never a
    file of that other tree read as the catalog's."""
    root_fd = open_dir(root)
    try:
        if identity is not None:
            st = os.fstat(root_fd)
            if (st.st_dev, st.st_ino) != identity:
                raise RootReplaced(errno.ESTALE, "the source's root is not the directory this run began with "
                                   "(replaced, or a link on the way repointed, since)", os.fsdecode(root))
        return open_below(root_fd, rel, root)
    finally:
        os.close(root_fd)


def open_regular(path: str | os.PathLike[str]) -> int:
    """Open ``path`` for reading if it is a regular file, never through a link at its end (EIO otherwise)."""
    return _regular(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC),
                    os.fsdecode(path))


def _regular(file: int, path: str) -> int:
    """``file`` if it is a regular file (no longer non-blocking); else closed and EIO."""
    return _regular_stat(file, path)[0]


def _regular_stat(file: int, where: bytes | str, rel: bytes | None = None) -> tuple[int, os.stat_result]:
    """``file`` and its stat if it is a regular file (no longer non-blocking); else closed and EIO (naming
    ``where``, or ``rel`` below it)."""
    try:
        st = os.fstat(file)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EIO, "no longer a regular file",
                          os.fsdecode(where) if rel is None else _named(where, rel))
        # Of the status flags F_SETFL can change (O_APPEND, O_ASYNC, O_DIRECT, O_NOATIME, O_NONBLOCK) every file
        # here was opened with O_NONBLOCK alone: clearing them all clears it, without an F_GETFL first.
        fcntl.fcntl(file, fcntl.F_SETFL, 0)
    except BaseException:  # (an fstat or fcntl that fails, too: the descriptor never outlives the refusal)
        os.close(file)
        raise
    return file, st
