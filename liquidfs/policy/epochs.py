"""What the next-epoch policy knows of each job's reads: each file's epoch in that job, its pace, its counters.

A job is the set of openers that read the dataset together (the ranks of one training, their loader workers),
told apart by the mount (``jobs.JobOf``); every read of the mount comes from one. Each job's epochs are inferred
from its own reads (``policy.next_epoch.NextEpochCache.read``), so jobs at other paces and in other orders never blur
each other's. This module holds the record and its counters; the policy decides.
"""

from __future__ import annotations

import mmap
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

#: Reads per window: the stretch over which a hit ratio is measured.
WINDOW = 64
#: Reads a job's pace is measured over.
PACE_READS = 64
#: Reads a job's recent hit ratio is taken over (a moving average): see ``policy.shared_budget.wanted_in``.
FAIR_READS = 256
#: A job's latest epochs that ``liquidfs stats`` shows.
JOB_EPOCHS_SHOWN = 8
#: A job's latest epochs whose counters are kept (the policy asks of the newest three; the rest are for stats):
#: a reader that makes an epoch every few reads (two files opened in turn) must not grow them without end.
EPOCHS_KEPT = 16


@dataclass
class EpochStats:
    reads: int = 0
    bytes: int = 0
    hits: int = 0
    hit_bytes: int = 0


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    same_epoch_reads: int = 0  # reads taken for a retry within an epoch (Decision.same_epoch)
    hit_bytes: int = 0
    miss_bytes: int = 0
    #: Predicted hits whose bytes were gone (``correct_miss``): counted in hits/misses as the misses they were.
    lost_hits: int = 0
    lost_hit_bytes: int = 0
    epochs: dict[int, EpochStats] = field(default_factory=dict)
    window_ratios: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # hits per file
    window_byte_ratios: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # hit bytes per byte
    window_epochs: deque[int] = field(default_factory=lambda: deque(maxlen=4096))


def add_stats(into: CacheStats, other: CacheStats) -> None:
    """Add ``other``'s counters to ``into``'s (epochs and windows are each job's own: not added)."""
    for name in ("hits", "misses", "same_epoch_reads", "hit_bytes", "miss_bytes", "lost_hits", "lost_hit_bytes"):
        setattr(into, name, getattr(into, name) + getattr(other, name))


def zeros(code: Literal["i", "q"], count: int) -> memoryview:
    """``count`` zeros of the C type ``code`` ("i": int32, "q": int64) in anonymous memory, read and set one element
    at a time as Python ints. The kernel gives its pages zeroed where first touched: a new job's arrays (made on an
    open's path, for ten million files 120 MB) cost nothing until its reads reach them, and a job that reads a shard
    holds only its pages, as NumPy's calloc'd zeros did; an ``array`` would write every byte at once. Not NumPy's:
    a daemon then starts without importing it (0.1-0.2 s and 15 MB of every mount)."""
    size = {"i": 4, "q": 8}[code]
    # private: a process forked later gets a copy of its own, not the same pages (mmap's default is shared)
    memory = mmap.mmap(-1, max(count, 1) * size, flags=mmap.MAP_PRIVATE)
    return memoryview(memory).cast(code)[:count]


@dataclass(eq=False)
class Job:
    """One job's reads: its epochs per file, pace and counters."""

    id: int
    size: int  # files' ids are below this
    owner: int = 0  # the uid whose job it is (``jobs.JobOf.owner``)
    #: This record's own number: a job id read again after its job retired is a new record, and the files held
    #: for the one before (handed over a slice per read, ``NextEpochCache._reown_some``) are told from its own.
    serial: int = 0
    epoch_of: memoryview = field(init=False)  # int32s
    read_at: memoryview = field(init=False)   # int64s: file -> value of ``reads`` at its last epoch read
    reads: int = 0
    newest_epoch: int = 1
    kept_for: dict[int, int] = field(default_factory=dict)  # epoch -> bytes held for it (the quota's count)
    stats: CacheStats = field(default_factory=CacheStats)
    window: list[tuple[bool, int]] = field(default_factory=list)
    window_epoch: int = 1
    last_read: float = 0.0     # monotonic seconds
    pace: float = 0.0          # reads per second, over the last PACE_READS
    pace_since: tuple[float, int] = (0.0, 0)  # (time, reads) where the current pace sample began
    files_per_epoch: int = 0   # reads of its last complete epoch (0: none complete yet)
    recent_hits: float = 0.0   # hits per read, over about the last FAIR_READS reads
    window_bytes: int = 0      # the bytes of its last window closed (``uncount_hit``)

    def __post_init__(self) -> None:
        # Per-file state in arrays indexed by id (ids are dense): 12 bytes a file and job, not ~200 in dicts.
        self.epoch_of = zeros("i", self.size)
        self.read_at = zeros("q", self.size)

    def has_passed(self, epoch: int) -> bool:
        """Whether no read of ``epoch`` is to come: two epochs have begun since, or one has and ``epoch``'s
        reads reached an epoch's (its seam drained: the last rank's last files, a loader's read-ahead)."""
        if epoch <= self.newest_epoch - 2:
            return True
        return epoch == self.newest_epoch - 1 and 0 < self.files_per_epoch <= self.reads_of(epoch)

    def reads_of(self, epoch: int) -> int:
        ep = self.stats.epochs.get(epoch)
        return ep.reads if ep else 0

    def reads_left(self, dataset_files: int) -> tuple[int, int]:
        """(reads until this job's current epoch ends, reads an epoch takes)."""
        per_epoch = self.files_per_epoch or dataset_files
        return max(0, per_epoch - self.reads_of(self.newest_epoch)), per_epoch

    def begin_epoch(self, epoch: int) -> None:
        """``epoch`` (a newer one) has begun. The one before may still drain (other ranks, read-ahead); the one
        before that is complete: its reads size the job's epochs from now."""
        complete = self.stats.epochs.get(epoch - 2) if epoch > 2 else None
        self.files_per_epoch = complete.reads if complete is not None else 0
        self.newest_epoch = epoch
        for old in [e for e in self.kept_for if e < epoch - 1]:  # the quota's counts of epochs read already
            del self.kept_for[old]
        for old in [e for e in self.stats.epochs if e <= epoch - EPOCHS_KEPT]:
            del self.stats.epochs[old]

    def clock_pace(self, now: float) -> None:
        """A read at ``now`` (monotonic seconds): the pace is measured again every PACE_READS reads."""
        since, at = self.pace_since
        if self.reads - at >= PACE_READS:
            if now > since:
                self.pace = (self.reads - at) / (now - since)
            self.pace_since = (now, self.reads)

    def count(self, epoch: int, hit: bool, size: int) -> None:
        """One read of ``epoch`` counted: a hit or a miss, in its epoch and its window."""
        st = self.stats
        ep = st.epochs[epoch]
        if hit:
            st.hits += 1
            st.hit_bytes += size
            ep.hits += 1
            ep.hit_bytes += size
        else:
            st.misses += 1
            st.miss_bytes += size
        self.recent_hits += (hit - self.recent_hits) / FAIR_READS
        if epoch != self.window_epoch:
            self.window = []
            self.window_epoch = epoch
        self.window.append((hit, size))
        if len(self.window) == WINDOW:
            st.window_ratios.append(sum(h for h, _ in self.window) / WINDOW)
            window_bytes = self.window_bytes = sum(s for _, s in self.window)  # 0 for a window of empty files
            st.window_byte_ratios.append(sum(s for h, s in self.window if h) / window_bytes if window_bytes
                                         else st.window_ratios[-1])
            st.window_epochs.append(epoch)
            self.window = []

    def uncount_hit(self, epoch: int, size: int) -> None:
        """A read of ``epoch`` that ``count`` counted as a hit was a miss (``NextEpochCache.correct_miss``: its
        pages were reclaimed): its window and the share of recent reads that hit say so too. The read is the
        newest of its size in the window, else in the window just closed (a correction follows its read within
        a few reads)."""
        self.recent_hits = max(0.0, self.recent_hits - 1 / FAIR_READS)
        if epoch == self.window_epoch:
            for i in range(len(self.window) - 1, -1, -1):
                if self.window[i] == (True, size):
                    self.window[i] = (False, size)
                    return
        st = self.stats
        if st.window_epochs and st.window_epochs[-1] == epoch and st.window_ratios[-1] > 0:
            st.window_ratios[-1] = max(0.0, st.window_ratios[-1] - 1 / WINDOW)
            st.window_byte_ratios[-1] = (max(0.0, st.window_byte_ratios[-1] - size / self.window_bytes)
                                         if self.window_bytes else st.window_ratios[-1])

    def summary(self) -> dict[str, object]:
        """Its epochs, its hits, and the bytes its misses read from the level below (storage; the disk or
        cluster level where the mount has one): ``liquidfs stats``' line of the job."""
        st = self.stats
        windows = [r for r, e in zip(st.window_ratios, st.window_epochs) if e >= 2]
        reads = st.hits + st.misses
        return {
            "epoch": self.newest_epoch,
            "reads": reads,
            "hit_ratio": round(st.hits / reads, 4) if reads else None,
            "hit_bytes": st.hit_bytes,
            "storage_bytes": st.miss_bytes,
            "epochs": {str(e): {"reads": v.reads, "byte_hit_ratio": round(v.hit_bytes / v.bytes, 4) if v.bytes
                                else 0.0} for e, v in sorted(st.epochs.items())[-JOB_EPOCHS_SHOWN:]},
            "window_hit_ratio_mean": round(statistics.fmean(windows), 4) if windows else None,
            "window_hit_ratio_low": round(min(windows), 4) if windows else None,
            "windows": len(windows),
            "reads_per_second": round(self.pace, 1),
        }
