"""The cluster level of held bytes (``mount --cluster memcached://HOST:PORT,... --cluster-size SIZE``): the
memories of the nodes that read one dataset, together, on memcached.

Where a job spans nodes, each runs its own mount and its own memcached beside it. A node's memory cache holds a
C/D share of each epoch for itself; the nodes' memcacheds together hold a fixed share of the dataset's raw objects
for all of them, as CoorDL's partitioned cache does: the objects whose checksum hashes below ``share`` (the
cluster's size over the raw bytes). Every node computes the same set from its catalog without asking anyone, and
pymemcache's ``HashClient`` places each object on one memcached by rendezvous hashing, so a node that joins or
leaves moves only its part. A node's miss in its own memory that the cluster holds is a fetch from a peer's memory,
not a storage read; the first node to read such an object from storage stores it.

Least trust: a memcached answers anyone who reaches it. Only raw objects whose checksum prepare recorded in the
catalog go through it, keyed by that checksum and size (what they hold, never a path), and every value is checked
against both on arrival: a wrong, short or foreign value is a miss, never served. A source changed since the
catalog was taken is checked first, as the store's reader checks it (the original is then served from storage).
Faults cost hits only: timeouts are short, a dead memcached is skipped for a while (``HashClient``'s dead-node
retry) and used again when it answers; no error of the cluster ever fails a read.

Like the disk level (``disktier.DiskTier``), it is a reader in front of the store's (``reader.Reader``), behind the
node's memory level: an open the memory level misses asks it, in a worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from .catalog import Node
from .reader import Content, InFront, Reader, checksum

log = logging.getLogger(__name__)

#: memcached's own default port.
DEFAULT_PORT = 11211
#: Seconds a connection to a memcached, and an answer from one, may take: past them a fetch is a miss (a slow
#: peer must never stall an open by more than a storage read would).
CONNECT_TIMEOUT = 0.2
TIMEOUT = 1.0
#: Seconds a memcached that failed is left out before it is tried again.
DEAD_TIMEOUT = 5.0
_KEY_PREFIX = "liquidfs1"


class ClusterError(ValueError):
    """A --cluster URL that names no usable memcached."""


def parse_cluster(url: str) -> list[tuple[str, int]]:
    """``memcached://HOST[:PORT],HOST[:PORT]...`` as (host, port) pairs."""
    parts = urlsplit(url)
    if parts.scheme != "memcached" or not parts.netloc or parts.path not in ("", "/") or parts.query:
        raise ClusterError(f"--cluster {url!r}: expected memcached://HOST:PORT[,HOST:PORT...]")
    servers = []
    for item in parts.netloc.split(","):
        host, sep, port_text = item.strip().rpartition(":")
        if not sep or host.endswith(":"):  # no port given (or a bare IPv6 address, which needs [brackets]:PORT)
            host, port_text = item.strip(), str(DEFAULT_PORT)
        host = host.removeprefix("[").removesuffix("]")
        port = int(port_text) if port_text.isdigit() else 0
        if not host or not 0 < port < 65536 or any(c.isspace() or c in "/@" for c in host):
            raise ClusterError(f"--cluster {url!r}: {item!r} is not HOST:PORT")
        servers.append((host, port))
    if len(set(servers)) != len(servers):
        raise ClusterError(f"--cluster {url!r} names a memcached twice")
    return servers


class Client(Protocol):
    """What the level asks of memcached (pymemcache's ``HashClient``; a fake in unit tests)."""

    def get(self, key: str) -> Any: ...

    def set(self, key: str, value: bytes, expire: int = 0, noreply: bool | None = None) -> Any: ...

    def close(self) -> None: ...


def memcached_client(servers: Iterable[tuple[str, int]]) -> Client:
    """pymemcache's ``HashClient`` over ``servers``: rendezvous hashing, short timeouts, errors as misses."""
    from pymemcache.client.hash import HashClient

    client: Client = HashClient(list(servers), connect_timeout=CONNECT_TIMEOUT, timeout=TIMEOUT, ignore_exc=True,
                                use_pooling=True, retry_attempts=1, retry_timeout=1, dead_timeout=DEAD_TIMEOUT,
                                no_delay=True)
    return client


def in_share(node: Node, share: float) -> bool:
    """Whether ``node``'s raw object is the cluster's: its checksum, prepare's, hashed below ``share`` (the same
    answer on every node of the job, from its catalog alone)."""
    if not (node.served_raw and node.checksum and node.size_served):
        return False
    try:
        point = int(node.checksum[:8], 16) / 0x1_0000_0000
    except ValueError:
        return False
    return point < share


def key_of(node: Node) -> str:
    """What the object holds, never where it is: prepare's checksum of its bytes and their size."""
    assert node.checksum is not None
    return f"{_KEY_PREFIX}:{node.checksum}:{node.size_served}"


@dataclass
class ClusterCounts:
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    stored: int = 0
    stored_bytes: int = 0
    rejected: int = 0  # values that were not the object the key names: never served
    unanswered: int = 0  # fetches or stores a memcached did not answer (a miss)


class ClusterTier(InFront):
    """A reader in front of ``inner`` that fetches the cluster's share of raw objects from memcached."""

    def __init__(self, inner: Reader, client: Client, share: float) -> None:
        super().__init__(inner)
        self.client = client
        self.share = max(0.0, min(1.0, share))
        self.counts = ClusterCounts()
        self._lock = threading.Lock()

    # -- the reader interface (the rest: ``InFront``'s) ------------------------------------------------------

    def open(self, node: Node) -> Content:
        if not in_share(node, self.share):
            return self.inner.open(node)
        if self.inner.check_source(node) is None:
            fetched = self._fetch(node)
            if fetched is not None:
                return Content(size=len(fetched), raw=True, data=memoryview(fetched), tier="cluster")
        content = self.inner.open(node)
        if content.raw and content.data is not None and not content.fallback and content.size == node.size_served:
            self._store(node, content.data)
        return content

    def vouch(self, node: Node, *, cached_only: bool = False) -> bool | None:
        # A vouched file is read at its first read (``Content.deferred``), which the cluster is not asked for:
        # the cluster's files are read at open.
        if in_share(node, self.share):
            return False
        return super().vouch(node, cached_only=cached_only)

    def close(self) -> None:
        """At unmount: its connections closed (the reader behind it is its owner's to close, as with the disk
        level)."""
        try:
            self.client.close()
        except Exception as exc:  # a client that cannot close its sockets costs nothing at unmount
            log.debug("closing the memcached client: %s", exc)

    # -- memcached ---------------------------------------------------------------------------------------

    def _fetch(self, node: Node) -> bytes | None:
        try:
            value = self.client.get(key_of(node))
        except Exception as exc:  # ignore_exc covers the client's own; anything else is a miss too
            log.debug("cluster: fetching %s: %s", key_of(node), exc)
            value = None
            with self._lock:
                self.counts.unanswered += 1
        if value is None:
            with self._lock:
                self.counts.misses += 1
            return None
        if not isinstance(value, bytes) or len(value) != node.size_served or checksum(value) != node.checksum:
            with self._lock:
                self.counts.rejected += 1
                self.counts.misses += 1
                first = self.counts.rejected == 1
            if first:
                log.warning("cluster: a memcached answered %s with other bytes; read from storage instead (further "
                            "ones are counted as cluster_rejected)", key_of(node))
            return None
        with self._lock:
            self.counts.hits += 1
            self.counts.hit_bytes += len(value)
        return value

    def _store(self, node: Node, data: memoryview) -> None:
        try:
            done = self.client.set(key_of(node), bytes(data), noreply=False)
        except Exception as exc:
            log.debug("cluster: storing %s: %s", key_of(node), exc)
            done = False
        with self._lock:
            if done:
                self.counts.stored += 1
                self.counts.stored_bytes += len(data)
            else:
                self.counts.unanswered += 1

    # -- statistics ----------------------------------------------------------------------------------------

    def statistics(self) -> dict[str, object]:
        with self._lock:
            c = self.counts
            return {"cluster_share": self.share, "cluster_hits": c.hits, "cluster_hit_bytes": c.hit_bytes,
                    "cluster_misses": c.misses, "cluster_stored": c.stored, "cluster_stored_bytes": c.stored_bytes,
                    "cluster_rejected": c.rejected, "cluster_unanswered": c.unanswered}
