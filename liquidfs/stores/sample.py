"""A profile's sample, and timed whole-file reads of it: the storage side of ``profile``'s measurements.

A store makes the sample (``Store.profile_sample``): a few images of the dataset and their raw expansions, put
where the mount will read them, with the function that times reads of them (local files with the page cache
bypassed, or whole-object GETs).
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import logging
import mmap
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sysio.paths import open_below

log = logging.getLogger(__name__)


class ProfileError(Exception):
    """The profile cannot be made; the message says why."""


@dataclass(frozen=True)
class Below:
    """A local file whose reads are timed: ``rel`` below the directory held open at ``dir_fd``, opened as the
    mount opens it (``paths.open_below``: no link on the way, regular files only). Between the sample and its
    timed reads the dataset's owner may swap the file for a link to a FIFO (an open that never returns) or to
    a device, and the reads run as root."""

    dir_fd: int
    rel: bytes
    where: bytes = b""  # the directory's path, for messages


@dataclass
class Sample:
    originals: list[Any]  # what ``load`` reads: local files (``Below``), or (bucket, key) of objects
    raws: list[Any]
    scratch: Path
    load: Callable[[Sequence[Any], float], tuple[float, float]] = field(default=lambda items, s: measure_load(items, s))
    cleanup: Callable[[], None] = lambda: None
    original_data: list[bytes] = field(default_factory=list)
    raw_data: list[bytes] = field(default_factory=list)



def _read_direct(file: Below, buf: mmap.mmap) -> int:
    # The open is timed too, as it was when files were opened by path: a mount opens each file this way.
    fd = open_below(file.dir_fd, file.rel, file.where)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError:  # no direct I/O here (tmpfs): read, then drop the pages the read left
            n = len(os.pread(fd, 1 << 30, 0))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return n
        total = 0
        while True:
            got = os.preadv(fd, [memoryview(buf)], total)
            total += got
            if got < len(buf):
                return total
    finally:
        os.close(fd)


def measure_load(files: Sequence[Below], seconds: float, jobs: int = 4) -> tuple[float, float]:
    """(bytes/s, CPU seconds per byte) of whole-file reads in random order with the page cache bypassed. A file
    that can no longer be opened as the mount opens it (swapped for a link, a FIFO) is skipped, with a warning."""
    local = threading.local()
    lock = threading.Lock()
    skipped: set[Below] = set()

    def read_one(file: Below) -> int:
        # one aligned buffer per thread, allocated once: faulting in fresh pages per file would be measured
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            return _read_direct(file, buf)
        except OSError as exc:
            with lock:
                first = file not in skipped
                skipped.add(file)
            if first:
                log.warning("profile: skipping %s: %s", exc.filename or os.fsdecode(file.rel), exc.strerror)
            return 0

    return _timed_reads(read_one, files, seconds, jobs)


def measure_get(get: Callable[[Any], bytes], objects: Sequence[Any], seconds: float,
                jobs: int) -> tuple[float, float]:
    """(bytes/s, CPU seconds per byte) of whole-object GETs (``get``) in random order, ``jobs`` in flight."""
    return _timed_reads(lambda obj: len(get(obj)), objects, seconds, jobs)


def _timed_reads(read_one: Callable[[Any], int], items: Sequence[Any], seconds: float,
                 jobs: int) -> tuple[float, float]:
    """Read every item (``read_one`` returns its bytes), ``jobs`` at a time in a fresh random order per round,
    rounds repeated for ``seconds`` (at least one): (bytes/s, this process's CPU seconds per byte)."""
    rng = random.Random(1)
    order = list(items)
    deadline = time.monotonic() + seconds
    total = 0
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()

    def worker(share: list[Any]) -> int:
        done = 0
        for item in share:
            done += read_one(item)
            if time.monotonic() > deadline:
                break
        return done

    with cf.ThreadPoolExecutor(jobs) as pool:
        while time.monotonic() < deadline or total == 0:
            rng.shuffle(order)
            done = sum(pool.map(worker, [order[i::jobs] for i in range(jobs)]))
            if done == 0:  # a round reads each item once: nothing readable is left, and none would ever be
                raise ProfileError("none of the sampled files could be read (see the warnings)")
            total += done
    elapsed = time.monotonic() - started
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return total / elapsed, cpu / max(1, total)
