"""The daemon data path: every read of a file is answered by this process (where passthrough is not available).

Files are read whole from storage (O_DIRECT, into pooled buffers), at open or at their first read, so a raw
object's checksum is checked before its first byte is served; the next-epoch cache holds its files' bytes in
this process; bytes served to the end are let go and read again chunk by chunk, checked, if the kernel asks
again. It is one ``datapath.base.DataPath``: ``fuse.operations.Operations`` translates requests and hands file opens,
reads and releases here.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

import trio
from pyfuse3 import FUSEError

from ..catalog.nodes import Node
from ..held.base import MemoryLevel
from ..metrics.stats import MountStats, Statistics
from ..policy.next_epoch import NO_CACHE, Decision
from ..stores.reader import WHOLE_FILE_LIMIT, ChunkDigests, Content, Reader, chunk_span
from ..sysio.directio import POOL
from .inodes import Handle, Inode, Pushes, note_fallback
from .limits import MAX_OPEN_BYTES, PAGE_CACHE_MODES
from .notifier import Notifier
from .storage_calls import StorageCalls

log = logging.getLogger(__name__)

#: The kernel marks a page it is handed (``notify_store``) up to date only when the page is whole.
_PAGE = 4096
#: Pieces of files read again (``DaemonPath._refetch``) kept for the reads of neighbouring pages that follow.
MAX_PIECES = 16


@dataclass(frozen=True, slots=True)
class DaemonPathStatistics(Statistics):
    open_bytes: int          # bytes of open files the daemon holds (bounded by --open-bytes)
    buffers_reused: int      # whole-file reads into a pooled buffer
    buffers_idle_bytes: int  # pooled buffers waiting for their next file


class DaemonPath:
    """Opens, reads and releases of files whose bytes this process serves."""

    name = "daemon"

    def __init__(self, reader: Reader, stats: MountStats, calls: StorageCalls, notifier: Notifier,
                 *, held: MemoryLevel | None = None, page_cache: str = "drop",
                 max_open_bytes: int = MAX_OPEN_BYTES, push_pages: bool = True) -> None:
        if page_cache not in PAGE_CACHE_MODES:
            raise ValueError(f"page_cache must be one of {PAGE_CACHE_MODES}, not {page_cache!r}")
        self.reader = reader
        self.stats = stats
        self.calls = calls
        self.notifier = notifier
        # What the kernel's page cache keeps of files the daemon does not hold (``mount --page-cache``).
        self.page_cache = page_cache
        # The files the cache policy holds, their bytes in the daemon's own memory (safe from page-cache reclaim).
        self.held = held
        # Hand the rest of a file to the kernel's page cache at its first read (``_push_rest``).
        self.push_pages = push_pages
        # Open files whose bytes are kept outside the cache's budget (fh -> (handle, size), oldest first): see
        # ``_count_open``.
        self.max_open_bytes = max_open_bytes
        self._open_bytes_of: dict[int, tuple[Handle, int]] = {}
        self._open_bytes = 0
        self._pieces: dict[int, _Piece] = {}  # fh -> the last piece its file was read again in, oldest first

    async def open(self, node: Node, record: Inode, fh: int, job: int = 0) -> Handle:
        inode = node.id
        decision = self._decide(node, record, job)
        held = self.held.get(inode) if self.held is not None and decision.hit else None
        if held is not None and self.held is not None and self.held.held_raw(node) != node.served_raw:
            # Held as the other representation than this open serves (the one another open of the file, served
            # meanwhile, gets): not served under its label, where its pages would share the inode's page cache
            # with that open's other bytes. Read from storage, as a hit whose bytes were not there.
            held = None
        try:
            if held is not None:
                content = await self._open_held(node, held)
                if content.data is not held:
                    # The source changed since the bytes were held: the kernel must not keep the pages of the old
                    # bytes (keep_cache) beside the new ones it reads from this open on. Read from storage: no
                    # hit, as the window's ratio must say.
                    held = None
                    assert self.held is not None
                    self.held.lost_hit(decision, content.size)
            else:
                if await self._read_later(node, record, decision):
                    self.stats.deferred += 1
                    content = Content(size=record.size_told(node), raw=node.served_raw, deferred=True)
                else:
                    content = await self._open_from_storage(node)
                if decision.hit:  # held by the policy but the bytes were lost (dropped after a fallback)
                    assert self.held is not None
                    self.held.lost_hit(decision, content.size)
        except BaseException:
            self._unheld(node, decision)
            raise
        direct_io = self.page_cache == "direct" and held is None
        if content.size != record.size_told(node):
            # The kernel was told another size (fallback, or a source changed in place). It clamps cached reads
            # to that size, so this handle bypasses the page cache (the caller corrects the attributes).
            direct_io = True
        # The kernel keeps one page cache per inode, whatever each open serves: an older open still serving
        # the other representation (or a size from before a change) would fill it, through its readahead,
        # a fault of its mapping or a push, with bytes this open must never see. This open bypasses it, and
        # those opens fail their further reads (their file changed since they opened it, as a passthrough
        # open that finds its backing changed is refused): never a page of one version under the other.
        direct_io = self._supersede_others(record, content) or direct_io
        await self._stores_landed(node, record, decision, content)
        # Opens that came while this one waited for the stores (they waited for the same ones, and were not
        # registered when it looked) are seen now, before it is, and superseded as well: the last to register
        # sees every other, so no two opens of other bytes both go on reading.
        while self._supersede_others(record, content):
            direct_io = True
            await self._stores_landed(node, record, decision, content)
        if not (content.deferred and decision.hold):  # else at its first read, once the bytes are there
            self._hold_or_drop(node, decision, content)
        # A file the daemon holds may also stay in the kernel's page cache: its reads then never reach the
        # daemon. Its pages are kept only while it is held (release drops the rest), and the kernel may
        # reclaim them at any time: the daemon's copy is the one the budget counts.
        keep_cache = held is not None and not direct_io
        handle = Handle(content, node, decision, fh=fh, direct_io=direct_io, keep_cache=keep_cache, inode=record)
        self._count_open(handle)
        # Every open, direct_io too: a private mapping of a direct_io file still faults through the inode's page
        # cache (``fuse_file_mmap``: ``generic_file_mmap`` for MAP_PRIVATE), with that open's bytes; DALI maps files
        # privately. Unrecorded, such an open was never superseded and filled the pages another open read.
        if record.open_handles is None:
            record.open_handles = {}
        record.open_handles[fh] = handle
        return handle

    @staticmethod
    def _supersede_others(record: Inode, content: Content) -> bool:
        """Whether this open, serving ``content``, superseded any open of ``record`` not superseded yet that
        serves other bytes: the other representation, another size, or another version of the source (one
        rewritten in place keeps its size, and older opens serve what it was). Those fail their further reads."""
        serves = (content.raw, content.size, content.version)
        superseded = [h for h in (record.open_handles or {}).values()
                      if not h.superseded and (h.content.raw, h.content.size, h.content.version) != serves]
        for other in superseded:
            other.superseded = True
        return bool(superseded)

    def _unheld(self, node: Node, decision: Decision) -> None:
        """An open that failed: the room the policy gave it, with no bytes to fill it (a failed read), or a hit's
        bytes, which the policy let go at this read where it does not hold the file again, and which nothing else
        lets go (outside the budget until this file's next sound open)."""
        if (decision.hold or decision.hit) and self.held is not None:
            self.held.drop(node.id)

    async def _stores_landed(self, node: Node, record: Inode, decision: Decision, content: Content) -> None:
        """Wait for the stores still queued for ``record``'s pages before an open is answered. The kernel drops
        the file's pages when an open without keep_cache is answered: a store landing after that could outlive a
        change of the source. And one an open of other bytes queued while this one waited for storage (a read of
        it came meanwhile) would land after the answer, where this open's reads through the page cache (a private
        mapping's too, direct_io or not) would find the other bytes' pages; so would those of an open that waited
        beside the one that superseded it. None of other bytes is queued after this: superseded opens' reads fail
        before they push."""
        pushes = record.pushes
        if pushes is None:
            return
        try:
            await pushes.done.wait()
        except BaseException:
            content.close()
            self._unheld(node, decision)
            raise

    async def read(self, handle: Handle, off: int, size: int) -> bytes | memoryview:
        fh = handle.fh
        _refuse_if_superseded(handle)
        if handle.content.deferred:  # still so after a failed first read: ``handle.failed`` answers it
            await self._first_read_once(handle)
            _refuse_if_superseded(handle)  # after every wait: an open that superseded it may have come meanwhile
            if fh not in self._open_bytes_of and not handle.released:
                # Being read now: let go once served to its end; a direct_io open is never seen to reach
                # its end, so it makes room now by letting go of the files opened longest ago.
                self._count_open(handle, evict=handle.direct_io)
        content = handle.content
        data: bytes | memoryview
        if handle.chunks is not None:
            data = await self._refetch(fh, handle, off, size)
            _refuse_if_superseded(handle)
            self.stats.lost_page_reads += 1
            self.stats.bytes_of_lost_pages += len(data)
        elif content.data is None:
            assert handle.node is not None  # only files are streamed
            data = await self.calls.run(handle.node, content.read, off, size)
            _refuse_if_superseded(handle)
        else:
            data = content.read(off, size)
            if handle.node is not None and not handle.direct_io and data:
                reach = handle.note_served(off, off + len(data))
                if reach >= content.size:
                    data = bytes(data)  # the buffer may serve another file before this reply is copied out
                    self._uncount_open(fh)
                    self._drop_served(handle)
                elif self.push_pages and not handle.pushing and not self._holds(handle):
                    self._push_rest(fh, handle, reach)
        return data

    async def release(self, handle: Handle) -> None:
        fh = handle.fh
        handle.released = True
        self._uncount_open(fh)
        record = handle.inode
        if record is not None and record.open_handles is not None:
            record.open_handles.pop(fh, None)
            if not record.open_handles:
                record.open_handles = None
        if handle.content.deferred and handle.decision.hold:  # never read: the policy cannot keep it
            assert handle.node is not None
            self._hold_or_drop(handle.node, handle.decision, handle.content)
        piece = self._pieces.pop(fh, None)
        if piece is not None:
            piece.close()
        handle.content.close()
        node = handle.node
        # Only what the daemon holds may stay in the page cache: everything else is dropped once served, so
        # the kernel never keeps a second, unplanned copy of the dataset.
        if node is not None and not self._held_now(node.id) and self.page_cache == "drop":
            self.notifier.invalidate(node.id)

    def close(self) -> None:
        """At unmount: nothing is left to let go (open files' buffers go with the process)."""

    def statistics(self) -> DaemonPathStatistics:
        return DaemonPathStatistics(open_bytes=self._open_bytes, buffers_reused=POOL.reused,
                                    buffers_idle_bytes=POOL.idle)

    def _held_now(self, inode: int) -> bool:
        return self.held is not None and self.held.holds(inode)

    async def _read_later(self, node: Node, record: Inode, decision: Decision) -> bool:
        """Whether ``node`` is opened without reading it, and read whole at its first read instead.

        DALI's reader thread opens each file of its shuffle buffer, maps it and asks for all of it
        (MADV_WILLNEED, which does not wait), one file after another: an open that read the file first made
        that thread wait for storage once per file (cold, all raw, 128 images: 44-93 -> 89-105 images/s). A
        file is read later only when what it serves, and so its size, is known without reading it: the
        reader vouches for it (a local source unchanged, its raw object as prepare left it), or, for a reader
        that cannot tell without a request (an object store), open files already keep ``max_open_bytes`` and
        the source is unchanged. The first read must find what was promised here, or the reader gets EIO.
        """
        size = record.size_told(node)
        if size > WHOLE_FILE_LIMIT or record.fell_back:
            return False  # streamed; or its raw object failed before: read now, so the original can be served
        vouched = await self.calls.inline_or_run(node, self.reader.vouch, node, for_open=True)
        if vouched is not None:
            return bool(vouched)
        no_room = self._open_bytes + size > self.max_open_bytes
        return not decision.hold and no_room and await self.calls.source_changed(node) is None

    async def _open_held(self, node: Node, data: memoryview) -> Content:
        changed = await self.calls.source_changed(node)
        if changed is None:
            self.stats.served_from("memory", len(data))
            return Content(size=len(data), raw=node.served_raw, data=data)
        # The source changed after the bytes were taken: they are stale. Serve what the source says now.
        assert self.held is not None
        self.held.drop(node.id)
        content = await self._open_from_storage(node)
        return content

    def _decide(self, node: Node, record: Inode, job: int) -> Decision:
        if self.held is None:
            return NO_CACHE
        decision = self.held.decide(node.id, record.size_told(node), job)
        for file in decision.evicted:
            self.notifier.invalidate(file)
        return decision

    def _hold_or_drop(self, node: Node, decision: Decision, content: Content) -> None:
        if self.held is None:
            return
        if decision.hold and content.data is not None and not content.fallback \
                and content.size == node.size_served and node.id in self.held.policy.held:
            # (the policy may have let it go while this open waited for storage: another job's read took its
            # room; its bytes are then not held, outside the budget)
            self._hold(node.id, content)
        else:  # not to be held; or the policy counted it, but these bytes cannot be held (streamed, fallback)
            self.held.drop(node.id)

    def _hold(self, node_id: int, content: Content) -> None:
        """Keep ``content``'s bytes for later opens: from now on other handles share its buffer, so it must
        never go back to the buffer pool."""
        assert content.data is not None and self.held is not None
        if content.pooled:
            content.pooled = False
            POOL.forget(content.data)
        self.held.hold(node_id, content.data, content.raw)

    async def warm_one(self, node: Node) -> int | None:
        assert self.held is not None
        content = await self._open_from_storage(node, for_open=False)
        if content.data is None or content.fallback or not self.held.policy.hold(node.id, content.size):
            content.close()
            return None
        self._hold(node.id, content)
        return content.size

    async def _open_from_storage(self, node: Node, for_open: bool = True) -> Content:
        """What ``node`` serves, read from storage; ``for_open``: an open waits for it (the opens' limiter), else
        a warm-up or a deferred first read (the reads')."""
        content: Content = await self.calls.run(node, self.reader.open, node, for_open=for_open)
        if content.data is not None or content.level != "storage":
            # (a file streamed from storage, over WHOLE_FILE_LIMIT, is not read yet: not counted)
            self.stats.served_from(content.level, content.size)
        return content

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
        record = handle.inode
        assert record is not None
        if record.pushes is None:
            record.pushes = Pushes()
        pushes = record.pushes
        pushes.count += 1

        def done(ok: bool) -> None:
            handle.pushing = False
            pushes.count -= 1
            if not pushes.count:
                record.pushes = None  # an idle record left by this goes at the inode's next forget
                pushes.done.set()
            if ok:
                self.stats.bytes_pushed += len(view) - start
            if content.data is view:
                if ok:
                    handle.note_served(start, content.size)
                    self._uncount_open(handle.fh)
                    self._drop_served(handle)
                if content.data is view:  # still served from memory, as without a push: to the pool at close
                    content.pooled = pooled
                    return
            if pooled:
                POOL.give(view)

        self.notifier.store(node.id, start, view[start:], done)

    def _count_open(self, handle: Handle, *, evict: bool = True) -> None:
        """Count the bytes an open file keeps in memory outside the cache's budget, and keep the total under
        ``max_open_bytes`` by letting go of the bytes of the files opened longest ago (read again if asked).

        DALI opens and maps the 1,024 files of its shuffle buffer long before it reads them, and each file is
        read whole at open: without a bound, 1,024 raw Cityscapes images would sit in the daemon (6.4 GB).
        Opens past the bound are deferred (``_read_later``), so letting go here is for what else exceeds it
        (files the cache decided to keep, sizes changed at open).
        """
        if handle.node is None or handle.content.data is None or self._holds(handle):
            return  # nothing in memory, or the cache's budget counts these very bytes
        # direct_io opens (--page-cache direct, sizes changed at open) count too: nothing else bounds them.
        content = handle.content
        self._open_bytes_of[handle.fh] = (handle, content.size)
        self._open_bytes += content.size
        while evict and self._open_bytes > self.max_open_bytes and len(self._open_bytes_of) > 1:
            oldest, (victim, _) = next(iter(self._open_bytes_of.items()))
            self._uncount_open(oldest)
            self._drop_served(victim)
            self.stats.open_evictions += 1

    def _uncount_open(self, fh: int) -> None:
        counted = self._open_bytes_of.pop(fh, None)
        if counted is not None:
            self._open_bytes -= counted[1]

    def _drop_served(self, handle: Handle) -> None:
        """The file was read to its end: its bytes now live in the reader's page cache (or its own buffers).

        Loaders keep files open long after reading them (DALI maps every file of its 1,024-sample shuffle
        buffer), so holding each open file's bytes until release would grow the daemon by gigabytes. They are
        let go here, and the digest of each CHUNK kept instead; should the kernel ask again for some pages (its
        page cache lost them), the chunks around them are read again and must match (``_refetch``), or the
        reader gets EIO: never bytes that differ from what it already has.
        """
        content = handle.content
        if content.data is None or handle.node is None or handle.chunks is not None or self._holds(handle):
            return  # nothing to let go, or the cache holds these very bytes (and counts them in its budget)
        handle.chunks = ChunkDigests.of(content.data)
        content.close()  # back to the buffer pool when only this handle had it

    def _holds(self, handle: Handle) -> bool:
        """The cache holds the very bytes ``handle`` serves (they are shared, and counted in its budget)."""
        assert handle.node is not None
        return self.held is not None and self.held.get(handle.node.id) is handle.content.data

    async def _refetch(self, fh: int, handle: Handle, off: int, size: int) -> bytes:
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
                return await self._refetch(fh, handle, off, size) if not handle.released else b""
            handle.reading = trio.Event()
            try:
                piece = await self._read_piece(handle, *chunk_span(off, end - off, total))
            finally:
                handle.reading.set()
                handle.reading = None
            data = bytes(piece.data[off - piece.start:end - piece.start])
            if not handle.released:
                self._keep_piece(fh, piece)
            else:  # released meanwhile
                piece.close()
            return data
        return bytes(piece.data[off - piece.start:end - piece.start])

    async def _read_piece(self, handle: Handle, start: int, stop: int) -> _Piece:
        node = handle.node
        assert node is not None and handle.chunks is not None
        held = self.held.get(node.id) if self.held is not None else None
        if held is not None and len(held) == handle.content.size:
            piece = _Piece(start, held[start:stop], pooled=False)
        else:
            data = await self.calls.run(node, self.reader.read_span, node, handle.content.raw, start, stop)
            piece = _Piece(start, data, pooled=True)
            self.stats.refetches += 1
            self.stats.bytes_refetched += len(data)
        if len(piece.data) != stop - start or not handle.chunks.matches(start, piece.data):
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
            content = await self._open_from_storage(node, for_open=False)
            # The version too (None: the catalog's, which the open was vouched for): a file renamed over it, or
            # rewritten in place at its size, since the open served another file's bytes under it (to an
            # --allow-other caller, one their check never saw: the open's inode check passed on the old one).
            if (content.size, content.raw, content.version) != \
                    (handle.content.size, handle.content.raw, handle.content.version):
                content.close()
                if content.fallback and handle.inode is not None:  # the next open reads it now, as the original
                    note_fallback(handle.inode, self.stats)
                raise OSError(errno.EIO, "changed between open and first read: reopen the file",
                              os.fsdecode(node.path))
            handle.content = content
            if handle.decision.hold:
                self._hold_or_drop(node, handle.decision, content)
        except OSError as exc:
            handle.failed = exc.errno or errno.EIO
            raise
        finally:
            handle.reading.set()
            handle.reading = None



@dataclass(eq=False, slots=True)
class _Piece:
    """CHUNKs of a file read again (``DaemonPath._refetch``), from ``start``."""

    start: int
    data: memoryview
    pooled: bool  # a pool buffer of its own, given back when dropped (not a slice of bytes the cache holds)

    def close(self) -> None:
        if self.pooled:
            POOL.give(self.data)
            self.pooled = False


def _refuse_if_superseded(handle: Handle) -> None:
    """EIO for a read of an open that another has superseded (``_serving_other_bytes``), before or after any
    wait: its bytes, answered after the superseding open was, would reach the one page cache of the inode."""
    if handle.superseded:
        assert handle.node is not None
        raise OSError(errno.EIO, "changed while open, and opened again since: reopen the file",
                      os.fsdecode(handle.node.path))
