"""Trust boundaries (issue: a root daemon that reads only what it should): one test per class fixed here, each
failing on the code before the fix."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from forge import xxh3_twins
from fusehelpers import DATA_PATHS, FUSERMOUNT, PASSTHROUGH_NEEDS_ROOT, Mount, daemon_pid, is_mounted, wait_for
from liquidfs.policy.next_epoch import WINDOW, NextEpochCache
from liquidfs.catalog.catalog import Catalog
from liquidfs.prepare import prepare
from sample import make_sample


@pytest.mark.fuse
def test_a_root_mount_imports_nothing_from_the_callers_directory(tmp_path: Path) -> None:
    """``python -m`` puts the working directory first on sys.path: a root mount started in a directory another
    user can write would run that user's ``trio.py``. The daemon is started isolated, in /."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    trap = tmp_path / "cwd"
    trap.mkdir()
    marker = tmp_path / "imported-from-cwd"
    for name in ("trio", "pyfuse3", "xxhash"):
        (trap / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\nraise ImportError\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        # the console script, as a user runs it: its own sys.path[0] is its directory, not the cwd
        cli = Path(sys.executable).parent / "liquidfs"
        done = subprocess.run([str(cli), "mount", str(src), str(mnt), "--store", str(tmp_path / "store")],
                              cwd=trap, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert (mnt / "a.txt").read_text() == "a\n"
        assert not marker.exists(), f"the daemon imported {marker.read_text()} from the caller's directory"
    finally:
        if is_mounted(mnt):
            subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True)


@pytest.mark.fuse
@pytest.mark.needs_root("--allow-other: fusermount3 allows it to others only with user_allow_other in /etc/fuse.conf",
                        allow_other=True)
def test_the_control_entry_is_the_owners_only(tmp_path: Path, mounter: Mount) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    mnt = mounter.mount(src, "--allow-other")
    control = mnt / ".__liquidfs__"
    assert os.stat(control).st_mode & 0o077 == 0
    assert json.loads(control.read_bytes())["pid"] > 0  # its owner still reads it
    assert run_cli("stats", str(mnt), "--probe").returncode == 0


@pytest.mark.fuse
def test_a_store_path_with_uri_characters_opens_that_store(tmp_path: Path, mounter: Mount) -> None:
    """The read-only catalog is opened through an SQLite URI: a '#', '?' or '%' in --store used to cut the path
    there and open another file (here: the decoy catalog in the store's parent named by the cut)."""
    src = make_sample(tmp_path / "src", count=4, width=64, height=48, seed=2)
    decoy_src = make_sample(tmp_path / "decoy-src", count=2, width=32, height=16, seed=3)
    prepare(decoy_src, tmp_path / "decoy-store", 0.0, progress=False)
    store = tmp_path / "st#x?y%41"
    store.mkdir()
    # what an unquoted URI names: "file:<store>/catalog.sqlite?mode=ro" cut at '#' opens the file "<tmp>/st"
    shutil.copyfile(tmp_path / "decoy-store" / "catalog.sqlite", tmp_path / "st")
    prepare(src, store, 0.5, progress=False)
    mnt = mounter.mount(src, store=store)
    names = sorted(p.name for p in (mnt / "leftImg8bit" / "train").rglob("*.png"))
    assert names == sorted(p.name for p in (src / "leftImg8bit" / "train").rglob("*.png"))


def test_catalogs_are_read_with_an_untrusted_schema(tmp_path: Path) -> None:
    src = make_sample(tmp_path / "src", count=2, width=32, height=16, seed=4)
    prepare(src, tmp_path / "store", 0.0, progress=False)
    for readonly in (True, False):
        catalog = Catalog.open(tmp_path / "store", readonly=readonly)
        try:
            assert catalog.db.execute("PRAGMA trusted_schema").fetchone()[0] == 0
        finally:
            catalog.close()


def test_a_window_of_empty_files_does_not_divide_by_zero() -> None:
    cache = NextEpochCache(1000, 1000, 2 * WINDOW, max_id=2 * WINDOW)
    for file in range(1, 2 * WINDOW + 1):
        cache.read(file, 0)  # 64 empty files in a row: a window of zero bytes
    summary = cache.summary()
    assert len(summary["window_byte_hit_ratios"]) == 2


def test_catalog_rows_that_leave_the_root_or_the_store_are_refused(tmp_path: Path) -> None:
    """Whoever writes the store writes the catalog: a node path with '..' or an object name pointing anywhere
    must not make the root daemon open (or serve) files outside the source and the store."""
    import dataclasses
    import errno

    from liquidfs.datapath.backing import resolve
    from liquidfs.stores.local.reader import StoreReader

    src = make_sample(tmp_path / "src", count=2, width=32, height=16, seed=5)
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not for the mount")
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    node = next(n for n in catalog.files() if n.object)
    reader = StoreReader(catalog.source, store)
    outside = dataclasses.replace(node, path=b"../secret.png", object=None, representation=0)
    with pytest.raises(OSError) as info:
        reader.open(outside)
    assert info.value.errno == errno.EIO
    with pytest.raises(OSError):
        resolve(reader, outside)
    for evil in ("../secret.png", "/etc/hostname", "objects/../../secret.png"):
        bad_object = dataclasses.replace(node, object=evil)
        with pytest.raises(OSError):
            reader.open_object(bad_object)
        content = reader.open(bad_object)  # the original is served, never the named file
        try:
            assert bytes(content.data) == (src / os.fsdecode(node.path)).read_bytes() and content.fallback
        finally:
            content.close()
    reader.close()
    catalog.close()


@pytest.mark.fuse
@PASSTHROUGH_NEEDS_ROOT
def test_a_source_root_swapped_for_a_link_while_mounted_serves_nothing_else(tmp_path: Path,
                                                                          mounter: Mount) -> None:
    """The root is held open from mount time: renaming the dataset directory and putting a link to another
    tree in its place (where a file has the same name, size and mtime) changes nothing the mount serves."""
    src = tmp_path / "data"
    src.mkdir()
    (src / "a.bin").write_bytes(b"A" * 4096)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "a.bin").write_bytes(b"V" * 4096)
    st = (src / "a.bin").stat()
    os.utime(victim / "a.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    mnt = mounter.mount(src, "--data-path", "daemon")
    pt = mounter.mount(src, "--data-path", "passthrough")
    src.rename(tmp_path / "data.old")
    src.symlink_to(victim)
    for m in (mnt, pt):
        assert (m / "a.bin").read_bytes() == b"A" * 4096


def test_disk_cache_directories_of_two_mounts_with_one_pid_coexist(tmp_path: Path) -> None:
    """A restarted sidecar is PID 2 again: its disk cache directory used to be the dead one's name (mkdir
    failed: a crash loop), and a live mount in another PID namespace could be taken for dead."""
    from liquidfs.held.disk import DiskLevel

    policy = NextEpochCache(1000, 1000, 10, max_id=10)
    first = DiskLevel(None, tmp_path, policy)  # type: ignore[arg-type]
    second = DiskLevel(None, tmp_path, policy)  # type: ignore[arg-type]
    assert first.dir != second.dir and first.dir.is_dir() and second.dir.is_dir()
    assert first.dir.stat().st_mode & 0o077 == 0
    second._alive.release(remove=False)  # it dies without unmounting
    third = DiskLevel(None, tmp_path, policy)  # type: ignore[arg-type]
    assert first.dir.is_dir() and not second.dir.exists() and third.dir.is_dir()
    first.close()
    third.close()


@pytest.mark.fuse
def test_metrics_listen_on_this_host_only_by_default(tmp_path: Path, mounter: Mount) -> None:
    import socket

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mnt = mounter.mount(src, "--metrics-port", str(port))
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # LISTEN
                listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1, and nothing on other addresses
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):  # the server closes the connection after its answer
            answer += chunk
        assert b"liquidfs_opens" in answer
    assert mnt.exists()


def test_what_prepare_and_mount_write_is_their_owners_only(tmp_path: Path) -> None:
    src = make_sample(tmp_path / "src", count=3, width=32, height=16, seed=6)
    (src / "leftImg8bit").chmod(0o700)
    store = tmp_path / "store"
    done = subprocess.run([sys.executable, "-m", "liquidfs", "prepare", str(src), "--store", str(store),
                           "--ratio", "1", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = [store, *store.rglob("*")]
    assert any(p.suffix == ".bmp" for p in written)
    loose = [f"{p} {oct(p.stat().st_mode)}" for p in written if not p.is_symlink() and p.stat().st_mode & 0o077]
    assert not loose, loose


def _two_images_of_one_size(a: Path, b: Path) -> None:
    """Two PNGs with different pixels and exactly the same length (the shorter padded after IEND, which decoders
    ignore): what an attacker needs to pass a size check."""
    from PIL import Image

    Image.new("RGB", (64, 32), (200, 10, 10)).save(a)
    Image.new("RGB", (64, 32), (10, 10, 200)).save(b)
    short, long_ = sorted((a, b), key=lambda p: p.stat().st_size)
    short.write_bytes(short.read_bytes() + b"\0" * (long_.stat().st_size - short.stat().st_size))


def _pixels(data: bytes) -> bytes:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB").tobytes()


@pytest.mark.fuse
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_a_source_rewritten_with_its_size_and_mtime_put_back_is_served_as_it_is_now(
        tmp_path: Path, mounter: Mount, data_path: str) -> None:
    """``cp -p``, ``rsync -t`` or ``touch -d`` put back size and mtime: the stale raw object of the old content
    was served. The identity now includes the inode and its ctime, which nobody can set back."""
    src = tmp_path / "src"
    src.mkdir()
    _two_images_of_one_size(src / "a.png", tmp_path / "new.png")
    store = tmp_path / "store"
    prepare(src, store, ratio=1.0, progress=False)
    st = (src / "a.png").stat()
    shutil.copyfile(tmp_path / "new.png", src / "a.png")  # rewritten in place, same size
    os.utime(src / "a.png", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (src / "a.png").stat().st_size == st.st_size
    mnt = mounter.mount(src, "--data-path", data_path, store=store)
    served = (mnt / "a.png").read_bytes()
    assert _pixels(served) == _pixels((tmp_path / "new.png").read_bytes()), "the old image's raw object was served"


@pytest.mark.fuse
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_a_raw_object_rewritten_in_place_to_its_xxh3_is_refused_and_the_original_served(
        tmp_path: Path, mounter: Mount, data_path: str) -> None:
    """Whoever can write the store rewrote a raw object in place with other pixels of the same size and the same
    xxh3_64 (a moment's work: ``forge.xxh3_twins``). Its stamp no longer vouches, so its digest is checked: an
    xxh3 one passed, and the forged pixels were served. The BLAKE2b digest refuses them: the original is."""
    import io

    from PIL import Image

    from liquidfs.expand import formats

    src = tmp_path / "src"
    src.mkdir()
    base = io.BytesIO()
    Image.effect_noise((64, 32), 40).convert("RGB").save(base, "PNG")
    bmp = formats.expand(base.getvalue()).data
    assert bmp is not None and bmp[:2] == b"BM"
    recorded, forged = xxh3_twins(bmp)  # they differ in 16 bytes of pixels, past the 54-byte header
    with Image.open(io.BytesIO(recorded)) as im:
        im.save(src / "a.png")  # the source whose expansion is ``recorded``
    store = tmp_path / "store"
    prepare(src, store, ratio=1.0, progress=False)
    (obj,) = (store / "objects").rglob("*.bmp")
    assert obj.read_bytes() == recorded
    with open(obj, "r+b") as f:  # in place: same inode, same size, a later ctime
        f.write(forged)
    mnt = mounter.mount(src, "--data-path", data_path, store=store)
    served = (mnt / "a.png").read_bytes()
    assert served != forged, "the forged raw object was served"
    assert served == (src / "a.png").read_bytes()
    values = json.loads(run_cli("stats", str(mnt), "--json").stdout)
    assert values["fallbacks"] == 1 and values["errors"] == 0


def test_prepare_reads_no_source_swapped_for_a_link_after_the_scan(tmp_path: Path) -> None:
    """Between the scan and the expansion a user who owns the dataset swaps an image for a link to a file of the
    same size and mtime that only root may read, and puts the directory's mtime back so the catalog is reused:
    prepare (root) used to follow the link and put that file's pixels in an object the mount serves."""
    from liquidfs.catalog.build import build

    src = tmp_path / "src"
    src.mkdir()
    secret = tmp_path / "secret.png"
    _two_images_of_one_size(src / "a.png", secret)
    secret.chmod(0o600)
    from PIL import Image

    Image.new("RGB", (64, 32), (10, 200, 10)).save(src / "b.png")  # a plain image beside it: one object is due
    store = tmp_path / "store"
    build(src, store)
    dir_st = src.stat()
    st = (src / "a.png").stat()
    os.utime(secret, ns=(st.st_atime_ns, st.st_mtime_ns))
    (src / "a.png").unlink()
    (src / "a.png").symlink_to(secret)
    os.utime(src, ns=(dir_st.st_atime_ns, dir_st.st_mtime_ns))
    prepare(src, store, ratio=1.0, progress=False)
    leaked = _pixels(secret.read_bytes())
    objects = list((store / "objects").rglob("*.bmp"))
    assert len(objects) == 1, objects  # b.png's; none for the swapped a.png
    assert _pixels(objects[0].read_bytes()) == _pixels((src / "b.png").read_bytes())
    for obj in objects:
        assert _pixels(obj.read_bytes()) != leaked, f"{obj} holds the pixels of a file the source only linked to"


def test_prepare_adopts_a_left_over_object_only_if_it_holds_the_right_bytes(tmp_path: Path) -> None:
    """A killed prepare (or a lost catalog) leaves objects nobody recorded; the next run used to adopt whatever
    bytes the object's name held, and record their checksum, so the mount served a damaged object as sound."""
    from liquidfs.catalog.catalog import Catalog as Cat

    src = tmp_path / "src"
    src.mkdir()
    make_sample(src, count=3, width=96, height=48, seed=3)
    store = tmp_path / "store"
    prepare(src, store, ratio=1.0, progress=False)
    objects = sorted((store / "objects").rglob("*.bmp"))
    assert objects
    damaged = objects[0]
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF
    os.chmod(damaged, 0o600)
    damaged.write_bytes(bytes(data))
    (store / "catalog.sqlite").unlink()  # the catalog is lost; the objects stay
    prepare(src, store, ratio=1.0, progress=False)
    assert damaged.read_bytes() != bytes(data), "the damaged object was adopted as it was"
    catalog = Cat.open(store, readonly=True)
    try:
        bad = [n.path for n in catalog.files() if n.served_raw and (store / str(n.object)).read_bytes() == bytes(data)]
    finally:
        catalog.close()
    assert not bad
    assert run_cli("verify", "--store", str(store), "--no-progress").returncode == 0


def test_a_source_written_while_it_is_read_is_not_served_torn(tmp_path: Path, monkeypatch) -> None:
    """The daemon path reads an original whole: a writer finishing during that read left half old, half new
    bytes in what was served. A change of the file during the read is now seen (fstat after) and it is read
    again."""
    from liquidfs.stores import reader as reader_mod
    from liquidfs.catalog.build import open_or_build
    from liquidfs.catalog.nodes import ROOT_ID
    from liquidfs.stores.local.reader import StoreReader

    src = tmp_path / "src"
    src.mkdir()
    old, new = b"O" * 8192, b"N" * 8192
    (src / "a.bin").write_bytes(old)
    catalog = open_or_build(src, tmp_path / "store")
    node = catalog.lookup(ROOT_ID, b"a.bin")
    assert node is not None
    real_read = reader_mod.read_span
    calls = []

    def read_while_written(fd: int, start: int, end: int, **kw: object) -> memoryview:
        calls.append(fd)
        if len(calls) == 1:  # the writer rewrites the file while the first read is half done
            first = bytes(real_read(fd, start, end))[:4096]
            with open(src / "a.bin", "r+b") as f:
                f.write(new)
            return memoryview(first + bytes(real_read(fd, start, end))[4096:])
        return real_read(fd, start, end)

    monkeypatch.setattr(reader_mod, "read_span", read_while_written)
    reader = StoreReader(catalog.source, tmp_path / "store")
    try:
        content = reader.open(node)
        assert len(calls) >= 2, "the file was not read again after the write during its first read"
        assert content.data is not None and bytes(content.data) == new, "a torn or stale copy was served"
        content.close()
    finally:
        reader.close()
        catalog.close()


@pytest.mark.fuse
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_a_chmod_of_the_source_after_the_scan_binds_other_users(public_dir: Path, tmp_path: Path,
                                                                mounter: Mount, data_path: str) -> None:
    """The catalog keeps the modes of the scan: a ``chmod 600`` of a source file (or 700 of its directory)
    while an --allow-other mount runs left it readable by every user. The source's own modes decide at open."""
    from fusehelpers import as_nobody

    src = tmp_path / "data"
    (src / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "sub/c.txt"):
        (src / name).write_text(f"{name}\n")
        (src / name).chmod(0o644)
    src.chmod(0o755)
    mnt = public_dir / "shared"
    mnt.mkdir()
    mounter.mount(src, "--allow-other", "--data-path", data_path, mountpoint=mnt)
    assert as_nobody("cat", str(mnt / "a.txt")).stdout == "a.txt\n"
    (src / "a.txt").chmod(0o600)
    (src / "sub").chmod(0o700)
    denied = as_nobody("cat", str(mnt / "a.txt"))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    denied = as_nobody("cat", str(mnt / "sub" / "c.txt"))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    assert as_nobody("cat", str(mnt / "b.txt")).stdout == "b.txt\n"
    assert (mnt / "a.txt").read_text() == "a.txt\n"  # the mount's owner still reads it


def _decodes_like_source(mnt: Path, src: Path) -> list[str]:
    """Names under ``mnt`` whose size differs from what stat says or whose pixels differ from the source's."""
    bad = []
    for path in sorted(src.rglob("*.png")):
        rel = path.relative_to(src)
        served = (mnt / rel).read_bytes()
        if len(served) != (mnt / rel).stat().st_size or _pixels(served) != _pixels(path.read_bytes()):
            bad.append(str(rel))
    return bad


@pytest.mark.fuse
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_a_prepare_while_a_mount_runs_leaves_the_mount_its_snapshot(tmp_path: Path, mounter: Mount,
                                                                     data_path: str) -> None:
    """prepare used to rewrite the catalog a running mount reads, in place: lowering the ratio deleted objects
    the mount still served (EIO) and raising it served files at sizes the kernel had cached for the old
    representation. Now a new selection replaces the catalog file in one rename (a running mount keeps the one
    it opened) and no object is deleted while a mount of the store runs; the next prepare deletes them."""
    src = tmp_path / "src"
    make_sample(src, count=8, width=96, height=48, seed=5)
    store = tmp_path / "store"
    prepare(src, store, ratio=1.0, progress=False)
    mnt = mounter.mount(src, "--data-path", data_path, store=store)
    for path in src.rglob("*.png"):  # the kernel now holds the raw objects' sizes
        (mnt / path.relative_to(src)).stat()
    report = prepare(src, store, ratio=0.0, progress=False)
    assert report.kept_for_mounts > 0 and report.deleted == 0
    assert _decodes_like_source(mnt, src) == []
    report = prepare(src, store, ratio=1.0, progress=False)  # and back: the objects are still there
    assert _decodes_like_source(mnt, src) == []
    pid = daemon_pid(mnt)
    mounter.cleanup()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30)  # its lock goes with the daemon
    report = prepare(src, store, ratio=0.0, progress=False)
    assert report.deleted > 0 and report.kept_for_mounts == 0
    assert not list((store / "objects").rglob("*.bmp"))


def test_prepares_of_one_store_at_once_run_one_after_another(tmp_path: Path) -> None:
    """Every pod of a Kubernetes Job runs ``prepare`` against one store: two at once wrote and deleted each
    other's work. They now take turns on the store's prepare lock; the store ends consistent."""
    src = tmp_path / "src"
    make_sample(src, count=12, width=96, height=48, seed=6)
    store = tmp_path / "store"
    runs = [subprocess.Popen([sys.executable, "-m", "liquidfs", "prepare", str(src), "--store", str(store),
                              "--ratio", ratio, "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for ratio in ("1.0", "0.5", "1.0")]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    assert run_cli("verify", "--store", str(store), "--no-progress").returncode == 0
    catalog = Catalog.open(store, readonly=True)
    try:
        named = {str(n.object) for n in catalog.files() if n.served_raw}
    finally:
        catalog.close()
    assert named and all((store / obj).is_file() for obj in named)


def test_the_mount_raises_its_descriptor_limit_and_bounds_open_files_below_it() -> None:
    import resource

    from liquidfs.daemon.build import descriptor_budget

    before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    budget = descriptor_budget()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft >= before and 64 <= budget < soft


def test_the_watchdog_takes_the_mount_that_appeared_while_it_mounted_not_the_one_on_top(monkeypatch) -> None:
    """Two mounts stacked on one mount point: the watchdog took whatever was on top when it started, which may
    be a mount stacked a moment later, and would abort that stranger's connection."""
    from liquidfs.daemon import watchdog as guard

    mnt = b"/mnt/data"
    before = {1, 2}
    table = [(1, 10, b"/", b"ext4"), (2, 20, mnt, b"fuse.liquidfs")]  # an older mount under ours
    ours = (3, 30, mnt, b"fuse.liquidfs")
    stranger = (4, 40, mnt, b"fuse.sshfs")  # stacked on top after ours
    monkeypatch.setattr(guard, "_mounts", lambda: [*table, ours])
    assert guard.new_mount(Path(os.fsdecode(mnt)), before) == (b"fuse.liquidfs", 30, 3)
    monkeypatch.setattr(guard, "_mounts", lambda: [*table, ours, stranger])
    assert guard.topmost_mount(Path(os.fsdecode(mnt)))[1] == 40  # what the old code took
    assert guard.new_mount(Path(os.fsdecode(mnt)), before) is None  # two appeared: neither is taken


@pytest.mark.fuse
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_fstat_right_after_an_open_says_the_size_that_open_serves(tmp_path: Path, mounter: Mount,
                                                                   data_path: str) -> None:
    """An open that serves another size than the one before it (a damaged raw object: the original; the object
    restored: the raw again) corrected the kernel's attributes a moment after the open was answered, so an
    fstat right after the open could say the old size, and a reader read or mapped the file cut at it. Found
    by scripts/attack/soak.py --attacker (98 of 200 such opens stale on passthrough)."""

    src = tmp_path / "src"
    make_sample(src, count=2, width=256, height=128, seed=11)
    store = tmp_path / "store"
    prepare(src, store, ratio=1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    node = next(n for n in catalog.files() if n.served_raw)
    catalog.close()
    rel, obj = os.fsdecode(node.path), store / str(node.object)
    good = obj.read_bytes()
    png = (src / rel).read_bytes()
    mnt = mounter.mount(src, "--data-path", data_path, store=store)
    stale = []
    for _ in range(20):
        os.truncate(obj, 1000)  # damaged: the next open serves the original
        with open(mnt / rel, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            stale += [] if size == len(png) else [("original", size)]
            assert os.pread(f.fileno(), size, 0) == png
        with open(obj, "r+b") as f:  # restored: the next open serves the raw object again
            f.write(good)
        with open(mnt / rel, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            stale += [] if size == len(good) else [("raw", size)]
            data = os.pread(f.fileno(), max(size, len(good)), 0)
            assert data in (good, png), "bytes of neither representation"
    assert stale == [], f"fstat right after the open said another size: {stale}"


@pytest.mark.fuse
@PASSTHROUGH_NEEDS_ROOT
def test_an_open_after_the_backing_changed_is_refused_not_served_the_change(tmp_path: Path,
                                                                             mounter: Mount) -> None:
    """Passthrough shares one backing per inode while any open of it exists: an object damaged after the first
    open was handed as it was to every later open (the kernel reads it live). A later open now re-checks the
    shared backing (inode, size, mtime, ctime) and fails with EIO; once every open is closed the next one
    decides again and serves the original. Found by soak --attacker."""

    src = tmp_path / "src"
    make_sample(src, count=2, width=256, height=128, seed=11)
    store = tmp_path / "store"
    prepare(src, store, ratio=1.0, progress=False)
    time.sleep(0.1)  # objects written within a clock tick of the seal are not vouched for by a stat
    prepare(src, store, ratio=1.0, progress=False)  # seals again: now they are, and are passed through as is
    catalog = Catalog.open(store, readonly=True)
    node = next(n for n in catalog.files() if n.served_raw)
    catalog.close()
    rel, obj = os.fsdecode(node.path), store / str(node.object)
    good = obj.read_bytes()
    mnt = mounter.mount(src, "--data-path", "passthrough", store=store)
    first = os.open(mnt / rel, os.O_RDONLY)
    try:
        assert os.pread(first, 4096, 0) == good[:4096]
        assert json.loads((mnt / ".__liquidfs__").read_bytes())["backing_object"] == 1
        with open(obj, "r+b") as f:  # a store writer flips a byte while the file is open
            f.seek(5100)
            f.write(bytes([good[5100] ^ 0xFF]))
        with pytest.raises(OSError) as info:
            open(mnt / rel, "rb").close()
        assert info.value.errno == errno.EIO
    finally:
        os.close(first)
    served = (mnt / rel).read_bytes()  # every open closed: decided again
    assert served == (src / rel).read_bytes()
