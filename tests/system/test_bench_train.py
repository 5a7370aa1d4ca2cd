"""scripts/bench/bench_train.py works (issue 18): its CPU mode, on a handful of images, trains through every
configuration, a real liquidfs mount included, and reports what it measured. Not a measurement: no figure is
compared with anything, only that each run trained over every image of every epoch, through the mount's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.fuse
def test_bench_train_smoke_trains_through_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_train.py"), "--smoke", "--cores",
                           "2", "--json", str(out / "train.json"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "train.json").read_text())
    runs = {run["config"]: run for run in report["runs"]}
    assert set(runs) == {"direct-png", "direct-bmp", "liquidfs", "liquidfs-cache", "liquidfs-j2k"}
    for config, run in runs.items():
        assert run["error"] is None, (config, run["error"])
        assert [e["epoch"] for e in run["epochs"]] == [1, 2], config
        # every image of the 24, every epoch (the last batch is partial, not dropped)
        assert all(e["images"] == 24 and e["images_per_s"] > 0 for e in run["epochs"]), (config, run["epochs"])
    for config in ("liquidfs", "liquidfs-cache"):
        mount = runs[config]["mount"]
        # the trainer read the mount: every image opened (DALI keeps a file mapped while it can, so epoch 2 may
        # reopen none of 24), about half of them served raw (the store is at 0.5)
        assert mount["opens"] >= 24 and 0 < mount["opens_raw"] < mount["opens"], (config, mount)
        assert mount["fallbacks"] == 0 and mount["errors"] == 0, (config, mount)
    # the J2K store (ratio 1): every image opened is served as its JPEG 2000 object, decoded by DALI's CPU
    # decoder here (nvJPEG2000 on a GPU), and trained on
    j2k = runs["liquidfs-j2k"]["mount"]
    assert j2k["opens"] >= 24 and j2k["opens_raw"] == j2k["opens"], j2k
    assert j2k["fallbacks"] == 0 and j2k["errors"] == 0, j2k
    store_objects = list((tmp_path / "work").rglob("store-j2k-1.00/objects/*/*"))
    assert len(store_objects) == 24 and all(p.suffix == ".jp2" for p in store_objects), store_objects
    assert "liquidfs-j2k" in proc.stdout and "| tiny |" in proc.stdout  # the table
