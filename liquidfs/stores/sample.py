"""A profile's sample, and timed whole-file reads of it: the storage side of ``profile``'s measurements.

A store makes the sample (``Store.profile_sample``): images of the dataset and their raw expansions, put where
the mount will read them, with the function that times reads of them (local files with the page cache bypassed,
or whole-object GETs), as many readers at once as the loader has.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import fcntl
import itertools
import logging
import mmap
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sysio.paths import open_below_stat

log = logging.getLogger(__name__)

#: Files each reader gets at least, before a sample may stop at its bytes (``sample_full``): with fewer, a
#: reader's rate is its first few files' (their open, a cold start of the device's queue).
FILES_PER_READER = 4
#: Of the memory this process may still use when a sample begins (``expand.workers.available_memory``), the share
#: its images may hold (each original and its raw expansion, kept for the decode timings): past it a sample stops,
#: short of ``FILES_PER_READER`` a reader or of ``--sample N`` even. 128 readers of 100-megapixel images (300 MB
#: raw) had the floor alone hold 512 of them, 150 GB: an out-of-memory kill, not a profile.
HELD_SHARE = 0.5
#: A direct read's lengths are multiples of this (the largest logical block size in use; the buffer is page-aligned).
_BLOCK = 4096


class ProfileError(Exception):
    """The profile cannot be made; the message says why."""


@dataclass(frozen=True)
class Below:
    """A local file whose reads are timed: ``rel`` below the directory held open at ``dir_fd``, opened as the
    mount opens it (``sysio.paths.open_below``: no link on the way, regular files only). Between the sample and its
    timed reads the dataset's owner may swap the file for a link to a FIFO (an open that never returns) or to
    a device, and the reads run as root."""

    dir_fd: int
    rel: bytes
    where: bytes = b""  # the directory's path, for messages
    #: Its size when sampled: a file of another size at the open is skipped, and none is read past it (the
    #: owner's `truncate -s 10T` of a sampled image would have the profile read terabytes of zeros as root).
    #: None: the open's size.
    size: int | None = None


@dataclass
class Sample:
    originals: list[Any]  # what ``load`` reads: local files (``Below``), or (bucket, key) of objects
    raws: list[Any]
    scratch: Path
    load: Callable[[Sequence[Any], float], tuple[float, float]] = field(default=lambda items, s: measure_load(items, s))
    cleanup: Callable[[], None] = lambda: None
    original_data: list[bytes] = field(default_factory=list)
    raw_data: list[bytes] = field(default_factory=list)
    #: Bytes its images may hold (``HELD_SHARE``); None: no bound (the memory available cannot be read).
    held_limit: int | None = field(default_factory=lambda: _held_limit())

    def full(self, count: int, readers: int, max_bytes: int | None) -> bool:
        """Whether the sample is complete (``sample_full``), or holds all the memory it may (said: its rates come
        from fewer files than asked for)."""
        raw_bytes = sum(map(len, self.raw_data))
        if sample_full(len(self.raws), raw_bytes, count, readers, max_bytes):
            return True
        held = raw_bytes + sum(map(len, self.original_data))
        # (Never none: a pod at its memory limit, its page cache counted as used, reads no headroom at all, and a
        # sample of none said "none of the sampled images can be expanded losslessly".)
        if self.held_limit is None or held < self.held_limit or not self.raws:
            return False
        log.warning("profile: the sample stops at %d images, which hold %.1f GB of the %.1f GB it may (half the "
                    "memory available): fewer than the %d asked for, or %d a reader for %d readers; its rates are "
                    "measured on fewer files", len(self.raws), held / 1e9, self.held_limit / 1e9, count,
                    FILES_PER_READER, readers)
        return True


def _held_limit() -> int | None:
    from ..expand.workers import available_memory  # (the profile's: not every mount's that opens a store)

    available = available_memory()
    return None if available is None else int(available * HELD_SHARE)


def sample_full(images: int, raw_bytes: int, count: int, readers: int, max_bytes: int | None) -> bool:
    """Whether a sample of ``images`` whose raw expansions hold ``raw_bytes`` is complete: ``count`` images, or
    ``max_bytes`` of expansions once each of the ``readers`` has ``FILES_PER_READER`` files to read."""
    if images >= count:
        return True
    return max_bytes is not None and raw_bytes >= max_bytes and images >= FILES_PER_READER * readers


def _read_direct(file: Below, buf: mmap.mmap) -> int:
    # The open is timed too, as it was when files were opened by path: a mount opens each file this way.
    fd, st = open_below_stat(file.dir_fd, file.rel, file.where)  # its size from the open's own check
    try:
        size = st.st_size if file.size is None else file.size
        if st.st_size != size:
            raise OSError(errno.ESTALE, f"{st.st_size} bytes, {size} when sampled: changed since",
                          os.fsdecode(os.path.join(file.where, file.rel)))
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError:  # no direct I/O here (tmpfs): read, then drop the pages the read left
            n = len(os.pread(fd, min(size, 1 << 30), 0))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return n
        # Each read asks for what is left of the file by its size (to the next block), never the whole buffer: a
        # direct read costs the kernel by the length asked for, not read (6.18: 64 MiB asked of a 180 KB file cost
        # ~10 ms of CPU, and the profile timed this machine's storage at 26 MB/s where it reads 600).
        view = memoryview(buf)
        total = 0
        while total < size:  # to its size, never past: one that grew since is read no further
            want = min(len(view), -(-(size - total) // _BLOCK) * _BLOCK)  # what is left, to the next block
            got = os.preadv(fd, [view[:want]], total)
            total += got
            if got < want:  # the end of the file
                break
        return min(total, size)
    finally:
        os.close(fd)


def measure_load(files: Sequence[Below], seconds: float, jobs: int = 4) -> tuple[float, float]:
    """(bytes/s, CPU seconds per byte) of whole-file reads in random order with the page cache bypassed, ``jobs``
    readers at once. A file that can no longer be opened as the mount opens it (swapped for a link, a FIFO) is
    skipped, with a warning."""
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
    """Read every item (``read_one`` returns its bytes) by ``jobs`` readers, each taking the next item of a fresh
    random order per round, rounds repeated for ``seconds`` (the first read whole): (bytes/s, this process's CPU
    seconds per byte)."""
    if not items:
        raise ProfileError("the sample has no files to read")
    rng = random.Random(1)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def schedule() -> Iterator[tuple[int, Any]]:
        for round_ in itertools.count():
            order = list(items)
            rng.shuffle(order)
            yield from ((round_, item) for item in order)

    # One shared queue, not a share per reader: a reader that meets a slow file leaves the others reading, as a
    # loader's workers do, instead of each round waiting for its slowest reader.
    queue = schedule()

    def reader() -> int:
        done = 0
        while True:
            with lock:
                round_, item = next(queue)
            if round_ > 0 and time.monotonic() > deadline:
                return done
            done += read_one(item)

    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    with cf.ThreadPoolExecutor(jobs) as pool:
        total = sum(pool.map(lambda _: reader(), range(jobs)))
    elapsed = time.monotonic() - started
    if total == 0:  # every item was tried: nothing readable is left, and none would ever be
        raise ProfileError("none of the sampled files could be read (see the warnings)")
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return total / elapsed, cpu / total
