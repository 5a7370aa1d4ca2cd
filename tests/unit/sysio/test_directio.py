"""The buffers files are read whole into (``sysio.directio.BufferPool``): lent again once let go, and a buffer
kept for good holding no pages past the bytes kept."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from liquidfs.sysio.directio import POOL, BufferPool, read_span


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


def test_a_span_that_ends_before_it_starts_is_no_bytes(tmp_path: Path) -> None:
    """Never a slice of a pool buffer up to a negative length: the bytes of the file it held before."""
    before = tmp_path / "before"
    before.write_bytes(b"S" * 8192)
    fd = os.open(before, os.O_RDONLY)
    try:
        POOL.give(read_span(fd, 0, 8192))  # the pool's buffer now holds another file's bytes
    finally:
        os.close(fd)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert bytes(read_span(fd, 4096, 10)) == b"" and bytes(read_span(fd, 0, 0)) == b""
    finally:
        os.close(fd)
