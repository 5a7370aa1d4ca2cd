"""The starter of a mount's daemon (``daemon.spawn``): a daemon that never says ready is stopped the way that
unmounts what it mounted, not killed at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from liquidfs.daemon import control, spawn
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


def _waited_for(tmp_path: Path, script: str, timeout: float, mountpoint: Path | None = None
                ) -> tuple[subprocess.Popen[bytes], pytest.ExceptionInfo[MountError], Path]:
    """``script`` run as a daemon whose readiness ``_wait_ready`` waits for (it fails: none ever says ready): the
    process, the MountError and the log file."""
    log_file = tmp_path / "mount.log"
    log_fd = os.open(log_file, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=log_fd, stderr=log_fd, pass_fds=(write_end,))
        os.close(write_end)
        with pytest.raises(MountError) as refused:
            spawn._wait_ready(proc, read_end, log_fd, log_file, timeout, mountpoint=mountpoint)
    finally:
        os.close(log_fd)
    return proc, refused, log_file


def test_a_daemon_that_never_answers_gets_sigterm_first(tmp_path: Path) -> None:
    proc, refused, log_file = _waited_for(tmp_path, STALLED, 2.0)
    assert refused.match("did not answer within 2 s: stopped")
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
    monkeypatch.setattr(control, "probe_state", lambda path: "stale")  # its daemon is dead
    ran: list[list[str]] = []
    real_run = subprocess.run

    def recorded(cmd, **kwargs):  # type: ignore[no-untyped-def]
        if cmd[0] == "fusermount3":
            ran.append(cmd)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(spawn.subprocess, "run", recorded)
    proc, refused, _ = _waited_for(tmp_path, STUCK, 1.0, mnt)
    assert refused.match("did not answer within 1 s: stopped")
    assert proc.returncode == -9
    assert ran == [["fusermount3", "-u", "-z", str(mnt)]]


#: A daemon killed outright once it had mounted (the OOM killer): gone before it said ready.
KILLED = """
import os, signal
print("mounted", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_daemon_killed_outright_before_ready_has_its_dead_mount_detached_and_the_signal_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from liquidfs.daemon import watchdog

    mnt = tmp_path / "mnt"
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (b"fuse.liquidfs", 99, 7) if path == mnt else None)
    monkeypatch.setattr(control, "probe_state", lambda path: "stale")  # its daemon is dead
    ran: list[list[str]] = []
    monkeypatch.setattr(spawn.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, "", ""))
    _, refused, _ = _waited_for(tmp_path, KILLED, 30.0, mnt)
    assert refused.match("the daemon was killed by SIGKILL before the mount answered")
    assert ran == [["fusermount3", "-u", "-z", str(mnt)]]


def test_a_daemon_killed_by_a_signal_python_has_no_name_for_is_said(tmp_path: Path) -> None:
    """A real-time signal (34-64): ``signal.Signals(40)`` raised ValueError, a traceback on the user's terminal
    in place of the daemon's lines."""
    rt = signal.SIGRTMIN + 6
    _, refused, _ = _waited_for(tmp_path, f"import os\nos.kill(os.getpid(), {int(rt)})", 30.0)
    assert refused.match(f"the daemon was killed by signal {int(rt)} before the mount answered")


def test_an_interrupted_mount_stops_the_daemon_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or SIGTERM, `timeout`) of `liquidfs mount` while its daemon starts: the daemon, in a session of its
    own, is stopped as one that never answers is, never left to mount for nobody."""
    started: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.append(popen([sys.executable, "-c", STALLED], stdout=kwargs["stdout"], stderr=kwargs["stderr"]))
        return started[-1]

    monkeypatch.setattr(spawn.reexec, "popen", recorded)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(spawn, "_wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        spawn.spawn_daemon(["mount", "x", "y"], tmp_path / "mount.log")
    assert started[0].returncode is not None  # stopped (SIGTERM), not left running


def test_a_dead_mount_that_cannot_be_detached_is_said_after_the_daemons_own_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from liquidfs.daemon import watchdog

    mnt = tmp_path / "mnt"
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (b"fuse.liquidfs", 99, 7) if path == mnt else None)
    monkeypatch.setattr(control, "probe_state", lambda path: "stale")  # its daemon is dead
    monkeypatch.setattr(spawn.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "fusermount3: entry for mnt not found"))
    _, refused, _ = _waited_for(tmp_path, KILLED, 30.0, mnt)
    message = str(refused.value)
    assert "killed by SIGKILL" in message and "  mounted" in message  # the daemon's lines kept
    assert message.endswith("could not be unmounted: fusermount3: entry for mnt not found")


def test_a_failed_daemon_never_detaches_a_live_mount_another_mount_made_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `liquidfs mount` of one mount point at once: the second's daemon fails (its mount point taken by the
    first's mount), and its exit must leave the first's mount, which answers, serving its readers."""
    from liquidfs.daemon import watchdog

    mnt = tmp_path / "mnt"
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (b"fuse.liquidfs", 99, 7) if path == mnt else None)
    monkeypatch.setattr(control, "probe_state", lambda path: "answers")
    ran: list[list[str]] = []
    monkeypatch.setattr(spawn.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, "", ""))
    _, refused, _ = _waited_for(tmp_path, "import sys; print('no longer the directory mount checked'); sys.exit(1)",
                                30.0, mnt)
    assert refused.match("exited with status 1") and ran == []


def test_a_log_directory_made_through_another_users_link_is_refused_before_it_is_made(tmp_path: Path) -> None:
    """``--log-file ~bob/logs/new/mount.log`` as root, ``logs`` a link of bob's to a directory of root's: the
    command made ``new`` there, root's, before anything was checked."""
    if os.geteuid() != 0:
        pytest.fail("root's checks are tested as root runs them") if os.environ.get("CI") else \
            pytest.skip("needs root to give a directory away")
    bob, target = tmp_path / "bob", tmp_path / "target"
    bob.mkdir()
    target.mkdir()
    os.chown(bob, 65534, 65534)
    (bob / "logs").symlink_to(target)
    os.lchown(bob / "logs", 65534, 65534)
    with pytest.raises(MountError, match="uid 65534"):
        spawn.spawn_daemon(["mount", "x", "y"], bob / "logs" / "new" / "mount.log")
    assert list(target.iterdir()) == []
