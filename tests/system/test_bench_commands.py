"""scripts/bench/bench_commands.py works: its smoke run times ``--help``, a real mount, ``stats`` of it and
``umount``, and leaves nothing mounted. Not a measurement: no time is compared with anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fusehelpers import is_mounted

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.fuse
def test_bench_commands_smoke_times_every_command_of_a_real_mount(tmp_path: Path) -> None:
    out = tmp_path / "out" / "commands.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_commands.py"), "--smoke",
                           "--json", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    assert row["checkout"] == str(REPO) and row["repeats"] == 1
    for command in ("help", "stats", "mount", "umount"):
        assert row[f"{command}_wall_s"] > 0 and row[f"{command}_cpu_s"] > 0, row
    assert row["daemon_start_cpu_s"] > 0 and 10 < row["daemon_rss_mb"] < 1000, row  # read from its daemon's /proc
    assert not is_mounted(tmp_path / "work" / "mnt")
    assert "| umount wall / CPU s |" in proc.stdout  # the table
