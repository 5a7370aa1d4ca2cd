"""Counters of a running mount, readable through the control file, ``liquidfs stats`` and Prometheus (under the
names ``metrics.defs.METRICS`` gives them); ``Statistics``, the shape every part's snapshot of its own has."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Protocol

#: Each level bytes are served from (``stores.reader.Content.level``) and the counter of its bytes: the one table
#: of them (``MountStats.served_from`` counts by it, ``metrics.defs`` exports it).
SERVED_FROM = {"storage": "bytes_from_storage", "memory": "bytes_from_memory", "disk": "bytes_from_disk",
               "cluster": "bytes_from_cluster"}


class Statistics:
    """A part's counters at one moment, typed (a dataclass of this): ``values()`` gives them under the keys the
    control file and ``/metrics`` read, each field's name after the part's ``prefix``. Those keys are the
    user-facing contract; the fields may be named for the part alone."""

    prefix: ClassVar[str] = ""

    def values(self) -> dict[str, object]:
        return {self.prefix + f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]  # a dataclass, by contract


class HasStatistics(Protocol):
    """A part whose counters the mount's statistics gather (a level beside the data path)."""

    def statistics(self) -> Statistics: ...


@dataclass
class MountStats:
    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)
    source: str = ""
    store: str = ""
    files: int = 0
    dataset_bytes: int = 0        # bytes of every file as served
    opens: int = 0
    opens_raw: int = 0
    bytes_read: int = 0           # bytes the daemon answered read requests with
    read_requests: int = 0        # read requests that reached the daemon
    bytes_from_storage: int = 0   # bytes the daemon read from the store or the source
    bytes_from_memory: int = 0    # bytes of opened files that were held in the daemon's memory
    bytes_from_disk: int = 0      # bytes served from the local disk level (--disk-cache)
    bytes_from_cluster: int = 0   # bytes served from the cluster level (--cluster): a peer's memcached
    deferred: int = 0             # opens whose file was read at its first read instead of at open
    open_evictions: int = 0       # open files whose bytes were let go to keep open_bytes under its bound
    bytes_pushed: int = 0         # bytes handed to the kernel's page cache ahead of its reads (notify_store)
    lost_page_reads: int = 0          # read requests for pages the kernel lost after the daemon let their file go
    bytes_of_lost_pages: int = 0     # bytes those requests were answered with
    refetches: int = 0            # storage reads they took (of the CHUNKs around what was asked)
    bytes_refetched: int = 0         # bytes those storage reads took
    reclaimed: int = 0            # cache hits whose held bytes were lost (dropped after a fallback) and re-read
    held_swapped: int = 0         # held originals let go since the mix now serves their files raw (the share
                                  # rose): the open reads raw, and the cache may hold that instead
    fallbacks: int = 0            # files whose raw object was not served (missing, corrupt, stale source)
    errors: int = 0               # requests answered with an error other than ENOENT
    listed_with_attributes: int = 0  # directory entries listed with attributes (each a lookup the kernel holds)
    listed_bare: int = 0          # ... listed bare: name, inode number and type (``fuse.listing``)
    listed_packed: int = 0        # ... of those, from the catalog's packed listings (``catalog.listings``)
    data_path: str = "daemon"     # "passthrough": the kernel serves reads from backing files; "daemon": we do
    data_path_why: str = ""       # why the daemon path serves, when it does
    dispatch: str = "stock"       # "queued-first": pyfuse3's loop (our patch) takes requests already queued
                                  # without a trip through trio; "stock": each request waits through trio
    passthrough_opens: int = 0    # opens answered with a backing file (no read of them reaches the daemon)
    backing_source: int = 0       # first opens served from the source file itself
    backing_object: int = 0       # ... from the raw object of a local store
    backing_memfd: int = 0        # ... from a memfd (a cache hit, an object-store download, a checked read)
    backing_disk: int = 0         # ... from the local disk level (copied into a memfd, checked)
    cold_opens: int = 0           # passthrough opens whose inodes were not in memory (opened in a worker thread)
    backings_recast: int = 0      # --loops: first opens whose bytes were made the other kind of backing (a memfd,
                                  # the file) to share another loop's backing of the same bytes
    warmup: str = ""              # mount --warmup: "running" (after the mount reported ready), then "done" or "failed"
    warmup_files: int = 0         # files the warm-up has put in the cache so far
    warmup_bytes: int = 0         # ... and their bytes

    def served_from(self, level: str, size: int) -> None:
        """``size`` bytes of an opened file came from ``level`` (``stores.reader.Content.level``): storage, or the level
        of held bytes in front of it that had them; the data paths count every level alike."""
        name = SERVED_FROM.get(level)
        if name is None:
            raise ValueError(f"no level of bytes named {level!r}")
        setattr(self, name, getattr(self, name) + size)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
