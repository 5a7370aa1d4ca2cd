"""What every backend's reader shares: the ``Reader`` protocol the mount reads through and its optional
capabilities, what one open serves (``Content``, ``Choice``), and the checks of what was read (a raw object's
digest, a source's version, chunk digests). Each backend's reader lives with its backend
(``stores.local.reader``, ``stores.s3.reader``).

Everything here is blocking and runs off the trio thread (but ``vouch`` and ``check_source``, a stat or two, on a
local filesystem). A dataset image is read whole, at open or at its first read: one large read per file instead of
dozens of 128 KiB FUSE-sized ones, which is what lets the digest of a raw object be verified before its first
byte is served.

Two kinds of digest. A raw object's, recorded by prepare and checked wherever a stat cannot vouch for the object
(``checksum``), is BLAKE2b-256: whoever can rewrite a store object (a shared store, a bucket others write) chooses
its bytes, and xxh3 is not made to resist a chosen input (a same-sized rewrite with the recorded xxh3 takes
milliseconds to find): ~1 GB/s per core, where xxh3 does ~20. xxh3 stays where the bytes are the mount's own
(``private_digest``); the chunks of a file the daemon let go are tagged under a key of the process's own
(``ChunkDigests``).
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..catalog.identity import LEGACY_REASON, checksum, digest_refusal, object_key, same_version
from ..catalog.nodes import Node
from ..expand.rawformats import MAX_OBJECT_BYTES, SUFFIX_PATTERN
from ..sysio.directio import POOL, read_span

log = logging.getLogger(__name__)

#: Files up to this size are read whole at open; larger ones (a tarball beside the images) are streamed.
WHOLE_FILE_LIMIT = 64 * 1024 * 1024


def private_digest(data: bytes | memoryview) -> str:
    """xxh3 of bytes only this mount writes and reads back (the disk level's files in a directory of its own,
    0700): it catches damage and a file changed behind the level's back, and nothing adversarial chose them
    to match. A twentieth of ``checksum``'s cost."""
    return xxhash.xxh3_64_hexdigest(data)


#: What a file is read again in, once the daemon has let go of its bytes: the kernel asks again for a few pages
#: its page cache lost (it may reclaim unmapped page-cache pages within seconds), and reading the whole file
#: again for them would cost up to a whole file of storage bandwidth per lost page (BENCHMARKS.md).
CHUNK = 1 << 20


#: The key of chunk tags: this process's own secret, never written anywhere, so no writer of the store can make a
#: rewritten chunk match the tag of the one this open served.
_CHUNK_KEY = AESGCM(os.urandom(32))


@dataclass(frozen=True, slots=True)
class ChunkDigests:
    """What a later read of part of a file must match: a keyed tag of each CHUNK of what this open served.

    Taken of every file the daemon path lets go of (every byte it serves without a cache), to catch a file changed
    since this open read it, including by a writer of the store who rewrites an object to match a chunk they know
    (issue 38): xxh3 could be solved for that in milliseconds, and BLAKE2b would cost about a core per GB/s served.
    Each tag is AES-GCM's authentication tag (GMAC) over the chunk under ``_CHUNK_KEY``: ~8 GB/s a core (AES-NI),
    unforgeable without the key. The nonce of chunk ``i`` is this file's random prefix and ``i``: never reused
    under the key."""

    prefix: bytes
    tags: tuple[bytes, ...]

    @classmethod
    def of(cls, data: bytes | memoryview) -> ChunkDigests:
        prefix = os.urandom(8)
        view = memoryview(data)
        return cls(prefix, tuple(_chunk_tag(prefix, i // CHUNK, view[i:i + CHUNK])
                                 for i in range(0, len(view), CHUNK)))

    def matches(self, start: int, data: bytes | memoryview) -> bool:
        """Whether ``data``, the file's bytes from ``start`` (a CHUNK boundary), are the chunks this open served."""
        if start % CHUNK:
            return False
        view = memoryview(data)
        first = start // CHUNK
        count = -(-len(view) // CHUNK)
        if first + count > len(self.tags):
            return False
        return all(hmac.compare_digest(_chunk_tag(self.prefix, first + k, view[k * CHUNK:(k + 1) * CHUNK]),
                                       self.tags[first + k]) for k in range(count))


def _chunk_tag(prefix: bytes, index: int, chunk: memoryview) -> bytes:
    # An empty plaintext: the tag alone, over the chunk as associated data.
    return _CHUNK_KEY.encrypt(prefix + index.to_bytes(4, "big"), b"", chunk)


def chunk_span(offset: int, length: int, size: int) -> tuple[int, int]:
    """The CHUNK-aligned ``(start, end)`` of the file that covers ``length`` bytes at ``offset``."""
    start = offset // CHUNK * CHUNK
    return start, min(size, -(-(offset + max(length, 1)) // CHUNK) * CHUNK)


@dataclass(slots=True)
class Content:
    """What one open file serves: its bytes in memory, or a descriptor to stream a large file from."""

    size: int
    raw: bool
    data: memoryview | None = None
    fd: int | None = None
    fallback: str | None = None  # why the raw object was not served, when it should have been
    fetch: Callable[[int, int], bytes] | None = None  # a ranged read of a large object in a bucket
    level: str = "storage"  # where the bytes came from: "storage", "disk" (the local disk level), "cluster" (memcached)
    #: ``data`` is a pool buffer only this content reads: given back to the pool when the file is closed.
    #: Cleared the moment anything else may keep a view of it (the cache holds it).
    pooled: bool = False
    #: Not read yet: read whole at the first read (``datapath.daemon.DaemonPath._read_later``).
    deferred: bool = False
    #: Where the source changed since the scan: its ``stamp`` as read (None: the version the catalog describes).
    #: Two opens of one size may then serve other bytes (a file rewritten in place): they never share the
    #: inode's page cache unless their versions are the same.
    version: tuple[int, int, int, int] | None = None

    def read(self, offset: int, length: int) -> bytes | memoryview:
        if self.data is not None:
            return self.data[offset:offset + length]
        if self.fetch is not None:
            return self.fetch(offset, min(length, self.size - offset)) if offset < self.size else b""
        assert self.fd is not None
        # No further than the size the open told (a file that grew since is not served past it, as the other
        # two are not)
        return os.pread(self.fd, max(0, min(length, self.size - offset)), offset) if offset < self.size else b""

    def close(self) -> None:
        try:
            if self.fd is not None:
                fd, self.fd = self.fd, None  # forgotten first: a close that fails frees it all the same
                os.close(fd)
        finally:
            if self.pooled and self.data is not None:
                POOL.give(self.data)
            self.pooled = False
            self.data = None


#: What prepare names raw objects (``prepare.object_name``): anything else in a catalog row is refused.
OBJECT_NAME = re.compile(rf"objects/([0-9a-f]{{2}}/([0-9a-f]{{32}}){SUFFIX_PATTERN})")


#: How often a source written while it is read is read again before the open fails (EIO).
SETTLE_TRIES = 3


def stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """What any change of a file changes: its inode, size, mtime and ctime."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_settled(fd: int, st: os.stat_result, name: str = "", limit: int = WHOLE_FILE_LIMIT) -> memoryview:
    """The whole file at ``fd`` (``st``: its stat, its size checked by the caller), read while nobody wrote it: a
    write during the read changes its mtime and ctime, and the mix of old and new bytes such a read returns (a
    torn image) is never served. Read again while the file keeps changing, then EIO. No more than the size
    checked is read: a file grown while it is read (to 50 GB, by whoever writes the source) is read again only
    while it stays within ``limit``, else EIO (the next open streams it)."""
    for _ in range(SETTLE_TRIES):
        data = read_span(fd, 0, st.st_size)
        try:
            after = os.fstat(fd)
        except BaseException:
            POOL.give(data)
            raise
        if stamp(after) == stamp(st):
            return data
        POOL.give(data)
        if after.st_size > limit:
            raise OSError(errno.EIO, "source grew past what is read whole while it was read", name)
        st = after
    raise OSError(errno.EIO, "source kept changing while it was read", name)


def same_file(node: Node, st: os.stat_result) -> bool:
    """True while the local file behind ``st`` is the one the catalog recorded (``same_version``). A local scan
    records every file's version (inode and ctime): a row without one (a writer of the catalog cleared it, so
    that size and mtime put back with ``touch -d`` would keep a stale raw object in service) is a changed file."""
    return node.etag is not None and same_version(st, node.size, node.mtime_ns, node.etag)


def unfit_raw_row(node: Node) -> str | None:
    """Why ``node``'s row names no raw object to read whole: no object or no size (a damaged or foreign row: an
    object store's GET without a size is one of any length), a size larger than any ``prepare`` writes (a
    catalog row's claim, which a store writer chooses; a sparse object of that size costs them nothing), or an
    object that is not the one named after this file's source; else None. Its original is served instead."""
    if node.object is None or not isinstance(node.served_size, int):
        return "no raw object recorded in the catalog's row"
    # SQLite keeps what a writer put in a column, a BLOB in a TEXT one (whoever writes the store wrote it): the
    # types the names below are made of, whatever the row's annotations say.
    shapes: tuple[tuple[object, type | tuple[type, ...]], ...] = (
        (node.object, str), (node.path, bytes), (node.size, int), (node.mtime_ns, int), (node.etag, (str, type(None))),
        (node.checksum, (str, type(None))), (node.object_stamp, (str, type(None))))
    if not all(isinstance(value, kind) for value, kind in shapes):
        return "a catalog row of the wrong types"
    if node.served_size > MAX_OBJECT_BYTES:
        return f"raw object of {node.served_size} bytes, more than any prepare writes ({MAX_OBJECT_BYTES})"
    name = OBJECT_NAME.fullmatch(node.object)
    if name is None:
        return "not an object name prepare gives"
    key = object_key(node)
    if name.group(2) != key or not name.group(1).startswith(key[:2] + "/"):
        # A catalog writer pointing this row at another image's object (its size and checksum copied along)
        # would have it served as this file: only the object named after this file's source is read.
        return "not the object of this file's source"
    return None


def check_raw(node: Node, data: bytes | memoryview, *, sealed: bool = False) -> str | None:
    """None when ``data`` is the raw object prepare recorded for ``node`` (size and BLAKE2b digest); else why not.

    ``sealed``: a stat vouched for the object before and after ``data`` was read (its inode, ctime and size
    those prepare recorded: nobody wrote it since). Only then may a digest recorded before BLAKE2b (xxh3) still
    be compared: it catches damage, and nobody chose the bytes. Without a stamp, such an object vouches for
    nothing (``LEGACY_REASON``) and its original is served."""
    if len(data) != node.served_size:
        return f"raw object has {len(data)} bytes, expected {node.served_size}"
    want = node.checksum or ""
    refused = digest_refusal(want)
    if refused is None:
        return None if checksum(data) == want else "raw object fails its checksum"
    if refused == LEGACY_REASON and sealed:
        return None if xxhash.xxh3_64_hexdigest(data) == want else "raw object fails its checksum"
    return refused


#: Why a raw object is not served where another user may have put it at its name (``StoreReader.may_serve``).
UNTRUSTED_REASON = ("in a directory of the store that others may write, or not its own owner's (chmod go-w the "
                    "objects directory and its subdirectories; or prepare again into a store of your own)")
#: Reasons that hold for many objects of a store at once: said once per reader, not once per file.
STORE_WIDE = frozenset({LEGACY_REASON, UNTRUSTED_REASON})


class FallbackLog:
    """Says why a raw object is not served: once per file, and once per reader for an xxh3 digest
    (``LEGACY_REASON``), which a catalog from before BLAKE2b has for every object."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger  # the reader's own
        self._warned: set[int] = set()
        self._said: set[str] = set()  # the reasons of a whole store said once

    def warn_once(self, node: Node, where: str, why: str | None) -> None:
        if why in STORE_WIDE:
            if why not in self._said:
                self._said.add(why)
                self.log.warning("%s (and every raw object like it): %s; serving the originals", where, why)
            return
        if node.id not in self._warned:
            self._warned.add(node.id)
            self.log.warning("%s: %s; serving the original", where, why)


@dataclass(slots=True)
class Choice:
    """What one open of a node serves (``StoreReader.choose``): an open descriptor of the source or of the raw
    object, owned by whoever holds this until ``take`` or ``close``."""

    fd: int
    st: os.stat_result
    raw: bool
    #: A stat vouches for the bytes: the source as the catalog describes it, or the raw object as prepare left
    #: it. Else they must be read whole and checked (a raw object's checksum) before any is served.
    sealed: bool
    fallback: str | None = None  # why a node with a raw object is served as its original

    @property
    def version(self) -> tuple[int, int, int, int] | None:
        """Of an original: the source's ``stamp`` where it changed since the scan (``Content.version``); None
        where the catalog describes it (a stat vouched for it)."""
        return None if self.sealed else stamp(self.st)

    def take(self) -> int:
        """The descriptor, now the caller's."""
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1  # forgotten first: a close that fails frees it all the same
            os.close(fd)


class Reader(Protocol):
    """What the mount reads through: a store's reader (the local store's ``StoreReader``, the S3 backend's) or a
    level of held bytes in front of one (``held.disk.DiskLevel``). Optional capabilities are protocols of their own
    (``LendsDescriptors``, ``ChecksCallers``): a method a reader has, never a check of its class."""

    def open(self, node: Node) -> Content:
        """What ``node`` serves, read whole and checked (or, past WHOLE_FILE_LIMIT, a way to stream it)."""
        ...

    def read_span(self, node: Node, raw: bool, start: int, end: int) -> memoryview: ...

    def vouch(self, node: Node, *, cached_only: bool = False) -> bool | None: ...

    def check_source(self, node: Node, st: Any = None, *, cached_only: bool = False,
                     version: tuple[int, int, int, int] | None = None) -> str | None:
        """None while the source is the file the catalog describes, or, given ``version``, the one of that
        ``stamp`` (``Content.version``: a source changed since the scan, which an earlier open served); else
        what changed."""
        ...

    @property
    def inline_check(self) -> bool:
        """Whether ``check_source`` and ``vouch`` are cheap enough for the loop (a stat of a local file)."""
        ...

    def close(self) -> None:
        """At unmount: let go of what the reader holds (descriptors of the roots, a client)."""
        ...


class InFront:
    """A reader in front of another (a level: ``held.disk.DiskLevel``, ``held.cluster.ClusterLevel``): what it
    does not change is asked of the reader behind it."""

    def __init__(self, inner: Reader) -> None:
        self.inner = inner

    def check_source(self, node: Node, st: Any = None, *, cached_only: bool = False,
                     version: tuple[int, int, int, int] | None = None) -> str | None:
        return self.inner.check_source(node, st, cached_only=cached_only, version=version)

    @property
    def inline_check(self) -> bool:
        return self.inner.inline_check

    def vouch(self, node: Node, *, cached_only: bool = False) -> bool | None:
        return self.inner.vouch(node, cached_only=cached_only)

    def read_span(self, node: Node, raw: bool, start: int, end: int) -> memoryview:
        # Part of a file the level may no longer have: the store has it, checked by the caller.
        return self.inner.read_span(node, raw, start, end)

    def source_changed_now(self, node: Node) -> str | None:
        return source_changed_now(self.inner, node)


@runtime_checkable
class AsksStorage(Protocol):
    """A reader whose ``check_source`` asks nothing of storage (an object store's: a request at every hit of
    this node's own cache would cost more than the hit saves, and its next miss checks again), with the request
    that does ask (``source_changed_now``)."""

    def source_changed_now(self, node: Node) -> str | None:
        """None while the source is the object the catalog describes (one request); else what changed. OSError
        (FileNotFoundError where it is gone) where storage does not say."""
        ...


def source_changed_now(reader: Reader, node: Node) -> str | None:
    """Whether ``node``'s source changed, asked of storage itself: for bytes another node read into a level all
    nodes share (the cluster), which no miss of this node's ever checks again. A reader's ``check_source``
    where that asks storage already (a local stat). In a worker thread."""
    if isinstance(reader, AsksStorage):
        return reader.source_changed_now(node)
    return reader.check_source(node)


#: The node whose source the open running in this thread found unchanged a moment ago (``source_checked``).
_CHECKED: ContextVar[tuple[int, str | None] | None] = ContextVar("liquidfs_source_checked", default=None)


@contextmanager
def source_checked(node: Node) -> Iterator[None]:
    """Around the read of a cluster miss, whose source ``source_changed_now`` found unchanged just before: the
    reader behind asks storage no second time (``asked_already``) in the same open."""
    token = _CHECKED.set((node.id, node.etag))
    try:
        yield
    finally:
        _CHECKED.reset(token)


def asked_already(node: Node) -> bool:
    """Whether this open found ``node``'s source unchanged already (``source_checked``)."""
    return _CHECKED.get() == (node.id, node.etag)


@runtime_checkable
class LendsDescriptors(Protocol):
    """A reader whose files are local and may back a passthrough open themselves (``datapath.backing.vouched``): it
    hands out the descriptor of the source or raw object an open serves."""

    @property
    def inline_check(self) -> bool: ...

    def choose(self, node: Node, *, cached_only: bool = False) -> Choice: ...

    def warm(self, node: Node) -> None:
        """Bring what an open of ``node`` walks into the kernel's caches, reading no byte (``lookahead``)."""
        ...

    def warm_walks(self, node: Node) -> list[tuple[int, bytes]]:
        """What ``warm`` walks: (a directory descriptor of ``warm_descriptors``, a path below it), each."""
        ...

    @property
    def warm_descriptors(self) -> tuple[int, ...]: ...


@runtime_checkable
class ChecksCallers(Protocol):
    """A reader that can tell whether a user may read a file as the source is now (an --allow-other mount
    asks it at every open by another user): the inode number they may read, None where they may not."""

    def readable_inode(self, node: Node, uid: int, gid: int, pid: int = 0) -> int | None: ...
