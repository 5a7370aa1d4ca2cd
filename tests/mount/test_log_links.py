"""The mount's log is written by root in the store, which its writer controls (issue 26): a link there is
refused, never written through. Fails on the code before the fix."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from fusehelpers import FUSERMOUNT, is_mounted


@pytest.mark.fuse
def test_a_mount_log_that_is_a_link_is_refused_and_its_target_left_as_it_was(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    store = tmp_path / "store"
    store.mkdir()
    startup = tmp_path / "bashrc"  # a root-owned startup file, as a store writer would aim at
    startup.write_text("# root's startup file\n")
    os.symlink(startup, store / "mount.log")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        done = run_cli("mount", str(src), str(mnt), "--store", str(store), check=False)
        assert done.returncode != 0, "mounted, logging through the link"
        assert "mount.log" in done.stderr and "symbolic link" in done.stderr, done.stderr
        assert not is_mounted(mnt)
        assert startup.read_text() == "# root's startup file\n"
        assert (store / "mount.log").is_symlink()
    finally:
        if is_mounted(mnt):
            subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True)
