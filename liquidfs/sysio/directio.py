"""Whole-file reads that leave no copy in the page cache (O_DIRECT, or drop-behind where the filesystem
refuses it), into buffers reused from one file to the next (``POOL``).

Every read is of a span its caller names: of a size it checked, never of whatever size the file has now (one a
writer grew to 100 GB while it was read would fill the daemon's memory).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading

log = logging.getLogger(__name__)

_ALIGN = 4096
_HUGE = 2 << 20


def read_span(fd: int, start: int, end: int, *, direct: bool = True) -> memoryview:
    """Bytes ``[start, end)`` of the file open at ``fd`` (``start`` page-aligned; fewer at the end of the file),
    read without leaving them in the page cache.

    O_DIRECT, into a page-aligned pool buffer (the descriptor is left so: its callers close it after).
    Filesystems without O_DIRECT (tmpfs, some FUSE and network filesystems) refuse it with EINVAL; they are read
    buffered and their pages dropped after.
    """
    if end <= start:  # nothing: not a slice of a pool buffer up to a negative length, another file's bytes
        return memoryview(b"")
    if direct and _set_direct(fd, True):
        view = POOL.take(max(_ALIGN, -(-(end - start) // _ALIGN) * _ALIGN))
        try:
            done = 0
            while start + done < end:
                got = os.preadv(fd, [view[done:]], start + done)
                done += got
                if got == 0 or done % _ALIGN:
                    break  # a short, unaligned read is the end of the file
            return view[:min(done, end - start)]
        except OSError as exc:
            POOL.give(view)  # nothing was served from it
            if exc.errno != errno.EINVAL:
                raise
        _set_direct(fd, False)
    chunks = []
    offset = start
    while offset < end:
        chunk = os.pread(fd, end - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
    return memoryview(chunks[0] if len(chunks) == 1 else b"".join(chunks))


class BufferPool:
    """Buffers of files served and closed, kept for the next files instead of unmapped.

    A fresh anonymous buffer costs the kernel a zeroed page for every page touched (on a VM the host may back
    each new guest page on first touch too: BENCHMARKS.md has what it cost the daemon). A reused one is already
    faulted in. Only buffers that nothing
    else can still read come back (``give``): a file's bytes that the cache holds, or that a second open
    shares, never do. Idle buffers are capped at ``limit`` bytes; past it they are unmapped as before.
    """

    def __init__(self, limit: int = 64 << 20) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._free: list[tuple[int, mmap.mmap, int]] = []  # (capacity, map, offset of the aligned view)
        self._idle = 0
        self._maps: dict[int, tuple[int, int]] = {}  # id(map) -> (capacity, offset), for maps out on loan
        self.reused = 0

    def take(self, capacity: int) -> memoryview:
        with self._lock:
            # best fit, and no buffer more than 1.5x (+ one huge page) the need: a small file must not pin a big one
            fits = [i for i, (cap, _, _) in enumerate(self._free) if capacity <= cap <= capacity * 3 // 2 + _HUGE]
            if fits:
                cap, buf, offset = self._free.pop(min(fits, key=lambda i: self._free[i][0]))
                self._idle -= cap
                self._maps[id(buf)] = (cap, offset)
                self.reused += 1
                return memoryview(buf)[offset:offset + capacity]
        buf, offset = _new_buffer(capacity)
        with self._lock:
            self._maps[id(buf)] = (capacity, offset)
        return memoryview(buf)[offset:offset + capacity]

    def give(self, view: memoryview) -> None:
        """``view`` (or a slice of it) will never be read again by anyone: its buffer may serve another file."""
        buf = view.obj
        with self._lock:
            found = self._maps.pop(id(buf), None)
            if found is None or not isinstance(buf, mmap.mmap):
                return
            capacity, offset = found
            if self._idle + capacity > self.limit:
                return  # unmapped once the last view goes
            self._free.append((capacity, buf, offset))
            self._idle += capacity

    @property
    def idle(self) -> int:
        return self._idle

    def forget(self, view: memoryview) -> None:
        """``view``'s buffer is kept elsewhere for good (the cache holds it): stop tracking it, and give the
        kernel back the pages of the buffer past ``view``. A buffer may be up to 1.5x (+ one huge page) the need,
        reused from a larger file whose pages are still in it: a held 110 KB file pinned 2 MB of memory where
        the cache's budget counted 110 KB."""
        with self._lock:
            found = self._maps.pop(id(view.obj), None)
        buf = view.obj
        if found is not None and isinstance(buf, mmap.mmap):
            _drop_past(buf, view)


POOL = BufferPool()


def _drop_past(buf: mmap.mmap, view: memoryview) -> None:
    """Give back the pages of ``buf`` after the last one ``view`` (a part of it) touches; the kernel hands fresh
    zeroed pages to a later access, which nobody makes."""
    try:
        base = ctypes.c_char.from_buffer(buf)
        start = ctypes.c_char.from_buffer(view)
    except (TypeError, ValueError):  # a read-only or empty view: nothing to compute its place from
        return
    end = ctypes.addressof(start) - ctypes.addressof(base) + view.nbytes
    del base, start  # their exports of the map
    tail = -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
    if tail < len(buf):
        try:
            buf.madvise(mmap.MADV_DONTNEED, tail, len(buf) - tail)
        except (OSError, AttributeError):
            pass


def _new_buffer(capacity: int) -> tuple[mmap.mmap, int]:
    """A fresh buffer for one file, backed by transparent huge pages where they fit.

    Faulting in and zeroing fresh 4 KiB pages cost ~0.5 CPU-s per GB read here, as much as everything else the
    daemon does; 2 MiB pages cut that to ~0.15. The map is private (a shared anonymous map would be shmem,
    counted and reclaimed as page cache); the view starts on a 2 MiB boundary so whole huge pages fit, and the
    tail that fills no whole huge page stays on small pages so no file holds up to 2 MiB it does not use.
    """
    buf = mmap.mmap(-1, capacity + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = (-ctypes.addressof(ctypes.c_char.from_buffer(buf))) % _HUGE
    whole = capacity // _HUGE * _HUGE
    try:
        if whole:
            buf.madvise(mmap.MADV_HUGEPAGE, offset, whole)
        buf.madvise(mmap.MADV_NOHUGEPAGE, offset + whole, len(buf) - offset - whole)
    except (OSError, AttributeError):  # no THP here: small pages work, just slower
        pass
    return buf, offset


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for an open file; False where the filesystem does not do direct I/O."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True
