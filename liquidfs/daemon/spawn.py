"""Starting a mount's daemon: ``liquidfs mount`` (no ``--foreground``) runs itself again, detached and isolated,
and returns once the daemon says the mount answers, or says why it did not from the daemon's lines of its log."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..sysio import reexec
from ..sysio.safefiles import escape_controls, open_append
from .config import MountError


def spawn_daemon(argv: list[str], log_file: Path, timeout: float = 120.0, mountpoint: Path | None = None) -> None:
    """Start ``liquidfs mount --foreground`` detached and wait until it reports the mount answers. ``mountpoint``
    (as mountinfo shows it): where a daemon stopped for not answering may have left a mount."""
    from ..catalog.schema import CatalogError
    from ..catalog.store_dir import make_store_dir

    try:  # (checked before it is made, as a store's directory is)
        make_store_dir(log_file.parent, "give a --log-file where only root and you may write")
    except CatalogError as exc:
        raise MountError(str(exc)) from None
    try:
        # STORE/mount.log is in a directory a store writer may write: a link there to a root-owned startup file
        # is refused, never appended to. Held open to read the daemon's last words from, whatever is at the
        # name by then.
        log_fd = open_append(log_file)
    except OSError as exc:
        # The log is the one file a mount writes in its store: a store read-only to this user mounts with the
        # log elsewhere.
        advice = (" (a store that is read-only to you mounts with --log-file naming a file you can write)"
                  if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "")
        raise MountError(f"cannot write the log {log_file}: {exc.strerror}{advice}") from None
    try:
        # Where this daemon's lines begin: the log keeps every earlier mount's, which say nothing of this one.
        start = os.fstat(log_fd).st_size
        read_end, write_end = os.pipe()
        # Isolated and in / (reexec): a root mount started from a directory someone else can write must not
        # import code from it.
        proc = reexec.popen("liquidfs", [*argv, "--foreground", "--ready-fd", str(write_end)],
                            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                            pass_fds=(write_end,), start_new_session=True)
        os.close(write_end)
        try:
            _wait_ready(proc, read_end, log_fd, log_file, timeout, start, mountpoint)
        except (KeyboardInterrupt, SystemExit):
            # Ctrl-C, SIGTERM (`timeout`, a unit's stop): the daemon in its own session would go on, mount, find
            # nobody to tell, and unmount with a traceback in its log, while a `mount` run again raced it.
            if proc.poll() is None:
                _stop(proc, mountpoint)
            raise
    finally:
        os.close(log_fd)


#: How long a daemon that closed its ready pipe without the mount answering gets to exit: it is on its way out
#: (the pipe closes as its descriptors do, a moment before its exit status exists).
EXIT_WAIT = 10.0
#: Log lines of a failed daemon shown to the user.
SHOWN_LINES = 15


def _wait_ready(proc: subprocess.Popen[bytes], read_end: int, log_fd: int, log_file: Path, timeout: float,
                start: int = 0, mountpoint: Path | None = None) -> None:
    """Return once the daemon says "ready" on ``read_end``; else a MountError whose first line says why (from
    the daemon's lines of the log, those past offset ``start``), then those lines."""
    deadline = time.monotonic() + timeout
    with os.fdopen(read_end, "rb") as ready:
        # EOF without "ready" means the daemon died before the mount answered.
        import select

        while time.monotonic() < deadline:
            readable, _, _ = select.select([ready], [], [], 0.5)
            if readable:
                line = ready.readline()
                if line.startswith(b"ready"):
                    return
                break
            if proc.poll() is not None:
                break
    if time.monotonic() < deadline:
        try:
            proc.wait(EXIT_WAIT)
        except subprocess.TimeoutExpired:
            pass
    lines = _log_since(log_fd, start)
    if lines:
        shown = f"; its lines in {log_file}:\n" + "\n".join(f"  {line}" for line in lines[-SHOWN_LINES:])
    else:
        shown = f"; nothing from it in {log_file}"
    if proc.returncode is None:
        left = _said(_stop, proc, mountpoint)
        what = (f"did not answer within {timeout:.0f} s" if time.monotonic() >= deadline
                else "gave up before the mount answered but did not exit")
        raise MountError(f"the daemon {what}: stopped" + shown + left)
    # Killed outright once it had mounted (the OOM killer, a crash): its mount left dead, ENOTCONN to every reader.
    left = _said(_detach_left, mountpoint)
    ended = (f"was killed by {_signal_name(-proc.returncode)}" if proc.returncode < 0
             else f"exited with status {proc.returncode}")
    status = f"the daemon {ended} before the mount answered" + shown + left
    reason = failure_reason(lines)
    raise MountError(f"{reason}\n{status}" if reason else status)


def _signal_name(signum: int) -> str:
    """SIGKILL, or "signal 40" for one Python has no name for (the real-time signals: a ValueError's traceback)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _said(clean_up: Callable[..., None], *args: object) -> str:
    """``clean_up(*args)``; what it could not do, as a line for the error it comes before (its MountError in the
    error's place lost the daemon's lines, which say why it failed)."""
    try:
        clean_up(*args)
    except MountError as exc:
        return f"\n{exc}"
    return ""


#: How long a daemon asked to stop (SIGTERM) gets to unmount before it is killed: past its own worst shutdown
#: (its other loops' stop alone may take ``loops.STOP_WAIT``, 5 s, before the session closes).
STOP_WAIT = 15.0


def _stop(proc: subprocess.Popen[bytes], mountpoint: Path | None = None) -> None:
    """Stop a daemon that never said ready: SIGTERM first, which unmounts what it may have mounted (its handlers
    are set from the mount on); SIGKILL at once would leave a mount whose daemon is gone (ENOTCONN to every
    reader, until someone unmounts it by hand). Killed if it does not exit; then a liquidfs mount it left at
    ``mountpoint`` (none was there before it started: ``check_mountpoint``) is detached."""
    proc.terminate()
    try:
        proc.wait(STOP_WAIT)
        return
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:  # stuck in the kernel past SIGKILL: its mount is detached all the same
            pass
    _detach_left(mountpoint)


def _detach_left(mountpoint: Path | None) -> None:
    """A liquidfs mount at ``mountpoint`` that a daemon gone before it said ready left (none was there before it
    started: ``check_mountpoint``) detached: its daemon is dead, every reader's access fails with ENOTCONN."""
    if mountpoint is None:
        return
    from . import control, watchdog  # (here: a mount that starts, the common case, reads no mountinfo for it)

    left = watchdog.topmost_mount(mountpoint)
    # Only a dead one: another `liquidfs mount` of the same mount point, run at once, may have mounted there and
    # serve (this daemon then failed for finding its mount point taken); asked from a child, as umount asks.
    if left is not None and left[0] == control.FSTYPE and control.probe_state(mountpoint) == "stale":
        control.clean_stale(mountpoint)  # (MountError where it cannot be)


#: A log record of the daemon's at ERROR or above (``sysio.safefiles.LOG_FORMAT``: date, time, level, logger, message).
_ERROR_RECORD = re.compile(r"\S+ \S+ (?:ERROR|CRITICAL) \S+: (.*)")


def failure_reason(lines: list[str]) -> str | None:
    """The line of a failed daemon's log that says why: fusermount3's or libfuse's own words (they name the
    option or the permission refused; liquidfs only sees "fuse_session_new() failed"), else the daemon's
    one-line error, else its last error record."""
    for line in lines:
        if line.startswith(("fusermount3:", "fusermount:", "fuse:")) and "warning" not in line.lower():
            return line
    prefix = "liquidfs mount: "
    for line in reversed(lines):
        if line.startswith(prefix) and line != prefix + "interrupted":
            return line[len(prefix):]
    for line in reversed(lines):
        found = _ERROR_RECORD.fullmatch(line)
        if found:
            # A record with a traceback is one line, its line breaks escaped: its first and last parts say it.
            parts = found.group(1).split("\\n")
            return parts[0] if len(parts) == 1 else f"{parts[0]}: {parts[-1].strip()}"
    return None


def _log_since(fd: int, start: int, size: int = 64 << 10) -> list[str]:
    """The lines of the log open at ``fd`` past offset ``start`` (its last ``size`` bytes at most)."""
    end = os.fstat(fd).st_size
    begin = max(start, end - size)
    text = os.pread(fd, max(0, end - begin), begin).decode(errors="replace")
    lines = text.splitlines()
    if begin > start and lines:
        lines = lines[1:]  # cut in the middle
    # Shown on the terminal of whoever mounts (root): libfuse's and the daemon's own words are not the log's
    # escaped records, and may carry a name a store or bucket writer chose (escape sequences included).
    return [escape_controls(line) for line in lines if line.strip()]
