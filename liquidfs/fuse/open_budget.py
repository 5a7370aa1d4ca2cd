"""The per-user budget of open files: how many files the mount holds open at once, and each user's share of them.

Each open file may hold a descriptor (its backing, or a large file's source) and some memory: past the budget an
open fails cleanly with ENFILE rather than the daemon running out of either. With --allow-other, users who do not
trust each other share it, and one user opening one file 18,976 times left everyone else (root included) with
ENFILE. So a user other than root and the mount's own holds at most half of what is not kept back: one greedy
user leaves the other half to everyone else, and a node's one loader (the usual user) still has most of the
budget. The last eighth is kept back for root and the mount's user, who may use all of it: they own the mount,
and what they run on it must open files whatever the others hold.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

from pyfuse3 import FUSEError

log = logging.getLogger(__name__)

#: Open files at once when the mount does not say (``daemon.build.descriptor_budget`` sizes it from RLIMIT_NOFILE).
MAX_OPEN_FILES = 16384


class OpenBudget:
    """Slots of the open-file budget, taken by opens in flight and open files: per uid, in all, and whose each
    open file's slot is. ``first_error(key)``: whether a refusal of that kind is the first (logged once)."""

    def __init__(self, max_files: int = MAX_OPEN_FILES, *, owner: int | None = None,
                 first_error: Callable[[tuple[object, ...]], bool] = lambda key: True) -> None:
        #: Open files at once: past it an open fails with ENFILE, and so does one past its user's share of it.
        self.max_files = max_files
        self.owner = os.getuid() if owner is None else owner
        self.first_error = first_error
        self.taken = 0
        self._by_uid: dict[int, int] = {}
        self._of_fh: dict[int, int] = {}

    def take(self, uid: int) -> None:
        """Count an open by ``uid`` against the budget, or refuse it with ENFILE. Taken before the open's first
        await and given back if it fails: opens in flight count, so many at once cannot all pass a check of the
        files open so far."""
        budget = self.max_files
        kept_back = budget // 8
        privileged = uid in (0, self.owner)
        room = budget if privileged else budget - kept_back
        share = budget if privileged else max(1, (budget - kept_back) // 2)
        mine = self._by_uid.get(uid, 0)
        if self.taken >= room:
            if self.first_error(("open files",)):
                log.warning("%d files open: further opens fail with ENFILE until some are closed (the last %d "
                            "for root and the mount's user)", self.taken, kept_back)
            raise FUSEError(errno.ENFILE)
        if mine >= share:
            if self.first_error(("open files of", uid)):
                log.warning("uid %d holds %d open files, its share of the %d of the mount: its further opens "
                            "fail with ENFILE until it closes some", uid, mine, budget)
            raise FUSEError(errno.ENFILE)
        self._by_uid[uid] = mine + 1
        self.taken += 1

    def give_back(self, uid: int) -> None:
        """An open by ``uid`` that failed, or whose file was released: its slot is free again."""
        left = self._by_uid[uid] - 1
        if left:
            self._by_uid[uid] = left
        else:
            del self._by_uid[uid]  # the uids holding files now, not every uid ever seen
        self.taken -= 1

    def opened(self, fh: int, uid: int) -> None:
        """The open that took ``uid``'s slot is file handle ``fh`` now."""
        self._of_fh[fh] = uid

    def released(self, fh: int) -> None:
        """``fh`` was released: its slot, if it took one (the control file takes none), is given back."""
        uid = self._of_fh.pop(fh, None)
        if uid is not None:
            self.give_back(uid)

    def held_by(self, uid: int) -> int:
        """The slots ``uid`` holds now."""
        return self._by_uid.get(uid, 0)
