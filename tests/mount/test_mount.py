"""Real mounts read by real clients: coreutils, tar, Pillow, DALI, torchvision."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from fusehelpers import DATA_PATHS, FUSERMOUNT, Mount, daemon_pid, is_mounted, mounter_on_each_path, wait_for
from trees import dataset_tree

pytestmark = pytest.mark.fuse


# Every test here runs on both data paths.
mounter = pytest.fixture(params=DATA_PATHS, name="mounter")(mounter_on_each_path)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dataset_tree(tmp_path_factory.mktemp("src") / "data", big_dir=5000)


def _listing(root: Path) -> str:
    out = subprocess.run(["find", ".", "-printf", r"%P %s %y\n"], cwd=root, capture_output=True, check=True)
    return "\n".join(sorted(out.stdout.decode(errors="surrogateescape").splitlines()))


def _sha256_all(root: Path) -> dict[str, str]:
    sums = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            sums[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return sums


def test_tree_and_bytes_identical(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    assert _listing(mnt) == _listing(tree)
    assert _sha256_all(mnt) == _sha256_all(tree)
    # and with the real tool, on the files with the awkward names
    extra = sorted(p.name for p in (tree / "extra").iterdir() if p.is_file() and not p.is_symlink())
    ours = subprocess.run(["sha256sum", "--", *extra], cwd=mnt / "extra", capture_output=True, check=True)
    theirs = subprocess.run(["sha256sum", "--", *extra], cwd=tree / "extra", capture_output=True, check=True)
    assert ours.stdout == theirs.stdout


def test_attributes_match_source(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    for rel in ["README.txt", "extra", "extra/deep/er/est/leaf.bin", "leftImg8bit/train", "many"]:
        a, b = os.stat(mnt / rel), os.stat(tree / rel)
        assert a.st_size == b.st_size or Path(tree / rel).is_dir()
        assert a.st_mtime_ns == b.st_mtime_ns
        assert (a.st_mode & 0o7555) == (b.st_mode & 0o7555)  # write bits are dropped, read-only
        assert a.st_mode & 0o222 == 0
        assert a.st_nlink == b.st_nlink, rel
        assert a.st_ino != 0
    link = mnt / "extra" / "rel-link"
    assert link.is_symlink() and os.readlink(link) == "../README.txt"
    assert link.read_bytes() == (tree / "README.txt").read_bytes()
    assert os.readlink(mnt / "extra" / "abs-link-outside") == "/etc/hostname"
    vfs = os.statvfs(mnt)
    assert vfs.f_files > 5000


def test_big_directory_readdir(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    names = os.listdir(mnt / "many")
    assert len(names) == 5000 and len(set(names)) == 5000
    assert sorted(names) == sorted(os.listdir(tree / "many"))
    # a reader that lists in small steps resumes at stable offsets (getdents with a tiny buffer)
    fd = os.open(mnt / "many", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as it:
            assert sum(1 for _ in it) == 5000
    finally:
        os.close(fd)


def test_writes_fail_with_erofs(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    attempts = [
        lambda: open(mnt / "new.txt", "w"),
        lambda: open(mnt / "README.txt", "r+b"),
        lambda: open(mnt / "README.txt", "ab"),
        lambda: os.mkdir(mnt / "d"),
        lambda: os.unlink(mnt / "README.txt"),
        lambda: os.rmdir(mnt / "extra"),
        lambda: os.rename(mnt / "README.txt", mnt / "R"),
        lambda: os.chmod(mnt / "README.txt", 0o777),
        lambda: os.truncate(mnt / "README.txt", 0),
        lambda: os.symlink("x", mnt / "l"),
        lambda: os.setxattr(mnt / "README.txt", "user.x", b"1"),
        lambda: os.utime(mnt / "README.txt", (0, 0)),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS, attempt
    # Syncing what was opened for reading is done at once, as on a read-only disk: nothing was written.
    for path in (mnt / "README.txt", mnt / "extra"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.fsync(fd)  # (the kernel answers it itself from now on)
        finally:
            os.close(fd)
    assert _sha256_all(mnt) == _sha256_all(tree)


def test_o_direct_and_private_mmap(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    rel = "extra/deep/er/est/leaf.bin"
    expected = (tree / rel).read_bytes()
    fd = os.open(mnt / rel, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 1 << 20)
        got = os.preadv(fd, [buf], 0)
        assert buf[:got] == expected
    finally:
        os.close(fd)
    with open(mnt / rel, "rb") as f:
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
            assert m[:] == expected


def test_tar_of_the_mount(tree: Path, mounter: Mount, tmp_path: Path) -> None:
    mnt = mounter.mount(tree)
    out = tmp_path / "x.tar"
    subprocess.run(["tar", "cf", str(out), "."], cwd=mnt, check=True, capture_output=True)
    listing = subprocess.run(["tar", "tf", str(out)], capture_output=True, check=True).stdout
    assert listing.count(b"\n") > 5000


def test_pillow_opens_every_image(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    images = sorted(p.relative_to(tree) for p in tree.rglob("*") if p.suffix in {".png", ".jpg"})
    assert len(images) >= 16
    for rel in images:
        a = np.asarray(Image.open(mnt / rel))
        b = np.asarray(Image.open(tree / rel))
        assert a.shape == b.shape and np.array_equal(a, b), rel


def test_dali_reads_the_tree(tree: Path, mounter: Mount) -> None:
    from dali_helpers import dali_decode_all

    mnt = mounter.mount(tree)
    root = "leftImg8bit/train"
    ours = dali_decode_all(mnt / root)
    theirs = dali_decode_all(tree / root)
    assert len(ours) == len(theirs) >= 16
    for name in theirs:
        assert np.array_equal(ours[name], theirs[name]), name


def test_torchvision_imagefolder_dataloader(tree: Path, mounter: Mount) -> None:
    torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
    from torchvision import datasets, transforms

    mnt = mounter.mount(tree)
    ds = datasets.ImageFolder(str(mnt / "leftImg8bit" / "train"), transform=transforms.PILToTensor())
    ref = datasets.ImageFolder(str(tree / "leftImg8bit" / "train"), transform=transforms.PILToTensor())
    assert len(ds) == len(ref) >= 16 and ds.classes == ref.classes
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    seen = 0
    for images, labels in loader:
        for img, label in zip(images, labels):
            want, want_label = ref[seen]
            assert int(label) == want_label and torch.equal(img, want)
            seen += 1
    assert seen == len(ref)


@pytest.mark.needs_root("/proc/sys/vm/drop_caches")
def test_lookup_counts_are_forgotten(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    os.listdir(mnt / "many")
    for name in os.listdir(mnt / "many")[:100]:
        os.stat(mnt / "many" / name)
    stats = json.loads((mnt / ".__liquidfs__").read_bytes())
    assert stats["known_inodes"] >= 100
    Path("/proc/sys/vm/drop_caches").write_text("2\n")  # the kernel forgets its dentries and inodes
    wait_for(lambda: json.loads((mnt / ".__liquidfs__").read_bytes())["known_inodes"] < 50, 20,
             what="forget to reach the daemon")


def test_control_file_is_hidden(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    assert ".__liquidfs__" not in os.listdir(mnt)
    assert sorted(os.listdir(mnt)) == sorted(os.listdir(tree))
    stats = json.loads(run_cli("stats", str(mnt), "--json").stdout)
    assert stats["pid"] == daemon_pid(mnt)
    assert run_cli("stats", str(mnt), "--probe").returncode == 0
    assert run_cli("stats", str(tree), "--probe", check=False).returncode == 1


# -- lifecycle -----------------------------------------------------------------------------------------


def test_refuses_bad_mountpoints(tree: Path, mounter: Mount, tmp_path: Path) -> None:
    missing = run_cli("mount", str(tree), str(tmp_path / "nope"), "--store", str(tmp_path / "st"), check=False)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    nonempty = run_cli("mount", str(tree), str(full), "--store", str(tmp_path / "st"), check=False)
    assert nonempty.returncode == 1 and "not empty" in nonempty.stderr
    mnt = mounter.mount(tree)
    again = run_cli("mount", str(tree), str(mnt), "--store", str(tmp_path / "st"), check=False)
    assert again.returncode == 1 and "already mounted" in again.stderr
    nosrc = run_cli("mount", str(tmp_path / "nosrc"), str(mounter.mountpoint()), check=False)
    assert nosrc.returncode == 1 and f"source {tmp_path / 'nosrc'}: no such directory" in nosrc.stderr
    assert "Traceback" not in missing.stderr + nonempty.stderr + again.stderr + nosrc.stderr


def test_umount_waits_for_the_daemon(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    pid = daemon_pid(mnt)
    run_cli("umount", str(mnt))
    assert not is_mounted(mnt)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def test_umount_of_a_busy_mount_names_the_holder(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    holder = subprocess.Popen([sys.executable, "-c", "import sys,time; f=open(sys.argv[1]); time.sleep(60)",
                               str(mnt / "README.txt")])
    try:
        wait_for(lambda: any(os.path.realpath(f"/proc/{holder.pid}/fd/{fd}").startswith(str(mnt))
                             for fd in os.listdir(f"/proc/{holder.pid}/fd")), what="holder to open the file")
        busy = run_cli("umount", str(mnt), check=False)
        assert busy.returncode == 1 and "busy" in busy.stderr and str(holder.pid) in busy.stderr
        assert is_mounted(mnt)
        run_cli("umount", "--lazy", str(mnt))
        assert not is_mounted(mnt)
    finally:
        holder.kill()
        holder.wait()


def test_umount_names_a_process_holding_a_copy_of_the_mount_in_another_namespace(tree: Path,
                                                                                  mounter: Mount) -> None:
    """A process in another mount namespace holding a copy of the mount keeps its daemon serving: umount said
    only "still running after 30 s". It names that process instead."""
    mnt = mounter.mount(tree)
    pid = daemon_pid(mnt)
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "300"])
    try:
        wait_for(lambda: os.readlink(f"/proc/{holder.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
                 and Path(f"/proc/{holder.pid}/cmdline").read_bytes().startswith(b"sleep")
                 and str(mnt).encode() in Path(f"/proc/{holder.pid}/mountinfo").read_bytes(),
                 what="the copy of the mount in another namespace")
        done = run_cli("umount", str(mnt), check=False)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert f"{holder.pid} sleep 300" in done.stderr and "another mount namespace" in done.stderr
        assert "still running after" not in done.stderr
        assert not is_mounted(mnt) and Path(f"/proc/{pid}").exists()  # unmounted here; the copy still served
    finally:
        holder.kill()
        holder.wait()
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
             .split(")")[1][:3], what="the daemon to exit once the copy is gone")


def test_sigterm_unmounts_foreground(tree: Path, mounter: Mount) -> None:
    mnt, proc = mounter.mount_foreground(tree)
    assert (mnt / "README.txt").read_bytes() == (tree / "README.txt").read_bytes()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert not is_mounted(mnt)


def test_signals_that_keep_coming_while_it_unmounts_never_leave_a_dead_mount(tree: Path, mounter: Mount) -> None:
    """A pod deleted twice, a `kill` sent again: every SIGTERM after the first (while the loop stops, while the
    session closes) is noted, not the default action's death before the unmount."""
    mnt, proc = mounter.mount_foreground(tree)
    assert (mnt / "README.txt").read_bytes() == (tree / "README.txt").read_bytes()
    while proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    assert proc.returncode == 0
    assert not is_mounted(mnt)


def test_kill_9_then_mount_again(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    pid = daemon_pid(mnt)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}/cmdline").exists() or
             Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z", what="daemon to die")
    with pytest.raises(OSError) as info:
        os.listdir(mnt)
    assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    mounter.mount(tree, mountpoint=mnt)
    assert (mnt / "README.txt").read_bytes() == (tree / "README.txt").read_bytes()


def test_a_stuck_daemon_holds_neither_mount_nor_umount(tree: Path, mounter: Mount, tmp_path: Path) -> None:
    """A mount whose daemon answers nothing (stopped here; a deadlock or a stuck storage call on a node) holds
    every statfs in the kernel: `liquidfs mount` on its mount point and `liquidfs umount` of it say so and
    name --lazy, each within its own answer timeout, instead of hanging with it."""
    mnt = mounter.mount(tree)
    pid = daemon_pid(mnt)
    os.kill(pid, signal.SIGSTOP)
    try:
        again = run_cli("mount", str(tree), str(mnt), "--store", str(tmp_path / "st"), check=False, timeout=60)
        assert again.returncode == 1 and "answered nothing" in again.stderr, again.stderr
        assert f"umount --lazy {mnt}" in again.stderr
        off = run_cli("umount", str(mnt), check=False, timeout=60)
        assert off.returncode == 1 and "answered nothing" in off.stderr and "--lazy" in off.stderr, off.stderr
        assert "Traceback" not in again.stderr + off.stderr
        assert is_mounted(mnt)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (mnt / "README.txt").read_bytes() == (tree / "README.txt").read_bytes()  # it answers again


def test_catalog_reused_until_the_source_changes(tmp_path: Path, mounter: Mount) -> None:
    src = dataset_tree(tmp_path / "data", count=4)
    store = tmp_path / "store2"
    mnt = mounter.mount(src, store=store)
    catalog = store / "catalog.sqlite"
    first = catalog.stat().st_ino
    mounter.umount(mnt)
    mounter.mount(src, mountpoint=mnt, store=store)
    assert catalog.stat().st_ino == first, "unchanged source: catalog reused"
    mounter.umount(mnt)
    (src / "added.txt").write_text("new file\n")
    mounter.mount(src, mountpoint=mnt, store=store)
    assert catalog.stat().st_ino != first, "changed source: catalog rebuilt"
    assert (mnt / "added.txt").read_text() == "new file\n"


def test_unreadable_source_file_is_an_error_not_a_crash(tmp_path: Path, mounter: Mount) -> None:
    src = dataset_tree(tmp_path / "data", count=4)
    mnt = mounter.mount(src)
    (src / "README.txt").unlink()
    with pytest.raises(OSError) as info:
        (mnt / "README.txt").read_bytes()
    assert info.value.errno in (errno.ENOENT, errno.EIO)
    assert (mnt / "meta.json").read_bytes() == (src / "meta.json").read_bytes()  # still serving


def test_python_m_and_help() -> None:
    for sub in ["mount", "umount", "stats", "prepare", "verify"]:
        out = subprocess.run([sys.executable, "-m", "liquidfs", sub, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "usage: liquidfs " + sub in out.stdout


# -- what the command says (issue 31) ----------------------------------------------------------------------------


def test_the_mount_names_the_data_path_it_got_and_why(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mountpoint()
    mounter.mountpoints.append(mnt)
    done = run_cli("mount", str(tree), str(mnt), "--store", str(mounter.tmp / "store"),
                   "--data-path", str(mounter.data_path))
    line = done.stdout.strip()
    assert len(line.splitlines()) == 1 and f"mounted on {mnt}" in line
    assert f"data path: {mounter.data_path}" in line
    if mounter.data_path == "daemon":
        assert "since --data-path daemon" in line


def test_the_mount_says_why_auto_chose_the_daemon(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mountpoint()
    mounter.mountpoints.append(mnt)
    done = run_cli("mount", str(tree), str(mnt), "--store", str(mounter.tmp / "store"), "--page-cache", "direct")
    assert "data path: daemon, since --page-cache direct" in done.stdout
    values = json.loads((mnt / ".__liquidfs__").read_bytes())
    assert values["data_path"] == "daemon" and values["data_path_why"] in done.stdout


def test_a_mount_option_fuse_refuses_is_named_first_and_at_once(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mountpoint()
    mounter.mountpoints.append(mnt)
    for option in ("first_bogus_option", "second_bogus_option"):
        # the timeout is a hang guard only: the daemon is gone in about a second
        done = run_cli("mount", str(tree), str(mnt), "--store", str(mounter.tmp / "store"), "-o", option,
                       check=False, timeout=60)
        assert done.returncode == 1, done.stderr
        first = done.stderr.splitlines()[0]
        assert option in first and "unknown option" in first, done.stderr
        assert "did not answer" not in done.stderr and "Traceback" not in done.stderr
        assert not is_mounted(mnt)
    assert "first_bogus_option" not in done.stderr  # only the failed run's own lines of the store's mount.log


def test_stats_into_a_closed_pipe_ends_quietly(tree: Path, mounter: Mount) -> None:
    mnt = mounter.mount(tree)
    for argv in (["stats", str(mnt)], ["stats", "--json", str(mnt)]):
        with subprocess.Popen([sys.executable, "-m", "liquidfs", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()  # `liquidfs stats MNT | head`, with head gone before stats prints
            err = proc.stderr.read().decode()
            status = proc.wait(60)
        assert status == 141 and err == "", err


def test_umount_refuses_a_fuse_mount_that_is_not_liquidfs(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.txt").write_text("a\n")
    mnt = tmp_path / "other"
    mnt.mkdir()
    rules = tmp_path / "rules.json"
    rules.write_text("{}")
    faultfs = Path(__file__).parents[1] / "support" / "faultfs.py"
    with open(tmp_path / "faultfs.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(faultfs), str(real), str(mnt), str(rules)], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: is_mounted(mnt) or proc.poll() is not None, 30, what="faultfs to mount")
        refused = run_cli("umount", str(mnt), check=False)
        assert refused.returncode == 1 and "not a liquidfs mount" in refused.stderr, refused.stderr
        assert is_mounted(mnt) and (mnt / "a.txt").read_text() == "a\n"
    finally:
        subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True)
        proc.terminate()
        proc.wait(10)


def test_a_daemon_serving_raw_objects_and_a_cache_loads_neither_numpy_nor_pillow(tmp_path: Path,
                                                                                 mounter: Mount) -> None:
    """NumPy and Pillow are the prepare's and the profile's: a daemon that serves prepared objects and holds a
    cache maps neither (they took 0.1-0.2 s of every mount's start and 13 MB of its memory)."""
    from sample import make_sample

    src = make_sample(tmp_path / "src", count=8, width=64, height=32, seed=3)
    run_cli("prepare", str(src), "--store", str(mounter.tmp / "store"), "--ratio", "1")
    mnt = mounter.mount(src, "--cache-size", "50%")
    for _ in range(2):  # a second epoch: the cache's hits
        for image in sorted(src.rglob("*.png")):
            with Image.open(mnt / image.relative_to(src)) as im, Image.open(image) as want:
                assert im.format == "BMP" and np.array_equal(np.asarray(im), np.asarray(want))
    values = json.loads(run_cli("stats", str(mnt), "--json").stdout)
    assert values["opens_raw"] == 16 and values["cache_hits"] > 0, values
    maps = Path(f"/proc/{daemon_pid(mnt)}/maps").read_text()
    assert "numpy" not in maps and "/PIL/" not in maps, [line for line in maps.splitlines()
                                                         if "numpy" in line or "/PIL/" in line][:3]
