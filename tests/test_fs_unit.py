"""The FUSE layer driven in-process, without a mount: handlers over a real catalog and store."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pyfuse3
import pytest
import trio

from liquidfs.cache import NextEpochCache
from liquidfs.catalog import ROOT_ID, Catalog, build
from liquidfs.fs import CONTROL_ID, CONTROL_NAME, Operations
from liquidfs.reader import StoreReader
from liquidfs.stats import MountStats

CTX = pyfuse3.RequestContext()


@pytest.fixture
def ops(tmp_path: Path) -> Operations:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.bin").write_bytes(b"A" * 5000)
    (src / "b.txt").write_bytes(b"hello\n")
    store = tmp_path / "store"
    build(src, store)
    catalog = Catalog.open(store, readonly=True)
    total = 5006
    cache = NextEpochCache(total, total, 2, max_id=10)
    return Operations(catalog, StoreReader(catalog.source, store), MountStats(), cache=cache)


def run(fn, *args):
    return trio.run(fn, *args)


def test_lookup_getattr_open_read_release(ops: Operations) -> None:
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    assert d.st_mode & 0o040000 and d.st_nlink == 2
    a = run(ops.lookup, d.st_ino, b"a.bin", CTX)
    assert a.st_size == 5000 and a.st_mode & 0o222 == 0
    assert run(ops.getattr, a.st_ino, CTX).st_size == 5000
    fi = run(ops.open, a.st_ino, os.O_RDONLY, CTX)
    assert run(ops.read, fi.fh, 4990, 100) == b"A" * 10
    run(ops.release, fi.fh)
    assert ops.stats.opens == 1 and ops.stats.bytes_read == 10
    assert ops.lookups[a.st_ino] == 1
    run(ops.forget, [(a.st_ino, 1)])
    assert a.st_ino not in ops.lookups


def test_missing_names_and_writes(ops: Operations) -> None:
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.lookup, ROOT_ID, b"nope", CTX)
    assert info.value.errno == errno.ENOENT
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        with pytest.raises(pyfuse3.FUSEError) as info:
            run(ops.open, b.st_ino, flags, CTX)
        assert info.value.errno == errno.EROFS
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.unlink, ROOT_ID, b"b.txt", CTX)
    assert info.value.errno == errno.EROFS


def test_unexpected_exceptions_become_eio(ops: Operations) -> None:
    def broken(node):
        raise RuntimeError("a bug")

    ops.reader.open = broken  # type: ignore[method-assign]
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.open, b.st_ino, os.O_RDONLY, CTX)
    assert info.value.errno == errno.EIO and ops.stats.errors == 1


def test_source_deleted_is_enoent(ops: Operations, tmp_path: Path) -> None:
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    (tmp_path / "src" / "b.txt").unlink()
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(ops.open, b.st_ino, os.O_RDONLY, CTX)
    assert info.value.errno == errno.ENOENT


def test_cache_holds_bytes_for_the_next_epoch(ops: Operations) -> None:
    d = run(ops.lookup, ROOT_ID, b"d", CTX)
    a = run(ops.lookup, d.st_ino, b"a.bin", CTX)
    b = run(ops.lookup, ROOT_ID, b"b.txt", CTX)
    for _ in range(3):  # three epochs over two files; the budget holds both
        for inode in (a.st_ino, b.st_ino):
            fi = run(ops.open, inode, os.O_RDONLY, CTX)
            run(ops.read, fi.fh, 0, 1 << 20)
            run(ops.release, fi.fh)
    assert set(ops.held_data) == {a.st_ino, b.st_ino}
    assert ops.stats.bytes_from_memory == 2 * 5006 and ops.stats.bytes_from_storage == 5006
    assert ops.cache is not None and ops.cache.stats.hits == 4


def test_control_entry(ops: Operations) -> None:
    entry = run(ops.lookup, ROOT_ID, CONTROL_NAME, CTX)
    assert entry.st_ino == CONTROL_ID
    fi = run(ops.open, CONTROL_ID, os.O_RDONLY, CTX)
    assert fi.direct_io
    values = json.loads(bytes(run(ops.read, fi.fh, 0, 1 << 20)))
    assert values["pid"] == os.getpid() and "cache_budget" in values
    vfs = run(ops.statfs, CTX)
    assert vfs.f_files == 2
