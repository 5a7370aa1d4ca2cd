"""Blocking calls into storage (the store, the source, an object store) from the trio loop: in worker threads, a
few at a time, each under ``--io-timeout``, so a hung disk or server fails one file and never the mount."""

from __future__ import annotations

import errno
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from .catalog import Node
from .reader import Reader

R = TypeVar("R")

#: Seconds a storage read may take before the reader gets EIO (``mount --io-timeout``).
IO_TIMEOUT = 60.0
#: Storage reads left stuck past their timeout before every new read fails at once: the storage is not answering,
#: and each further try would only park one more thread in the kernel.
MAX_STUCK = 64


class StorageCalls:
    """Runs blocking storage calls in worker threads, each timed out, with stuck ones kept out of the way."""

    def __init__(self, reader: Reader, *, thread_limiter: trio.CapacityLimiter | None = None,
                 io_timeout: float = IO_TIMEOUT) -> None:
        self.reader = reader
        # Reads of storage block: they go to worker threads, a few at a time, so the loop keeps answering.
        self.thread_limiter = thread_limiter or trio.CapacityLimiter(4)
        self.io_timeout = io_timeout
        # Threads of reads that ran past io_timeout; they give their slot back, so they run outside the limiter.
        self._stuck: set[_Call] = set()
        self._stuck_lock = threading.Lock()
        self._unlimited = trio.CapacityLimiter(math.inf)

    @property
    def stuck(self) -> int:
        return len(self._stuck)

    async def run(self, node: Node, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)``, a blocking read of ``node``'s storage, in a worker thread; EIO past ``io_timeout``.

        A read stuck in the kernel (a hung NFS server, a failing disk) cannot be interrupted: its thread is
        abandoned and gives its slot back, so the other files keep their full number of threads. A file whose
        earlier read is still stuck fails at once rather than parking another thread, and so does every read
        once MAX_STUCK are stuck. Only the read itself is timed, not the wait for a slot: a busy mount is slow,
        not broken.
        """
        with self._stuck_lock:
            stuck = [call.node for call in self._stuck]
        where = os.fsdecode(node.path)
        if node.id in stuck:
            raise OSError(errno.EIO, "an earlier storage read of this file is still stuck", where)
        if len(stuck) >= MAX_STUCK:
            raise OSError(errno.EIO, f"{len(stuck)} storage reads are stuck: the storage does not answer", where)
        call = _Call(node.id)

        def run() -> R:
            try:
                return fn(*args)
            finally:
                with self._stuck_lock:
                    call.done = True
                    self._stuck.discard(call)

        async with self.thread_limiter:
            with trio.move_on_after(self.io_timeout):
                try:
                    return await trio.to_thread.run_sync(run, abandon_on_cancel=True, limiter=self._unlimited)
                except OSError as exc:
                    if exc.filename is None:  # a failed read names no file: name it, for the log and its dedup
                        raise OSError(exc.errno, exc.strerror, where) from exc
                    raise
        with self._stuck_lock:
            if not call.done:
                self._stuck.add(call)
        raise OSError(errno.EIO, f"storage did not answer within {self.io_timeout:g} s", where)


    async def inline_or_run(self, node: Node, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` on the loop itself where the reader's storage answers from the kernel's caches (a local
        filesystem) and everything on the way is in them (``fn`` is called with ``cached_only=True`` and raises
        BlockingIOError otherwise); else, and then, in a worker thread (``run``). A walk on the loop never
        waits: a dentry that is not cached, or a path that would cross into another filesystem (the mount
        itself, whose LOOKUP only this loop could answer), is not walked here."""
        if self.reader.inline_check:
            try:
                return fn(*args, cached_only=True)
            except BlockingIOError:
                pass
        return await self.run(node, fn, *args)

    async def source_changed(self, node: Node) -> str | None:
        """None while ``node``'s source is the file the catalog describes (``check_source``), else what changed."""
        return await self.inline_or_run(node, self.reader.check_source, node)


@dataclass(eq=False, slots=True)
class _Call:
    """One storage read in a worker thread; kept in ``StorageCalls._stuck`` (by identity) while it overruns."""

    node: int
    done: bool = False
