"""Which job an open comes from: the FUSE request's pid mapped to the job its process belongs to.

The next-epoch cache counts epochs per job (``policy.next_epoch.NextEpochCache``): the ranks of one training and their
loader workers read one epoch between them, while two trainings of a hyperparameter search each read the whole
dataset at their own pace. The kernel tells the daemon only the pid (the thread's id) of each request, so a job
is what that process shares with the others of its job and not with other jobs' processes: its **cgroup** (a
Kubernetes container, a systemd unit or scope, a Slurm step each have their own, and every process they start
inherits it) and, within a cgroup, the first of these the process has:

- ``LIQUIDFS_JOB`` in its environment: what a user sets to say it;
- ``TORCHELASTIC_RUN_ID`` with ``MASTER_PORT``: what ``torchrun`` gives the ranks of one run (each rank in a
  session of its own, so the session would split them);
- ``SLURM_JOB_ID`` with ``SLURM_STEP_ID``: one step of a Slurm job;
- else its **session**: a login, a terminal, a ``setsid`` start each begin one, and a training's children
  (DataLoader workers, DALI's threads) inherit it.

And always its **uid** (the FUSE request's): on an ``--allow-other`` mount another user who sets the same
``LIQUIDFS_JOB``, or runs in the same cgroup and session number, is another job, and so can neither join a job
of another user nor move its epochs. The openers of a uid whose job cannot be learnt (gone before they could be
asked, pid 0, ``/proc`` too slow) share one job of that uid (``JobOf.unknown``): not the first job, which may be
another user's.

Neither cgroup nor session alone would do: on a plain host every process of a user shares the login's cgroup,
and in a container every process may share one session. What this cannot see: two trainings that one driver
starts as plain children (no session, variable or unit of their own) are one job; give each a ``LIQUIDFS_JOB``
(or start it with ``setsid``, ``systemd-run --scope``, or in its own container). A user who sets a new
``LIQUIDFS_JOB`` per process only makes jobs of its own (at most ``policy.next_epoch.MAX_JOBS`` are tracked, and a user
other than root and the mount's own has at most ``policy.next_epoch.JOBS_PER_USER`` of them).

Reading ``/proc/PID/cgroup`` and ``/proc/PID/environ`` costs two file opens, in a worker thread (never on the
FUSE loop: see ``JobOf``); it is done once per pid every RECHECK seconds, and ``getsid`` (one system call)
checks on every open that the pid is still in the session it was (a pid reused by another process may not be).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)

#: pids remembered (one entry each); past them the oldest is forgotten and read again if it opens again.
PIDS_KEPT = 4096
#: Jobs remembered by what tells them apart; past them the oldest is forgotten (a job seen again gets a new id).
JOBS_KEPT = 1024
#: Jobs remembered of one uid; past them its own oldest is forgotten: a user who opens from a new session or
#: ``LIQUIDFS_JOB`` per process pushes out their own jobs, never other users' (who would get new ids, and new epochs).
JOBS_KEPT_PER_UID = JOBS_KEPT // 4
#: What names the job of a uid's openers that cannot be told apart (``JobOf.unknown``).
UNKNOWN = "an opener not told apart"
#: Seconds an open waits for its opener's job to be read from /proc (``JobOf.read_key``).
JOB_LOOKUP = 1.0
#: Worker threads reading /proc for jobs at once, for the openers of one uid, on limiters of their own: a lookup
#: stuck on an opener's environment (its memory map's lock, held while it faults on this mount, or on a FUSE
#: mount of its owner's that never answers) keeps its thread and its token until it returns, and must not starve
#: the storage reads, memfd copies or notifications, nor another user's lookups (whose every open would wait
#: JOB_LOOKUP for a token).
JOB_LOOKUP_THREADS = 8
#: Worker threads reading /proc for jobs at once, all uids together: each uid's stuck lookups keep their threads,
#: and a user with many uids (a subordinate range) must not pin thousands of the daemon's. Past it, an opener's
#: job is read no more until threads come back (``JobOf.register`` of nothing: its job as before, or its uid's).
JOB_LOOKUP_THREADS_ALL = 64
#: Per-uid limiters kept before those of uids with no lookup under way are let go (``_limiter_of``).
LOOKUP_LIMITERS_KEPT = 64


#: The variables that name a job, each group in the order tried (the first group a process has all of wins).
JOB_VARIABLES = (("LIQUIDFS_JOB",), ("TORCHELASTIC_RUN_ID", "MASTER_PORT"), ("SLURM_JOB_ID", "SLURM_STEP_ID"))
_ENVIRON_READ = 1 << 18  # bytes of a process's environment read: variables past them are not seen


def read_job_variables(pid: int) -> str:
    """The first of ``JOB_VARIABLES`` that ``pid``'s environment (as it started) has, as ``NAME=value ...``; ""
    for none."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read(_ENVIRON_READ)
    found: dict[str, str] = {}
    wanted = {name for group in JOB_VARIABLES for name in group}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        key = name.decode("ascii", "replace")
        if sep and key in wanted:
            found[key] = value[:256].decode("utf-8", "replace")
    for group in JOB_VARIABLES:
        if all(name in found for name in group):
            return " ".join(f"{name}={found[name]}" for name in group)
    return ""


def read_cgroup(pid: int) -> str:
    """The cgroup ``pid`` is in: the unified hierarchy's path (cgroup v2), else the lines of every v1 hierarchy."""
    with open(f"/proc/{pid}/cgroup", "rb") as f:
        text = f.read(65536).decode("utf-8", "replace")
    lines = [line for line in text.splitlines() if line]
    unified = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    return unified[0] if unified and unified[0] != "/" else "\n".join(sorted(lines))


#: Seconds a pid's job is trusted before its cgroup and environment are read again: a pid reused by a process of
#: another job within that time, in a session of the same number (torchrun's ranks lead sessions of their own,
#: numbered by their pids), would be counted in the old one meanwhile.
RECHECK = 10.0
#: What ``read_key`` learns of a pid: (its session, (its cgroup, what names its job)).
Found = tuple[int, tuple[str, str]]
#: What tells a job apart: (the opener's uid, its cgroup, what names its job or its session).
Key = tuple[int, str, str]


def _printable(text: str, limit: int = 200) -> str:
    """``text`` (a cgroup path, a variable's value: anyone's) without control characters, for the log and stats."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


class JobOf:
    """Maps the pid and uid of a FUSE request to a small job id (1, 2, ... in the order jobs first open a file;
    0 is the next-epoch cache's own first job, its warm-up's, never an opener's).

    On the FUSE loop only ``known`` and ``register`` run (a dict, and ``getsid``: one system call).
    ``read_key`` reads ``/proc``, which must not run on the loop: reading another process's environment takes
    its memory map's lock, which one of its threads may hold while it faults on a page of this very mount, and
    only the loop can serve that fault. The caller runs it in a worker thread with a time limit."""

    def __init__(self, *, getsid: Callable[[int], int] = os.getsid,
                 cgroup_of: Callable[[int], str] = read_cgroup,
                 variables_of: Callable[[int], str] = read_job_variables,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._getsid = getsid
        self._cgroup_of = cgroup_of
        self._variables_of = variables_of
        self._clock = clock
        # pid -> (session, uid, job, when read)
        self._pids: OrderedDict[int, tuple[int, int, int, float]] = OrderedDict()
        self._ids: OrderedDict[Key, int] = OrderedDict()   # (uid, cgroup, variables or session) -> job
        self._keys_of: dict[int, OrderedDict[Key, None]] = {}  # uid -> its keys, oldest first
        self._next = 1
        #: Each job's (cgroup, session), for ``liquidfs stats``: which processes a job id stands for.
        self.labels: dict[int, str] = {}
        #: Each job's uid (those remembered): whose job it is (``next_epoch.NextEpochCache`` asks at its first read).
        self.owners: dict[int, int] = {}

    def __call__(self, pid: int, uid: int = 0) -> int:
        """The job of ``pid`` (run by ``uid``), reading ``/proc`` here where it must (tests, and callers off the
        FUSE loop)."""
        job = self.known(pid, uid)
        return job if job is not None else self.register(pid, uid, self.read_key(pid))

    def owner(self, job: int) -> int | None:
        """The uid whose job ``job`` is (None: not one of the jobs remembered)."""
        return self.owners.get(job)

    def unknown(self, uid: int) -> int:
        """The job of ``uid``'s openers that cannot be told apart: one per uid, so they move no other user's."""
        return self._job((uid, "", UNKNOWN))

    def known(self, pid: int, uid: int = 0) -> int | None:
        """The job of ``pid`` run by ``uid`` where it is known (or cannot be learnt: ``unknown``); None where
        ``read_key`` must read it."""
        if pid <= 0:
            return self.unknown(uid)
        try:
            session = self._getsid(pid)
        except OSError:  # gone already (a thread that opened and exited)
            return self.unknown(uid)
        known = self._pids.get(pid)
        # A uid that changed (a process that dropped root) is a new opener: read again, never its old job.
        if known is not None and known[:2] == (session, uid) and self._clock() - known[3] < RECHECK:
            self._pids.move_to_end(pid)
            return known[2]
        return None

    def read_key(self, pid: int) -> Found | None:
        """What tells ``pid``'s job apart (blocking: ``/proc``); None for a process gone meanwhile."""
        try:
            session = self._getsid(pid)
            return session, (self._cgroup_of(pid), self._variables_of(pid) or f"session {session}")
        except OSError:
            return None

    def register(self, pid: int, uid: int, found: Found | None) -> int:
        """The job of ``pid`` run by ``uid`` from what ``read_key`` found (None: not found, ``_as_before``),
        remembered for its next opens."""
        if found is None:
            return self._as_before(pid, uid)
        session, (cgroup, names) = found
        job = self._job((uid, cgroup, names))
        self._remember(pid, session, uid, job)
        return job

    def _remember(self, pid: int, session: int, uid: int, job: int) -> None:
        self._pids[pid] = (session, uid, job, self._clock())
        self._pids.move_to_end(pid)
        if len(self._pids) > PIDS_KEPT:
            self._pids.popitem(last=False)

    def _as_before(self, pid: int, uid: int) -> int:
        """A pid whose ``/proc`` could not be read: the job it was read in before, where it is the same opener
        (same uid and session: only the RECHECK was missed), else its uid's ``unknown`` one. Lookups another
        user's processes keep stuck (they share the lookups' threads) cannot move a known job's reads.

        Remembered as a lookup's result is, until its next RECHECK: a pid whose ``/proc`` stays stuck (its
        memory-map lock held by a thread faulting on a stuck mount) would have had each of its opens wait
        JOB_LOOKUP for it again."""
        try:
            session = self._getsid(pid)
        except OSError:
            return self.unknown(uid)
        known = self._pids.get(pid)
        job = known[2] if known is not None and known[:2] == (session, uid) else self.unknown(uid)
        self._remember(pid, session, uid, job)
        return job

    def _job(self, key: Key) -> int:
        job = self._ids.get(key)
        if job is None:
            job = self._ids[key] = self._next
            self._next += 1
            uid, cgroup_lines, names = key
            cgroup = _printable(cgroup_lines.splitlines()[0] if cgroup_lines else "?")
            self.labels[job] = f"uid {uid}, {_printable(names)}, cgroup {cgroup}"
            self.owners[job] = uid
            log.info("job %d: the openers with %s", job, self.labels[job])
            mine = self._keys_of.setdefault(uid, OrderedDict())
            mine[key] = None
            if len(mine) > JOBS_KEPT_PER_UID:
                self._forget_key(next(iter(mine)))
            elif len(self._ids) > JOBS_KEPT:
                self._forget_key(next(iter(self._ids)))
        else:
            self._ids.move_to_end(key)
            self._keys_of[key[0]].move_to_end(key)
        return job

    def _forget_key(self, key: Key) -> None:
        old = self._ids.pop(key)
        self.labels.pop(old, None)
        self.owners.pop(old, None)
        mine = self._keys_of[key[0]]
        del mine[key]
        if not mine:
            del self._keys_of[key[0]]


class JobLookups:
    """The job of each open, as the FUSE layer asks it on the trio loop: a known opener at once, a new one read
    from ``/proc`` in a worker thread of the lookups' own, for at most JOB_LOOKUP seconds (then, and for a
    process gone meanwhile, its uid's job of openers not told apart: ``JobOf.unknown``)."""

    def __init__(self, job_of: JobOf) -> None:
        self.job_of = job_of
        self._limiters: dict[int, trio.CapacityLimiter] = {}  # by the openers' uid
        self._all = trio.CapacityLimiter(JOB_LOOKUP_THREADS_ALL)

    async def job(self, pid: int, uid: int = 0) -> int:
        """The job of the opener ``pid`` run by ``uid``."""
        job = self.job_of.known(pid, uid)
        if job is None:
            found = None
            if self._all.available_tokens:
                with trio.move_on_after(JOB_LOOKUP):
                    # (trio takes any limiter with these two methods; its hints name CapacityLimiter alone)
                    both = _Both(self._limiter_of(uid), self._all)
                    found = await trio.to_thread.run_sync(self.job_of.read_key, pid, abandon_on_cancel=True,
                                                          limiter=both)  # type: ignore[arg-type]
            job = self.job_of.register(pid, uid, found)
        return job

    def _limiter_of(self, uid: int) -> trio.CapacityLimiter:
        """The lookups' limiter of ``uid``'s openers (those of uids with no lookup under way let go, past a few)."""
        limiter = self._limiters.get(uid)
        if limiter is None:
            if len(self._limiters) >= LOOKUP_LIMITERS_KEPT:
                for idle in [u for u, held in self._limiters.items() if not held.borrowed_tokens]:
                    del self._limiters[idle]
            limiter = self._limiters[uid] = trio.CapacityLimiter(JOB_LOOKUP_THREADS)
        return limiter

    def name_openers(self, jobs: object) -> None:
        """Each job in the policy's statistics (``jobs``: its summary's ``{job: entry}``) told whose openers it
        is, as ``openers`` (a job forgotten since: "?")."""
        if not isinstance(jobs, dict):
            return
        for job, entry in jobs.items():
            if isinstance(entry, dict):
                entry["openers"] = self.job_of.labels.get(int(job), "?")


class _Both:
    """A token of ``first`` (waited for), then one of ``second``: a lookup's thread counts in its uid's limiter
    and in the limiter of all lookups (trio's ``to_thread`` limiter interface)."""

    def __init__(self, first: trio.CapacityLimiter, second: trio.CapacityLimiter) -> None:
        self.first, self.second = first, second

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        await self.first.acquire_on_behalf_of(borrower)
        try:
            await self.second.acquire_on_behalf_of(borrower)
        except BaseException:
            self.first.release_on_behalf_of(borrower)
            raise

    def release_on_behalf_of(self, borrower: object) -> None:
        self.second.release_on_behalf_of(borrower)
        self.first.release_on_behalf_of(borrower)
