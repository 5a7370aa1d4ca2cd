"""A small run of scripts/bench/bench_scale.py's measurements, checked for correctness (figures printed, not
asserted)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchscripts import load_script
from fusehelpers import Mount, daemon_pid

pytestmark = pytest.mark.fuse

FILES = 20_000
DIRS = 20

bench = load_script("bench_scale")


def test_scale_tree_through_a_mount(tmp_path: Path, mounter: Mount) -> None:
    layout = bench.Layout(FILES, DIRS, bench.BIG_DIR_ENTRIES)
    assert sum(layout.counts()) == FILES and layout.counts()[0] == 1300
    source = tmp_path / "tree"
    _, made = bench.make_tree(source, layout)
    assert made and bench.make_tree(source, layout) == (0.0, False), "a complete tree is reused"
    store = tmp_path / "store"
    build = bench.measure_build(source, store)
    assert build["files"] == FILES + 1 and build["dirs"] == DIRS  # the marker is a file of the tree
    warm = bench.measure_warmup_choice(store)
    assert warm["files"] == FILES + 1 and warm["chosen"] >= 1 and warm["longest_gap_ms"] > 0, warm
    side_by_side = bench.bench_warmup.run(store, bench.bench.REPO, 1)  # --against: this checkout, as another
    assert set(side_by_side) == {"this", "against"} and "against" in bench.bench_warmup.table(side_by_side)

    mnt = mounter.mount(source, store=store)
    pid = daemon_pid(mnt)
    found = bench.measure_find(mnt)
    assert found["entries"] == FILES + DIRS + 2  # the root and the marker
    memory = bench.bench.memory_mb(pid)  # bench_scale's _bench

    big = layout.big_dir()
    directory = bench.measure_directory(mnt / big)
    assert directory["entries"] == 1300
    assert directory["names"] == sorted(os.listdir(source / big))
    for name, (size, mtime_ns, mode) in directory["stats"].items():
        st = os.stat(source / big / name)
        assert (size, mtime_ns, mode) == (st.st_size, st.st_mtime_ns, st.st_mode & ~0o222), name
    control = json.loads((mnt / ".__liquidfs__").read_bytes())
    assert control["errors"] == 0 and control["files"] == FILES + 1
    print(f"\n{FILES:,} files: build {build['files_per_s']:,.0f} files/s; find {found['seconds']:.2f} s; "
          f"daemon RSS {memory['rss_mb']:.0f} MB (peak {memory['hwm_mb']:.0f} MB); stat p50 "
          f"{directory['stat_p50_us']:.0f} us, p99 {directory['stat_p99_us']:.0f} us")
