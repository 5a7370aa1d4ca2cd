"""``mount --mix``: real mounts serving a share of the prepared images raw, read by real clients, while the share
moves (the adaptive controller steered by pressure files the test writes: ``--pressure-dir``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fusehelpers import DATA_PATHS, Mount, mounter_on_each_path, wait_for
from mixhelpers import PressureFiles, adaptive_mount, prepared_all_raw, read_checked
from liquidfs.prepare import prepare
from sample import make_sample

pytestmark = pytest.mark.fuse

mounter = pytest.fixture(params=DATA_PATHS, name="mounter")(mounter_on_each_path)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Path]]:
    """24 images, every one with a raw object (prepare --ratio 1). Not modified by any test."""
    return prepared_all_raw(tmp_path_factory.mktemp("mix"))


def _control(mnt: Path) -> dict:
    return json.loads((mnt / ".__liquidfs__").read_bytes())


def _adaptive_mount(prepared, mounter: Mount, tmp_path: Path, request: pytest.FixtureRequest,  # type: ignore[no-untyped-def]
                    *extra: str) -> tuple[Path, PressureFiles]:
    src, store, _ = prepared
    return adaptive_mount(src, store, mounter, tmp_path / "psi", request, *extra)


def test_a_fixed_share_serves_the_rest_as_originals(prepared, mounter: Mount) -> None:
    src, store, objects = prepared
    mnt = mounter.mount(src, "--mix", "0.5", store=store)
    served_raw = {rel: read_checked(mnt, rel, src, obj) for rel, obj in objects.items()}
    assert 4 <= sum(served_raw.values()) <= 20  # half of 24 in expectation, a seeded random choice
    for rel, raw in served_raw.items():  # the size stat shows is the one served
        assert (mnt / rel).stat().st_size == (objects[rel] if raw else src / rel).stat().st_size
        with Image.open(mnt / rel) as im, Image.open(src / rel) as ref:
            assert np.array_equal(np.asarray(im), np.asarray(ref))
    mix = _control(mnt)["mix"]
    assert mix["mode"] == "fixed" and mix["share"] == 0.5
    assert mix["opens_raw"] >= sum(served_raw.values()) and mix["opens_original"] > 0


def test_a_share_above_the_prepared_one_is_refused(tmp_path: Path, mounter: Mount) -> None:
    src = make_sample(tmp_path / "src", count=4, width=64, height=32, seed=2)
    store = tmp_path / "store"
    prepare(src, store, 0.5, progress=False)
    with pytest.raises(AssertionError, match="more than the store holds raw"):
        mounter.mount(src, "--mix", "0.9", store=store)


def test_adaptive_follows_the_pressure_and_every_read_stays_whole(prepared, mounter: Mount, tmp_path: Path,
                                                                   request: pytest.FixtureRequest) -> None:
    """Decoding binds (CPU pressure): the share rises to all raw; storage binds (IO pressure): it falls, files
    switch to their originals at their next first open; a file open across a switch keeps its bytes and size."""
    src, store, objects = prepared
    mnt, pressure = _adaptive_mount(prepared, mounter, tmp_path, request)
    assert _control(mnt)["mix"]["share"] == 0.5  # no profile in the store: the middle of [0, 1]
    rels = sorted(objects)
    last = dict.fromkeys(rels, True)  # what each file's last open served (the catalog's raw, before any)
    switches = 0

    def read_all() -> int:
        nonlocal switches
        for rel in rels:
            raw = read_checked(mnt, rel, src, objects[rel])
            switches += raw != last[rel]
            last[rel] = raw
        return sum(last.values())

    def share_becomes(test) -> str:
        """Read until the share passes ``test``; the reason the mount gave then. (Read later, after an interval
        without opens, it would be "hold: no opens in the last interval".)"""
        seen: dict = {}

        def moved() -> bool:
            read_all()  # opens: the controller decides only while the mount is used
            seen.update(_control(mnt)["mix"])
            return test(seen["share"])
        wait_for(moved, 60, interval=0.1, what="the mix to move")
        return seen["reason"]

    pressure.set(cpu=0.8, io=0.02)
    reason = share_becomes(lambda share: share == 1.0)
    assert read_all() == 24
    assert "decode binds" in reason or "top of the prepared" in reason

    held = open(mnt / rels[0], "rb")  # noqa: SIM115 - open across the switch on purpose
    held_size = os.fstat(held.fileno()).st_size
    assert held_size == objects[rels[0]].stat().st_size
    pressure.set(cpu=0.02, io=0.8)
    reason = share_becomes(lambda share: share <= 0.3)
    assert "storage binds" in reason or "bottom of the prepared" in reason
    with open(mnt / rels[0], "rb") as again:  # a second open while the first is open: same bytes, same size
        assert os.fstat(again.fileno()).st_size == held_size
        assert again.read() == objects[rels[0]].read_bytes()
    assert held.read() == objects[rels[0]].read_bytes()
    held.close()
    assert read_all() < 24
    assert _control(mnt)["mix"]["switches"] == switches > 0  # every open was the test's: the counts agree
    # DALI (mmap, its default) over the mount after the switch: every image decodes to the source's pixels.
    from dali_helpers import dali_decode_all

    root = "leftImg8bit/train"
    ours, theirs = dali_decode_all(mnt / root), dali_decode_all(src / root)
    assert len(ours) == len(theirs) == 24
    for name in theirs:
        assert np.array_equal(ours[name], theirs[name]), name
    stats = _control(mnt)
    assert stats["mix"]["decisions"] > 2
    assert stats["errors"] == 0


def test_held_originals_are_served_raw_once_the_share_rises(prepared, mounter: Mount, tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    """The next-epoch cache holds what it served. A file held as its original while the share was low would go
    on being served as held, costing the loader its PNG decode at every hit however far the share rises; once
    the mix wants it raw, the held original is let go and the raw object is read and held in its stead."""
    src, store, objects = prepared
    # A cache of the whole dataset, at what memfds cost (whole pages and an overhead each: 100% of its bytes
    # would not hold it all): every file read is held, in the representation it was served in.
    mnt, pressure = _adaptive_mount(prepared, mounter, tmp_path, request, "--cache-size", "16M")
    rels = sorted(objects)

    def read_all() -> int:
        return sum(read_checked(mnt, rel, src, objects[rel]) for rel in rels)

    first = read_all()  # at the starting share, 0.5: some served, and now held, as originals
    assert first < 24
    pressure.set(cpu=0.8, io=0.02)  # decoding binds: the share rises to all raw

    def risen() -> bool:
        read_all()
        return _control(mnt)["mix"]["share"] == 1.0
    wait_for(risen, 60, interval=0.1, what="the share to reach 1.0")
    assert read_all() == 24  # every file raw, the ones held as originals included
    before = _control(mnt)
    assert 0 < before["held_swapped"] <= 24 - first and before["reclaimed"] == 0
    # the policy counts what it holds at the size held: the raw copies (and, in memfds, their pages' rounding and
    # overhead), within the budget
    raw_bytes = sum(objects[rel].stat().st_size for rel in rels)
    assert before["cache_held_files"] == 24
    assert raw_bytes <= before["cache_held_bytes"] <= before["cache_budget"]
    if before["data_path"] == "daemon":
        assert before["cache_held_bytes"] == raw_bytes
    assert read_all() == 24  # ... and held raw now: an epoch of hits, nothing read from storage
    after = _control(mnt)
    assert after["bytes_from_storage"] == before["bytes_from_storage"]
    assert after["held_swapped"] == before["held_swapped"] and after["errors"] == 0
    for rel in rels[:4]:
        with Image.open(mnt / rel) as im, Image.open(src / rel) as ref:
            assert np.array_equal(np.asarray(im), np.asarray(ref))

