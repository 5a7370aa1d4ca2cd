"""``sysio.orphans``: pool workers (prepare's, verify's) end with the command they work for, killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fusehelpers import wait_for

#: A command whose forkserver pool (initialized as prepare's is) runs a job that never ends; it writes its
#: workers' pids, then waits to be killed.
COMMAND = """
import concurrent.futures as cf, multiprocessing, os, sys, time
from liquidfs.expand.expansion import set_budget

def stuck(_):
    time.sleep(3600)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("forkserver")
    pool = cf.ProcessPoolExecutor(max_workers=2, mp_context=ctx, initializer=set_budget,
                                  initargs=(None, os.getpid()))
    futures = [pool.submit(stuck, i) for i in range(2)]
    time.sleep(1)
    with open(sys.argv[1], "w") as f:
        f.write(" ".join(str(p) for p in pool._processes))
    time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_exit_when_the_command_is_killed_outright(tmp_path: Path) -> None:
    """SIGKILL of prepare (the OOM killer): its workers, children of the forkserver, sat blocked on a queue
    nobody writes, holding their memory and a half-written object, for good."""
    script = tmp_path / "command.py"
    script.write_text(COMMAND)
    pids_file = tmp_path / "workers"
    command = subprocess.Popen([sys.executable, str(script), str(pids_file)], cwd="/",
                               env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        wait_for(lambda: pids_file.exists() and pids_file.read_text().strip() != "", 60, what="the workers")
        workers = [int(p) for p in pids_file.read_text().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        command.send_signal(signal.SIGKILL)
        command.wait(30)
        wait_for(lambda: not any(_alive(p) for p in workers), 30, what="the workers to exit with the command")
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
        for pid in [int(p) for p in pids_file.read_text().split()] if pids_file.exists() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
