"""Putting a mount's file serving together: the data paths, the level each keeps its held bytes in, and the
``fs.Operations`` over them, built finished from their parts (``mount.build_operations`` hands it the options).

Either data path is built from the same parts (``Parts``): the store's reader, the storage calls, the kernel
notifier and the next-epoch policy. The daemon path keeps held files in the daemon's memory; the passthrough
path in memfds, with a daemon path beside it (holding nothing) for the files that get no backing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from ..catalog import Catalog, Node
from ..datapath.daemon import MAX_OPEN_BYTES, DaemonPath
from ..datapath.notifier import Notifier
from ..datapath.passthrough import Kernel, PassthroughPath
from ..datapath.storage_calls import IO_TIMEOUT, OPEN_THREADS, StorageCalls
from ..fuse.lookahead import MetadataAhead
from ..fuse.operations import MAX_OPEN_FILES, Operations
from ..held.base import MemfdLevel, MemoryLevel
from ..metrics.stats import MountStats
from ..mix.share import Mix
from ..policy.jobs import JobOf
from ..policy.next_epoch import NextEpochCache
from ..stores.reader import Reader


@dataclass
class Parts:
    """What either data path is built from."""

    reader: Reader
    stats: MountStats
    storage: StorageCalls
    notifier: Notifier
    policy: NextEpochCache | None = None  # the next-epoch cache's, if the mount has one
    page_cache: str = "drop"
    max_open_bytes: int = MAX_OPEN_BYTES
    push_pages: bool = True
    verify_reads: bool = False
    #: Told of each passthrough open that found its metadata cold (the metadata read-ahead, where there is one).
    cold_open: Callable[[Node], None] | None = None
    #: Memfds the passthrough path's level may hold (``held.held_descriptors``; None: no cap).
    held_files: int | None = None

    def daemon_path(self, *, holds: bool = True) -> DaemonPath:
        """The daemon data path; ``holds``: it keeps the next-epoch cache's files (in this process)."""
        held = MemoryLevel(self.policy, self.stats) if holds and self.policy is not None else None
        return DaemonPath(self.reader, self.stats, self.storage, self.notifier, held=held,
                          page_cache=self.page_cache, max_open_bytes=self.max_open_bytes,
                          push_pages=self.push_pages)

    def passthrough_path(self, kernel: Kernel) -> PassthroughPath:
        """The passthrough data path over ``kernel``'s connection; the next-epoch cache's files in memfds."""
        held = MemfdLevel(self.policy, self.stats, self.held_files) if self.policy is not None else None
        return PassthroughPath(kernel, self.reader, self.stats, self.storage, ranges=self.daemon_path(holds=False),
                               held=held, verify_reads=self.verify_reads,
                               drop_served_pages=self.page_cache == "drop", on_cold_open=self.cold_open)


def parts(reader: Reader, stats: MountStats, *, policy: NextEpochCache | None = None,
          thread_limiter: trio.CapacityLimiter | None = None, io_timeout: float = IO_TIMEOUT,
          page_cache: str = "drop", max_open_bytes: int = MAX_OPEN_BYTES, push_pages: bool = True,
          verify_reads: bool = False, held_files: int | None = None, open_threads: int = OPEN_THREADS) -> Parts:
    storage = StorageCalls(reader, thread_limiter=thread_limiter, io_timeout=io_timeout, open_threads=open_threads)
    return Parts(reader, stats, storage, Notifier(), policy, page_cache, max_open_bytes, push_pages, verify_reads,
                 held_files=held_files)


def operations(catalog: Catalog, built: Parts, *, data_path: str = "daemon", kernel: Kernel | None = None,
               mix: Mix | None = None, may_read: Callable[[Node, int, int, int], bool] | None = None,
               max_open_files: int = MAX_OPEN_FILES, extra_statistics: Callable[[], dict[str, Any]] | None = None,
               enable_passthrough: bool = False, time_requests: bool = False,
               lookahead: MetadataAhead | None = None) -> Operations:
    """A finished ``Operations``. ``data_path``: "daemon", "passthrough" (over ``kernel``), or "at init": chosen
    once the connection's INIT says whether the kernel grants passthrough (``Operations.serve_with``)."""
    path: DaemonPath | PassthroughPath | None
    if lookahead is not None:
        built.cold_open = lookahead.went_cold
    job_of = None
    if built.policy is not None:
        job_of = JobOf()
        built.policy.owner_of = job_of.owner  # a job's uid decides which slots it may take
    if data_path == "daemon":
        path = built.daemon_path()
    elif data_path == "passthrough":
        if kernel is None:
            raise ValueError("the passthrough data path needs the kernel's connection")
        path = built.passthrough_path(kernel)
    elif data_path == "at init":
        path = None
    else:
        raise ValueError(f"data_path must be 'daemon', 'passthrough' or 'at init', not {data_path!r}")
    return Operations(catalog, built.stats, built.storage, built.notifier, path, mix=mix, may_read=may_read,
                      max_open_files=max_open_files, extra_statistics=extra_statistics,
                      enable_passthrough=enable_passthrough, time_requests=time_requests, lookahead=lookahead,
                      job_of=job_of)
