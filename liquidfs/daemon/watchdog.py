"""A watchdog beside the daemon that aborts its FUSE connection if the daemon is killed and cannot finish dying.

The daemon's notifier thread hands pages to the kernel (``notify_store``) and drops them (``invalidate_inode``);
both lock the file's page-cache folios, and wait, uninterruptibly, for any folio a pending read holds locked until
the daemon answers that read. Killed at that moment (SIGKILL, the OOM killer), the daemon never answers it: the
thread never returns, the process never finishes exiting, its descriptor of /dev/fuse is never closed, and the
kernel never aborts the connection. Every reader of the mount then hangs instead of getting ENOTCONN.

This process is outside that: it polls the daemon and, once it sees it dying (SIGKILL pending, or its main thread
gone while others remain), writes to the connection's ``abort`` file in the fusectl filesystem, which fails every
pending request (readers get ECONNABORTED/ENOTCONN), unlocks the folios and lets the daemon finish. It exits with
the daemon. Needs root (fusectl's files are root's), as does mounting fusectl if nobody has.

    python -m liquidfs.daemon.watchdog PID CONNECTION MOUNT_ID [LOG_FILE]
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from ..sysio import mountinfo, reexec
from ..sysio.safefiles import LogFileHandler

log = logging.getLogger("liquidfs.daemon.watchdog")  # also when run as __main__

FUSECTL = Path("/sys/fs/fuse/connections")
_SIGKILL_BIT = 1 << (9 - 1)
POLL_S = 0.2


def topmost_mount(mountpoint: Path) -> tuple[bytes, int, int] | None:
    """(filesystem type, device, mount id) of what is mounted on top at ``mountpoint``, from /proc/self/mountinfo
    (a stat of a FUSE mount would wait for its daemon), or None."""
    target = as_mountinfo_shows(mountpoint)
    found = None
    for mount_id, device, point, fstype in _mounts():
        if point == target:  # later lines are mounted on top of earlier ones
            found = fstype, device, mount_id
    return found


def as_mountinfo_shows(mountpoint: Path) -> bytes:
    """``mountpoint`` as mountinfo names it: the links of the directories above it resolved (mountinfo shows the
    real path), the last name as it is. Nothing of what is mounted there is touched: a stat of it would wait
    for its daemon, and one that no longer answers would hold the caller for good."""
    # Not abspath: it would drop "link/.." by its text, where the kernel goes up from where the link led.
    given = os.fspath(mountpoint)
    # (getcwd only for a relative one: run from a deleted directory it fails, naming no file)
    path = (given if os.path.isabs(given) else os.path.join(os.getcwd(), given)).rstrip("/") or "/"
    head, last = os.path.split(path)
    if last in ("", ".", ".."):  # a name that is no entry of its own: the directory it names, resolved
        return os.fsencode(os.path.realpath(path))
    return os.fsencode(os.path.join(os.path.realpath(head), last))


def _mounts(table: str = mountinfo.SELF) -> list[tuple[int, int, bytes, bytes]]:
    """(mount id, device, mount point, filesystem type) of every mount this process (or the one whose
    mountinfo ``table`` is named) sees. The device as the kernel numbers it (``kernel_device``): what fusectl
    names a FUSE connection's directory after."""
    return [(m.mount_id, kernel_device(m.major, m.minor), m.point, m.fstype) for m in mountinfo.mounts(table)]


def kernel_device(major: int, minor: int) -> int:
    """A device number as the kernel holds it (``MKDEV``: 20 bits of minor), which is how fusectl names a
    connection (``fc->dev``, printed with %u): a FUSE mount's anonymous device 0:300 is connection 300. glibc's
    ``makedev`` packs the two otherwise above a minor of 255 (0:300 is 1048620), so it names no connection."""
    return major << 20 | minor


def sees_connection(pid: int, connection: int) -> bool:
    """Whether process ``pid``'s mount namespace holds a mount of FUSE ``connection`` (its device); False where
    that cannot be read (the process is gone)."""
    try:
        # A FUSE mount's only: the anonymous device number a connection had is handed to the next mount made
        # once it is gone (a container's tmpfs or overlay), whose processes were named as holding a copy.
        return any(device == connection and fstype.split(b".")[0] == b"fuse"
                   for _, device, _, fstype in _mounts(f"/proc/{pid}/mountinfo"))
    except (OSError, ValueError, IndexError):
        return False


def connection_of(mountpoint: Path) -> int | None:
    """The FUSE connection serving ``mountpoint``: its directory in fusectl is named after the mount's device."""
    found = topmost_mount(mountpoint)
    return found[1] if found is not None else None


def dying(status_texts: list[str]) -> bool:
    """Whether a process is exiting, from the /proc status of its threads (the main thread's first).

    SIGKILL sits in the pending set of each thread until that thread exits; the main thread of a process whose
    other threads are still running shows as a zombie."""
    for i, text in enumerate(status_texts):
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if i == 0 and fields.get("State", "").strip().startswith("Z"):
            return True
        for key in ("SigPnd", "ShdPnd"):
            if int(fields.get(key, "0").strip() or "0", 16) & _SIGKILL_BIT:
                return True
    return False


def _still_ours(pid: int, connection: int, mount_id: int) -> bool:
    """The connection is still the daemon's: it holds /dev/fuse open (a process that finished exiting and waits
    to be reaped holds nothing), and the mount it made is still there. Connection numbers are reused: a later
    mount's must never be aborted."""
    return holds_fuse_device(pid) and any(m[0] == mount_id and m[1] == connection for m in _mounts())


def holds_fuse_device(pid: int) -> bool:
    """Whether process ``pid`` (of this PID namespace) holds /dev/fuse open, as a daemon that serves a mount does.
    Asked per thread: a main thread that has exited shows no descriptors, a stuck thread still does."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        fds = f"/proc/{pid}/task/{tid}/fd"
        try:
            if any(os.readlink(f"{fds}/{fd}") == "/dev/fuse" for fd in os.listdir(fds)):
                return True
        except OSError:
            continue
    return False


def _statuses(pid: int) -> list[str] | None:
    """The status of each thread of ``pid``, the main thread first; None once the process is gone."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=lambda t: t != str(pid))
        return [Path(f"/proc/{pid}/task/{tid}/status").read_text() for tid in tids]
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:  # a thread ended between the listing and the read
        return []


def abort(connection: int) -> bool:
    """Abort a FUSE connection (fails every pending and future request of its mount)."""
    try:
        (FUSECTL / str(connection) / "abort").write_text("1\n")
    except OSError as exc:
        log.warning("cannot abort FUSE connection %d: %s", connection, exc)
        return False
    return True


def ensure_fusectl() -> bool:
    """fusectl is mounted (mounting it if root and it is not); False where it cannot be."""
    if FUSECTL.is_dir() and any(FUSECTL.iterdir()):
        return True
    if os.geteuid() != 0 or not FUSECTL.is_dir():
        return False
    subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSECTL)], capture_output=True, check=False)
    return any(FUSECTL.iterdir())


def mount_ids() -> set[int]:
    """The ids of the mounts this process sees: taken before mounting, for ``start``."""
    return {m[0] for m in _mounts()}


def new_mount(mountpoint: Path, before: set[int]) -> tuple[bytes, int, int] | None:
    """(filesystem type, device, mount id) of the one FUSE mount at ``mountpoint`` that is not in ``before``.

    Whatever is on top at the mount point is not necessarily ours: another mount may be stacked there a moment
    later, and a watchdog that took its connection would abort a stranger's. Ours is the mount that appeared
    while we mounted; if two did (another mount raced ours on the same point), neither is taken."""
    target = as_mountinfo_shows(mountpoint)
    found = [(fstype, device, mount_id) for mount_id, device, point, fstype in _mounts()
             if point == target and mount_id not in before and fstype.startswith(b"fuse")]
    return found[0] if len(found) == 1 else None


def start(pid: int, mountpoint: Path, before: set[int]) -> subprocess.Popen[bytes] | None:
    """Start the watchdog of daemon ``pid`` serving ``mountpoint`` (mounted after ``before`` was taken); None
    where it could do nothing (not root, no fusectl) or cannot tell which connection is ours."""
    found = new_mount(mountpoint, before)
    if found is None:
        log.warning("no watchdog for %s: cannot tell which mount there is ours (another raced it)", mountpoint)
        return None
    if os.geteuid() != 0 or not ensure_fusectl() or not (FUSECTL / str(found[1])).is_dir():
        log.info("no watchdog for %s: fusectl's abort needs root and %s", mountpoint, FUSECTL)
        return None
    # Its own session and cwd "/": nothing of it keeps the mount busy, and a signal to the daemon's group
    # (a terminal's ^C) does not reach it.
    log_file = next((h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)),
                    None)
    _, connection, mount_id = found
    return reexec.popen("liquidfs.daemon.watchdog",
                        [str(pid), str(connection), str(mount_id), *([log_file] if log_file else [])],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        start_new_session=True, close_fds=True)


def watch(pid: int, connection: int, mount_id: int) -> int:
    while True:
        statuses = _statuses(pid)
        if statuses is None or _exited(statuses):
            return 0  # it closed its /dev/fuse: the kernel aborted what was pending itself
        if statuses and dying(statuses):
            # Give a daemon that can exit on its own a moment: only a stuck one needs the abort.
            time.sleep(1.0)
            statuses = _statuses(pid)
            if statuses is not None and not _exited(statuses) and _still_ours(pid, connection, mount_id) \
                    and abort(connection):
                log.warning("the daemon (pid %d) was killed and could not exit (a thread waiting on the kernel "
                            "for a read it will never answer): aborted FUSE connection %d; readers get ENOTCONN",
                            pid, connection)
            return 0
        time.sleep(POLL_S)


def _exited(statuses: list[str]) -> bool:
    """Only the main thread is left, a zombie: the process finished exiting and waits to be reaped."""
    return len(statuses) == 1 and "\nState:\tZ" in "\n" + statuses[0]


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) > 3:  # the daemon's log, so the abort is in it (opened as the daemon opens it: no link)
        try:
            handler: logging.Handler = LogFileHandler(args[3])
        except OSError:
            handler = logging.NullHandler()  # the log was swapped for a link: the watchdog works all the same
        logging.basicConfig(handlers=[handler], level=logging.INFO)
    return watch(int(args[0]), int(args[1]), int(args[2]))


if __name__ == "__main__":
    raise SystemExit(main())
