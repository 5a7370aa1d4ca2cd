"""Names that cannot collide and locks that say whether their owner is alive, for files on shared volumes.

PIDs are no identity on a volume that several PID namespaces share (two init containers are both PID 1; a
restarted sidecar is PID 2 again under tini): a file named after a PID is another process's file as often as not.
Work files get a random name and an exclusive ``flock`` on a lock file beside them for as long as their owner
lives; the kernel drops the lock when the owner dies, however it dies, so a leftover is one whose lock can be
taken.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def unique(prefix: str) -> str:
    """``prefix`` and 16 random hex digits."""
    return f"{prefix}{secrets.token_hex(8)}"


class HeldLock:
    """An exclusive flock on ``path`` (created 0600), held until ``release`` or the process's end.

    The file is made and locked under a name of its own, then renamed to ``path``: a file at ``path`` is always
    a held lock or a free one, never one made but not yet locked, which a sweeper (``abandoned``) would have taken
    for its dead owner's and removed with what it guards."""

    def __init__(self, path: Path) -> None:
        self.path = path
        making = path.with_name(f".{path.name}-{secrets.token_hex(8)}")  # no sweeper's pattern ends so
        self.fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(making, path)
        except BaseException:
            os.close(self.fd)
            making.unlink(missing_ok=True)
            raise

    def release(self, *, remove: bool = True) -> None:
        if self.fd < 0:
            return
        try:
            if remove:
                self.path.unlink(missing_ok=True)
        finally:  # (a disk that fails the unlink must not keep the lock, and its descriptor, for good)
            os.close(self.fd)
            self.fd = -1


def abandoned(lock_path: Path | str, *, dir_fd: int | None = None) -> bool:
    """True when nobody holds ``lock_path`` (below ``dir_fd`` where given; its owner died or finished): what it
    guards may be removed."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


#: The lock inside a run's private directory (``PrivateDir``).
DIR_LOCK = "lock"


class PrivateDir:
    """A new directory ``prefix<random>`` under ``parent`` (0700, mkdtemp's) and the lock in it, held while its run
    lives: a run killed outright (SIGKILL, the OOM killer, a node's reboot) leaves the directory behind, which the
    next run's ``PrivateDir`` there removes (``abandoned_dirs``) before it makes its own. ``remove``: how one goes
    (what else must go first: a mount in it), this run's own at its end (``remove``) as well as the leftovers."""

    def __init__(self, parent: Path, prefix: str, remove: Callable[[Path], None] = _remove_tree) -> None:
        remove_abandoned_dirs(parent, prefix, remove)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self._remove = remove
        try:
            self._alive = HeldLock(self.path / DIR_LOCK)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def remove(self) -> None:
        """The directory removed, then its lock let go (in that order: no sweeper takes it while it goes)."""
        self._remove(self.path)
        self._alive.release(remove=False)


def abandoned_dirs(parent: Path, prefix: str) -> list[Path]:
    """The ``prefix*`` directories under ``parent`` (none through a link) whose lock nobody holds: their runs
    died. One without its lock yet is another run's, just made, and one from a version that made none is left
    alone as well."""
    found = []
    for leftover in parent.glob(f"{prefix}*"):
        lock = leftover / DIR_LOCK
        if not leftover.is_symlink() and leftover.is_dir() and os.path.lexists(lock) and abandoned(lock):
            found.append(leftover)
    return found


def remove_abandoned_dirs(parent: Path, prefix: str, remove: Callable[[Path], None] = _remove_tree) -> None:
    """Each of ``abandoned_dirs`` removed (``remove``: what else must go first, a mount in it)."""
    for leftover in abandoned_dirs(parent, prefix):
        remove(leftover)


#: In a store: held shared by every mount of it for its whole life, exclusive by prepare while it deletes
#: objects (objects a running mount's catalog names are never deleted under it).
MOUNTS_LOCK = "mounts.lock"
#: In a store: held exclusive by a prepare for its whole run, and by a mount's scan of the source, so the
#: writers of one store's catalog run one after another (``stores.local.store.LocalStore._one_writer``).
PREPARE_LOCK = "prepare.lock"


def shared_lock(path: Path) -> int:
    """A shared flock on ``path`` (created 0600 if it can be), waiting for an exclusive holder; the descriptor
    holds it. A read-only volume that lacks the file raises OSError."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError:  # (flock needs no write access)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        _regular(fd, path)
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _regular(fd: int, path: Path) -> None:
    """OSError unless ``fd`` is a regular file. A lock file is opened without blocking (O_NONBLOCK): a FIFO put
    at its name by whoever writes the store blocked a read-only open for good (the mount hung at its start)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise OSError(errno.EINVAL, "not a regular file (a lock file is one)", str(path))


def exclusive_lock(path: Path, *, wait: bool = True) -> int | None:
    """An exclusive flock on ``path`` (created 0600); None when ``wait`` is false and someone holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    try:
        _regular(fd, path)
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd
