"""The buffers files are read whole into (``sysio.directio.BufferPool``): lent again once let go, and a buffer
kept for good holding no pages past the bytes kept."""

from __future__ import annotations

import ctypes
import mmap

from liquidfs.sysio.directio import BufferPool


def _resident(buf: mmap.mmap) -> int:
    """Bytes of ``buf``'s mapping resident in memory, from this process's own smaps."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                low, high = (int(x, 16) for x in head[0].split("-"))
                inside = low <= start < high
            elif inside and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise AssertionError("no mapping of the buffer in /proc/self/smaps")


def test_a_buffer_kept_for_good_gives_back_its_pages_past_the_bytes_kept() -> None:
    """A small file read into a buffer a large one filled before (the pool lends one up to 1.5x + 2 MiB the
    need): kept by the cache, it pinned the large file's pages, 2 MB for 110 KB the budget counted."""
    pool = BufferPool()
    large = pool.take(2 << 20)
    large[:] = b"L" * (2 << 20)  # every page touched
    buf = large.obj
    assert isinstance(buf, mmap.mmap)
    pool.give(large)
    small = pool.take(110_000)
    assert small.obj is buf  # the same buffer, lent again
    small[:] = b"s" * 110_000
    before = _resident(buf)
    assert before >= 2 << 20
    pool.forget(small)
    after = _resident(buf)
    assert after <= 110_000 + 2 * mmap.PAGESIZE + (before - (2 << 20))  # what it keeps, and no page past it
    assert bytes(small) == b"s" * 110_000  # the bytes kept, untouched
