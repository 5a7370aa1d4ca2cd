"""Memory as prepare sees it (``liquidfs.expand.workers``): cgroup v1/v2 and meminfo parsing, the worker count under a
small limit, and the images refused (served as their originals) rather than a worker OOM-killed. In-process; the
mount that serves those originals is tests/mount/test_resources_mount.py."""

from __future__ import annotations

import io
import logging
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from liquidfs.expand import expansion
from liquidfs.expand import formats
from liquidfs import prepare as prepare_mod
from liquidfs.expand import workers as resources
from liquidfs.catalog.catalog import Catalog
from liquidfs.expand.expansion import expand_bytes
from liquidfs.prepare import prepare
from liquidfs.expand.workers import (WORKER_BASE_BYTES, available_memory, expansion_need, headroom, parse_limit,
                                 parse_meminfo, parse_stat, plan_workers)
from liquidfs.sysio.cgroups import parse_cgroup_paths
from smallmachine import MiB, fake_machine, limit_for, photo_png, two_images

GiB = 1 << 30

MEMINFO = """MemTotal:       32768000 kB
MemFree:         1000000 kB
MemAvailable:    4000000 kB
Buffers:          100000 kB
"""

V1_CGROUP = """9:name=systemd:/
5:devices:/
4:memory:/process_api/8724c73abe85f52ff533c6bdf458ce05
3:cpu,cpuacct:/
0::/
"""


# -- parsers ---------------------------------------------------------------------------------------------


def test_proc_self_cgroup_gives_the_v2_path_and_the_v1_memory_path() -> None:
    assert parse_cgroup_paths("0::/kubepods.slice/pod1/cri-abc.scope\n") == ("/kubepods.slice/pod1/cri-abc.scope",
                                                                              None)
    assert parse_cgroup_paths(V1_CGROUP) == ("/", "/process_api/8724c73abe85f52ff533c6bdf458ce05")
    assert parse_cgroup_paths("7:cpu,memory,pids:/docker/abc\n") == (None, "/docker/abc")
    assert parse_cgroup_paths("4:memory:/a:b\n") == (None, "/a:b")  # a colon in the path is the path's
    assert parse_cgroup_paths("") == (None, None)


def test_limits_max_and_huge_v1_values_mean_none() -> None:
    assert parse_limit("536870912\n") == 512 * MiB
    assert parse_limit("max\n") is None  # v2
    assert parse_limit("9223372036854771712\n") is None  # v1: 2**63 - 1 rounded down to a 4 KiB page
    assert parse_limit("9223372036854775807") is None
    with pytest.raises(ValueError):
        parse_limit("lots")


def test_meminfo_available_in_bytes() -> None:
    assert parse_meminfo(MEMINFO) == 4_000_000 * 1024
    assert parse_meminfo("MemTotal: 100 kB\nMemFree: 50 kB\n") is None  # kernels before 3.14


def test_headroom_leaves_out_inactive_page_cache() -> None:
    stat_v2 = "anon 300000000\nfile 700000000\ninactive_file 209715200\nactive_file 100\n"
    assert parse_stat(stat_v2, "inactive_file") == 200 * MiB
    assert headroom(f"{GiB}\n", f"{600 * MiB}\n", stat_v2) == GiB - 400 * MiB
    assert headroom(f"{GiB}\n", f"{600 * MiB}\n") == GiB - 600 * MiB
    assert headroom("max\n", "123\n", stat_v2) is None
    assert headroom("9223372036854771712\n", "123\n") is None
    stat_v1 = "cache 5\ninactive_file 1\ntotal_inactive_file 104857600\n"
    assert headroom(f"{GiB}\n", f"{GiB + MiB}\n", stat_v1, "total_inactive_file") == 99 * MiB
    assert headroom(f"{GiB}\n", f"{2 * GiB}\n") == 0  # over its limit (kmem, a race): nothing left, not < 0


def _write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text)


def test_available_memory_is_the_least_of_meminfo_and_every_cgroup_level(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _write(proc, meminfo=MEMINFO)
    _write(proc / "self", cgroup="0::/pods/pod1/app\n")
    cg = tmp_path / "cgroup"
    _write(cg, cgroup__controllers="memory\n")  # the root has no memory.max
    _write(cg / "pods" / "pod1", memory__max=f"{GiB}\n", memory__current=f"{900 * MiB}\n",
           memory__stat=f"inactive_file {100 * MiB}\n")
    _write(cg / "pods" / "pod1" / "app", memory__max="max\n", memory__current=f"{700 * MiB}\n")
    # the pod's limit binds, less what is not reclaimable: 1 GiB - (900 - 100) MiB
    assert available_memory(str(cg), str(proc)) == 224 * MiB
    # a looser limit everywhere: MemAvailable binds
    _write(cg / "pods" / "pod1", memory__max=f"{64 * GiB}\n")
    assert available_memory(str(cg), str(proc)) == 4_000_000 * 1024
    # nothing readable at all: unknown
    assert available_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_available_memory_under_cgroup_v1_and_in_a_cgroup_namespace(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _write(proc, meminfo=MEMINFO)
    _write(proc / "self", cgroup=V1_CGROUP)
    mem = tmp_path / "cgroup" / "memory"
    _write(mem, memory__limit_in_bytes="9223372036854771712\n", memory__usage_in_bytes="10631467008\n")
    own = mem / "process_api" / "8724c73abe85f52ff533c6bdf458ce05"
    _write(own, memory__limit_in_bytes=f"{2 * GiB}\n", memory__usage_in_bytes=f"{GiB}\n",
           memory__stat=f"total_inactive_file {256 * MiB}\n")
    assert available_memory(str(tmp_path / "cgroup"), str(proc)) == GiB + 256 * MiB
    # in a cgroup namespace the path is "/" and the mount's root is the process's own cgroup
    _write(proc / "self", cgroup="4:memory:/\n")
    _write(mem, memory__limit_in_bytes=f"{512 * MiB}\n", memory__usage_in_bytes=f"{500 * MiB}\n")
    assert available_memory(str(tmp_path / "cgroup"), str(proc)) == 12 * MiB


# -- the worker count ------------------------------------------------------------------------------------


def test_the_worker_count_is_lowered_to_what_fits(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    per_worker = WORKER_BASE_BYTES + expansion_need(formats.MAX_PIXELS, 10 * MiB)
    fake_machine(monkeypatch, 3 * per_worker + MiB)
    plan = plan_workers(None, max_pixels=formats.MAX_PIXELS, largest_source=10 * MiB)
    assert plan.workers == 3
    assert plan.budget is not None and plan.budget >= expansion_need(formats.MAX_PIXELS, 10 * MiB)
    caplog.set_level(logging.WARNING, logger="liquidfs.expand.workers")
    assert plan_workers(8, max_pixels=formats.MAX_PIXELS, largest_source=10 * MiB).workers == 3
    assert "--jobs: 8 workers lowered to 3" in caplog.text
    caplog.clear()
    assert plan_workers(2, max_pixels=formats.MAX_PIXELS, largest_source=10 * MiB).workers == 2  # fits: kept
    assert not caplog.text
    # a small limit: one worker, whose budget says which images it must refuse
    fake_machine(monkeypatch, 500 * MiB)
    plan = plan_workers(None, max_pixels=formats.MAX_PIXELS, largest_source=10 * MiB)
    assert (plan.workers, plan.budget) == (1, 500 * MiB - WORKER_BASE_BYTES)
    assert "no-memory" in caplog.text
    # memory unknown: the cores, no budget
    fake_machine(monkeypatch, None)
    assert plan_workers(None, max_pixels=formats.MAX_PIXELS, largest_source=0) == resources.WorkerPlan(8, None, None)


def test_the_largest_source_counts_in_what_a_worker_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    per_worker = WORKER_BASE_BYTES + expansion_need(formats.MAX_PIXELS, 0)
    fake_machine(monkeypatch, 4 * per_worker)
    assert plan_workers(None, max_pixels=formats.MAX_PIXELS, largest_source=0).workers == 4
    assert plan_workers(None, max_pixels=formats.MAX_PIXELS, largest_source=100 * MiB).workers == 3


# -- refusing what would not fit -------------------------------------------------------------------------


def _bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height, with almost no data behind it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1000))
            + chunk(b"IEND", b""))


def test_header_pixel_count_without_decoding() -> None:
    assert formats.pixel_count(photo_png(64, 32, 1)) == 64 * 32
    jpeg = io.BytesIO()
    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(jpeg, format="JPEG")
    assert formats.pixel_count(jpeg.getvalue()) == 40 * 30
    assert formats.pixel_count(_bomb_png(50_000, 1_000)) == 50_000_000
    assert formats.pixel_count(b"not an image") is None
    assert formats.pixel_count(b"\x89PNG\r\n\x1a\n") is None


def test_an_image_over_the_budget_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*args: object, **kw: object) -> None:
        raise AssertionError("decoded an image that does not fit")

    bomb = _bomb_png(50_000, 1_000)  # 50 Mpx: under max_pixels, 1.2 GB to expand
    monkeypatch.setattr(expansion, "_budget", 256 * MiB)
    with monkeypatch.context() as m:
        m.setattr(formats, "expand", no_decoding)
        refusal, raw, fmt = expand_bytes(b"bomb.png", len(bomb), 0, bomb)
    assert raw is None and refusal is not None
    assert (refusal.reason, fmt) == ("no-memory", "png")
    assert prepare_mod._transient(refusal.reason)  # not remembered: a run with more memory tries it again
    # within the budget it is expanded; past max_pixels it stays too-large, a lasting refusal
    small = photo_png(64, 32, 2)
    assert expand_bytes(b"small.png", len(small), 0, small)[1] is not None
    huge = _bomb_png(100_000, 100_000)
    refusal, raw, _ = expand_bytes(b"huge.png", len(huge), 0, huge)
    assert raw is None and refusal is not None and refusal.reason == "too-large"
    # no budget known: nothing is refused for memory, the image goes on to expand
    monkeypatch.setattr(expansion, "_budget", None)
    monkeypatch.setattr(formats, "expand", lambda data, **kw: formats.Expansion(None, "png", "reached-expand"))
    refusal, raw, _ = expand_bytes(b"bomb.png", len(bomb), 0, bomb)
    assert raw is None and refusal is not None and refusal.reason == "reached-expand"


def test_memory_short_while_decoding_and_a_fault_of_ours_are_tried_again_by_the_next_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A MemoryError while decoding is this run's memory (it was "too-large", remembered until the source
    changed); any other exception in a worker is one image's, never the whole prepare's traceback."""
    small = photo_png(64, 32, 2)

    def short(data: bytes, **kw: object) -> None:
        raise MemoryError

    with monkeypatch.context() as m:
        m.setattr(formats, "expand", short)
        refusal, raw, _ = expand_bytes(b"small.png", len(small), 0, small)
    assert raw is None and refusal is not None and refusal.reason == "no-memory"
    src = tmp_path / "data"
    src.mkdir()
    (src / "a.png").write_bytes(small)

    def broken(*args: object, **kw: object) -> None:
        raise TypeError("a defect of ours")

    st = (src / "a.png").stat()
    with monkeypatch.context() as m:
        m.setattr(expansion, "expand_bytes", broken)
        outcome = expansion.expand_one(os.fsencode(src), b"a.png", str(tmp_path / "store"), "objects/ab/a",
                                       st.st_size, st.st_mtime_ns, None)
    assert outcome.reason == "worker-error:TypeError" and outcome.object is None
    assert prepare_mod._transient(outcome.reason)  # not remembered: the next run tries the image again


def test_prepare_under_a_small_limit_skips_what_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    small, big = two_images(tmp_path / "data")
    limit_for(small, monkeypatch)
    store = tmp_path / "store"
    caplog.set_level(logging.INFO, logger="liquidfs.expand.workers")
    report = prepare(tmp_path / "data", store, 1.0, progress=False)
    assert "4 workers lowered to 1" in caplog.text
    assert report.skipped == {"no-memory": 1}, report.lines()
    assert report.raw_served == 1 and report.expanded == 1
    assert any(line.startswith("skipped            1 (no-memory: 1)") for line in report.lines())
    catalog = Catalog.open(store)
    try:
        served = {n.path: n.representation for n in catalog.files()}
        recorded = {row[0] for row in catalog.db.execute("SELECT path FROM expansions")}
    finally:
        catalog.close()
    assert served == {b"small.png": 1, b"big.png": 0}  # big.png is served as its original
    assert b"big.png" not in recorded  # and not remembered as refused
    # with the memory back, the next run expands it
    monkeypatch.undo()
    again = prepare(tmp_path / "data", store, 1.0, progress=False)
    assert (again.raw_served, again.expanded, again.reused, dict(again.skipped)) == (2, 1, 1, {})


def test_an_explicit_jobs_over_the_limit_is_lowered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    small, _ = two_images(tmp_path / "data")
    limit_for(small, monkeypatch)
    caplog.set_level(logging.WARNING, logger="liquidfs.expand.workers")
    report = prepare(tmp_path / "data", tmp_path / "store", 1.0, jobs=4, progress=False)
    assert "--jobs: 4 workers lowered to 1" in caplog.text
    assert report.skipped == {"no-memory": 1}


def test_a_source_larger_than_any_image_expand_accepts_is_not_planned_for() -> None:
    """One sparse file of a terabyte named *.png (it costs whoever writes the dataset nothing) cut a whole prepare
    to a single worker, planned for as the largest image; it is refused by its worker instead."""
    from liquidfs.expand.workers import MAX_PLANNED_SOURCE, largest_planned

    assert largest_planned([5 * MiB, 1 << 40, 7 * MiB]) == 7 * MiB
    assert largest_planned([MAX_PLANNED_SOURCE]) == MAX_PLANNED_SOURCE and largest_planned([]) == 0


def test_the_default_workers_follow_a_containers_cpu_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The default took the CPU affinity alone: in a pod limited to 4 of 64 cores, 64 workers, each with room for
    the largest image. The cores a cgroup's cpu.max allows count (``cgroups.usable_cores``)."""
    from liquidfs.sysio import cgroups

    monkeypatch.setattr(resources, "available_memory", lambda *a, **k: None)
    monkeypatch.setattr(cgroups, "cpu_count", lambda: 64)
    (tmp_path / "cgroup" / "pod").mkdir(parents=True)
    (tmp_path / "cgroup" / "pod" / "cpu.max").write_text("400000 100000\n")
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/pod\n")
    real = cgroups.usable_cores
    monkeypatch.setattr(resources, "usable_cores", lambda: real(str(tmp_path / "cgroup"), str(tmp_path / "proc")))
    assert plan_workers(None, max_pixels=formats.MAX_PIXELS, largest_source=0).workers == 4
