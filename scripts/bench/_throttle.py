"""Emulate slower storage for benchmarks and tests: a cgroup v1 blkio group that caps read bandwidth.

Readers of a FUSE mount do no block I/O themselves: to throttle the storage behind liquidfs, put the daemon in
the group; to throttle a direct reader, put the reader in it. Not part of the package: the benchmarks beside it
and the profile's tests (tests/unit/test_profile.py) use it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")


def available() -> str | None:
    """None when read throttling works here, else why not."""
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        return "cgroup v1 blkio controller not mounted at /sys/fs/cgroup/blkio"
    if os.geteuid() != 0:
        return "needs root"
    return None


def device_of(path: str | os.PathLike[str]) -> str:
    """'major:minor' of the whole disk under ``path`` (throttling applies to disks, not partitions)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    if (sysfs / "partition").exists():
        parent = (sysfs.resolve().parent / "dev").read_text().strip()
        return parent
    return f"{major}:{minor}"


class ReadThrottle:
    """A blkio group reading at most ``bytes_per_s`` from the disk under ``path``."""

    def __init__(self, path: str | os.PathLike[str], bytes_per_s: int) -> None:
        self.group = BLKIO / f"liquidfs-{uuid.uuid4().hex[:8]}"
        self.group.mkdir()
        (self.group / "blkio.throttle.read_bps_device").write_text(f"{device_of(path)} {int(bytes_per_s)}\n")

    def add(self, pid: int) -> None:
        (self.group / "cgroup.procs").write_text(f"{pid}\n")

    def read_bytes(self) -> int:
        """Bytes the group's processes have read from disk so far (the block layer's count, every device)."""
        total = 0
        for line in (self.group / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] == "Read":
                total += int(parts[2])
        return total

    def close(self) -> None:
        # Move anything left back to the root group, then remove ours. The host may already have removed an
        # empty group (a release agent): nothing is left to do then.
        try:
            procs = (self.group / "cgroup.procs").read_text().split()
        except FileNotFoundError:
            return
        for pid in procs:
            with contextlib.suppress(OSError):
                (BLKIO / "cgroup.procs").write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            self.group.rmdir()


@contextlib.contextmanager
def throttled(path: str | os.PathLike[str], bytes_per_s: int) -> Iterator[ReadThrottle]:
    group = ReadThrottle(path, bytes_per_s)
    try:
        yield group
    finally:
        group.close()
