"""Metadata read ahead (``lookahead.MetadataAhead``): a cold directory's files warmed once, in a worker thread,
bounded; and what ``warm`` does for the opens that follow."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from liquidfs import lookahead
from liquidfs.catalog import ROOT_ID, Catalog, build
from liquidfs.lookahead import MetadataAhead
from liquidfs.stores.local.reader import StoreReader


def _tree(tmp_path: Path, dirs: int = 3, files: int = 5) -> Catalog:
    src = tmp_path / "src"
    for d in range(dirs):
        (src / f"d{d}").mkdir(parents=True)
        for f in range(files):
            (src / f"d{d}" / f"f{f}.bin").write_bytes(b"x" * 100)
    build(src, tmp_path / "store")
    return Catalog.open(tmp_path / "store", readonly=True)


def _dir(catalog: Catalog, name: bytes) -> int:
    found = catalog.lookup(ROOT_ID, name)
    assert found is not None
    return found.id


def test_a_cold_directory_is_warmed_once_file_by_file(tmp_path: Path) -> None:
    catalog = _tree(tmp_path)
    warmed: list[bytes] = []
    ahead = MetadataAhead(catalog.path, lambda node: warmed.append(node.path))
    d0, d1 = _dir(catalog, b"d0"), _dir(catalog, b"d1")
    for _ in range(4):  # every lookup in d0 reaches the daemon; the directory is warmed once
        ahead.looked_up(d0)
    ahead.looked_up(d1)
    ahead.stop()
    assert sorted(warmed) == sorted([b"d0/f%d.bin" % i for i in range(5)] + [b"d1/f%d.bin" % i for i in range(5)])
    assert ahead.statistics() == {"lookahead_directories": 2, "lookahead_files": 10}


def test_a_directory_is_warmed_again_after_a_while_and_the_queue_is_bounded(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = _tree(tmp_path, dirs=2, files=1)
    release = threading.Event()
    warmed: list[bytes] = []

    def slow(node) -> None:
        release.wait(10)
        warmed.append(node.path)

    ahead = MetadataAhead(catalog.path, slow)
    d0 = _dir(catalog, b"d0")
    monkeypatch.setattr(lookahead, "AGAIN_AFTER", 0.0)  # a directory may be warmed again at once
    for _ in range(lookahead.MAX_QUEUED + 10):
        ahead.looked_up(d0)  # the worker is stuck on the first: the queue fills to its bound and no further
    release.set()
    ahead.stop()
    assert len(warmed) == lookahead.MAX_QUEUED  # the first taken by the worker, the rest queued behind it


def test_a_warm_that_fails_costs_only_the_hint(tmp_path: Path) -> None:
    catalog = _tree(tmp_path, dirs=1, files=3)

    def broken(node) -> None:
        raise OSError(5, "gone")

    ahead = MetadataAhead(catalog.path, broken)
    ahead.looked_up(_dir(catalog, b"d0"))
    ahead.stop()
    assert ahead.statistics() == {"lookahead_directories": 1, "lookahead_files": 0}


@pytest.mark.needs_root("/proc/sys/vm/drop_caches")
def test_warm_brings_what_an_open_on_the_loop_walks_into_the_kernels_caches(tmp_path: Path) -> None:
    catalog = _tree(tmp_path, dirs=1, files=1)
    reader = StoreReader(catalog.source, tmp_path / "store")
    node = catalog.lookup(_dir(catalog, b"d0"), b"f0.bin")
    assert node is not None
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2\n")  # dentries and inodes
    with pytest.raises(BlockingIOError):
        reader.open_source(node, cached_only=True)  # cold: the loop would hand this open to a thread
    reader.warm(node)
    os.close(reader.open_source(node, cached_only=True))  # warm: answered on the loop
    reader.close()
