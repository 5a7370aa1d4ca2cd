"""scripts/bench/bench_opens.py runs end to end on a small scale (as root: it drops caches; passthrough for its
--mirror): every shape's rows come out for direct, the mount and the mirror, as table and JSON, and nothing stays
mounted. That it works, never a figure (BENCHMARKS.md has those)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fusehelpers import PASSTHROUGH_NEEDS_ROOT

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_opens.py"

pytestmark = [pytest.mark.fuse, PASSTHROUGH_NEEDS_ROOT]


def test_direct_the_mirror_and_the_mount_side_by_side(tmp_path: Path) -> None:
    out, work = tmp_path / "opens.json", tmp_path / "w"
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--mirror", "--readers", "1,2",
                           "--work", str(work), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["shape"], r["state"], r["readers"]) for r in rows} == {
        (shape, state, n) for shape in ("small", "large", "opens") for state in ("cold", "warm") for n in (1, 2)}
    for row in rows:
        assert row["direct_files_s"] > 0 and row["mount_files_s"] > 0 and row["mirror_files_s"] > 0, row
        assert row["mirror_ratio"] == pytest.approx(row["mirror_files_s"] / row["direct_files_s"])
        assert row["mirror_open_p50_us"] <= row["mirror_open_p99_us"], row
        # Every repeat read every file through each of the three, the same bytes (the mirror serves the files
        # themselves, the mount the bytes it promises); the opens-only shape reads none.
        assert [len(row["runs"][where]) for where in ("direct", "mirror", "mount")] == [1, 1, 1], row
        read = row["bytes_read"]
        assert read["direct"] == read["mirror"] == read["mount"], row
        assert (read["direct"] > 0) == (row["shape"] != "opens"), row
        # The daemon's CPU split into its loops' threads and the rest: each thread's nanoseconds (schedstat),
        # never less than before, so no part below 0, and the loops' within the daemon's whole
        split = row["daemon_cpu_split_us_per_file"]
        assert split["loop"] >= 0 and split["other"] >= 0, row
        assert split["loop"] <= row["daemon_cpu_us_per_file"] + 1e-6, row
        # the rest's parts by the names of the threads (worker threads, the closer, the read-ahead): within it
        # (the read-ahead's helper process whole from its stat, in clock ticks: two of them either way)
        tick_per_file = 1e6 / os.sysconf("SC_CLK_TCK") / row["files"]
        parts = [split[kind] for kind in ("workers", "closer", "read_ahead")]
        assert min(parts) >= -2 * tick_per_file and sum(parts) <= split["other"] + 2 * tick_per_file, row
        assert row["lookahead_warms_per_file"] >= 0, row
    # the split is read, not made up: the loops' threads answered every request of every run
    assert sum(r["daemon_cpu_split_us_per_file"]["loop"] for r in rows) > 0, rows
    # cold, the read-ahead warmed the files' inodes (once each, its own run's; at most twice with a re-warm)
    assert any(r["lookahead_warms_per_file"] > 0 for r in rows if r["state"] == "cold"), rows
    # The mount's requests were counted: each file was opened through it.
    small_cold = next(r for r in rows if (r["shape"], r["state"], r["readers"]) == ("small", "cold", 1))
    assert small_cold["requests_last_run"]["open"]["per_file"] >= 1.0
    assert "| mirror files/s |" in done.stdout
    assert "daemon CPU us/file (its loops' threads + the rest: of it worker threads, closer, read-ahead)" in done.stdout
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    assert str(work / "mnt") not in mounts and str(work / "mnt-mirror") not in mounts


def test_without_mirror_the_table_has_no_mirror_columns(tmp_path: Path) -> None:
    out = tmp_path / "opens.json"
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--shapes", "small",
                           "--work", str(tmp_path / "w"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["shape"], r["state"]) for r in rows} == {("small", "cold"), ("small", "warm")}
    assert all("mirror_files_s" not in r for r in rows)
    assert "mirror" not in done.stdout
