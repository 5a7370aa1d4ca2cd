"""The passthrough data path: each open is answered with a backing descriptor the kernel reads from itself.

With FUSE passthrough (kernel >= 6.9, libfuse >= 3.17, a pyfuse3 built with ``scripts/passthrough``, and
CAP_SYS_ADMIN in the initial user namespace) no read or mmap of a file reaches the daemon: its work per file is
one open and one release. The kernel allows one backing file per inode while any open of it exists, so an
inode's backing is shared by its concurrent opens and closed at the last release. Each open of a raw object
checks the object and the source again: where either changed while the inode is open, that open fails (EIO,
never the old image) and the next first open serves what the check then finds. The cache's latest decision
takes effect at the last release. A file that cannot have a backing (one too large to read whole from an object
store) is served by a daemon path beside.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import pyfuse3
import trio

from ..catalog.nodes import Node
from ..held.base import MemfdLevel
from ..metrics.stats import MountStats, Statistics
from ..policy.next_epoch import NO_CACHE, Decision
from ..stores.reader import WHOLE_FILE_LIMIT, Content, LendsDescriptors, Reader
from ..sysio.paths import CACHED_WALKS
from .backing import (Backing, Closer, SharedBacking, content_digest, drop_pages, memfd_copy, memfd_with, resolve,
                      still_sound, vouched)
from .daemon import DaemonPath, DaemonPathStatistics
from .inodes import Handle, Inode
from .shared_inodes import Conflict, SharedInodes, signed64
from .storage_calls import StorageCalls, in_thread

log = logging.getLogger(__name__)

#: Released source or object backings of this size and more are handed to a worker thread at once
#: (``backing.Closer``): dropping a 6 MB file's pages is ~0.4 ms of the loop's time. Smaller ones go in batches:
#: a thread's wake-up and its turn at the GIL per file cost the daemon more CPU than their drop (bench_opens: 237
#: against 167 us of CPU per 110 KB file with 8 readers), one per batch less than the ~30 us drop on the loop.
CLOSE_OFF_LOOP = 1 << 20
#: Worker threads copying released files into memfds at once, on a limiter of their own: the copies must not
#: wait behind storage reads or /proc lookups stuck in trio's default limiter, nor take all of its threads.
COPY_THREADS = 4
#: Seconds an open counted as a hit waits for the memfd its file's last release is still copying; past them it
#: is served from storage, as the miss it then is (a copy stuck on a slow backing must not hang the open).
KEEP_WAIT = 5.0


class Kernel(Protocol):
    """Registers backing descriptors with the FUSE connection (a fake in unit tests)."""

    def register(self, fd: int) -> int: ...

    def unregister(self, backing_id: int) -> None: ...


class FuseKernel:
    """The FUSE connection of this process, through the patched pyfuse3 (``scripts/passthrough``)."""

    def register(self, fd: int) -> int:
        return int(pyfuse3.passthrough_open(fd))  # type: ignore[attr-defined]

    def unregister(self, backing_id: int) -> None:
        pyfuse3.passthrough_close(backing_id)  # type: ignore[attr-defined]


def built_in() -> str | None:
    """None when this pyfuse3 can ask for passthrough; else why not (for ``doctor`` and the mount's log)."""
    if not hasattr(pyfuse3, "passthrough_open") or not hasattr(pyfuse3.FileInfo, "backing_id"):
        if os.geteuid() != 0:  # install.sh skips the build without root: rebuilding would change nothing
            return ("this pyfuse3 has no passthrough (a stock build), and passthrough needs root "
                    "(CAP_SYS_ADMIN) anyway: a non-root mount serves reads through the daemon")
        return ("this pyfuse3 has no passthrough (a stock build): install with scripts/install.sh, which "
                "builds it against libfuse >= 3.17")
    return None


def engaged(kernel: Kernel | None = None) -> str | None:
    """After the connection's INIT: None when backing files can be registered, else why not.

    A memfd is registered and closed again: the kernel checks CAP_SYS_ADMIN at each registration, not at INIT.
    """
    missing = built_in()
    if missing:
        return missing
    if not pyfuse3.passthrough_enabled():  # type: ignore[attr-defined]
        return ("the kernel did not offer FUSE passthrough at INIT (needs Linux >= 6.9 with "
                "CONFIG_FUSE_PASSTHROUGH, and libfuse >= 3.17)")
    kernel = kernel or FuseKernel()
    fd = memfd_with(b"probe")
    try:
        backing_id = kernel.register(fd)
    except OSError as exc:
        if exc.errno == errno.EPERM:
            return "registering a backing file was refused (EPERM): the daemon lacks CAP_SYS_ADMIN"
        return f"registering a backing file failed: {os.strerror(exc.errno or errno.EIO)}"
    finally:
        os.close(fd)
    kernel.unregister(backing_id)
    return None


@dataclass(slots=True)
class _Keeping:
    """A released file's copy into a memfd, under way (``PassthroughPath._keep``)."""

    done: trio.Event = field(default_factory=trio.Event)
    #: Opens counted as hits that wait for the copy: it is kept for them even if the policy let the file go
    #: meanwhile (their own hit did, when it was not held again), and they release it once served.
    waiting: int = 0


@dataclass(slots=True)
class _Copying:
    """A copy into a memfd in its worker thread (``PassthroughPath.blocking_copy``): ended, or abandoned while
    it runs."""

    done: bool = False
    abandoned: bool = False


@dataclass(frozen=True, slots=True)
class PassthroughStatistics(Statistics):
    passthrough_open_inodes: int  # inodes with a backing registered now
    closes_pending: int           # backing descriptors queued for closing
    ranges: DaemonPathStatistics  # the daemon path beside it, for files that get no backing

    def values(self) -> dict[str, object]:
        return {**self.ranges.values(), "passthrough_open_inodes": self.passthrough_open_inodes,
                "closes_pending": self.closes_pending}


class PassthroughPath:
    """Opens and releases on the passthrough data path (on the trio thread; storage work in worker threads)."""

    name = "passthrough"

    def __init__(self, kernel: Kernel, reader: Reader, stats: MountStats, calls: StorageCalls,
                 *, ranges: DaemonPath, held: MemfdLevel | None = None, verify_reads: bool = False,
                 drop_served_pages: bool = True, on_cold_open: Callable[[Node], None] | None = None) -> None:
        """``on_cold_open``: told of each open whose metadata was not in memory (``MetadataAhead.went_cold``)."""
        self.kernel = kernel
        self.reader = reader
        self.stats = stats
        self.calls = calls
        #: Serves the files that get no backing, in ranges; it holds nothing for the next epoch.
        self.ranges = ranges
        self.held = held
        self.verify_reads = verify_reads
        self.drop_served_pages = drop_served_pages
        self._open_inodes = 0  # inodes with a shared backing (``Inode.shared``)
        self._closer = Closer()
        #: Files whose memfd is being copied from the backing their last open released (``_keep``): an open that
        #: the policy counts as a hit meanwhile waits for it, rather than reading storage (a lost hit).
        self._keeping: dict[int, _Keeping] = {}
        self._copies = trio.CapacityLimiter(COPY_THREADS)
        self._copies_stuck = 0  # copies abandoned past --io-timeout whose threads have not ended yet
        self._copies_lock = threading.Lock()
        self.on_cold_open = on_cold_open
        #: ``mount --loops``: the backings every loop shares, and this loop's index (``join_loops``).
        self.shared: SharedInodes | None = None
        self.loop = 0
        #: Whether the reader lends its descriptors (``backing.resolve``), found once: an ``isinstance`` of a
        #: runtime protocol cost 19 us on Python 3.11, more than the rest of a cold open's Python.
        lends = reader if isinstance(reader, LendsDescriptors) else None
        self.lends = lends is not None
        # A reader whose vouched backings are local descriptors opens them on the loop itself (see ``_backing``).
        # Without openat2 no walk can ask for the kernel's caches only: each would fail at once, count as a cold
        # open and have the read-ahead warm its directory again, for nothing.
        self.lender = lends if lends is not None and reader.inline_check and not verify_reads and CACHED_WALKS \
            else None

    async def open(self, node: Node, record: Inode, fh: int, job: int = 0) -> Handle:
        """One more open of ``node``, answered with its inode's backing; a file without one is served by
        ``ranges``."""
        entry = record.shared
        while entry is not None:
            handle = await self._join(node, record, entry, fh, job)
            if handle is not None:
                return handle
            entry = record.shared  # the open it waited for was interrupted: this one decides, or joins who does
        entry = record.shared = SharedBacking()
        self._open_inodes += 1
        decision = NO_CACHE
        backing: Backing | None = None
        try:
            if self.held is not None:
                decision = self.held.decide(node.id, record.size_told(node), job)
            backing = await self._backing(node, decision)
            if backing is not None:
                backing, entry.backing_id = await self._registered(node, backing)
            entry.backing = backing
            self._decide_keep(node, entry, decision)
        except BaseException as exc:
            if isinstance(exc, trio.Cancelled):  # its reader was interrupted: no failure of the file's
                entry.abandoned = True
            else:
                entry.failed = (exc.errno or errno.EIO) if isinstance(exc, OSError) else errno.EIO
            if decision.hold and self.held is not None:
                self.held.could_not_keep(node.id)
            if backing is not None and entry.backing_id:  # registered, then failed: no open serves it
                self._unregister(node.id, entry.backing_id)
                backing.close()
            entry.backing, entry.backing_id = None, 0
            # The opens that waited take the outcome; one that comes later makes its own entry, never
            # inheriting a failure of the past.
            entry.opens -= 1
            self._detach(record, entry)
            raise
        finally:
            entry.settle()
        if backing is None:
            self._release_entry(record, entry)
            return await self.ranges.open(node, record, fh, job)
        self.stats.passthrough_opens += 1
        _count_backing(self.stats, backing.kind)
        return self._handle(node, record, fh, entry)

    async def _join(self, node: Node, record: Inode, entry: SharedBacking, fh: int, job: int) -> Handle | None:
        """An open of an inode another open has decided (or is deciding) the backing of: it shares that
        backing, or its failure; None where that open was interrupted before it decided."""
        entry.opens += 1  # counted before waiting, so a release meanwhile does not close it under us
        try:
            await entry.wait_settled()
        except BaseException:  # cancelled while the first open decides: this one is not counted
            self._release_entry(record, entry)
            raise
        if entry.backing is None:
            self._release_entry(record, entry)
            if entry.failed is not None:
                raise OSError(entry.failed, "the open it waited for failed", os.fsdecode(node.path))
            if entry.abandoned:
                return None
            return await self.ranges.open(node, record, fh, job)
        try:
            backing = entry.backing
            if backing.stamp is None or self.reader.inline_check:
                changed = still_sound(backing)  # no stat (a memfd), or one the local kernel answers
            else:  # an fstat of a source on NFS or FUSE may wait on its server: never on the loop
                changed = await self.calls.run(node, still_sound, backing, for_open=True)
            if changed is None:
                # The source's identity is checked at every open that serves a raw object, or an original (a
                # copy in a memfd, or the source's old inode: a source replaced since must not get the old
                # image), against the catalog or, for a source changed since the scan, the version the first
                # open read; that open's check vouched for that open only.
                changed = await self.calls.source_changed(node, backing.version)
            if changed is None:
                self._count_again(node, record, entry, job)
        except BaseException:  # the count taken above goes with this open, or the backing outlives every reader
            self._release_entry(record, entry)
            raise
        if changed is not None:  # one backing per inode while it is open: no other can be given now
            self._release_entry(record, entry)
            raise OSError(errno.EIO, f"{changed}: reopen once its other opens are closed",
                          os.fsdecode(node.path))
        self.stats.passthrough_opens += 1
        return self._handle(node, record, fh, entry)

    def _count_again(self, node: Node, record: Inode, entry: SharedBacking, job: int) -> None:
        """An open of a file open already is a read the policy counts like any: the kernel sends a RELEASE in
        the background after the reader's close returned, so the next epoch's open of a file read at the end of
        the last one may find that open still here (CI: 170 of an epoch's 1,500 tiny files went uncounted). It
        shares the backing; its decision, the latest, says whether the last release keeps the file. A hit of a
        file held by that open (its memfd is made at the release) counts as one: its bytes are the ones that open
        has just had read, in the page cache until the last release, and no storage read is made for it."""
        if self.held is None:
            return
        decision = self.held.decide(node.id, record.size_told(node), job)
        if decision.hit:
            self.held.release(node.id)  # not held again, the level's memfd goes, as at a hit in ``_backing``
        self._decide_keep(node, entry, decision)

    def _decide_keep(self, node: Node, entry: SharedBacking, decision: Decision) -> None:
        """Whether the last release keeps ``entry``'s backing for the next epoch: where the policy holds the file
        and the backing holds its bytes as served (not a fallback, nor another size). A hold that cannot be kept
        gives its room back."""
        backing = entry.backing
        entry.keep = decision.hold and backing is not None and backing.fallback is None \
            and backing.size == node.size_served
        if decision.hold and not entry.keep:
            assert self.held is not None
            self.held.could_not_keep(node.id)

    def join_loops(self, shared: SharedInodes, loop: int) -> None:
        """Serve as loop ``loop`` of several (``mount --loops``): an inode's backing is the one every loop's
        opens share (``shared_inodes``)."""
        self.shared, self.loop = shared, loop

    async def _registered(self, node: Node, backing: Backing) -> tuple[Backing, int]:
        """``backing`` registered (``_register``): the backing this open serves, and its id; where it fails, what it
        was given is closed.

        With several loops, another loop's open of the file may hold the other kind of backing: its memfd (a hit
        of its cache) where this open has the file itself, or the file where this one read the bytes whole. Their
        identities differ (a digest, an inode), but the bytes may well be the same: the next epoch's open of a
        file read at the end of the last one finds that open's RELEASE still pending (CI: 170 of an epoch's
        1,500 files), and such a pair failed with EIO. This open's bytes are made the other kind, then, and
        share that backing where they are the same; only other bytes are refused (``Conflict``)."""
        try:
            return backing, self._register(node, backing)
        except Conflict as exc:
            conflict = exc
        except BaseException:
            self._close_served(backing)
            raise
        try:
            other = await self._other_kind(node, backing, conflict.held_in_memory)
        finally:
            self._close_served(backing)  # replaced, or refused: it serves no open
        if other is None:
            raise conflict
        try:
            backing_id = self._register(node, other)
        except BaseException:
            self._close_served(other)
            raise
        self.stats.backings_recast += 1
        return other, backing_id

    async def _other_kind(self, node: Node, backing: Backing, held_in_memory: bool) -> Backing | None:
        """``backing``'s bytes as the kind of backing another loop's open holds (``_registered``;
        ``held_in_memory``: a memfd): a file's copied into a sealed memfd (its digest taken) where it is no larger
        than what is read whole, or the file itself where this open's memfd holds them and the reader vouches
        for the file as it is; None where the other loop's is the same kind (other bytes, then), or there is no
        other kind (only loops share backings, and a reader that lends no descriptors has no file to give)."""
        if self.shared is None:
            return None
        if backing.kind in ("source", "object"):
            if not held_in_memory or backing.size > WHOLE_FILE_LIMIT:
                return None
            fd, digest = await self.blocking_copy(backing, digest=True)
            return Backing(fd, backing.size, backing.raw, "memfd", backing.fallback, level=backing.level,
                           digest=digest, version=backing.version)
        if held_in_memory or not self.lends or self.verify_reads:
            return None
        found = await self.calls.run(node, vouched, self.reader, node, for_open=True)
        if found is not None and (found.raw, found.size) != (backing.raw, backing.size):
            self._close_served(found)  # another representation or size than this open decided on: other bytes
            return None
        return found

    def _register(self, node: Node, backing: Backing) -> int:
        """The backing id of ``backing`` for this open: registered here, or, with several loops, the one another
        loop registered for the very same file (a backing of other bytes: ``Conflict``, EIO)."""
        if self.shared is None:
            return self.kernel.register(backing.fd)
        if backing.kind in ("memfd", "disk"):
            # Bytes read whole (and checked): where two loops' memfds hold the same bytes, the first registered
            # serves them all, as one loop's later opens share its first open's memfd without reading again. The
            # same bytes, which their digest says (a size alone did not: an original edited in place between two
            # loops' reads, a raw object and an original of one size).
            digest = backing.digest if backing.digest is not None else content_digest(backing.fd, backing.size)
            identity = (-2 - backing.raw, digest)
        else:
            # The stat the backing's check took off the loop (an fstat here waited on an NFS or FUSE source's
            # server with the loop's every request behind it).
            file_id = backing.file_id
            if file_id is None:  # (every source or object backing is made with it)
                st = os.fstat(backing.fd)
                file_id = (st.st_dev, st.st_ino)
            identity = (signed64(file_id[0]), signed64(file_id[1]))
        return self.shared.attach(node.id, self.loop, identity, lambda: self.kernel.register(backing.fd),
                                  self.kernel.unregister)

    @staticmethod
    def _handle(node: Node, record: Inode, fh: int, entry: SharedBacking) -> Handle:
        backing = entry.backing
        assert backing is not None
        content = Content(size=backing.size, raw=backing.raw, fallback=backing.fallback, version=backing.version)
        return Handle(content, node, fh=fh, inode=record, backing_id=entry.backing_id)

    async def _backing(self, node: Node, decision: Decision) -> Backing | None:
        if decision.hit:
            assert self.held is not None
            keeping = self._keeping.get(node.id)
            copied = True
            if keeping is not None:  # released just now (DALI reopens a file soon after its last release)
                keeping.waiting += 1
                try:
                    with trio.move_on_after(KEEP_WAIT):
                        await keeping.done.wait()
                    copied = keeping.done.is_set()
                except BaseException:
                    # Cancelled (the reader was interrupted): a copy kept only for this open is let go.
                    if keeping.done.is_set():
                        self.held.release(node.id)
                    raise
                finally:
                    keeping.waiting -= 1
            held = self.held.get(node.id) if copied else None
            if held is not None:
                # This open's own descriptor of the memfd, taken before the wait below: meanwhile another open's
                # decision may let the held file go, and the level closes its descriptor then.
                try:
                    served = Backing(os.dup(held.fd), held.size, held.raw, "memfd", digest=held.digest)
                finally:
                    # Not held again at this hit, or let go while its copy was made (kept for this open): its
                    # memfd lives as long as this open (where the dup failed, EMFILE: not at all).
                    self.held.release(node.id)
                try:
                    changed = await self.calls.source_changed(node)
                except BaseException:
                    served.close()
                    raise
                if changed is None:
                    self.stats.served_from("memory", held.size)
                    return served
                served.close()
                self.held.drop(node.id)  # stale: the source changed after the bytes were taken
                self.held.lost_hit(decision, node.size_served)  # (read from storage: no hit, as the stats tell)
            else:  # counted as a hit, but the bytes are gone (a copy that failed)
                self.held.lost_hit(decision, node.size_served)
        backing = None
        vouch = True
        if self.lender is not None:
            # Two opens and a stat answered from the kernel's caches: cheaper here than the hop to a worker
            # thread. Where a dentry or inode is not in memory the open says so (EAGAIN) instead of waiting for
            # the disk on this thread, and goes to a worker thread, where cold opens proceed in parallel.
            try:
                backing = vouched(self.lender, node, cached_only=True)
                vouch = False  # not vouched for by a stat: read whole below
            except BlockingIOError:
                self.stats.cold_opens += 1
                if self.on_cold_open is not None:
                    self.on_cold_open(node)
        if backing is None:
            backing = await self.calls.run(node, self._resolve, node, vouch, for_open=True)
        if backing is not None:
            self.stats.served_from(backing.level, backing.size)
        return backing

    def _resolve(self, node: Node, vouch: bool = True) -> Backing | None:
        """``resolve``, in a worker thread; a memfd's digest taken here too, where loops share backings."""
        backing = resolve(self.reader, node, verify_reads=self.verify_reads, vouch=vouch, lends=self.lends)
        if backing is not None and self.shared is not None and backing.kind in ("memfd", "disk"):
            try:
                backing.digest = content_digest(backing.fd, backing.size)
            except BaseException:
                backing.close()
                raise
        return backing

    def _release_entry(self, record: Inode, entry: SharedBacking) -> None:
        """An open that is not served (it failed, was cancelled, or is served by ``ranges``) lets go of ``entry``;
        where it was the last, and the entry holds a backing, the backing goes as at a release: an open that
        joined, and failed its check of the source after the first open's release, was the last, and nothing
        else let go of the backing (its descriptor and id for good, and with several loops its slot, so that every
        later open of the file in any loop failed with EIO)."""
        entry.opens -= 1
        if entry.opens <= 0:
            self._detach(record, entry)
            backing = entry.backing
            if backing is not None and entry.backing_id:
                last = self._unregister(record.id, entry.backing_id)
                entry.backing, entry.backing_id = None, 0
                self._close_served(backing, drop=last)
                if entry.keep and self.held is not None:  # not kept: the room the policy gave it goes back
                    self.held.could_not_keep(record.id)

    def _detach(self, record: Inode, entry: SharedBacking) -> None:
        """``entry`` is no longer the inode's: the next open makes its own."""
        if record.shared is entry:
            record.shared = None
            self._open_inodes -= 1

    def _unregister(self, inode: int, backing_id: int) -> bool:
        """This loop lets go of the inode's backing id (with several loops, the last loop's user closes it).
        Whether no loop serves the inode now (another loop's reader still reads its file's pages)."""
        if self.shared is not None:
            return self.shared.detach(inode, self.loop, self.kernel.unregister)
        try:
            self.kernel.unregister(backing_id)
        except OSError as exc:
            log.warning("closing backing %d of inode %d: %s", backing_id, inode, exc)
        return True

    async def read(self, handle: Handle, off: int, size: int) -> bytes | memoryview:
        if not handle.backing_id:
            return await self.ranges.read(handle, off, size)
        # A READ that still reaches the daemon (the kernel may send some, e.g. readahead racing an open) is
        # answered from the backing.
        assert handle.node is not None and handle.inode is not None
        entry = handle.inode.shared
        if entry is None or entry.backing is None or entry.backing.fd < 0:
            raise OSError(errno.EBADF, "not open")
        data: bytes = await self.calls.run(handle.node, os.pread, entry.backing.fd, size, off)
        return data

    async def release(self, handle: Handle) -> None:
        """One open is closed; at the last of its inode, the backing goes (kept for the next epoch, or its
        pages dropped)."""
        if not handle.backing_id:
            await self.ranges.release(handle)
            return
        record = handle.inode
        assert record is not None
        entry = record.shared
        if entry is None:
            return
        entry.opens -= 1
        if entry.opens > 0:
            return
        record.shared = None  # the next open makes a new entry, whatever happens below
        self._open_inodes -= 1
        inode = record.id
        backing = entry.backing
        assert backing is not None
        last = self._unregister(inode, entry.backing_id)
        # Kept only if the policy still holds it: another job's read may have taken its room meanwhile.
        keep = entry.keep and self.held is not None and inode in self.held.policy.held
        if not keep:
            self._close_served(backing, drop=last)
            return
        try:
            await self._keep(inode, backing)
        finally:
            # off the loop: the close of a FUSE or NFS source waits on its server
            self._close_served(backing, drop=last)

    def _close_served(self, backing: Backing, drop: bool = True) -> None:
        """A backing no open of this loop serves any more, not kept. A file of the source or the store: closed
        off the loop, a large one at once, small ones in batches, and its pages dropped (``drop``: unless another
        loop still serves the file, ``mount --loops``: the pages are the file's, and its reader's would go with
        them). A memfd is closed here: the memory it holds is counted, and must be given back by the time the
        next open is answered."""
        if backing.kind not in ("source", "object"):
            backing.close()
            return
        fd, backing.fd = backing.fd, -1
        drop = drop and self.drop_served_pages
        if backing.size >= CLOSE_OFF_LOOP:
            self._closer.close(fd, drop=drop)
        else:
            self._closer.close_soon(fd, drop=drop)

    async def _keep(self, inode: int, backing: Backing) -> None:
        """Copy ``backing`` into a memfd the level keeps for ``inode`` (the caller saw the policy still holds it)."""
        assert self.held is not None
        keeping = self._keeping[inode] = _Keeping()
        try:
            fd, digest = await self._memfd_of(backing)
        except OSError as exc:
            log.warning("cannot keep inode %d for the next epoch: %s", inode, exc)
            self.held.could_not_keep(inode)
            return
        except BaseException:  # cancelled (an unmount) or a fault: its room given back all the same
            self.held.could_not_keep(inode)
            raise
        finally:
            if self._keeping.get(inode) is keeping:
                del self._keeping[inode]
            keeping.done.set()  # (the waiters run after ``keep`` below: no checkpoint between)
        if inode not in self.held.policy.held and not keeping.waiting:
            # Let go while it was copied (another job's read took its room) and no open waits for it.
            os.close(fd)
            return
        self.held.keep(inode, fd, backing.size, backing.raw, digest)
        # (the file's pages are dropped as it is closed, ``_close_served``: the memfd is the copy the budget counts)

    async def _memfd_of(self, backing: Backing) -> tuple[int, int | None]:
        """A sealed memfd of the backing's bytes, the caller's (the backing itself where it is one already), and
        its digest where loops share backings (``_register``)."""
        if backing.kind in ("memfd", "disk"):
            return os.dup(backing.fd), backing.digest
        return await self.blocking_copy(backing, digest=self.shared is not None)

    async def blocking_copy(self, backing: Backing, digest: bool = False) -> tuple[int, int | None]:
        """The copy (and its digest where asked) in one worker thread: one hop, not two. Under ``--io-timeout``,
        as every storage call: a copy stuck on a source that stopped answering is abandoned (EIO; its memfd
        closed whenever it ends), never a RELEASE, nor the unmount after it, waiting for good. It reads a
        descriptor of its own, which its thread closes (the caller's may be closed and its number reused
        meanwhile; the close of a FUSE or NFS file waits on its server). Once COPY_THREADS abandoned copies are
        still stuck, further copies fail at once rather than park one more thread each."""
        if self._copies_stuck >= COPY_THREADS:
            raise OSError(errno.EIO, f"{self._copies_stuck} copies into memory are stuck: the storage does not "
                                     "answer")
        copying = _Copying()

        def copy() -> tuple[int, int | None]:
            try:
                # A descriptor of its own, taken as it starts (its caller waits meanwhile, the backing open): the
                # caller's may be closed, and its number reused, once it gave up (what the copy then made is
                # discarded); and the close of a FUSE or NFS file, which waits on its server, is this thread's.
                fd = os.dup(backing.fd)
                try:
                    made = _copy_of(fd, backing.size, digest)
                    # The file as its open checked it, still: a copy of one rewritten meanwhile (torn) would be
                    # held, and served at later hits, as those bytes (a hit checks the source, not this copy).
                    changed = still_sound(backing, fd)
                    if changed is not None:
                        os.close(made[0])
                        raise OSError(errno.EIO, f"{changed} while it was copied into memory")
                    return made
                finally:
                    try:
                        os.close(fd)
                    except OSError as exc:  # freed all the same (a flush error of a FUSE or NFS source)
                        log.debug("closing a copied file's descriptor: %s", exc)
            finally:
                with self._copies_lock:
                    copying.done = True
                    if copying.abandoned:
                        self._copies_stuck -= 1

        async with self._copies:
            try:
                with trio.move_on_after(self.calls.io_timeout):
                    return await in_thread(copy, discard=_close_copy)
            except trio.Cancelled:
                self._left_running(copying)
                raise
        self._left_running(copying)
        raise OSError(errno.EIO, f"copying a file into memory took more than {self.calls.io_timeout:g} s")

    def _left_running(self, copying: _Copying) -> None:
        """A copy given up on (timed out, cancelled): counted stuck while its thread runs on."""
        with self._copies_lock:
            if not copying.done:
                copying.abandoned = True
                self._copies_stuck += 1

    async def warm_one(self, node: Node) -> int | None:
        assert self.held is not None
        backing = await self.calls.run(node, self._resolve, node)
        if backing is None:
            return None
        try:
            if backing.fallback is not None or backing.size != node.size_served:
                return None
            fd, digest = await self._memfd_of(backing)
            if backing.kind in ("source", "object"):
                drop_pages(backing.fd)
            if not self.held.hold_now(node.id, fd, backing.size, backing.raw, digest):
                os.close(fd)
                return None
            return backing.size
        finally:
            self._close_served(backing)

    def close(self) -> None:
        """At unmount: the descriptors queued for closing are closed."""
        self._closer.stop()

    def statistics(self) -> PassthroughStatistics:
        return PassthroughStatistics(passthrough_open_inodes=self._open_inodes, closes_pending=self._closer.pending,
                                     ranges=self.ranges.statistics())


def _copy_of(fd: int, size: int, digest: bool) -> tuple[int, int | None]:
    """``memfd_copy`` of ``fd`` and, where ``digest``, its ``content_digest`` (in the caller's worker thread)."""
    copy = memfd_copy(fd, size)
    if not digest:
        return copy, None
    try:
        return copy, content_digest(copy, size)
    except BaseException:
        os.close(copy)
        raise


def _close_copy(copied: tuple[int, int | None]) -> None:
    """What an abandoned copy made (``blocking_copy``): its memfd, closed."""
    os.close(copied[0])


def _count_backing(stats: MountStats, kind: str) -> None:
    """One more open served from a backing of ``kind`` (``backing.Backing.kind``)."""
    if kind == "source":
        stats.backing_source += 1
    elif kind == "object":
        stats.backing_object += 1
    elif kind == "memfd":
        stats.backing_memfd += 1
    elif kind == "disk":
        stats.backing_disk += 1
