"""The cluster level on real memcacheds (Debian's, two on loopback ports, as two nodes would run one each) and
two real mounts of one dataset (issue 29): a node's miss that the other node read is a fetch from memcached,
byte-exact; a memcached killed costs hits, never a read or a wrong byte, and is used again once it is back. A
--cluster name (``localhost`` here, a headless Service's in Kubernetes) is resolved to the memcacheds behind it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from fusehelpers import Mount, wait_for
from ports import free_port
from liquidfs.catalog import Catalog
from liquidfs.clustertier import DEAD_TIMEOUT, resolve_addresses
from liquidfs.mount import read_control
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
def memcached_binary() -> str:
    binary = shutil.which("memcached") or shutil.which("memcached", path="/usr/bin:/usr/sbin")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("memcached not installed (scripts/test.sh installs it with apt)")
        pytest.skip("memcached not installed (apt-get install memcached)")
    return binary


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
    """A sample prepared all raw: (source, store, each raw-served file's path -> its raw object's bytes)."""
    src = tmp_path / "src"
    make_sample(src, count=count, width=width, height=height, seed=seed)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    raw = {os.fsdecode(n.path): (store / str(n.object)).read_bytes() for n in catalog.files() if n.served_raw}
    catalog.close()
    return src, store, raw


def test_a_node_hits_what_another_read_and_a_killed_memcached_costs_only_hits(tmp_path: Path, mounter: Mount,
                                                                          memcacheds: list[Memcached]) -> None:
    src, store, raw = _all_raw(tmp_path, count=12, width=256, height=128, seed=29)
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

    memcacheds[0].start()  # back, empty: used again once the client's dead-node wait is over
    time.sleep(DEAD_TIMEOUT + 1)
    epoch(node_a)
    epoch(node_b)
    a2, b3 = read_control(node_a), read_control(node_b)
    assert a2["cluster_stored"] > a["cluster_stored"]  # node A gave the restarted memcached its share again
    assert b3["cluster_hits"] - b2["cluster_hits"] == len(raw), (a2, b3)
    assert a2["errors"] == b3["errors"] == 0


def test_a_cluster_named_by_a_dns_name_reaches_the_memcacheds_it_resolves_to(tmp_path: Path, mounter: Mount,
                                                                             memcached_binary: str) -> None:
    src, store, raw = _all_raw(tmp_path, count=6, width=128, height=64, seed=30)
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
