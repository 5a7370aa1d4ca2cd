"""scripts/bench/bench_loops.py runs end to end on a small scale (as root, passthrough): its mirror serves the
files' bytes from several processes on one connection, and the table and JSON come out. That it works, never a
figure (BENCHMARKS.md has those)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusehelpers import PASSTHROUGH_NEEDS_ROOT

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_loops.py"

pytestmark = [pytest.mark.fuse, PASSTHROUGH_NEEDS_ROOT]


def test_the_mirror_serves_from_several_loops_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "loops.json"
    done = subprocess.run([sys.executable, str(BENCH), "--files", "60", "--readers", "3", "--loops", "1,3",
                           "--seconds", "0.3", "--repeats", "1", "--work", str(tmp_path / "w"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["loops"] for r in rows] == [1, 3]
    assert all(r["mount"] > 0 and r["direct"] > 0 for r in rows)
    assert all("liquidfs" not in r for r in rows)
    assert "| 3 |" in done.stdout


def test_liquidfs_is_measured_beside_the_mirror_its_cpu_split_by_thread(tmp_path: Path) -> None:
    out = tmp_path / "loops.json"
    work = tmp_path / "w"
    done = subprocess.run([sys.executable, str(BENCH), "--files", "40", "--readers", "2", "--loops", "1,2",
                           "--seconds", "1", "--repeats", "1", "--liquidfs", "--work", str(work),
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["loops"] for r in rows] == [1, 2]
    for row in rows:
        ours = row["liquidfs"]
        assert ours["rate"] > 0
        split = ours["cpu_split"]
        assert set(split) == {"loop_user", "loop_sys", "other_user", "other_sys"}
        # No part is negative (each process's total is its own, the ended threads' time included), and the
        # loops' own threads answered every request: a second of opens costs them some CPU. A thread's and its
        # process's user and system times are each split from their run time apart (and read in clock ticks): the
        # rest's user time can fall by a tick while its system time rises (CI: -0.8 and +2.3 us an open); their sum
        # cannot, beyond rounding.
        ticks_per_open = 2 * 1e6 / os.sysconf("SC_CLK_TCK") / ours["rate"]  # --seconds 1: ~rate opens
        assert split["loop_user"] >= 0 and split["loop_sys"] >= 0, split
        assert split["other_user"] + split["other_sys"] >= -ticks_per_open, split
        assert split["loop_user"] + split["loop_sys"] > 0, split
    assert "liquidfs files/s" in done.stdout
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    assert str(work / "mnt") not in mounts and str(work / "mnt-liquidfs") not in mounts


def test_the_mirror_serves_each_files_bytes(tmp_path: Path) -> None:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    files = {f"{i:03d}.bin": bytes([i]) * (1000 + i) for i in range(20)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    with subprocess.Popen([sys.executable, str(BENCH), "--serve", str(src), str(mnt), "3"],
                          stdout=subprocess.PIPE, text=True) as daemon:
        try:
            assert daemon.stdout is not None and daemon.stdout.readline().startswith("ready")
            for _ in range(5):
                for name, data in files.items():
                    assert (mnt / name).read_bytes() == data
        finally:
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
            daemon.wait(timeout=60)
    assert daemon.returncode == 0


def test_the_mirror_serves_a_tree_of_directories(tmp_path: Path) -> None:
    # bench_opens.py --mirror serves its datasets' directories of files through this mirror.
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    mnt.mkdir()
    files = {f"d{i % 3}/e{i % 2}/{i:03d}.bin": bytes([i]) * (500 + i) for i in range(12)}
    files |= {f"many/{i:04d}-{'x' * 100}.bin": b"m" for i in range(2000)}  # a listing of several replies
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    with subprocess.Popen([sys.executable, str(BENCH), "--serve", str(src), str(mnt), "1"],
                          stdout=subprocess.PIPE, text=True) as daemon:
        try:
            assert daemon.stdout is not None and daemon.stdout.readline().startswith("ready")
            for name, data in files.items():
                assert (mnt / name).read_bytes() == data
            assert sorted(p.name for p in (mnt / "d0").iterdir()) == ["e0", "e1"]
            assert sorted(os.listdir(mnt / "many")) == sorted(os.listdir(src / "many"))
            assert not (mnt / "d0" / "000.bin").exists()  # a name of another directory is not found here
        finally:
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
            daemon.wait(timeout=60)
    assert daemon.returncode == 0
