"""A mount seen from outside its daemon: whether a mount point can be mounted on (a stale mount cleaned), the
control file a running mount answers (``read_control``), and ``liquidfs umount`` (who holds a busy mount, in this
mount namespace and in others)."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..catalog.nodes import CONTROL_NAME
from ..sysio.privileges import has_cap_sys_admin
from ..sysio.safefiles import escape_controls
from . import watchdog
from .config import MountError

log = logging.getLogger(__name__)

#: ``liquidfs umount --timeout``: seconds to wait for the daemon to exit once unmounted.
UNMOUNT_TIMEOUT = 30.0
#: Seconds ``unmount`` (and ``check_mountpoint``, for a FUSE mount already there) waits for a mount's daemon to
#: answer a statfs before it says the daemon is stuck.
ANSWER_TIMEOUT = 10.0


def is_stale(mountpoint: Path) -> bool:
    """A FUSE mount whose daemon is gone: every access that reaches it fails with ENOTCONN."""
    try:
        # statfs always reaches the daemon; a stat of the root may be answered from cached attributes.
        os.statvfs(mountpoint)
    except OSError as exc:
        # ENOTCONN, or ECONNABORTED for the first access after the daemon died (newer kernels)
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def clean_stale(mountpoint: Path) -> None:
    """A stale mount detached; MountError where fusermount3 could not (a user's `umount` of root's mount): its
    result was dropped, and `umount` said nothing and exited 0 over a mount still there."""
    log.warning("%s is a stale mount (its daemon died); unmounting it lazily", mountpoint)
    done = subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        why = done.stderr.strip() or f"fusermount3 exited with status {done.returncode}"
        raise MountError(f"{mountpoint} is a stale mount (its daemon died) and could not be unmounted: {why}")


#: Links followed to a mount point at most, as the kernel follows them (ELOOP past it).
MAX_LINKS = 40


def mount_point_named(path: Path) -> Path:
    """``path`` as mountinfo shows a mount on it: the links above it resolved, and the last name read where it
    is a link nothing is mounted on (a mount point named by a link to it). What is mounted there is never
    touched: a stat of its root would wait for its daemon, and one stuck would hold the caller for good."""
    shown = Path(os.fsdecode(watchdog.as_mountinfo_shows(path)))
    for _ in range(MAX_LINKS + 1):  # the path given, then each of the links it leads through
        if watchdog.topmost_mount(shown) is not None or not os.path.islink(shown):
            return shown
        shown = Path(os.fsdecode(watchdog.as_mountinfo_shows(shown.parent / os.readlink(shown))))
    raise MountError(f"{path}: too many levels of links")


def check_mountpoint(mountpoint: Path) -> tuple[int, int]:
    """Refuse what cannot be mounted on, with a message that says what to do; clean a stale mount. The mount
    point's (device, inode), which the daemon mounts on only if it is still there (``still_the_mount_point``).

    A FUSE mount already there is asked its statfs from a child process (``_probe``), never from this one: a
    mount whose daemon is stuck would hold `liquidfs mount` in the kernel for good, as it holds any reader."""
    if _fuse_mounted(mountpoint):
        state, _ = _probe(mountpoint, ANSWER_TIMEOUT, control=False)
        if state == "stale":
            clean_stale(mountpoint)
        elif state == "silent":
            raise MountError(f"{mountpoint}: a FUSE mount is there whose daemon answered nothing in "
                             f"{ANSWER_TIMEOUT:.0f} s (stuck?); `liquidfs umount --lazy {mountpoint}` (a liquidfs "
                             "mount) or `fusermount3 -u -z` detaches it")
    if not mountpoint.exists():
        raise MountError(f"mount point {mountpoint} does not exist (mkdir it first)")
    if not mountpoint.is_dir():
        raise MountError(f"mount point {mountpoint} is not a directory")
    if _fuse_mounted(mountpoint):
        raise MountError(f"{mountpoint} is already mounted; run `liquidfs umount {mountpoint}` first")
    if not _empty(mountpoint):
        raise MountError(f"mount point {mountpoint} is not empty")
    st = os.stat(mountpoint)
    return st.st_dev, st.st_ino


def check_metrics_listen(port: int | None, address: str) -> None:
    """Refuse a --metrics-port that cannot be listened on (taken, an address not this host's), said here before
    a catalog is built and a mount made: the daemon binds it only once mounted, and then it is its last words.
    A port taken between this check and the daemon's bind still fails the mount, in the daemon's log."""
    if not port:  # none, or 0: any free port
        return
    # Bound as trio's open_tcp_listeners binds the daemon's: each address apart (IPv6 ones IPv6 only), a family
    # this host lacks skipped, one bound enough.
    try:
        found = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:  # socket.gaierror: a name that does not resolve
        raise MountError(f"--metrics-port {port}: cannot listen on {address}: {exc.strerror or exc}") from None
    refused: OSError | None = None
    bound = False
    for family, kind, proto, _, where in found:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError as exc:
            if exc.errno == errno.EAFNOSUPPORT:
                continue
            refused = exc
            continue
        with probe:
            try:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(where)
                bound = True
            except OSError as exc:
                refused = exc
    if refused is not None or not bound:
        why = refused.strerror if refused is not None and refused.strerror else str(refused or "no address")
        raise MountError(f"--metrics-port {port}: cannot listen on {address}: {why}")


def _empty(directory: Path) -> bool:
    with os.scandir(directory) as entries:  # closed at once, not when collected
        return next(entries, None) is None


def still_the_mount_point(mountpoint: Path, seen: tuple[int, ...]) -> None:
    """Right before the mount: ``mountpoint`` is the directory the command checked (``seen``; a first mount scans
    the source for minutes in between), and empty. mount(2) follows a link, and root mounts it: a user who may
    write the directory above could otherwise swap the mount point for a link to /etc and have a dataset of
    theirs mounted over it."""
    try:
        # Not followed: the mount point is named with its links resolved (``mount_point_named``), so a link
        # there now is one put in its place since.
        st = os.stat(mountpoint, follow_symlinks=False)
        empty = stat.S_ISDIR(st.st_mode) and _empty(mountpoint)
    except OSError as exc:
        raise MountError(f"mount point {mountpoint}: {exc.strerror} (it was there when `liquidfs mount` checked "
                         "it)") from None
    if not stat.S_ISDIR(st.st_mode) or (seen and (st.st_dev, st.st_ino) != tuple(seen)):
        raise MountError(f"mount point {mountpoint} is no longer the directory `liquidfs mount` checked "
                         "(replaced meanwhile): not mounted")
    if not empty:
        raise MountError(f"mount point {mountpoint} is not empty")


def _fuse_mounted(mountpoint: Path) -> bool:
    """A FUSE filesystem is mounted on ``mountpoint`` (the topmost mount there).

    Any other mount is fine to mount over: in a container the mount point is itself a volume (a bind mount or
    an emptyDir) shared back to the host.
    """
    found = watchdog.topmost_mount(mountpoint)
    return found is not None and found[0].startswith(b"fuse")


#: Where fusermount3 reads whether users other than root may mount with allow_other.
FUSE_CONF = Path("/etc/fuse.conf")


def check_allow_other(allow_other: bool, options: list[str]) -> None:
    """Refuse an allow_other mount that fusermount3 will refuse (a user's, without ``user_allow_other`` in
    fuse.conf): said here, before a catalog is built and a daemon started, not as the daemon's last words."""
    if not (allow_other or "allow_other" in options) or os.geteuid() == 0 or _has_cap_sys_admin():
        return  # root, or CAP_SYS_ADMIN: libfuse mounts without fusermount3
    try:
        lines = FUSE_CONF.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    except OSError:
        return  # fusermount3 (setuid root) reads what this user cannot: it decides
    if "user_allow_other" not in (line.split("#", 1)[0].strip() for line in lines):  # as fusermount3 reads it
        raise MountError(f"--allow-other: fusermount3 allows it to a user other than root only where {FUSE_CONF} "
                         "has a line user_allow_other (ask root to add it), or mount as root")


def _has_cap_sys_admin() -> bool:
    try:
        return has_cap_sys_admin(Path("/proc/self/status").read_text())
    except OSError:
        return False


#: The most bytes a control file is read for (``read_control``).
CONTROL_MAX_BYTES = 1 << 20


def read_control(mountpoint: Path) -> dict[str, object]:
    # Any user can mount a FUSE filesystem of type fuse.liquidfs (-o subtype): what its file holds is read
    # no further than a control file's size (a few hundred bytes) allows.
    return _control_values(mountpoint, _control_text(mountpoint))


def _control_text(mountpoint: Path) -> bytes:
    # Any user can mount a fuse.liquidfs: its control file may be a link (to /dev/watchdog, whose open by root
    # arms a reset; to a file only root may read, which `stats` would print), or a FIFO. Only a regular file of
    # the mount itself is read.
    fd = os.open(mountpoint / os.fsdecode(CONTROL_NAME),
                 os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "the control file is no regular file: not a liquidfs mount's",
                          os.fspath(mountpoint))
        os.set_blocking(fd, True)
        return f.read(CONTROL_MAX_BYTES + 1)


def read_control_within(mountpoint: Path, timeout: float = ANSWER_TIMEOUT) -> dict[str, object]:
    """``read_control``, asked from a child process (``_in_child``, as ``_probe`` asks): TimeoutError where the
    mount answers nothing within ``timeout`` seconds. Read in this process, a mount whose daemon is stuck held
    `liquidfs stats` in the kernel for good, past SIGKILL, and a pod's liveness probe (`stats --probe`) left one
    such process behind at each try."""
    def read() -> bytes:
        try:
            return b"+" + _control_text(mountpoint)
        except OSError as exc:
            return b"-%d" % (exc.errno or errno.EIO)

    said = _in_child(read, timeout)
    if said is None:
        raise TimeoutError(errno.ETIMEDOUT, f"its daemon answered nothing in {timeout:.0f} s", os.fspath(mountpoint))
    if said[:1] == b"-" and said[1:].isdigit():
        code = int(said[1:])
        raise OSError(code, os.strerror(code), os.fspath(mountpoint))
    if said[:1] != b"+":
        raise OSError(errno.EIO, "the control file could not be read", os.fspath(mountpoint))
    return _control_values(mountpoint, said[1:])


def _in_child(work: Callable[[], bytes], timeout: float) -> bytes | None:
    """What ``work()`` returns, run in a child process (b"" where the child ended without saying: it failed, or
    was killed); None where it says nothing within ``timeout`` seconds. A statfs or a read of a mount whose
    daemon is stuck waits in the kernel for good, past SIGKILL once the daemon has read the request: the child is
    left behind (killed, reaped by init when it can be), and this process can still exit."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: works, says, and ends without running anything of the parent's
        code = 0
        try:
            os.close(read_end)
            view = memoryview(work())
            while view:
                view = view[os.write(write_end, view):]
        except BaseException:  # noqa: BLE001  (the child ends here, whatever happened: never in the parent's code)
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    parts: list[bytes] = []
    try:
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(child, signal.SIGKILL)  # not waited for: a child stuck in the kernel is reaped by init
                return None
            part = os.read(read_end, 1 << 16)
            if not part:
                break
            parts.append(part)
    finally:
        os.close(read_end)
    _, status = os.waitpid(child, 0)
    # Ended without saying (killed, failed): no answer, but not a silent mount.
    return b"".join(parts) if status == 0 else b""


def _control_values(mountpoint: Path, text: bytes) -> dict[str, object]:
    """The statistics a control file's ``text`` holds; ValueError where it holds none of ours."""
    if len(text) > CONTROL_MAX_BYTES:
        raise ValueError(f"{mountpoint}: the control file holds more than a control file does")
    try:
        values = json.loads(text)
    except RecursionError:  # nested past the interpreter's stack
        raise ValueError(f"{mountpoint}: the control file holds no control file's JSON") from None
    if not isinstance(values, dict):
        raise ValueError(f"{mountpoint}: the control file holds no object")
    return values


def holders(mountpoint: Path) -> list[str]:
    """Processes with a file, cwd or root inside ``mountpoint`` (what fuser -m would show). ``mountpoint`` as
    mountinfo shows it (``mount_point_named``): a resolve() would stat the mount's root, and wait for a daemon
    that may answer nothing."""
    prefix = os.fspath(mountpoint)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        paths = []
        for link in ("cwd", "root"):
            try:
                paths.append(os.readlink(f"/proc/{pid}/{link}"))
            except OSError:
                pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
        if any(p == prefix or p.startswith(prefix + "/") for p in paths):
            found.append(_named(pid))
    return found


def _named(pid: str | int) -> str:
    """``pid`` and its command line, for a message."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = "?"
    return f"{pid} {escape_controls(cmd.strip())}"


#: Seconds between scans of /proc for copies of the mount while ``unmount`` waits for the daemon.
NAMESPACE_SCAN_S = 0.5
#: Processes named per mount namespace that holds a copy of a mount (a container's every process would).
NAMED_PER_NAMESPACE = 3


def namespace_holders(connection: int) -> list[str]:
    """Processes in other mount namespaces whose copy of the mounts holds FUSE ``connection`` (``unshare
    --mount``, a container started while it was mounted): the kernel keeps the connection, and so its daemon,
    while any copy of the mount lives, whatever is unmounted here."""
    try:
        own = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return []
    holds: dict[str, bool] = {}  # each namespace's mountinfo read once, from its first process seen
    found: dict[str, list[str]] = {}
    for pid in sorted(filter(str.isdigit, os.listdir("/proc")), key=int):
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            continue
        if namespace == own:
            continue
        if namespace not in holds:
            holds[namespace] = watchdog.sees_connection(int(pid), connection)
        named = found.setdefault(namespace, [])
        if holds[namespace] and len(named) < NAMED_PER_NAMESPACE:
            named.append(f"{_named(pid)} (mount namespace {namespace})")
    return [line for named in found.values() for line in named]


#: The filesystem type of a liquidfs mount in /proc/self/mountinfo (``fuse_options``: subtype=liquidfs).
FSTYPE = b"fuse.liquidfs"


def unmount(mountpoint: Path, *, lazy: bool = False, timeout: float = UNMOUNT_TIMEOUT) -> None:
    # What is mounted there, from mountinfo: a stat would wait for a hung daemon. Only a liquidfs mount is
    # unmounted: fusermount3 run by root unmounts any FUSE filesystem, someone else's included, so it is
    # given the path checked (the links above it resolved), not one a link could have moved since.
    mountpoint = mount_point_named(mountpoint)
    found = watchdog.topmost_mount(mountpoint)
    if found is None:
        if not os.path.lexists(mountpoint):
            raise MountError(f"{mountpoint} does not exist")
        raise MountError(f"{mountpoint} is not mounted")
    if found[0] != FSTYPE:
        raise MountError(f"{mountpoint} is a {os.fsdecode(found[0])} mount, not a liquidfs mount: left mounted "
                         "(unmount it with what mounted it)")
    pid = None
    if not lazy:  # --lazy touches nothing of the mount: its daemon may answer nothing any more
        state, pid = _probe(mountpoint, ANSWER_TIMEOUT)
        if state == "stale":
            clean_stale(mountpoint)
            return
        if state == "silent":
            raise MountError(f"{mountpoint}: its daemon answered nothing in {ANSWER_TIMEOUT:.0f} s (stuck?); "
                             f"`liquidfs umount --lazy {mountpoint}` detaches the mount now")
        # Asked for as long as its daemon took to answer (seconds, where any user's fuse.liquidfs chooses): what
        # is there must still be the mount checked, or root's fusermount3 unmounts whatever is there by then
        # (a directory above swapped for a link: another mount of the same last name).
        if watchdog.topmost_mount(mountpoint) != found:
            raise MountError(f"{mountpoint}: what is mounted there changed while its daemon was asked; nothing "
                             "was unmounted (run umount again)")
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        msg = done.stderr.strip()
        if "busy" in msg.lower():
            who = holders(mountpoint)
            raise MountError(
                f"{mountpoint} is busy; held by:\n  " + "\n  ".join(who or ["(unknown)"])
                + "\nclose those, or use `liquidfs umount --lazy` to detach it now and finish when they let go"
            )
        raise MountError(f"fusermount3 failed: {msg}")
    if pid is not None and not lazy:
        deadline = time.monotonic() + timeout
        scan_at = time.monotonic() + NAMESPACE_SCAN_S
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            elsewhere: list[str] = []
            if time.monotonic() >= scan_at:  # a scan of every process: not at each poll, nor before the daemon
                scan_at = time.monotonic() + NAMESPACE_SCAN_S  # had its moment to exit
                elsewhere = namespace_holders(found[1])
            if elsewhere:  # the daemon serves that copy until its last holder goes: waiting would not help
                raise MountError(
                    f"unmounted here, but the daemon (pid {pid}) still serves a copy of the mount in another mount "
                    "namespace, held by:\n  " + "\n  ".join(elsewhere)
                    + "\nit exits once those end (or unmount it in their namespace)")
            time.sleep(0.05)
        raise MountError(f"unmounted, but the daemon (pid {pid}) is still running after {timeout:.0f} s")


def _probe(mountpoint: Path, timeout: float, control: bool = True) -> tuple[str, int | None]:
    """("stale", None): its daemon is gone; ("answers", the daemon's pid from its control file, None where that
    does not say or ``control`` is False: its statfs alone is asked); or ("silent", None): no answer within
    ``timeout`` seconds. Asked from a child process (``_in_child``): a mount whose daemon is stuck would hold
    this one in the kernel for good."""
    def ask() -> bytes:
        if is_stale(mountpoint):
            return b"stale"
        if not control:
            return b"answers"
        try:
            return f"answers {int(str(read_control(mountpoint)['pid']))}".encode()
        except (OSError, ValueError, KeyError):
            return b"answers -"

    answer = _in_child(ask, timeout)
    if answer is None:
        return "silent", None
    said = answer.decode(errors="replace")
    if said == "stale":
        return "stale", None
    if not control:
        return "answers", None
    pid = said.removeprefix("answers ")
    if not pid.isdigit():
        log.warning("%s: its control file does not answer; unmounting without waiting for its daemon", mountpoint)
        return "answers", None
    if not watchdog.holds_fuse_device(int(pid)):
        # The mount's word (any user can mount a fuse.liquidfs that names pid 1), or a daemon of another PID
        # namespace (a sidecar's): nothing here to wait for.
        log.info("%s: its control file names pid %s, which serves no FUSE mount here; unmounting without waiting "
                 "for its daemon", mountpoint, pid)
        return "answers", None
    return "answers", int(pid)


def probe_state(mountpoint: Path) -> str:
    """"stale", "answers" or "silent": whether the mount's daemon is gone, answers a statfs, or answers nothing
    within ``ANSWER_TIMEOUT`` (asked from a child, ``_probe``)."""
    return _probe(mountpoint, ANSWER_TIMEOUT, control=False)[0]


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a container's PID 1 may never reap the detached daemon)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
