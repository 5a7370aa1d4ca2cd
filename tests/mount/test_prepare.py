"""prepare / verify, and a real mount serving the mix: pixels identical, fallbacks on any doubt."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from forge import as_before_blake2b
from fusehelpers import Mount, wait_for
from liquidfs.catalog.catalog import Catalog
from liquidfs.expand.expansion import rank
from liquidfs.prepare import prepare, verify
from sample import make_sample, mosaic, _photos

import random


def _modes_tree(root: Path) -> Path:
    """One class directory per PNG mode (and JPEG), real photo content."""
    rng = random.Random(5)
    photos = _photos()
    base = mosaic(160, 96, rng, photos)
    variants: dict[str, Image.Image] = {
        "rgb": base,
        "gray": base.convert("L"),
        "gray_alpha": base.convert("LA"),
        "rgba": base.convert("RGBA"),
        "palette": base.quantize(64),
    }
    alpha = base.convert("RGBA")
    a = np.asarray(alpha).copy()
    a[::7, :, 3] = 0
    variants["rgba_holes"] = Image.fromarray(a, "RGBA")
    pal = base.quantize(16)
    pal.info["transparency"] = 3
    variants["palette_trns"] = pal
    for name, img in variants.items():
        folder = root / name
        folder.mkdir(parents=True)
        img.save(folder / "plain.png")
        img.save(folder / "interlaced.png", interlace=1) if img.mode != "P" or "transparency" not in img.info \
            else img.save(folder / "interlaced.png", interlace=1, transparency=3)
    jpeg = root / "jpeg"
    jpeg.mkdir()
    base.save(jpeg / "photo.jpg", quality=90)
    base.convert("L").save(jpeg / "gray.jpg", quality=90)
    base.save(jpeg / "really-a-jpeg.png", format="JPEG", quality=85)
    return root


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        im.load()
        return np.asarray(im)


@pytest.fixture(scope="module")
def modes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _modes_tree(tmp_path_factory.mktemp("modes") / "data")


@pytest.mark.fuse
def test_every_mode_round_trips_through_the_mount(modes: Path, mounter: Mount, tmp_path: Path) -> None:
    from dali_helpers import dali_decode_all

    store = tmp_path / "store"
    report = prepare(modes, store, 1.0, progress=False)
    assert report.raw_served >= 10, report.lines()
    mnt = mounter.mount(modes, store=store)
    served_raw = []
    for src in sorted(modes.rglob("*.*")):
        rel = src.relative_to(modes)
        through = mnt / rel
        if through.read_bytes()[:2] == b"BM":
            served_raw.append(str(rel))
        a, b = _pixels(through), _pixels(src)
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), rel
        with Image.open(through) as x, Image.open(src) as y:
            assert x.mode == y.mode, rel
    for must in ["rgb/plain.png", "rgb/interlaced.png", "gray/plain.png", "palette/plain.png", "jpeg/photo.jpg",
                 "jpeg/really-a-jpeg.png"]:
        assert must in served_raw, f"{must} should be served raw; raw: {served_raw}"
    ours = dali_decode_all(mnt)
    theirs = dali_decode_all(modes)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        if name.startswith("jpeg/"):
            # DALI's JPEG decoder may differ from libjpeg-turbo (what the BMP holds) by a level or so
            diff = np.abs(ours[name].astype(int) - theirs[name].astype(int))
            assert ours[name].shape == theirs[name].shape and diff.max() <= 4, (name, diff.max())
        else:
            assert np.array_equal(ours[name], theirs[name]), name
    try:
        import cv2
    except ImportError:
        if os.environ.get("CI"):
            raise  # the test extras install OpenCV: in CI its checks run
        return
    for rel in served_raw:
        if rel.startswith("jpeg/"):
            continue
        for flag in (cv2.IMREAD_UNCHANGED, cv2.IMREAD_COLOR):
            a = cv2.imread(str(mnt / rel), flag)
            b = cv2.imread(str(modes / rel), flag)
            assert a.shape == b.shape and np.array_equal(a, b), (rel, flag)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sample(tmp_path_factory.mktemp("sample") / "data", count=40, width=128, height=64, seed=3)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_served_share_matches_ratio(sample: Path, tmp_path: Path, ratio: float) -> None:
    report = prepare(sample, tmp_path / "store", ratio, progress=False)
    eligible = report.candidates - sum(report.skipped.values())
    assert report.candidates == 40 and eligible == 40
    assert abs(report.raw_served / eligible - ratio) <= 1 / eligible
    catalog = Catalog.open(tmp_path / "store")
    raw = [n for n in catalog.files() if n.served_raw]
    assert len(raw) == report.raw_served
    catalog.close()


def test_selection_is_seeded_and_ratio_changes_reuse(sample: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = prepare(sample, store, 0.5, seed=7, progress=False)
    assert first.expanded == 20
    chosen = _raw_paths(store)
    # the choice is the best-ranked half for this seed: reproducible, independent of completion order
    everything = sorted((n for n in _all_paths(store)), key=lambda p: rank(7, p))
    assert chosen == set(everything[:20])
    more = prepare(sample, store, 0.75, seed=7, progress=False)
    assert more.reused == 20 and more.expanded == 10 and chosen < _raw_paths(store)
    fewer = prepare(sample, store, 0.25, seed=7, progress=False)
    assert fewer.expanded == 0 and fewer.deleted == 20
    assert len(list((store / "objects").rglob("*.bmp"))) == 10
    assert verify(store, progress=False) == []


def test_prepare_stamps_each_object_it_writes_and_a_rescan_keeps_the_stamps(tmp_path: Path) -> None:
    """Each object's stamp (inode, ctime, size) is taken when it is written: mounts trust an object whose stamp
    is unchanged. A rescan carries the stamps over with the selection."""
    from liquidfs.catalog.build import open_or_build
    from liquidfs.catalog.identity import object_stamp

    src = make_sample(tmp_path / "data", count=4, width=128, height=64, seed=3)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store)
    stamps = {n.path: n.object_stamp for n in catalog.files() if n.served_raw}
    objects = {n.path: store / str(n.object) for n in catalog.files() if n.served_raw}
    catalog.close()
    assert len(stamps) == 4 and all(stamps[p] == object_stamp(objects[p].stat()) for p in stamps)
    (src / "new.txt").write_text("a new file: the catalog is built again\n")
    catalog = open_or_build(src, store)
    try:
        assert {n.path: n.object_stamp for n in catalog.files() if n.served_raw} == stamps
    finally:
        catalog.close()


def _raw_paths_of(catalog: Catalog) -> set[bytes]:
    return {n.path for n in catalog.files() if n.served_raw}


def _raw_paths(store: Path) -> set[bytes]:
    catalog = Catalog.open(store)
    try:
        return _raw_paths_of(catalog)
    finally:
        catalog.close()


def _all_paths(store: Path) -> list[bytes]:
    catalog = Catalog.open(store)
    try:
        return [n.path for n in catalog.files() if n.path.endswith(b".png")]
    finally:
        catalog.close()


def test_prepare_never_writes_the_source(sample: Path, tmp_path: Path) -> None:
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in sample.rglob("*")}
    prepare(sample, tmp_path / "store", 1.0, progress=False)
    assert before == {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in sample.rglob("*")}


def test_resume_after_kill_9(tmp_path: Path) -> None:
    src = make_sample(tmp_path / "data", count=48, width=768, height=384, seed=4)
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "liquidfs", "prepare", str(src), "--store", str(store), "--ratio", "1",
           "--no-progress", "--jobs", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(lambda: len(list((store / "objects").rglob("*.bmp"))) >= 6 if (store / "objects").exists()
                 else False, 120, interval=0.02, what="some objects")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    done_before = len(list((store / "objects").rglob("*.bmp")))
    assert done_before < 48, "prepare finished before it could be killed; make the sample larger"
    again = run_cli("prepare", str(src), "--store", str(store), "--ratio", "1", "--no-progress")
    expanded_now = int(again.stdout.split("expanded now")[0].rsplit("; ", 1)[1].split()[0].strip("("))
    assert "served raw         48" in again.stdout
    assert expanded_now <= 48 - done_before, again.stdout  # finished objects were not redone
    assert not list(store.rglob("*.tmp-*")), "a half-written object is visible"
    assert run_cli("verify", "--store", str(store), "--no-progress").returncode == 0


def _bad_inputs(root: Path) -> dict[str, str]:
    """name -> the reason class prepare must give."""
    root.mkdir(parents=True)
    good = mosaic(64, 32, random.Random(1), _photos())
    good.save(root / "good.png")
    (root / "empty.png").write_bytes(b"")
    (root / "text.png").write_text("not an image at all\n")
    data = (root / "good.png").read_bytes()
    (root / "truncated.png").write_bytes(data[: len(data) // 2])
    corrupt = bytearray(data)
    corrupt[len(corrupt) // 2: len(corrupt) // 2 + 64] = b"\xff" * 64
    (root / "corrupt.png").write_bytes(bytes(corrupt))
    Image.fromarray((np.arange(64 * 32, dtype=np.uint16).reshape(32, 64) * 31)).save(root / "deep16.png")
    # a PNG header declaring 100000 x 100000 pixels: must be refused without allocating them
    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))  # noqa: E731
    (root / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) +
                                    chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b""))
    return {"good.png": "", "empty.png": "x", "text.png": "x", "truncated.png": "x", "corrupt.png": "x",
            "deep16.png": "x", "bomb.png": "x"}


@pytest.mark.fuse
def test_bad_input_is_skipped_and_served_unchanged(tmp_path: Path, mounter: Mount) -> None:
    src = tmp_path / "data"
    expected = _bad_inputs(src)
    store = tmp_path / "store"
    out = run_cli("prepare", str(src), "--store", str(store), "--ratio", "1", "--no-progress")
    assert "Traceback" not in out.stderr
    catalog = Catalog.open(store)
    reasons = dict(catalog.db.execute("SELECT path, reason FROM expansions").fetchall())
    catalog.close()
    for name, want in expected.items():
        if want:
            assert reasons.get(name.encode()), f"{name} should be skipped with a reason: {reasons}"
    assert reasons.get(b"good.png") is None
    assert "skipped            6" in out.stdout, out.stdout
    mnt = mounter.mount(src, store=store)
    for name in expected:
        assert (mnt / name).read_bytes() == (src / name).read_bytes() or name == "good.png"
    assert (mnt / "good.png").read_bytes()[:2] == b"BM"


@pytest.mark.fuse
def test_fallbacks_never_serve_stale_or_broken_objects(tmp_path: Path, mounter: Mount) -> None:
    src = make_sample(tmp_path / "data", count=6, width=128, height=64, seed=9)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store)
    nodes = [n for n in catalog.files() if n.served_raw]
    catalog.close()
    changed, missing, corrupt, truncated = nodes[:4]
    # the source changed after prepare: new pixels must be served, not the stale expansion
    new = mosaic(128, 64, random.Random(99), _photos())
    time.sleep(0.01)
    new.save(src / os.fsdecode(changed.path))
    (store / str(missing.object)).unlink()
    obj = store / str(corrupt.object)
    raw = bytearray(obj.read_bytes())
    raw[-10] ^= 0xFF
    obj.write_bytes(bytes(raw))
    obj = store / str(truncated.object)
    obj.write_bytes(obj.read_bytes()[:-100])
    mnt = mounter.mount(src, store=store)
    for node in (changed, missing, corrupt, truncated):
        rel = os.fsdecode(node.path)
        data = (mnt / rel).read_bytes()
        assert data == (src / rel).read_bytes(), rel
        wait_for(lambda: os.stat(mnt / rel).st_size == len(data), 10, what="size corrected to what is served")
        assert np.array_equal(_pixels(mnt / rel), _pixels(src / rel))
    assert np.array_equal(_pixels(mnt / os.fsdecode(changed.path)), np.asarray(new))
    stats = json.loads((mnt / ".__liquidfs__").read_bytes())
    assert stats["fallbacks"] == 4
    # the untouched ones are still served raw
    assert (mnt / os.fsdecode(nodes[4].path)).read_bytes()[:2] == b"BM"
    failures = verify(store, progress=False)
    assert len(failures) == 4


def test_verify_sample_and_exit_codes(sample: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    prepare(sample, store, 0.5, progress=False)
    assert run_cli("verify", "--store", str(store), "--sample", "5", "--no-progress").returncode == 0
    obj = next((store / "objects").rglob("*.bmp"))
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))
    bad = run_cli("verify", "--store", str(store), "--no-progress", check=False)
    assert bad.returncode == 1 and "FAIL" in bad.stdout
    missing = run_cli("verify", "--store", str(tmp_path / "nothing"), check=False)
    assert missing.returncode == 2 and "no catalog" in missing.stderr


@pytest.mark.fuse
def test_a_store_prepared_with_xxh3_digests_is_vouched_for_by_stamps_until_prepare_records_blake2b(
        tmp_path: Path, mounter: Mount) -> None:
    """A store from before BLAKE2b: its catalog records xxh3 digests. A raw object its stamp vouches for is served
    raw as before; one touched since prepare is served as its original (a fallback), as no xxh3 digest vouches
    for bytes a writer of the store may have chosen; verify fails them all and says to run prepare again. That
    prepare makes them again and records their BLAKE2b digests: it never carries an xxh3 digest forward."""
    src = make_sample(tmp_path / "data", count=4, width=128, height=64, seed=8)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    assert as_before_blake2b(store) == 4
    catalog = Catalog.open(store)
    touched, *kept = [n for n in catalog.files() if n.served_raw]
    catalog.close()
    os.chmod(store / str(touched.object), 0o640)  # the same bytes; the stamp no longer vouches
    out = run_cli("verify", "--store", str(store), "--no-progress", check=False)
    assert out.returncode == 1 and out.stdout.count("liquidfs prepare") == 4, out.stdout
    mnt = mounter.mount(src, store=store)
    rel = os.fsdecode(touched.path)
    assert (mnt / rel).read_bytes() == (src / rel).read_bytes()
    for node in kept:
        assert (mnt / os.fsdecode(node.path)).read_bytes() == (store / str(node.object)).read_bytes()
    assert json.loads((mnt / ".__liquidfs__").read_bytes())["fallbacks"] == 1
    mounter.umount(mnt)
    report = prepare(src, store, 1.0, progress=False)
    assert report.raw_served == 4 and report.expanded + report.reused == 4
    catalog = Catalog.open(store)
    try:
        for table in ("nodes", "expansions"):
            rows = catalog.db.execute(f"SELECT object, checksum FROM {table} WHERE object IS NOT NULL").fetchall()
            assert len(rows) == 4
            for obj, digest in rows:
                assert digest == hashlib.blake2b((store / obj).read_bytes(), digest_size=32).hexdigest(), table
    finally:
        catalog.close()
    assert run_cli("verify", "--store", str(store), "--no-progress").returncode == 0


def test_incompatible_catalog_is_refused(sample: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    prepare(sample, store, 0.0, progress=False)
    catalog = Catalog.open(store)
    catalog.set_meta("schema_version", "999")
    catalog.close()
    out = run_cli("prepare", str(sample), "--store", str(store), "--ratio", "0.5", check=False)
    assert out.returncode == 1 and "schema version 999" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.needs_root("mounting a small tmpfs for the store")
def test_out_of_disk_space_is_clear_and_consistent(tmp_path: Path) -> None:
    src = make_sample(tmp_path / "data", count=12, width=512, height=256, seed=2)
    store = tmp_path / "small"
    store.mkdir()
    # mode: a tmpfs's root is 1777 by default, a store others may make names in (refused)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(store)],
                             capture_output=True)
    if mounted.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot make a small tmpfs for the ENOSPC test: {mounted.stderr!r}")
        pytest.skip("cannot mount tmpfs here")
    try:
        out = run_cli("prepare", str(src), "--store", str(store), "--ratio", "1", "--no-progress", check=False)
        assert out.returncode == 1 and "out of disk space" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert not list(store.rglob("*.tmp-*"))
        catalog = Catalog.open(store)
        assert all(n.representation == 0 for n in catalog.files())  # previous selection (none) still served
        catalog.close()
    finally:
        subprocess.run(["umount", str(store)], check=True)


def test_prepare_cli_summary_and_bad_ratio(sample: Path, tmp_path: Path) -> None:
    out = run_cli("prepare", str(sample), "--store", str(tmp_path / "s"), "--ratio", "50%", "--no-progress")
    for word in ["served raw", "skipped", "raw objects", "dataset served"]:
        assert word in out.stdout
    bad = run_cli("prepare", str(sample), "--store", str(tmp_path / "s"), "--ratio", "1.5", check=False)
    assert bad.returncode == 2 and "ratio" in bad.stderr


def test_an_image_that_kills_its_worker_is_refused_and_the_rest_expanded(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed mid-expansion (a decoder that crashes on a crafted file, the OOM killer) loses prepare's
    whole pool: every job in it runs again alone, the one that kills its worker is refused for good (served as
    its original), and the others are expanded. The next run does not try it again; a change of it does."""
    from crashers import expand_or_die

    from liquidfs.stores.local.store import LocalStore

    src = make_sample(tmp_path / "data", count=6, width=64, height=32, seed=7)
    store = tmp_path / "store"
    images = sorted(p.relative_to(src) for p in src.rglob("*.png"))
    doomed = os.fsencode(images[2])
    job = LocalStore.expansion_job

    def deadly(self: LocalStore, *args: object) -> object:
        func, job_args = job(self, *args)  # type: ignore[arg-type]
        return expand_or_die, (doomed, func, *job_args)

    monkeypatch.setattr(LocalStore, "expansion_job", deadly)
    report = prepare(src, store, 1.0, progress=False, jobs=2)
    # Expanded, or adopted: a job lost with the pool after its object was written is run again alone and finds
    # exactly its bytes there (reused), as a killed run's next run does.
    assert report.skipped == {"worker-died": 1} and report.expanded + report.reused == len(images) - 1, report
    catalog = Catalog.open(store, readonly=True)
    served = {n.path: n.served_raw for n in catalog.files() if n.path.endswith(b".png")}
    catalog.close()
    assert served == {os.fsencode(p): os.fsencode(p) != doomed for p in images}
    again = prepare(src, store, 1.0, progress=False, jobs=2)  # remembered: no worker is lost to it again
    assert again.skipped == {"worker-died": 1} and again.expanded == 0 and again.reused == len(images) - 1
    monkeypatch.setattr(LocalStore, "expansion_job", job)
    fresh = src / "fresh.tmp"
    fresh.write_bytes((src / images[0]).read_bytes())
    fresh.replace(src / os.fsdecode(doomed))  # replaced (as a dataset's files are): tried anew
    assert prepare(src, store, 1.0, progress=False, jobs=2).expanded == 1


def test_verify_of_an_object_whose_check_kills_its_worker_names_that_one_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same in `verify`: the checks lost with a dead worker's pool run again alone, and only the one whose
    check kills its worker is a failure, said in a line, never a traceback."""
    from crashers import expand_or_die

    from liquidfs.stores.local.store import LocalStore

    src = make_sample(tmp_path / "data", count=6, width=64, height=32, seed=8)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False, jobs=2)
    verify_jobs = LocalStore.verify_jobs
    doomed: list[bytes] = []

    def deadly(self: LocalStore) -> object:
        nodes, job = verify_jobs(self)
        doomed.append(nodes[1].path)

        def wrapped(node: object) -> object:
            func, job_args = job(node)  # type: ignore[arg-type]
            return expand_or_die, (doomed[0], func, *job_args)
        return nodes, wrapped

    monkeypatch.setattr(LocalStore, "verify_jobs", deadly)
    failures = verify(store, jobs=2, progress=False)
    assert [path for path, _ in failures] == [os.fsdecode(doomed[0])], failures
    assert "killed the worker process" in failures[0][1]


def test_workers_that_die_with_nothing_to_do_stop_prepare_and_refuse_no_image(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a new worker dies even with nothing to do (the node out of memory), a job lost with it says nothing
    of its image: prepare stops, saying so, and refuses none of them for good; the next run tries them."""
    from crashers import expand_or_die

    import liquidfs.prepare as preparing
    from liquidfs.stores.local.store import LocalStore

    src = make_sample(tmp_path / "data", count=4, width=64, height=32, seed=9)
    store = tmp_path / "store"
    doomed = os.fsencode(sorted(p.relative_to(src) for p in src.rglob("*.png"))[0])
    job = LocalStore.expansion_job

    def deadly(self: LocalStore, *args: object) -> object:
        func, job_args = job(self, *args)  # type: ignore[arg-type]
        return expand_or_die, (doomed, func, *job_args)

    monkeypatch.setattr(LocalStore, "expansion_job", deadly)
    monkeypatch.setattr(preparing, "_workers_live", lambda new_pool: False)
    with pytest.raises(preparing.PrepareError, match="worker processes die before doing any work"):
        prepare(src, store, 1.0, progress=False, jobs=1)
    monkeypatch.setattr(LocalStore, "expansion_job", job)
    monkeypatch.undo()
    report = prepare(src, store, 1.0, progress=False, jobs=1)
    assert not report.skipped and report.raw_served == 4, report


def test_verify_where_workers_die_with_nothing_to_do_says_so_in_a_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        restore_logging: None) -> None:
    """`liquidfs verify` on a node where new workers die even idle: no object is blamed, and the command ends
    with one line that says why (exit 2), never a traceback."""
    from crashers import expand_or_die

    import liquidfs.prepare as preparing
    from liquidfs.cli.main import main
    from liquidfs.stores.local.store import LocalStore

    src = make_sample(tmp_path / "data", count=4, width=64, height=32, seed=10)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False, jobs=1)
    verify_jobs = LocalStore.verify_jobs

    def deadly(self: LocalStore) -> object:
        nodes, job = verify_jobs(self)

        def wrapped(node: object) -> object:
            func, job_args = job(node)  # type: ignore[arg-type]
            return expand_or_die, (nodes[0].path, func, *job_args)
        return nodes, wrapped

    monkeypatch.setattr(LocalStore, "verify_jobs", deadly)
    monkeypatch.setattr(preparing, "_workers_live", lambda new_pool: False)
    assert main(["verify", "--store", str(store), "--no-progress", "--jobs", "1"]) == 2
    said = capsys.readouterr()
    assert "liquidfs verify: worker processes die before doing any work" in said.err, said.err
    assert "Traceback" not in said.err + said.out and "FAIL" not in said.out
