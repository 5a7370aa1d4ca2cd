"""The FUSE layer: translates kernel requests into catalog queries and reads, and nothing else.

Only ``FUSEError`` may leave a handler: any other exception would end pyfuse3's main loop and leave a dead mount,
so every handler goes through ``_handler``, which turns ``OSError`` into its errno and anything else into EIO
(logged with its traceback once per kind of failure).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import math
import os
import queue
import stat
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from .cache import Decision, NextEpochCache
from .passthrough import PassthroughPath
from .catalog import KIND_DIR, KIND_SYMLINK, REPR_RAW, ROOT_ID, Catalog, Node
from .reader import CHUNK, POOL, WHOLE_FILE_LIMIT, Content, StoreReader, chunk_digests, chunk_span
from .stats import MountStats

log = logging.getLogger(__name__)

#: A hidden entry at the root: found by lookup, never listed by readdir, so `ls -a` shows the tree unchanged.
CONTROL_NAME = b".__liquidfs__"
CONTROL_ID = 1 << 62
#: The tree never changes under a mount, so the kernel may keep names and attributes for long.
ATTR_TIMEOUT = 300.0
_BLOCK = 512
#: Seconds a storage read may take before the reader gets EIO (``mount --io-timeout``).
IO_TIMEOUT = 60.0
#: Storage reads left stuck past their timeout before every new read fails at once: the storage is not answering,
#: and each further try would only park one more thread in the kernel.
MAX_STUCK = 64
#: Bytes that open files may keep in the daemon beyond the cache's budget (files read whole at open, not yet
#: served to the end); past it the oldest let go of theirs and read them again if asked (``Operations._loan``).
MAX_OPEN_BYTES = 64 << 20
#: ``mount --page-cache``: "drop" the pages of a file the daemon does not hold when it is closed (no second
#: copy of the dataset in memory; the kernel's work of dropping them is charged to the daemon), "keep" them
#: like any file's (the kernel reclaims them under pressure), or serve such files "direct" (direct_io: no pages
#: at all, every read reaches the daemon).
PAGE_CACHE_MODES = ("drop", "keep", "direct")
#: The kernel marks a page it is handed (``notify_store``) up to date only when the page is whole.
_PAGE = 4096
#: Pieces of files read again (``Operations._read_again``) kept for the reads of neighbouring pages that follow.
MAX_PIECES = 16
#: Distinct errors logged at warning level; repeats (a reader retrying a broken file) go to debug.
_MAX_LOGGED = 10_000

P = ParamSpec("P")
R = TypeVar("R")


def _handler(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(func)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await func(*args, **kwargs)
        except FUSEError:
            raise
        except OSError as exc:
            self = args[0]
            self.stats.errors += 1  # type: ignore[attr-defined]
            code = exc.errno or errno.EIO
            first = self.first_error((func.__name__, code, exc.filename, exc.strerror))  # type: ignore[attr-defined]
            log.log(logging.WARNING if first else logging.DEBUG, "%s: %s", func.__name__, exc)
            raise FUSEError(code) from None
        except Exception:
            self = args[0]
            self.stats.errors += 1  # type: ignore[attr-defined]
            log.exception("unexpected error in %s; answering EIO", func.__name__)
            raise FUSEError(errno.EIO) from None

    return wrapper


class Operations(pyfuse3.Operations):
    """A read-only view of a catalog; file bytes come from a ``StoreReader``."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, catalog: Catalog, reader: StoreReader, stats: MountStats,
                 *, thread_limiter: trio.CapacityLimiter | None = None,
                 cache: NextEpochCache | None = None, io_timeout: float = IO_TIMEOUT,
                 page_cache: str = "drop", max_open_bytes: int = MAX_OPEN_BYTES, push_pages: bool = True) -> None:
        super().__init__()
        if page_cache not in PAGE_CACHE_MODES:
            raise ValueError(f"page_cache must be one of {PAGE_CACHE_MODES}, not {page_cache!r}")
        # What the kernel's page cache keeps of files the daemon does not hold (``mount --page-cache``).
        self.page_cache = page_cache
        self.catalog = catalog
        self.reader = reader
        self.stats = stats
        self.cache = cache
        self.notifier = Notifier()
        # Bytes of the files the cache policy holds: the daemon's own memory, safe from page-cache reclaim.
        self.held_data: dict[int, memoryview] = {}
        self.lookups: dict[int, int] = {}
        self.open_files: dict[int, Handle] = {}
        self._next_fh = 1
        # Sizes that differ from the catalog's (a fallback to the original, a source changed in place).
        self.size_overrides: dict[int, int] = {}
        self.fell_back: set[int] = set()  # files whose raw object was not served, counted once each
        # Reads of storage block: they go to worker threads, a few at a time, so the loop keeps answering.
        self.thread_limiter = thread_limiter or trio.CapacityLimiter(4)
        self.io_timeout = io_timeout
        # Hand the rest of a file to the kernel's page cache at its first read (``_push_rest``).
        self.push_pages = push_pages
        self._pushes: dict[int, _Pushes] = {}  # inode -> pushes not yet taken by the kernel
        # Bytes of open files kept outside the cache's budget (fh -> size, oldest first): see ``_loan``.
        self.max_open_bytes = max_open_bytes
        self._loaned: dict[int, int] = {}
        self._loaned_bytes = 0
        self._pieces: dict[int, _Piece] = {}  # fh -> the last piece its file was read again in, oldest first
        # Threads of reads that ran past io_timeout; they give their slot back, so they run outside the limiter.
        self._stuck: set[_Call] = set()
        self._stuck_lock = threading.Lock()
        self._unlimited = trio.CapacityLimiter(math.inf)
        self._logged: set[tuple[object, ...]] = set()
        self.uid = os.getuid()
        self.gid = os.getgid()
        files, served, _, _ = catalog.file_totals()
        self.stats.files = files
        self.stats.dataset_bytes = served
        self.control_extra: Callable[[], dict[str, Any]] | None = None
        # Set once the connection's INIT granted passthrough (``engage_passthrough``): every open of a file
        # is then answered with a backing descriptor, and the kernel serves its reads and maps itself.
        self.passthrough: PassthroughPath | None = None
        # Ask for passthrough at INIT (read by the patched pyfuse3's fuse_init); the stock one ignores it.
        self.enable_passthrough = False

    def engage_passthrough(self, path: PassthroughPath) -> None:
        """From now on files are opened on the passthrough path; the next-epoch cache moves there too (its
        policy decides per open, its bytes live in memfds), so this layer's own cache stays empty."""
        self.passthrough = path
        self.cache = None
        self.stats.data_path = "passthrough"
        self.stats.data_path_why = ""

    # -- attributes ----------------------------------------------------------------------------------

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = node.id
        entry.generation = 0
        entry.entry_timeout = ATTR_TIMEOUT
        entry.attr_timeout = ATTR_TIMEOUT
        mode = node.mode
        # Read-only: no write bits, whatever the source says.
        entry.st_mode = mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
        entry.st_nlink = node.nlink
        entry.st_uid = self.uid
        entry.st_gid = self.gid
        size = self.size_overrides.get(node.id, node.size_served)
        entry.st_size = size
        entry.st_blksize = 1 << 20
        entry.st_blocks = -(-size // _BLOCK)
        entry.st_atime_ns = node.mtime_ns
        entry.st_mtime_ns = node.mtime_ns
        entry.st_ctime_ns = node.mtime_ns
        return entry

    def _control_attrs(self) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = CONTROL_ID
        entry.st_mode = stat.S_IFREG | 0o444
        entry.st_nlink = 1
        entry.st_uid = self.uid
        entry.st_gid = self.gid
        entry.st_size = 0  # served with direct_io: readers read until EOF, not to st_size
        entry.entry_timeout = 0
        entry.attr_timeout = 0
        return entry

    def _node(self, inode: int) -> Node:
        node = self.catalog.get(inode)
        if node is None:
            raise FUSEError(errno.ENOENT)
        return node

    # -- lookups -------------------------------------------------------------------------------------

    @_handler
    async def lookup(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if parent_inode == ROOT_ID and name == CONTROL_NAME:
            return self._control_attrs()
        if name == b".":
            node = self._node(parent_inode)
        elif name == b"..":
            node = self._node(self._node(parent_inode).parent)
        else:
            found = self.catalog.lookup(parent_inode, name)
            if found is None:
                raise FUSEError(errno.ENOENT)
            node = found
        self.lookups[node.id] = self.lookups.get(node.id, 0) + 1
        return self._attrs(node)

    async def forget(self, inode_list: list[tuple[pyfuse3.InodeT, int]]) -> None:
        for inode, count in inode_list:
            left = self.lookups.get(inode, 0) - count
            if left > 0:
                self.lookups[inode] = left
            else:
                self.lookups.pop(inode, None)
                self.size_overrides.pop(inode, None)

    @_handler
    async def getattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode == CONTROL_ID:
            return self._control_attrs()
        return self._attrs(self._node(inode))

    @_handler
    async def readlink(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileNameT:
        node = self._node(inode)
        if node.kind != KIND_SYMLINK or node.target is None:
            raise FUSEError(errno.EINVAL)
        return pyfuse3.FileNameT(node.target)

    @_handler
    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        if self._node(inode).kind != KIND_DIR:
            raise FUSEError(errno.ENOTDIR)
        return pyfuse3.FileHandleT(inode)

    @_handler
    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # The offset handed to the kernel is the entry's id: stable across calls, so a listing interrupted
        # by a full reply buffer resumes exactly after the last entry the kernel accepted.
        after = start_id
        while True:
            page = self.catalog.children(fh, after_id=after)
            if not page:
                return
            for node in page:
                if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(node.name), self._attrs(node), node.id):
                    return
                # readdirplus: every accepted entry counts as a lookup the kernel will forget.
                self.lookups[node.id] = self.lookups.get(node.id, 0) + 1
                after = node.id

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    @_handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        out = pyfuse3.StatvfsData()
        out.f_bsize = _BLOCK
        out.f_frsize = _BLOCK
        out.f_blocks = -(-self.stats.dataset_bytes // _BLOCK)
        out.f_bfree = 0
        out.f_bavail = 0
        out.f_files = self.stats.files
        out.f_ffree = 0
        out.f_favail = 0
        out.f_namemax = 255
        return out

    # -- file contents -------------------------------------------------------------------------------

    @_handler
    async def open(self, inode: pyfuse3.InodeT, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise FUSEError(errno.EROFS)
        if inode == CONTROL_ID:
            content = Content(size=0, raw=False, data=memoryview(self._control_bytes()))
            return self._new_handle(Handle(content), direct_io=True, keep_cache=False)
        node = self._node(inode)
        if node.kind == KIND_DIR:
            raise FUSEError(errno.EISDIR)
        if self.passthrough is not None:
            answer = await self._open_passthrough(node)
            if answer is not None:
                return answer
        pushes = self._pushes.get(inode)
        if pushes is not None:
            # The kernel drops the file's pages when this open is answered (no keep_cache): a store still
            # queued from an earlier open must land before that, or it could outlive a change of the source.
            await pushes.done.wait()
        decision = self._decide(node)
        held = self.held_data.get(inode) if decision.hit else None
        if held is not None:
            content = await self._open_held(node, held)
        else:
            if await self._read_later(node, decision):
                self.stats.deferred += 1
                content = Content(size=self.size_overrides.get(node.id, node.size_served),
                                  raw=node.repr == REPR_RAW, deferred=True)
            else:
                content = await self._open_from_storage(node)
            if decision.hit:  # held by the policy but the bytes were lost (dropped after a fallback)
                self._lost_hit(decision, content.size)
        self.stats.opens += 1
        self.stats.opens_raw += content.raw
        if content.fallback:
            self._fell_back(inode)
        direct_io = self.page_cache == "direct" and held is None
        if content.size != self.size_overrides.get(inode, node.size_served):
            # The kernel was told another size (fallback, or a source changed in place). It clamps cached reads
            # to that size, so this handle bypasses the page cache, and the attributes are corrected for later.
            self.size_overrides[inode] = content.size
            self.notifier.invalidate(inode, attr_only=True)
            direct_io = True
        if not (content.deferred and decision.keep):  # else at its first read, once the bytes are there
            self._hold_or_drop(node, decision, content)
        # A file the daemon holds may also stay in the kernel's page cache: its reads then never reach the
        # daemon. Its pages are kept only while it is held (release drops the rest), and the kernel may
        # reclaim them at any time: the daemon's copy is the one the budget counts.
        keep_cache = held is not None and not direct_io
        return self._new_handle(Handle(content, node, decision, direct_io=direct_io), direct_io=direct_io,
                                keep_cache=keep_cache)

    async def _open_passthrough(self, node: Node) -> pyfuse3.FileInfo | None:
        """An open answered with the inode's backing id; None for a file without one (served below)."""
        assert self.passthrough is not None
        told = self.size_overrides.get(node.id, node.size_served)
        opened = await self.passthrough.open(node, told)
        if opened is None:
            return None
        self.stats.opens += 1
        self.stats.opens_raw += opened.raw
        if opened.fallback:
            self._fell_back(node.id)
        if opened.size != told:
            # A fallback, or a source changed in place: the kernel reads the backing file to its own end, but
            # stat must say the new size too (DALI maps as many bytes as stat says).
            self.size_overrides[node.id] = opened.size
            self.notifier.invalidate(node.id, attr_only=True)
        fh = self._next_fh
        self._next_fh += 1
        self.open_files[fh] = Handle(Content(size=opened.size, raw=opened.raw), node, passthrough=True)
        info = pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), direct_io=False, keep_cache=False, nonseekable=False)
        info.backing_id = opened.backing_id  # type: ignore[attr-defined]  # the patched pyfuse3
        return info

    async def _read_later(self, node: Node, decision: Decision) -> bool:
        """Whether ``node`` is opened without reading it, and read whole at its first read instead.

        DALI's reader thread opens each file of its shuffle buffer, maps it and asks for all of it
        (MADV_WILLNEED, which does not wait), one file after another: an open that read the file first made
        that thread wait for storage once per file (cold, all raw, 128 images: 44-93 -> 89-105 images/s). A
        file is read later only when what it serves, and so its size, is known without reading it: the
        reader vouches for it (a local source unchanged, its raw object as prepare left it), or, for a reader
        that cannot tell without a request (an object store), open files already keep ``max_open_bytes`` and
        the source is unchanged. The first read must find what was promised here, or the reader gets EIO.
        """
        size = self.size_overrides.get(node.id, node.size_served)
        if size > WHOLE_FILE_LIMIT or node.id in self.fell_back:
            return False  # streamed; or its raw object failed before: read now, so the original can be served
        if self.reader.inline_check:
            vouched = self.reader.vouch(node)
        else:
            vouched = await self._blocking(node, self.reader.vouch, node)
        if vouched is not None:
            return vouched
        no_room = self._loaned_bytes + size > self.max_open_bytes
        return not decision.keep and no_room and await self._source_changed(node) is None

    async def _open_held(self, node: Node, data: memoryview) -> Content:
        changed = await self._source_changed(node)
        if changed is None:
            self.stats.bytes_from_memory += len(data)
            return Content(size=len(data), raw=node.repr == REPR_RAW, data=data)
        # The source changed after the bytes were taken: they are stale. Serve what the source says now.
        self.held_data.pop(node.id, None)
        assert self.cache is not None
        self.cache.drop(node.id)
        content = await self._open_from_storage(node)
        return content

    async def _source_changed(self, node: Node) -> str | None:
        if self.reader.inline_check:
            return self.reader.check_source(node)
        return await self._blocking(node, self.reader.check_source, node)

    def _fell_back(self, inode: int) -> None:
        self.fell_back.add(inode)
        self.stats.fallbacks = len(self.fell_back)

    def _lost_hit(self, decision: Decision, size: int) -> None:
        self.stats.reclaimed += 1
        if self.cache is not None and decision.epoch:
            self.cache.correct_miss(decision.epoch, size)

    def _decide(self, node: Node) -> Decision:
        if self.cache is None:
            return NO_CACHE
        decision = self.cache.read(node.id, self.size_overrides.get(node.id, node.size_served))
        for file in decision.evicted:
            self.held_data.pop(file, None)
            self.notifier.invalidate(file)
        return decision

    def _hold_or_drop(self, node: Node, decision: Decision, content: Content) -> None:
        if self.cache is None:
            return
        if decision.keep and content.data is not None and not content.fallback \
                and content.size == node.size_served:
            self._hold(node.id, content)
        else:
            self.held_data.pop(node.id, None)
            if decision.keep:  # the policy counted it, but these bytes cannot be held (streamed, fallback)
                self.cache.drop(node.id)

    def _hold(self, node_id: int, content: Content) -> None:
        """Keep ``content``'s bytes for later opens: from now on other handles share its buffer, so it must
        never go back to the buffer pool."""
        assert content.data is not None
        if content.pooled:
            content.pooled = False
            POOL.forget(content.data)
        self.held_data[node_id] = content.data

    async def warm_up(self) -> tuple[int, int]:
        """Load a random budget's worth of files before the first epoch, so that epoch hits too.

        Storage reads go to worker threads; the policy and the held bytes change only on the trio thread.
        """
        assert self.cache is not None
        nodes = {n.id: n for n in self.catalog.files()}
        files = 0
        total = 0
        for node_id in self.cache.warmup_choice([(i, n.size_served) for i, n in nodes.items()]):
            node = nodes[node_id]
            try:
                content = await self._open_from_storage(node)
            except OSError as exc:
                log.warning("warm-up: %s: %s", os.fsdecode(node.path), exc)
                continue
            if content.data is None or content.fallback or not self.cache.hold(node_id, content.size):
                content.close()
                continue
            self._hold(node_id, content)
            files += 1
            total += content.size
        return files, total

    async def _open_from_storage(self, node: Node) -> Content:
        content = await self._blocking(node, self.reader.open, node)
        if content.tier == "disk":
            self.stats.bytes_from_disk += content.size
        elif content.data is not None:  # a streamed file (over WHOLE_FILE_LIMIT) is not read yet: not counted
            self.stats.bytes_from_storage += content.size
        return content

    async def _blocking(self, node: Node, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)``, a blocking read of ``node``'s storage, in a worker thread; EIO past ``io_timeout``.

        A read stuck in the kernel (a hung NFS server, a failing disk) cannot be interrupted: its thread is
        abandoned and gives its slot back, so the other files keep their full number of threads. A file whose
        earlier read is still stuck fails at once rather than parking another thread, and so does every read
        once MAX_STUCK are stuck. Only the read itself is timed, not the wait for a slot: a busy mount is slow,
        not broken.
        """
        with self._stuck_lock:
            stuck = [call.node for call in self._stuck]
        where = os.fsdecode(node.path)
        if node.id in stuck:
            raise OSError(errno.EIO, "an earlier storage read of this file is still stuck", where)
        if len(stuck) >= MAX_STUCK:
            raise OSError(errno.EIO, f"{len(stuck)} storage reads are stuck: the storage does not answer", where)
        call = _Call(node.id)

        def run() -> R:
            try:
                return fn(*args)
            finally:
                with self._stuck_lock:
                    call.done = True
                    self._stuck.discard(call)

        async with self.thread_limiter:
            with trio.move_on_after(self.io_timeout):
                try:
                    return await trio.to_thread.run_sync(run, abandon_on_cancel=True, limiter=self._unlimited)
                except OSError as exc:
                    if exc.filename is None:  # a failed read names no file: name it, for the log and its dedup
                        raise OSError(exc.errno, exc.strerror, where) from exc
                    raise
        with self._stuck_lock:
            if not call.done:
                self._stuck.add(call)
        raise OSError(errno.EIO, f"storage did not answer within {self.io_timeout:g} s", where)

    def first_error(self, key: tuple[object, ...]) -> bool:
        """True the first time an error is seen: a reader retrying a broken file must not flood the log."""
        if key in self._logged:
            return False
        if len(self._logged) < _MAX_LOGGED:
            self._logged.add(key)
        return True

    def _new_handle(self, handle: Handle, *, direct_io: bool, keep_cache: bool) -> pyfuse3.FileInfo:
        fh = self._next_fh
        self._next_fh += 1
        self.open_files[fh] = handle
        self._loan(fh, handle)
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), direct_io=direct_io, keep_cache=keep_cache,
                                nonseekable=False)

    @_handler
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        handle = self.open_files[fh]
        if handle.passthrough:
            assert self.passthrough is not None and handle.node is not None
            fd = self.passthrough.backing_fd(handle.node.id)
            data = await self._blocking(handle.node, os.pread, fd, size, off)
            self.stats.bytes_read += len(data)
            self.stats.read_requests += 1
            return data
        if handle.content.deferred:  # still so after a failed first read: ``handle.failed`` answers it
            await self._first_read_once(handle)
            if fh not in self._loaned and fh in self.open_files:
                self._loan(fh, handle, evict=False)  # being read now: let go once served to its end
        content = handle.content
        if handle.chunks is not None:
            data = await self._read_again(fh, handle, off, size)
            self.stats.reads_again += 1
            self.stats.bytes_read_again += len(data)
        elif content.data is None:
            assert handle.node is not None  # only files are streamed
            data = await self._blocking(handle.node, content.read, off, size)
        else:
            data = content.read(off, size)
            if handle.node is not None and not handle.direct_io and data:
                reach = handle.note_served(off, off + len(data))
                if reach >= content.size:
                    data = bytes(data)  # the buffer may serve another file before this reply is copied out
                    self._unloan(fh)
                    self._drop_served(handle)
                elif self.push_pages and not handle.pushing and not self._holds(handle):
                    self._push_rest(fh, handle, reach)
        if handle.node is not None:  # the control file's reads are not the dataset's
            self.stats.bytes_read += len(data)
            self.stats.read_requests += 1
        return data  # type: ignore[return-value]  # pyfuse3 takes any contiguous buffer

    def _push_rest(self, fh: int, handle: Handle, reach: int) -> None:
        """Give the kernel the rest of the file now (``notify_store``), and its buffer back to the pool.

        DALI's reader touches the first page of every file it opens (the kernel then asks for the first MiB),
        long before a decoder reads the rest: the whole file was read at that first read (so that a raw
        object's checksum is checked before any byte is served), and its buffer stayed with the open file
        until the decoder got to it, so no buffer ever came back for the next file to reuse. Stored pages are
        the kernel's (reclaimable, and dropped at release like any served page); if it asks again, the file
        is read again and must match its digest (``_drop_served``). Sent from the notifier thread after this
        reply: the pages the current read holds locked would block a store sent from inside it.
        """
        content = handle.content
        node = handle.node
        assert node is not None and content.data is not None
        view, pooled = content.data, content.pooled
        start = reach // _PAGE * _PAGE
        content.pooled = False  # the buffer goes back to the pool only once the kernel has copied it
        handle.pushing = True
        pushes = self._pushes.setdefault(node.id, _Pushes())
        pushes.count += 1

        def done(ok: bool) -> None:
            handle.pushing = False
            pushes.count -= 1
            if not pushes.count:
                del self._pushes[node.id]
                pushes.done.set()
            if ok:
                self.stats.bytes_pushed += len(view) - start
            if content.data is view:
                if ok:
                    handle.note_served(start, content.size)
                    self._unloan(fh)
                    self._drop_served(handle)
                if content.data is view:  # still served from memory, as without a push: to the pool at close
                    content.pooled = pooled
                    return
            if pooled:
                POOL.give(view)

        self.notifier.store(node.id, start, view[start:], done)

    def _loan(self, fh: int, handle: Handle, *, evict: bool = True) -> None:
        """Count the bytes an open file keeps in memory outside the cache's budget, and keep the total under
        ``max_open_bytes`` by letting go of the bytes of the files opened longest ago (read again if asked).

        DALI opens and maps the 1,024 files of its shuffle buffer long before it reads them, and each file is
        read whole at open: without a bound, 1,024 raw Cityscapes images would sit in the daemon (6.4 GB).
        Opens past the bound are deferred (``_read_later``), so letting go here is for what else exceeds it
        (files the cache decided to keep, sizes changed at open).
        """
        if handle.node is None or handle.direct_io or handle.content.data is None or self._holds(handle):
            return  # nothing in memory, or the cache's budget counts these very bytes
        content = handle.content
        self._loaned[fh] = content.size
        self._loaned_bytes += content.size
        while evict and self._loaned_bytes > self.max_open_bytes and len(self._loaned) > 1:
            oldest = next(iter(self._loaned))
            victim = self.open_files[oldest]
            self._unloan(oldest)
            self._drop_served(victim)
            self.stats.let_go += 1

    def _unloan(self, fh: int) -> None:
        size = self._loaned.pop(fh, None)
        if size is not None:
            self._loaned_bytes -= size

    def _drop_served(self, handle: Handle) -> None:
        """The file was read to its end: its bytes now live in the reader's page cache (or its own buffers).

        Loaders keep files open long after reading them (DALI maps every file of its 1,024-sample shuffle
        buffer), so holding each open file's bytes until release would grow the daemon by gigabytes. They are
        let go here, and the digest of each CHUNK kept instead; should the kernel ask again for some pages (its
        page cache lost them), the chunks around them are read again and must match (``_read_again``), or the
        reader gets EIO: never bytes that differ from what it already has.
        """
        content = handle.content
        if content.data is None or handle.node is None or handle.chunks is not None or self._holds(handle):
            return  # nothing to let go, or the cache holds these very bytes (and counts them in its budget)
        handle.chunks = chunk_digests(content.data)
        content.close()  # back to the buffer pool when only this handle had it

    def _holds(self, handle: Handle) -> bool:
        """The cache holds the very bytes ``handle`` serves (they are shared, and counted in its budget)."""
        assert handle.node is not None
        return self.held_data.get(handle.node.id) is handle.content.data

    async def _read_again(self, fh: int, handle: Handle, off: int, size: int) -> bytes:
        """Serve part of a file whose bytes were let go: the CHUNKs around it, from the cache when it holds the
        file now, else from storage, each checked against the digest of what this handle served.

        This VM class reclaims page-cache pages that no process maps within seconds, and DALI maps a file long
        before it decodes it: the pages its first read filled are often gone by then, a few here and there, and
        the kernel asks for just those.
        """
        node = handle.node
        assert node is not None and handle.chunks is not None
        total = handle.content.size
        if off >= total:
            return b""
        end = min(off + size, total)
        piece = self._pieces.get(fh)
        if piece is None or not piece.start <= off < end <= piece.start + len(piece.data):
            if handle.reading is not None:  # the kernel sent several reads at once: one reads, the rest wait
                await handle.reading.wait()
                return await self._read_again(fh, handle, off, size) if fh in self.open_files else b""
            handle.reading = trio.Event()
            try:
                piece = await self._read_piece(handle, *chunk_span(off, end - off, total))
            finally:
                handle.reading.set()
                handle.reading = None
            data = bytes(piece.data[off - piece.start:end - piece.start])
            if fh in self.open_files:
                self._keep_piece(fh, piece)
            else:  # released meanwhile
                piece.close()
            return data
        return bytes(piece.data[off - piece.start:end - piece.start])

    async def _read_piece(self, handle: Handle, start: int, stop: int) -> _Piece:
        node = handle.node
        assert node is not None and handle.chunks is not None
        held = self.held_data.get(node.id)
        if held is not None and len(held) == handle.content.size:
            piece = _Piece(start, held[start:stop], pooled=False)
        else:
            data = await self._blocking(node, self.reader.read_span, node, handle.content.raw, start, stop)
            piece = _Piece(start, data, pooled=True)
            self.stats.rereads += 1
            self.stats.bytes_reread += len(data)
        if len(piece.data) != stop - start or \
                chunk_digests(piece.data) != handle.chunks[start // CHUNK:-(-stop // CHUNK)]:
            piece.close()
            raise OSError(errno.EIO, "changed since this open read it: reopen the file", os.fsdecode(node.path))
        return piece

    def _keep_piece(self, fh: int, piece: _Piece) -> None:
        """The kernel asks for the lost pages of a file one run at a time: the next asks are likely in the same
        chunk. A few pieces are kept, the oldest dropped."""
        old = self._pieces.pop(fh, None)
        if old is not None:
            old.close()
        self._pieces[fh] = piece
        while len(self._pieces) > MAX_PIECES:
            self._pieces.pop(next(iter(self._pieces))).close()

    async def _first_read_once(self, handle: Handle) -> None:
        """A file opened without being read (``_read_later``) is read whole at its first read; the kernel may
        send several reads of it at once: one reads, the rest wait. If that read fails, so does every later
        read of this open, at once (the kernel retries a failed readahead page by page; each retry would wait
        for the storage again, and count and log the same failure again): reopen the file to try again."""
        if handle.failed is None and handle.reading is not None:
            await handle.reading.wait()
        if handle.failed is not None:
            raise FUSEError(handle.failed)
        if not handle.content.deferred:
            return
        handle.reading = trio.Event()
        try:
            node = handle.node
            assert node is not None
            content = await self._open_from_storage(node)
            if content.size != handle.content.size or content.raw != handle.content.raw:
                content.close()
                if content.fallback:  # the next open reads it at once and serves the original
                    self._fell_back(node.id)
                raise OSError(errno.EIO, "changed between open and first read: reopen the file",
                              os.fsdecode(node.path))
            handle.content = content
            if handle.decision.keep:
                self._hold_or_drop(node, handle.decision, content)
        except OSError as exc:
            handle.failed = exc.errno or errno.EIO
            raise
        finally:
            handle.reading.set()
            handle.reading = None

    @_handler
    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        handle = self.open_files.pop(fh, None)
        if handle is None:
            return
        if handle.passthrough:
            assert self.passthrough is not None and handle.node is not None
            await self.passthrough.release(handle.node.id)
            return
        self._unloan(fh)
        if handle.content.deferred and handle.decision.keep:  # never read: the policy cannot keep it
            assert handle.node is not None
            self._hold_or_drop(handle.node, handle.decision, handle.content)
        piece = self._pieces.pop(fh, None)
        if piece is not None:
            piece.close()
        handle.content.close()
        node = handle.node
        # Only what the daemon holds may stay in the page cache: everything else is dropped once served, so
        # the kernel never keeps a second, unplanned copy of the dataset.
        if node is not None and node.id not in self.held_data and self.page_cache == "drop":
            self.notifier.invalidate(node.id)

    def _control_bytes(self) -> bytes:
        values = self.stats.to_dict()
        values["open_files"] = len(self.open_files)
        values["known_inodes"] = len(self.lookups)
        values["stuck_reads"] = len(self._stuck)
        values["open_bytes"] = self._loaned_bytes
        values["buffers_reused"] = POOL.reused
        values["buffers_idle_bytes"] = POOL.idle
        if self.cache is not None:
            values.update(self.cache.summary())
        if self.passthrough is not None:
            values["passthrough_open_inodes"] = self.passthrough.open_inodes()
            if self.passthrough.memory is not None:
                values.update(self.passthrough.memory.policy.summary())
                values.update(dataclasses.asdict(self.passthrough.memory.statistics()))
        if self.control_extra is not None:
            values.update(self.control_extra())
        return (json.dumps(values, indent=1, sort_keys=True) + "\n").encode()

    # -- everything that would write -----------------------------------------------------------------

    async def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _read_only
    write = create = setxattr = removexattr = fsync = fsyncdir = _read_only

    async def getxattr(self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT,
                       ctx: pyfuse3.RequestContext) -> bytes:
        raise FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []

    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        return None


@dataclass(slots=True)
class Handle:
    content: Content
    node: Node | None = None
    decision: Decision = field(default_factory=lambda: NO_CACHE)
    direct_io: bool = False      # every read reaches the daemon: the bytes are kept until release
    served: list[list[int]] = field(default_factory=list)  # [start, end) ranges served, merged, sorted
    #: The digest of each CHUNK served, set once the bytes were let go after a whole read (``_drop_served``).
    chunks: tuple[int, ...] | None = None
    reading: trio.Event | None = None  # set while one read of this handle reads storage for the others
    pushing: bool = False        # the rest of the file is being handed to the kernel (``_push_rest``)
    failed: int | None = None    # the errno its first read failed with (``_first_read_once``)
    passthrough: bool = False    # served by the kernel from the inode's backing (``PassthroughPath``)

    def note_served(self, start: int, end: int) -> int:
        """Record a served range; returns how far from offset 0 the served ranges reach without a gap.

        The kernel's reads of one file may arrive out of order (readahead windows, page faults of a mapping),
        so the ranges are merged rather than assumed sequential; a file gets only a handful of reads.
        """
        ranges = self.served
        ranges.append([start, end])
        ranges.sort()
        merged = [ranges[0]]
        for lo, hi in ranges[1:]:
            if lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.served = merged
        return merged[0][1] if merged[0][0] == 0 else 0


NO_CACHE = Decision(hit=False, keep=False, epoch=0)


@dataclass(eq=False, slots=True)
class _Piece:
    """CHUNKs of a file read again (``Operations._read_again``), from ``start``."""

    start: int
    data: memoryview
    pooled: bool  # a pool buffer of its own, given back when dropped (not a slice of bytes the cache holds)

    def close(self) -> None:
        if self.pooled:
            POOL.give(self.data)
            self.pooled = False


@dataclass(eq=False, slots=True)
class _Pushes:
    """Stores of one inode's pages queued for the kernel (``Operations._push_rest``)."""

    count: int = 0
    done: trio.Event = field(default_factory=trio.Event)


@dataclass(eq=False, slots=True)
class _Call:
    """One storage read in a worker thread; kept in ``Operations._stuck`` (by identity) while it overruns."""

    node: int
    done: bool = False


class Notifier:
    """Sends kernel notifications from one worker thread, in order.

    libfuse: a notification must not be sent from inside the request it concerns (it may deadlock on the inode
    or the pages the request holds), and each one blocks until the kernel has processed it. A queue keeps
    handlers fast, and keeps a file's pages stored (``store``) before its release drops them (``invalidate``).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Invalidate | _Store | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.sent = 0

    def invalidate(self, inode: int, attr_only: bool = False) -> None:
        self._put(_Invalidate(inode, attr_only))

    def store(self, inode: int, offset: int, data: memoryview, done: Callable[[bool], None]) -> None:
        """Put ``data`` in the kernel's page cache of ``inode`` at ``offset``; then ``done(ok)`` runs on this
        trio thread. ``data`` must stay unchanged until then."""
        self._put(_Store(inode, offset, data, done, trio.lowlevel.current_trio_token()))

    def _put(self, item: _Invalidate | _Store) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="liquidfs-notify", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ok = False
            try:
                if isinstance(item, _Store):
                    pyfuse3.notify_store(pyfuse3.InodeT(item.inode), item.offset, item.data)
                else:
                    pyfuse3.invalidate_inode(pyfuse3.InodeT(item.inode), item.attr_only)
                self.sent += 1
                ok = True
            except OSError as exc:  # the kernel forgot the inode already: nothing to drop, or to store into
                log.debug("%s(%d): %s", type(item).__name__, item.inode, exc)
            except Exception:  # never let the notifier die: later drops would be lost
                log.exception("%s(%d) failed", type(item).__name__, item.inode)
            if isinstance(item, _Store):
                try:
                    item.token.run_sync_soon(_guarded, item.done, ok)
                except trio.RunFinishedError:  # unmounted meanwhile
                    pass

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(5)


def _guarded(done: Callable[[bool], None], ok: bool) -> None:
    """Runs a store's completion on the trio thread: an exception there would end trio.run, and the mount."""
    try:
        done(ok)
    except Exception:
        log.exception("completing a page store failed")


@dataclass(frozen=True, slots=True)
class _Invalidate:
    inode: int
    attr_only: bool


@dataclass(frozen=True, slots=True)
class _Store:
    inode: int
    offset: int
    data: memoryview
    done: Callable[[bool], None]
    token: trio.lowlevel.TrioToken
