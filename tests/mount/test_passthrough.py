"""The passthrough data path on real mounts: engaged (shown by stats, not assumed), read by real clients
(coreutils, Pillow, mmap as DALI does, DALI itself), with sources and objects changing under it, the next-epoch
cache in memfds, and the daemon path chosen and logged where the capability is missing."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from fusehelpers import PASSTHROUGH_NEEDS_ROOT, Mount, daemon_pid, memfd_bytes, wait_for
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.identity import object_stamp
from liquidfs.prepare import prepare
from trees import dataset_tree, noise_files

pytestmark = pytest.mark.fuse


def stats(mnt: Path) -> dict:
    return json.loads(run_cli("stats", str(mnt), "--json").stdout)


def require_passthrough(mnt: Path) -> dict:
    """Passthrough must be engaged here: CI runs as root on a kernel that has it, with the patched pyfuse3 (the
    tests that need it are marked PASSTHROUGH_NEEDS_ROOT: another user's run skips them)."""
    values = stats(mnt)
    assert values["data_path"] == "passthrough", f"passthrough not engaged: {values['data_path_why']}"
    # the same build patches pyfuse3's loop (build.sh): an install that left it out costs ~70 us per open
    assert values["dispatch"] == "queued-first", "pyfuse3 without pyfuse3-queued-requests.patch"
    return values


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pt")
    src = dataset_tree(root / "data", count=24, width=256, height=128)
    store = root / "store"
    reseal(src, store)
    return src, store


def reseal(src: Path, store: Path, ratio: float = 0.5) -> None:
    """prepare, then prepare again: the second reuses every object unread and must leave each one's stamp (what
    lets a stat vouch for it) as the first took it."""
    prepare(src, store, ratio, progress=False)
    prepare(src, store, ratio, progress=False)


def _images(src: Path) -> list[str]:
    return sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.suffix in (".png", ".jpg") and p.is_file())


def _pixels(path: Path | bytes) -> np.ndarray:
    import io

    with Image.open(io.BytesIO(path) if isinstance(path, bytes) else path) as im:
        return np.asarray(im.convert("RGB") if im.mode == "P" else im)


def _raw_nodes(store: Path) -> list:
    catalog = Catalog.open(store, readonly=True)
    try:
        return [n for n in catalog.files() if n.object]
    finally:
        catalog.close()


@PASSTHROUGH_NEEDS_ROOT
def test_passthrough_serves_identical_bytes_and_pixels_without_reads(prepared, mounter: Mount) -> None:
    src, store = prepared
    mnt = mounter.mount(src, store=store)
    require_passthrough(mnt)
    raw = {os.fsdecode(n.path): (store / n.object).read_bytes() for n in _raw_nodes(store)}
    assert raw, "the sample has raw images"
    for rel in _images(src):
        served = (mnt / rel).read_bytes()
        assert served == raw.get(rel, (src / rel).read_bytes()), rel
        assert np.array_equal(_pixels(served), _pixels(src / rel)), rel
        assert os.stat(mnt / rel).st_size == len(served)
    # every other file too, with coreutils
    plain = [str(p.relative_to(src)) for p in (src / "extra").rglob("*") if p.is_file() and not p.is_symlink()]
    ours = subprocess.run(["sha256sum", "--", *plain], cwd=mnt, capture_output=True, check=True)
    theirs = subprocess.run(["sha256sum", "--", *plain], cwd=src, capture_output=True, check=True)
    assert ours.stdout == theirs.stdout
    values = stats(mnt)
    assert values["passthrough_opens"] >= len(_images(src)) + len(plain)
    assert values["backing_object"] >= len(raw) and values["backing_source"] >= 1
    assert values["read_requests"] == 0, "a read reached the daemon: the kernel did not pass it through"


@PASSTHROUGH_NEEDS_ROOT
def test_private_mmap_reads_as_dali_does(prepared, mounter: Mount) -> None:
    src, store = prepared
    mnt = mounter.mount(src, store=store)
    require_passthrough(mnt)
    for rel in _images(src):
        with open(mnt / rel, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
                m.madvise(mmap.MADV_WILLNEED)
                data = bytes(m)
        assert np.array_equal(_pixels(data), _pixels(src / rel)), rel
    assert stats(mnt)["read_requests"] == 0


@PASSTHROUGH_NEEDS_ROOT
def test_dali_with_its_defaults_through_passthrough(prepared, mounter: Mount) -> None:
    from dali_helpers import dali_decode_all

    src, store = prepared
    mnt = mounter.mount(src, store=store)
    require_passthrough(mnt)
    root = "leftImg8bit/train"
    ours = dali_decode_all(mnt / root, shuffle=True)  # random_shuffle: opens and maps its buffer ahead
    theirs = dali_decode_all(src / root)
    assert ours.keys() == theirs.keys() and len(ours) >= 16
    for name in ours:
        assert np.array_equal(ours[name], theirs[name]), name
    assert stats(mnt)["opens_raw"] >= 1


@PASSTHROUGH_NEEDS_ROOT
def test_two_processes_open_one_file_while_its_decision_changes(prepared, tmp_path: Path, mounter: Mount) -> None:
    """One reader holds a raw image open; its source is then edited: a second open while the first is alive
    fails (EIO: the kernel allows one backing per inode, and the first's is the old image's raw object, which
    the new source's reader must never get), the first reads on as it began, and the next first open serves the
    new source at its new size. Every read decodes to the pixels of the source it was opened against."""
    src0, store0 = prepared
    src, store = tmp_path / "data", tmp_path / "store"
    shutil.copytree(src0, src, symlinks=True)
    reseal(src, store)
    node = _raw_nodes(store)[0]
    rel = os.fsdecode(node.path)
    mnt = mounter.mount(src, store=store)
    require_passthrough(mnt)
    before = _pixels(src / rel)
    first = open(mnt / rel, "rb")
    try:
        head = first.read(2)
        assert head == b"BM"  # the raw object
        # the source changes: a different image, another size
        with Image.open(src / rel) as im:
            im.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(src / rel, compress_level=1)
        after = _pixels(src / rel)
        assert not np.array_equal(before, after)
        second = subprocess.run([sys.executable, "-c", "import sys; sys.stdout.buffer.write(open(sys.argv[1], "
                                 "'rb').read())", str(mnt / rel)], capture_output=True)
        assert second.returncode != 0 and b"Input/output error" in second.stderr, second  # never the old image
        first.seek(0)
        assert np.array_equal(_pixels(first.read()), before)
    finally:
        first.close()
    third = (mnt / rel).read_bytes()
    assert np.array_equal(_pixels(third), after)
    assert len(third) == (src / rel).stat().st_size
    # the new size reaches stat once the attribute invalidation sent after that open lands (it cannot be sent
    # from inside the open request)
    wait_for(lambda: os.stat(mnt / rel).st_size == len(third), 10, what="the size to follow what is served")
    assert stats(mnt)["fallbacks"] == 1


@PASSTHROUGH_NEEDS_ROOT
def test_object_deleted_or_damaged_after_prepare_serves_the_original(prepared, tmp_path: Path,
                                                                    mounter: Mount) -> None:
    src0, store0 = prepared
    src, store = tmp_path / "data", tmp_path / "store"
    shutil.copytree(src0, src, symlinks=True)
    reseal(src, store)
    gone, damaged, *_ = _raw_nodes(store)
    mnt = mounter.mount(src, store=store)
    require_passthrough(mnt)
    (store / gone.object).unlink()
    obj = store / damaged.object
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x55  # one pixel byte: still a valid BMP, other pixels
    obj.write_bytes(bytes(data))
    for node in (gone, damaged):
        rel = os.fsdecode(node.path)
        served = (mnt / rel).read_bytes()
        assert served == (src / rel).read_bytes(), rel
        wait_for(lambda: os.stat(mnt / rel).st_size == len(served), 10, what="the size to follow what is served")
    values = stats(mnt)
    assert values["fallbacks"] == 2 and values["errors"] == 0


@PASSTHROUGH_NEEDS_ROOT
def test_verify_reads_checks_every_file_before_serving_it(prepared, tmp_path: Path, mounter: Mount) -> None:
    """--verify-reads: a raw object damaged in a way no stat shows (its stamp rewritten to match, as only a
    writer of the catalog could) is caught by its checksum: the original is served."""
    src0, store0 = prepared
    src, store = tmp_path / "data", tmp_path / "store"
    shutil.copytree(src0, src, symlinks=True)
    reseal(src, store)
    node = _raw_nodes(store)[0]
    obj = store / node.object
    data = bytearray(obj.read_bytes())
    data[-1] ^= 0x01
    obj.write_bytes(bytes(data))
    # damage no stat shows (as if stamped after it): only the checksum can tell now
    catalog = Catalog.open(store)
    catalog.db.execute("UPDATE nodes SET object_stamp=? WHERE id=?", (object_stamp(obj.stat()), node.id))
    catalog.close()
    rel = os.fsdecode(node.path)
    plain = mounter.mount(src, store=store)
    require_passthrough(plain)
    assert (plain / rel).read_bytes() == bytes(data)  # what a stat-only check serves: the damaged object
    checked = mounter.mount(src, "--verify-reads", store=store)
    require_passthrough(checked)
    assert (checked / rel).read_bytes() == (src / rel).read_bytes()
    values = stats(checked)
    assert values["fallbacks"] == 1 and values["backing_memfd"] >= 1 and values["backing_object"] == 0


READER = textwrap.dedent(r"""
    import sys
    for f in sys.argv[1:]:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(1 << 20):
                pass
""")


@PASSTHROUGH_NEEDS_ROOT
def test_next_epoch_cache_in_memfds(tmp_path: Path, mounter: Mount) -> None:
    src = tmp_path / "data"
    files = noise_files(src, count=256, classes=4, seed=5, sizes=(60_000, 200_000))
    mnt = mounter.mount(src, "--cache-size", "30%")
    require_passthrough(mnt)
    pid = daemon_pid(mnt)
    budget = stats(mnt)["cache_budget"]
    peak = 0
    for epoch in range(3):
        order = files[:]
        random.Random(epoch).shuffle(order)
        paths = [str(mnt / f) for f in order]
        for part in range(0, len(paths), 64):
            subprocess.run([sys.executable, "-c", READER, *paths[part:part + 64]], check=True, timeout=120)
            peak = max(peak, memfd_bytes(pid))
    values = stats(mnt)
    assert values["memfd_bytes"] <= budget and peak <= budget * 1.02 + (1 << 20)
    assert values["memfd_files"] > 0 and values["cache_held_bytes"] <= budget
    later = [v for k, v in values["epochs"].items() if int(k) >= 2]
    assert len(later) == 2
    for ep in later:
        assert 0.2 <= ep["byte_hit_ratio"] <= 0.4, values["epochs"]
    assert values["bytes_from_memory"] > 0 and values["read_requests"] == 0
    for f in random.Random(5).sample(files, 20):
        assert (mnt / f).read_bytes() == (src / f).read_bytes()


def test_daemon_path_is_chosen_and_logged_without_cap_sys_admin(prepared, tmp_path: Path) -> None:
    """In a user namespace the daemon is root but holds CAP_SYS_ADMIN only there, not in the initial one: the
    kernel refuses backing files, so the mount serves through the daemon, says why, and still serves right."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed")
    src, store0 = prepared
    store = tmp_path / "store"
    shutil.copytree(store0, store)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rel = os.fsdecode(_raw_nodes(store)[0].path)
    script = textwrap.dedent(f"""
        set -e
        {sys.executable} -m liquidfs mount {src} {mnt} --store {store} --log-level info \\
            --log-file {tmp_path}/mount.log
        sha256sum < {mnt}/{rel}
        {sys.executable} -m liquidfs stats {mnt} --json > {tmp_path}/stats.json
        {sys.executable} -m liquidfs umount {mnt}
    """)
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
                           "bash", "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "mount.log").read_text()
    expected = hashlib.sha256(((store / _raw_nodes(store)[0].object)).read_bytes()).hexdigest()
    sums = [line.split()[0] for line in done.stdout.splitlines() if line.endswith(" -")]
    assert sums == [expected], done.stdout
    values = json.loads((tmp_path / "stats.json").read_text())
    assert values["data_path"] == "daemon" and "CAP_SYS_ADMIN" in values["data_path_why"], values
    assert values["passthrough_opens"] == 0 and values["read_requests"] > 0
    lines = [line for line in (tmp_path / "mount.log").read_text().splitlines() if "data path:" in line]
    assert len(lines) == 1 and "daemon" in lines[0] and "CAP_SYS_ADMIN" in lines[0], lines


def test_data_path_passthrough_refuses_to_mount_when_it_cannot(prepared, tmp_path: Path) -> None:
    src, store0 = prepared
    store = tmp_path / "store"
    shutil.copytree(store0, store)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (f"{sys.executable} -m liquidfs mount {src} {mnt} --store {store} --data-path passthrough "
              f"--log-file {tmp_path}/mount.log")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
                           "bash", "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "CAP_SYS_ADMIN" in done.stderr and "Traceback" not in done.stderr, done.stderr
    # in the foreground too: the daemon says why and exits non-zero
    fg = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
                         sys.executable, "-m", "liquidfs", "mount", str(src), str(mnt), "--store", str(store),
                         "--data-path", "passthrough", "--foreground"], capture_output=True, text=True, timeout=180)
    assert fg.returncode == 1 and "CAP_SYS_ADMIN" in fg.stderr and "Traceback" not in fg.stderr, fg.stderr


@PASSTHROUGH_NEEDS_ROOT
def test_many_readers_of_the_same_files_at_once(prepared, mounter: Mount) -> None:
    """Sixteen threads open, read and close the same few files over and over: opens and releases of one inode
    interleave, and every read is whole and right."""
    src, store = prepared
    mnt = mounter.mount(src, store=store)
    require_passthrough(mnt)
    rels = _images(src)[:4]
    expected = {rel: (mnt / rel).read_bytes() for rel in rels}
    for rel in rels:  # the reference is right before it is repeated
        assert np.array_equal(_pixels(expected[rel]), _pixels(src / rel)), rel
    wrong: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            rel = rng.choice(rels)
            if (mnt / rel).read_bytes() != expected[rel]:
                wrong.append(rel)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not wrong
    values = stats(mnt)
    assert values["errors"] == 0 and values["passthrough_open_inodes"] == 0
