"""The cluster level (``clustertier.ClusterTier``) over a memcached in a dict: which objects are the cluster's,
hits only of the exact bytes the catalog records, a changed source never served from it, a dead memcached a miss.
Real memcacheds and mounts: ``tests/system/test_cluster.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clusterfakes import FakeMemcached
from liquidfs.catalog import Catalog
from liquidfs.clustertier import ClusterError, ClusterTier, in_share, key_of, parse_cluster
from liquidfs.prepare import prepare
from liquidfs.stores.local.reader import StoreReader
from sample import make_sample


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    make_sample(src, count=8, width=64, height=32, seed=4)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    return src, store


def _tier(store: Path, share: float = 1.0) -> tuple[ClusterTier, FakeMemcached, list]:
    catalog = Catalog.open(store, readonly=True)
    client = FakeMemcached()
    tier = ClusterTier(StoreReader(catalog.source, store), client, share)
    return tier, client, [n for n in catalog.files() if n.served_raw]


def test_urls() -> None:
    assert parse_cluster("memcached://a:1,b,[::1]:5") == [("a", 1), ("b", 11211), ("::1", 5)]
    for bad in ("memcached://", "redis://a:1", "memcached://a:x", "memcached://a:1,a:1", "memcached://a:1/db",
                "memcached://:5", "memcached://a:99999"):
        with pytest.raises(ClusterError):
            parse_cluster(bad)


def test_the_share_is_the_same_on_every_node_and_of_raw_objects_only(store: tuple[Path, Path]) -> None:
    src, path = store
    _, _, raw = _tier(path)
    assert raw and all(in_share(n, 1.0) for n in raw) and not any(in_share(n, 0.0) for n in raw)
    half = [in_share(n, 0.5) for n in raw]
    assert half == [in_share(n, 0.5) for n in _tier(path)[2]]  # from the catalog alone: another node agrees
    catalog = Catalog.open(path, readonly=True)
    assert not any(in_share(n, 1.0) for n in catalog.files() if not n.served_raw)
    assert all(key_of(n) == f"liquidfs1:{n.checksum}:{n.size_served}" for n in raw)  # what it holds, no path


def test_a_miss_is_stored_and_the_next_node_hits_the_same_bytes(store: tuple[Path, Path]) -> None:
    _, path = store
    first, client, raw = _tier(path)
    served = {n.id: bytes(first.open(n).data or b"") for n in raw}
    assert first.statistics()["cluster_misses"] == len(raw) and client.sets == len(raw)
    second = ClusterTier(first.inner, client, 1.0)  # another node, the same memcacheds
    for n in raw:
        content = second.open(n)
        assert content.tier == "cluster" and bytes(content.data or b"") == served[n.id]
        assert served[n.id] == (path / str(n.object)).read_bytes()
    st = second.statistics()
    assert st["cluster_hits"] == len(raw) and st["cluster_hit_bytes"] == sum(map(len, served.values()))
    second.close()  # its connections; the reader behind it is its owner's and still serves
    assert client.closed and bytes(first.inner.open(raw[0]).data or b"") == served[raw[0].id]


def test_a_value_that_is_not_the_objects_bytes_is_never_served(store: tuple[Path, Path]) -> None:
    _, path = store
    tier, client, raw = _tier(path)
    node = raw[0]
    real = (path / str(node.object)).read_bytes()
    for wrong in (b"x" * len(real), real[:-1], real[:-1] + bytes([real[-1] ^ 1]), "text"):
        client.values[key_of(node)] = wrong  # type: ignore[assignment]  # a peer, or anyone who reaches it
        content = tier.open(node)
        assert content.tier == "storage" and bytes(content.data or b"") == real
        client.values.pop(key_of(node), None)
    assert tier.statistics()["cluster_rejected"] == 4 and tier.statistics()["cluster_hits"] == 0


def test_a_changed_source_is_never_served_from_the_cluster(store: tuple[Path, Path]) -> None:
    src, path = store
    tier, client, raw = _tier(path)
    node = raw[0]
    tier.open(node)  # stored
    source = src / os.fsdecode(node.path)
    source.write_bytes(source.read_bytes())  # rewritten in place: the catalog no longer describes it
    content = tier.open(node)
    assert content.tier != "cluster" and not content.raw and bytes(content.data or b"") == source.read_bytes()
    assert tier.statistics()["cluster_hits"] == 0


def test_a_memcached_that_does_not_answer_costs_hits_never_a_read(store: tuple[Path, Path]) -> None:
    _, path = store
    tier, client, raw = _tier(path)
    client.down = True
    for n in raw:
        assert bytes(tier.open(n).data or b"") == (path / str(n.object)).read_bytes()
    st = tier.statistics()
    assert st["cluster_hits"] == 0 and st["cluster_unanswered"] == len(raw)  # the stores it refused
    client.down = False  # back: used again
    for n in raw:
        tier.open(n)
    assert tier.statistics()["cluster_stored"] == len(raw)


def test_files_outside_the_share_never_ask_the_cluster(store: tuple[Path, Path]) -> None:
    _, path = store
    tier, client, raw = _tier(path, share=0.0)
    for n in raw:
        tier.open(n)
    assert client.gets == client.sets == 0
    assert tier.vouch(raw[0]) is True  # read at its first read, as without a cluster
    assert _tier(path, share=1.0)[0].vouch(raw[0]) is False  # the cluster's: read at open, where it is asked
