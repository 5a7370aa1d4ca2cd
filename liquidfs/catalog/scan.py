"""Reading a local tree's inodes ahead of the catalog build: a helper process lstat-s, in threads, the directories
the build will list next, so inodes cold on disk are read in parallel with each other and with the build's
inserts; the build itself still lstat-s every entry, and records only what it read.

Warming is a hint: a helper that cannot start or dies only leaves the build as fast as it was without one. The
helper runs as a script of the standard library alone (never an import of liquidfs, whatever the interpreter's
path), and in its own process so that its syscalls never wait for the build's interpreter lock (threads of the
builder's own process were slower than none: each lstat came back to a lock held by the inserting loop).
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

#: Threads of the helper: inodes of different directories come from disk in parallel (8 halved a cold build's
#: wait for them on a virtio disk; more gained nothing there).
THREADS = 8
#: Directories the helper is told of ahead of the one the build lists: enough to keep its threads busy, few
#: enough that what it warmed is still in the kernel's caches when the build gets there.
AHEAD = 32
#: Entries the build walks before it starts a helper: a small tree is built before a process could start.
START_AFTER = 20_000


#: Seconds the build waits for a helper it killed: one stuck in a request the kernel cannot interrupt (a FUSE
#: mount that never answers, mounted on a directory of the source by its owner) is left to die on its own.
STOP_WAIT = 5.0


class Warmer:
    """The parent's side: ``expect`` names the directories the build will want (relative to the root held at
    ``root``), nearest first."""

    def __init__(self, root: int, ahead: int = AHEAD, threads: int = THREADS) -> None:
        self.root = root  # the build's descriptor of the source's root: the helper's too
        self.ahead = ahead
        self._threads = threads
        self._process: subprocess.Popen[bytes] | None = None
        self._told: set[bytes] = set()
        self._failed = False

    def start(self) -> None:
        if self._process is not None or self._failed:
            return
        from ..sysio.reexec import isolated_env  # here: run as the helper, this file imports nothing of the package

        try:
            # -I -S: no site, no environment, no current directory: the script imports only the standard library.
            # In / and without PYTHON* variables, as every re-exec of the package (``sysio.reexec``).
            self._process = subprocess.Popen([sys.executable, "-I", "-S", __file__, str(self._threads),
                                              str(self.root)],
                                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, close_fds=True, pass_fds=(self.root,),
                                             cwd="/", env=isolated_env())
        except OSError as exc:
            log.info("no helper reads the tree ahead (%s): the build reads it alone", exc)
            self._failed = True
            return
        assert self._process.stdin is not None
        os.set_blocking(self._process.stdin.fileno(), False)  # a hint never makes the build wait

    def expect(self, paths: Iterable[bytes]) -> None:
        """Have the helper read ``paths`` (directories, nearest first) unless it was told of them already."""
        if self._process is None or self._process.stdin is None:
            return
        fd = self._process.stdin.fileno()
        for path in paths:
            if path in self._told or len(path) >= select.PIPE_BUF:
                continue
            try:
                # NUL-separated: the one byte no path holds. A write of at most PIPE_BUF bytes to a pipe is
                # whole or nothing: a helper that lags behind (its pipe full) is told less, never half a name.
                os.write(fd, path + b"\0")
            except BlockingIOError:
                return
            except OSError:  # the helper died: the build goes on alone
                self._stop()
                self._failed = True
                return
            self._told.add(path)

    def taken(self, path: bytes) -> None:
        """The build has read ``path`` itself: it is no longer one to tell the helper of."""
        self._told.discard(path)

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()
        except OSError:
            pass
        process.kill()  # what it has not warmed yet is of no use any more
        try:
            process.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            log.warning("the helper that read the tree ahead (pid %d) is stuck in the kernel: left to end on its "
                        "own", process.pid)

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> Warmer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _warm(root: int, device: int, rel: bytes) -> None:
    """``rel`` below the directory held at ``root`` listed and its entries lstat-ed: reached a component at a time,
    never through a link (a directory swapped for a link to /root since the build listed its parent), and
    nothing listed on another filesystem (the build names no mount point; one mounted since on a directory it
    named is opened, then left: a helper stuck there is left by the build, ``STOP_WAIT``)."""
    fd = root
    try:
        for part in rel.split(b"/"):
            if part in (b"", b".", b".."):
                return
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            if fd != root:
                os.close(fd)
            fd = inner
            if os.fstat(fd).st_dev != device:
                return
        with os.scandir(fd) as entries:
            for entry in entries:
                entry.stat(follow_symlinks=False)
    except OSError:
        pass  # the build meets the same error itself, and says so
    finally:
        if fd != root:
            os.close(fd)


def _helper(threads: int, root: int) -> None:
    """The helper's loop: each directory named on stdin (below the root held at ``root``, the build's) is listed
    and its entries lstat-ed, then forgotten."""
    # Only a core the build leaves idle: where the tree is warm the helper's lstats are of no use, and on a busy
    # machine each of its wake-ups took the build's core (a second of a 1 M-file build's 8.6).
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    limiter = threading.BoundedSemaphore(threads * 2)  # a few queued at most: the newest names are the nearest
    device = os.fstat(root).st_dev

    def warm(path: bytes) -> None:
        try:
            _warm(root, device, path)
        finally:
            limiter.release()

    with ThreadPoolExecutor(threads) as pool:
        pending = b""
        while chunk := os.read(0, 1 << 16):
            *paths, pending = (pending + chunk).split(b"\0")
            for path in paths:
                limiter.acquire()
                pool.submit(warm, path)


if __name__ == "__main__":
    _helper(int(sys.argv[1]), int(sys.argv[2]))
