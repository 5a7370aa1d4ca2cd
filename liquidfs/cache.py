"""The next-epoch working-set policy: which files to hold in memory so every stretch of an epoch hits C/D.

Each file is read once per epoch in an order the filesystem does not know. While epoch *e* is read, a share
``p = C/D`` of it (by bytes) is kept for epoch *e+1*; everything else is dropped once served. Because the next
epoch's order is an independent random permutation, any kept set of that size is hit at a steady rate: per window
of reads the hit count follows sampling noise around ``p`` instead of the drift and swings of an LRU page cache.

Which files are kept is decided by a running quota, not a coin: a file is kept when the bytes kept so far for the
next epoch lag ``p`` times the bytes read so far in this epoch. The loader's random order makes the kept set a
random sample, the quota makes its size exact (no binomial spread in the budget) and fills it evenly over the
epoch, so memory never runs over while the last epoch's set drains.

Epochs are inferred per file: the first read of a file is its epoch 1; a later read is its next epoch if that
epoch is already open (another file started it, so the next epoch may begin before the previous one drains), or
if at least ``gap`` x (reads of its epoch so far) other reads happened since its last read, which opens the next
epoch. Any other repeated read (a header probe, a retry, a second open by another worker, all close to the first)
is a re-read that changes nothing. The number of files is never assumed: loaders often read only the images.

This module is pure bookkeeping: it never touches bytes. Where the held bytes live is the caller's business (the
mount keeps them as kernel page-cache pages of the FUSE inodes, see ``fs``).
"""

from __future__ import annotations

import logging
import math
import re
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

WINDOW = 64


@dataclass(frozen=True, slots=True)
class Decision:
    hit: bool            # the file's bytes are held: serve them from memory
    hold: bool           # hold the file after this read (for the next epoch)
    epoch: int           # the epoch this read belongs to (0 for a re-read)
    same_epoch: bool = False  # a second read of the file in the epoch it was already read in (a retry)
    evicted: tuple[int, ...] = ()  # files that stopped being held: their pages must be dropped


#: What an open decides where no next-epoch cache is configured: not held, not to hold.
NO_CACHE = Decision(hit=False, hold=False, epoch=0)


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


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, dataset_bytes: int) -> int:
    """'30%' of the dataset as served, or bytes with an optional K/M/G/T suffix (powers of 1024)."""
    text = text.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1
        if share < 0:
            raise ValueError(f"cache size {text!r}: use a percentage (30%) or bytes (512M, 24G)")
        return int(share * dataset_bytes)
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cache size {text!r}: use a percentage (30%) or bytes (512M, 24G)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class NextEpochCache:
    """Decides, per read of a file, whether it is a hit and whether to hold it for the next epoch."""

    def __init__(self, budget: int, dataset_bytes: int, dataset_files: int, *, max_id: int | None = None,
                 gap: float = 0.5, seed: int = 0) -> None:
        self.budget = max(0, budget)
        self.dataset_bytes = max(1, dataset_bytes)
        self.dataset_files = max(1, dataset_files)
        self.share = min(1.0, self.budget / self.dataset_bytes)
        self.gap = gap
        self.seed = seed
        # Per-file state in arrays indexed by id (ids are dense): 12 bytes a file, not ~200 in dicts.
        size = (max_id if max_id is not None else dataset_files) + 1
        self.epoch_of = np.zeros(size, np.int32)
        self.read_at = np.zeros(size, np.int64)  # file -> value of ``reads`` at its last epoch read
        self.reads = 0
        self.held: dict[int, tuple[int, int]] = {}  # file -> (size, epoch it is held for)
        self.held_bytes = 0
        self.kept_for: dict[int, int] = {}  # epoch -> bytes held for it
        self.newest_epoch = 1
        self.stats = CacheStats()
        self._window: list[tuple[bool, int]] = []
        self._window_epoch = 1

    # -- the policy ----------------------------------------------------------------------------------

    def read(self, file: int, size: int) -> Decision:
        """A reader opened ``file`` (``size`` bytes as served) to read it."""
        current = int(self.epoch_of[file])
        if current + 1 <= self.newest_epoch:
            epoch = current + 1
        elif self.reads - int(self.read_at[file]) >= self._gap_needed(current):
            epoch = current + 1
        else:
            self.stats.same_epoch_reads += 1
            held = file in self.held
            return Decision(hit=held, hold=held, epoch=0, same_epoch=True)
        evicted: tuple[int, ...] = ()
        if epoch > self.newest_epoch:
            self.newest_epoch = epoch
            evicted = self._evict_missed(epoch)
        self.epoch_of[file] = epoch
        self.reads += 1
        self.read_at[file] = self.reads
        ep = self.stats.epochs.setdefault(epoch, EpochStats())
        ep.reads += 1
        ep.bytes += size
        hit = file in self.held
        if hit:
            self._release(file)
        keep = self._quota_allows(epoch, size)
        if keep:
            self.held[file] = (size, epoch + 1)
            self.held_bytes += size
            self.kept_for[epoch + 1] = self.kept_for.get(epoch + 1, 0) + size
        self._count(epoch, hit, size)
        return Decision(hit=hit, hold=keep, epoch=epoch, evicted=evicted)

    def _gap_needed(self, epoch: int) -> int:
        # A retry or header probe comes within a few reads of the first (other workers' reads in between);
        # the first read of a new epoch comes a uniformly random share of an epoch later. A small threshold
        # misreads that first read as a retry with probability ~2 %, after which the epoch is open anyway.
        reads = self._reads(epoch)
        return max(1, int(min(self.gap * reads, 32 + 0.02 * reads)))

    def _reads(self, epoch: int) -> int:
        ep = self.stats.epochs.get(epoch)
        return ep.reads if ep else 0

    def _quota_allows(self, epoch: int, size: int) -> bool:
        if self.share <= 0 or self.held_bytes + size > self.budget:
            return False
        ep = self.stats.epochs[epoch]
        # The decision must not depend on this file's own size, or the kept set would favour large (or small)
        # files and the share of hits counted per file would drift from the byte share: the quota grows by the
        # mean size of the files read before it, and a file is kept when that quota covers half a mean file.
        before = ep.bytes - size
        mean = before / (ep.reads - 1) if ep.reads > 1 else size
        return self.kept_for.get(epoch + 1, 0) + mean / 2 <= self.share * (before + mean)

    def _release(self, file: int) -> None:
        size, for_epoch = self.held.pop(file)
        self.held_bytes -= size
        self.kept_for[for_epoch] = self.kept_for.get(for_epoch, 0) - size

    def _evict_missed(self, new_epoch: int) -> tuple[int, ...]:
        """Files held for an epoch that has passed without reading them (a partial epoch) free their room."""
        stale = [f for f, (_, for_epoch) in self.held.items() if for_epoch < new_epoch - 1]
        for f in stale:
            self._release(f)
        if stale:
            log.info("epoch %d began: %d held files were never read in their epoch; dropped", new_epoch,
                     len(stale))
        return tuple(stale)

    # -- warm-up ---------------------------------------------------------------------------------------

    def warmup_choice(self, files: list[tuple[int, int]]) -> list[int]:
        """A random set of (file, size) filling the budget by ``share`` of the bytes, held for epoch 1."""
        rng = random.Random(self.seed)
        order = files[:]
        rng.shuffle(order)
        chosen = []
        total = 0
        for file, size in order:
            if total + size > self.budget or total + size / 2 > self.share * self.dataset_bytes:
                continue
            chosen.append(file)
            total += size
        return chosen

    def hold(self, file: int, size: int) -> bool:
        """Hold ``file`` for the epoch its next read belongs to (warm-up); False when over budget."""
        if file in self.held or self.held_bytes + size > self.budget:
            return False
        for_epoch = int(self.epoch_of[file]) + 1
        self.held[file] = (size, for_epoch)
        self.held_bytes += size
        self.kept_for[for_epoch] = self.kept_for.get(for_epoch, 0) + size
        return True

    def drop(self, file: int) -> None:
        """The held bytes were lost (the kernel reclaimed them, or the file changed)."""
        if file in self.held:
            self._release(file)

    # -- statistics ------------------------------------------------------------------------------------

    def _count(self, epoch: int, hit: bool, size: int) -> None:
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
        if epoch != self._window_epoch:
            self._window = []
            self._window_epoch = epoch
        self._window.append((hit, size))
        if len(self._window) == WINDOW:
            st.window_ratios.append(sum(h for h, _ in self._window) / WINDOW)
            window_bytes = sum(s for _, s in self._window)  # 0 for a window of empty files
            st.window_byte_ratios.append(sum(s for h, s in self._window if h) / window_bytes if window_bytes
                                         else st.window_ratios[-1])
            st.window_epochs.append(epoch)
            self._window = []

    def correct_miss(self, epoch: int, size: int) -> None:
        """A predicted hit had to be read from storage after all (its pages were reclaimed by the kernel)."""
        st = self.stats
        st.hits -= 1
        st.hit_bytes -= size
        st.misses += 1
        st.miss_bytes += size
        st.lost_hits += 1
        st.lost_hit_bytes += size
        ep = st.epochs.get(epoch)
        if ep is not None:
            ep.hits -= 1
            ep.hit_bytes -= size

    def summary(self) -> dict[str, object]:
        st = self.stats
        windows = [r for r, e in zip(st.window_ratios, st.window_epochs) if e >= 2]
        epochs = {
            str(e): {"reads": v.reads, "bytes": v.bytes, "hits": v.hits,
                     "byte_hit_ratio": round(v.hit_bytes / v.bytes, 4) if v.bytes else 0.0}
            for e, v in sorted(st.epochs.items())
        }
        current = self.newest_epoch
        return {
            "cache_budget": self.budget,
            "cache_share": round(self.share, 4),
            "cache_held_bytes": self.held_bytes,
            "cache_held_files": len(self.held),
            "cache_hits": st.hits,
            "cache_misses": st.misses,
            "cache_same_epoch_reads": st.same_epoch_reads,
            "cache_hit_bytes": st.hit_bytes,
            "cache_miss_bytes": st.miss_bytes,
            # The same as the policy predicted them at each read, and the lost hits apart: these only grow (the
            # counters /metrics exports; hits and misses above are net of the lost hits, and a lost hit lowers hits).
            "cache_hits_predicted": st.hits + st.lost_hits,
            "cache_misses_predicted": st.misses - st.lost_hits,
            "cache_hit_bytes_predicted": st.hit_bytes + st.lost_hit_bytes,
            "cache_miss_bytes_predicted": st.miss_bytes - st.lost_hit_bytes,
            "cache_lost_hits": st.lost_hits,
            "cache_lost_hit_bytes": st.lost_hit_bytes,
            "epoch": current,
            "epoch_progress": round(self._reads(current) / self.dataset_files, 4),
            "epochs": epochs,
            "window_size": WINDOW,
            "window_hit_ratios": [round(r, 4) for r in list(st.window_ratios)[-256:]],
            "window_byte_hit_ratios": [round(r, 4) for r in list(st.window_byte_ratios)[-256:]],
            "window_hit_ratio_mean": round(statistics.fmean(windows), 4) if windows else None,
            "window_hit_ratio_sd": round(statistics.pstdev(windows), 4) if len(windows) > 1 else None,
            "window_sd_bound": round(1.25 * math.sqrt(self.share * (1 - self.share) / WINDOW), 4),
        }
