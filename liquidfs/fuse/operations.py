"""The FUSE layer: translates kernel requests into catalog queries, and file opens, reads and releases into calls
of the one data path the mount serves with (``datapath.base.DataPath``), and nothing else: it never asks which.
What decides about an open is each its own part's (``PerOpen``): the open-file budget (``fuse.open_budget``), the
mix and what the held level gives up for it (``mix.share.Mix.view_held``), the opener's job (``policy.jobs``).

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
import os
import stat
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from ..catalog.catalog import Catalog
from ..catalog.identity import version_inode
from ..catalog.nodes import CONTROL_ID, CONTROL_NAME, KIND_DIR, KIND_FILE, KIND_SYMLINK, ROOT_ID, Node
from ..datapath.base import DataPath
from ..datapath.inodes import Handle, Inode, Inodes, note_fallback
from ..datapath.notifier import Notifier
from ..datapath.shared_inodes import SharedInodes
from ..datapath.storage_calls import StorageCalls
from ..metrics.defs import counters
from ..metrics.stats import HasStatistics, MountStats, Statistics
from ..mix.share import Mix
from ..policy.jobs import JobLookups
from ..stores.reader import Content
from .listing import Listings, list_bare, list_plus
from .lookahead import WARM_CLAIM, MetadataAhead
from .open_budget import OpenBudget
from .peers import Peers, fh_of, merged, plus
from .request_times import RequestTimes, on_loop_cpu

if TYPE_CHECKING:
    from ..policy.next_epoch import NextEpochCache

log = logging.getLogger(__name__)

__all__ = ["CONTROL_ID", "CONTROL_NAME", "Operations"]

#: How long the kernel may keep a name and its attributes: a day. The tree never changes under a mount, and a size that
#: does (a fallback, the mix) is dropped from the kernel's caches before the open that serves it is answered
#: (``_tell_size``; with several loops, so is one their shared table lets go), never left to expire. Past the timeout,
#: each open of a name sends a LOOKUP again: with 300 s, every epoch longer than five minutes (ImageNet's 1.28 M files
#: at 3,000 images/s: seven) paid one per file, and 3,000 files looked up more than the timeout before were read at
#: 4.2-5.4 k files/s against 5.0-7.5 k, 147-207 us of the daemon's CPU a file against 93-170 (8 readers; BENCHMARKS.md,
#: "Names that outlive an epoch").
ATTR_TIMEOUT = 86_400.0
#: The file type shown for each kind of row.
_TYPE_OF_KIND = {KIND_FILE: stat.S_IFREG, KIND_DIR: stat.S_IFDIR, KIND_SYMLINK: stat.S_IFLNK}
#: The bits of a row's mode shown (``Operations._attrs``): read, execute and the sticky bit.
_MODE_SHOWN = 0o1555
_BLOCK = 512
#: Distinct errors logged at warning level; repeats (a reader retrying a broken file) go to debug.
_MAX_LOGGED = 10_000

#: The errnos a storage error is answered with as it is; any other is EIO. ENOSYS to an OPEN tells the kernel
#: that this filesystem has no OPEN at all, and it sends none, nor a RELEASE, for the rest of the mount (the reads
#: that follow carry no handle: a dead mount); another to a request that may have none stops those for good too.
#: A number no errno has (1000 or more: ERANGE from libfuse; 512 to 999: a reply the kernel refuses, leaving the
#: caller waiting) is never passed on.
_PASSED_ON = frozenset(errno.errorcode) - {errno.ENOSYS}

P = ParamSpec("P")
R = TypeVar("R")


def served_inode(row: Node, content: Content) -> int | None:
    """The inode number of the source version ``content`` serves: the one it read where the source changed since
    the scan (``Content.version``), else the catalog's (a raw object, a held copy, the source as scanned)."""
    return content.version[0] if content.version is not None else version_inode(row.etag)


def _handler(func: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    name = func.__name__

    @functools.wraps(func)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        ops: Operations = args[0]  # type: ignore[assignment]
        times = ops.requests[name]
        times.count += 1
        started = time.perf_counter()
        try:
            if ops.time_requests:
                return await on_loop_cpu(func(*args, **kwargs), times)
            return await func(*args, **kwargs)
        except FUSEError:
            raise
        except OSError as exc:
            ops.stats.errors += 1
            code = exc.errno if exc.errno in _PASSED_ON else errno.EIO
            first = ops.first_error((name, code, exc.filename, exc.strerror))
            log.log(logging.WARNING if first else logging.DEBUG, "%s: %s", name, exc)
            raise FUSEError(code) from None
        except Exception as exc:
            ops.stats.errors += 1
            # A fault met at every open of a file (a catalog row of the wrong type) must not write a traceback
            # per open: the first of each kind has its traceback, the rest a line at debug level.
            if ops.first_error((name, type(exc).__name__, _raised_at(exc))):
                log.exception("unexpected error in %s; answering EIO (more of this kind: at debug level)", name)
            else:
                log.debug("unexpected error in %s: %r; answering EIO", name, exc)
            raise FUSEError(errno.EIO) from None
        finally:
            times.wall_s += time.perf_counter() - started

    wrapper.fuse_request = True  # type: ignore[attr-defined]  # counted in Operations.requests
    return wrapper


def _raised_at(exc: BaseException) -> tuple[str, int]:
    """Where ``exc`` was raised (file and line): two faults of one type are two kinds where they differ."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else ("", 0)


@dataclass
class PerOpen:
    """What each open of a file is decided by, beside the data path: each its own part's."""

    #: Open files at once, and each user's share of them.
    budget: OpenBudget = field(default_factory=OpenBudget)
    #: ``mount --mix``: which images with a raw object each open serves raw (None: all of them).
    mix: Mix | None = None
    #: The job of an opener, for a next-epoch policy that counts each job's epochs (None: no policy).
    jobs: JobLookups | None = None
    #: With --allow-other (local sources): the inode number of a file's source that a caller may read as the
    #: source is now (None: may not).
    may_read: Callable[[Node, int, int, int], int | None] | None = None


class Operations(pyfuse3.Operations):
    """A read-only view of a catalog; file bytes are served by a data path."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    #: Plain READDIR pages once no lookup follows a listing's first one (``listing``; our pyfuse3 patch reads it).
    readdirplus_auto = True

    def __init__(self, catalog: Catalog, stats: MountStats, calls: StorageCalls, notifier: Notifier,
                 data_path: DataPath | None, *, per_open: PerOpen | None = None,
                 lookahead: MetadataAhead | None = None,
                 levels: Sequence[HasStatistics] = (),
                 enable_passthrough: bool = False, time_requests: bool = False) -> None:
        """``data_path`` None: it is chosen once the connection's INIT says what the kernel grants
        (``serve_with``); opens wait for it meanwhile."""
        super().__init__()
        self.catalog = catalog
        self.stats = stats
        self.calls = calls
        self.notifier = notifier
        files, served, _, max_id = catalog.file_totals()
        self.inodes = Inodes(stats, max_id)
        self.open_files: dict[int, Handle] = {}
        self._next_fh = 1
        #: ``mount --loops``: the other loops (None: this is the only one).
        self.peers: Peers | None = None
        self.other_loops: list[dict[str, Any]] = []  # their statistics as last gathered (``gather_loops``)
        self.ended_loops: dict[str, Any] = {}  # the counters of the loops that ended, summed (``gather_loops``)
        self.data_path = data_path
        self._data_chosen = trio.Event()
        if data_path is not None:
            self.serve_with(data_path)
        self._logged: set[tuple[object, ...]] = set()
        #: Count and wall time of each request type; with ``time_requests`` also the loop CPU of its steps.
        self.requests: dict[str, RequestTimes] = {name: RequestTimes() for name in REQUEST_TYPES}
        self.time_requests = time_requests
        #: Warms a directory's metadata when a lookup shows it cold (None: a reader whose storage is remote).
        self.lookahead = lookahead
        self.listings = Listings()
        per_open = per_open if per_open is not None else PerOpen()
        self.open_budget = per_open.budget
        self.open_budget.first_error = self.first_error  # one bound on what the mount logs of its errors
        self.jobs = per_open.jobs
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.stats.files = files
        self.stats.dataset_bytes = served
        #: Levels beside the data path (the disk level, the cluster level): their counters in ``statistics``.
        self.levels = tuple(levels)
        self.may_read = per_open.may_read
        #: Ask for passthrough at INIT (read by the patched pyfuse3's fuse_init); the stock one ignores it.
        self.enable_passthrough = enable_passthrough
        self.mix = per_open.mix

    def join_loops(self, peers: Peers, shared: SharedInodes) -> None:
        """Serve as loop ``peers.index`` of several on one connection: handles name this loop, a request for
        another's goes there, and the sizes told are agreed through ``shared`` (the backings too: the daemon joins
        its passthrough path to them, ``PassthroughPath.join_loops``)."""
        self.peers = peers
        self.inodes.shared = shared
        if self.lookahead is not None:  # one loop reads a directory's inodes from the disk, not every one at once
            self.lookahead.join_loops(
                lambda directory, within: shared.claim_directory(directory, time.monotonic(), within, WARM_CLAIM),
                lambda directory, rest: shared.directory_warmed(directory, time.monotonic() + rest))

    def serve_with(self, path: DataPath) -> None:
        """The data path every open is served by from now on: given at construction, or chosen once after INIT
        (passthrough where the kernel granted it). Set once."""
        if self._data_chosen.is_set():
            raise RuntimeError("the data path is chosen once")
        self.data_path = path
        self.stats.data_path = path.name
        self._data_chosen.set()

    async def _chosen_path(self) -> DataPath:
        if self.data_path is None:  # an open between INIT and the choice of the data path
            await self._data_chosen.wait()
        assert self.data_path is not None
        return self.data_path

    @property
    def policy(self) -> NextEpochCache | None:
        """The next-epoch policy of the data path (None before it is chosen, or without a cache)."""
        held = self.data_path.held if self.data_path is not None else None
        return held.policy if held is not None else None

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = node.id
        entry.generation = 0
        entry.entry_timeout = ATTR_TIMEOUT
        entry.attr_timeout = ATTR_TIMEOUT
        # The type the row's kind says (a row whose mode names a device would make the kernel an inode of one),
        # read and execute bits only: no write bits (read-only), and no set-user-ID or set-group-ID bit, which
        # over the daemon's owner (root) would make a source user's program run as root on a mount with -o suid.
        entry.st_mode = _TYPE_OF_KIND[node.kind] | (node.mode & _MODE_SHOWN)
        entry.st_nlink = node.nlink
        entry.st_uid = self.uid
        entry.st_gid = self.gid
        size = self.inodes.size_told(node)
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
        # The owner's only: with --allow-other, other users would read the daemon's pid, source and store.
        entry.st_mode = stat.S_IFREG | 0o400
        entry.st_nlink = 1
        entry.st_uid = self.uid
        entry.st_gid = self.gid
        entry.st_size = 0  # served with direct_io: readers read until EOF, not to st_size
        entry.entry_timeout = 0
        entry.attr_timeout = 0
        return entry

    def _node(self, inode: int) -> Node:
        node = self.inodes.node(inode) or self.catalog.get(inode)
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
            found = self.lookahead.row(parent_inode, name) if self.lookahead is not None else None
            if found is None:
                found = self.catalog.lookup(parent_inode, name)
            if found is None:
                raise FUSEError(errno.ENOENT)
            node = found
            if node.kind == KIND_FILE:
                self.listings.looked_up(parent_inode)
                if self.lookahead is not None:
                    self.lookahead.looked_up(parent_inode)
        entry = self._attrs(node)  # first: a row that fails here is EIO, and no reference the kernel never forgets
        self.inodes.looked_up(node)
        return entry

    async def forget(self, inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
        for inode, count in inode_list:
            self.inodes.forget(inode, count)

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
        # A plain READDIR (the kernel's READDIRPLUS_AUTO) can carry no attributes, whatever the directory wants;
        # a stock pyfuse3's token has no ``plus`` (it asks for READDIRPLUS only).
        # The lookups the reply's entries carry are counted once it is whole: a reply that fails on the way (a
        # catalog page that cannot be read) is never sent, and the kernel never forgets what it never got.
        taken: list[Node] = []
        if self.listings.with_attributes(fh) and getattr(token, "plus", True):
            self.stats.listed_with_attributes += list_plus(self.catalog, fh, start_id, token, self._attrs,
                                                           taken.append)
            self._looked_up(taken)
            return
        with_attrs, bare, packed = list_bare(self.catalog, fh, start_id, token, self._attrs, taken.append)
        self._looked_up(taken)
        self.stats.listed_with_attributes += with_attrs
        self.stats.listed_bare += bare
        self.stats.listed_packed += packed
        self.listings.listed_bare(fh, bare)

    def _looked_up(self, nodes: list[Node]) -> None:
        for node in nodes:
            self.inodes.looked_up(node)

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
            content = Content(size=0, raw=False, data=memoryview(await self._control_bytes()))
            handle = Handle(content, fh=self._new_fh(), direct_io=True)
            self.open_files[handle.fh] = handle
            return self._file_info(handle)
        node = self._node(inode)
        if node.kind == KIND_DIR:
            raise FUSEError(errno.EISDIR)
        self.open_budget.take(ctx.uid)  # before the first await (``OpenBudget.take``)
        try:
            with self.calls.opening(ctx.uid):
                info = await self._open_file(node, ctx)
        except BaseException:
            self.open_budget.give_back(ctx.uid)
            raise
        self.open_budget.opened(info.fh, ctx.uid)
        return info

    async def _open_file(self, node: Node, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        """The open of a file, its slot of the budget taken."""
        checked: int | None = None
        if self.may_read is not None and ctx.uid not in (0, self.uid):
            # --allow-other: the kernel checked the modes of the scan; the source's own, now, decide too.
            checked = await self.calls.run(node, self.may_read, node, ctx.uid, ctx.gid, ctx.pid, for_open=True)
            if checked is None:
                raise FUSEError(errno.EACCES)
        data = self.data_path if self.data_path is not None else await self._chosen_path()
        record = self.inodes[node.id]
        record.opens += 1  # until its release (``_release``)
        mixed = self.mix is not None and node.served_raw and not record.fell_back
        row = node  # the catalog's: what a GETATTR says where no other size was told (the mix's view is not)
        viewed = False  # this open counted by the mix (``Mix.view``): released with it, never another's count
        try:
            if mixed:
                assert self.mix is not None
                view, swapped = self.mix.view_held(node, data.held)
                viewed = True
                self.stats.held_swapped += swapped
                # Where the view is another size than the kernel was told, its attributes are dropped before the
                # open is answered.
                await self._tell_size(node, record, view.size_served)
                node = view
            job = await self.jobs.job(ctx.pid, ctx.uid) if self.jobs is not None else 0
            handle = await data.open(node, record, self._new_fh(), job)
        except BaseException:
            record.opens -= 1
            if viewed:
                assert self.mix is not None
                self.mix.release(node.id)
            self.inodes.tidy(record)
            raise
        handle.mixed = mixed
        self.open_files[handle.fh] = handle
        self.stats.opens += 1
        self.stats.opens_raw += handle.content.raw
        if handle.content.fallback:
            note_fallback(record, self.stats)
        if checked is not None and served_inode(row, handle.content) not in (None, checked):
            # The file the caller was found to may read is not the one served: the path led elsewhere between the
            # check and this open (a file renamed over the one checked by whoever may rename in its directory).
            await self._release(handle.fh)
            # (once a file: whoever may rename in its directory could make one a request)
            log.log(logging.WARNING if self.first_error(("open", "swapped", row.path)) else logging.DEBUG,
                    "open of %s: the source changed between the caller's check and the open; refused",
                    os.fsdecode(row.path))
            raise FUSEError(errno.EACCES)
        # A fallback, or a source changed in place: the kernel reads to its own end, but stat must say the new
        # size too (DALI maps as many bytes as stat says). (Checked here first: most opens tell nothing, and the
        # coroutine's call and await cost each open ~0.5 us of the loop's time.)
        # Against the catalog's row, not the mix's view: a size the mix told may have been let go meanwhile (with
        # --loops, by another loop's tell), and a GETATTR then says the row's.
        if handle.content.size != self.inodes.size_told(row):
            try:
                await self._tell_size(row, record, handle.content.size)
            except BaseException:
                await self._release(handle.fh)
                raise
        return self._file_info(handle)

    async def _tell_size(self, node: Node, record: Inode, size: int) -> None:
        """Where ``size`` is not what the kernel was told of ``node``, it is from now on: the kernel's attributes
        are dropped before the open is answered."""
        if size != self.inodes.size_told(node):
            if self.inodes.shared is None:
                record.size = size
            else:  # told by this loop: a GETATTR in another says the same
                # (In the shared table alone: the kernel's FORGET may reach another loop than its LOOKUP did, so a
                # size kept in this loop's record would keep the record for good.)
                for let_go in self.inodes.shared.tell(node.id, None if size == node.size_served else size):
                    # Sizes let go to make room (files no loop has open): the kernel must not keep them.
                    self.notifier.invalidate(let_go, attr_only=True)
            await self.notifier.new_size(node.id)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh if self.peers is None else fh_of(fh, self.peers.index)

    @staticmethod
    def _file_info(handle: Handle) -> pyfuse3.FileInfo:
        info = pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(handle.fh), direct_io=handle.direct_io,
                                keep_cache=handle.keep_cache, nonseekable=False)
        if handle.backing_id:
            info.backing_id = handle.backing_id
        return info

    def first_error(self, key: tuple[object, ...]) -> bool:
        """True the first time an error is seen: a reader retrying a broken file must not flood the log."""
        if key in self._logged:
            return False
        if len(self._logged) < _MAX_LOGGED:
            self._logged.add(key)
        return True


    @_handler
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        handle = self.open_files.get(fh)
        if handle is None:
            if self.peers is not None and self.peers.owner(fh) is not None:
                return await self.peers.read(fh, off, size)
            raise FUSEError(errno.EBADF)
        if handle.node is None:  # the control file
            return bytes(handle.content.read(off, size))
        assert self.data_path is not None
        data = await self.data_path.read(handle, off, size)
        self.stats.bytes_read += len(data)
        self.stats.read_requests += 1
        return data  # type: ignore[return-value]  # pyfuse3 takes any contiguous buffer

    @_handler
    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        if self.peers is not None and self.peers.owner(fh) is not None:
            await self.peers.release(fh)  # opened in another loop (its handle says which): released there
            return
        await self._release(fh)

    async def _release(self, fh: int) -> None:
        handle = self.open_files.pop(fh, None)
        if handle is None:
            return
        self.open_budget.released(fh)
        if handle.mixed:
            assert self.mix is not None and handle.node is not None
            self.mix.release(handle.node.id)
        if handle.node is None:
            handle.content.close()
            return
        assert self.data_path is not None and handle.inode is not None
        try:
            await self.data_path.release(handle)
        finally:
            handle.inode.opens -= 1
            self.inodes.tidy(handle.inode)

    def statistics(self) -> dict[str, Any]:
        """Every counter of the mount, from each component's own snapshot: what ``liquidfs stats`` shows (the
        control file) and ``/metrics`` exports."""
        parts: list[Statistics] = [self.calls.statistics()]
        if self.data_path is not None:
            parts.append(self.data_path.statistics())
            if self.data_path.held is not None:
                parts.append(self.data_path.held.statistics())
        if self.lookahead is not None:
            parts.append(self.lookahead.statistics())
        parts.extend(level.statistics() for level in self.levels)
        values = self.stats.to_dict()
        values["open_files"] = len(self.open_files)
        values["known_inodes"] = self.inodes.known
        for part in parts:
            values.update(part.values())  # each part's keys its own (its prefix): none is renamed here
        values["requests"] = {name: dataclasses.asdict(t) for name, t in self.requests.items()}
        if self.mix is not None:
            values["mix"] = dataclasses.asdict(self.mix.statistics())
        if self.jobs is not None:
            self.jobs.name_openers(values.get("jobs"))
        if self.peers is not None:
            values["loop"] = self.peers.index
            values["loop_pid"], values["pid"] = values["pid"], self.peers.first_pid  # the mount's daemon
            values["loop_requests_forwarded"] = self.peers.forwarded  # sent to the loop that opened the file
            values["loop_requests_answered"] = self.peers.answered    # answered here for another loop
        return values

    def mount_statistics(self) -> dict[str, Any]:
        """Every loop's counters as one (``/metrics``): this loop's now, the others' as ``gather_loops`` last
        found them."""
        values = self.statistics()
        return values if self.peers is None else plus(merged([values, *self.other_loops]), self.ended_loops)

    async def gather_loops(self, interval: float) -> None:
        """Until cancelled: the other loops' statistics gathered every ``interval`` seconds. A loop that does not
        answer in time (busy) keeps its last ones: left out, it took its share out of every counter's total, and
        the scraper took that dip for a reset (a jump of each rate). A loop gone leaves its last counters in the
        totals (``ended_loops``), its gauges with it."""
        assert self.peers is not None
        last: dict[int, dict[str, Any]] = {}
        while True:
            for values in await self.peers.statistics():
                loop = values.get("loop")
                if isinstance(loop, int):
                    last[loop] = values
            for loop in self.peers.gone_loops:
                ended = last.pop(loop, None)
                if ended is not None:
                    ended_counts = counters(ended)
                    self.ended_loops = plus(self.ended_loops, ended_counts) if self.ended_loops else ended_counts
            self.other_loops = [last[loop] for loop in sorted(last)]
            await trio.sleep(interval)

    async def _control_bytes(self) -> bytes:
        values = self.statistics()
        if self.peers is not None:
            values = plus(merged([values, *await self.peers.statistics()]), self.ended_loops)
        return (json.dumps(values, indent=1, sort_keys=True) + "\n").encode()

    # -- everything that would write -----------------------------------------------------------------

    async def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _read_only
    write = create = setxattr = removexattr = _read_only

    async def _nothing_written(self, *args: Any, **kwargs: Any) -> None:
        # Nothing is ever written: ENOSYS tells the kernel so, for good. It sends no FLUSH at any later close (one
        # request fewer per file opened), and answers every later fsync itself, done, as a read-only disk answers
        # that of a file open for reading (EROFS failed a tool that syncs what it read, and its copy with it).
        raise FUSEError(errno.ENOSYS)

    flush = fsync = fsyncdir = _nothing_written

    async def getxattr(self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT,
                       ctx: pyfuse3.RequestContext) -> bytes:
        raise FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []


#: The request types ``Operations`` counts and times (its handlers).
REQUEST_TYPES = tuple(name for name, value in vars(Operations).items() if getattr(value, "fuse_request", False))
