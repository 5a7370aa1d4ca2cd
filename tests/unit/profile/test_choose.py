"""profile: real profiles of a small dataset (the model and the search on synthetic curves: test_model.py); J2K weighed
with a fake GPU decoder (the one fake here: no GPU is lent to CI) over a real store and real J2K files."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from liquidfs import cli
from liquidfs.profile import decoders as decoderates
from liquidfs.expand import formats
from liquidfs.profile.decoders import DecodeRate
from liquidfs.profile.choose import ProfileError, profile_store, render, to_json
from liquidfs.profile.model import GPU_BUSY, STORAGE_BINDS
from liquidfs.stores import open_store
from liquidfs.stores.local import store as local_store
from liquidfs.stores.sample import FILES_PER_READER, sample_full

import _throttle
from sample import make_sample


def test_a_sample_stops_at_its_bytes_only_once_each_reader_has_its_files() -> None:
    big = 10 ** 9
    assert sample_full(64, 0, count=64, readers=8, max_bytes=big)
    assert not sample_full(63, big - 1, count=64, readers=8, max_bytes=big)
    assert sample_full(FILES_PER_READER * 8, big, count=64, readers=8, max_bytes=big)
    assert not sample_full(FILES_PER_READER * 8 - 1, 10 * big, count=64, readers=8, max_bytes=big)
    assert not sample_full(40, 10 * big, count=64, readers=8, max_bytes=None)  # --sample N: N images


def test_a_sample_stops_where_its_images_hold_the_memory_they_may(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """128 readers of 100-megapixel images had the floor of ``FILES_PER_READER`` a reader hold 150 GB: the
    sample stops once its originals and expansions hold ``HELD_SHARE`` of the memory available at its start,
    short of the floor (or of ``--sample N``) if it must, and says so."""
    from liquidfs.stores import sample as sample_module

    monkeypatch.setattr("liquidfs.expand.workers.available_memory", lambda: 1000)
    smp = sample_module.Sample([], [], tmp_path)
    assert smp.held_limit == 500
    for _ in range(3):
        smp.raws.append(None)
        smp.raw_data.append(b"r" * 100)
        smp.original_data.append(b"o" * 50)
    assert not smp.full(64, readers=128, max_bytes=10)  # 450 held: the floor still wants more
    smp.raws.append(None)
    smp.raw_data.append(b"r" * 100)
    smp.original_data.append(b"o" * 50)
    assert smp.full(64, readers=128, max_bytes=10) and smp.full(64, readers=128, max_bytes=None)
    monkeypatch.setattr("liquidfs.expand.workers.available_memory", lambda: None)
    assert sample_module.Sample([], [], tmp_path).held_limit is None  # unknown: bounded by count and bytes only
    assert not sample_module.Sample([], [], tmp_path, held_limit=0).full(64, readers=4, max_bytes=None)  # one, always


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # on the root disk (not tmpfs), so read throttling applies to it
    return make_sample(tmp_path_factory.mktemp("prof") / "data", count=12, width=512, height=256, seed=6)


def _profile(src: Path, store: Path, out: Path, *extra: str, throttle: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "liquidfs", "profile", str(src), "--store", str(store), "--quick",
           "--decoder", "pil", "--model-only", "--json", str(out / "p.json"), "--plot", str(out / "p.png"), *extra]
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


def test_prepare_ratio_auto_weighs_the_cache_it_is_given(small: Path, tmp_path: Path) -> None:
    """``prepare --ratio auto --cache-size 40%``: the profile kept in the store weighed a 40 % cache."""
    out = subprocess.run([sys.executable, "-m", "liquidfs", "prepare", str(small), "--store", str(tmp_path / "s"),
                          "--ratio", "auto", "--quick", "--model-only", "--cache-size", "40%", "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    kept = json.loads((tmp_path / "s" / "profile.json").read_text())
    assert kept["costs"]["cache_share"] == pytest.approx(0.4) and "cache share 40%" in out.stdout


def _fixed_rates(monkeypatch: pytest.MonkeyPatch, *, storage: float, decode: float) -> list[int]:
    """The machine's rates fixed (storage bytes/s, decode images/s), the sample's files real: the readers each
    storage measurement was given are recorded in the list returned."""
    from liquidfs.profile import choose as profile_mod

    readers: list[int] = []

    def load(items, seconds: float, jobs: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
        readers.append(jobs)
        return storage, 1e-10

    monkeypatch.setattr(profile_mod, "measure_decode", lambda encoded, decoder, threads, seconds: decode)
    monkeypatch.setattr(local_store, "measure_load", load)
    return readers


@pytest.mark.parametrize("threads, readers", [(3, None), (3, 5)])
def test_storage_is_measured_with_as_many_readers_as_the_loader_has(small: Path, tmp_path: Path, threads: int,
                                                                    readers: int | None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every storage measurement runs the loader's readers at once: --readers, else one per decoder thread (it was
    4 whatever the loader); the output says how many."""
    seen = _fixed_rates(monkeypatch, storage=300e6, decode=200.0)
    profile = profile_store(open_store(small, tmp_path / "store"), decoder="pil", threads=threads, readers=readers,
                            quick=True, measured=False)
    want = readers or threads
    assert seen and set(seen) == {want}, seen
    assert profile.costs.readers == want and f"storage ({want} readers): originals" in render(profile)
    # The sample: the whole 12-image dataset (fewer than the 16 a quick sample takes, or 4 for each reader)
    assert profile.costs.images == 12


@pytest.mark.parametrize("size", [180_000, 8192, 200_000])
def test_a_timed_read_asks_for_the_file_not_the_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        size: int) -> None:
    """Each direct read asks for what is left of the file (to the next 4 KiB), never the whole buffer: the kernel
    pins what is asked for, and 64 MiB asked of a 180 KB file cost ~10 ms of CPU (kernel 6.18), so the profile
    timed storage 20x slower than it reads. A file larger than the buffer is read in turns, a grown one to its end."""
    import mmap

    from liquidfs.stores import sample as timedreads

    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    probe = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        fcntl.fcntl(probe, fcntl.F_SETFL, os.O_DIRECT)
    except OSError as exc:  # tmpfs before 6.6: read buffered, no length to check
        if os.environ.get("CI"):
            pytest.fail(f"no direct I/O where the test's files are: {exc}")
        pytest.skip(f"no direct I/O here: {exc}")
    finally:
        os.close(probe)
    asked: list[int] = []
    real = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        asked.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        big = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        assert timedreads._read_direct(timedreads.Below(dir_fd, b"f"), big) == size
        assert asked and max(asked) <= -(-size // 4096) * 4096 + 4096, asked
        assert sum(asked) < 2 * size + 8192, asked
        asked.clear()
        small = mmap.mmap(-1, 64 << 10, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        assert timedreads._read_direct(timedreads.Below(dir_fd, b"f"), small) == size
        assert len(asked) >= size // (64 << 10) and max(asked) <= 64 << 10, asked
        # a file that grew after its size was read is read no further than that size (a `truncate -s 10T` by
        # the dataset's owner would have the profile read terabytes as root)
        asked.clear()
        real_fstat = os.fstat

        looks: list[int] = []

        def fstat_then_grow(fd: int) -> os.stat_result:
            st = real_fstat(fd)
            looks.append(st.st_size)
            if len(looks) == 1:  # the open's check, which gave the read its size: the file grows after it
                with open(tmp_path / "f", "ab") as f:
                    f.write(data)
            return st

        monkeypatch.setattr(os, "fstat", fstat_then_grow)
        assert timedreads._read_direct(timedreads.Below(dir_fd, b"f"), big) == size
        assert sum(asked) <= -(-size // 4096) * 4096, asked
        monkeypatch.setattr(os, "fstat", real_fstat)
        with pytest.raises(OSError, match="when sampled: changed since"):  # of another size at the open: skipped
            timedreads._read_direct(timedreads.Below(dir_fd, b"f", size=size), big)
    finally:
        os.close(dir_fd)


def test_the_timed_reads_run_their_readers_at_once(small: Path, tmp_path: Path) -> None:
    """measure_load with N readers has N files open at once (a barrier of N holds every reader until all are
    in), and reads each file whole."""
    import threading

    from liquidfs.stores import sample as timedreads

    smp = open_store(small, tmp_path / "store").profile_sample(12, jobs=4)
    try:
        barrier = threading.Barrier(4, timeout=30)
        real = timedreads._read_direct
        first: set[int] = set()

        def read(file, buf):  # type: ignore[no-untyped-def]
            me = threading.get_ident()
            if me not in first:
                first.add(me)
                barrier.wait()  # broken (BrokenBarrierError) unless 4 readers arrive together
            return real(file, buf)

        timedreads._read_direct = read  # type: ignore[assignment]
        try:
            rate, _ = smp.load(smp.raws, 0.2)
        finally:
            timedreads._read_direct = real  # type: ignore[assignment]
        assert len(first) == 4 and rate > 0
    finally:
        smp.cleanup()


def test_a_stores_sample_stops_at_the_memory_its_images_may_hold(small: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("liquidfs.expand.workers.available_memory", lambda: 2)  # a byte may be held: one image
    smp = open_store(small, tmp_path / "store").profile_sample(12, jobs=4)
    try:
        assert len(smp.raws) == len(smp.originals) == 1
    finally:
        smp.cleanup()


def test_a_samples_raw_files_are_on_the_disk_before_they_are_timed(small: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed with O_DIRECT right after they were written, their dirty pages' writeback came first: raw files
    timed at 642-801 MB/s where synced ones ran at 944-1285 (a review), and the model leaned to the originals."""
    import os

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(local_store.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_size) or real(fd))
    smp = open_store(small, tmp_path / "store").profile_sample(12, jobs=4)
    try:
        assert sorted(synced) == sorted(len(data) for data in smp.raw_data)
    finally:
        smp.cleanup()


def _fake_gpu(rate: float, seen: list[bytes]):  # type: ignore[no-untyped-def]
    def measure(encoded, threads: int, seconds: float) -> DecodeRate:  # type: ignore[no-untyped-def]
        seen.extend(encoded)
        return DecodeRate(rate, 1e-4)

    return lambda decoder: (measure, f"a fake GPU for {decoder}")


@pytest.mark.parametrize("gpu_rate, expect", [(5000.0, "j2k"), (0.5, "bmp")])
def test_profile_weighs_j2k_where_a_gpu_decodes_it(small: Path, tmp_path: Path, gpu_rate: float,
                                                  expect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample's J2K files real, the machine's rates fixed: storage at 50 MB/s, the CPU's decoding fast, so
    what is weighed is which format's bytes and decoder set the pace, not this VM's load (a loaded 2-core CI run
    measured both formats bound by the CPU, or by the tiny files' latency, within the GPU's margin of each other,
    and BMP was chosen at 5,000 GPU img/s)."""
    _fixed_rates(monkeypatch, storage=50e6, decode=1e6)
    seen: list[bytes] = []
    profile = profile_store(open_store(small, tmp_path / "store"), decoder="dali", threads=2, quick=True,
                            formats=("j2k", "bmp"), find_gpu=_fake_gpu(gpu_rate, seen))
    # The GPU was given the sample's real lossless J2K files, each the exact pixels of its PNG.
    assert seen and all(formats.sniff(data[:32]) == "j2k" for data in seen)
    assert [w["raw_format"] for w in profile.weighed] == ["bmp", "j2k"]
    assert profile.raw_format == expect, profile.weighed
    j2k = next(w for w in profile.weighed if w["raw_format"] == "j2k")
    bmp = next(w for w in profile.weighed if w["raw_format"] == "bmp")
    assert (j2k["predicted_images_per_s"] > bmp["predicted_images_per_s"]) == (expect == "j2k")
    assert profile.costs.raw_format == expect and (profile.costs.gpu_decode_raw == gpu_rate) == (expect == "j2k")
    assert not list((tmp_path / "store").glob("profile-sample*")), "both samples' scratch is removed"
    kept = json.loads(json.dumps(to_json(profile), allow_nan=False))  # strict JSON, whatever the GPU column
    assert kept["raw_format"] == expect and len(kept["table"]) == 11
    text = render(profile)
    assert f"raw images as {expect.upper()}" in text and ("GPU img/s" in text) == (expect == "j2k")
    assert "weighed: BMP at" in text and "J2K at" in text


@pytest.mark.parametrize("train_rate, expect, node", [(1e6, "j2k", STORAGE_BINDS), (20.0, "bmp", GPU_BUSY)])
def test_j2k_is_chosen_where_storage_binds_and_the_gpu_has_time_to_spare(small: Path, tmp_path: Path,
                                                                        train_rate: float, expect: str, node: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Pillow loader, nvImageCodec's GPU decoder found by its probe (a fake here, at 5,000 img/s alone), storage
    at 50 MB/s: J2K's smaller objects pay while training leaves the GPU time (1e6 img/s alone), not where
    training alone (20 img/s) already holds the GPU; the output names the readers, the decoder, the GPU decoder
    and the kind of node."""
    _fixed_rates(monkeypatch, storage=50e6, decode=1e6)
    seen: list[bytes] = []
    monkeypatch.setattr(decoderates, "find_nvimgcodec",
                        lambda: (_fake_gpu(5000.0, seen)("pil")[0], "nvImageCodec (fake) GPU_ONLY"))
    profile = profile_store(open_store(small, tmp_path / "store"), decoder="pil", threads=2, quick=True,
                            formats=("j2k", "bmp"), gpu_train_rate=train_rate, measured=False)
    assert seen and all(formats.sniff(data[:32]) == "j2k" for data in seen)  # the real J2K sample, decoded
    assert profile.raw_format == expect, profile.weighed
    assert profile.node == node and profile.gpu_decoder == "nvImageCodec (fake) GPU_ONLY"
    j2k = next(w for w in profile.weighed if w["raw_format"] == "j2k")
    assert j2k["predicted_images_per_s"] <= train_rate * (1 + 1e-9)  # training's GPU time counted
    text = render(profile)
    assert "storage (2 readers)" in text and "decoder pil x2 threads" in text
    assert "GPU decoder weighed: nvImageCodec (fake) GPU_ONLY" in text and f"node: {node}" in text
    if expect == "j2k":
        assert any("handed to nvidia.nvimgcodec" in n for n in profile.notes)


def test_profile_says_why_j2k_is_not_weighed(small: Path, tmp_path: Path) -> None:
    store = open_store(small, tmp_path / "store")
    no_gpu = profile_store(store, decoder="dali", threads=2, quick=True, formats=("j2k", "bmp"),
                           find_gpu=lambda decoder: (None, "no CUDA device is visible"))
    assert no_gpu.raw_format == "bmp" and [w["raw_format"] for w in no_gpu.weighed] == ["bmp"]
    assert any("J2K not weighed: no GPU to decode it (no CUDA device is visible)" in n for n in no_gpu.notes)
    with pytest.raises(ProfileError, match="J2K cannot be weighed: no GPU"):
        profile_store(store, decoder="dali", quick=True, formats=("j2k",), find_gpu=lambda decoder: (None, "none"))


def test_prepare_ratio_auto_stores_what_the_profile_chose(small: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``prepare --ratio auto --formats png,bmp,j2k``: J2K objects where the (fake) GPU makes them faster, BMP
    where there is no GPU; the profile kept in the store says which. (DALI, the default decoder, is a test
    dependency: without it the profile would weigh Pillow, and this test fails rather than skips.)"""
    def prepare(store: Path) -> dict:
        code = cli.main(["prepare", str(small), "--store", str(store), "--ratio", "auto", "--quick",
                         "--formats", "png,bmp,j2k", "--no-progress"])
        assert code == 0, capsys.readouterr().err
        return json.loads((store / "profile.json").read_text())

    # Storage bound and the CPU fast, as in the test above: this machine's own rates for 12 tiny files, measured
    # under a loaded run, put J2K's best share below BMP's now and then (its storage timed apart from BMP's).
    with monkeypatch.context() as fixed:
        _fixed_rates(fixed, storage=50e6, decode=1e6)
        fixed.setattr(decoderates, "find_gpu_decoder", _fake_gpu(5000.0, []))
        kept = prepare(tmp_path / "gpu")
    said = capsys.readouterr()
    assert kept["raw_format"] == "j2k" and "raw images as J2K" in said.out, said.out
    assert "J2K chosen for a loader that decodes with DALI's 'mixed'" in said.out  # for whom it is
    assert "not yet shown exact on a GPU" in said.err  # until bench_j2k shows dali-mixed exact
    objects = [p for p in (tmp_path / "gpu" / "objects").rglob("*") if p.is_file()]
    assert objects and all(p.suffix == ".jp2" for p in objects)

    monkeypatch.setattr(decoderates, "find_gpu_decoder", lambda decoder: (None, "no CUDA device is visible"))
    kept = prepare(tmp_path / "cpu")
    out = capsys.readouterr().out
    assert kept["raw_format"] == "bmp" and "J2K not weighed" in out and "raw images as BMP" in out
    objects = [p for p in (tmp_path / "cpu" / "objects").rglob("*") if p.is_file()]
    # How many are raw is the model's call on this machine's measured rates (on a loaded 2-core VM it has found
    # decoding the bound even with every image original: ratio 0); whatever it chose is BMP.
    assert bool(objects) == (kept["chosen"] > 0) and all(p.suffix == ".bmp" for p in objects)


@pytest.mark.parametrize("case", ["target-rate", "no-mount-token"])
def test_a_run_that_cannot_be_made_is_refused_before_anything_is_measured(small: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          case: str) -> None:
    """`--run` beside `--target-rate` (which chooses by the model), or a command that never names the mount:
    refused after the sample, storage and decode timings had run (minutes of measuring first)."""
    store = open_store(small, tmp_path / "store")

    def measured_first(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before the refusal")

    monkeypatch.setattr(type(store), "profile_sample", measured_first)
    run = "python train.py --data /data" if case == "no-mount-token" else "python train.py --data {mount}"
    with pytest.raises(ProfileError, match="--run: --target-rate" if case == "target-rate" else r"\{mount\}"):
        profile_store(store, decoder="pil", run=run, target_rate=100.0 if case == "target-rate" else None)


def test_the_builtin_pipelines_shuffle_buffer_is_of_the_images_the_sample_holds(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """A dataset of 40 images, 256 asked for: the built-in loader's shuffle buffer was 256 // 8 = 32, nearly the
    whole epoch (its reads then all come before its first batch: no overlap, the choice pushed to an end). Of
    the images copied: 5."""
    from types import SimpleNamespace

    from liquidfs.profile import choose
    from liquidfs.profile.measured import builtin_command

    class Scratch:
        images = 40

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> "Scratch":
            return self

        def __exit__(self, *args: object) -> None:
            pass

    class Stop(Exception):
        pass

    def search(*args: object, **kwargs: object) -> None:
        raise Stop

    monkeypatch.setattr(choose.runprofile, "ScratchMounts", Scratch)
    monkeypatch.setattr(choose.runprofile, "search", search)
    said: list[str] = []
    store: Any = SimpleNamespace(local_dirs=lambda: (tmp_path, tmp_path))
    with pytest.raises(Stop):
        choose._measured_search(store, lambda copied: builtin_command("pil", 4, copied), first=0.5, images=256,
                                repeats=1, timeout=10, cache_share=0.0, timed_epoch=1, progress=said.append)
    assert "--shuffle-buffer 5" in said[-1]
