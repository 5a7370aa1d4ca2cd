"""The cluster level of held bytes (``mount --cluster memcached://HOST:PORT,... --cluster-size SIZE``): the
memories of the nodes that read one dataset, together, on memcached.

Where a job spans nodes, each runs its own mount and its own memcached beside it. A node's memory cache holds a
C/D share of each epoch for itself; the nodes' memcacheds together hold a fixed share of the dataset's raw objects
for all of them, as CoorDL's partitioned cache does: the objects whose checksum hashes below ``share`` (the
cluster's size over the raw bytes). Every node computes the same set from its catalog without asking anyone, and
rendezvous hashing places each object on one memcached, so a node that joins or leaves moves only its part. A
node's miss in its own memory that the cluster holds is a fetch from a peer's memory, not a storage read; the first
node to read such an object from storage stores it.

Least trust: a memcached answers anyone who reaches it, and anyone may store anything there. With a cluster key
(``--cluster-key-file``, ``sealing``) every value is sealed with authenticated encryption bound to the object's
identity: a value that does not open was not stored by a mount of this job for this object, and is a miss; and
only key holders can read one. Without a key, values are the object's bytes in the clear, checked against the
catalog's checksum (which vouches for nothing a writer can choose where the checksum is not cryptographic), and
only objects whose source anyone may read go there at all (``EveryoneReads``). Either way a value is also checked
against the catalog's checksum and size, so a wrong, short or foreign value is a miss, never served; and a source
changed since the catalog was taken is checked first, as the store's reader checks it (the original is then served
from storage). Faults cost hits only: every call to a memcached has one deadline for all of it and buffers no more
than the object (``memcachedwire``), a memcached that fails repeatedly is left out for a while, and no error of the
cluster ever fails a read.

A HOST that is a DNS name (a Kubernetes headless Service: one address per memcached pod) stands for every address
it resolves to, and is resolved again every ``RESOLVE_EVERY`` seconds in a daemon thread of its own, so a node that
joins or leaves is picked up, and with rendezvous hashing only its share moves. What resolution returns is trusted
no more than a memcached: addresses only, at most ``MAX_SERVERS``; a name that resolves to nothing usable keeps its
last good set. A literal address is used as given, never resolved.

Like the disk level (``disktier.DiskTier``), it is a reader in front of the store's (``reader.Reader``), behind the
node's memory level: an open the memory level misses asks it, in a worker thread.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from .catalog import Node
from .memcachedwire import TIMEOUT, MemcachedWire, PeerError, Skipped, WrongLength
from .reader import Content, InFront, Reader, check_raw
from .sealing import OVERHEAD, Sealer

log = logging.getLogger(__name__)

#: memcached's own default port.
DEFAULT_PORT = 11211
#: The format of what is stored (2: sealed values, or plaintext only of sources anyone may read): in every key, so
#: mounts of another format never read these values, nor these mounts theirs.
_KEY_PREFIX = "liquidfs2"
#: The share of ``--io-timeout`` one call to a memcached may take at most: an open that misses the cluster still
#: reads storage, and stores what it read, within the same timeout.
IO_TIMEOUT_SHARE = 0.25
#: Seconds between two resolutions of a --cluster name: how soon a memcached that joins or leaves is used or left.
RESOLVE_EVERY = 30.0
#: Seconds between two tries of a name that has never resolved yet: until it does, every open is a miss.
RESOLVE_RETRY = 5.0
#: The most memcacheds a client keeps: a DNS answer is not trusted to size its connection pools.
MAX_SERVERS = 64

#: ``resolve(host, port)``: the addresses of ``host`` (anything else in the answer is dropped).
Resolve = Callable[[str, int], list[str]]


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


def call_timeout(io_timeout: float) -> float:
    """Seconds one call to a memcached may take in all under ``--io-timeout``: never more than a share of it, so an
    open that misses still has the rest to read storage and store what it read (all in one storage call)."""
    return min(TIMEOUT, io_timeout * IO_TIMEOUT_SHARE)


class Client(Protocol):
    """What the level asks of memcached (``memcachedwire.MemcachedWire``; a fake in unit tests). ``get`` and
    ``set`` raise ``memcachedwire.PeerError`` where a memcached does not answer as one, in time."""

    def get(self, key: str, length: int) -> bytearray | bytes | None: ...

    def set(self, key: str, value: bytes | bytearray | memoryview) -> bool: ...

    def close(self) -> None: ...


def hash_client(servers: Iterable[tuple[str, int]], *, timeout: float = TIMEOUT) -> MemcachedWire:
    """A client over ``servers`` (addresses): rendezvous hashing, each call within ``timeout`` seconds in all."""
    return MemcachedWire(list(servers), timeout=timeout)


def memcached_client(servers: Iterable[tuple[str, int]], *, timeout: float = TIMEOUT, resolve: Resolve | None = None,
                     every: float = RESOLVE_EVERY) -> Client:
    """The client of ``--cluster``: one over ``servers`` as given where all are addresses, else one over what
    their names resolve to, resolved again every ``every`` seconds (``ResolvingClient``)."""
    servers = list(servers)
    if all(literal(host) for host, _ in servers):
        return hash_client(((literal(host) or host, port) for host, port in servers), timeout=timeout)
    return ResolvingClient(servers, resolve=resolve or resolve_addresses, every=every,
                           make=lambda found: hash_client(found, timeout=timeout))


def literal(host: str) -> str | None:
    """``host`` written as pymemcache keys it if it is an IP address, else None (a name)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses a TCP connection to ``host``:``port`` may go to, as the system's resolver answers (a headless
    Service's name: one per ready pod)."""
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                            proto=socket.IPPROTO_TCP)]


def usable_addresses(answer: object) -> tuple[list[str], int]:
    """Of a resolver's ``answer``, the unicast IP addresses, canonical, sorted and at most ``MAX_SERVERS`` (the
    same cut on every node that got the same answer); and how many items were dropped."""
    items = list(answer) if isinstance(answer, (list, tuple)) else []
    found: dict[str, ipaddress.IPv4Address | ipaddress.IPv6Address] = {}
    dropped = 0
    for item in items:
        address = literal(item) if isinstance(item, str) else None
        ip = ipaddress.ip_address(address) if address is not None else None
        if address is None or ip is None or ip.is_unspecified or ip.is_multicast:
            dropped += 1
        else:
            found[address] = ip  # the same address twice (one per socket type, say) is one memcached
    ordered = sorted(found, key=lambda a: (found[a].version, found[a]))
    return ordered[:MAX_SERVERS], dropped + max(0, len(ordered) - MAX_SERVERS)


class ResolvingClient:
    """A client over the addresses the names of ``--cluster`` resolve to, rebuilt when they change.

    Rebuilt rather than changed in place: a memcached gone from DNS must stay gone, with its connections. Rendezvous
    hashing places a key
    from the set alone, so a new client over one more (or one fewer) address moves only that address's keys. The
    swap is one assignment, safe against the worker threads that fetch; a fetch in flight on the old client is a
    miss at worst."""

    def __init__(self, servers: Iterable[tuple[str, int]], *, resolve: Resolve = resolve_addresses,
                 every: float = RESOLVE_EVERY, make: Callable[[list[tuple[str, int]]], Client] = hash_client,
                 background: bool = True) -> None:
        servers = list(servers)
        self._fixed = [(address, port) for host, port in servers if (address := literal(host)) is not None]
        self._names = [(host, port) for host, port in servers if literal(host) is None]
        self._resolve = resolve
        self._make = make
        self.every = every
        self._last: dict[tuple[str, int], list[str]] = {}  # a name's last good addresses
        self._failing: set[tuple[str, int]] = set()  # names whose failure was logged (once, until they resolve)
        self._capped = False  # whether the names' addresses together past MAX_SERVERS were logged
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        # The first resolution before the mount serves (mount start, never the trio loop), so its first reads
        # already use every memcached; then in a daemon thread, off every read's path.
        self._servers = self._wanted()
        self._client = make(self._servers)
        log.info("cluster: %d memcacheds: %s", len(self._servers), ", ".join(f"{h}:{p}" for h, p in self._servers))
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="liquidfs-cluster-dns", daemon=True)
            self._thread.start()

    # -- the client interface --------------------------------------------------------------------------------

    def get(self, key: str, length: int) -> bytearray | bytes | None:
        return self._client.get(key, length)

    def set(self, key: str, value: bytes | bytearray | memoryview) -> bool:
        return self._client.set(key, value)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a resolution stuck in getaddrinfo must not hold the unmount
        with self._swap_lock:  # after a swap in flight, if any: the client closed is the last one
            client = self._client
        client.close()

    # -- resolution --------------------------------------------------------------------------------------

    def servers(self) -> list[tuple[str, int]]:
        """The memcacheds in use now."""
        return list(self._servers)

    def refresh(self) -> bool:
        """Resolve every name again; a new client where the set changed. Whether it changed. Never raises.
        Called from one thread at a time (the constructor, then the daemon thread; a unit test instead)."""
        wanted = self._wanted()
        # Resolution outside the lock: close takes it, and a getaddrinfo that hangs must not hold the unmount.
        with self._swap_lock:
            if wanted == self._servers:
                return False
            joined = sorted(set(wanted) - set(self._servers))
            left = sorted(set(self._servers) - set(wanted))
            if self._stop.is_set():  # closed meanwhile: a new client would never be closed
                return False
            try:
                client = self._make(wanted)
            except Exception as exc:  # the old set keeps serving; the next round tries again
                log.warning("cluster: a client over %d memcacheds: %s", len(wanted), exc)
                return False
            old, self._client, self._servers = self._client, client, wanted
            log.info("cluster: %d memcacheds%s%s", len(wanted),
                     "; joined " + ", ".join(f"{h}:{p}" for h, p in joined) if joined else "",
                     "; left " + ", ".join(f"{h}:{p}" for h, p in left) if left else "")
        try:
            old.close()
        except Exception as exc:  # its sockets go with it anyway
            log.debug("cluster: closing the previous client: %s", exc)
        return True

    def _wanted(self) -> list[tuple[str, int]]:
        """The memcacheds the names resolve to now (or last did), with the literal ones, sorted."""
        wanted = sorted(set(self._fixed) | {(a, port) for (name, port) in self._names
                                            for a in self._lookup(name, port)})
        if len(wanted) > MAX_SERVERS:
            if not self._capped:
                self._capped = True
                log.warning("cluster: %d memcacheds, more than %d; the first %d are used", len(wanted), MAX_SERVERS,
                            MAX_SERVERS)
            wanted = wanted[:MAX_SERVERS]
        return wanted

    def _lookup(self, name: str, port: int) -> list[str]:
        """``name``'s addresses now, or its last good ones where resolution fails or answers nothing usable."""
        try:
            answer: object = self._resolve(name, port)
        except Exception as exc:  # socket.gaierror, a timeout, a resolver's bug: never into a read
            answer, error = [], str(exc)
        else:
            error = "no address"
        addresses, dropped = usable_addresses(answer)
        key = (name, port)
        if not addresses:
            if key not in self._failing:
                self._failing.add(key)
                log.warning("cluster: %s resolves to no usable address (%s); keeping its last %d", name, error,
                            len(self._last.get(key, [])))
            return self._last.get(key, [])
        if key in self._failing:
            self._failing.discard(key)
            log.info("cluster: %s resolves again", name)
        if dropped and self._last.get(key) != addresses:
            log.warning("cluster: %s: %d items of its answer dropped (not addresses, or past %d)", name, dropped,
                        MAX_SERVERS)
        self._last[key] = addresses
        return addresses

    def _run(self) -> None:
        while not self._stop.wait(self.every if len(self._last) == len(self._names) else
                                  min(self.every, RESOLVE_RETRY)):
            try:
                self.refresh()
            except Exception:  # never: refresh catches what it expects; a bug must not end the re-resolution
                log.exception("cluster: re-resolving")


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


def key_of(node: Node, keyed: str = "") -> str:
    """What the object holds, never where it is: prepare's checksum of its bytes and their size; ``keyed``: the
    id of the cluster key its values are sealed under ("" for plaintext), so two jobs of different keys sharing a
    memcached each keep their own values."""
    assert node.checksum is not None
    prefix = f"{_KEY_PREFIX}s-{keyed}" if keyed else _KEY_PREFIX
    return f"{prefix}:{node.checksum}:{node.size_served}"


class EveryoneReads:
    """Whether anyone may read a file's source as the catalog recorded it: others may read the file (o+r) and
    search every directory above it in the catalog (o+x). Without a cluster key only such objects go to the cluster:
    memcached has no authentication, so what it holds in the clear is readable by anyone who reaches it.

    ``directory(id)``: a directory's node (``Catalog.get``). Each directory is looked up once (a dataset has few)."""

    def __init__(self, directory: Callable[[int], Node | None]) -> None:
        self._directory = directory
        self._searchable: dict[int, bool] = {}
        self._lock = threading.Lock()  # one lookup of the catalog at a time, from the level's worker threads

    def __call__(self, node: Node) -> bool:
        return bool(node.mode & stat.S_IROTH) and self._searchable_to(node.parent)

    def _searchable_to(self, dir_id: int) -> bool:
        """Whether others may search ``dir_id`` and every directory above it."""
        with self._lock:
            walked: list[int] = []
            answer = False
            while (known := self._searchable.get(dir_id)) is None:
                found = self._directory(dir_id)
                if found is None or dir_id in walked:  # a catalog that is not a tree shares nothing
                    break
                walked.append(dir_id)
                if not found.mode & stat.S_IXOTH:
                    break
                if found.parent == dir_id:  # the root
                    answer = True
                    break
                dir_id = found.parent
            else:
                answer = known
            for walked_id in walked:
                self._searchable[walked_id] = answer
            return answer


@dataclass
class ClusterCounts:
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    stored: int = 0
    stored_bytes: int = 0
    rejected: int = 0  # values that were not the object the key names (or did not open under the key): never served
    unanswered: int = 0  # fetches or stores a memcached did not answer as one, in time (a miss)
    skipped: int = 0  # fetches or stores not tried: their memcached failed repeatedly and is left out for a while
    private: int = 0  # opens of the share kept out of the cluster: no key, and not everyone may read the source


class ClusterTier(InFront):
    """A reader in front of ``inner`` that fetches the cluster's share of raw objects from memcached.

    ``sealer``: the job's cluster key (every value sealed and opened with it); None: plaintext values, and only
    objects that ``public`` says anyone may read."""

    def __init__(self, inner: Reader, client: Client, share: float, *, sealer: Sealer | None = None,
                 key_id: str = "", public: Callable[[Node], bool] | None = None) -> None:
        super().__init__(inner)
        self.client = client
        self.share = max(0.0, min(1.0, share))
        self.sealer = sealer
        self.key_id = key_id if sealer is not None else ""
        self.public = public
        self.counts = ClusterCounts()
        self._lock = threading.Lock()
        self._warned: set[str] = set()  # what was logged once (further ones are counted)

    # -- the reader interface (the rest: ``InFront``'s) ------------------------------------------------------

    def open(self, node: Node) -> Content:
        if not in_share(node, self.share):
            return self.inner.open(node)
        if self.sealer is None and not (self.public is not None and self.public(node)):
            self._count("private", f"cluster: {node.path!r} is not readable by everyone: without "
                        "--cluster-key-file such objects never go to the cluster (counted as cluster_private)")
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

    def _fetch(self, node: Node) -> bytearray | bytes | None:
        key = key_of(node, self.key_id)
        length = node.size_served + (OVERHEAD if self.sealer is not None else 0)
        try:
            value = self.client.get(key, length)
        except WrongLength as exc:
            self._count("rejected", f"cluster: a memcached answered {key} with other bytes ({exc}); read from "
                        "storage instead (further ones are counted as cluster_rejected)")
            value = None
        except Skipped:
            self._count("skipped")
            value = None
        except Exception as exc:  # PeerError, or anything else: never into a read
            log.debug("cluster: fetching %s: %s", key, exc)
            self._count("unanswered")
            value = None
        if value is not None:
            value = self._opened(node, key, value)
        if value is None:
            self._count("misses")
            return None
        with self._lock:
            self.counts.hits += 1
            self.counts.hit_bytes += len(value)
        return value

    def _opened(self, node: Node, key: str, value: object) -> bytearray | bytes | None:
        """The object's bytes in ``value``, or None (counted as rejected) where it is not exactly them."""
        opened: bytearray | bytes | None = None
        why = "not bytes"
        if isinstance(value, (bytes, bytearray)):
            opened = self.sealer.open(key.encode(), value) if self.sealer is not None else value
            why = "it does not open under the cluster key"
        # Checked against the catalog even when sealed: a mount that holds the key is not trusted to vouch for
        # bytes the catalog describes (a node with a damaged store, or one taken over, would poison every node);
        # the check costs what a storage read's costs, a fraction of the unsealing.
        if opened is not None:
            why = check_raw(node, memoryview(opened)) or ""
        if not why:
            return opened
        self._count("rejected", f"cluster: a memcached answered {key} with other bytes ({why}); read from "
                    "storage instead (further ones are counted as cluster_rejected)")
        return None

    def _store(self, node: Node, data: memoryview) -> None:
        key = key_of(node, self.key_id)
        try:
            value = self.sealer.seal(key.encode(), data) if self.sealer is not None else data
            done = self.client.set(key, value)
        except Skipped:
            self._count("skipped")
            return
        except Exception as exc:  # PeerError, or anything else: never into a read
            log.debug("cluster: storing %s: %s", key, exc)
            done = False
        with self._lock:
            if done:
                self.counts.stored += 1
                self.counts.stored_bytes += len(data)
            else:
                self.counts.unanswered += 1

    def _count(self, what: str, first: str = "") -> None:
        """One more of counter ``what``; ``first`` logged as a warning the first time only."""
        with self._lock:
            setattr(self.counts, what, getattr(self.counts, what) + 1)
            warn = bool(first) and what not in self._warned
            self._warned.add(what)
        if warn:
            log.warning("%s", first)

    # -- statistics ----------------------------------------------------------------------------------------

    def statistics(self) -> dict[str, object]:
        with self._lock:
            c = self.counts
            return {"cluster_share": self.share, "cluster_sealed": int(self.sealer is not None),
                    "cluster_hits": c.hits, "cluster_hit_bytes": c.hit_bytes, "cluster_misses": c.misses,
                    "cluster_stored": c.stored, "cluster_stored_bytes": c.stored_bytes,
                    "cluster_rejected": c.rejected, "cluster_unanswered": c.unanswered,
                    "cluster_skipped": c.skipped, "cluster_private": c.private}
