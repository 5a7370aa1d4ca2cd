"""The next-epoch cache of the passthrough data path: ``cache.NextEpochCache`` decides, memfds hold the bytes.

A held file is a sealed memfd (shmem, counted in the budget by its size); a hit is an open whose backing is a
duplicate of that memfd, so the kernel serves the hit from memory without a byte crossing the daemon. Files
are kept when their last open is released, copied kernel-side from the backing that just served them (its
pages are still warm from the reader's reads), or, when that backing is itself a checked memfd, by keeping it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .cache import Decision, NextEpochCache

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HeldFile:
    fd: int      # a sealed memfd, owned by the tier
    size: int
    raw: bool


@dataclass(frozen=True, slots=True)
class MemoryTierStatistics:
    memfd_files: int
    memfd_bytes: int
    kept: int        # files copied into memfds after being served
    keep_failed: int  # files the policy chose whose bytes could not be kept (released unread, copy failed)


class MemoryTier:
    """Which files are held for the next epoch (the policy) and the memfds that hold them."""

    def __init__(self, policy: NextEpochCache) -> None:
        self.policy = policy
        self._held: dict[int, HeldFile] = {}
        self._bytes = 0
        self._kept = 0
        self._keep_failed = 0

    @property
    def budget(self) -> int:
        return self.policy.budget

    def decide(self, file: int, size: int) -> Decision:
        """An open of ``file`` that the policy counts as a read; files it stops holding are let go at once."""
        decision = self.policy.read(file, size)
        for gone in decision.evicted:
            self._forget(gone)
        return decision

    def held(self, file: int) -> HeldFile | None:
        return self._held.get(file)

    def keep(self, file: int, fd: int, size: int, raw: bool) -> None:
        """Hold ``fd`` (a sealed memfd, now the tier's) for ``file``, as the policy decided at its open."""
        self._forget(file)
        self._held[file] = HeldFile(fd, size, raw)
        self._bytes += size
        self._kept += 1

    def could_not_keep(self, file: int) -> None:
        """The policy counted ``file`` as held, but its bytes were not kept: give its room back."""
        self._keep_failed += 1
        self.drop(file)

    def release(self, file: int) -> None:
        """The policy stopped holding ``file`` (a hit not kept again): close the tier's memfd."""
        self._forget(file)

    def drop(self, file: int) -> None:
        """The held bytes are stale (the source changed) or were never kept."""
        self._forget(file)
        self.policy.drop(file)

    def hold_now(self, file: int, fd: int, size: int, raw: bool) -> bool:
        """Warm-up: hold ``fd`` for ``file``'s next read if the budget allows (else the caller keeps ``fd``)."""
        if not self.policy.hold(file, size):
            return False
        self.keep(file, fd, size, raw)
        return True

    def _forget(self, file: int) -> None:
        found = self._held.pop(file, None)
        if found is not None:
            self._bytes -= found.size
            os.close(found.fd)

    def statistics(self) -> MemoryTierStatistics:
        return MemoryTierStatistics(memfd_files=len(self._held), memfd_bytes=self._bytes, kept=self._kept,
                                    keep_failed=self._keep_failed)

    def close(self) -> None:
        for file in list(self._held):
            self._forget(file)
