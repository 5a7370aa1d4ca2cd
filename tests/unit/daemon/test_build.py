"""The one builder of a mount (``daemon.build.mount``): every part on one ``ExitStack`` from the moment it exists,
so a close that raises leaves no other part open."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from liquidfs.catalog.catalog import Catalog
from liquidfs.daemon import build
from liquidfs.daemon.config import MountConfig, Share
from liquidfs.datapath.daemon import DaemonPath
from liquidfs.datapath.notifier import Notifier
from liquidfs.fuse.lookahead import MetadataAhead
from liquidfs.held.disk import DiskLevel
from liquidfs.stores import open_store
from liquidfs.stores.local.reader import StoreReader

#: Each part's close, by the part's name.
CLOSES: dict[str, tuple[type, str]] = {
    "catalog": (Catalog, "close"), "reader": (StoreReader, "close"), "disk level": (DiskLevel, "close"),
    "notifier": (Notifier, "stop"), "read-ahead": (MetadataAhead, "stop"), "data path": (DaemonPath, "close"),
}


class Broken(Exception):
    pass


def _recording(name: str, close: Callable[..., Any], closed: list[str], failing: str) -> Callable[..., Any]:
    def recorded(self: object, *args: Any, **kwargs: Any) -> Any:
        closed.append(name)
        result = close(self, *args, **kwargs)
        if name == failing:
            raise Broken(name)
        return result
    return recorded


def _prepared(tmp_path: Path) -> Callable[[ExitStack], build.Mount]:
    """A local store of three files with its catalog made: what builds a mount of it on a stack."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(3):
        (src / "d" / f"{i}.bin").write_bytes(bytes([i]) * 4000)
    storage = open_store(src, tmp_path / "store")
    store_dir = storage.mount_catalog(rescan=False, progress=False)
    config = MountConfig(source=storage.source_label, mountpoint=tmp_path / "mnt", store=storage.label,
                         cache_size=Share(0.5), disk_cache=tmp_path / "disk", disk_cache_size=Share(0.5),
                         data_path="daemon")
    return lambda stack: build.mount(config, storage, store_dir, stack)


def _record(monkeypatch: pytest.MonkeyPatch, failing: str = "") -> list[str]:
    """The parts closed, in order (each close still runs); the close of ``failing`` raises after it ran."""
    closed: list[str] = []
    for name, (cls, method) in CLOSES.items():
        monkeypatch.setattr(cls, method, _recording(name, getattr(cls, method), closed, failing))
    return closed


@pytest.mark.parametrize("failing", sorted(CLOSES))
def test_a_part_whose_close_raises_leaves_every_other_part_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  failing: str) -> None:
    mounted = _prepared(tmp_path)
    closed = _record(monkeypatch, failing)
    with pytest.raises(Broken, match=failing):
        with ExitStack() as stack:
            mount = mounted(stack)
            assert mount.ops.data_path is not None and mount.ops.lookahead is not None and not closed
    assert sorted(closed) == sorted(CLOSES), f"closed: {closed}"


def test_parts_close_in_reverse_order_of_their_making(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mounted = _prepared(tmp_path)
    closed = _record(monkeypatch)
    with ExitStack() as stack:
        mounted(stack)
    # the data path after the notifier stopped (its queue may name the path's files), the levels before the
    # reader under them, the catalog last
    assert closed == ["notifier", "data path", "read-ahead", "disk level", "reader", "catalog"]


def test_a_part_that_cannot_be_made_closes_those_made_before_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    mounted = _prepared(tmp_path)
    closed = _record(monkeypatch)

    def no_operations(*args: Any, **kwargs: Any) -> Any:
        raise Broken("operations")

    monkeypatch.setattr(build, "Operations", no_operations)
    with pytest.raises(Broken):
        with ExitStack() as stack:
            mounted(stack)
    assert closed == ["notifier", "read-ahead", "disk level", "reader", "catalog"]


def test_a_cluster_without_a_key_over_a_source_without_modes_is_refused(tmp_path: Path) -> None:
    """The daemon's own check behind the command's: a source with no root of its own to ask (an object store's)
    has nothing everyone may read, so no cluster level in the clear is made for it."""
    config = MountConfig(source="s3://b/data", mountpoint=tmp_path / "mnt", store="s3://b/store",
                         cluster=(("127.0.0.1", 9),), cluster_size=1 << 20)
    with pytest.raises(build.MountError, match="needs --cluster-key-file"):
        build.make_cluster_level((0, 0, 0, 0), Any, config, Any, None)  # type: ignore[arg-type]


def test_a_local_mounts_cluster_asks_the_source_as_it_is_whether_everyone_may_read_a_file(tmp_path: Path) -> None:
    """Without a cluster key: the modes of the source now (``EveryoneReadsNow``), not the catalog's."""
    from liquidfs.held.cluster import EveryoneReadsNow

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x")
    storage = open_store(src, tmp_path / "store")
    store_dir = storage.mount_catalog(rescan=False, progress=False)
    config = MountConfig(source=storage.source_label, mountpoint=tmp_path / "mnt", store=storage.label,
                         cluster=(("127.0.0.1", 9),), cluster_size=1 << 20)
    with ExitStack() as stack:
        mount = build.mount(config, storage, store_dir, stack)
        levels = [level for level in mount.ops.levels if type(level).__name__ == "ClusterLevel"]
        assert len(levels) == 1
        public = levels[0].public  # type: ignore[attr-defined]
        assert isinstance(public, EveryoneReadsNow)


def test_one_memcached_telling_a_huge_size_counts_as_the_others_do() -> None:
    """A peer saying it holds a petabyte (a lying one, or one a spoofed name resolved to) took the cluster's share
    to every raw object: each memcached counts at most as the lower median of what they say."""
    from liquidfs.daemon.build import CLUSTER_USABLE, cluster_size_from_limits

    mib = 2**20
    assert cluster_size_from_limits({"a": 64 * mib, "b": 64 * mib, "liar": 2**50}, 10**15) == \
        int((64 + 64 + 4 * 64) * mib * CLUSTER_USABLE)  # at most CLUSTER_SPREAD (4) times the lower median
    assert cluster_size_from_limits({"a": 64 * mib, "liar": 2**50}, 10**15) == \
        int((64 + 4 * 64) * mib * CLUSTER_USABLE)
    assert cluster_size_from_limits({"a": 64 * mib, "b": 32 * mib, "c": 100 * mib, "d": None}, 10**15) == \
        int(196 * mib * CLUSTER_USABLE)  # honest sizes of a spread unchanged


def test_the_reader_is_told_every_storage_call_that_may_be_asked_at_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The opens' own pool and --threads' reads ask the reader at once: an object store's reader sized its
    connections for --threads alone (110 connections made for 128 requests of 64 opens, a TLS handshake each)."""
    from liquidfs.datapath.limits import OPEN_THREADS
    from liquidfs.stores.local.store import LocalStore

    asked: list[int] = []
    reader = LocalStore.reader
    monkeypatch.setattr(LocalStore, "reader",
                        lambda self, catalog, threads, io_timeout: asked.append(threads) or reader(
                            self, catalog, threads, io_timeout))
    with ExitStack() as stack:
        _prepared(tmp_path)(stack)
    assert asked == [MountConfig.threads + OPEN_THREADS]
