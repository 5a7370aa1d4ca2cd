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
