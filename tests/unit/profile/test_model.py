"""The profile's cost model (``profile.model``): the best share of each machine's costs, with and without a GPU
stage, which stage holds a node, the published search over the 11 mixes, and the share for a target rate."""

from __future__ import annotations

import pytest

from liquidfs.profile.model import (DECODE_BINDS, GPU_BUSY, STORAGE_BINDS, Costs, choose_for_target, model_choice,
                                    node_kind, paper_search)


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


def test_model_is_the_best_share_with_a_gpu_stage() -> None:
    """With J2K decoded on the GPU the pace is the slowest of three stages; the model finds its best share
    exactly (checked against a fine grid), whatever the machine."""
    import random

    rng = random.Random(18)
    for _ in range(2000):
        c = _costs(raw_format="j2k", original_bytes=rng.uniform(1e6, 5e6), raw_bytes=rng.uniform(1e6, 5e6),
                   load_original=rng.uniform(5e7, 2e9), load_raw=rng.uniform(5e7, 2e9),
                   decode_original=rng.uniform(5, 200), decode_raw=rng.uniform(100, 5000),
                   gpu_decode_raw=rng.uniform(10, 2000), cache_share=rng.uniform(0, 0.5))
        r, why = model_choice(c)
        grid = max(c.throughput(i / 1000) for i in range(1001))
        assert c.throughput(r) >= grid * (1 - 1e-9), (c, r, why)


def test_model_names_the_gpu_where_it_binds() -> None:
    fast_gpu = _costs(raw_format="j2k", load_original=50e9, load_raw=50e9, decode_raw=2000.0, gpu_decode_raw=5000.0)
    assert model_choice(fast_gpu) == (1.0, "CPU-bound even with every image raw: serve all raw (ratio 1)")
    slow_gpu = _costs(raw_format="j2k", load_original=50e9, load_raw=50e9, decode_raw=2000.0, gpu_decode_raw=20.0)
    r, why = model_choice(slow_gpu)
    assert 0 < r < 1 and why.startswith("GPU and CPU balance at"), why
    assert slow_gpu.gpu_time(r) == pytest.approx(slow_gpu.cpu_time(r), rel=1e-9)
    assert slow_gpu.throughput(r) > max(slow_gpu.throughput(0), slow_gpu.throughput(1))


def test_training_time_on_the_gpu_caps_every_share_and_the_model_takes_the_least_disk_for_it() -> None:
    """--gpu-train-rate: training's GPU time is a stage of its own, the same at every share; where it binds, the
    smallest share that keeps up with it is chosen (the same rate on less disk)."""
    free = _costs(load_original=300e6, load_raw=300e6)
    r_free, _ = model_choice(free)
    slow_gpu = _costs(load_original=300e6, load_raw=300e6, gpu_train=1 / (0.8 * free.throughput(r_free)))
    r, _ = model_choice(slow_gpu)
    assert slow_gpu.throughput(r) == pytest.approx(0.8 * free.throughput(r_free))
    assert r < r_free and slow_gpu.throughput(r - 0.01) < slow_gpu.throughput(r)


def test_node_kind_names_the_stage_that_holds_bmps_best_share() -> None:
    storage = _costs(load_original=20e6, load_raw=20e6, gpu_train=1 / 50)  # 6.9 img/s of storage, all originals
    assert node_kind(storage) == (STORAGE_BINDS, "at BMP's best share 0.00, img/s: storage 6.9, CPU 37.0, GPU 50.0 "
                                  "(GPU: training alone); the GPU has 86% of its time to spare there")
    decode = _costs(load_original=50e9, load_raw=50e9, decode_original=30.0, decode_raw=40.0)
    kind, detail = node_kind(decode)
    assert kind == DECODE_BINDS and "--gpu-train-rate" in detail  # training's time not given: said so
    busy = _costs(load_original=50e9, load_raw=50e9, gpu_train=1 / 10.0)  # training alone: 10 img/s
    assert node_kind(busy)[0] == GPU_BUSY and "0% of its time to spare" in node_kind(busy)[1]


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
