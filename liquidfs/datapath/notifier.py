"""Kernel notifications (drop an inode's pages or attributes, store pages) sent from one worker thread."""

from __future__ import annotations

import errno
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pyfuse3
import trio

from ..sysio.thread_names import NOTIFIER, name_this_thread

log = logging.getLogger(__name__)

#: Seconds ``Notifier.stop`` waits for the thread to finish the call it is in.
STOP_WAIT = 5.0
#: Worker threads dropping attributes at once (``Notifier.new_size``), on a limiter of their own: an open that
#: waits for one must not wait behind storage reads, memfd copies or /proc lookups in trio's default limiter.
ATTR_THREADS = 4


class Notifier:
    """Sends kernel notifications from one worker thread, in order.

    libfuse: a notification must not be sent from inside the request it concerns (it may deadlock on the inode
    or the pages the request holds), and each one blocks until the kernel has processed it. A queue keeps
    handlers fast, and keeps a file's pages stored (``store``) before its release drops them (``invalidate``).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Invalidate | _Store | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        #: Set at unmount: what is still queued is never sent (the session is about to close).
        self._stopping = False
        self.sent = 0
        self._attrs = trio.CapacityLimiter(ATTR_THREADS)

    def invalidate(self, inode: int, attr_only: bool = False) -> None:
        self._put(_Invalidate(inode, attr_only))

    async def new_size(self, inode: int) -> None:
        """Drop the kernel's cached attributes of ``inode`` before the open that serves another size is
        answered: queued, they were dropped a moment after it, and a reader's ``fstat`` right after its open
        could still see the old size (and read or map a file cut at it, or past its end).

        Attributes only: the kernel takes no inode or page lock for that, so it cannot wait on the open being
        answered. A worker thread, so the notifier's queue (stores that may wait on pages) cannot delay it."""
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, pyfuse3.InodeT(inode), True,
                                          limiter=self._attrs)
            self.sent += 1
        except OSError as exc:
            # ENOENT: the kernel does not know the inode (yet), and has no attributes to drop. Anything else leaves
            # it the old size for as long as it keeps attributes (a day): said.
            log.log(logging.DEBUG if exc.errno == errno.ENOENT else logging.WARNING,
                    "invalidate attributes (%d): %s", inode, exc)

    def store(self, inode: int, offset: int, data: memoryview, done: Callable[[bool], None]) -> None:
        """Put ``data`` in the kernel's page cache of ``inode`` at ``offset``; then ``done(ok)`` runs on this
        trio thread. ``data`` must stay unchanged until then."""
        self._put(_Store(inode, offset, data, done, trio.lowlevel.current_trio_token()))

    def _put(self, item: _Invalidate | _Store) -> None:
        if self._stopping:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=NOTIFIER, daemon=True)
            self._thread.start()
        self._queue.put(item)

    def _run(self) -> None:
        name_this_thread(NOTIFIER)
        while (item := self._queue.get()) is not None:
            if self._stopping:
                continue  # unmounting: pages and attributes of a mount going away need no word
            ok = False
            try:
                if isinstance(item, _Store):
                    # The stub says bytes; any buffer works, and a copy of every pushed range is what pushing avoids.
                    pyfuse3.notify_store(pyfuse3.InodeT(item.inode), item.offset, item.data)  # type: ignore[arg-type]
                else:
                    pyfuse3.invalidate_inode(pyfuse3.InodeT(item.inode), item.attr_only)
                self.sent += 1
                ok = True
            except OSError as exc:  # the kernel forgot the inode already: nothing to drop, or to store into
                log.debug("%s(%d): %s", type(item).__name__, item.inode, exc)
            except Exception:  # never let the notifier die: later drops would be lost
                log.exception("%s(%d) failed", type(item).__name__, item.inode)
            if isinstance(item, _Store):
                try:
                    item.token.run_sync_soon(_guarded, item.done, ok)
                except trio.RunFinishedError:  # unmounted meanwhile
                    pass

    def stop(self) -> None:
        """At unmount, before the session closes: nothing queued is sent any more, and the thread ends once out of
        the call it is in. A call made after ``pyfuse3.close`` would use the session it frees; a long queue of
        stores (a pushed file each) once took longer than the wait, and was still being sent as it closed."""
        self._stopping = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(STOP_WAIT)
            if self._thread.is_alive():
                # In the kernel still: a store waits for a page a read holds locked, which the stopped loop will
                # never answer (the watchdog aborts the connection where the process cannot end).
                log.warning("the notifier is still in a kernel call after %g s; closing the session regardless",
                            STOP_WAIT)


def _guarded(done: Callable[[bool], None], ok: bool) -> None:
    """Runs a store's completion on the trio thread: an exception there would end trio.run, and the mount."""
    try:
        done(ok)
    except Exception:
        log.exception("completing a page store failed")


@dataclass(frozen=True, slots=True)
class _Invalidate:
    inode: int
    attr_only: bool


@dataclass(frozen=True, slots=True)
class _Store:
    inode: int
    offset: int
    data: memoryview
    done: Callable[[bool], None]
    token: trio.lowlevel.TrioToken
