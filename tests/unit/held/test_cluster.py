"""The cluster level (``held.cluster.ClusterLevel``) over a memcached in a dict: which objects are the cluster's,
hits only of the exact bytes the catalog records, a changed source never served from it, a dead memcached a miss.
A --cluster name (``ResolvingClient``) with a resolver faked: every address it resolves to, a join or a leave moving
only that memcached's keys, an answer that is not addresses or fails keeping the last good set.
Real memcacheds and mounts: ``tests/system/test_cluster.py``."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from clusterfakes import FakeMemcached
from liquidfs.catalog.catalog import Catalog
from liquidfs.held.cluster_peers import (MAX_SERVERS, ClusterError, ResolvingClient, hash_client, memcached_client,
                                   parse_cluster, resolve_addresses)
from liquidfs.held.cluster import ClusterLevel, EveryoneReadsNow, in_share, key_of
from liquidfs.held.sealing import ClusterKey, Sealer
from liquidfs.prepare import prepare
from liquidfs.stores.local.reader import StoreReader
from liquidfs.sysio.thread_names import CLUSTER_DNS
from sample import make_sample


@pytest.fixture
def store(reachable_tmp: Path) -> tuple[Path, Path]:
    """A source every user may read, down from / (a cluster without a key shares only such), and its store."""
    tmp_path = reachable_tmp
    src = tmp_path / "src"
    make_sample(src, count=8, width=64, height=32, seed=4)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    return src, store


def _level(store: Path, share: float = 1.0, key: ClusterKey | None = None) -> tuple[ClusterLevel, FakeMemcached, list]:
    """A level over a fake memcached: plaintext of sources everyone may read, or sealed under ``key``."""
    catalog = Catalog.open(store, readonly=True)
    client = FakeMemcached()
    reader = StoreReader(catalog.source, store)
    if key is not None:
        level = ClusterLevel(reader, client, share, sealer=Sealer(key), key_id=key.id)
    else:
        level = ClusterLevel(reader, client, share, public=EveryoneReadsNow(reader.root_fd))
    return level, client, [n for n in catalog.files() if n.served_raw]


def test_urls() -> None:
    assert parse_cluster("memcached://a:1,b,[::1]:5,[fe80::2]") == [("a", 1), ("b", 11211), ("::1", 5),
                                                                      ("fe80::2", 11211)]
    for bad in ("memcached://", "redis://a:1", "memcached://a:x", "memcached://a:1,a:1", "memcached://a:1/db",
                "memcached://:5", "memcached://a:99999", "memcached://a:", "memcached://[::1]:",
                "memcached://[::1]x", "memcached://[::1", "memcached://a:\u00b2"):  # a bracket not closed; a
        with pytest.raises(ClusterError):                                      # digit int() refuses
            parse_cluster(bad)
    for unbracketed in ("memcached://2001:db8:0:0:0:0:0:1", "memcached://2001:db8::1:2", "memcached://::1"):
        with pytest.raises(ClusterError, match=r"an IPv6 address is written \[ADDRESS\]:PORT"):
            parse_cluster(unbracketed)


def test_the_share_is_the_same_on_every_node_and_of_raw_objects_only(store: tuple[Path, Path]) -> None:
    src, path = store
    _, _, raw = _level(path)
    assert raw and all(in_share(n, 1.0) for n in raw) and not any(in_share(n, 0.0) for n in raw)
    half = [in_share(n, 0.5) for n in raw]
    assert half == [in_share(n, 0.5) for n in _level(path)[2]]  # from the catalog alone: another node agrees
    catalog = Catalog.open(path, readonly=True)
    assert not any(in_share(n, 1.0) for n in catalog.files() if not n.served_raw)
    assert all(key_of(n) == f"liquidfs2:{n.checksum}:{n.size_served}" for n in raw)  # what it holds, no path


def test_a_miss_is_stored_and_the_next_node_hits_the_same_bytes(store: tuple[Path, Path]) -> None:
    _, path = store
    first, client, raw = _level(path)
    served = {n.id: bytes(first.open(n).data or b"") for n in raw}
    assert first.statistics().values()["cluster_misses"] == len(raw) and client.sets == len(raw)
    second = ClusterLevel(first.inner, client, 1.0, public=first.public)  # another node, the same memcacheds
    for n in raw:
        content = second.open(n)
        assert content.level == "cluster" and bytes(content.data or b"") == served[n.id]
        assert served[n.id] == (path / str(n.object)).read_bytes()
    st = second.statistics().values()
    assert st["cluster_hits"] == len(raw) and st["cluster_hit_bytes"] == sum(map(len, served.values()))
    second.close()  # its connections; the reader behind it is its owner's and still serves
    assert client.closed and bytes(first.inner.open(raw[0]).data or b"") == served[raw[0].id]


def test_a_value_that_is_not_the_objects_bytes_is_never_served(store: tuple[Path, Path]) -> None:
    _, path = store
    level, client, raw = _level(path)
    node = raw[0]
    real = (path / str(node.object)).read_bytes()
    for wrong in (b"x" * len(real), real[:-1], real[:-1] + bytes([real[-1] ^ 1]), "text"):
        client.values[key_of(node)] = wrong  # type: ignore[assignment]  # a peer, or anyone who reaches it
        content = level.open(node)
        assert content.level == "storage" and bytes(content.data or b"") == real
        client.values.pop(key_of(node), None)
    assert level.statistics().values()["cluster_rejected"] == 4 and level.statistics().values()["cluster_hits"] == 0


def test_a_changed_source_is_never_served_from_the_cluster(store: tuple[Path, Path]) -> None:
    src, path = store
    level, client, raw = _level(path)
    node = raw[0]
    level.open(node)  # stored
    source = src / os.fsdecode(node.path)
    source.write_bytes(source.read_bytes())  # rewritten in place: the catalog no longer describes it
    content = level.open(node)
    assert content.level != "cluster" and not content.raw and bytes(content.data or b"") == source.read_bytes()
    assert level.statistics().values()["cluster_hits"] == 0


def test_a_memcached_that_does_not_answer_costs_hits_never_a_read(store: tuple[Path, Path]) -> None:
    _, path = store
    level, client, raw = _level(path)
    client.down = True
    for n in raw:
        assert bytes(level.open(n).data or b"") == (path / str(n.object)).read_bytes()
    st = level.statistics().values()
    assert st["cluster_hits"] == 0 and st["cluster_unanswered"] == 2 * len(raw)  # its fetches and stores
    client.down = False  # back: used again
    for n in raw:
        level.open(n)
    assert level.statistics().values()["cluster_stored"] == len(raw)


def test_values_past_what_a_memcached_stores_are_kept_out_for_a_while(store: tuple[Path, Path]) -> None:
    """A memcached with a smaller -I than the raw objects (memcached's default 1 MB, Cityscapes' 6 MB): each miss
    sealed and sent a value to be refused, at every node. Once refused, values that large are not sent, counted as
    refused (not as unanswered), until REFUSED_FOR has passed; they are still asked for: one memcached's refusal
    (a smaller -I than the others', or one that lies) kept every node from the values the others hold."""
    from liquidfs.held.cluster import REFUSED_FOR

    _, path = store
    level, client, raw = _level(path)
    now = [100.0]
    level.clock = lambda: now[0]
    client.largest = 0
    for n in raw:
        assert bytes(level.open(n).data or b"") == (path / str(n.object)).read_bytes()
    st = level.statistics().values()
    assert (client.gets, client.sets) == (len(raw), 1) and st["cluster_refused"] == len(raw)
    assert st["cluster_unanswered"] == 0 and st["cluster_misses"] == len(raw)
    client.values[key_of(raw[1])] = (path / str(raw[1].object)).read_bytes()  # another node's memcached has it
    assert level.open(raw[1]).level == "cluster"
    client.values.clear()
    client.largest = None  # restarted with a larger -I
    now[0] += REFUSED_FOR
    for n in raw:
        level.open(n)
    assert level.statistics().values()["cluster_stored"] == len(raw)


def test_a_value_refused_for_now_keeps_no_size_out(store: tuple[Path, Path]) -> None:
    """Out of memory for a moment (or NOT_STORED): refused, counted so, and the next values are tried (one such
    answer for a small value had kept nearly every image out of the cluster for 5 minutes)."""
    _, path = store
    level, client, raw = _level(path)
    client.full = True
    for n in raw:
        level.open(n)
    st = level.statistics().values()
    assert client.sets == len(raw) and st["cluster_refused"] == len(raw) and st["cluster_unanswered"] == 0


def test_files_outside_the_share_never_ask_the_cluster(store: tuple[Path, Path]) -> None:
    _, path = store
    level, client, raw = _level(path, share=0.0)
    for n in raw:
        level.open(n)
    assert client.gets == client.sets == 0
    assert level.vouch(raw[0]) is True  # read at its first read, as without a cluster
    assert _level(path, share=1.0)[0].vouch(raw[0]) is False  # the cluster's: read at open, where it is asked


# -- a --cluster name, resolved again ------------------------------------------------------------------------


class FakeDNS:
    """A resolver whose answer the test sets: a list (returned as is, whatever it holds) or an exception (raised)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.asked: list[tuple[str, int]] = []
        self.threads: list[str] = []  # the thread of each question

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        self.threads.append(threading.current_thread().name)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[no-any-return]


class Made:
    """``make`` for ``ResolvingClient``: real ``HashClient``s (no connection until asked), each kept."""

    def __init__(self) -> None:
        self.clients: list[Any] = []

    def __call__(self, servers: list[tuple[str, int]]) -> Any:
        self.clients.append(hash_client(servers))
        return self.clients[-1]

    def placement(self, keys: list[str]) -> dict[str, str]:
        """Which memcached the latest client puts each key on (its rendezvous hash)."""
        return {key: self.clients[-1].hasher.get_node(key) for key in keys}


def test_literal_addresses_are_used_as_given_and_never_resolved() -> None:
    dns = FakeDNS(socket.gaierror("must not be asked"))
    client = memcached_client([("10.0.0.1", 11211), ("::1", 5)], resolve=dns)
    assert not isinstance(client, ResolvingClient) and dns.asked == []
    assert sorted(client.clients) == ["10.0.0.1:11211", "::1:5"]  # type: ignore[attr-defined]
    client.close()


def test_a_name_stands_for_every_address_it_resolves_to_and_nothing_else() -> None:
    dns = FakeDNS(["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::7", "memcached.evil", "0.0.0.0", "224.0.0.1", 7, "",
                   "10.0.0.1 ; rm", "::"])
    client = memcached_client([("memcached.ns.svc.cluster.local", 11211), ("192.168.1.9", 11212)], resolve=dns)
    try:
        assert isinstance(client, ResolvingClient)
        assert dns.asked == [("memcached.ns.svc.cluster.local", 11211)]  # the literal one is not asked about
        # fd00::7 too, but of the IPv4 addresses the name answers with: one family (a dual-stack Service's)
        assert client.servers() == [("10.0.0.1", 11211), ("10.0.0.2", 11211), ("192.168.1.9", 11212)]
    finally:
        client.close()


def test_a_dual_stack_name_counts_each_memcached_once() -> None:
    """A headless Service of both families answers each memcached's IPv4 and IPv6 address: each was a memcached
    of its own (their sizes summed twice over; half the keys on addresses a node without an IPv6 route cannot
    reach). IPv4 where the answer has any; an IPv6-only answer is as it is."""
    from liquidfs.held.cluster_peers import usable_addresses

    assert usable_addresses(["10.0.0.1", "fd00::1", "10.0.0.2", "fd00::2"]) == (["10.0.0.1", "10.0.0.2"], 0)
    assert usable_addresses(["fd00::2", "fd00::1"]) == (["fd00::1", "fd00::2"], 0)


def test_a_memcached_that_joins_or_leaves_moves_only_its_own_keys() -> None:
    dns, made = FakeDNS(["10.0.0.1", "10.0.0.2", "10.0.0.3"]), Made()
    client = ResolvingClient([("memcached", 11211)], resolve=dns, make=made, background=False)
    keys = [f"liquidfs2:{i:08x}:{i}" for i in range(3000)]
    before = made.placement(keys)
    assert set(before.values()) == {"10.0.0.1:11211", "10.0.0.2:11211", "10.0.0.3:11211"}

    dns.answer = ["10.0.0.3", "10.0.0.4", "10.0.0.1", "10.0.0.2"]  # a node joins (any order: one set)
    assert client.refresh() and len(made.clients) == 2  # a new client over the new set
    joined = made.placement(keys)
    moved = {k for k in keys if joined[k] != before[k]}
    assert moved and all(joined[k] == "10.0.0.4:11211" for k in moved)  # only to the new one
    assert 0.15 < len(moved) / len(keys) < 0.35  # about its quarter

    dns.answer = ["10.0.0.1", "10.0.0.3", "10.0.0.4"]  # another leaves
    assert client.refresh()
    left = made.placement(keys)
    moved = {k for k in keys if left[k] != joined[k]}
    assert moved == {k for k in keys if joined[k] == "10.0.0.2:11211"}  # exactly its keys, spread on the rest
    assert "10.0.0.2:11211" not in made.clients[-1].clients  # gone for good, not a dead node waiting to return
    assert not client.refresh() and len(made.clients) == 3  # the same answer: the same client, its pools kept
    client.close()


def test_the_memcacheds_that_stay_when_a_name_resolves_anew_keep_their_record() -> None:
    """A memcached left out for its failures (skipped) came straight back into service, with a clean record, as
    soon as another joined or left (a new client over the new set made every peer anew); and the idle
    connections of every one that stayed were closed. The peers that stay are carried over; the old client's
    close leaves them open, and closes the ones that left."""
    dns, made = FakeDNS(["10.0.0.1", "10.0.0.2"]), Made()
    client = ResolvingClient([("memcached", 11211)], resolve=dns, make=made, background=False)
    first = made.clients[-1]
    dead, gone = first.clients["10.0.0.1:11211"], first.clients["10.0.0.2:11211"]
    for _ in range(3):
        dead.failed(time.monotonic(), "refused")
    assert dead.skipped(time.monotonic())
    dns.answer = ["10.0.0.1", "10.0.0.3"]  # one joins, one leaves
    assert client.refresh()
    now = made.clients[-1]
    assert now.clients["10.0.0.1:11211"] is dead and dead.skipped(time.monotonic()) and not dead.closed
    assert gone.closed and "10.0.0.3:11211" in now.clients
    client.close()
    assert dead.closed


@pytest.mark.parametrize("failure", [socket.gaierror(socket.EAI_NONAME, "Name or service not known"), [],
                                     ["not-an-address", None], "10.0.0.9", RuntimeError("a resolver's bug")])
def test_a_name_that_resolves_to_nothing_usable_keeps_its_last_good_set_and_logs_once(
        failure: Any, caplog: pytest.LogCaptureFixture) -> None:
    dns = FakeDNS(["10.0.0.1", "10.0.0.2"])
    memcached = FakeMemcached()
    client = ResolvingClient([("memcached", 11211)], resolve=dns, make=lambda servers: memcached,
                             background=False)
    memcached.values["k"] = b"v"
    dns.answer = failure
    with caplog.at_level(logging.INFO, logger="liquidfs.held.cluster_peers"):
        for _ in range(3):
            assert client.refresh() is False
            assert client.servers() == [("10.0.0.1", 11211), ("10.0.0.2", 11211)]
            assert client.get("k", 1) == b"v"  # fetches go on over the last good set
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "keeping its last 2" in warned[0].getMessage()
        dns.answer = ["10.0.0.1"]
        assert client.refresh() and client.servers() == [("10.0.0.1", 11211)]
        assert any("resolves again" in r.getMessage() for r in caplog.records)
    client.close()


def test_an_answer_past_the_bound_is_cut_the_same_on_every_node() -> None:
    addresses = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(300)]
    nodes = []
    for seed in (1, 2):
        random.Random(seed).shuffle(addresses)
        client = ResolvingClient([("memcached", 11211)], resolve=FakeDNS(list(addresses)),
                                 make=lambda servers: FakeMemcached(), background=False)
        nodes.append(client.servers())
    assert len(nodes[0]) == MAX_SERVERS and nodes[0] == nodes[1]


def test_a_name_that_never_resolved_is_a_miss_never_a_failed_read(store: tuple[Path, Path]) -> None:
    _, path = store
    catalog = Catalog.open(path, readonly=True)
    client = ResolvingClient([("memcached", 11211)], resolve=FakeDNS(socket.gaierror("no such name")),
                             background=False)  # a real HashClient over no memcached at all
    reader = StoreReader(catalog.source, path)
    level = ClusterLevel(reader, client, 1.0, public=EveryoneReadsNow(reader.root_fd))
    raw = [n for n in catalog.files() if n.served_raw]
    for n in raw:
        assert bytes(level.open(n).data or b"") == (path / str(n.object)).read_bytes()
    assert client.servers() == [] and level.statistics().values()["cluster_hits"] == 0
    level.close()


def test_the_name_is_resolved_again_in_a_thread_of_its_own_until_closed() -> None:
    dns, made = FakeDNS(["10.0.0.1"]), Made()
    client = ResolvingClient([("memcached", 11211)], resolve=dns, make=made, every=0.02)
    try:
        dns.answer = ["10.0.0.1", "10.0.0.2"]
        deadline = time.monotonic() + 10
        while len(client.servers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.servers() == [("10.0.0.1", 11211), ("10.0.0.2", 11211)]
        # the first answer at the mount's start (before it serves), every later one in the resolver's thread
        assert dns.threads[0] == threading.current_thread().name and set(dns.threads[1:]) == {CLUSTER_DNS}
    finally:
        client.close()
    assert not any(t.name == CLUSTER_DNS for t in threading.enumerate())
    asked = len(dns.asked)
    time.sleep(0.1)
    assert len(dns.asked) == asked  # stopped at close


def test_the_systems_resolver_answers_addresses() -> None:
    assert "127.0.0.1" in resolve_addresses("localhost", 11211)


# -- sealed under a cluster key, or only what everyone may read ----------------------------------------------


def _key(seed: int = 1) -> ClusterKey:
    return ClusterKey(random.Random(seed).randbytes(32))


def test_sealed_values_hit_on_another_node_and_hold_none_of_the_objects_bytes(store: tuple[Path, Path]) -> None:
    _, path = store
    first, client, raw = _level(path, key=_key())
    for n in raw:
        first.open(n)
    assert client.sets == len(raw) and first.statistics().values()["cluster_sealed"] == 1
    for n in raw:
        real = (path / str(n.object)).read_bytes()
        value = client.values[key_of(n, _key().id, Sealer(_key()))]
        assert len(value) == len(real) + 28 and real[:64] not in value  # nonce + ciphertext + tag
    second = ClusterLevel(first.inner, client, 1.0, sealer=Sealer(_key()), key_id=_key().id)  # same key
    for n in raw:
        content = second.open(n)
        assert content.level == "cluster" and bytes(content.data or b"") == (path / str(n.object)).read_bytes()
    assert second.statistics().values()["cluster_hits"] == len(raw) and second.statistics().values()["cluster_rejected"] == 0


def test_a_sealed_values_key_shows_nothing_of_its_object(store: tuple[Path, Path]) -> None:
    """Anyone who reaches memcached lists its keys: a sealed value's key named the object's checksum and size,
    which says which known images a job holds and is what a catalog writer copies into a row of theirs. Only a
    name only key holders can make, of the file and its object together."""
    _, path = store
    level, client, raw = _level(path, key=_key())
    for n in raw:
        level.open(n)
    assert len(client.values) == len(raw)
    for key in client.values:
        assert key.startswith(f"liquidfs3s-{_key().id}:")
        assert not any(n.checksum[:16] in key or f":{n.size_served}" in key for n in raw)
    node = raw[0]
    assert key_of(node, _key().id, Sealer(_key())) != key_of(dataclasses.replace(node, path=b"other/" + node.path),
                                                             _key().id, Sealer(_key()))


def test_a_value_not_sealed_under_the_key_for_that_object_is_never_served(store: tuple[Path, Path]) -> None:
    """What a writer without the key can do to a value (change any bytes, keep its length; put another object's
    sealed value, or one sealed under another key, in its place) is a miss, read from storage."""
    _, path = store
    level, client, raw = _level(path, key=_key())
    node, other = raw[0], raw[1]
    level.open(node)
    level.open(other)
    key = key_of(node, _key().id, Sealer(_key()))
    sealed = client.values[key]
    real = (path / str(node.object)).read_bytes()
    foreign = Sealer(_key(2)).seal(key.encode(), real)  # the right identity, another key
    flipped = bytearray(sealed)
    flipped[40] ^= 0x20
    wrongs = [bytes(flipped), sealed[:12] + bytes(len(sealed) - 12), foreign, client.values[key_of(other, _key().id, Sealer(_key()))],
              real + bytes(28), sealed[:-1]]
    for wrong in wrongs:
        client.values[key] = wrong
        content = level.open(node)
        assert content.level == "storage" and bytes(content.data or b"") == real
    st = level.statistics().values()
    assert st["cluster_rejected"] == len(wrongs) and st["cluster_hits"] == 0


def test_a_value_this_node_cannot_open_is_a_miss_never_a_failed_open(store: tuple[Path, Path],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Unsealing that raises (a ``cryptography`` without ``decrypt_into``, on a node of a job whose others have
    it): the open reads storage, as for any value the cluster gets wrong; it failed with EIO. Said once, even
    after a value of other bytes was (both are counted as rejected)."""
    _, path = store
    level, client, raw = _level(path, key=_key())
    node = raw[0]
    level.open(node)  # stored
    assert client.sets == 1
    stored = dict(client.values)

    def cannot(*args: object) -> None:
        raise AttributeError("'AESGCM' object has no attribute 'decrypt_into'")

    with caplog.at_level(logging.WARNING):
        client.values = {key: b"x" * len(value) for key, value in stored.items()}
        level.open(node)  # other bytes: rejected, and said
        client.values = stored
        monkeypatch.setattr(level.sealer, "open", cannot)
        content = level.open(node)
    assert content.level == "storage" and bytes(content.data or b"") == (path / str(node.object)).read_bytes()
    assert level.statistics().values()["cluster_rejected"] == 2
    said = [r.getMessage() for r in caplog.records]
    assert any("with other bytes" in m for m in said) and any("could not be opened" in m for m in said), said


def test_a_catalog_writer_cannot_have_another_files_sealed_value_served_as_theirs(store: tuple[Path, Path]) -> None:
    """A file they may read given, in a catalog they write, another's checksum and size (one they may not read,
    whose sealed value a mount of the job stored): the value is bound to its own file, and does not open."""
    _, path = store
    level, client, raw = _level(path, key=_key())
    theirs, secret = raw[0], raw[1]
    level.open(secret)  # stored, sealed, by a reader allowed to read it
    forged = dataclasses.replace(theirs, checksum=secret.checksum, served_size=secret.served_size)
    content = level.open(forged)
    assert content.level != "cluster" and bytes(content.data or b"") != (path / str(secret.object)).read_bytes()


def _private_store(tmp_path: Path) -> tuple[Path, Path, set[bytes]]:
    """A sample whose one file is 0600 and one city's directory 0700 (before prepare: the catalog records
    them); the paths of the raw-served files nobody else may read."""
    src = tmp_path / "src"
    make_sample(src, count=8, width=64, height=32, seed=4)
    cities = sorted(p for p in (src / "leftImg8bit" / "train").iterdir())
    hidden = cities[0]
    secret = sorted(cities[1].iterdir())[0]
    secret.chmod(0o600)
    hidden.chmod(0o700)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    private = {n.path for n in catalog.files() if n.served_raw
               and (n.path == os.fsencode(secret.relative_to(src)) or n.path.startswith(
                   os.fsencode(hidden.relative_to(src)) + b"/"))}
    catalog.close()
    return src, store, private


def test_without_a_key_only_objects_everyone_may_read_go_to_the_cluster(reachable_tmp: Path) -> None:
    _, path, private = _private_store(reachable_tmp)
    assert len(private) >= 2
    level, client, raw = _level(path)
    for n in raw:
        assert bytes(level.open(n).data or b"") == (path / str(n.object)).read_bytes()
    stored = {n.path for n in raw if key_of(n) in client.values}
    assert stored == {n.path for n in raw} - private and stored
    assert level.statistics().values()["cluster_private"] == len(private)
    client.values.update({key_of(n): (path / str(n.object)).read_bytes() for n in raw})  # offered anyway
    gets = client.gets
    for n in raw:
        content = level.open(n)
        assert (content.level == "cluster") == (n.path not in private)
    assert client.gets - gets == len(raw) - len(private)  # never even asked for
    # With the key, sealed: nobody without it can read them, so they are shared too.
    sealed, sealed_client, _ = _level(path, key=_key())
    for n in raw:
        sealed.open(n)
    assert sealed_client.sets == len(raw) and sealed.statistics().values()["cluster_private"] == 0


def test_a_source_with_acls_of_its_own_shares_nothing_in_the_clear_that_has_no_posix_acl(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An NFSv4 (or SMB) source answers that it supports no POSIX ACL and keeps ACLs of its own, which are not
    read: nothing there is everyone's without a key. The kind is the root descriptor's filesystem's."""
    import liquidfs.held.cluster as cluster_module

    src, _, _ = _private_store(tmp_path)
    root = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert EveryoneReadsNow(root).posix_acls_only  # this machine's ext4 (or tmpfs)
        monkeypatch.setattr(cluster_module, "filesystem_type_of", lambda fd: "nfs4")
        assert not EveryoneReadsNow(root).posix_acls_only
    finally:
        os.close(root)


def test_a_file_closed_to_others_since_the_scan_never_goes_to_the_cluster_in_the_clear(reachable_tmp: Path) -> None:
    """Whether anyone may read a local source is asked of the source as it is: the catalog's modes are its
    writer's word, and a directory closed since the scan (chmod o-x) changes no file's ctime."""
    src, path, private = _private_store(reachable_tmp)
    catalog = Catalog.open(path, readonly=True)
    reader = StoreReader(catalog.source, path)
    client = FakeMemcached()
    level = ClusterLevel(reader, client, 1.0, public=EveryoneReadsNow(reader.root_fd))
    raw = [n for n in catalog.files() if n.served_raw]
    closed = sorted((src / "leftImg8bit" / "train").iterdir())[-1]
    closed.chmod(0o700)  # after the scan: the catalog still says everyone may search it
    now_private = private | {n.path for n in raw if n.path.startswith(os.fsencode(closed.relative_to(src)) + b"/")}
    assert now_private > private
    for n in raw:
        assert bytes(level.open(n).data or b"") == (path / str(n.object)).read_bytes()
    assert {n.path for n in raw if key_of(n) in client.values} == {n.path for n in raw} - now_private
    catalog.close()


def test_a_source_below_a_directory_only_its_owner_may_enter_is_nobody_elses(reachable_tmp: Path) -> None:
    """Others reach a source through every directory above it: one in a home only its owner may enter (0700)
    shares nothing in the clear, whatever the modes below its root say; opened to others' search, it does. As
    the directories are now, at each open."""
    home = reachable_tmp / "home"
    home.mkdir(mode=0o700)
    src = home / "src"
    make_sample(src, count=4, width=64, height=32, seed=5)
    path = home / "store"
    prepare(src, path, 1.0, progress=False)
    level, client, raw = _level(path)
    for n in raw:
        assert bytes(level.open(n).data or b"") == (path / str(n.object)).read_bytes()
    assert client.sets == 0 and level.statistics().values()["cluster_private"] == len(raw)
    home.chmod(0o711)
    for n in raw:
        level.open(n)
    assert client.sets == len(raw)
    home.chmod(0o701)  # others may search, the group may not: not everyone
    assert not level.public(raw[0])  # type: ignore[misc]
