"""The cluster level of held bytes (``mount --cluster memcached://HOST:PORT,... --cluster-size SIZE``): the
memories of the nodes that read one dataset, together, on memcached.

Where a job spans nodes, each runs its own mount and its own memcached beside it. A node's memory level holds a
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
catalog's BLAKE2b digest (no writer can choose other bytes that match it), and only objects whose source anyone
may read go there at all (``EveryoneReadsNow``, from the source as it is). An object store's source has no modes of
its own (its catalog's are made up): whoever holds the bucket's credentials reads it, so nothing of it is
everyone's, and a mount of one takes a cluster only with a key (``mount_config``). Either way a value is also checked
against the catalog's checksum and size, so a wrong, short or foreign value is a miss, never served; and a source
changed since the catalog was taken is checked first, asked of storage itself (``stores.reader.source_changed_now``:
an object store's HEAD too), and the original is then served from storage. Faults cost hits only: every call to a memcached has one deadline for all of it and buffers no more
than the object (``held.memcached``), a memcached that fails repeatedly is left out for a while, and no error of the
cluster ever fails a read.

Which memcacheds, and their names resolved: ``held.cluster_peers``.

Like the disk level (``held.disk.DiskLevel``), it is a reader in front of the store's (``stores.reader.Reader``),
behind the node's memory level: an open the memory level misses asks it, in a worker thread. Unlike it, it is no
``held.base.Level``: it holds a fixed share by hash, not what the next-epoch policy chooses, so it has nothing to
decide, drop or lose (``held.base`` says why).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..catalog.identity import is_digest, version_inode
from ..catalog.nodes import Node
from ..metrics.stats import Statistics
from ..stores.reader import Content, InFront, Reader, check_raw, unfit_raw_row, source_changed_now, source_checked
from ..sysio.access import POSIX_ACLS_ONLY, everyone_may_read, everyone_may_search_above
from ..sysio.paths import filesystem_type_of
from .cluster_peers import Client
from .memcached import TIMEOUT, Skipped, WrongLength
from .sealing import OVERHEAD, Sealer

log = logging.getLogger(__name__)

#: The format of what is stored (2: sealed values, or plaintext only of sources anyone may read): in every key, so
#: mounts of another format never read these values, nor these mounts theirs.
_KEY_PREFIX = "liquidfs2"
#: A sealed value's key: its format (``key_of``; "liquidfs2s" named the object's checksum and size in the clear).
_SEALED_PREFIX = "liquidfs3s"
#: The share of ``--io-timeout`` one call to a memcached may take at most: an open that misses the cluster still
#: reads storage, and stores what it read, within the same timeout.
IO_TIMEOUT_SHARE = 0.25
#: Seconds a value size a memcached refused as too large (past its -I, the largest item) keeps values of that size
#: or more out of the cluster: each was sealed and sent whole, to be refused, at every miss of every node
#: (Cityscapes' 6 MB raw objects against memcached's default 1 MB -I). Then tried again (a memcached restarted
#: with a larger -I). A refusal for now (out of memory, NOT_STORED) keeps nothing out.
REFUSED_FOR = 300.0


def call_timeout(io_timeout: float) -> float:
    """Seconds one call to a memcached may take in all under ``--io-timeout``: never more than a share of it, so an
    open that misses still has the rest to read storage and store what it read (all in one storage call)."""
    return min(TIMEOUT, io_timeout * IO_TIMEOUT_SHARE)


def in_share(node: Node, share: float) -> bool:
    """Whether ``node``'s raw object is the cluster's: its checksum, prepare's, hashed below ``share`` (the same
    answer on every node of the job, from its catalog alone). Only an object with a BLAKE2b digest: one of a
    catalog from before them (xxh3) would be stored by every node and refused by every fetch (``check_raw``)."""
    if not node.served_raw or unfit_raw_row(node) is not None or not (is_digest(node.checksum) and node.size_served):
        return False
    try:
        point = int(node.checksum[:8], 16) / 0x1_0000_0000
    except ValueError:
        return False
    return point < share


def key_of(node: Node, keyed: str = "", sealer: Sealer | None = None) -> str:
    """What the object holds, never where it is: prepare's checksum of its bytes and their size; ``keyed``: the
    id of the cluster key its values are sealed under ("" for plaintext), so two jobs of different keys sharing a
    memcached each keep their own values.

    A sealed value (``sealer``) is bound to its file too, by a name only key holders can make of the file's path
    in the dataset, which the key, and so the sealing's associated data, holds: a writer of the catalog who gives
    a file they may read another's checksum and size (one they may not read, whose value a mount of the job
    stored) fetches a value that does not open for that file. The path only: every node of a job has its own copy
    of the dataset, whose inodes and ctimes (``catalog.identity.object_key``'s) differ. The checksum and size are
    in that name, not beside it: a key listed by anyone who reaches memcached (``lru_crawler metadump``) showed
    each object's digest, which says which known images a job holds and is what a catalog writer would copy into
    a row of theirs. Plaintext values are only of sources anyone may read: no such binding is needed there."""
    assert node.checksum is not None
    if sealer is None:
        return f"{_KEY_PREFIX}:{node.checksum}:{node.size_served}"
    identity = b"\0".join((node.path, node.checksum.encode(), str(node.size_served).encode()))  # (no NUL in a path)
    return f"{_SEALED_PREFIX}-{keyed}:{sealer.name(identity)}"


class EveryoneReadsNow:
    """Whether anyone may read a local file's source now: the bits for others and the group and the ACLs of the
    file and of every directory above it, up to /, as they are (``sysio.access.everyone_may_read`` below the
    source root, ``everyone_may_search_above`` above it: a source in a home only its owner may enter is nobody
    else's). The modes the catalog recorded are its writer's word, and a directory closed (chmod o-x) since the
    scan changes no ctime of the files below it. In a worker thread, at each open that would fetch or store a
    plaintext value."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        # A walk below the root never leaves its filesystem: its kind, once, says whether it has ACLs of its own.
        self.posix_acls_only = filesystem_type_of(root_fd) in POSIX_ACLS_ONLY
        self._kinds: dict[int, bool] = {}  # the same of each filesystem above it, by device, found once each
        self._kinds_lock = threading.Lock()

    def __call__(self, node: Node) -> bool:
        # The file judged is the source the catalog describes (its inode), whose object is served: never one
        # swapped in for the judgement. A row that names no inode is nobody's to judge.
        inode = version_inode(node.etag)
        return inode is not None and everyone_may_search_above(self.root_fd, self._posix_acls_only) and \
            everyone_may_read(self.root_fd, node.path, posix_acls_only=self.posix_acls_only, inode=inode)

    def _posix_acls_only(self, fd: int) -> bool:
        device = os.fstat(fd).st_dev
        with self._kinds_lock:
            known = self._kinds.get(device)
        if known is None:
            known = filesystem_type_of(fd) in POSIX_ACLS_ONLY
            with self._kinds_lock:
                self._kinds[device] = known
        return known


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
    refused: int = 0  # stores a memcached refused, and opens of values as large as one refused as too large since


@dataclass(frozen=True, slots=True)
class ClusterStatistics(Statistics):
    prefix = "cluster_"

    share: float      # of the raw objects, the cluster's
    bytes: int        # what the memcacheds hold together for this dataset
    size_from: str    # what said so: the flag, or their stats
    sealed: int       # 1: values sealed under a cluster key
    hits: int
    hit_bytes: int
    misses: int
    stored: int
    stored_bytes: int
    rejected: int
    unanswered: int
    skipped: int
    private: int
    refused: int


class ClusterLevel(InFront):
    """A reader in front of ``inner`` that fetches the cluster's share of raw objects from memcached (a level of
    held bytes by its share, not by the policy: no ``held.base.Level``).

    ``sealer``: the job's cluster key (every value sealed and opened with it); None: plaintext values, and only
    objects that ``public`` says anyone may read."""

    def __init__(self, inner: Reader, client: Client, share: float, *, sealer: Sealer | None = None,
                 key_id: str = "", public: Callable[[Node], bool] | None = None, size: int = 0,
                 size_from: str = "--cluster-size") -> None:
        super().__init__(inner)
        self.client = client
        self.share = max(0.0, min(1.0, share))
        #: What the memcacheds hold together for this dataset, and what said so (the flag, or their ``stats``).
        self.size = size
        self.size_from = size_from
        self.sealer = sealer
        self.key_id = key_id if sealer is not None else ""
        self.public = public
        self.counts = ClusterCounts()
        self._lock = threading.Lock()
        #: The smallest value a memcached refused to store, and until when values that large are kept out.
        self._refused_from: int | None = None
        self._refused_until = 0.0
        self.clock = time.monotonic
        self._warned: set[str] = set()  # what was logged once (further ones are counted)

    # -- the reader interface (the rest: ``InFront``'s) ------------------------------------------------------

    def open(self, node: Node) -> Content:
        if not in_share(node, self.share):
            return self.inner.open(node)
        if self.sealer is None and not (self.public is not None and self.public(node)):
            self._count("private", f"cluster: {node.path!r} is not readable by everyone: without "
                        "--cluster-key-file such objects never go to the cluster (counted as cluster_private)")
            return self.inner.open(node)
        # Asked of storage itself: a value any node stored is every node's hit, so no miss would check it again
        # (an object store's check_source asks nothing).
        if source_changed_now(self.inner, node) is None:
            fetched = self._fetch(node)
            if fetched is not None:
                return Content(size=len(fetched), raw=True, data=memoryview(fetched), level="cluster")
            with source_checked(node):  # a miss: the store's read need not ask a second time
                content = self.inner.open(node)
        else:
            content = self.inner.open(node)
        if content.raw and content.data is not None and not content.fallback and content.size == node.size_served:
            # A size a memcached refused lately is not offered again for a while; it is still asked for above: one
            # memcached's refusal (its -I, or one that lies) must not keep every node from the others' values.
            if self._too_large(node):
                self._count("refused")
            else:
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
        key = key_of(node, self.key_id, self.sealer)
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
            try:
                value = self._opened(node, key, value)
            except Exception as exc:  # a value this node cannot even open: rejected, the read goes to storage
                self._count("rejected", f"cluster: a memcached value for {key} could not be opened ({exc!r}); read "
                            "from storage instead (further ones are counted as cluster_rejected)",
                            warned_as="unopenable")
                value = None
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
        # the check costs what a storage read's check costs (BLAKE2b: several times the unsealing).
        if opened is not None:
            why = check_raw(node, memoryview(opened)) or ""
        if not why:
            return opened
        self._count("rejected", f"cluster: a memcached answered {key} with other bytes ({why}); read from "
                    "storage instead (further ones are counted as cluster_rejected)")
        return None

    def _store(self, node: Node, data: memoryview) -> None:
        key = key_of(node, self.key_id, self.sealer)
        try:
            value = self.sealer.seal(key.encode(), data) if self.sealer is not None else data
            # True: stored; False: refused for now (NOT_STORED, out of memory); None: too large for it (its -I)
            done = self.client.set(key, value)
        except Skipped:
            self._count("skipped")
            return
        except Exception as exc:  # PeerError, or anything else: never into a read
            log.debug("cluster: storing %s: %s", key, exc)
            with self._lock:
                self.counts.unanswered += 1
            return
        with self._lock:
            if done:
                self.counts.stored += 1
                self.counts.stored_bytes += len(data)
                return
            self.counts.refused += 1
            if done is None:  # a lasting refusal: that size kept out for a while
                self._refused_from = min(self._refused_from or len(value), len(value))
                self._refused_until = self.clock() + REFUSED_FOR
        if done is None and "refused" not in self._warned:
            self._warned.add("refused")
            log.warning("cluster: a memcached refused a value of %d bytes as too large (past its -I, the largest "
                        "item): values that large are not stored for %g s at a time, only asked for (counted as "
                        "cluster_refused)", len(value), REFUSED_FOR)

    def _too_large(self, node: Node) -> bool:
        """Whether ``node``'s value is as large as one a memcached refused lately (not stored again meanwhile)."""
        with self._lock:
            refused_from, until = self._refused_from, self._refused_until
        if refused_from is None:
            return False
        if self.clock() >= until:
            with self._lock:
                self._refused_from = None
            return False
        return node.size_served + (OVERHEAD if self.sealer is not None else 0) >= refused_from

    def _count(self, what: str, first: str = "", *, warned_as: str | None = None) -> None:
        """One more of counter ``what``; ``first`` logged as a warning the first time only (the first of
        ``warned_as``'s, where one counter has warnings of several causes)."""
        key = warned_as or what
        with self._lock:
            setattr(self.counts, what, getattr(self.counts, what) + 1)
            warn = bool(first) and key not in self._warned
            self._warned.add(key)
        if warn:
            log.warning("%s", first)

    # -- statistics ----------------------------------------------------------------------------------------

    def statistics(self) -> ClusterStatistics:
        with self._lock:
            return ClusterStatistics(share=self.share, bytes=self.size, size_from=self.size_from,
                                     sealed=int(self.sealer is not None), **dataclasses.asdict(self.counts))
