"""scripts/bench/bench_jobs.py works (issue 29): its smoke run mounts once per scenario and runs one job alone, two
at the same pace and two at different paces, each in a session of its own reading every image once per epoch; the
mount tells every job apart, and no read fails or serves a wrong byte. Not a measurement: no rate or ratio is
compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.fuse
@pytest.mark.needs_root("bench_jobs drops the page cache and caps storage with a blkio cgroup")
def test_bench_jobs_smoke_tells_every_job_apart_and_reads_exact_bytes(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_jobs.py"), "--smoke",
                           "--json", str(tmp_path / "out" / "jobs.json"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "jobs.json").read_text())
    assert all(run["error"] is None for run in report["runs"]), [run["error"] for run in report["runs"]]
    scenarios = {s["scenario"]: s for s in report["scenarios"]}
    assert set(scenarios) == {"one-job", "same-pace", "different-paces"}
    images, epochs = report["meta"]["images"], report["meta"]["epochs"]
    for name, s in scenarios.items():
        assert s["jobs_started"] == (1 if name == "one-job" else 2), s
        assert s["jobs_seen"] == s["jobs_started"], (name, s["jobs"])
        assert s["failed"] == 0 and s["wrong_bytes"] == 0, (name, s["jobs"])
        assert all(j["files"] == images * epochs for j in s["jobs"]), (name, s["jobs"])
        assert s["storage_datasets"] > 0, s  # every job's first reads came from storage
    assert "| different-paces | 1 | 0.5 (" in proc.stdout
