"""Openers told apart by job: cgroup, and the variables that name a job or the session, read once per pid (no
mount: fakes of /proc and getsid, and one real child process)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from liquidfs.policy import jobs as jobs_module
from liquidfs.policy.jobs import PIDS_KEPT, JobLookups, JobOf, read_cgroup, read_job_variables


class _Host:
    """pids -> (session, cgroup), and how often each was asked."""

    def __init__(self) -> None:
        self.procs: dict[int, tuple[int, str]] = {}
        self.variables: dict[int, str] = {}
        self.cgroup_reads = 0

    def getsid(self, pid: int) -> int:
        if pid not in self.procs:
            raise ProcessLookupError(pid)
        return self.procs[pid][0]

    def cgroup(self, pid: int) -> str:
        self.cgroup_reads += 1
        if pid not in self.procs:
            raise FileNotFoundError(pid)
        return self.procs[pid][1]

    def variables_of(self, pid: int) -> str:
        return self.variables.get(pid, "")


def _job_of(host: _Host) -> JobOf:
    return JobOf(getsid=host.getsid, cgroup_of=host.cgroup, variables_of=host.variables_of)


def _stuck(host: _Host, free: tuple[int, ...] = ()) -> tuple[JobOf, list[int], threading.Event]:
    """A JobOf over ``host`` whose /proc reads of every pid but ``free`` stay stuck until the event is set; the
    pids whose read began, in order."""
    release = threading.Event()
    entered: list[int] = []

    def cgroup(pid: int) -> str:
        if pid not in free:
            entered.append(pid)
            release.wait(30)
        return host.cgroup(pid)

    return JobOf(getsid=host.getsid, cgroup_of=cgroup, variables_of=host.variables_of), entered, release


def test_ranks_of_one_job_share_an_id_and_other_jobs_get_their_own() -> None:
    host = _Host()
    host.procs = {100: (100, "/train-a"), 101: (100, "/train-a"), 102: (100, "/train-a"),  # ranks, workers
                  200: (200, "/train-a"),   # same cgroup, another session (a second setsid start)
                  300: (100, "/train-b")}   # same session id, another cgroup (another container)
    job_of = _job_of(host)
    assert [job_of(pid) for pid in (100, 101, 102)] == [1, 1, 1]
    assert job_of(200) == 2
    assert job_of(300) == 3
    assert job_of(101) == 1
    assert "session 200" in job_of.labels[2] and "/train-b" in job_of.labels[3]


def test_torchrun_ranks_in_sessions_of_their_own_are_one_job() -> None:
    """torchrun starts each rank in a new session: its run id (and port) make them one job, another run another."""
    host = _Host()
    run_a = "TORCHELASTIC_RUN_ID=a MASTER_PORT=29500"
    run_b = "TORCHELASTIC_RUN_ID=b MASTER_PORT=29501"
    host.procs = {pid: (pid, "/") for pid in (10, 11, 12, 13, 20, 21)}
    host.variables = {10: run_a, 11: run_a, 12: run_a, 13: run_a, 20: run_b, 21: run_b}
    job_of = _job_of(host)
    assert [job_of(pid) for pid in (10, 11, 12, 13)] == [1, 1, 1, 1]
    assert [job_of(pid) for pid in (20, 21)] == [2, 2]
    assert job_of.labels[1].startswith(f"uid 0, {run_a}")


def _variables_of_child(env: dict[str, str]) -> str:
    """``read_job_variables`` of a child running with ``env``, once it runs (before, mid-exec, it has none)."""
    with subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"\n"
            return read_job_variables(child.pid)
        finally:
            child.communicate(b"")


def test_read_job_variables_of_a_real_process() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LIQUIDFS_JOB"}
    env.update(TORCHELASTIC_RUN_ID="run7", MASTER_PORT="29511")
    assert _variables_of_child(env) == "TORCHELASTIC_RUN_ID=run7 MASTER_PORT=29511"
    # the user's own name comes first
    assert _variables_of_child({**env, "LIQUIDFS_JOB": "search-3"}) == "LIQUIDFS_JOB=search-3"
    assert _variables_of_child({"PATH": "/usr/bin"}) == ""


def test_cgroup_read_once_per_pid_and_again_when_the_pid_is_reused() -> None:
    host = _Host()
    host.procs = {100: (100, "/a")}
    job_of = _job_of(host)
    for _ in range(5):
        assert job_of(100) == 1
    assert host.cgroup_reads == 1
    host.procs[100] = (555, "/b")  # pid 100 exited and a process of another job got its number
    assert job_of(100) == 2
    assert host.cgroup_reads == 2


def test_openers_not_told_apart_share_one_job_of_their_own_uid() -> None:
    """A process gone before it could be asked, and pid 0, count in a job of their uid: not in the first job,
    which may be another user's."""
    host = _Host()
    host.procs = {100: (100, "/a")}
    job_of = _job_of(host)
    first = job_of(100, 0)
    unknown_root = job_of(0, 0)
    assert unknown_root != first and job_of(4242, 0) == unknown_root  # exited before its open was answered
    unknown_nobody = job_of(4242, 65534)
    assert unknown_nobody not in (first, unknown_root) and job_of(0, 65534) == unknown_nobody
    assert job_of.owner(unknown_nobody) == 65534 and job_of.owner(first) == 0
    # alive for getsid, gone by the time /proc is read
    lone = JobOf(getsid=lambda pid: 7, cgroup_of=host.cgroup)
    assert lone(7, 5) == lone.unknown(5)


def test_another_uid_with_the_same_job_name_gets_a_job_of_its_own() -> None:
    """On an --allow-other mount, nobody with root's LIQUIDFS_JOB (or in the same cgroup and a session of the
    same number) neither joins root's job nor is mistaken for it; a pid whose uid changed is read again."""
    host = _Host()
    host.procs = {10: (10, "/"), 20: (10, "/")}
    host.variables = {10: "LIQUIDFS_JOB=resnet-a", 20: "LIQUIDFS_JOB=resnet-a"}
    job_of = _job_of(host)
    root = job_of(10, 0)
    assert job_of(20, 0) == root  # root's own second process: its job
    other = job_of(20, 65534)
    assert other != root and job_of.owner(other) == 65534 and job_of.owner(root) == 0
    assert job_of.known(20, 0) is None  # known as nobody's now: root's opener is read again, not trusted
    assert "uid 65534" in job_of.labels[other]


def test_a_lookup_that_times_out_keeps_the_job_its_pid_was_read_in() -> None:
    """A known pid due for its RECHECK whose /proc cannot be read in time stays in its job (lookups stuck on
    another user's processes cannot move it); an unknown one goes to its uid's job of openers not told apart."""
    from liquidfs.policy.jobs import RECHECK

    host = _Host()
    now = [0.0]
    host.procs = {500: (500, "/a"), 600: (600, "/a")}
    job_of = JobOf(getsid=host.getsid, cgroup_of=host.cgroup, variables_of=host.variables_of, clock=lambda: now[0])
    job = job_of(500, 1000)
    now[0] = RECHECK + 1
    assert job_of.known(500, 1000) is None
    assert job_of.register(500, 1000, None) == job
    assert job_of.register(600, 1000, None) == job_of.unknown(1000) != job
    assert job_of.register(500, 2000, None) == job_of.unknown(2000)  # another uid: never the old job


def test_pids_remembered_are_bounded() -> None:
    host = _Host()
    host.procs = {pid: (1, "/a") for pid in range(1, PIDS_KEPT + 50)}
    job_of = _job_of(host)
    for pid in host.procs:
        assert job_of(pid) == 1
    assert len(job_of._pids) == PIDS_KEPT


def test_read_cgroup_of_this_process() -> None:
    text = read_cgroup(os.getpid())
    assert text and "\x00" not in text
    with pytest.raises(OSError):
        read_cgroup(2 ** 22 + 12345)  # above pid_max's default ceiling: no such process


def test_a_pid_is_read_again_after_recheck_seconds() -> None:
    """A pid reused within a session of the same number (torchrun's ranks lead their own: session = pid) by
    another job's process is told apart once RECHECK seconds have passed since it was read."""
    from liquidfs.policy.jobs import RECHECK

    host = _Host()
    now = [0.0]
    host.procs = {500: (500, "/a")}
    host.variables = {500: "TORCHELASTIC_RUN_ID=one MASTER_PORT=1"}
    job_of = JobOf(getsid=host.getsid, cgroup_of=host.cgroup, variables_of=host.variables_of, clock=lambda: now[0])
    assert job_of(500) == 1
    host.variables[500] = "TORCHELASTIC_RUN_ID=two MASTER_PORT=2"  # pid 500 is another run's rank now
    assert job_of.known(500) == 1  # within RECHECK: trusted
    now[0] = RECHECK + 1
    assert job_of.known(500) is None  # to be read again (off the loop)
    assert job_of(500) == 2


def test_labels_carry_no_control_characters() -> None:
    host = _Host()
    host.procs = {9: (9, "/evil\x1b[2J\nline")}
    host.variables = {9: "LIQUIDFS_JOB=a\rb\x00"}
    job_of = _job_of(host)
    assert job_of(9) == 1
    label = job_of.labels[1]
    assert label.isprintable(), label


def test_the_mount_reads_proc_off_its_loop_and_gives_up_after_a_while(monkeypatch) -> None:
    """/proc/PID/environ takes the opener's memory-map lock, which a thread of it may hold while it faults on
    this mount: the read runs in a worker thread, and an open waits JOB_LOOKUP seconds at most (its uid's job of
    openers not told apart then),
    while the loop goes on."""
    import threading

    import trio

    release = threading.Event()
    host = _Host()
    host.procs = {77: (77, "/a")}

    def stuck_cgroup(pid: int) -> str:
        release.wait(10)
        return "/a"

    job_of = JobOf(getsid=host.getsid, cgroup_of=stuck_cgroup, variables_of=host.variables_of)
    monkeypatch.setattr(jobs_module, "JOB_LOOKUP", 0.2)
    ticks = 0

    async def main() -> int:
        nonlocal ticks
        async with trio.open_nursery() as nursery:
            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await trio.sleep(0.01)
            nursery.start_soon(ticker)
            job = await JobLookups(job_of).job(77)
            nursery.cancel_scope.cancel()
        return job

    assert trio.run(main) == job_of.unknown(0)
    assert ticks >= 5  # the loop ran while /proc was read
    release.set()


def test_lookups_stuck_on_proc_hold_up_no_memfd_copy_or_attribute_drop(monkeypatch, tmp_path) -> None:
    """More lookups stuck in /proc than trio's default limiter has threads (40) take only the lookups' own
    threads: a memfd copy and an attribute drop, each on a limiter of its own, finish while they are stuck."""
    import pyfuse3
    import trio
    from liquidfs.datapath.backing import memfd_with
    from liquidfs.datapath.notifier import Notifier
    from liquidfs.datapath.passthrough import PassthroughPath

    host = _Host()
    host.procs = {pid: (pid, "/a") for pid in range(1000, 1050)}
    job_of, entered, release = _stuck(host)
    monkeypatch.setattr(jobs_module, "JOB_LOOKUP", 0.2)
    invalidated: list[int] = []
    monkeypatch.setattr(pyfuse3, "invalidate_inode", lambda inode, attr_only: invalidated.append(inode))

    class Copier:  # PassthroughPath's copy alone, with its limiter
        blocking_copy = PassthroughPath.blocking_copy

        def __init__(self) -> None:
            self._copies = trio.CapacityLimiter(4)
            self._copies_stuck, self._copies_lock = 0, threading.Lock()
            self.calls = SimpleNamespace(io_timeout=60.0)

    source = memfd_with(b"held bytes")
    copied: list[bytes] = []

    async def main() -> None:
        lookups = JobLookups(job_of)
        with trio.fail_after(20):  # a copy behind the stuck lookups would wait for them: 30 s
            async with trio.open_nursery() as nursery:
                for pid in host.procs:
                    nursery.start_soon(lookups.job, pid)
                await trio.sleep(0.3)  # every lookup has given up; their threads are still stuck
                fd, _ = await Copier().blocking_copy(SimpleNamespace(fd=source, size=10, stamp=None))  # type: ignore[arg-type]
                copied.append(os.pread(fd, 100, 0))
                os.close(fd)
                await Notifier().new_size(5)
                assert not release.is_set()

    try:
        trio.run(main)
    finally:
        release.set()
        os.close(source)
    assert copied == [b"held bytes"] and invalidated == [5]
    assert len(entered) <= jobs_module.JOB_LOOKUP_THREADS  # the lookups' own threads: the rest never got one


def test_lookups_one_users_processes_keep_stuck_never_make_another_users_opens_wait(monkeypatch) -> None:
    """A user on an --allow-other mount can keep the lookups of their own openers stuck (their environment mapped
    from a FUSE mount of theirs that never answers): those take that uid's threads only. Another user's new opener
    still has its /proc read, and its job is its own, not the uid's job of openers not told apart that a lookup
    waiting past JOB_LOOKUP for a thread falls back to."""
    import trio

    host = _Host()
    host.procs = {pid: (pid, "/attacker") for pid in range(2000, 2000 + 2 * jobs_module.JOB_LOOKUP_THREADS)}
    host.procs[99] = (99, "/trainer")
    job_of, entered, release = _stuck(host, free=(99,))
    monkeypatch.setattr(jobs_module, "JOB_LOOKUP", 0.5)

    async def main() -> int:
        lookups = JobLookups(job_of)
        async with trio.open_nursery() as nursery:
            for pid in host.procs:
                if pid != 99:
                    nursery.start_soon(lookups.job, pid, 1001)
            await trio.sleep(0.1)  # the attacker's lookups hold every thread theirs may have
            return await lookups.job(99, 1002)

    try:
        job = trio.run(main)
    finally:
        release.set()
    assert job != job_of.unknown(1002) and job_of.owner(job) == 1002 and "/trainer" in job_of.labels[job]
    assert len(entered) <= jobs_module.JOB_LOOKUP_THREADS


def test_lookups_of_every_uid_together_hold_a_bounded_number_of_threads(monkeypatch) -> None:
    """Each uid's stuck lookups keep their threads: a user with many uids (a subordinate range) must not pin the
    daemon's threads without end. Past JOB_LOOKUP_THREADS_ALL, a new opener's job is not read (its uid's job of
    openers not told apart), at once, until threads come back."""
    import trio

    host = _Host()
    host.procs = {pid: (pid, "/stuck") for pid in range(3000, 3012)}
    job_of, entered, release = _stuck(host)
    monkeypatch.setattr(jobs_module, "JOB_LOOKUP", 0.3)
    monkeypatch.setattr(jobs_module, "JOB_LOOKUP_THREADS", 2)
    monkeypatch.setattr(jobs_module, "JOB_LOOKUP_THREADS_ALL", 4)

    async def main() -> None:
        lookups = JobLookups(job_of)
        async with trio.open_nursery() as nursery:
            for i, pid in enumerate(host.procs):
                nursery.start_soon(lookups.job, pid, 2000 + i // 2)  # six uids, two openers each
        assert len(entered) == 4  # the cap of all, not six uids' two each

    try:
        trio.run(main)
    finally:
        release.set()


def test_a_user_opening_from_ever_new_sessions_pushes_out_only_their_own_jobs() -> None:
    """Job keys are remembered for JOBS_KEPT jobs; a user who opens from a new session per process (thousands)
    pushes out their own oldest, never another user's: that one's reads keep their job id (its epochs go on)."""
    host = _Host()
    host.procs = {1: (1, "/trainer")}
    job_of = _job_of(host)
    trainer = job_of(1, 2000)
    for pid in range(100, 100 + 2 * jobs_module.JOBS_KEPT):
        host.procs[pid] = (pid, "/hopper")  # a session of its own each
        job_of(pid, 1000)
    assert job_of._job((2000, "/trainer", "session 1")) == trainer and job_of.owner(trainer) == 2000
    assert len(job_of._ids) <= jobs_module.JOBS_KEPT


def test_a_pid_whose_lookup_timed_out_is_not_waited_for_again_until_its_recheck(monkeypatch) -> None:
    """Each open of a pid whose /proc stays stuck waited JOB_LOOKUP again (its lookups piling up on its uid's
    threads): one wait, then its job as ``_as_before`` says, until RECHECK."""
    import trio

    from liquidfs.policy.jobs import RECHECK

    host = _Host()
    host.procs = {77: (77, "/a")}
    now = [0.0]
    job_of, entered, release = _stuck(host)
    job_of._clock = lambda: now[0]
    monkeypatch.setattr(jobs_module, "JOB_LOOKUP", 0.2)

    async def opens(count: int) -> list[int]:
        lookups = JobLookups(job_of)
        return [await lookups.job(77, 1000) for _ in range(count)]

    try:
        assert trio.run(opens, 3) == [job_of.unknown(1000)] * 3
        assert entered == [77]  # one lookup began, one wait
        now[0] = RECHECK + 1
        trio.run(opens, 1)
        assert entered == [77, 77]  # tried again once its recheck is due
    finally:
        release.set()
