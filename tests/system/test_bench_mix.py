"""scripts/bench/bench_mix.py works (issue 30): its smoke run holds a 200 MB/s storage cap and runs the DALI
pipeline at three static shares, at what ``profile --run`` chose (the profile timed the same loader through its own
mounts) and at the model's choice, then under ``--mix adaptive`` and, run the same way, at the best static share.
Not a measurement: no rate is compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.fuse
@pytest.mark.needs_root("bench_mix drops the page cache and caps storage with a blkio cgroup")
def test_bench_mix_smoke_runs_every_chooser_under_a_cap(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_mix.py"), "--smoke",
                           "--shapes", "cap200", "--json", str(tmp_path / "mix.json"), "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "mix.json").read_text())["rows"]
    configs = [r["config"] for r in rows]
    assert configs == ["static"] * 3 + ["profile --run", "model", "adaptive", "best static, continuous"], configs
    measured = next(r for r in rows if r["config"] == "profile --run")
    assert measured["profile"]["chosen_by"].startswith("measured search"), measured["profile"]
    assert measured["share"] == measured["profile"]["chosen"] and measured["profile"]["measured"]
    adaptive, same_way = rows[-2:]
    assert len(adaptive["epochs"]) >= 2 and all(e["images_per_s"] > 0 for e in adaptive["epochs"])
    best = max((r for r in rows if r["config"] == "static"), key=lambda r: r["images_per_s"])
    # the mix's share as sampled each second (none yet for the epochs that ended before the first sample)
    assert {e["share"] for e in same_way["epochs"]} - {None} == {best["share"]}
    assert adaptive["vs_best"] == adaptive["images_per_s"] / same_way["images_per_s"]
    assert all(r["images_per_s"] > 0 and "vs_best" in r for r in rows)
    assert "**cap200** (best static:" in proc.stdout and "| profile --run |" in proc.stdout
    assert not list((tmp_path / "w").glob("store-profile/profile-run-*")), "the profile's scratch is removed"
