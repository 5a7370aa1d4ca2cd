"""Openers told apart by job: cgroup, and the variables that name a job or the session, read once per pid (no
mount: fakes of /proc and getsid, and one real child process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from liquidfs.jobs import PIDS_KEPT, UNKNOWN, JobOf, read_cgroup, read_job_variables


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


def test_ranks_of_one_job_share_an_id_and_other_jobs_get_their_own() -> None:
    host = _Host()
    host.procs = {100: (100, "/train-a"), 101: (100, "/train-a"), 102: (100, "/train-a"),  # ranks, workers
                  200: (200, "/train-a"),   # same cgroup, another session (a second setsid start)
                  300: (100, "/train-b")}   # same session id, another cgroup (another container)
    job_of = _job_of(host)
    assert [job_of(pid) for pid in (100, 101, 102)] == [0, 0, 0]
    assert job_of(200) == 1
    assert job_of(300) == 2
    assert job_of(101) == 0
    assert "session 200" in job_of.labels[1] and "/train-b" in job_of.labels[2]


def test_torchrun_ranks_in_sessions_of_their_own_are_one_job() -> None:
    """torchrun starts each rank in a new session: its run id (and port) make them one job, another run another."""
    host = _Host()
    run_a = "TORCHELASTIC_RUN_ID=a MASTER_PORT=29500"
    run_b = "TORCHELASTIC_RUN_ID=b MASTER_PORT=29501"
    host.procs = {pid: (pid, "/") for pid in (10, 11, 12, 13, 20, 21)}
    host.variables = {10: run_a, 11: run_a, 12: run_a, 13: run_a, 20: run_b, 21: run_b}
    job_of = _job_of(host)
    assert [job_of(pid) for pid in (10, 11, 12, 13)] == [0, 0, 0, 0]
    assert [job_of(pid) for pid in (20, 21)] == [1, 1]
    assert job_of.labels[0].startswith(run_a)


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
        assert job_of(100) == 0
    assert host.cgroup_reads == 1
    host.procs[100] = (555, "/b")  # pid 100 exited and a process of another job got its number
    assert job_of(100) == 1
    assert host.cgroup_reads == 2


def test_gone_processes_and_the_kernel_count_for_the_first_job() -> None:
    host = _Host()
    job_of = _job_of(host)
    assert job_of(0) == UNKNOWN
    assert job_of(4242) == UNKNOWN  # exited before its open was answered
    # alive for getsid, gone by the time /proc is read
    assert JobOf(getsid=lambda pid: 7, cgroup_of=host.cgroup)(7) == UNKNOWN


def test_pids_remembered_are_bounded() -> None:
    host = _Host()
    host.procs = {pid: (1, "/a") for pid in range(1, PIDS_KEPT + 50)}
    job_of = _job_of(host)
    for pid in host.procs:
        assert job_of(pid) == 0
    assert len(job_of._pids) == PIDS_KEPT


def test_read_cgroup_of_this_process() -> None:
    text = read_cgroup(os.getpid())
    assert text and "\x00" not in text
    with pytest.raises(OSError):
        read_cgroup(2 ** 22 + 12345)  # above pid_max's default ceiling: no such process


def test_a_pid_is_read_again_after_recheck_seconds() -> None:
    """A pid reused within a session of the same number (torchrun's ranks lead their own: session = pid) by
    another job's process is told apart once RECHECK seconds have passed since it was read."""
    from liquidfs.jobs import RECHECK

    host = _Host()
    now = [0.0]
    host.procs = {500: (500, "/a")}
    host.variables = {500: "TORCHELASTIC_RUN_ID=one MASTER_PORT=1"}
    job_of = JobOf(getsid=host.getsid, cgroup_of=host.cgroup, variables_of=host.variables_of, clock=lambda: now[0])
    assert job_of(500) == 0
    host.variables[500] = "TORCHELASTIC_RUN_ID=two MASTER_PORT=2"  # pid 500 is another run's rank now
    assert job_of.known(500) == 0  # within RECHECK: trusted
    now[0] = RECHECK + 1
    assert job_of.known(500) is None  # to be read again (off the loop)
    assert job_of(500) == 1


def test_labels_carry_no_control_characters() -> None:
    host = _Host()
    host.procs = {9: (9, "/evil\x1b[2J\nline")}
    host.variables = {9: "LIQUIDFS_JOB=a\rb\x00"}
    job_of = _job_of(host)
    assert job_of(9) == 0
    label = job_of.labels[0]
    assert label.isprintable(), label


def test_the_mount_reads_proc_off_its_loop_and_gives_up_after_a_while(monkeypatch) -> None:
    """/proc/PID/environ takes the opener's memory-map lock, which a thread of it may hold while it faults on
    this mount: the read runs in a worker thread, and an open waits JOB_LOOKUP seconds at most (the first job's
    then), while the loop goes on."""
    import threading

    import trio

    from liquidfs import fs

    release = threading.Event()
    host = _Host()
    host.procs = {77: (77, "/a")}

    def stuck_cgroup(pid: int) -> str:
        release.wait(10)
        return "/a"

    job_of = JobOf(getsid=host.getsid, cgroup_of=stuck_cgroup, variables_of=host.variables_of)
    monkeypatch.setattr(fs, "JOB_LOOKUP", 0.2)

    class Ops:
        _job_of = fs.Operations._job_of

        def __init__(self) -> None:
            self.job_of = job_of

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
            job = await Ops()._job_of(77)
            nursery.cancel_scope.cancel()
        return job

    assert trio.run(main) == UNKNOWN
    assert ticks >= 5  # the loop ran while /proc was read
    release.set()
