"""Blocking calls into storage (the store, the source, an object store) from the trio loop: in worker threads, a
few at a time, each under ``--io-timeout``, so a hung disk or server fails one file and never the mount."""

from __future__ import annotations

import errno
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import outcome  # trio's own: what a worker thread's call returned or raised
import trio

from ..catalog.nodes import Node
from ..metrics.stats import Statistics
from ..stores.reader import Reader
from ..sysio.paths import CACHED_WALKS
from ..sysio.thread_names import DISCARD, name_this_thread
from .limits import IO_TIMEOUT, OPEN_THREADS

log = logging.getLogger(__name__)

R = TypeVar("R")

#: Storage reads left stuck past their timeout before every new read fails at once: the storage is not answering,
#: and each further try would only park one more thread in the kernel.
MAX_STUCK = 64
#: FUSE requests answered at once (pyfuse3's worker tasks: ``pyfuse3.main(max_tasks=...)``, 99 by default). A
#: request awaiting storage holds its worker, and with every worker waiting nobody reads the next request: an
#: ``ls`` elsewhere waited with them. Workers are trio tasks, a few KiB each, started only while requests wait.
FUSE_WORKERS = 512
#: Opens in flight at once (``StorageCalls.opening``); the other workers are kept for lookups, attributes,
#: listings, reads and releases. Reads need no bound of their own: the kernel sends a page-cached file's reads
#: as background requests, at most ``max_background`` (12) at a time. Opens are synchronous, one per caller.
MAX_OPENS = FUSE_WORKERS - 128
#: The share of MAX_OPENS one user other than root and the daemon's own may hold at once: one user's opens stuck
#: on a slow source (an NFS server of theirs, a FUSE mount they serve themselves) leave the other half to everyone
#: else, who would otherwise all get EAGAIN.
OPENS_PER_USER_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class StorageCallsStatistics(Statistics):
    stuck_reads: int          # storage reads still stuck past their timeout
    opens_in_flight: int      # opens waiting for storage now
    opens_refused: int        # opens refused with EAGAIN: too many in flight
    opens_refused_share: int  # ... of them, past their user's share


class StorageCalls:
    """Runs blocking storage calls in worker threads, each timed out, with stuck ones kept out of the way."""

    def __init__(self, reader: Reader, *, thread_limiter: trio.CapacityLimiter | None = None,
                 io_timeout: float = IO_TIMEOUT, max_opens: int = MAX_OPENS, open_threads: int = OPEN_THREADS) -> None:
        self.reader = reader
        # Reads of storage block: they go to worker threads, a few at a time, so the loop keeps answering.
        self.thread_limiter = thread_limiter or trio.CapacityLimiter(4)
        # An open's calls (``for_open``) wait for these instead: opens never queue behind reads, nor behind a
        # handful of other opens.
        self.open_limiter = trio.CapacityLimiter(open_threads)
        self.io_timeout = io_timeout
        # Threads of reads that ran past io_timeout; they give their slot back, so they run outside the limiter.
        self._stuck: set[_Call] = set()
        self._stuck_lock = threading.Lock()
        self.max_opens = max_opens
        self.opens_in_flight = 0
        #: Opens refused (EAGAIN): max_opens in flight, or the opener's uid held its share (both counted here).
        self.opens_refused = 0
        #: Of those, opens refused because their uid held its share of max_opens (``opening``).
        self.opens_refused_share = 0
        self._opens_of: dict[int, int] = {}  # opens in flight by uid (those with any)
        self._unshared = frozenset({0, os.getuid()})  # root and the daemon's own user: bound by the total only

    def opening(self, uid: int) -> Opening:
        """Held by an open of a file by ``uid`` from before its first wait for storage to its answer (``with``). Past
        ``max_opens`` in flight an open fails at once with EAGAIN rather than taking one more FUSE worker: opens
        stuck behind a hung or saturated storage then never leave the mount unable to answer ``ls``, ``stat`` or
        the control file. A user other than root and the daemon's own may hold at most OPENS_PER_USER_SHARE of
        them: one user's stuck opens never refuse everyone else's. EAGAIN ("try again") because nothing is wrong
        with the file or the mount (EIO would send the operator after a broken disk, ENFILE is the open-file
        budget's); loaders do not retry either way, and the log and ``opens_refused`` say why.

        Only counters change here, between awaits: no open can slip past either bound. (A class of its own, not a
        ``contextmanager``: its generator and wrapper cost every open ~2 us of the loop's time.)"""
        return Opening(self, uid)

    def _open_begins(self, uid: int) -> None:
        """``Opening``'s entry: the bounds checked, the open counted."""
        mine = self._opens_of.get(uid, 0)
        if self.opens_in_flight >= self.max_opens:
            self.opens_refused += 1
            raise OSError(errno.EAGAIN, f"{self.max_opens} opens wait for storage already: further opens fail at "
                                        "once (EAGAIN) so that the mount keeps answering")
        share = max(1, int(self.max_opens * OPENS_PER_USER_SHARE))
        if uid not in self._unshared and mine >= share:
            self.opens_refused += 1
            self.opens_refused_share += 1
            raise OSError(errno.EAGAIN, f"uid {uid} has {mine} opens waiting for storage already, its share: its "
                                        "further opens fail at once (EAGAIN) so that others' keep being answered")
        self.opens_in_flight += 1
        self._opens_of[uid] = mine + 1

    def _open_ends(self, uid: int) -> None:
        """``Opening``'s exit, however the open ended."""
        self.opens_in_flight -= 1
        left = self._opens_of[uid] - 1
        if left:
            self._opens_of[uid] = left
        else:
            del self._opens_of[uid]

    @property
    def stuck(self) -> int:
        return len(self._stuck)

    def statistics(self) -> StorageCallsStatistics:
        return StorageCallsStatistics(stuck_reads=self.stuck, opens_in_flight=self.opens_in_flight,
                                      opens_refused=self.opens_refused,
                                      opens_refused_share=self.opens_refused_share)

    async def run(self, node: Node, fn: Callable[..., R], *args: Any, for_open: bool = False) -> R:
        """``fn(*args)``, a blocking read of ``node``'s storage, in a worker thread; EIO past ``io_timeout``.
        ``for_open``: a call an open waits for, under the opens' own limiter (``OPEN_THREADS``).

        A read stuck in the kernel (a hung NFS server, a failing disk) cannot be interrupted: its thread is
        abandoned and gives its slot back, so the other files keep their full number of threads. A file whose
        earlier read is still stuck fails at once rather than parking another thread, and so does every read
        once MAX_STUCK are stuck. Only the read itself is timed, not the wait for a slot: a busy mount is slow,
        not broken.
        """
        where = os.fsdecode(node.path)
        self._refuse_if_stuck(node, where)  # at once: no wait for a slot to be refused after it
        call = _Call(node.id)

        def run() -> R:
            try:
                return fn(*args)
            finally:
                with self._stuck_lock:
                    call.done = True
                    self._stuck.discard(call)

        async with self.open_limiter if for_open else self.thread_limiter:
            # Again once a slot is had: the calls queued behind those that got stuck passed the check before them,
            # and each would have parked one more thread on the storage that does not answer, past MAX_STUCK.
            self._refuse_if_stuck(node, where)
            with trio.move_on_after(self.io_timeout):
                try:
                    return await in_thread(run, discard=close_abandoned)
                except OSError as exc:
                    if exc.filename is None:  # a failed read names no file: name it, for the log and its dedup
                        raise OSError(exc.errno, exc.strerror, where) from exc
                    raise
        with self._stuck_lock:
            if not call.done:
                self._stuck.add(call)
        raise OSError(errno.EIO, f"storage did not answer within {self.io_timeout:g} s", where)

    def _refuse_if_stuck(self, node: Node, where: str) -> None:
        """EIO where an earlier read of ``node`` is still stuck, or MAX_STUCK reads are."""
        with self._stuck_lock:
            stuck = [call.node for call in self._stuck]
        if node.id in stuck:
            raise OSError(errno.EIO, "an earlier storage read of this file is still stuck", where)
        if len(stuck) >= MAX_STUCK:
            raise OSError(errno.EIO, f"{len(stuck)} storage reads are stuck: the storage does not answer", where)

    async def inline_or_run(self, node: Node, fn: Callable[..., R], *args: Any, for_open: bool = False) -> R:
        """``fn(*args)`` on the loop itself where the reader's storage answers from the kernel's caches (a local
        filesystem) and everything on the way is in them (``fn`` is called with ``cached_only=True`` and raises
        BlockingIOError otherwise); else, and then, in a worker thread (``run``). A walk on the loop never
        waits: a dentry that is not cached, or a path that would cross into another filesystem (the mount
        itself, whose LOOKUP only this loop could answer), is not walked here."""
        if self.reader.inline_check and CACHED_WALKS:  # without it no walk can ask for the caches only
            try:
                return fn(*args, cached_only=True)
            except BlockingIOError:
                pass
        return await self.run(node, fn, *args, for_open=for_open)

    async def source_changed(self, node: Node, version: tuple[int, int, int, int] | None = None) -> str | None:
        """None while ``node``'s source is the file the catalog describes (``check_source``), or the changed one
        of ``version`` an earlier open served; else what changed. An open's check (under the opens' limiter)."""
        check = self.reader.check_source if version is None else functools.partial(self.reader.check_source,
                                                                                   version=version)
        return await self.inline_or_run(node, check, node, for_open=True)


def close_abandoned(value: object) -> None:
    """What a storage call returned after its caller gave up on it (timed out, cancelled): a backing's descriptor,
    a whole file in a memfd (``Backing``, ``Content``), closed here, since nobody else ever will."""
    close = getattr(value, "close", None)
    if close is None:
        return
    try:
        close()
    except OSError as exc:
        log.warning("closing what an abandoned storage call returned: %s", exc)


class _Discards:
    """What abandoned calls returned and reached the loop late, discarded in turn by one thread of its own: closing
    a source's descriptor waits for its filesystem (a FUSE or NFS server that stopped answering, the very reason
    the call was abandoned), and on the loop every request of the mount waited with it. One thread, not one each:
    behind a close that hangs, the rest wait in its queue rather than pile up threads. ``put`` never raises (it
    runs in a callback of trio's, where an exception ends the whole loop): where no thread can be started (a pids
    limit), the next ``put`` tries again."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[Any], None], Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, discard: Callable[[Any], None], value: Any) -> None:
        self._queue.put((discard, value))
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            thread = threading.Thread(target=self._run, name=DISCARD, daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # ("can't start new thread")
                log.warning("cannot start a thread to close what an abandoned storage call returned (%s): "
                            "tried again at the next", exc)
                return
            self._thread = thread

    def _run(self) -> None:
        name_this_thread(DISCARD)
        while True:
            discard, value = self._queue.get()
            try:
                discard(value)
            except Exception as exc:  # (a thread of its own: nothing above it to catch it)
                log.warning("discarding what an abandoned storage call returned: %r", exc)


_DISCARDS = _Discards()


async def in_thread(fn: Callable[[], R], discard: Callable[[R], None] | None = None) -> R:
    """``fn()`` in one of trio's cached worker threads, abandoned (left to finish on its own) if the caller is
    cancelled; ``discard`` is given what an abandoned call returns, off the loop (``_DISCARDS``). What
    ``trio.to_thread.run_sync(fn, abandon_on_cancel=True)`` does, without what a storage call needs none of (a
    limiter of its own, a context copy, the way back into trio from the thread): 75 against 127 us of CPU per
    call on this kind of machine (issue 40), paid by every cold open."""
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()
    abandoned = False

    def discarded(result: Any) -> None:  # what an abandoned call returned
        if discard is not None and isinstance(result, outcome.Value):
            _DISCARDS.put(discard, result.value)

    def deliver(result: Any) -> None:  # an outcome.Outcome of fn(), handed back to the task
        if abandoned:  # (given up on before the call returned: no need to go by the loop)
            discarded(result)
            return

        def wake() -> None:
            if not abandoned:
                trio.lowlevel.reschedule(task, result)
            else:  # given up on while the answer was on its way to the loop
                discarded(result)
        try:
            token.run_sync_soon(wake)
        except trio.RunFinishedError:  # the loop ended while the call ran: nobody waits for it
            pass

    def abort(_: Any) -> trio.lowlevel.Abort:
        nonlocal abandoned
        abandoned = True
        return trio.lowlevel.Abort.SUCCEEDED

    trio.lowlevel.start_thread_soon(fn, deliver)
    result: R = await trio.lowlevel.wait_task_rescheduled(abort)
    return result


class Opening:
    """One open's hold on ``StorageCalls``' bound of opens in flight (``StorageCalls.opening``), for ``with``."""

    __slots__ = ("calls", "uid")

    def __init__(self, calls: StorageCalls, uid: int) -> None:
        self.calls, self.uid = calls, uid

    def __enter__(self) -> None:
        self.calls._open_begins(self.uid)

    def __exit__(self, *exc_info: object) -> None:
        self.calls._open_ends(self.uid)


@dataclass(eq=False, slots=True)
class _Call:
    """One storage read in a worker thread; kept in ``StorageCalls._stuck`` (by identity) while it overruns."""

    node: int
    done: bool = False
