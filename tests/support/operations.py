"""``fuse.operations.Operations`` built in-process for unit tests by the mount's own builder
(``daemon.build.operations``), from a ``MountConfig`` as a mount's."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from liquidfs.daemon import build as assemble
from liquidfs.daemon.config import MountConfig
from liquidfs.datapath.passthrough import Kernel
from liquidfs.policy.next_epoch import NextEpochCache
from liquidfs.catalog.build import build
from liquidfs.catalog.catalog import Catalog
from liquidfs.fuse.operations import Operations
from liquidfs.stores.reader import Reader
from liquidfs.stores.local.reader import StoreReader
from liquidfs.metrics.stats import MountStats


class FakeKernel:
    """The kernel's side of passthrough: registrations recorded, each backing's bytes readable."""

    def __init__(self) -> None:
        self.next_id = 1
        self.files: dict[int, int] = {}  # backing id -> (a dup of) the registered fd
        self.registered = 0

    def register(self, fd: int) -> int:
        backing_id = self.next_id
        self.next_id += 1
        self.files[backing_id] = os.dup(fd)
        self.registered += 1
        return backing_id

    def unregister(self, backing_id: int) -> None:
        os.close(self.files.pop(backing_id))

    def read(self, backing_id: int) -> bytes:
        fd = self.files[backing_id]
        return os.pread(fd, os.fstat(fd).st_size + 1, 0)


def config(**options: Any) -> MountConfig:
    """A mount's config with ``options`` (``MountConfig``'s fields: page_cache, open_bytes, verify_reads...)."""
    return MountConfig(source="src", mountpoint=Path("/mnt"), store="store", **options)


def daemon_operations(catalog: Catalog, reader: Reader, *, cache: NextEpochCache | None = None,
                      **options: Any) -> Operations:
    """Served by the daemon data path; ``options`` are ``MountConfig``'s. Its parts are left open, as a test's
    process ends soon enough."""
    ops, _ = assemble.operations(config(**options), catalog, reader, MountStats(), ExitStack(), policy=cache)
    return ops


def passthrough_operations(catalog: Catalog, reader: Reader, kernel: Kernel, *,
                           cache: NextEpochCache | None = None, **options: Any) -> Operations:
    """Served by the passthrough data path over ``kernel`` (a fake in unit tests)."""
    ops, _ = assemble.operations(config(**options), catalog, reader, MountStats(), ExitStack(), policy=cache,
                                 data_path="passthrough", kernel=kernel)
    return ops


def small_tree(tmp_path: Path) -> Operations:
    """``d/a.bin`` (5,000 x "A") and ``b.txt`` ("hello\\n"), with a next-epoch cache of all of it."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.bin").write_bytes(b"A" * 5000)
    (src / "b.txt").write_bytes(b"hello\n")
    store = tmp_path / "store"
    build(src, store)
    catalog = Catalog.open(store, readonly=True)
    total = 5006
    cache = NextEpochCache(total, total, 2, max_id=10)
    return daemon_operations(catalog, StoreReader(catalog.source, store), cache=cache)


def ops_over(tmp_path: Path, files: dict[str, bytes], cache_share: float | None) -> Operations:
    """The files named in ``files`` at the root, with a cache of ``cache_share`` of their bytes (None: none)."""
    src = tmp_path / "src"
    src.mkdir(parents=True)
    for name, data in files.items():
        (src / name).write_bytes(data)
    store = tmp_path / "store"
    build(src, store)
    catalog = Catalog.open(store, readonly=True)
    total = sum(map(len, files.values()))
    cache = NextEpochCache(int(cache_share * total), total, len(files), max_id=10) if cache_share else None
    return daemon_operations(catalog, StoreReader(catalog.source, store), cache=cache)
