"""Reading what the mount serves: the representation check at open, and whole-file reads from storage.

Everything here is blocking and runs off the trio thread (but ``vouch`` and ``check_source``, a stat or two, on a
local filesystem). A dataset image is read whole, at open or at its first read: one large read per file instead of
dozens of 128 KiB FUSE-sized ones, which is what lets the checksum of a raw object be verified before its first
byte is served. Reads bypass the page cache (O_DIRECT, or drop-behind where the filesystem
refuses O_DIRECT: ``directio``) so the backing files never take a second copy of the dataset in memory; paths
are opened below their root without following links (``paths``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import xxhash

from .catalog import Node, file_version, object_key, object_stamp
from .directio import POOL, read_fd, read_span
from . import access
from .paths import LOCAL_FILESYSTEMS, filesystem_type, open_below, open_dir, stat_below

log = logging.getLogger(__name__)

#: Files up to this size are read whole at open; larger ones (a tarball beside the images) are streamed.
WHOLE_FILE_LIMIT = 64 * 1024 * 1024




def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


#: What a file is read again in, once the daemon has let go of its bytes: the kernel asks again for a few pages
#: its page cache lost (it may reclaim unmapped page-cache pages within seconds), and reading the whole file
#: again for them would cost up to a whole file of storage bandwidth per lost page (BENCHMARKS.md).
CHUNK = 1 << 20


def chunk_digests(data: bytes | memoryview) -> tuple[int, ...]:
    """The xxh3 digest of each CHUNK of ``data``: what a later read of part of the file must match."""
    view = memoryview(data)
    return tuple(xxhash.xxh3_64_intdigest(view[i:i + CHUNK]) for i in range(0, len(view), CHUNK))


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
    tier: str = "storage"  # where the bytes came from: "storage", or "disk" for the local disk cache level
    #: ``data`` is a pool buffer only this content reads: given back to the pool when the file is closed.
    #: Cleared the moment anything else may keep a view of it (the cache holds it).
    pooled: bool = False
    #: Not read yet: read whole at the first read (``fs.Operations._read_later``).
    deferred: bool = False

    def read(self, offset: int, length: int) -> bytes | memoryview:
        if self.data is not None:
            return self.data[offset:offset + length]
        if self.fetch is not None:
            return self.fetch(offset, min(length, self.size - offset)) if offset < self.size else b""
        assert self.fd is not None
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.pooled and self.data is not None:
            POOL.give(self.data)
        self.pooled = False
        self.data = None




#: What prepare names raw objects (``prepare.object_name``): anything else in a catalog row is refused.
OBJECT_NAME = re.compile(r"objects/([0-9a-f]{2}/([0-9a-f]{32})\.(?:bmp|jp2))")




#: How often a source written while it is read is read again before the open fails (EIO).
SETTLE_TRIES = 3


def stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """What any change of a file changes: its inode, size, mtime and ctime."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_settled(fd: int, st: os.stat_result, name: str = "") -> memoryview:
    """The whole file at ``fd``, read while nobody wrote it: a write during the read changes its mtime and
    ctime, and the mix of old and new bytes such a read returns (a torn image) is never served.  Read again
    while the file keeps changing, then EIO."""
    for _ in range(SETTLE_TRIES):
        data = read_fd(fd)
        after = os.fstat(fd)
        if stamp(after) == stamp(st):
            return data
        POOL.give(data)
        st = after
    raise OSError(errno.EIO, "source kept changing while it was read", name)


def same_version(st: os.stat_result, size: int, mtime_ns: int, version: str | None) -> bool:
    """True while the local file behind ``st`` has the recorded size, mtime and, where it was recorded, version
    (inode and ctime: ``catalog.file_version``)."""
    return (st.st_size, st.st_mtime_ns) == (size, mtime_ns) and (version is None or version == file_version(st))


def same_file(node: Node, st: os.stat_result) -> bool:
    """True while the local file behind ``st`` is the one the catalog recorded (``same_version``)."""
    return same_version(st, node.size, node.mtime_ns, node.etag)




def digest_of(node: Node, content: Content) -> str:
    """The xxh3 digest of what ``content`` serves: prepare's recorded one for a raw object (checked when it was
    read), else computed."""
    assert content.data is not None
    return node.checksum if content.raw and node.checksum else checksum(content.data)


def check_raw(node: Node, data: bytes | memoryview) -> str | None:
    """None when ``data`` is the raw object prepare recorded for ``node`` (size and checksum); else why not."""
    if len(data) != node.served_size:
        return f"raw object has {len(data)} bytes, expected {node.served_size}"
    if checksum(data) != node.checksum:
        return "raw object fails its checksum"
    return None


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

    def take(self) -> int:
        """The descriptor, now the caller's."""
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Reader(Protocol):
    """What the mount reads through: a store's reader (``StoreReader``, ``s3reader.S3Reader``) or a cache level
    in front of one (``disktier.DiskTier``)."""

    def open(self, node: Node) -> Content: ...

    def read_span(self, node: Node, raw: bool, start: int, end: int) -> memoryview: ...

    def vouch(self, node: Node, *, cached_only: bool = False) -> bool | None: ...

    def check_source(self, node: Node, st: Any = None, *, cached_only: bool = False) -> str | None: ...

    @property
    def inline_check(self) -> bool: ...


class StoreReader:
    """Opens the content of catalog nodes: the raw object when it is sound, the source otherwise."""

    def __init__(self, source_root: bytes, store_dir: Path) -> None:
        self.source_root = source_root
        self.store_dir = store_dir
        # Held from mount time: every path of the catalog is resolved below these, never through the paths
        # again (a root renamed or swapped for a link while the mount runs serves nothing else).
        self.root_fd = open_dir(source_root)
        # The objects directory as the store's owner set it up at mount time (it may be a link to another
        # disk); names below it are resolved without links.
        try:
            self.objects_fd = open_dir(store_dir / "objects")
        except FileNotFoundError:  # nothing prepared raw
            self.objects_fd = -1
        # An object's stamp (``catalog.object_stamp``) vouches for it only where a stat is the inode's own, not
        # attributes a network or FUSE filesystem may have cached for seconds.
        self.stamps_vouch = filesystem_type(str(store_dir / "objects")) in LOCAL_FILESYSTEMS
        self._warned: set[int] = set()
        # check_source is one stat of a path looked up at the previous open: on a local filesystem it is
        # answered from the dentry cache, and a worker thread would cost more than the stat (~1/4 of a cache
        # hit's CPU). Anything else (NFS, FUSE) is checked in a worker thread, under --io-timeout.
        self.inline_check = filesystem_type(source_root) in LOCAL_FILESYSTEMS

    def open_source(self, node: Node, *, cached_only: bool = False) -> int:
        return open_below(self.root_fd, node.path, self.source_root, cached_only=cached_only)

    def open_object(self, node: Node, *, cached_only: bool = False) -> int:
        """The raw object's descriptor: a name prepare gives, a regular file below the store, no link."""
        assert node.object is not None
        name = OBJECT_NAME.fullmatch(node.object)
        if name is None:
            raise OSError(errno.EIO, "not an object name prepare gives: refused", node.object)
        if name.group(2) != object_key(node):
            # A catalog writer pointing this row at another image's object (its size and checksum copied along)
            # would have it served as this file: only the object named after this file's source is opened.
            raise OSError(errno.EIO, "not the object of this file's source: refused", node.object)
        if self.objects_fd < 0:
            raise FileNotFoundError(errno.ENOENT, "the store had no objects directory at mount", node.object)
        return open_below(self.objects_fd, os.fsencode(name.group(1)), os.fsencode(self.store_dir / "objects"),
                          cached_only=cached_only)

    def close(self) -> None:
        for fd in (self.root_fd, self.objects_fd):
            if fd >= 0:
                os.close(fd)
        self.root_fd = self.objects_fd = -1

    def may_read(self, node: Node, uid: int, gid: int, pid: int = 0) -> bool:
        """Whether the caller (``uid``/``gid``, the groups of process ``pid``) may read ``node``'s source as it
        is now, as the kernel would decide for them (``access.may_read``). The catalog's modes are those of the
        scan: a ``chmod 600`` or a denying ACL since then must bind other users of an --allow-other mount."""
        return access.may_read(self.root_fd, node.path, uid, gid, access.caller_groups(pid))

    def choose(self, node: Node, *, cached_only: bool = False) -> Choice:
        """What an open of ``node`` serves, and how far a stat vouches for it: the one decision both data paths
        take (passthrough hands the chosen descriptor to the kernel, ``backing.vouched``; the daemon path reads
        it, ``open``, or defers its read, ``vouch``).

        The source is opened below the root without links and compared with the catalog (size, mtime, inode,
        ctime). A node with a raw object is served raw while the source is unchanged and the object can be
        opened (a name prepare gives, a regular file below the objects directory, no link); ``sealed`` says
        whether a stat vouches for the object (its size, its inode unchanged since prepare sealed the store),
        else its checksum must be checked before any byte is served. Otherwise the original is served, and for a
        raw node ``fallback`` says why. ``cached_only``: BlockingIOError where an open would wait for the disk.
        """
        source = self.open_source(node, cached_only=cached_only)
        try:
            st = os.fstat(source)
            changed = self.check_source(node, st)
            why = changed
            if node.served_raw and changed is None:
                try:
                    obj = self.open_object(node, cached_only=cached_only)
                except BlockingIOError:
                    raise
                except FileNotFoundError:
                    why = "raw object missing"
                except OSError as exc:
                    why = f"raw object unreadable ({exc.strerror})"
                else:
                    ost = os.fstat(obj)
                    return Choice(obj, ost, raw=True, sealed=self.object_sealed(node, ost))
            if why is not None:
                self.warn_once(node, why)
            # An original is served either way; its size may differ from the catalog's (the caller corrects it).
            chosen = Choice(source, st, raw=False, sealed=changed is None,
                            fallback=why if node.served_raw else None)
            source = -1
            return chosen
        finally:
            if source >= 0:
                os.close(source)

    def open(self, node: Node) -> Content:
        """What ``node`` serves, read whole: the raw object when sound (checksum verified), else the source."""
        chosen = self.choose(node)
        try:
            if chosen.raw:
                problem, data = self._read_raw(node, chosen.fd)
                if data is not None:
                    return Content(size=len(data), raw=True, data=data, pooled=True)
                self.warn_once(node, problem)
                chosen.close()
                chosen = self._original(node, problem)
            if chosen.st.st_size > WHOLE_FILE_LIMIT:
                streamed = chosen.take()  # the content owns it now
                return Content(size=chosen.st.st_size, raw=False, fd=streamed, fallback=chosen.fallback)
            data = read_settled(chosen.fd, chosen.st, os.fsdecode(node.path))
            return Content(size=len(data), raw=False, data=data, fallback=chosen.fallback, pooled=True)
        finally:
            chosen.close()

    def vouch(self, node: Node, *, cached_only: bool = False) -> bool:
        """True when what ``node`` serves is known without reading it, so it may be read at its first read:
        the source unchanged, and a raw object as prepare left it (``choose``). Its checksum is still checked
        when it is read; a mismatch then fails that read with EIO (the original could not be served at the size
        promised) and the next open serves the original. ``cached_only``: as ``choose``."""
        chosen = self.choose(node, cached_only=cached_only)
        try:
            return chosen.sealed and chosen.fallback is None  # a fallback is read at open: its size may differ
        finally:
            chosen.close()

    def object_sealed(self, node: Node, st: os.stat_result) -> bool:
        """The raw object behind ``st`` is the one prepare wrote or last read whole and checked: its inode, ctime
        and size are those recorded then (``catalog.object_stamp``; any write, truncation or replacement since
        changes one), and the size served. Evidence about this object alone: no later run vouches for it
        without reading it."""
        return (self.stamps_vouch and node.object_stamp is not None and st.st_size == node.served_size
                and object_stamp(st) == node.object_stamp)

    def check_source(self, node: Node, st: os.stat_result | None = None, *, cached_only: bool = False) -> str | None:
        """None while the source is the file the catalog describes; else what changed. The path is walked below
        the held root as every open walks it (``paths.stat_below``: no link, no other filesystem), never by a
        path ``stat``, which follows links on the way (a directory swapped for a link into the mount would make
        the daemon wait for itself). ``cached_only``: BlockingIOError where the walk would wait for the disk."""
        if st is None:
            st = stat_below(self.root_fd, node.path, self.source_root, cached_only=cached_only)
        if not same_file(node, st):
            return "source changed since prepare" if node.served_raw else "source changed since the scan"
        return None

    def _read_raw(self, node: Node, fd: int) -> tuple[str | None, memoryview | None]:
        """The raw object read whole and checked against its checksum; else why not."""
        try:
            data = read_fd(fd)
        except OSError as exc:
            return f"raw object unreadable ({exc.strerror})", None
        problem = check_raw(node, data)
        if problem:
            POOL.give(data)  # never served: the buffer may take the next file
            return problem, None
        return None, data

    def _original(self, node: Node, why: str | None) -> Choice:
        """The source, for a raw node whose object turned out unsound when read."""
        source = self.open_source(node)
        try:
            return Choice(source, os.fstat(source), raw=False, sealed=False, fallback=why)
        except BaseException:
            os.close(source)
            raise

    def read_span(self, node: Node, raw: bool, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of what ``node`` served (its raw object, or its source), for a read of part of
        a file whose bytes were let go; the caller checks them against the digests of what was served."""
        fd = self.open_object(node) if raw else self.open_source(node)
        try:
            return read_span(fd, start, end)
        finally:
            os.close(fd)

    def warn_once(self, node: Node, why: str | None) -> None:
        if node.id not in self._warned:
            self._warned.add(node.id)
            log.warning("%s: %s; serving the original", os.fsdecode(node.path), why)
