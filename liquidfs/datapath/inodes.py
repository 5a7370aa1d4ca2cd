"""What the mount keeps of what the kernel holds: one record per inode it knows (``Inode``) and one per file it
has open (``Handle``).

Everything the FUSE layer and the data paths keep about an inode sits in its one record, as libfuse's
``passthrough_hp.cc`` keeps it in ``struct Inode``: the size it was told where that is not the catalog's,
whether its raw object failed, the backing its passthrough opens share, its opens that read through the page
cache and the page stores queued for it on the daemon path. A record lives while any of that says something.

Two things are kept for every inode the kernel holds, and a ``find`` over ten million files makes it hold them
all (issue 28: <= 300 MB of daemon memory after one): so they are not in records. The lookups the kernel will
forget are one machine word per catalog id in an array (8 bytes an inode, where a record and its dict entry
took ~650 with the catalog row); the rows of the latest lookups are kept, a bounded number, for the open and
getattr that follow a lookup (the catalog never changes under a mount, so a row kept longer is still true).
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..catalog.nodes import Node
from ..metrics.stats import MountStats
from ..policy.next_epoch import NO_CACHE, Decision
from ..stores.reader import ChunkDigests, Content

if TYPE_CHECKING:
    from .backing import SharedBacking
    from .shared_inodes import SharedInodes


@dataclass(eq=False, slots=True)
class Pushes:
    """Stores of one inode's pages queued for the kernel (``DaemonPath._push_rest``)."""

    count: int = 0
    done: trio.Event = field(default_factory=trio.Event)


#: Catalog rows of the latest lookups kept (``Inodes.node``): a lookup's open follows it within a few requests.
ROWS_KEPT = 65536


@dataclass(eq=False, slots=True)
class Inode:
    id: int
    #: The size the kernel was told where it is not the catalog's (a fallback to the original, a source changed
    #: in place, the other representation of a mixed image).
    size: int | None = None
    fell_back: bool = False  # its raw object was not served once: read at open from now on, not mixed
    #: Passthrough: the backing every open of it shares while any is open (the kernel allows one per inode).
    shared: SharedBacking | None = None
    #: Daemon path: its opens, by fh, page-cached or direct_io (``DaemonPath._supersede_others``).
    open_handles: dict[int, Handle] | None = None
    pushes: Pushes | None = None  # daemon path: page stores not yet taken by the kernel
    #: Its opens under way or open (``Operations._open_file`` to its release): the record stays while any is, or
    #: an open would fill one nobody finds (a later open could not see its page-cached handle to supersede it,
    #: nor the fallback a direct_io open's first read found).
    opens: int = 0

    def size_told(self, node: Node) -> int:
        return node.size_served if self.size is None else self.size

    def idle(self) -> bool:
        return not (self.size is not None or self.fell_back or self.shared is not None
                    or self.open_handles or self.pushes is not None or self.opens)


def note_fallback(record: Inode, stats: MountStats) -> None:
    """``record``'s raw object was not served, when it should have been: counted once per file."""
    if not record.fell_back:
        record.fell_back = True
        stats.fallbacks += 1


class Inodes:
    """The records of the inodes the mount is keeping anything of, by inode number; the kernel's lookups of each;
    the catalog rows of the latest lookups."""

    def __init__(self, stats: MountStats, max_id: int = 1) -> None:
        """``max_id``: the catalog's highest id (the array of lookups grows past it if need be)."""
        self.stats = stats
        self._records: dict[int, Inode] = {}
        self._lookups = _words(max_id + 1)  # by inode number: the kernel's references
        self._rows: OrderedDict[int, Node] = OrderedDict()  # the rows of the latest lookups, oldest first
        self.known = 0  # inodes the kernel holds a reference to
        #: ``mount --loops``: the sizes told by every loop (``Operations.join_loops``; None: one loop).
        self.shared: SharedInodes | None = None

    def __getitem__(self, inode: int) -> Inode:
        """The record of ``inode``, made if there is none yet."""
        record = self._records.get(inode)
        if record is None:
            record = self._records[inode] = Inode(inode)
        return record

    def get(self, inode: int) -> Inode | None:
        return self._records.get(inode)

    def __len__(self) -> int:
        return len(self._records)

    def size_told(self, node: Node) -> int:
        """The size the kernel was told of ``node`` (its attributes say it), by whichever loop told it."""
        if self.shared is not None:
            told = self.shared.size(node.id)
            return node.size_served if told is None else told
        record = self._records.get(node.id)
        return node.size_served if record is None else record.size_told(node)

    def lookups(self, inode: int) -> int:
        """The kernel's references to ``inode`` (lookups and readdirplus entries) not yet forgotten."""
        return self._lookups[inode] if inode < len(self._lookups) else 0

    def looked_up(self, node: Node) -> None:
        inode = node.id
        if inode >= len(self._lookups):
            self._lookups = _words(max(inode + 1, 2 * len(self._lookups)), self._lookups)
        if not self._lookups[inode]:
            self.known += 1
        self._lookups[inode] += 1
        rows = self._rows
        if inode not in rows:
            rows[inode] = node
            if len(rows) > ROWS_KEPT:
                rows.popitem(last=False)

    def node(self, inode: int) -> Node | None:
        """The catalog row of ``inode`` where a recent lookup left it here."""
        return self._rows.get(inode)

    def forget(self, inode: int, count: int) -> None:
        held = self.lookups(inode)
        if held:
            left = max(0, held - count)
            self._lookups[inode] = left
            if not left:
                self.known -= 1
                record = self._records.get(inode)
                if record is not None:
                    record.size = None  # the kernel asks for attributes afresh at its next lookup
                    self.tidy(record)

    def tidy(self, record: Inode) -> None:
        """Let ``record`` go once it holds nothing."""
        if record.idle() and self._records.get(record.id) is record:
            del self._records[record.id]


def _words(count: int, old: memoryview | None = None) -> memoryview:
    """``count`` zeroed machine words in anonymous memory (``old``'s first): pages never written are never
    resident, so a mount of ten million files holds the pages its lookups touched, not 80 MB from the start (and
    each loop of ``mount --loops`` its own)."""
    words = memoryview(mmap.mmap(-1, 8 * max(1, count))).cast("Q")
    if old is not None:
        words[:len(old)] = old
    return words


@dataclass(slots=True)
class Handle:
    """One open file: what it serves and how, whichever data path serves it."""

    content: Content
    node: Node | None = None     # None: the control file
    decision: Decision = field(default_factory=lambda: NO_CACHE)
    fh: int = 0
    inode: Inode | None = None   # its inode's record (None: the control file)
    direct_io: bool = False      # every read reaches the daemon: the bytes are kept until release
    keep_cache: bool = False     # the kernel may keep the pages of this open (a file the daemon holds)
    backing_id: int = 0          # passthrough: the kernel serves it from this registered backing
    served: list[list[int]] = field(default_factory=list)  # [start, end) ranges served, merged, sorted
    #: The digest of each CHUNK served, set once the bytes were let go after a whole read (``_drop_served``).
    chunks: ChunkDigests | None = None
    reading: trio.Event | None = None  # set while one read of this handle reads storage for the others
    pushing: bool = False        # the rest of the file is being handed to the kernel (``_push_rest``)
    failed: int | None = None    # the errno its first read failed with (``_first_read_once``)
    mixed: bool = False          # its representation was chosen by ``mount --mix`` (released there too)
    released: bool = False       # released while a read of it was still waiting
    #: A later open of its inode serves other bytes: its reads, which would reach the shared page cache, fail.
    superseded: bool = False

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
