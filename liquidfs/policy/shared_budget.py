"""Several jobs on one budget: the held files ranked by how soon a job is expected to read each again.

While several jobs read one mount (``policy.next_epoch.NextEpochCache``), a file just read is wanted again, soon, by
every job that has not read it yet in its current epoch, and by the others only in their next. The policy holds it
where there is room, or in place of the held files wanted latest when it is wanted sooner than they are
(Belady's rule, with each job's progress as the clock). How soon depends only on which jobs had read a file in
which epoch when it was held (``ReadIn``), so the held files are grouped by that and the groups ranked, every
RANK_EVERY reads, not each file at each read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .epochs import Job

#: (job, the file's epoch in that job) for every job reading when a file was held.
ReadIn = tuple[tuple[int, int], ...]
#: Reads between two rankings of the groups (paces and progress move slowly).
RANK_EVERY = 32


def read_in(file: int, jobs: Sequence[Job]) -> ReadIn:
    return tuple((j.id, int(j.epoch_of[file])) for j in jobs)


def wanted_in(key: ReadIn, jobs: Sequence[Job], dataset_files: int) -> float:
    """How soon a file held with ``key`` is expected to be read again by any job: a job that had not read it in
    its current epoch reads it at a uniformly random point of what is left of that epoch (half of it, expected);
    a job that had, half an epoch after its next begins.

    Soon is counted in each job's own reads, not in seconds: by the clock, a slow job's reads are always later
    than a fast one's, and the files held would be the fast jobs' alone (more hits in all, but a slow job below
    the budget's share). And each job's count is weighed by its recent hit ratio against the jobs' mean: a job
    that leads the others through the dataset finds few files the others left for it, so its wants count as
    sooner until it hits as often as they do (each job's share is the goal, not the most hits in all)."""
    epochs = dict(key)
    mean = sum(j.recent_hits for j in jobs) / len(jobs) if jobs else 0.0
    soonest = math.inf
    for job in jobs:
        left, whole = job.reads_left(dataset_files)
        unread = epochs.get(job.id, 0) < job.newest_epoch
        weight = min(4.0, max(0.25, job.recent_hits / mean)) if mean > 0 else 1.0
        soonest = min(soonest, weight * (left / 2 if unread else left + whole / 2))
    return soonest


class WantedSoonest:
    """The held files by ``ReadIn``, each group in the order held, and the groups ranked."""

    def __init__(self, dataset_files: int) -> None:
        self.dataset_files = dataset_files
        self._groups: dict[ReadIn, dict[int, None]] = {}
        self._ranked: list[tuple[float, ReadIn]] = []
        self._rank_at = 0
        self._new_group = False  # a group appeared since the last ranking

    def add(self, file: int, key: ReadIn) -> None:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = {}
            self._new_group = True
        group[file] = None

    def remove(self, file: int, key: ReadIn) -> None:
        group = self._groups.get(key)
        if group is not None:
            group.pop(file, None)
            if not group:
                del self._groups[key]

    def victims(self, key: ReadIn, size: int, room: int, size_of: Callable[[int], int], jobs: Sequence[Job],
                reads: int) -> list[int] | None:
        """The held files to let go, wanted later than a file held with ``key`` (the latest first), for
        ``size`` bytes where ``room`` is free; None where those wanted later do not make enough room. ``reads``:
        the reads of every job so far (the ranking's clock)."""
        mine = wanted_in(key, jobs, self.dataset_files)
        chosen: list[int] = []
        for wanted, other in reversed(self._ranking(jobs, reads)):
            if wanted <= mine or room >= size:
                break
            for file in self._groups.get(other, ()):
                chosen.append(file)
                room += size_of(file)
                if room >= size:
                    break
        return chosen if room >= size else None

    def _ranking(self, jobs: Sequence[Job], reads: int) -> list[tuple[float, ReadIn]]:
        """The groups, soonest wanted first; ranked again every RANK_EVERY reads or when a group has appeared (its
        count alone missed one that appeared as another emptied: its files no victim for up to RANK_EVERY
        reads). A group emptied since is passed over (``victims`` finds no file of it)."""
        if reads >= self._rank_at or self._new_group:
            self._ranked = sorted((wanted_in(key, jobs, self.dataset_files), key) for key in self._groups)
            self._rank_at = reads + RANK_EVERY
            self._new_group = False
        return self._ranked
