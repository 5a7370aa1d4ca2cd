"""The cluster level on real memcacheds (Debian's, two on loopback ports, as two nodes would run one each) and
two real mounts of one dataset (issue 29): a node's miss that the other node read is a fetch from memcached,
byte-exact; a memcached killed costs hits, never a read or a wrong byte, and is used again once it is back. A
--cluster name (``localhost`` here, a headless Service's in Kubernetes) is resolved to the memcacheds behind it.
Issue 38: with --cluster-key-file a value rewritten by anyone without the key is never served, and what memcached
holds is not the dataset's bytes; without one, an image others may not read never goes to memcached."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from fusehelpers import Mount, wait_for
from memcacheds import memcached_binary  # noqa: F401  (a fixture)
from ports import free_port
from liquidfs.catalog.catalog import Catalog
from liquidfs.held.cluster_peers import resolve_addresses
from liquidfs.held.memcached import SKIP_FOR, MemcachedWire
from liquidfs.daemon.build import CLUSTER_USABLE, cluster_size_from_limits
from liquidfs.daemon.control import read_control
from liquidfs.prepare import prepare
from sample import make_sample

pytestmark = pytest.mark.fuse



class Memcached:
    """One memcached on 127.0.0.1, started and killed by the test."""

    def __init__(self, binary: str, listen: Sequence[str] = ("127.0.0.1",)) -> None:
        self.binary = binary
        self.listen = listen
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # -I: items up to 8 MB (a Cityscapes BMP is 6.3 MB); -u root: memcached refuses to run as root otherwise
        listen = [arg for a in self.listen for arg in ("-l", f"[{a}]:{self.port}" if ":" in a else a)]
        self.proc = subprocess.Popen([self.binary, *listen, "-p", str(self.port), "-U", "0", "-m", "64",
                                      "-I", "8m", "-u", "root"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"version\r\n")
                    return conn.recv(64).startswith(b"VERSION")
            except OSError:
                return False

        wait_for(answers, 20, what=f"memcached on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def memcacheds(memcached_binary: str) -> Iterator[list[Memcached]]:
    servers = [Memcached(memcached_binary), Memcached(memcached_binary)]
    for server in servers:
        server.start()
    try:
        yield servers
    finally:
        for server in servers:
            server.kill()



def _all_raw(tmp_path: Path, *, count: int, width: int, height: int, seed: int) -> tuple[Path, Path, dict[str, bytes]]:
    """A sample prepared all raw: (source, store, each raw-served file's path -> its raw object's bytes). Without
    a cluster key only a source every user may reach is shared: ``tmp_path`` is then ``reachable_tmp``."""
    src = tmp_path / "src"
    make_sample(src, count=count, width=width, height=height, seed=seed)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    raw = {os.fsdecode(n.path): (store / str(n.object)).read_bytes() for n in catalog.files() if n.served_raw}
    catalog.close()
    return src, store, raw


def test_a_node_hits_what_another_read_and_a_killed_memcached_costs_only_hits(reachable_tmp: Path, mounter: Mount,
                                                                          memcacheds: list[Memcached]) -> None:
    src, store, raw = _all_raw(reachable_tmp, count=12, width=256, height=128, seed=29)
    assert len(raw) >= 8
    url = "memcached://" + ",".join(f"127.0.0.1:{m.port}" for m in memcacheds)
    node_a = mounter.mount(src, "--cluster", url, "--cluster-size", "100%", store=store)
    node_b = mounter.mount(src, "--cluster", url, "--cluster-size", "100%", store=store)

    def epoch(node: Path) -> None:
        for rel, want in raw.items():
            assert (node / rel).read_bytes() == want, rel

    epoch(node_a)  # node A reads everything from storage and gives the cluster its share (all of it here)
    a = read_control(node_a)
    assert a["cluster_share"] == 1.0 and a["cluster_stored"] == len(raw) and a["cluster_hits"] == 0
    epoch(node_b)  # node B's misses in its own memory are fetches from the memcacheds, byte-exact
    b = read_control(node_b)
    assert b["cluster_hits"] == len(raw) and b["cluster_hit_bytes"] == sum(map(len, raw.values()))
    # served from a peer, not storage: its own row of the bytes served
    assert b["bytes_from_cluster"] == b["cluster_hit_bytes"] and b["bytes_from_storage"] == 0
    assert b["cluster_rejected"] == 0 and b["errors"] == 0

    memcacheds[0].kill()  # mid-epoch: one node's memcached gone
    epoch(node_b)
    b2 = read_control(node_b)
    lost = len(raw) - (b2["cluster_hits"] - b["cluster_hits"])
    assert 0 < lost < len(raw), "rendezvous hashing put every object on one memcached"  # the other still hits
    assert b2["errors"] == 0 and b2["fallbacks"] == 0

    memcacheds[0].start()  # back, empty: used again once it is no longer left out
    time.sleep(SKIP_FOR + 1)
    epoch(node_a)
    epoch(node_b)
    a2, b3 = read_control(node_a), read_control(node_b)
    assert a2["cluster_stored"] > a["cluster_stored"]  # node A gave the restarted memcached its share again
    assert b3["cluster_hits"] - b2["cluster_hits"] == len(raw), (a2, b3)
    assert a2["errors"] == b3["errors"] == 0


def test_without_cluster_size_the_mount_holds_what_the_memcacheds_say_they_hold(reachable_tmp: Path, mounter: Mount,
                                                                             memcacheds: list[Memcached]) -> None:
    """No --cluster-size: the size is the smaller of the memcacheds' limit_maxbytes together (less their overhead)
    and the raw objects' bytes, told in ``liquidfs stats``; a cluster where no memcached answers is refused at
    mount, naming the flag to give."""
    src, store, raw = _all_raw(reachable_tmp, count=6, width=128, height=64, seed=31)
    wire = MemcachedWire([("127.0.0.1", server.port) for server in memcacheds])
    assert wire.limits() == {f"127.0.0.1:{server.port}": 64 * 2**20 for server in memcacheds}  # their -m 64
    wire.close()
    assert cluster_size_from_limits({"a": 64 * 2**20, "b": 64 * 2**20}, 10**12) == int(128 * 2**20 * CLUSTER_USABLE)
    url = "memcached://" + ",".join(f"127.0.0.1:{m.port}" for m in memcacheds)
    node = mounter.mount(src, "--cluster", url, store=store)
    said = read_control(node)
    raw_bytes = sum(map(len, raw.values()))
    assert said["cluster_bytes"] == raw_bytes and said["cluster_share"] == 1.0  # the raw objects are the smaller
    assert said["cluster_size_from"] == "the memcacheds' stats"
    for rel, want in raw.items():
        assert (node / rel).read_bytes() == want, rel
    assert read_control(node)["cluster_stored"] == len(raw)

    memcacheds[0].kill()
    memcacheds[1].kill()
    with pytest.raises(AssertionError, match="no memcached told its size"):
        mounter.mount(src, "--cluster", url, store=store)


def test_a_cluster_named_by_a_dns_name_reaches_the_memcacheds_it_resolves_to(reachable_tmp: Path, mounter: Mount,
                                                                             memcached_binary: str) -> None:
    src, store, raw = _all_raw(reachable_tmp, count=6, width=128, height=64, seed=30)
    # One memcached on every address localhost has here (127.0.0.1, ::1 where it is listed): each is a server of
    # the client, and each must answer for every object to be a hit.
    server = Memcached(memcached_binary, listen=sorted(set(resolve_addresses("localhost", 0))))
    server.start()
    try:
        url = f"memcached://localhost:{server.port}"
        node_a = mounter.mount(src, "--cluster", url, "--cluster-size", "100%", store=store)
        node_b = mounter.mount(src, "--cluster", url, "--cluster-size", "100%", store=store)
        for node in (node_a, node_b):
            for rel, want in raw.items():
                assert (node / rel).read_bytes() == want, rel
        a, b = read_control(node_a), read_control(node_b)
        assert a["cluster_stored"] == len(raw) and a["cluster_unanswered"] == 0
        assert b["cluster_hits"] == len(raw) and b["errors"] == 0 and b["cluster_rejected"] == 0
    finally:
        server.kill()


# -- issue 38: sealed values, and images others may not read -------------------------------------------------


def _ask(port: int, command: bytes, end: bytes) -> bytes:
    """One command to the memcached on ``port`` as any client may send it (no key, no liquidfs): its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(command)
        answer = b""
        while not answer.endswith(end):
            chunk = conn.recv(1 << 20)
            assert chunk, f"memcached closed the connection after {answer[-200:]!r}"
            answer += chunk
    return answer


def _keys(server: Memcached) -> list[str]:
    """Every key the memcached holds, as anyone who reaches it lists them."""
    dump = _ask(server.port, b"lru_crawler metadump all\r\n", b"END\r\n")
    return [urllib.parse.unquote(field.removeprefix("key="))
            for line in dump.decode().splitlines() for field in line.split() if field.startswith("key=")]


def _get(server: Memcached, key: str) -> bytes | None:
    answer = _ask(server.port, b"get " + key.encode() + b"\r\n", b"END\r\n")
    if answer == b"END\r\n":
        return None
    header, _, rest = answer.partition(b"\r\n")
    return rest[:int(header.split()[3])]


def _set(server: Memcached, key: str, value: bytes) -> None:
    assert _ask(server.port, b"set %s 0 0 %d\r\n%s\r\n" % (key.encode(), len(value), value), b"\r\n") == \
        b"STORED\r\n"


def _key_file(tmp_path: Path) -> Path:
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o400)
    return key


def test_a_value_rewritten_without_the_key_is_never_served(tmp_path: Path, mounter: Mount,
                                                           memcached_binary: str) -> None:
    """As the issue reproduced it: anyone who reaches memcached lists its keys, reads a value, changes bytes of it
    (the length kept) and stores it back. A node with the key rejects it and serves the store's bytes."""
    src, store, raw = _all_raw(tmp_path, count=6, width=128, height=64, seed=38)
    server = Memcached(memcached_binary)
    server.start()
    try:
        url, key = f"memcached://127.0.0.1:{server.port}", _key_file(tmp_path)
        node_a = mounter.mount(src, "--cluster", url, "--cluster-size", "100%", "--cluster-key-file", str(key),
                               store=store)
        node_b = mounter.mount(src, "--cluster", url, "--cluster-size", "100%", "--cluster-key-file", str(key),
                               store=store)
        for rel, want in raw.items():
            assert (node_a / rel).read_bytes() == want
        a = read_control(node_a)
        assert a["cluster_stored"] == len(raw) and a["cluster_sealed"] == 1
        keys = _keys(server)
        assert len(keys) == len(raw)
        for name in keys:  # what memcached holds is not the dataset's bytes: readable by key holders only
            value = _get(server, name)
            assert value is not None and not any(want[100:164] in value for want in raw.values())
        victim = keys[0]
        value = bytearray(_get(server, victim) or b"")
        value[40:640] = b"\xff" * 600  # painted white, its length kept
        _set(server, victim, bytes(value))
        for rel, want in raw.items():
            assert (node_b / rel).read_bytes() == want, rel  # never the painted bytes
        b = read_control(node_b)
        assert b["cluster_rejected"] == 1 and b["cluster_hits"] == len(raw) - 1 and b["errors"] == 0
        assert b["bytes_from_storage"] > 0  # the rejected one: from the store
    finally:
        server.kill()


def test_without_a_key_an_image_others_may_not_read_never_goes_to_memcached(reachable_tmp: Path, mounter: Mount,
                                                                            memcached_binary: str) -> None:
    src = reachable_tmp / "src"
    make_sample(src, count=8, width=128, height=64, seed=39)
    for path in [src, *src.rglob("*")]:  # whatever the umask: everyone may read the tree but what is made private
        path.chmod(0o755 if path.is_dir() else 0o644)
    cities = sorted((src / "leftImg8bit" / "train").iterdir())
    secret = sorted(cities[1].iterdir())[0]
    secret.chmod(0o600)  # a 0600 image
    cities[0].chmod(0o700)  # and a 0700 directory of images
    store = reachable_tmp / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    nodes = [n for n in catalog.files() if n.served_raw]
    catalog.close()
    private = {n.checksum for n in nodes if (src / os.fsdecode(n.path)) == secret
               or (src / os.fsdecode(n.path)).parent == cities[0]}
    assert len(private) >= 2 and len(private) < len(nodes)
    server = Memcached(memcached_binary)
    server.start()
    try:
        node = mounter.mount(src, "--cluster", f"memcached://127.0.0.1:{server.port}", "--cluster-size", "100%",
                             store=store)
        for n in nodes:  # read by root, who may read them all
            assert (node / os.fsdecode(n.path)).read_bytes() == (store / str(n.object)).read_bytes()
        held = " ".join(_keys(server))
        assert not [c for c in private if c and c in held], "an image others may not read is in memcached"
        assert all(n.checksum in held for n in nodes if n.checksum not in private)  # the rest are shared
        stats = read_control(node)
        assert stats["cluster_private"] == len(private) and stats["cluster_sealed"] == 0
        assert stats["cluster_stored"] == len(nodes) - len(private)
    finally:
        server.kill()
