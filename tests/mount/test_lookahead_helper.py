"""The metadata read-ahead's helper process through real mounts (``fuse.warm_helper``): each loop starts its own
when it begins to serve, lookups in cold directories have it warm their files, the bytes read are the source's
whatever it does, a helper killed leaves the read-ahead to the daemon's threads, and none outlives its mount."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fusehelpers import PASSTHROUGH_NEEDS_ROOT, Mount, daemon_pid, wait_for

from liquidfs.catalog.build import build
from liquidfs.daemon.control import read_control

pytestmark = [pytest.mark.fuse]

HELPER = b"liquidfs.fuse.warm_helper"


def _tree(src: Path, dirs: int = 3, files: int = 20) -> dict[str, bytes]:
    made = {}
    for d in range(dirs):
        (src / f"d{d}").mkdir(parents=True)
        for f in range(files):
            data = os.urandom(1000 + 37 * f + d)
            (src / f"d{d}" / f"f{f:02d}.bin").write_bytes(data)
            made[f"d{d}/f{f:02d}.bin"] = data
    return made


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _helpers(pid: int) -> list[int]:
    """The read-ahead's helper processes among ``pid``'s descendants (a mount's loops each have one)."""
    out = []
    for child in _descendants(pid):
        try:
            if HELPER in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                out.append(child)
        except OSError:
            pass
    return out


def _read_all(mnt: Path, made: dict[str, bytes], prefix: str) -> None:
    for rel, data in made.items():
        if rel.startswith(prefix):
            assert hashlib.sha256((mnt / rel).read_bytes()).digest() == hashlib.sha256(data).digest(), rel


def test_the_helper_warms_cold_directories_and_a_killed_one_leaves_it_to_threads(tmp_path: Path,
                                                                                mounter: Mount) -> None:
    src, store = tmp_path / "src", tmp_path / "store"
    made = _tree(src)
    build(src, store)
    mnt = mounter.mount(src, store=store)
    pid = daemon_pid(mnt)
    wait_for(lambda: len(_helpers(pid)) == 1, what="the read-ahead's helper process")
    assert read_control(mnt)["lookahead_helper"] == 1

    _read_all(mnt, made, "d0/")  # its first lookup warms d0's files in the helper
    wait_for(lambda: read_control(mnt)["lookahead_files"] >= 20, what="d0 warmed")
    assert read_control(mnt)["lookahead_helper"] == 1

    (helper,) = _helpers(pid)
    # It holds what it was handed and nothing else: its pipes, stderr, and the directories its arguments name.
    words = [w for w in Path(f"/proc/{helper}/cmdline").read_bytes().split(b"\0") if w]
    handed = {int(word) for word in words[words.index(HELPER) + 2:]}  # after the module and its thread count
    assert handed and sorted(int(fd) for fd in os.listdir(f"/proc/{helper}/fd")) == [0, 1, 2, *sorted(handed)]
    # The source's root (no objects directory: nothing was prepared raw), never /dev/fuse or another file.
    assert {os.readlink(f"/proc/{helper}/fd/{fd}") for fd in handed} == {str(src)}

    os.kill(helper, signal.SIGKILL)
    _read_all(mnt, made, "d1/")  # the next directory's warm finds it gone: the daemon's threads warm it
    wait_for(lambda: read_control(mnt)["lookahead_helper"] == 0, what="the read-ahead in the daemon's threads")
    wait_for(lambda: read_control(mnt)["lookahead_files"] >= 40, what="d1 warmed")
    _read_all(mnt, made, "")  # every byte the source's, throughout
    assert "the metadata read-ahead goes on in the daemon's own threads" in (store / "mount.log").read_text()


@PASSTHROUGH_NEEDS_ROOT
def test_each_loop_has_its_own_helper_and_none_outlives_the_mount(tmp_path: Path, mounter: Mount) -> None:
    src, store = tmp_path / "src", tmp_path / "store"
    made = _tree(src, dirs=2)
    build(src, store)
    mnt = mounter.mount(src, "--loops", "2", "--data-path", "passthrough", store=store)
    pid = daemon_pid(mnt)
    wait_for(lambda: len(_helpers(pid)) == 2, what="a helper process per loop")
    helpers = _helpers(pid)
    _read_all(mnt, made, "")
    subprocess.run([sys.executable, "-m", "liquidfs", "umount", str(mnt)], check=True, timeout=120)

    def gone() -> bool:
        for h in helpers:
            try:
                if HELPER in Path(f"/proc/{h}/cmdline").read_bytes():
                    return False
            except OSError:
                pass  # ended
        return True

    wait_for(gone, timeout=30, what="the helpers to end with their mount")


def test_lookups_answered_from_the_rows_read_ahead_say_what_the_source_is(tmp_path: Path, mounter: Mount) -> None:
    # A cold directory's first lookup reads its rows ahead; the lookups of its other files take them (no query):
    # `stat` and the bytes through the mount are the source's all the same.
    src, store = tmp_path / "src", tmp_path / "store"
    made = _tree(src, dirs=2, files=30)
    build(src, store)
    mnt = mounter.mount(src, store=store)
    os.stat(mnt / "d0" / "f00.bin")
    wait_for(lambda: read_control(mnt)["lookahead_files"] >= 30, what="d0 read ahead")
    for rel in sorted(made):
        seen, real = os.stat(mnt / rel), os.stat(src / rel)
        assert (seen.st_size, seen.st_mtime_ns, stat.S_IFMT(seen.st_mode)) == \
            (real.st_size, real.st_mtime_ns, stat.S_IFMT(real.st_mode)), rel
    assert read_control(mnt)["lookahead_rows_hit"] >= 29  # d0's other files at least
    _read_all(mnt, made, "")
