"""A profile's sample, and timed whole-file reads of it: the storage side of ``profile``'s measurements.

A store makes the sample (``Store.profile_sample``): a few images of the dataset and their raw expansions, put
where the mount will read them, with the function that times reads of them (local files with the page cache
bypassed, or whole-object GETs).
"""

from __future__ import annotations

import concurrent.futures as cf
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


class ProfileError(Exception):
    """The profile cannot be made; the message says why."""


@dataclass
class Sample:
    originals: list[Any]  # what ``load`` reads: local paths, or (bucket, key) of objects
    raws: list[Any]
    scratch: Path
    load: Callable[[Sequence[Any], float], tuple[float, float]] = field(default=lambda items, s: measure_load(items, s))
    cleanup: Callable[[], None] = lambda: None
    original_data: list[bytes] = field(default_factory=list)
    raw_data: list[bytes] = field(default_factory=list)



def _read_direct(path: Path, buf: mmap.mmap) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            n = len(os.pread(fd, 1 << 30, 0))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return n
        finally:
            os.close(fd)
    try:
        total = 0
        while True:
            got = os.preadv(fd, [memoryview(buf)], total)
            total += got
            if got < len(buf):
                return total
    finally:
        os.close(fd)


def measure_load(paths: Sequence[Path], seconds: float, jobs: int = 4) -> tuple[float, float]:
    """(bytes/s, CPU seconds per byte) of whole-file reads in random order with the page cache bypassed."""
    local = threading.local()

    def read_one(path: Path) -> int:
        # one aligned buffer per thread, allocated once: faulting in fresh pages per file would be measured
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return _read_direct(path, buf)

    return _timed_reads(read_one, paths, seconds, jobs)


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
            total += sum(pool.map(worker, [order[i::jobs] for i in range(jobs)]))
    elapsed = time.monotonic() - started
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return total / elapsed, cpu / max(1, total)
