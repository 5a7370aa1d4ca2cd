"""The passthrough data path: each open is answered with a backing descriptor the kernel reads from itself.

With FUSE passthrough (kernel >= 6.9, libfuse >= 3.17, a pyfuse3 built with ``scripts/passthrough``, and
CAP_SYS_ADMIN in the initial user namespace) no read or mmap of a file reaches the daemon: its work per file is
one open and one release. The kernel allows one backing file per inode while any open of it exists, so an
inode's backing is shared by its concurrent opens and closed at the last release; a decision that changes
while the inode is open (a source edited, the cache letting it go) takes effect at its next first open.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyfuse3
import trio

from .backing import Backing, ContentReader, drop_pages, memfd_copy, memfd_with, resolve, still_sound, vouched
from .reader import StoreReader
from .cache import Decision
from .catalog import Node
from .memtier import MemoryTier
from .stats import MountStats

log = logging.getLogger(__name__)

NO_CACHE = Decision(hit=False, hold=False, epoch=0)


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


@dataclass(eq=False, slots=True)
class _Inode:
    """One inode's backing while any open of it exists."""

    opens: int = 1
    backing: Backing | None = None
    backing_id: int = 0
    keep: bool = False            # the policy decided at the first open to hold it for the next epoch
    failed: int | None = None     # the errno the first open failed with (concurrent opens fail too)
    ready: trio.Event = field(default_factory=trio.Event)


@dataclass(frozen=True, slots=True)
class Opened:
    """What the FUSE layer answers an open with."""

    backing_id: int
    size: int
    raw: bool
    fallback: str | None


Blocking = Callable[..., Awaitable[Any]]


class PassthroughPath:
    """Opens and releases on the passthrough data path (on the trio thread; storage work via ``blocking``)."""

    def __init__(self, kernel: Kernel, reader: ContentReader, stats: MountStats, blocking: Blocking,
                 *, memory: MemoryTier | None = None, verify_reads: bool = False,
                 drop_served_pages: bool = True, source_changed: Callable[[Node], Awaitable[str | None]]) -> None:
        self.kernel = kernel
        self.reader = reader
        self.stats = stats
        self.blocking = blocking
        self.memory = memory
        self.verify_reads = verify_reads
        self.drop_served_pages = drop_served_pages
        self.source_changed = source_changed
        self._inodes: dict[int, _Inode] = {}
        # A local store's vouched backings are opened on the loop itself (see ``_backing``).
        self.inline = isinstance(reader, StoreReader) and reader.inline_check and not verify_reads

    async def open(self, node: Node, size: int) -> Opened | None:
        """The backing of one more open of ``node`` (``size`` bytes as the kernel was told); None when it has
        none (a file the daemon serves in ranges): the caller serves that open itself."""
        entry = self._inodes.get(node.id)
        if entry is not None:
            entry.opens += 1  # counted before waiting, so a release meanwhile does not close it under us
            await entry.ready.wait()
            if entry.backing is None:
                self._release_entry(node.id, entry)
                if entry.failed is not None:
                    raise OSError(entry.failed, "the open it waited for failed", os.fsdecode(node.path))
                return None
            changed = still_sound(entry.backing)
            if changed is not None:  # one backing per inode while it is open: no other can be given now
                self._release_entry(node.id, entry)
                raise OSError(errno.EIO, f"{changed}: reopen once its other opens are closed",
                              os.fsdecode(node.path))
            self.stats.passthrough_opens += 1
            return Opened(entry.backing_id, entry.backing.size, entry.backing.raw, entry.backing.fallback)
        entry = self._inodes[node.id] = _Inode()
        decision = NO_CACHE
        try:
            if self.memory is not None:
                decision = self.memory.decide(node.id, size)
            backing = await self._backing(node, decision)
            if backing is not None:
                try:
                    entry.backing_id = self.kernel.register(backing.fd)
                except BaseException:
                    backing.close()
                    raise
            entry.backing = backing
            entry.keep = decision.hold and backing is not None and backing.fallback is None \
                and backing.size == node.size_served
            if decision.hold and not entry.keep:
                assert self.memory is not None
                self.memory.could_not_keep(node.id)
        except BaseException as exc:
            entry.failed = (exc.errno or errno.EIO) if isinstance(exc, OSError) else errno.EIO
            if decision.hold and self.memory is not None:
                self.memory.could_not_keep(node.id)
            self._release_entry(node.id, entry)
            raise
        finally:
            entry.ready.set()
        if backing is None:
            self._release_entry(node.id, entry)
            return None
        self.stats.passthrough_opens += 1
        setattr(self.stats, f"backing_{backing.kind}", getattr(self.stats, f"backing_{backing.kind}") + 1)
        return Opened(entry.backing_id, backing.size, backing.raw, backing.fallback)

    async def _backing(self, node: Node, decision: Decision) -> Backing | None:
        if decision.hit:
            assert self.memory is not None
            held = self.memory.held(node.id)
            if held is not None:
                if await self.source_changed(node) is None:
                    self.stats.bytes_from_memory += held.size
                    served = Backing(os.dup(held.fd), held.size, held.raw, "memfd")
                    if not decision.hold:  # the policy no longer holds it: its memfd lives as long as this open
                        self.memory.release(node.id)
                    return served
                self.memory.drop(node.id)  # stale: the source changed after the bytes were taken
            else:  # counted as a hit, but the bytes are gone (a copy that failed)
                self.stats.reclaimed += 1
                if decision.epoch:
                    self.memory.policy.correct_miss(decision.epoch, node.size_served)
        backing = None
        vouch = True
        if self.inline:
            # Two opens and a stat answered from the kernel's caches: cheaper here than the hop to a worker
            # thread. Where a dentry or inode is not in memory the open says so (EAGAIN) instead of waiting for
            # the disk on this thread, and goes to a worker thread, where cold opens proceed in parallel.
            try:
                backing = vouched(self.reader, node, cached_only=True)  # type: ignore[arg-type]
                vouch = False  # not vouched for by a stat: read whole below
            except BlockingIOError:
                self.stats.cold_opens += 1
        if backing is None:
            backing = await self.blocking(node, self._resolve, node, vouch)
        if backing is not None:
            if backing.kind == "disk":
                self.stats.bytes_from_disk += backing.size
            else:
                self.stats.bytes_from_storage += backing.size
        return backing

    def _resolve(self, node: Node, vouch: bool = True) -> Backing | None:
        return resolve(self.reader, node, verify_reads=self.verify_reads, vouch=vouch)

    def _release_entry(self, inode: int, entry: _Inode) -> None:
        entry.opens -= 1
        if entry.opens <= 0 and self._inodes.get(inode) is entry:
            del self._inodes[inode]

    async def release(self, inode: int) -> None:
        """One open of ``inode`` is closed; at the last, the backing goes (kept for the next epoch, or its
        pages dropped)."""
        entry = self._inodes.get(inode)
        if entry is None:
            return
        entry.opens -= 1
        if entry.opens > 0:
            return
        del self._inodes[inode]  # the next open makes a new entry, whatever happens below
        backing = entry.backing
        assert backing is not None
        try:
            self.kernel.unregister(entry.backing_id)
        except OSError as exc:
            log.warning("closing backing %d of inode %d: %s", entry.backing_id, inode, exc)
        try:
            if entry.keep:
                await self._keep(inode, backing)
            elif self.drop_served_pages and backing.kind in ("source", "object"):
                drop_pages(backing.fd)
        finally:
            backing.close()

    async def _keep(self, inode: int, backing: Backing) -> None:
        assert self.memory is not None
        if inode not in self.memory.policy.held:
            return  # let go meanwhile (an epoch ended without reading it)
        try:
            if backing.kind in ("memfd", "disk"):  # already a sealed memfd: keep it as it is
                fd = os.dup(backing.fd)
            else:
                fd = await self.blocking_copy(backing)
        except OSError as exc:
            log.warning("cannot keep inode %d for the next epoch: %s", inode, exc)
            self.memory.could_not_keep(inode)
            return
        self.memory.keep(inode, fd, backing.size, backing.raw)
        if self.drop_served_pages and backing.kind in ("source", "object"):
            drop_pages(backing.fd)  # the memfd is the copy the budget counts; no second one in the page cache

    async def blocking_copy(self, backing: Backing) -> int:
        return await trio.to_thread.run_sync(memfd_copy, backing.fd, backing.size)

    async def warm_up(self, files: list[Node],
                      progress: Callable[[int, int], None] = lambda files, total: None) -> tuple[int, int]:
        """Fill the memory tier with a random budget's worth of files before the first epoch."""
        assert self.memory is not None
        nodes = {n.id: n for n in files}
        held = total = 0
        for node_id in self.memory.policy.warmup_choice([(i, n.size_served) for i, n in nodes.items()]):
            node = nodes[node_id]
            try:
                backing = await self.blocking(node, self._resolve, node)
            except OSError as exc:
                log.warning("warm-up: %s: %s", os.fsdecode(node.path), exc)
                continue
            if backing is None:
                continue
            try:
                if backing.fallback is not None or backing.size != node.size_served:
                    continue
                fd = os.dup(backing.fd) if backing.kind in ("memfd", "disk") else await self.blocking_copy(backing)
                if backing.kind in ("source", "object"):
                    drop_pages(backing.fd)
                if not self.memory.hold_now(node_id, fd, backing.size, backing.raw):
                    os.close(fd)
                    continue
                held += 1
                total += backing.size
                progress(held, total)
            finally:
                backing.close()
        return held, total

    def backing_fd(self, inode: int) -> int:
        """The descriptor an open inode is served from: a READ that still reaches the daemon (the kernel may
        send some, e.g. readahead racing an open) is answered from it."""
        entry = self._inodes.get(inode)
        if entry is None or entry.backing is None or entry.backing.fd < 0:
            raise OSError(errno.EBADF, "not open")
        return entry.backing.fd

    def open_inodes(self) -> int:
        return len(self._inodes)
