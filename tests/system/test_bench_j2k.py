"""scripts/bench/bench_j2k.py works (issue 18): its smoke run decodes the PNG, BMP and J2K of a few images with every
decoder here and finds each exact against the PNG's pixels. Not a measurement: no rate is compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_j2k_smoke_decodes_every_format_exactly(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_j2k.py"), "--smoke", "--threads",
                           "2", "--json", str(tmp_path / "j2k.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "j2k.json").read_text())
    rows = {(r["format"], r["decoder"]): r for r in report["rows"]}
    # DALI is a test dependency: its CPU decoder is measured beside Pillow; dali-mixed only with a GPU
    expected = {(f, d) for f in ("png", "bmp", "j2k") for d in ("pil", "dali-cpu")}
    assert expected <= set(rows), sorted(rows)
    assert all(r["exact"] == r["images"] == 4 and r["images_per_s"] > 0 for r in rows.values()), rows
    # J2K is compressed like the PNG, the BMP is not
    assert rows["j2k", "pil"]["mean_bytes"] < rows["bmp", "pil"]["mean_bytes"] / 1.5
    assert ("j2k", "dali-mixed") in rows or report["meta"]["no_gpu_because"]
    assert "| j2k | dali-cpu |" in proc.stdout
