"""Trust boundaries (issue: a root daemon that reads only what it should): one test per class fixed here, each
failing on the code before the fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from fusehelpers import FUSERMOUNT, Mount, is_mounted
from liquidfs.cache import WINDOW, NextEpochCache
from liquidfs.catalog import Catalog
from liquidfs.prepare import prepare
from liquidfs.sample import make_sample


@pytest.mark.fuse
def test_a_root_mount_imports_nothing_from_the_callers_directory(tmp_path: Path) -> None:
    """``python -m`` puts the working directory first on sys.path: a root mount started in a directory another
    user can write would run that user's ``trio.py``. The daemon is started isolated, in /."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    trap = tmp_path / "cwd"
    trap.mkdir()
    marker = tmp_path / "imported-from-cwd"
    for name in ("trio", "pyfuse3", "xxhash"):
        (trap / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\nraise ImportError\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        # the console script, as a user runs it: its own sys.path[0] is its directory, not the cwd
        cli = Path(sys.executable).parent / "liquidfs"
        done = subprocess.run([str(cli), "mount", str(src), str(mnt), "--store", str(tmp_path / "store")],
                              cwd=trap, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert (mnt / "a.txt").read_text() == "a\n"
        assert not marker.exists(), f"the daemon imported {marker.read_text()} from the caller's directory"
    finally:
        if is_mounted(mnt):
            subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True)


@pytest.mark.fuse
def test_the_control_entry_is_the_owners_only(tmp_path: Path, mounter: Mount) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    mnt = mounter.mount(src, "--allow-other")
    control = mnt / ".__liquidfs__"
    assert os.stat(control).st_mode & 0o077 == 0
    assert json.loads(control.read_bytes())["pid"] > 0  # its owner still reads it
    assert run_cli("stats", str(mnt), "--probe").returncode == 0


@pytest.mark.fuse
def test_a_store_path_with_uri_characters_opens_that_store(tmp_path: Path, mounter: Mount) -> None:
    """The read-only catalog is opened through an SQLite URI: a '#', '?' or '%' in --store used to cut the path
    there and open another file (here: the decoy catalog in the store's parent named by the cut)."""
    src = make_sample(tmp_path / "src", count=4, width=64, height=48, seed=2)
    decoy_src = make_sample(tmp_path / "decoy-src", count=2, width=32, height=16, seed=3)
    prepare(decoy_src, tmp_path / "decoy-store", 0.0, progress=False)
    store = tmp_path / "st#x?y%41"
    store.mkdir()
    # what an unquoted URI names: "file:<store>/catalog.sqlite?mode=ro" cut at '#' opens the file "<tmp>/st"
    shutil.copyfile(tmp_path / "decoy-store" / "catalog.sqlite", tmp_path / "st")
    prepare(src, store, 0.5, progress=False)
    mnt = mounter.mount(src, store=store)
    names = sorted(p.name for p in (mnt / "leftImg8bit" / "train").rglob("*.png"))
    assert names == sorted(p.name for p in (src / "leftImg8bit" / "train").rglob("*.png"))


def test_catalogs_are_read_with_an_untrusted_schema(tmp_path: Path) -> None:
    src = make_sample(tmp_path / "src", count=2, width=32, height=16, seed=4)
    prepare(src, tmp_path / "store", 0.0, progress=False)
    for readonly in (True, False):
        catalog = Catalog.open(tmp_path / "store", readonly=readonly)
        try:
            assert catalog.db.execute("PRAGMA trusted_schema").fetchone()[0] == 0
        finally:
            catalog.close()


def test_a_window_of_empty_files_does_not_divide_by_zero() -> None:
    cache = NextEpochCache(1000, 1000, 2 * WINDOW, max_id=2 * WINDOW)
    for file in range(1, 2 * WINDOW + 1):
        cache.read(file, 0)  # 64 empty files in a row: a window of zero bytes
    summary = cache.summary()
    assert len(summary["window_byte_hit_ratios"]) == 2
