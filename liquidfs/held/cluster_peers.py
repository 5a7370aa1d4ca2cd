"""Which memcacheds the cluster level (``held.cluster``) talks to: the ``--cluster`` URL, its names resolved to
addresses (and again every ``RESOLVE_EVERY`` seconds), and the client over them (``held.memcached``).

A HOST that is a DNS name (a Kubernetes headless Service: one address per memcached pod) stands for every address
it resolves to, and is resolved again in a daemon thread of its own, so a node that joins or leaves is picked up,
and with rendezvous hashing only its share moves. What resolution returns is trusted no more than a memcached:
addresses only, at most ``MAX_SERVERS``; a name that resolves to nothing usable keeps its last good set. A literal
address is used as given, never resolved.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Protocol
from urllib.parse import urlsplit

from ..sysio.thread_names import CLUSTER_DNS, name_this_thread
from .memcached import TIMEOUT, MemcachedWire

log = logging.getLogger(__name__)

#: memcached's own default port.
DEFAULT_PORT = 11211
#: Seconds between two resolutions of a --cluster name: how soon a memcached that joins or leaves is used or left.
RESOLVE_EVERY = 30.0
#: Seconds between two tries of a name that has never resolved yet: until it does, every open is a miss.
RESOLVE_RETRY = 5.0
#: The most memcacheds a client keeps: a DNS answer is not trusted to size its connection pools.
MAX_SERVERS = 64

#: ``resolve(host, port)``: the addresses of ``host`` (anything else in the answer is dropped).
Resolve = Callable[[str, int], list[str]]

#: Why a mount of an object store's source takes ``--cluster`` only with ``--cluster-key-file``.
CLUSTER_NEEDS_KEY = ("--cluster with an object-store source needs --cluster-key-file: whoever holds the bucket's "
                     "credentials reads its objects, and a memcached answers anyone who reaches it, so none of "
                     "them may go there in the clear")


class ClusterError(ValueError):
    """A --cluster URL that names no usable memcached."""


def parse_cluster(url: str) -> list[tuple[str, int]]:
    """``memcached://HOST[:PORT],HOST[:PORT]...`` as (host, port) pairs."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": a bracket not closed
        raise ClusterError(f"--cluster {url!r}: {exc}") from None
    if parts.scheme != "memcached" or not parts.netloc or parts.path not in ("", "/") or parts.query:
        raise ClusterError(f"--cluster {url!r}: expected memcached://HOST:PORT[,HOST:PORT...]")
    servers = []
    for item in map(str.strip, parts.netloc.split(",")):
        if item.startswith("["):  # [IPv6]:PORT or [IPv6]
            host, sep, rest = item[1:].partition("]")
            port_text = rest.removeprefix(":") if sep and rest.startswith(":") else ("" if rest else None)
        elif item.count(":") > 1:
            # 2001:db8::1:2 is an address, or an address and a port: never guessed (it was taken as host
            # 2001:db8::1, port 2, and the cluster never resolved)
            raise ClusterError(f"--cluster {url!r}: {item!r}: an IPv6 address is written [ADDRESS]:PORT")
        else:
            host, sep, port_text = item.partition(":")
            port_text = port_text if sep else None
        port_text = str(DEFAULT_PORT) if port_text is None else port_text
        port = int(port_text) if port_text.isascii() and port_text.isdigit() else 0  # not "²" (isdigit says so)
        if not host or not 0 < port < 65536 or any(c.isspace() or c in "/@" for c in host):
            raise ClusterError(f"--cluster {url!r}: {item!r} is not HOST:PORT")
        servers.append((host, port))
    if len(set(servers)) != len(servers):
        raise ClusterError(f"--cluster {url!r} names a memcached twice")
    return servers


class Client(Protocol):
    """What the level asks of memcached (``held.memcached.MemcachedWire``; a fake in unit tests). ``get`` and
    ``set`` raise ``held.memcached.PeerError`` where a memcached does not answer as one, in time."""

    def get(self, key: str, length: int) -> bytearray | bytes | None: ...

    def set(self, key: str, value: bytes | bytearray | memoryview) -> bool | None: ...

    def limits(self) -> dict[str, int | None]: ...

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
    """Of a resolver's ``answer``, the unicast IP addresses, canonical, of one family (IPv4 where it has any),
    sorted and at most ``MAX_SERVERS`` (the same cut on every node that got the same answer); and how many items
    were dropped (not addresses, or past the cut)."""
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
    if any(ip.version == 4 for ip in found.values()):
        # A dual-stack name (a Kubernetes headless Service of both families) answers each memcached's IPv4 and
        # IPv6 address: one family only, or each was counted twice (their sizes summed twice over, and on a node
        # without an IPv6 route half the keys placed on addresses it cannot reach).
        found = {address: ip for address, ip in found.items() if ip.version == 4}
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
            self._thread = threading.Thread(target=self._run, name=CLUSTER_DNS, daemon=True)
            self._thread.start()

    # -- the client interface --------------------------------------------------------------------------------

    def get(self, key: str, length: int) -> bytearray | bytes | None:
        return self._client.get(key, length)

    def set(self, key: str, value: bytes | bytearray | memoryview) -> bool | None:
        return self._client.set(key, value)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a resolution stuck in getaddrinfo must not hold the unmount
        with self._swap_lock:  # after a swap in flight, if any: the client closed is the last one
            client = self._client
        client.close()

    # -- resolution --------------------------------------------------------------------------------------

    def limits(self) -> dict[str, int | None]:
        """What each memcached in use now can hold (``MemcachedWire.limits``)."""
        return self._client.limits()

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
            if isinstance(client, MemcachedWire) and isinstance(self._client, MemcachedWire):
                client.take_peers_of(self._client)  # the memcacheds that stayed keep their records
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
        name_this_thread(CLUSTER_DNS)
        while not self._stop.wait(self.every if len(self._last) == len(self._names) else
                                  min(self.every, RESOLVE_RETRY)):
            try:
                self.refresh()
            except Exception:  # never: refresh catches what it expects; a bug must not end the re-resolution
                log.exception("cluster: re-resolving")
