"""The starter of a mount's daemon (``daemon.spawn``): a daemon that never says ready is stopped the way that
unmounts what it mounted, not killed at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from liquidfs.daemon import spawn
from liquidfs.daemon.config import MountError

#: A daemon that mounted and then stalled: it never writes to its ready pipe, and on SIGTERM does what the real
#: one's handlers do (unmounts, here: says so) before it exits.
STALLED = """
import signal, sys, time
def stop(signum, frame):
    print("stopped by signal", signum, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("mounted", flush=True)
while True:
    time.sleep(1)
"""


def test_a_daemon_that_never_answers_gets_sigterm_first(tmp_path: Path) -> None:
    log_file = tmp_path / "mount.log"
    log_fd = os.open(log_file, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", STALLED], stdout=log_fd, stderr=log_fd,
                                pass_fds=(write_end,))
        os.close(write_end)
        with pytest.raises(MountError, match="did not answer within 2 s: stopped") as refused:
            spawn._wait_ready(proc, read_end, log_fd, log_file, 2.0)
    finally:
        os.close(log_fd)
    assert proc.returncode == 0, proc.returncode  # its own exit, from SIGTERM's handler: not -9
    assert "stopped by signal 15" in log_file.read_text()
    assert "mounted" in str(refused.value)  # its lines are shown


#: A daemon that mounted and then stalled past SIGTERM (its shutdown stuck): it is killed.
STUCK = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("mounted", flush=True)
while True:
    time.sleep(1)
"""


def test_a_daemon_killed_after_it_mounted_leaves_no_dead_mount(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed past its SIGTERM's wait, a daemon that had mounted left a mount whose daemon was gone: every
    reader got ENOTCONN until someone unmounted it by hand. Its mount is detached."""
    from liquidfs.daemon import watchdog

    mnt = tmp_path / "mnt"
    monkeypatch.setattr(spawn, "STOP_WAIT", 0.5)
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (b"fuse.liquidfs", 99, 7) if path == mnt else None)
    ran: list[list[str]] = []
    real_run = subprocess.run

    def recorded(cmd, **kwargs):  # type: ignore[no-untyped-def]
        if cmd[0] == "fusermount3":
            ran.append(cmd)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(spawn.subprocess, "run", recorded)
    log_file = tmp_path / "mount.log"
    log_fd = os.open(log_file, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=log_fd, stderr=log_fd, pass_fds=(write_end,))
        os.close(write_end)
        with pytest.raises(MountError, match="did not answer within 1 s: stopped"):
            spawn._wait_ready(proc, read_end, log_fd, log_file, 1.0, mountpoint=mnt)
    finally:
        os.close(log_fd)
    assert proc.returncode == -9
    assert ran == [["fusermount3", "-u", "-z", str(mnt)]]
