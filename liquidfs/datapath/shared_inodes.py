"""What a mount's loops (``mount --loops N``: processes serving one FUSE connection) must agree on per inode, in
memory they share: the backing its open files share, and the size the kernel was told where it is not the
catalog's.

The kernel allows one backing file per inode while any open of it exists, and an OPEN may reach any loop: the
first loop to open an inode registers its backing (ids are the connection's, usable from every loop; where two
open it at once, one's id is kept and the other's closed) and the others' opens of it share that id, where the
file they checked themselves is the same one; the last loop to let it go closes it. The kernel's calls are made
outside the lock. Each loop's users are counted apart, so a loop that dies can be taken out of every count
(``reap``). Sizes: a GETATTR may reach a loop other than the one whose open found a fallback of another size, and
must say what that open said. Directories: which loop's read-ahead warms a directory's inodes (``claim_directory``):
the LOOKUPs of one directory reach every loop, and each would read the same inodes from the disk at once.

Two open-addressed tables of fixed slots in one anonymous shared mapping made before the fork, under one lock (a
record lock the kernel lets go of when its holder dies). Both hold few entries: the backings of the inodes open now (bounded by the opens in
flight), the sizes of files whose raw object was not served. The directories' claims are a cache beside them
(a slot per hash: a directory whose slot another took may be warmed twice, nothing worse).
"""

from __future__ import annotations

import errno
import logging
import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Loops a mount may run (each has a user count in every backing slot).
MAX_LOOPS = 32
#: Slots of the backings' table: inodes open at once across the loops (6 MB shared); past it an open fails with
#: EMFILE. A loader keeps at most its shuffle buffer open (DALI's 1,024 by default), far below.
BACKING_SLOTS = 1 << 16
#: Slots of the sizes' table: files served at another size than the catalog's (fallbacks). Past half of them the
#: sizes of files no loop has open are let go, and the kernel's attributes of them dropped (``tell``'s caller): it
#: asks again, and hears the catalog's size, until an open of such a file tells it another before it is answered.
SIZE_SLOTS = 65536
#: Slots of the directories' claims (``claim_directory``): directories warmed within a claim's time at once.
CLAIM_SLOTS = 4096

_EMPTY = 0  # a slot's inode when it holds none (inode numbers start at 1)
_BACKING = struct.Struct(f"<qiqq{MAX_LOOPS}H")  # inode, backing id, st_dev, st_ino, users per loop
# Parts of a backing slot, read and written alone (the whole slot is 36 fields: ~2 us each way in Python)
_ID_FILE = struct.Struct("<iqq")  # backing id, st_dev, st_ino
_ID_AT, _USERS_AT = 8, struct.calcsize("<qiqq")  # after the inode; after inode, id, st_dev, st_ino
_USERS = struct.Struct("<H")
_NO_USERS = bytes(2 * MAX_LOOPS)
_SIZE = struct.Struct("<qq")  # inode, size told
_HEADER = struct.Struct("<q")  # sizes recorded: none, the common case, is read without the lock
_DIRECTORY_CLAIM = struct.Struct("<qd")  # directory inode, when claimed (CLOCK_MONOTONIC: one clock for all loops)


class Conflict(OSError):
    """Another loop's open of the inode serves other bytes than this open checked (a source changed meanwhile), or
    the same bytes as the other kind of backing (``held_in_memory``: a memfd's, where this open has the file)."""

    #: Whether the backing another loop registered is a memfd's (its identity a digest), not a file's.
    held_in_memory = False


class TableFull(OSError):
    pass


def signed64(value: int) -> int:
    """An unsigned 64-bit number (an inode number, a device, a digest) as the signed one of the same bits, as the
    shared table packs it: an inode number at or past 2**63 (overlayfs with xino, some NFS and FUSE sources)
    made every open of its file under --loops fail (struct.error, EIO)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _home(inode: int, slots: int) -> int:
    return ((inode * 0x9E3779B97F4A7C15) >> 17) % slots


class _Table:
    """Fixed slots of ``record`` (its first field the inode) at ``base`` of ``memory``, linear probing; a slot
    freed is filled by shifting back the entries after it, so no tombstone ever lengthens a search."""

    def __init__(self, memory: mmap.mmap, base: int, record: struct.Struct, slots: int) -> None:
        self.memory, self.base, self.record, self.slots = memory, base, record, slots

    def offset(self, at: int) -> int:
        return self.base + at * self.record.size

    def inode_at(self, at: int) -> int:
        return int(struct.unpack_from("<q", self.memory, self.offset(at))[0])

    def find(self, inode: int) -> tuple[int, int | None]:
        """(the slot holding ``inode``, or -1; the empty slot that ends its probe, or None where all are full)."""
        at = _home(inode, self.slots)
        for _ in range(self.slots):
            held = self.inode_at(at)
            if held == inode:
                return at, None
            if held == _EMPTY:
                return -1, at
            at = (at + 1) % self.slots
        return -1, None

    def sweep(self, drop: Callable[[int], bool]) -> list[int]:
        """``drop(at)`` for each slot holding an entry (it may rewrite the entry); where it says True the slot is
        freed and looked at again, as a later entry may have moved into it. Returns the inodes of the slots freed."""
        freed: list[int] = []
        at = 0
        while at < self.slots:
            inode = self.inode_at(at)
            if inode != _EMPTY and drop(at):
                self.remove(at)
                freed.append(inode)
            else:
                at += 1
        return freed

    def remove(self, at: int) -> None:
        """Free slot ``at``, moving back each later entry of the run whose home lies at or before the gap. Each
        other slot is looked at once at most: in a full table the run never meets an empty slot, and the search
        for one went round for good, under the lock every loop of the mount takes (all of them hung)."""
        memory, size = self.memory, self.record.size
        gap = at
        nxt = at
        for _ in range(self.slots - 1):
            nxt = (nxt + 1) % self.slots
            held = self.inode_at(nxt)
            if held == _EMPTY:
                break
            home = _home(held, self.slots)
            # The entry at nxt may move into the gap where its home is not within (gap, nxt], cyclically.
            if (gap < nxt and (home <= gap or home > nxt)) or (gap > nxt and home <= gap and home > nxt):
                start = self.offset(nxt)
                memory[self.offset(gap):self.offset(gap) + size] = memory[start:start + size]
                gap = nxt
        struct.pack_into("<q", memory, self.offset(gap), _EMPTY)


class SharedInodes:
    """Per inode, across a mount's loops: its registered backing and users (``attach``/``detach``), the size
    told (``size``/``tell``), and for a directory which loop warms its inodes (``claim_directory``). Made before
    the fork; each loop then uses it with its own ``loop`` index."""

    def __init__(self, loops: int, *, backing_slots: int = BACKING_SLOTS, size_slots: int = SIZE_SLOTS,
                 claim_slots: int = CLAIM_SLOTS) -> None:
        if not 1 <= loops <= MAX_LOOPS:
            raise ValueError(f"loops must be in 1..{MAX_LOOPS}")
        self.loops = loops
        sizes_at = _HEADER.size + backing_slots * _BACKING.size
        self._claims_at = sizes_at + size_slots * _SIZE.size
        self._claim_slots = claim_slots
        self._map = mmap.mmap(-1, self._claims_at + claim_slots * _DIRECTORY_CLAIM.size,
                              flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self._backings = _Table(self._map, _HEADER.size, _BACKING, backing_slots)
        self._sizes = _Table(self._map, sizes_at, _SIZE, size_slots)
        self._lock = _DeathSafeLock()

    # -- backings --------------------------------------------------------------------------------------

    def attach(self, inode: int, loop: int, identity: tuple[int, int], register: Callable[[], int],
               unregister: Callable[[int], None]) -> int:
        """One more user in ``loop`` of ``inode``'s backing, whose file is ``identity`` (st_dev, st_ino): the id
        another loop registered for that very file, else ``register()``'s. ``Conflict`` where another loop's
        backing of the inode is another file.

        ``register()`` (an ioctl, ~20 us) is made outside the lock, which every open and release of every loop
        takes: where no loop has the file, the lock is let go, the file registered, and the lock taken again;
        should another loop have registered it meanwhile (both opened it at once), that id is taken and this one
        unregistered, after the lock."""
        found = self._join(inode, loop, identity, None)
        if found is not None:
            return found
        mine = register()
        try:
            kept = self._join(inode, loop, identity, mine)
        except BaseException:
            _unregister(unregister, mine)
            raise
        assert kept is not None  # given an id, _join keeps it or another
        if kept != mine:
            _unregister(unregister, mine)
        return kept

    def _join(self, inode: int, loop: int, identity: tuple[int, int], mine: int | None) -> int | None:
        """Under the lock: a user more of the inode's slot, its id; where there is none, a slot of id ``mine``
        (None: nothing written, None returned)."""
        table = self._backings
        with self._lock:
            at, free = table.find(inode)
            if at >= 0:
                offset = table.offset(at)
                backing_id, dev, ino = _ID_FILE.unpack_from(self._map, offset + _ID_AT)
                if (dev, ino) != identity:
                    conflict = Conflict(errno.EIO, "another open of it serves other bytes (its source changed): "
                                        "reopen once its other opens are closed")
                    conflict.held_in_memory = dev < 0  # a memfd's identity: (-2 - raw, digest)
                    raise conflict
                at_users = offset + _USERS_AT + 2 * loop
                _USERS.pack_into(self._map, at_users, _USERS.unpack_from(self._map, at_users)[0] + 1)
                return int(backing_id)
            if mine is None:
                return None
            if free is None:
                # (ENFILE, as the mount's own budget of open files answers: EMFILE would tell the reader that its
                # own process is out of descriptors)
                raise TableFull(errno.ENFILE, "too many files open across the mount's loops")
            # The whole slot made first (a value that does not fit raises here, nothing written), then written
            # at once: a freed slot keeps its last entry's users, and a loop killed between two writes must not
            # leave them in a slot of this inode.
            users = [0] * MAX_LOOPS
            users[loop] = 1
            record = _BACKING.pack(inode, mine, *identity, *users)
            offset = table.offset(free)
            self._map[offset:offset + _BACKING.size] = record
            return mine

    def detach(self, inode: int, loop: int, unregister: Callable[[int], None]) -> bool:
        """One user fewer in ``loop``; the last of every loop's unregisters the backing (outside the lock: the
        kernel let go of the inode's backing when its last file closed, before this RELEASE was sent, so another
        loop may register a new one for it at once). Whether no loop uses it now (False: another still serves
        the file, whose pages are not to be dropped under its reader)."""
        table = self._backings
        with self._lock:
            at, _ = table.find(inode)
            if at >= 0:
                offset = table.offset(at)
                at_users = offset + _USERS_AT + 2 * loop
                (users,) = _USERS.unpack_from(self._map, at_users)
                if users:
                    _USERS.pack_into(self._map, at_users, users - 1)
                if self._map[offset + _USERS_AT:offset + _BACKING.size] != _NO_USERS:
                    return False
                backing_id = int(struct.unpack_from("<i", self._map, offset + _ID_AT)[0])
                table.remove(at)
        if at < 0:  # said outside the lock every loop takes: a log write that waits must not stall them all
            log.warning("inode %d: no shared backing to let go (loop %d)", inode, loop)
            return True
        _unregister(unregister, backing_id)
        return True

    def reap(self, loop: int, unregister: Callable[[int], None]) -> int:
        """``loop`` is gone: its users are taken out of every backing, and those no loop uses any more are
        unregistered. Returns how many were."""
        table = self._backings
        closing: list[int] = []

        def drop(at: int) -> bool:
            fields = list(_BACKING.unpack_from(self._map, table.offset(at)))
            if not fields[4 + loop]:
                return False
            fields[4 + loop] = 0
            if any(fields[4:]):
                _BACKING.pack_into(self._map, table.offset(at), *fields)
                return False
            closing.append(fields[1])
            return True

        with self._lock:
            freed = len(table.sweep(drop))
        for backing_id in closing:
            _unregister(unregister, backing_id)
        return freed

    def backings(self) -> int:
        """Inodes with a shared backing now (for ``stats``)."""
        with self._lock:
            return sum(1 for at in range(self._backings.slots) if self._backings.inode_at(at) != _EMPTY)

    # -- directories warmed -------------------------------------------------------------------------------

    def claim_directory(self, inode: int, now: float, within: float, busy_for: float = 0.0) -> bool:
        """Whether this loop is the one to warm directory ``inode``'s inodes now: no loop claimed it in the last
        ``within`` seconds, nor is warming it (``now``: ``time.monotonic()``, the same clock in every loop). The
        claim is recorded as made ``busy_for`` seconds from now, so that it holds while the warm runs (at most
        that long: a loop that died warming lets go then); ``directory_warmed`` says when it ended."""
        offset = self._claim_offset(inode)
        with self._lock:
            held, at = _DIRECTORY_CLAIM.unpack_from(self._map, offset)
            if held == inode and now - at < within:
                return False
            _DIRECTORY_CLAIM.pack_into(self._map, offset, inode, now + busy_for)
            return True

    def directory_warmed(self, inode: int, now: float) -> None:
        """The warm of directory ``inode`` this loop claimed ended ``now`` (or later: one that took long rests for
        a while after, ``lookahead.RESTS``): the others' windows count from it."""
        offset = self._claim_offset(inode)
        with self._lock:
            if _DIRECTORY_CLAIM.unpack_from(self._map, offset)[0] == inode:
                _DIRECTORY_CLAIM.pack_into(self._map, offset, inode, now)

    def _claim_offset(self, inode: int) -> int:
        return self._claims_at + _home(inode, self._claim_slots) * _DIRECTORY_CLAIM.size

    # -- sizes told --------------------------------------------------------------------------------------

    def size(self, inode: int) -> int | None:
        """The size the kernel was last told of ``inode`` where it is not the catalog's, by any loop."""
        if not _HEADER.unpack_from(self._map, 0)[0]:
            return None  # nothing recorded, the common case: no lock taken (every GETATTR asks)
        with self._lock:
            at, _ = self._sizes.find(inode)
            return None if at < 0 else int(_SIZE.unpack_from(self._map, self._sizes.offset(at))[1])

    def tell(self, inode: int, size: int | None) -> list[int]:
        """Record (None: forget) the size the kernel is told of ``inode`` where it is not the catalog's. Returns
        the inodes whose sizes were let go to make room (``_forget_closed_sizes``): the kernel still holds the sizes
        it was told of them, and must drop them (every loop now says the catalog's)."""
        table = self._sizes
        let_go: list[int] = []
        with self._lock:
            at, free = table.find(inode)
            (count,) = _HEADER.unpack_from(self._map, 0)
            if size is None:
                if at >= 0:
                    table.remove(at)
                    _HEADER.pack_into(self._map, 0, count - 1)
            elif at >= 0:
                _SIZE.pack_into(self._map, table.offset(at), inode, size)
            else:
                if count >= table.slots // 2:
                    let_go = self._forget_closed_sizes()
                    count -= len(let_go)
                    at, free = table.find(inode)
                if free is None:
                    raise TableFull(errno.EIO, "too many files served at another size than the catalog's")
                _SIZE.pack_into(self._map, table.offset(free), inode, size)
                _HEADER.pack_into(self._map, 0, count + 1)
        return let_go

    def _forget_closed_sizes(self) -> list[int]:
        """Let go of the sizes of files no loop has open (the lock held); returns their inodes."""
        table = self._sizes
        freed = table.sweep(lambda at: self._backings.find(table.inode_at(at))[0] < 0)
        if freed:
            _HEADER.pack_into(self._map, 0, int(_HEADER.unpack_from(self._map, 0)[0]) - len(freed))
            # (at debug level: under the lock every loop takes, a log write that waits would stall them all)
            log.debug("let go of %d sizes told of files no loop has open", len(freed))
        return freed


class _DeathSafeLock:
    """A lock between processes that the kernel releases when its holder dies (a POSIX record lock on a memfd
    made before the fork): a loop killed inside a section must not leave the others waiting for ever, as a
    semaphore would. Record locks are a process's, not a thread's: a second thread of the holder would pass
    straight in, and its unlock free the first's section for the other processes. So the threads of a process
    (its loop, its read-ahead's ``claim_directory``) take a thread lock first."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("liquidfs-shared-inodes", os.MFD_CLOEXEC)
        os.write(self._fd, b"\0")
        self._threads = threading.Lock()  # made before the fork, free: each process has its own from then on

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1)
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1)
        finally:
            self._threads.release()


def _unregister(unregister: Callable[[int], None], backing_id: int) -> None:
    try:
        unregister(backing_id)
    except OSError as exc:
        log.warning("closing shared backing %d: %s", backing_id, exc)
