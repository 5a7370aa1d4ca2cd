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

Several jobs reading one mount (``jobs.JobOf`` tells them apart) each have their own epochs (``epochs.Job``) and
share one budget by how soon each held file is wanted again (``shared_budget``); one job decides as above. A job is
one user's: a new one takes the place of a job of its own user, or of one idle past DISPLACE_IDLE, never of
another user's job that reads; where there is none, its reads are counted in no job (``_admit``).

A held file costs the budget what the level that holds it says it takes (``charge_files``): for a memfd its
whole pages, a file's overhead, and at least its share of the descriptors the level may hold, so a budget of
tiny files cannot run the daemon out of descriptors or count a page as 512 B. A budget given as a percentage is
of what holding every file costs at that charge, and ``share`` (the C/D above) is the budget's part of that cost
however it was given (``budget``): the quota keeps that share of each epoch's bytes, which then fills the budget.

This module is pure bookkeeping: it never touches bytes. Where the held bytes live is the caller's business (a
level of held bytes, ``held``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import random
import statistics
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .budget import DatasetCost, ShareOfCost
from .epochs import WINDOW, CacheStats, EpochStats, Job, add_stats
from .shared_budget import ReadIn, WantedSoonest, read_in

__all__ = ["NO_CACHE", "WINDOW", "Decision", "NextEpochCache"]

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Decision:
    hit: bool            # the file's bytes are held: serve them from memory
    hold: bool           # hold the file after this read (for the next epoch)
    epoch: int           # the epoch this read belongs to (0 for a re-read)
    same_epoch: bool = False  # a second read of the file in the epoch it was already read in (a retry)
    evicted: tuple[int, ...] = ()  # files that stopped being held: their pages must be dropped
    job: int = 0  # the job whose read it was (``jobs.JobOf``)


#: What an open decides where no next-epoch cache is configured: not held, not to hold.
NO_CACHE = Decision(hit=False, hold=False, epoch=0)


#: Jobs tracked at once (12 bytes a file each): past them a new job takes the place of one of its own user's, or
#: of one idle past DISPLACE_IDLE (``_admit``).
MAX_JOBS = 8
#: Seconds before the latest read within which a job still counts as reading for the mount's own figures
#: (``NextEpochCache._leading``).
LEADING_WINDOW = 60.0
#: Jobs refused a slot remembered, so each is counted once in ``jobs_refused`` (a job's every read had been).
REMEMBERED_REFUSALS = 1024
#: Job slots only root and the mount's own user may take (as the open-file budget keeps its last eighth for them,
#: ``fuse.open_budget.OpenBudget``): whatever the other users run, the mount's owner can begin a job.
JOBS_KEPT_BACK = max(1, MAX_JOBS // 8)
#: Jobs a user other than root and the mount's own has at once: half of those not kept back, so one user with
#: a `setsid cat` loop leaves the other half to everyone else (it displaces its own jobs past them).
JOBS_PER_USER = max(1, (MAX_JOBS - JOBS_KEPT_BACK) // 2)
#: The owner of a job whose uid the job table no longer knows: no user's, privileged never (its slots are one
#: unprivileged user's).
UNKNOWN_OWNER = -1
#: Seconds without a read after which a job no longer counts as reading (its files are not held for it).
JOB_IDLE = 300.0
#: Seconds without a read after which another user's new job may take a job's slot when every slot is taken.
#: Far past the pauses of a training that reads on (an epoch's end, a loader's workers restarting, a short
#: evaluation: seconds; the issue's trainer paused 3 s), and short enough that a finished trial's slot goes to
#: whoever reads now well before JOB_IDLE. A job displaced loses only its epoch count, not its held files.
DISPLACE_IDLE = 60.0
#: Reads between two looks for jobs idle past JOB_IDLE (besides when a new job begins).
RETIRE_EVERY = 1024
#: Held files a retired job's heir takes over per read (``_reown_some``): a job that held 100,000 files is
#: handed over in slices, never in one walk on the FUSE loop.
REOWN_SLICE = 64


@dataclass(frozen=True, slots=True)
class Held:
    size: int
    charge: int     # what it costs the budget (``NextEpochCache.charge``)
    for_epoch: int  # the epoch (of ``job``) its next read is expected in
    job: int        # the job whose read chose it
    #: Each job's epoch of the file when it was chosen, (job, epoch) pairs: whether a job still has to read it in
    #: the epoch it is in, which decides how soon it is wanted again (``shared_budget.wanted_in``).
    read_in: ReadIn = ()
    serial: int = 0  # the ``Job.serial`` of that job's record (its id may be a later record's by now)


class NextEpochCache:
    """Decides, per read of a file, whether it is a hit and whether to hold it for a later read.

    One job (the usual case: one training, its ranks and workers) is the policy of the module's docstring: a C/D
    share of each epoch held for the next. Several jobs reading one dataset at once (a hyperparameter search)
    share one budget: a file one job has just read is wanted by every job that has not read it yet in its
    current epoch, soon, and by the others only in their next. So, while more than one job reads, a file read is
    held when there is room, or in place of the held files wanted latest when it is wanted sooner than they are
    (Belady's rule, with each job's own reads as the clock; ``shared_budget``). Every job hits at least the
    C/D share a random choice would give it, and a file read from storage by one job is served from memory to
    the others that follow it closely, so k jobs read less than k datasets from storage per epoch.
    """

    def __init__(self, budget: int | ShareOfCost, dataset_bytes: int, dataset_files: int, *,
                 max_id: int | None = None, cost: DatasetCost | None = None, gap: float = 0.5, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 owner_of: Callable[[int], int | None] | None = None) -> None:
        """``budget``: bytes, or a share of what holding every file costs (``budget.ShareOfCost``); ``cost``:
        what the dataset's files take in pages (``catalog.catalog.Catalog.paged_bytes``; None: estimated from
        ``dataset_bytes``); ``owner_of``: the uid of a job id (``jobs.JobOf.owner``; None: every job is the
        daemon's own user's)."""
        self.dataset_bytes = max(1, dataset_bytes)
        self.dataset_files = max(1, dataset_files)
        self.cost = cost if cost is not None else DatasetCost(self.dataset_files, {1: self.dataset_bytes})
        self._asked = budget
        self.budget = 0
        self.share = 0.0
        self._dataset_cost = self.dataset_bytes  # what holding every file costs (``_resolve_budget``)
        self.gap = gap
        self.seed = seed
        self.clock = clock
        self._size = (max_id if max_id is not None else dataset_files) + 1
        self.held: dict[int, Held] = {}
        self.held_bytes = 0
        self.jobs: dict[int, Job] = {0: Job(0, self._size)}  # job 0: the first opener (and the warm-up)
        self.retired = CacheStats()  # the counters of jobs that stopped reading
        self.jobs_retired = 0
        # While several jobs read: the held files ranked by how soon a job wants them again.
        self._soonest = WantedSoonest(self.dataset_files)
        # The held files by the epoch they are held for (of the one job reading), each in the order held.
        self._by_epoch: dict[int, dict[int, None]] = {}
        # The held files by the job whose read chose them: a retired job's are handed over without a walk of all.
        self._by_job: dict[int, dict[int, None]] = {}  # (by ``Job.serial``)
        self._serials = itertools.count(1)  # ``Job.serial``s: 0 is the first job's
        # (files, heir, retired job's serial): a retired job's held files, still to be handed over to its heir
        self._reowning: deque[tuple[dict[int, None], int, int]] = deque()
        self.files_reowned = 0  # held files handed from a retired job to its heir (work done, for tests)
        self._all_reads = 0
        self.owner_of = owner_of
        #: Root and the mount's own user: the only ones who may take the job slots kept back.
        self.privileged = frozenset({0, os.getuid()})
        # What a held file costs (``charge_files``): its size, until a level says what it takes.
        self._page = 1
        self._overhead = 0
        self._min_charge = 0
        self._resolve_budget()
        self.uncounted_reads = 0  # reads counted in no job (``_admit``)
        self.jobs_refused = 0     # new jobs that found no slot they could take
        self._refused: OrderedDict[int, None] = OrderedDict()  # the latest of them (REMEMBERED_REFUSALS)

    @property
    def stats(self) -> CacheStats:
        """The leading job's counters (the only job's, usually; there is always one: ``_retire``)."""
        return self._leading().stats

    @property
    def newest_epoch(self) -> int:
        return self._leading().newest_epoch

    def _leading(self) -> Job:
        """The job the mount's own figures describe (its epoch, its windows): of those that read in the last
        LEADING_WINDOW seconds of the latest read, the one that read most, so a training, not a `cat` from a shell
        that read one file before it began (the first job, which the figures described until it retired,
        minutes later), nor, of two trainings at once, each in turn at every read; the first where none has."""
        newest = max(job.last_read for job in self.jobs.values())
        return max((job for job in self.jobs.values() if newest - job.last_read <= LEADING_WINDOW),
                   key=lambda job: job.reads)

    # -- the policy ----------------------------------------------------------------------------------

    def read(self, file: int, size: int, job: int = 0) -> Decision:
        """A reader of ``job`` opened ``file`` (``size`` bytes as served) to read it."""
        now = self.clock()
        found = self._job(job, now)
        self._reown_some()  # a slice of the files of jobs retired (at this read or before)
        if found is None:
            # An opener without a job (not known, or no slot it may take): served what is held like any read,
            # and nothing counted, moved or held for anyone.
            self.uncounted_reads += 1
            held = file in self.held
            return Decision(hit=held, hold=held, epoch=0, job=job)
        state = found
        current = int(state.epoch_of[file])
        if current + 1 <= state.newest_epoch:
            # its next epoch, already open; unless no read of that epoch is to come (the file was not read for an
            # epoch or more: one node's shard of each epoch, a partial epoch), then the newest
            epoch = current + 1
            if epoch < state.newest_epoch and state.has_passed(epoch):
                epoch = state.newest_epoch
        elif state.reads - int(state.read_at[file]) >= self._gap_needed(state, current):
            epoch = current + 1
        else:
            state.stats.same_epoch_reads += 1
            held = file in self.held
            return Decision(hit=held, hold=held, epoch=0, same_epoch=True, job=job)
        evicted: tuple[int, ...] = ()
        if epoch > state.newest_epoch:
            state.begin_epoch(epoch)
        state.epoch_of[file] = epoch
        state.reads += 1
        state.read_at[file] = state.reads
        self._all_reads += 1
        if self._all_reads % RETIRE_EVERY == 0 and len(self.jobs) > 1:
            self._retire_idle(now)  # a job that stopped (a `cat` from a shell, a finished trial) stops counting
        state.clock_pace(now)
        ep = state.stats.epochs.setdefault(epoch, EpochStats())
        ep.reads += 1
        ep.bytes += size
        hit = file in self.held
        if hit:
            self._release(file, read=True)
        if len(self.jobs) == 1:
            keep = self._quota_allows(state, epoch, size)
            wanted = self.charge(size) + (self._drain_reserve(state) if epoch == state.newest_epoch else 0)
            if keep and self.held_bytes + wanted > self.budget:
                keep, evicted = self._room_from_passed(state, wanted)
        else:
            keep, pushed_out = self._wanted_sooner(file, size)
            evicted += pushed_out
        if keep:
            self._hold(file, Held(size, self.charge(size), epoch + 1, job, read_in(file, list(self.jobs.values())),
                                  state.serial))
            state.kept_for[epoch + 1] = state.kept_for.get(epoch + 1, 0) + size
        state.count(epoch, hit, size)
        return Decision(hit=hit, hold=keep, epoch=epoch, evicted=evicted, job=job)

    def _job(self, job: int, now: float) -> Job | None:
        """The record of ``job``, begun at its first read where it may have a slot; None: counted in no job."""
        state = self.jobs.get(job)
        if state is None:
            if self.owner_of is None:  # no job table: every job is this process's user's
                owner = os.getuid()
            else:
                # None: a job the table has forgotten (pushed out by many new ones) while an opener's pid still
                # names it. Nobody's, never the daemon's root: a user who pushes their own job out of the table
                # must not have it take root's slots.
                known = self.owner_of(job)
                owner = UNKNOWN_OWNER if known is None else known
            self._retire_idle(now)
            if not self._admit(owner, now):
                if job not in self._refused:  # counted once a job, not once a read of it
                    self.jobs_refused += 1
                    self._refused[job] = None
                    if len(self._refused) > REMEMBERED_REFUSALS:
                        self._refused.popitem(last=False)
                return None
            self._refused.pop(job, None)  # (refused again later: counted again)
            # (A record of its own: files still held for a record of this id before, retired, go on being handed
            # over a slice per read, told from this one's by their serial.)
            state = self.jobs[job] = Job(job, self._size, owner=owner, serial=next(self._serials))
            state.pace_since = (now, 0)
            for waiting in [j for j in self.jobs.values() if not j.reads and j is not state]:
                # a job that never read (job 0 before the first open: the warm-up's): the new one takes its place
                del self.jobs[waiting.id]
                self._reown(waiting, state)
            log.info("cache: job %d began reading (%d jobs now)", job, len(self.jobs))
        state.last_read = now
        return state

    def _admit(self, owner: int, now: float) -> bool:
        """Whether a new job of ``owner`` may begin, making room where it must: by retiring the job of its own
        idle longest, else one idle past DISPLACE_IDLE (anyone's). Never another user's job that reads: a user
        who opens with a new session or ``LIQUIDFS_JOB`` per process only takes its own jobs' places. Jobs that
        never read (the warm-up's) take no slot: the new job takes their place."""
        reading = [j for j in self.jobs.values() if j.reads]
        privileged = owner in self.privileged
        share = MAX_JOBS if privileged else JOBS_PER_USER
        room = MAX_JOBS if privileged else MAX_JOBS - JOBS_KEPT_BACK
        mine = [j for j in reading if j.owner == owner]
        if len(mine) < share and len(reading) < room:
            return True
        if mine:
            victim = min(mine, key=lambda j: j.last_read)
        else:
            idle = [j for j in reading if now - j.last_read > DISPLACE_IDLE]
            if not idle:
                log.log(logging.WARNING if not self.jobs_refused else logging.DEBUG,
                        "cache: every job slot is taken by jobs that read; a new job of uid %d is counted in "
                        "none (its reads are served, held for no one)", owner)
                return False
            victim = min(idle, key=lambda j: j.last_read)
        self._retire(victim)
        return True

    def _retire_idle(self, now: float) -> None:
        for state in [j for j in self.jobs.values() if j.reads and now - j.last_read > JOB_IDLE]:
            self._retire(state)

    def _retire(self, state: Job) -> None:
        """``state``'s job stopped reading: its counters join the retired ones, its held files stay (any job may
        read them) and are charged to the job that read first of those left."""
        del self.jobs[state.id]
        self.jobs_retired += 1
        add_stats(self.retired, state.stats)
        log.info("cache: job %d stopped reading (%d reads); %d jobs now", state.id, state.reads, len(self.jobs))
        if not self.jobs:
            self.jobs[state.id] = Job(state.id, self._size, serial=next(self._serials))  # for whoever reads next
        heir = next(iter(self.jobs.values()))
        self._reown(state, heir)

    def _reown(self, old: Job, heir: Job) -> None:
        """The files held for ``old``'s next reads are ``heir``'s now, held for its current epoch (unread in it,
        they are the first let go when room is wanted, as any file held for a passed epoch is). Only ``old``'s
        files are touched, REOWN_SLICE per read (``_reown_some``), never all at once."""
        files = self._by_job.pop(old.serial, None)
        if files:
            self._reowning.append((files, heir.id, old.serial))

    def _reown_some(self, limit: int = REOWN_SLICE) -> None:
        """Hand over at most ``limit`` files of the retired jobs to their heirs (the oldest retirement first)."""
        while self._reowning and limit > 0:
            files, heir_id, old = self._reowning[0]
            heir = self.jobs.get(heir_id) or next(iter(self.jobs.values()))  # (an heir retired meanwhile)
            while files and limit > 0:
                file, _ = files.popitem()
                limit -= 1
                self.files_reowned += 1
                entry = self.held.get(file)
                if entry is None or entry.serial != old:  # let go since (or held again by another record)
                    continue
                self._release(file)
                self._hold(file, dataclasses.replace(entry, job=heir.id, serial=heir.serial,
                                                     for_epoch=heir.newest_epoch))
                heir.kept_for[heir.newest_epoch] = heir.kept_for.get(heir.newest_epoch, 0) + entry.size
            if not files:
                self._reowning.popleft()

    def _gap_needed(self, state: Job, epoch: int) -> int:
        # A retry or header probe comes within a few reads of the first (other workers' reads in between);
        # the first read of a new epoch comes a uniformly random share of an epoch later. A small threshold
        # misreads that first read as a retry with probability ~2 %, after which the epoch is open anyway.
        reads = state.reads_of(epoch)
        return max(1, int(min(self.gap * reads, 32 + 0.02 * reads)))

    def _quota_allows(self, state: Job, epoch: int, size: int) -> bool:
        if self.share <= 0 or self.charge(size) > self.budget:
            return False
        ep = state.stats.epochs[epoch]
        # The decision must not depend on this file's own size, or the kept set would favour large (or small)
        # files and the share of hits counted per file would drift from the byte share: the quota grows by the
        # mean size of the files read before it, and a file is kept when that quota covers half a mean file.
        before = ep.bytes - size
        mean = before / (ep.reads - 1) if ep.reads > 1 else size
        return state.kept_for.get(epoch + 1, 0) + mean / 2 <= self.share * (before + mean)

    def _drain_reserve(self, state: Job) -> int:
        """The room the epoch before the newest may still take, while its last reads come (other ranks still in
        it, a loader's read-ahead already in the newest): its share of the bytes left to read of it. Without
        it, the newest epoch's first keeps took that room, and the epoch after the seam hit less than C/D (DALI
        shards: 0.23-0.26 of 0.30) and the one after more."""
        draining = state.newest_epoch - 1
        if draining < 1 or state.has_passed(draining):
            return 0
        before = state.stats.epochs.get(draining - 1)
        expected = before.bytes if before is not None else self.dataset_bytes
        read = state.stats.epochs.get(draining)
        left = expected - (read.bytes if read is not None else 0)
        # (in what the level charges: share x the bytes left costs what those bytes' files take)
        return int(self.share * left * self._dataset_cost / self.dataset_bytes) if left > 0 else 0

    def _wanted_sooner(self, file: int, size: int) -> tuple[bool, tuple[int, ...]]:
        """Whether to hold ``file`` while several jobs read: at once where there is room; else in place of held
        files wanted later than it (``shared_budget``). The files let go are returned."""
        cost = self.charge(size)
        if self.share <= 0 or cost > self.budget:
            return False, ()
        if self.held_bytes + cost <= self.budget:
            return True, ()
        jobs = list(self.jobs.values())
        victims = self._soonest.victims(read_in(file, jobs), cost, self.budget - self.held_bytes,
                                        lambda held: self.held[held].charge, jobs, self._all_reads)
        if victims is None:
            return False, ()
        for victim in victims:
            self._release(victim)
        return True, tuple(victims)

    # -- held files ------------------------------------------------------------------------------------

    def charge(self, size: int) -> int:
        """What holding a file of ``size`` bytes costs the budget (``charge_files``)."""
        return max(max(1, -(-size // self._page)) * self._page + self._overhead, self._min_charge)

    def charge_files(self, *, page: int, overhead: int, max_files: int | None = None) -> None:
        """Each held file costs its size rounded up to whole ``page`` (at least one: a memfd takes a page for a
        byte) and ``overhead``; with ``max_files`` (a level that holds a descriptor per file), at least that
        share of the budget, so the budget itself keeps the count whatever the sizes, and eviction needs no
        second limit. Set by the level before anything is held."""
        self._page = max(1, page)
        self._overhead = max(0, overhead)
        self._resolve_budget()
        self._min_charge = -(-self.budget // max(1, max_files)) if max_files is not None else 0

    def _resolve_budget(self) -> None:
        """The budget in what the level charges, and its share of holding every file: a percentage is of the
        files' cost at this charge, not of their bytes (``budget``), so 30 % holds 30 % of the files and hits
        about 30 % of the opens whatever their sizes. Only a descriptor cap (``charge_files``'s ``max_files``)
        can hold fewer: past it no level may hold more files whatever the budget."""
        cost = self._dataset_cost = self.cost.of(self._page, self._overhead)
        asked = self._asked
        self.budget = int(asked.share * cost) if isinstance(asked, ShareOfCost) else max(0, asked)
        self.share = min(1.0, self.budget / cost)
        log.info("cache budget %d bytes: %.1f %% of %d, what holding every file costs (pages of %d bytes, "
                 "%d bytes a file besides)", self.budget, 100 * self.share, cost, self._page, self._overhead)

    def _hold(self, file: int, entry: Held) -> None:
        self.held[file] = entry
        self.held_bytes += entry.charge
        self._soonest.add(file, entry.read_in)
        self._by_epoch.setdefault(entry.for_epoch, {})[file] = None
        self._by_job.setdefault(entry.serial, {})[file] = None

    def _release(self, file: int, *, read: bool = False) -> None:
        """``file`` is held no longer: ``read`` by the read it was held for, or let go unread (its place in
        the quota given back, so another file of its epoch may take it)."""
        entry = self.held.pop(file)
        self.held_bytes -= entry.charge
        state = self.jobs.get(entry.job)
        if state is not None and state.serial == entry.serial and not read:
            # A read keeps its file's place: the quota counts what was kept for an epoch, not what is left of it,
            # or the first reads of an epoch, while the last of the one before still come (other ranks, a
            # loader's read-ahead), would make room in the quota for more than C/D of it.
            state.kept_for[entry.for_epoch] = state.kept_for.get(entry.for_epoch, 0) - entry.size
        self._soonest.remove(file, entry.read_in)
        bucket = self._by_epoch.get(entry.for_epoch)
        if bucket is not None:
            bucket.pop(file, None)
            if not bucket:
                del self._by_epoch[entry.for_epoch]
        mine = self._by_job.get(entry.serial)
        if mine is not None:
            mine.pop(file, None)
            if not mine:
                del self._by_job[entry.serial]

    def _room_from_passed(self, state: Job, size: int) -> tuple[bool, tuple[int, ...]]:
        """Room for ``size`` more bytes, made by letting go of files held for an epoch that has passed without
        reading them, those of the oldest epoch first; (whether there is room now, the files let go).

        Such files stay held until their room is wanted, not dropped as their epoch ends: a reader of part of
        each epoch (one node's shard of a permutation that changes every epoch: DALI's ``shard_id``, a
        ``DistributedSampler`` across nodes) reads a held file in a later epoch as likely as in the next, so a
        budget kept full of them still hits C/D of what the node reads, where dropping them each epoch left
        it a quarter full. An epoch has passed when no read of it is to come (``Job.has_passed``): not while its
        last ranks still read it, though the first have begun the next (their files held for it would be lost
        hits, and the epoch's hit ratio short of C/D)."""
        room = self.budget - self.held_bytes
        victims: list[int] = []
        for for_epoch in sorted(e for e in self._by_epoch if state.has_passed(e)):
            for file in self._by_epoch[for_epoch]:
                victims.append(file)
                room += self.held[file].charge
                if room >= size:
                    break
            if room >= size:
                break
        if room < size:
            return False, ()
        for file in victims:
            self._release(file)
        return True, tuple(victims)

    # -- warm-up ---------------------------------------------------------------------------------------

    def warmup_choice(self, files: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """A random set of ``files`` (``sizes[i]`` bytes each) filling the budget by ``share`` of the bytes, held
        for epoch 1. Plain arithmetic on its arguments and constants of the policy: a worker thread may run it
        (ten million files take seconds), the loop serving meanwhile."""
        order = array("q", range(len(files)))  # positions, 8 bytes each, not a tuple per file
        random.Random(self.seed).shuffle(order)
        chosen = []
        # What the chosen files cost the budget (whole pages and a memfd each) and what they hold of the dataset:
        # the share is of the files' bytes, the budget of their costs (small files cost many times their size).
        cost_total = held = 0
        least = self.charge(0)
        wanted = self.share * self.dataset_bytes
        for at in order:
            size = sizes[at]
            cost = self.charge(size)
            if cost_total + cost > self.budget or held + size / 2 > wanted:
                if cost_total + least > self.budget or held > wanted:
                    break  # full: no file, however small, fits any more
                continue
            chosen.append(files[at])
            cost_total += cost
            held += size
        return chosen

    def hold(self, file: int, size: int) -> bool:
        """Hold ``file`` for the epoch its next read belongs to (warm-up); False when over budget."""
        cost = self.charge(size)
        if file in self.held or self.held_bytes + cost > self.budget:
            return False
        state = next(iter(self.jobs.values()))
        for_epoch = int(state.epoch_of[file]) + 1
        self._hold(file, Held(size, cost, for_epoch, state.id, read_in(file, list(self.jobs.values())), state.serial))
        state.kept_for[for_epoch] = state.kept_for.get(for_epoch, 0) + size
        return True

    def drop(self, file: int) -> None:
        """The held bytes were lost (the kernel reclaimed them, or the file changed)."""
        if file in self.held:
            self._release(file)

    # -- statistics ------------------------------------------------------------------------------------

    def correct_miss(self, epoch: int, size: int, job: int = 0) -> None:
        """A predicted hit had to be read from storage after all (its pages were reclaimed by the kernel)."""
        state = self.jobs.get(job)
        st = state.stats if state is not None else self.retired
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
        if state is not None:
            state.uncount_hit(epoch, size)

    def totals(self) -> CacheStats:
        """The counters of every job, those that stopped reading included (only the counters: no epochs)."""
        total = CacheStats()
        add_stats(total, self.retired)
        for state in self.jobs.values():
            add_stats(total, state.stats)
        return total

    def job_summaries(self) -> dict[str, dict[str, object]]:
        """Each job reading now, by id (``epochs.Job.summary``)."""
        return {str(state.id): state.summary() for state in self.jobs.values()}

    def summary(self) -> dict[str, object]:
        state = self._leading()  # (once: every figure of one summary of one job)
        st = state.stats
        total = self.totals()
        windows = [r for r, e in zip(st.window_ratios, st.window_epochs) if e >= 2]
        epochs = {
            str(e): {"reads": v.reads, "bytes": v.bytes, "hits": v.hits,
                     "byte_hit_ratio": round(v.hit_bytes / v.bytes, 4) if v.bytes else 0.0}
            for e, v in sorted(st.epochs.items())
        }
        current = state.newest_epoch
        return {
            "cache_budget": self.budget,
            "cache_share": round(self.share, 4),
            "cache_held_bytes": self.held_bytes,
            "cache_held_files": len(self.held),
            "cache_hits": total.hits,
            "cache_misses": total.misses,
            "cache_same_epoch_reads": total.same_epoch_reads,
            "cache_hit_bytes": total.hit_bytes,
            "cache_miss_bytes": total.miss_bytes,
            # The same as the policy predicted them at each read, and the lost hits apart: these only grow (the
            # counters /metrics exports; hits and misses above are net of the lost hits, and a lost hit lowers hits).
            "cache_hits_predicted": total.hits + total.lost_hits,
            "cache_misses_predicted": total.misses - total.lost_hits,
            "cache_hit_bytes_predicted": total.hit_bytes + total.lost_hit_bytes,
            "cache_miss_bytes_predicted": total.miss_bytes - total.lost_hit_bytes,
            "cache_lost_hits": total.lost_hits,
            "cache_lost_hit_bytes": total.lost_hit_bytes,
            "epoch": current,
            "epoch_progress": round(state.reads_of(current) / self.dataset_files, 4),
            "epochs": epochs,
            "window_size": WINDOW,
            "window_hit_ratios": [round(r, 4) for r in list(st.window_ratios)[-256:]],
            "window_byte_hit_ratios": [round(r, 4) for r in list(st.window_byte_ratios)[-256:]],
            "window_hit_ratio_mean": round(statistics.fmean(windows), 4) if windows else None,
            "window_hit_ratio_sd": round(statistics.pstdev(windows), 4) if len(windows) > 1 else None,
            "window_sd_bound": round(1.25 * math.sqrt(self.share * (1 - self.share) / WINDOW), 4),
            "jobs": self.job_summaries(),
            "jobs_reading": sum(1 for j in self.jobs.values() if j.reads),
            "jobs_retired": self.jobs_retired,
            "jobs_refused": self.jobs_refused,
            "jobs_uncounted_reads": self.uncounted_reads,
        }

