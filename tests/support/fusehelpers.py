"""Helpers for tests that mount real FUSE filesystems (after pyfuse3's test/util.py and s3ql's tests)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

FUSERMOUNT = "fusermount3"


@functools.cache
def fuse_available() -> str | None:
    """None when real mounts can be made here, else why not."""
    if shutil.which(FUSERMOUNT) is None:
        return f"{FUSERMOUNT} not installed (apt-get install fuse3)"
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        return f"cannot open /dev/fuse: {exc.strerror}"
    os.close(fd)
    return None


def is_mounted(path: Path) -> bool:
    target = os.fsencode(os.path.abspath(path))
    with open("/proc/mounts", "rb") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and fields[1].replace(b"\\040", b" ") == target:
                return True
    return False


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


def daemon_pid(mountpoint: Path) -> int:
    import json

    with open(mountpoint / ".__liquidfs__", "rb") as f:
        return int(json.loads(f.read())["pid"])


def memfd_bytes(pid: int) -> int:
    """Bytes in the memfds a daemon holds open (the passthrough path's cache): its own objects, not a
    machine-wide counter that any other process moves."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
        except OSError:
            pass
    return total


class Mount:
    """Starts ``liquidfs mount`` like a user does; tears every mount down whatever happened."""

    def __init__(self, tmp: Path, data_path: str | None = None) -> None:
        self.tmp = tmp
        #: ``--data-path`` given to every mount (None: the default, auto)
        self.data_path = data_path
        self.mountpoints: list[Path] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._n = 0

    def mountpoint(self) -> Path:
        self._n += 1
        mnt = self.tmp / f"mnt{self._n}"
        mnt.mkdir()
        return mnt

    def mount(self, source: Path, *args: str, mountpoint: Path | None = None, store: Path | None = None) -> Path:
        mnt = mountpoint or self.mountpoint()
        store = store or self.tmp / "store"
        cmd = [sys.executable, "-m", "liquidfs", "mount", str(source), str(mnt), "--store", str(store),
               "--log-level", "info", *self._data_path_args(args), *args]
        self.mountpoints.append(mnt)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise AssertionError(f"mount failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        assert is_mounted(mnt), f"{mnt} not in /proc/mounts after liquidfs mount returned"
        return mnt

    def mount_foreground(self, source: Path, *args: str, store: Path | None = None) -> tuple[Path, subprocess.Popen[bytes]]:
        mnt = self.mountpoint()
        store = store or self.tmp / "store"
        cmd = [sys.executable, "-m", "liquidfs", "mount", str(source), str(mnt), "--store", str(store),
               "--foreground", "--log-level", "info", *self._data_path_args(args), *args]
        with open(self.tmp / f"fg{self._n}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.mountpoints.append(mnt)
        self.procs.append(proc)

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"daemon exited with {proc.returncode}: "
                                     + (self.tmp / f"fg{self._n}.log").read_text())
            try:
                os.stat(mnt / ".__liquidfs__")
                return True
            except OSError:
                return False

        wait_for(ready, 120, what=f"mount on {mnt}")
        return mnt, proc

    def _data_path_args(self, args: tuple[str, ...]) -> list[str]:
        chosen = ["--data-path", self.data_path] if self.data_path and "--data-path" not in args else []
        # One loop unless a test asks for more: `--loops auto` (the default) follows the machine's cores, and a
        # test's counts and daemon pid must not (tests/mount/test_loops.py runs several).
        return chosen + ([] if "--loops" in args else ["--loops", "1"])

    def umount(self, mnt: Path) -> None:
        subprocess.run([sys.executable, "-m", "liquidfs", "umount", str(mnt)], check=True, capture_output=True,
                       timeout=60)

    def cleanup(self) -> None:
        for mnt in self.mountpoints:
            if is_mounted(mnt):
                subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


#: The data paths the mount suites run on (``--data-path``). Passthrough needs CAP_SYS_ADMIN (and the patched pyfuse3
#: that install.sh builds only for root): another user's runs of it skip, and CI (root) runs both.
PASSTHROUGH_NEEDS_ROOT = pytest.mark.needs_root("the passthrough data path (CAP_SYS_ADMIN)")
DATA_PATHS = [pytest.param("passthrough", marks=PASSTHROUGH_NEEDS_ROOT), "daemon"]


def mounter_on_each_path(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mount]:
    """A ``Mount`` factory on the data path ``request.param``; a module makes it its ``mounter`` with
    ``mounter = pytest.fixture(params=DATA_PATHS, name="mounter")(mounter_on_each_path)``. ``--data-path
    passthrough`` fails the mount where it is not available, so those runs cannot quietly fall back to the daemon."""
    m = Mount(tmp_path, data_path=request.param)
    try:
        yield m
    finally:
        m.cleanup()


#: Run a command as nobody (uid/gid 65534, no supplementary groups): the other user of --allow-other tests.
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, *cmd], capture_output=True, text=True, timeout=30)
