"""Levels of held bytes: where the files the next-epoch policy (``policy.next_epoch.NextEpochCache``) keeps for
later opens live, behind one interface.

A level pairs the policy, which decides what to hold, with the place the bytes are: the daemon's own memory
(``MemoryLevel``, the daemon data path), sealed memfds the kernel reads itself (``MemfdLevel``, the passthrough
path), files on a local disk (``held.disk.DiskLevel``, a second level behind either). The data paths ask a level
the same few things whichever it is (``HeldLevel``): count an open as a read (``decide``), what it holds of a
file (``held_raw``), forget a file whose bytes went stale (``drop``), a hit whose bytes were lost
(``lost_hit``), and its counters (``statistics``). Each is a class of ``Level``, which answers those once.

The cluster level (``held.cluster.ClusterLevel``) is not one of them, and does not pretend to be: it holds no
file by the policy's choice but a fixed share of the raw objects, the same on every node (a hash of each one's
checksum), in memcacheds it does not own; nothing decides, drops or loses a hit there. It shares with the disk
level only its place, a reader in front of the store's (``stores.reader.InFront``), and the word "level" for
where bytes are served from (``stores.reader.Content.level``).
"""

from __future__ import annotations

import logging
import os
import resource
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..catalog.nodes import Node
from ..metrics.stats import MountStats, Statistics
from ..policy.next_epoch import Decision, NextEpochCache

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The share of the daemon's descriptor budget (``daemon.build.descriptor_budget``) that held memfds may take; open
#: files keep the rest (``fuse.open_budget.OpenBudget``). A held file is worth less than an open one: past the
#: cap a file is read from storage at its next epoch, while an open past the budget fails. A quarter of the
#: 1,048,000 descriptors a root daemon gets holds 262,000 files, more than most budgets fit; of 20,000 (a lower
#: hard limit), 5,000.
HELD_DESCRIPTOR_SHARE = 0.25
#: What a memfd costs beyond its pages: the kernel's inode, dentry and file (~0.8 KB of slab) and the policy's
#: and the level's records of it (~0.3 KB of Python objects), rounded up.
MEMFD_OVERHEAD = 1280
PAGE = resource.getpagesize()


def held_descriptors(descriptors: int) -> int:
    """The memfds a level may hold, of ``descriptors`` the mount may use for files."""
    return max(1, int(descriptors * HELD_DESCRIPTOR_SHARE))


class HeldLevel(Protocol):
    """What a data path asks of a level of held bytes."""

    policy: NextEpochCache

    def decide(self, file: int, size: int, job: int = 0) -> Decision:
        """An open of ``file`` by ``job`` that the policy counts as a read; files it stops holding are let go at
        once."""
        ...

    def held_raw(self, node: Node) -> bool | None:
        """Whether ``node`` is held raw (True), as its original (False), or not at all (None)."""
        ...

    def drop(self, file: int) -> None:
        """The held bytes of ``file`` are stale or not wanted: forget them and their place in the policy."""
        ...

    def lost_hit(self, decision: Decision, size: int) -> None:
        """The policy counted an open as a hit, but the bytes were gone: it was a miss."""
        ...

    def statistics(self) -> Statistics: ...


@dataclass(frozen=True, slots=True)
class PolicyStatistics(Statistics):
    """A memory level's counters: its policy's (``NextEpochCache.summary``, whose keys and shape are the
    policy's own)."""

    summary: dict[str, object]

    def values(self) -> dict[str, object]:
        return dict(self.summary)


class Level(Generic[T]):
    """What every level shares: held values by file, the policy beside them, and what an open, a drop and a lost
    hit do to both. A level read from worker threads sets ``_lock``; one used on the trio loop alone needs none."""

    #: Held around every change of the policy and of ``_held`` (none: the level lives on the loop alone).
    _lock: AbstractContextManager[object] = nullcontext()

    def __init__(self, policy: NextEpochCache) -> None:
        self.policy = policy
        self._held: dict[int, T] = {}

    @property
    def budget(self) -> int:
        return self.policy.budget

    def decide(self, file: int, size: int, job: int = 0) -> Decision:
        # The evicted files let go in the hold that evicted them: after it, one another open re-admitted in
        # between would lose its new copy while the policy holds it.
        with self._lock:
            decision = self.policy.read(file, size, job)
            for gone in decision.evicted:
                self._forget_held(gone)
        return decision

    def get(self, file: int) -> T | None:
        with self._lock:
            return self._held.get(file)

    def holds(self, file: int) -> bool:
        return file in self._held

    def held_items(self) -> dict[int, T]:
        """What the level holds now, by file (a copy: for statistics and tests)."""
        with self._lock:
            return dict(self._held)

    def drop(self, file: int) -> None:
        with self._lock:  # one hold: a re-admission in between would leave a value the policy does not hold
            self._forget_held(file)
            self.policy.drop(file)

    def lost_hit(self, decision: Decision, size: int) -> None:
        """The policy counted this open as a hit, but the bytes were gone (a copy that failed, bytes dropped
        after a fallback, a file changed on disk): it was a miss, and the window's ratio must say so."""
        with self._lock:
            self._count_lost()
            if decision.epoch:
                self.policy.correct_miss(decision.epoch, size, decision.job)

    def _count_lost(self) -> None:
        """One more hit whose bytes were gone, in the counter of this level (under ``_lock``)."""
        raise NotImplementedError

    def _put(self, file: int, value: T) -> None:
        with self._lock:
            self._forget_held(file)
            self._held[file] = value

    def _forget(self, file: int) -> T | None:
        """Let go of what is held of ``file`` (and return it)."""
        with self._lock:
            return self._forget_held(file)

    def _forget_held(self, file: int) -> T | None:
        """``_forget`` with ``_lock`` held."""
        found = self._held.pop(file, None)
        if found is not None:
            self._let_go(file, found)
        return found

    def _let_go(self, file: int, value: T) -> None:
        """What else goes with a held value that is let go (a descriptor closed, a file removed), under ``_lock``."""


class InMemory(Level[T]):
    """A level in the daemon's own memory (its memory or its memfds): its lost hits are the mount's
    ``reclaimed``, and its statistics the policy's own."""

    def __init__(self, policy: NextEpochCache, stats: MountStats) -> None:
        super().__init__(policy)
        self.stats = stats

    def _count_lost(self) -> None:
        self.stats.reclaimed += 1

    def statistics(self) -> Statistics:
        return PolicyStatistics(self.policy.summary())


class MemoryLevel(InMemory[memoryview]):
    """The daemon data path's held files: their bytes in this process, safe from page-cache reclaim."""

    def __init__(self, policy: NextEpochCache, stats: MountStats) -> None:
        super().__init__(policy, stats)
        #: The held files whose bytes are their raw objects (the rest: their originals). Recorded at the hold:
        #: told from the size, an original padded to its raw object's size was taken for it.
        self._raw: set[int] = set()

    def held_raw(self, node: Node) -> bool | None:
        return None if node.id not in self._held else node.id in self._raw

    def hold(self, file: int, data: memoryview, raw: bool) -> None:
        self._put(file, data)
        if raw:
            self._raw.add(file)

    def _let_go(self, file: int, value: memoryview) -> None:
        self._raw.discard(file)


@dataclass(frozen=True, slots=True)
class HeldFile:
    fd: int      # a sealed memfd, owned by the level
    size: int
    raw: bool
    digest: int | None = None  # its bytes' ``backing.content_digest``, where the mount's loops share backings


@dataclass(frozen=True, slots=True)
class MemfdStatistics(Statistics):
    policy: PolicyStatistics
    memfd_files: int
    memfd_bytes: int
    memfd_max_files: int  # memfds it may hold (its share of the daemon's descriptors; 0: no cap)
    kept: int        # files copied into memfds after being served
    keep_failed: int  # files the policy chose whose bytes could not be kept (released unread, copy failed)

    def values(self) -> dict[str, object]:
        own = {name: value for name, value in Statistics.values(self).items() if name != "policy"}
        return {**self.policy.values(), **own}


class MemfdLevel(InMemory[HeldFile]):
    """The passthrough path's held files: sealed memfds (shmem, counted in the budget by their pages, and at most
    ``max_files`` of them: each is a descriptor of the daemon's).

    A hit is an open whose backing is a duplicate of that memfd, so the kernel serves the hit from memory without
    a byte crossing the daemon. Files are kept when their last open is released, copied kernel-side from the
    backing that just served them (its pages are still warm from the reader's reads), or, when that backing is
    itself a checked memfd, by keeping it.
    """

    def __init__(self, policy: NextEpochCache, stats: MountStats, max_files: int | None = None) -> None:
        super().__init__(policy, stats)
        #: Memfds held at most: the policy charges each file at least its share of the budget (``charge_files``),
        #: so it never chooses more; a copy kept for an open that waited for it is the only way past, and is not.
        self.max_files = max_files
        # shmem gives whole pages: 24,000 files of 512 B took 94 MB where 12 MB were counted
        policy.charge_files(page=PAGE, overhead=MEMFD_OVERHEAD, max_files=max_files)
        self._bytes = 0
        self._kept = 0
        self._keep_failed = 0

    def held_raw(self, node: Node) -> bool | None:
        found = self._held.get(node.id)
        return None if found is None else found.raw

    def keep(self, file: int, fd: int, size: int, raw: bool, digest: int | None = None) -> None:
        """Hold ``fd`` (a sealed memfd, now the level's) for ``file``, as the policy decided at its open."""
        if self.max_files is not None and len(self._held) >= self.max_files and file not in self._held:
            os.close(fd)
            self.could_not_keep(file)
            return
        self._put(file, HeldFile(fd, size, raw, digest))
        self._bytes += size
        self._kept += 1

    def could_not_keep(self, file: int) -> None:
        """The policy counted ``file`` as held, but its bytes were not kept: give its room back."""
        self._keep_failed += 1
        self.drop(file)

    def release(self, file: int) -> None:
        """After a hit of ``file``: where the policy no longer holds it (not held again at this hit, or let go
        since), close the level's memfd; the opens that took their own descriptor of it keep it alive."""
        if file not in self.policy.held:
            self._forget(file)

    def hold_now(self, file: int, fd: int, size: int, raw: bool, digest: int | None = None) -> bool:
        """Warm-up: hold ``fd`` for ``file``'s next read if the budget allows (else the caller keeps ``fd``)."""
        if not self.policy.hold(file, size):
            return False
        self.keep(file, fd, size, raw, digest)
        return True

    def _let_go(self, file: int, value: HeldFile) -> None:
        self._bytes -= value.size
        os.close(value.fd)

    def statistics(self) -> MemfdStatistics:
        return MemfdStatistics(
            policy=PolicyStatistics(self.policy.summary()), memfd_files=len(self._held), memfd_bytes=self._bytes,
            memfd_max_files=self.max_files or 0, kept=self._kept, keep_failed=self._keep_failed)

    def close(self) -> None:
        for file in list(self._held):
            self._forget(file)
