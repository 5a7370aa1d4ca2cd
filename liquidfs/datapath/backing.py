"""The file descriptor that serves an open on the passthrough path, and the checks that make it safe to hand to
the kernel.

With FUSE passthrough the kernel reads an open file's bytes straight from a descriptor the daemon hands it at
open: every check must therefore happen before the open is answered. Which bytes an open serves (the source, or
the raw object) is decided for both data paths by ``StoreReader.choose``; this module turns that choice into one
of four kinds of backing:

* ``source``: the original file, opened below the source root without following links, its identity checked on
  the open descriptor against the catalog;
* ``object``: the raw object of a local store, served only as ``prepare`` left it (regular file, its size, its
  inode unchanged since the store was sealed: any write, truncation or rename since makes its ctime later) and
  writable by nobody but the mount's user;
* ``memfd``: bytes read whole and checked before any is served (a raw object that cannot be vouched for by a
  stat, an object-store download, ``mount --verify-reads``, a next-epoch cache hit), sealed against change;
* ``disk``: a file of the local disk level, read whole and checked against its digest like a memfd.

Everything here blocks and runs in a worker thread (``datapath.storage_calls.StorageCalls.run``).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import trio
import xxhash

from ..catalog.nodes import Node
from ..stores.reader import LendsDescriptors, Reader, stamp
from ..sysio.thread_names import CLOSER, name_this_thread
from .shared_inodes import signed64

log = logging.getLogger(__name__)

_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
#: memfd_create's limit on a name: NAME_MAX (255) less its "memfd:" prefix, in bytes; EINVAL beyond.
_MEMFD_NAME_MAX = 249


@dataclass(slots=True)
class Backing:
    """An open descriptor holding exactly the bytes one file serves; owned by whoever holds this object."""

    fd: int
    size: int
    raw: bool
    kind: str  # "source", "object": the file itself; "memfd" (read whole, or held), "disk": a disk level's copy
    fallback: str | None = None  # why the raw object was not served, when it should have been
    #: ``stamp`` of a source or object descriptor when it was checked (``still_sound``); None for a memfd.
    stamp: tuple[int, int, int, int] | None = None
    #: Where its bytes came from (``stores.reader.Content.level``): "storage", or the level in front of it that
    #: had them.
    level: str = "storage"
    #: A memfd's or disk copy's ``content_digest``, where the mount's loops share backings (else None).
    digest: int | None = None
    #: An original's source version where it changed since the scan (``Content.version``); None: the version
    #: the catalog describes, which a later open sharing this backing checks the source against again.
    version: tuple[int, int, int, int] | None = None
    #: A source's or object's (st_dev, st_ino), from the stat its check took (in a worker thread where a stat may
    #: wait on a server): what the mount's loops share its backing by (``PassthroughPath._register``).
    file_id: tuple[int, int] | None = None

    def close(self) -> None:
        if self.fd >= 0:
            # Forgotten first: Linux frees a descriptor whose close fails (a FUSE or NFS source's flush error), and
            # a second close would close whatever file reused its number.
            fd, self.fd = self.fd, -1
            os.close(fd)


@dataclass(eq=False, slots=True)
class SharedBacking:
    """One inode's backing while any passthrough open of it exists (the kernel allows one per inode)."""

    opens: int = 1
    backing: Backing | None = None
    backing_id: int = 0
    keep: bool = False            # the policy's latest decision of its opens: hold it for the next epoch
    failed: int | None = None     # the errno the first open failed with (concurrent opens fail too)
    abandoned: bool = False       # the first open was cancelled undecided: the opens that waited try again
    settled: bool = False         # the first open has decided (its backing, or its failure)
    #: Made by the first open that waits for the decision: most inodes have one open at a time, and an Event
    #: made and set for each cost every open ~1 us of the loop's time.
    _decided: trio.Event | None = None

    async def wait_settled(self) -> None:
        """Until the first open has decided (``settle``)."""
        if not self.settled:
            if self._decided is None:
                self._decided = trio.Event()
            await self._decided.wait()

    def settle(self) -> None:
        """The first open has decided: the opens waiting for it go on."""
        self.settled = True
        if self._decided is not None:
            self._decided.set()


def resolve(reader: Reader, node: Node, *, verify_reads: bool = False,
            vouch: bool = True, lends: bool | None = None) -> Backing | None:
    """The backing of ``node``, or None where none can be made (a file too large to be read whole from an
    object store: such a file is served by the daemon, in ranges, as before).

    A local store answers with the source or the object descriptor itself when a stat vouches for it; anything
    else (and everything with ``verify_reads``) is read whole by the reader, checked there (a raw object's
    checksum, an object store's ETag and size), and copied into a sealed memfd. ``lends``: whether ``reader``
    is a ``LendsDescriptors``, as its caller found once (None: found here). An ``isinstance`` of a runtime
    protocol looks up every member the protocol names (on Python 3.11 a property's getter included): 19 us of
    Python there, which every cold open paid in its worker thread, holding the interpreter's lock the loop wanted
    (issue 40).
    """
    if vouch and not verify_reads and (isinstance(reader, LendsDescriptors) if lends is None else lends):
        found = vouched(cast(LendsDescriptors, reader), node)  # as found above, or by the caller
        if found is not None:
            return found
    content = reader.open(node)
    try:
        if content.data is not None:
            fd = memfd_with(content.data, node.path)
            kind = "disk" if content.level == "disk" else "memfd"
            return Backing(fd, content.size, content.raw, kind, content.fallback, level=content.level,
                           version=content.version)
        if content.fd is not None:  # a local file too large to read whole: the source itself
            st = os.fstat(content.fd)  # before the descriptor is taken: one that fails is closed below
            fd, content.fd = content.fd, None
            return Backing(fd, content.size, content.raw, "source", content.fallback, stamp(st),
                           version=content.version, file_id=(st.st_dev, st.st_ino))
        return None
    finally:
        content.close()


def vouched(reader: LendsDescriptors, node: Node, *, cached_only: bool = False) -> Backing | None:
    """The descriptor ``StoreReader.choose`` picked for ``node``, when it may be handed to the kernel as it is:
    the source (as the catalog describes it, or changed: an original is served either way, the caller corrects
    its size), or a raw object a stat vouches for that nobody else can write in place. None when the object must
    be read whole and its checksum checked. ``cached_only``: BlockingIOError where that would wait for the disk."""
    chosen = reader.choose(node, cached_only=cached_only)
    try:
        if not chosen.raw:
            return Backing(chosen.take(), chosen.st.st_size, raw=False, kind="source", fallback=chosen.fallback,
                           stamp=stamp(chosen.st), version=chosen.version,
                           file_id=(chosen.st.st_dev, chosen.st.st_ino))
        if chosen.sealed and only_we_write(chosen.st):
            return Backing(chosen.take(), chosen.st.st_size, raw=True, kind="object", stamp=stamp(chosen.st),
                           file_id=(chosen.st.st_dev, chosen.st.st_ino))
        return None  # touched since prepare, or writable by others: read whole, checksum checked
    finally:
        chosen.close()


def only_we_write(st: os.stat_result) -> bool:
    """Whether nobody but this process's user (root, for a mount) can write the file in place.

    The kernel reads a passed-through object live, for as long as it is open: a write to it after the open
    checked it reaches readers already holding it. Objects that ``prepare`` wrote as the mount's own user, 0600
    (its umask), can only be written by that user; renaming or deleting them, which a writer of the store's
    directories can do, changes nothing behind a descriptor already open. Any other object is read whole into a
    sealed memfd and its checksum checked."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def still_sound(backing: Backing, fd: int | None = None) -> str | None:
    """None while a backing shared by the opens of one inode still is the file its first open checked; else
    what changed.  The kernel reads a source or object backing live: a later open must not be handed bytes
    changed since (it gets EIO until every open of the file is closed and the next first open decides again).
    Memfds are sealed and carry no stamp: nothing to re-check. ``fd``: a descriptor of the backing's file to
    look at (a copy's own), instead of the backing's."""
    if backing.stamp is None:
        return None
    try:
        now = stamp(os.fstat(backing.fd if fd is None else fd))
    except OSError as exc:
        return f"backing unreadable ({exc.strerror})"
    return None if now == backing.stamp else f"{'raw object' if backing.raw else 'source'} changed while open"


def _sealed_memfd(name: bytes | str, fill: Callable[[int], None]) -> int:
    """A memfd named after ``name``, filled by ``fill(fd)``, then sealed: nobody, the daemon included, can change
    what it serves afterwards."""
    # Cut as bytes, the kernel's measure: a file name may have 255 bytes (of multi-byte characters, or of none),
    # and a cut by characters left too many. The name is only a label in /proc/PID/fd: a character split at
    # the cut, or bytes that are no UTF-8, cost nothing: fsdecode's surrogates give the kernel the same bytes.
    label = os.path.basename(os.fsencode(name))[:_MEMFD_NAME_MAX] or b"liquidfs"
    fd = os.memfd_create(os.fsdecode(label), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        fill(fd)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def memfd_with(data: bytes | memoryview, name: bytes | str = b"liquidfs") -> int:
    """A sealed memfd holding ``data``."""
    def fill(fd: int) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])

    return _sealed_memfd(name, fill)


def content_digest(fd: int, size: int) -> int:
    """The xxh3-64 of the first ``size`` bytes of ``fd`` (a sealed memfd), seeded with that size, as a signed
    64-bit number: what tells two loops' copies of one file apart (``PassthroughPath._register``). In a worker
    thread, ~0.3 ms a 6 MB file; a hash object's ``update`` lets the interpreter's lock go while it hashes (the
    one-call ``xxh3_64_intdigest`` holds it, and the loop's thread waited)."""
    digest = xxhash.xxh3_64(seed=size)
    if size:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
            digest.update(view)
    return signed64(digest.intdigest())


def memfd_copy(fd: int, size: int, name: bytes | str = b"liquidfs") -> int:
    """A sealed memfd holding the first ``size`` bytes of ``fd``, copied by the kernel (``sendfile``): no byte
    passes through Python. The caller has just served these bytes, so their pages are usually still cached."""
    def fill(out: int) -> None:
        done = 0
        while done < size:
            sent = os.sendfile(out, fd, done, size - done)
            if sent == 0:
                raise OSError(errno.EIO, f"short copy: {done} of {size} bytes")
            done += sent

    return _sealed_memfd(name, fill)


def drop_pages(fd: int) -> None:
    """Drop the page-cache pages of a served file, so the kernel keeps no second, unplanned copy of the dataset."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as exc:
        log.debug("fadvise(DONTNEED): %s", exc)


#: Small files handed to the closer together: one or two wake-ups of its thread per batch, not one per file.
CLOSE_BATCH = 32
#: How long a batch not yet full waits for more before it is closed anyway (the loop went quiet).
CLOSE_WAIT = 0.05
_FIRST, _FULL = "first", "full"


class Closer:
    """Descriptors of served files let go off the loop: their pages dropped (``drop_pages``) and closed, in order,
    by one worker thread. Dropping the pages of a 6 MB file is ~0.4 ms of the kernel's work, and even a 110 KB
    file's ~30 us was a third of a warm open's CPU on the loop (bench_opens). A large file is handed over at once;
    small ones in batches (``close_soon``): a thread's wake-up and turn at the GIL per file cost more than the
    drop itself."""

    def __init__(self) -> None:
        self._files: collections.deque[tuple[int, bool]] = collections.deque()  # handed over, not closed yet
        self._wake: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.pending = 0  # descriptors handed over and not closed yet
        self.closed = 0   # descriptors it has closed

    def close(self, fd: int, *, drop: bool) -> None:
        """``fd`` is the closer's now: its pages dropped first where ``drop``, at once."""
        self._add(fd, drop)
        self._wake.put(_FULL)

    def close_soon(self, fd: int, *, drop: bool) -> None:
        """As ``close``, with the files handed over after it, up to ``CLOSE_BATCH`` or ``CLOSE_WAIT`` seconds."""
        self._add(fd, drop)
        # Counted after the append: the thread may empty the deque at any moment, and a file added after its last
        # look must still wake it.
        waiting = len(self._files)
        if waiting == 1:
            self._wake.put(_FIRST)
        elif waiting == CLOSE_BATCH:
            self._wake.put(_FULL)

    def _add(self, fd: int, drop: bool) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=CLOSER, daemon=True)
            self._thread.start()
        with self._lock:
            self.pending += 1
        self._files.append((fd, drop))

    def _run(self) -> None:
        name_this_thread(CLOSER)
        while True:
            why = self._wake.get()
            if why == _FIRST:  # a batch begins: closed when full or quiet
                try:
                    why = self._wake.get(timeout=CLOSE_WAIT)
                except queue.Empty:
                    pass
            while self._files:
                fd, drop = self._files.popleft()
                if drop:
                    drop_pages(fd)
                try:
                    os.close(fd)
                except OSError as exc:  # freed all the same (a FUSE or NFS source's flush error): this thread goes on
                    log.debug("closing a served file's descriptor: %s", exc)
                with self._lock:
                    self.pending -= 1
                    self.closed += 1
            if why is None:
                return

    def stop(self) -> None:
        """Close what was handed over, then end the thread (at unmount)."""
        if self._thread is not None:
            self._wake.put(None)
            self._thread.join()
            self._thread = None
