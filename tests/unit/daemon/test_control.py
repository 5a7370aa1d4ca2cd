"""What ``liquidfs umount`` and ``stats`` read of a mount (``daemon.control``): nothing of a mount that may not
answer where it need not be touched, and no more of a control file than one holds."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from liquidfs.catalog.nodes import CONTROL_NAME
from liquidfs.daemon import control, watchdog


def test_a_control_file_is_read_no_further_than_one_holds(tmp_path: Path) -> None:
    """Any user can mount a FUSE filesystem of type fuse.liquidfs, and root's `liquidfs stats` or `umount` reads
    its control file: an endless or deeply nested one is refused as a ValueError (one line), never read whole
    or a traceback."""
    control_file = tmp_path / os.fsdecode(CONTROL_NAME)
    control_file.write_text(json.dumps({"pid": 12}))
    assert control.read_control(tmp_path) == {"pid": 12}
    control_file.write_bytes(b'{"pad": "' + b"x" * control.CONTROL_MAX_BYTES + b'"}')
    with pytest.raises(ValueError, match="more than a control file"):
        control.read_control(tmp_path)
    control_file.write_bytes(b"[" * (control.CONTROL_MAX_BYTES // 2) + b"]" * (control.CONTROL_MAX_BYTES // 2))
    with pytest.raises(ValueError):
        control.read_control(tmp_path)


def test_a_lazy_umount_touches_nothing_of_the_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`umount --lazy` is how a mount whose daemon answers nothing any more is cleared: a statfs or a read of
    its control file would hold the command in the kernel for good. fusermount3 is given the path checked,
    the links above it resolved."""
    real = tmp_path / "real"
    (real / "mnt").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    seen: list[bytes] = []

    def topmost(path: Path) -> tuple[bytes, int, int]:
        seen.append(os.fsencode(path))
        return control.FSTYPE, 300, 1

    def touched(*args: object) -> None:
        raise AssertionError("the mount was touched")

    ran: list[list[str]] = []
    monkeypatch.setattr(watchdog, "topmost_mount", topmost)
    monkeypatch.setattr(control, "is_stale", touched)
    monkeypatch.setattr(control, "read_control", touched)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    control.unmount(tmp_path / "link" / "mnt", lazy=True)
    assert seen and set(seen) == {os.fsencode(real / "mnt")}
    assert ran == [["fusermount3", "-u", "-z", str(real / "mnt")]]
    # The mount point named by a link to it: the link is read, not followed into the mount.
    (tmp_path / "to-mnt").symlink_to("link/mnt")
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: topmost(path) if path == real / "mnt" else None)
    seen.clear()
    ran.clear()
    control.unmount(tmp_path / "to-mnt", lazy=True)
    assert ran == [["fusermount3", "-u", "-z", str(real / "mnt")]]


@pytest.mark.parametrize("stuck_at", ["is_stale", "read_control"])
def test_umount_of_a_mount_whose_daemon_answers_nothing_says_so_and_how_to_detach_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stuck_at: str) -> None:
    """A statfs or a read of a mount whose daemon is stuck waits in the kernel for good (past SIGKILL once the
    daemon has read the request): `liquidfs umount` asks them from a child process, and past its time says
    the daemon answers nothing and that --lazy detaches it, running nothing else; the child is left behind."""
    (tmp_path / "mnt").mkdir()
    asked = tmp_path / "asked"

    def stuck(path: Path) -> object:
        asked.touch()
        time.sleep(30)  # killed long before
        return {"pid": 1} if stuck_at == "read_control" else False

    ran: list[list[str]] = []
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (control.FSTYPE, 300, 1))
    monkeypatch.setattr(control, "is_stale", lambda path: False)
    monkeypatch.setattr(control, "read_control", lambda path: {"pid": 1})
    monkeypatch.setattr(control, stuck_at, stuck)
    monkeypatch.setattr(control, "ANSWER_TIMEOUT", 0.5)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    started = time.monotonic()
    with pytest.raises(control.MountError, match=r"answered nothing in 0 s.*umount --lazy"):
        control.unmount(tmp_path / "mnt")
    assert asked.exists() and ran == [] and time.monotonic() - started < 20


def test_a_daemon_that_answers_is_waited_for_by_its_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's answer reaches the parent: the daemon's pid, then fusermount3, then the wait for that pid."""
    (tmp_path / "mnt").mkdir()
    ran: list[list[str]] = []
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (control.FSTYPE, 300, 1))
    monkeypatch.setattr(control, "is_stale", lambda path: False)
    monkeypatch.setattr(control, "read_control", lambda path: {"pid": 424242})
    waited: list[int] = []
    monkeypatch.setattr(control, "_alive", lambda pid: waited.append(pid) or False)
    monkeypatch.setattr(watchdog, "holds_fuse_device", lambda pid: pid == 424242)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    control.unmount(tmp_path / "mnt")
    assert ran == [["fusermount3", "-u", str(tmp_path / "mnt")]] and waited == [424242]
    monkeypatch.setattr(control, "read_control", lambda path: {"pid": 1})  # a pid that serves no FUSE mount
    control.unmount(tmp_path / "mnt")
    assert len(ran) == 2 and waited == [424242]  # unmounted, nothing waited for


def test_mount_over_a_fuse_mount_whose_daemon_answers_nothing_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`liquidfs mount` asks a FUSE mount already at its mount point whether its daemon is gone from a child
    process: one whose daemon is stuck is named, with how to detach it, instead of holding the command in the
    kernel for good; a stale one is cleaned, one that answers is already mounted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    asked = tmp_path / "asked"

    def stuck(path: Path) -> bool:
        asked.touch()
        time.sleep(30)  # killed long before
        return False

    cleaned: list[Path] = []
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (b"fuse.sshfs", 300, 1))
    monkeypatch.setattr(control, "is_stale", stuck)
    monkeypatch.setattr(control, "clean_stale", cleaned.append)
    monkeypatch.setattr(control, "ANSWER_TIMEOUT", 0.5)
    started = time.monotonic()
    with pytest.raises(control.MountError, match=r"answered nothing in 0 s.*umount --lazy .*fusermount3 -u -z"):
        control.check_mountpoint(mnt)
    assert asked.exists() and cleaned == [] and time.monotonic() - started < 20
    monkeypatch.setattr(control, "is_stale", lambda path: False)
    with pytest.raises(control.MountError, match="already mounted"):
        control.check_mountpoint(mnt)
    # A stale mount is cleaned; then nothing FUSE is there, and the empty directory is mounted on.
    monkeypatch.setattr(control, "is_stale", lambda path: True)
    monkeypatch.setattr(control, "clean_stale", lambda path: cleaned.append(path) or monkeypatch.setattr(
        watchdog, "topmost_mount", lambda path: (b"ext4", 2, 1)))
    control.check_mountpoint(mnt)
    assert cleaned == [mnt]


def test_a_mount_point_is_found_through_as_many_links_as_the_kernel_follows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 links lead to it (the kernel's limit); one more is a loop's message, never a hang."""
    (tmp_path / "mnt").mkdir()
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: None)
    previous = tmp_path / "mnt"
    for i in range(control.MAX_LINKS):
        link = tmp_path / f"l{i}"
        link.symlink_to(previous.name)
        previous = link
    assert control.mount_point_named(previous) == tmp_path / "mnt"
    (tmp_path / "one-more").symlink_to(previous.name)
    with pytest.raises(control.MountError, match="too many levels of links"):
        control.mount_point_named(tmp_path / "one-more")


def test_the_daemon_mounts_only_on_the_directory_the_command_checked(tmp_path: Path) -> None:
    """Between the command's check and the mount a first mount scans the source (minutes): a mount point swapped
    meanwhile for a link to another directory (root's mount(2) follows it: /etc, say), or even to the very
    directory checked, moved (mountinfo would then show another path than the one umount and the watchdog know),
    or filled, is refused. The mount point is named with its links resolved: a link there is one put since."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    seen = control.check_mountpoint(mnt)
    control.still_the_mount_point(mnt, seen)
    mnt.rename(tmp_path / "moved")
    mnt.symlink_to(tmp_path / "moved")
    with pytest.raises(control.MountError, match="no longer the directory"):
        control.still_the_mount_point(mnt, seen)
    mnt.unlink()
    (tmp_path / "moved").rename(mnt)
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    mnt.rmdir()
    mnt.symlink_to(elsewhere)
    assert not any(elsewhere.iterdir())  # empty too: only its identity tells it from the one checked
    with pytest.raises(control.MountError, match="no longer the directory `liquidfs mount` checked"):
        control.still_the_mount_point(mnt, seen)
    mnt.unlink()
    with pytest.raises(control.MountError, match="it was there when"):
        control.still_the_mount_point(mnt, seen)
    mnt.mkdir()
    (mnt / "file").write_text("x")
    with pytest.raises(control.MountError, match="not empty"):
        control.still_the_mount_point(mnt, ())


def test_a_metrics_port_that_cannot_be_listened_on_is_refused_before_the_mount() -> None:
    """The daemon binds it once mounted: a port taken was an exception group's traceback on a terminal, or
    "uncaught exception: +----" as the daemon's last words. Said by the command, in one line, first."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(control.MountError, match=rf"--metrics-port {port}: cannot listen on 127.0.0.1: "):
            control.check_metrics_listen(port, "127.0.0.1")
        if socket.has_ipv6:  # IPv6 only, as trio binds it: the IPv4 listener on that port is no obstacle
            try:
                control.check_metrics_listen(port, "::1")
            except control.MountError as exc:
                assert "Cannot assign requested address" in str(exc), exc  # no ::1 on this host
    control.check_metrics_listen(port, "127.0.0.1")  # free again
    control.check_metrics_listen(0, "127.0.0.1")  # any port
    control.check_metrics_listen(None, "127.0.0.1")
    with pytest.raises(control.MountError, match="cannot listen on no-such-host.invalid"):
        control.check_metrics_listen(9100, "no-such-host.invalid")


def test_one_error_of_the_loops_nurseries_is_raised_as_itself() -> None:
    from liquidfs.daemon.serve import _only_leaf

    taken = OSError(98, "Address already in use")
    assert _only_leaf(ExceptionGroup("outer", [ExceptionGroup("inner", [taken])])) is taken
    two = ExceptionGroup("two", [taken, ValueError("x")])
    assert _only_leaf(two) is two and _only_leaf(taken) is taken


def test_the_holders_of_a_busy_mount_are_found_without_touching_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolve() of the mount point stats the mount's root: with a daemon that answers nothing, `liquidfs
    umount` would hang where it should name who holds the mount."""
    import subprocess
    import sys

    inside = tmp_path / "mnt"
    (inside / "sub").mkdir(parents=True)

    def touched(self: Path, strict: bool = False) -> Path:
        raise AssertionError("the mount point was resolved")

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=inside / "sub")
    try:
        monkeypatch.setattr(Path, "resolve", touched)
        found = control.holders(inside)
    finally:
        holder.kill()
        holder.wait()
    assert any(line.startswith(f"{holder.pid} ") for line in found), found


def test_a_stale_mount_that_cannot_be_detached_is_said_never_a_silent_success(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`liquidfs umount` of a dead mount ran fusermount3 and dropped its result: a user's umount of root's mount
    (refused) said nothing and exited 0 over a mount still there."""
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (control.FSTYPE, 300, 1))
    monkeypatch.setattr(control, "_probe", lambda path, timeout, control=True: ("stale", None))
    ran: list[list[str]] = []

    def refused(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", f"fusermount3: entry for {mnt} not found in /etc/mtab")

    monkeypatch.setattr(control.subprocess, "run", refused)
    with pytest.raises(control.MountError, match="stale mount .* could not be unmounted: fusermount3: entry"):
        control.unmount(mnt)
    assert ran and ran[0][:3] == ["fusermount3", "-u", "-z"]


def test_statistics_are_read_from_a_child_and_a_mount_that_never_answers_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`liquidfs stats` (and a pod's `stats --probe`) read the control file in their own process: a mount whose
    daemon is stuck held them in the kernel for good. Read from a child; no answer in time is a TimeoutError.
    (A read that sleeps, in the child, stands for the one that never returns.)"""
    import json

    from liquidfs.catalog.nodes import CONTROL_NAME

    answering, stuck, empty = tmp_path / "answering", tmp_path / "stuck", tmp_path / "empty"
    for d in (answering, stuck, empty):
        d.mkdir()
    (answering / os.fsdecode(CONTROL_NAME)).write_text(json.dumps({"pid": 42, "opens": 7}))
    text = control._control_text
    monkeypatch.setattr(control, "_control_text", lambda where: time.sleep(30) if where == stuck else text(where))
    assert control.read_control_within(answering, 10) == {"pid": 42, "opens": 7}
    with pytest.raises(FileNotFoundError):
        control.read_control_within(empty, 10)
    with pytest.raises(TimeoutError, match="answered nothing"):
        control.read_control_within(stuck, 0.5)


def test_a_child_that_fails_is_no_answer_but_no_silent_mount() -> None:
    """A probe's child killed (the OOM killer) or failing read as a mount that answered nothing in time: umount
    then refused with "stuck?" where it used to go on to fusermount3."""
    assert control._in_child(lambda: b"answers 5", 10) == b"answers 5"
    assert control._in_child(lambda: bytes(1 // 0), 10) == b""  # failed: no answer, at once
    assert control._in_child(lambda: time.sleep(30) or b"late", 0.3) is None  # silent


def test_the_daemon_leaves_past_threads_stuck_on_storage_and_only_then(caplog) -> None:  # type: ignore[no-untyped-def]
    """A warm stuck in the kernel (storage that no longer answers) is a thread the interpreter would join at the
    exit, for good: the daemon says so and leaves with its status. With none left, it exits as any process."""
    import threading

    from liquidfs.daemon.serve import exit_past_stuck_threads

    left: list[int] = []
    exit_past_stuck_threads(0, leave=left.append)
    assert left == []
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="liquidfs-warm_0", daemon=False)
    stuck.start()
    gone = open(os.devnull, "w")  # noqa: SIM115
    gone.close()
    closed = logging.StreamHandler(gone)  # a log whose stream is gone: its flush fails, the exit goes on
    logging.getLogger().addHandler(closed)
    try:
        with caplog.at_level("WARNING", logger="liquidfs.daemon.serve"):
            exit_past_stuck_threads(3, leave=left.append)
    finally:
        logging.getLogger().removeHandler(closed)
        release.set()
        stuck.join()
    assert left == [3] and "(liquidfs-warm_0): the daemon exits without them" in caplog.text


def test_a_control_file_that_is_a_link_or_a_fifo_is_never_opened_through(tmp_path: Path) -> None:
    """Any user can mount a fuse.liquidfs whose control file is a link (to /dev/watchdog, whose open by root arms
    a reset; to a file only root may read, which `stats --json` printed) or a FIFO (an open that never returns):
    only a regular file of the mount itself is read."""
    from liquidfs.daemon.control import read_control
    from liquidfs.catalog.nodes import CONTROL_NAME

    secret = tmp_path / "secret.json"
    secret.write_text('{"pid": 1, "root_only": true}')
    secret.chmod(0o600)
    fake = tmp_path / "mnt"
    fake.mkdir()
    control = fake / os.fsdecode(CONTROL_NAME)
    control.symlink_to(secret)
    with pytest.raises(OSError) as refused:
        read_control(fake)
    assert refused.value.errno == errno.ELOOP
    control.unlink()
    os.mkfifo(control)
    with pytest.raises(OSError, match="no regular file"):
        read_control(fake)  # at once: no writer ever comes
    control.unlink()
    control.write_text('{"pid": 7}')
    assert read_control(fake) == {"pid": 7}


@pytest.mark.fuse
def test_the_pid_a_control_file_names_is_waited_for_only_where_it_serves_fuse() -> None:
    """The mount's word: any user's fuse.liquidfs may name pid 1 (umount waited 30 s for it, then failed)."""
    from liquidfs.daemon.watchdog import holds_fuse_device

    assert not holds_fuse_device(os.getpid())
    fuse = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        assert holds_fuse_device(os.getpid())
    finally:
        os.close(fuse)


def test_umount_runs_fusermount3_only_on_the_mount_it_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its daemon asked first (seconds, where any user's fuse.liquidfs answers slowly): a directory above swapped
    for a link meanwhile would have root's fusermount3 unmount another mount of the same last name."""
    (tmp_path / "mnt").mkdir()
    asked: list[Path] = []

    def mounted(path: Path) -> tuple[bytes, int, int]:  # the one checked, then another once its daemon was asked
        return (control.FSTYPE, 301, 2) if asked else (control.FSTYPE, 300, 1)

    monkeypatch.setattr(watchdog, "topmost_mount", mounted)
    monkeypatch.setattr(control, "_probe", lambda path, timeout: asked.append(path) or ("answers", None))
    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    with pytest.raises(control.MountError, match="what is mounted there changed while its daemon was asked"):
        control.unmount(tmp_path / "mnt")
    assert ran == []


def test_the_failed_daemons_lines_shown_are_escaped(tmp_path: Path) -> None:
    from liquidfs.daemon.spawn import _log_since

    log = tmp_path / "mount.log"
    log.write_bytes(b"earlier\nliquidfs mount: catalog of s3://b/\x1b]0;owned\x07x: refused\n")
    fd = os.open(log, os.O_RDONLY)
    try:
        assert _log_since(fd, len(b"earlier\n")) == ["liquidfs mount: catalog of s3://b/\\x1b]0;owned\\x07x: refused"]
    finally:
        os.close(fd)
