"""profile: the search and the model on synthetic cost curves, and real profiles of a small dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from liquidfs import _throttle
from liquidfs.profile import Costs, choose_for_target, model_choice, paper_search
from liquidfs.sample import make_sample


def _costs(**kw: float) -> Costs:
    base = dict(images=10, original_bytes=2.9e6, raw_bytes=6.3e6, load_original=800e6, load_raw=800e6,
                decode_original=37.0, decode_raw=250.0, read_cpu_per_byte=0.0, threads=2, decoder="test")
    base.update(kw)
    return Costs(**base)  # type: ignore[arg-type]


def test_model_balance_point_is_where_load_meets_decode() -> None:
    c = _costs(load_original=300e6, load_raw=300e6)
    r, why = model_choice(c)
    assert 0 < r < 1 and "balance" in why
    assert c.load_time(r) == pytest.approx(c.cpu_time(r), rel=1e-9)
    assert c.throughput(r) >= max(c.throughput(x / 10) for x in range(11)) - 1e-9


def test_model_storage_bound_and_cpu_bound_ends() -> None:
    slow_disk = _costs(load_original=20e6, load_raw=20e6)
    assert model_choice(slow_disk) == (0.0, pytest.approx(model_choice(slow_disk)[1]))
    assert "storage-bound" in model_choice(slow_disk)[1]
    fast_disk_slow_cpu = _costs(load_original=50e9, load_raw=50e9, decode_raw=40.0)
    r, why = model_choice(fast_disk_slow_cpu)
    assert r == 1.0 and "CPU-bound" in why


def test_cache_share_moves_the_balance_towards_raw() -> None:
    c0 = _costs(load_original=300e6, load_raw=300e6)
    c3 = _costs(load_original=300e6, load_raw=300e6, cache_share=0.3)
    assert model_choice(c3)[0] > model_choice(c0)[0]


def _search_on(curve_load, curve_decode):
    calls = []

    def measure(r: float) -> tuple[float, float]:
        calls.append(r)
        return curve_load(r), curve_decode(r)

    return paper_search(measure), calls


def test_paper_search_finds_the_crossing() -> None:
    (best, steps), calls = _search_on(lambda r: 100 - 60 * r, lambda r: 30 + 120 * r)
    # crossing at r = 70/180 = 0.39: the best of the 11 mixes is 0.4 (min(76, 78) = 76)
    assert best == 0.4
    assert len(calls) <= 4 and calls[0] == 0.5


def test_paper_search_monotone_and_flat_cases() -> None:
    (best, _), _ = _search_on(lambda r: 1000.0, lambda r: 10 + 90 * r)  # decode always slower
    assert best == 1.0
    (best, _), _ = _search_on(lambda r: 10 - 5 * r, lambda r: 1000.0)  # load always slower
    assert best == 0.0
    (best, _), calls = _search_on(lambda r: 50.0, lambda r: 50.0)  # flat and equal: stops at once
    assert calls == [0.5] and best == 0.5


def test_target_rate_picks_the_smallest_share() -> None:
    c = _costs(load_original=50e9, load_raw=50e9)
    r = choose_for_target(c, 60.0)
    assert r is not None and c.throughput(r) >= 60 and c.throughput(r - 0.01) < 60
    assert choose_for_target(c, 1e6) is None


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # on the root disk (not tmpfs), so read throttling applies to it
    return make_sample(tmp_path_factory.mktemp("prof") / "data", count=12, width=512, height=256, seed=6)


def _profile(src: Path, store: Path, out: Path, *extra: str, throttle: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "liquidfs", "profile", str(src), "--store", str(store), "--quick",
           "--decoder", "pil", "--json", str(out / "p.json"), "--plot", str(out / "p.png"), *extra]
    if throttle is None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    else:
        with _throttle.throttled(src, throttle) as group:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=lambda: group.add(os.getpid()))
            stdout, stderr = proc.communicate(timeout=300)
            done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr
    assert "chosen ratio" in done.stdout and "ratio  load img/s" in done.stdout
    return json.loads((out / "p.json").read_text())


def test_profile_writes_table_json_and_plot(small: Path, tmp_path: Path) -> None:
    result = _profile(small, tmp_path / "store", tmp_path)
    assert len(result["table"]) == 11 and 0 <= result["chosen"] <= 1
    assert result["costs"]["decoder"] == "pil" and result["search_steps"]
    with Image.open(tmp_path / "p.png") as im:
        assert im.format == "PNG" and im.size[0] > 100
    assert not list((tmp_path / "store").glob("profile-sample*")), "the sample's scratch is removed"


def test_throttled_storage_moves_the_choice_towards_originals(small: Path, tmp_path: Path) -> None:
    problem = _throttle.available()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"cannot throttle reads: {problem}")
        pytest.skip(problem)
    free = _profile(small, tmp_path / "s1", tmp_path)
    (tmp_path / "t").mkdir()
    slow = _profile(small, tmp_path / "s2", tmp_path / "t", throttle=8 * 1024 * 1024)
    assert slow["costs"]["load_original"] < free["costs"]["load_original"] / 3
    assert slow["chosen"] < free["chosen"], (slow["chosen"], free["chosen"])
    assert slow["chosen"] <= 0.3


def test_prepare_ratio_auto(small: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "liquidfs", "prepare", str(small), "--store", str(tmp_path / "s"),
                          "--ratio", "auto", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "profile chose ratio" in out.stdout and "served raw" in out.stdout
