"""scripts/bench/bench_adaptive.py works: its smoke run (cpu scenario, a handful of small images) reads every tree once
before timing, then runs each configuration through every epoch of every phase on a real mount. Not a
measurement: no rate is compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.fuse
@pytest.mark.needs_root("bench_adaptive drops the page cache (/proc/sys/vm/drop_caches)")
def test_bench_adaptive_smoke_warms_up_and_runs_every_configuration(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_adaptive.py"), "--smoke",
                           "--scenarios", "cpu", "--configs", "png,adaptive", "--json",
                           str(tmp_path / "out" / "adaptive.json"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "adaptive.json").read_text())
    assert report["meta"]["warm_up"] is True
    # the source and the two stores the configurations read (ratio 0 and the prepared 1.0), each once
    assert proc.stderr.count("warming up: reading") == 3, proc.stderr[-3000:]
    runs = {run["config"]: run for run in report["runs"]}
    assert set(runs) == {"png", "adaptive"}
    for config, run in runs.items():
        assert run["error"] is None, (config, run["error"])
        assert [e["phase"] for e in run["epochs"]] == ["before", "changed", "after"], config
        assert all(e["images"] > 0 and e["images_per_s"] > 0 for e in run["epochs"]), (config, run["epochs"])
