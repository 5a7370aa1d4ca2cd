"""What the tests of the deployment assets under mount/ share (tests/system/test_deploy_*.py): the paths, running a
command, the mount table, a small dataset to mount."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MOUNT_DIR = REPO / "mount"

IN_CI = bool(os.environ.get("CI"))

#: Where the manifests mount the dataset in a pod, and the container test in its container.
MOUNTPOINT_IN_POD = "/mnt/dataset"


def skip_or_fail(reason: str) -> None:
    """Skip, except under CI where a FUSE test that cannot run is a failure."""
    if IN_CI:
        pytest.fail(f"{reason} (CI is set: this test may not skip)")
    pytest.skip(reason)


def run(cmd: list[str], *, timeout: float = 60, check: bool = False, **kw) -> subprocess.CompletedProcess:
    if "stdout" not in kw and "stderr" not in kw:
        kw["capture_output"] = True
    proc = subprocess.run(cmd, timeout=timeout, text=True, check=False, **kw)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


# ------------------------------------------------------------------------------------------------------
# mount table helpers (shared by the real FUSE tests)
# ------------------------------------------------------------------------------------------------------

def _unescape_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_at(path: Path) -> list[tuple[str, str]]:
    """(fstype, propagation tags) of every mount stacked on ``path``, bottom first."""
    target = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if _unescape_mountinfo(fields[4]) == target:
                found.append((right.split()[0], " ".join(fields[6:])))
    return found


def is_fuse_mounted(path: Path) -> bool:
    return any(fstype.startswith("fuse") for fstype, _ in mounts_at(path))


def force_unmount(path: Path) -> None:
    """Best-effort cleanup: lazily detach every FUSE mount on ``path``; never raises."""
    for _ in range(4):
        if not is_fuse_mounted(path):
            return
        with contextlib.suppress(Exception):
            subprocess.run(["fusermount3", "-u", "-z", str(path)], timeout=30, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if is_fuse_mounted(path):
            with contextlib.suppress(Exception):
                subprocess.run(["umount", "-l", str(path)], timeout=30, check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def make_source_tree(root: Path) -> dict[str, bytes]:
    """A small dataset: text, a binary blob and a PNG; returns {relative path: bytes}."""
    from PIL import Image  # runtime dependency of liquidfs

    (root / "train" / "cls0").mkdir(parents=True)
    files: dict[str, bytes] = {
        "labels.txt": b"cls0\ncls1\n",
        "train/blob.bin": os.urandom(300_000),
    }
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    png = root / "train" / "cls0" / "img0.png"
    Image.frombytes("RGB", (64, 48), bytes(range(256)) * 36).save(png)
    files["train/cls0/img0.png"] = png.read_bytes()
    return files


def assert_same_dataset(mounted: Path, files: dict[str, bytes]) -> None:
    # Nothing is prepared in these tests, so every file is served as its original bytes.
    for rel, data in files.items():
        got = (mounted / rel).read_bytes()
        assert got == data, f"{rel}: {len(got)} bytes through the mount differ from the {len(data)} source bytes"
