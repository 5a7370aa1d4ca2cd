"""The second round of trust boundaries (issue 26): what a dataset writer, a store writer or another user of an
--allow-other mount can do to a root daemon. One test per class, each failing on the code before its fix."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from fusehelpers import DATA_PATHS, Mount, as_nobody, wait_for
from liquidfs.catalog.catalog import Catalog
from liquidfs.daemon.control import read_control
from liquidfs.prepare import prepare
from sample import make_sample

#: Seconds a request to a healthy mount may take here before it counts as hung (a generous bound on a loaded
#: 2-core machine, not a performance figure).
HUNG = 20


def _connection(mnt: Path) -> str | None:
    """The fusectl connection number of the mount at ``mnt`` (its device's minor), from mountinfo: a stat of a
    hung mount would hang too."""
    target = os.path.abspath(mnt)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].replace("\\040", " ") == target:
                return fields[2].split(":")[1]
    return None


def _abort(mnt: Path) -> None:
    """Abort a hung mount's FUSE connection, so a failing test leaves no process stuck in it."""
    conn = _connection(mnt)
    if conn is None:
        return
    if not os.path.isdir("/sys/fs/fuse/connections"):
        subprocess.run(["mount", "-t", "fusectl", "none", "/sys/fs/fuse/connections"], capture_output=True)
    try:
        Path(f"/sys/fs/fuse/connections/{conn}/abort").write_text("1")
    except OSError:
        pass


#: Processes left waiting on a hung mount: killed, and reaped once its connection is aborted (a process waiting
#: for a directory lock held by a request the daemon never answers cannot die before that).
_stuck: list[subprocess.Popen[bytes]] = []


def _answers(*cmd: str) -> subprocess.CompletedProcess[bytes] | None:
    """``cmd``'s result, or None when it did not finish within HUNG seconds (the mount is hung)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=HUNG)
    except subprocess.TimeoutExpired:
        proc.kill()
        _stuck.append(proc)
        return None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _abort_if_hung(mnt: Path) -> None:
    """Leave nothing stuck behind a test that found the mount hung."""
    if _stuck or (_connection(mnt) is not None and _answers("stat", str(mnt)) is None):
        _abort(mnt)
    while _stuck:
        proc = _stuck.pop()
        try:
            proc.communicate(timeout=HUNG)
        except subprocess.TimeoutExpired:
            pass


@pytest.mark.fuse
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_a_held_files_directory_swapped_for_a_link_into_the_mount_never_hangs_it(tmp_path: Path, mounter: Mount,
                                                                                 data_path: str) -> None:
    """The "has the source changed" check of a next-epoch cache hit was a path stat on the loop, which follows
    links in every component but the last: a dataset writer who swapped a held file's directory for a link into
    the mount made the daemon LOOKUP in its own mount, which its blocked loop never answered, and every process
    touching the mount hung. Every source check now walks below the held root without links or crossing into
    another filesystem, and never waits on the loop."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    payload = {f"f{i}.bin": os.urandom(40_000 + i) for i in range(4)}
    for name, data in payload.items():
        (src / "d" / name).write_bytes(data)
    mnt = mounter.mount(src, "--cache-size", "100%", "--data-path", data_path)
    try:
        for name, data in payload.items():  # first epoch: every file is read once and held for the next
            assert (mnt / "d" / name).read_bytes() == data
        wait_for(lambda: read_control(mnt)["cache_held_files"] >= 1, 30, what="held files")
        (src / "d").rename(src / "d0")
        (src / "d").symlink_to(mnt / "nowhere")
        reads = [_answers("cat", str(mnt / "d" / name)) for name in payload]
        listing = _answers("ls", str(mnt))
        stats = _answers("cat", str(mnt / ".__liquidfs__"))
        assert listing is not None and stats is not None and None not in reads, "the mount hung"
        assert listing.returncode == 0 and b"d" in listing.stdout.split()
        for name, done in zip(payload, reads):
            assert done is not None
            # the source is no longer below the root without a link: an error, never bytes from elsewhere
            assert done.returncode != 0 and done.stdout == b"", (name, done.stderr)
    finally:
        _abort_if_hung(mnt)


@pytest.mark.fuse
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_an_object_damaged_in_place_and_prepared_again_is_never_served(tmp_path: Path, mounter: Mount,
                                                                       data_path: str) -> None:
    """A store-wide seal time vouched for every object whose ctime was older, and every prepare moved it, objects
    it reused unread included: an object damaged in place, then a prepare (the Kubernetes init container runs
    one at every pod start), was passed through with no fallback. What vouches for an object is now its own
    stamp, taken when it was written or read and checked, which a reuse leaves as it was; and a prepare reuses
    an object unread only where that stamp is its own still (this one is made again, sound), so the damage that
    reaches a mount is one done after the last prepare."""
    src = tmp_path / "src"
    make_sample(src, count=3, width=256, height=128, seed=21)
    store = tmp_path / "store"
    prepare(src, store, ratio=1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    node = next(n for n in catalog.files() if n.served_raw)
    catalog.close()
    obj = store / str(node.object)
    sound = obj.read_bytes()
    damaged = bytearray(sound)
    damaged[-100] ^= 0xFF

    def damage() -> None:
        with open(obj, "r+b") as f:  # in place: the same inode, the same size
            f.seek(len(damaged) - 100)
            f.write(bytes([damaged[-100]]))

    damage()
    time.sleep(0.05)
    prepare(src, store, ratio=1.0, progress=False)  # its stamp is not the object's: made again
    assert obj.read_bytes() == sound
    damage()  # after the prepare, the object it sealed
    mnt = mounter.mount(src, "--data-path", data_path, store=store)
    rel = os.fsdecode(node.path)
    original = (src / rel).read_bytes()
    try:
        served = (mnt / rel).read_bytes()
    except OSError as exc:  # the daemon path, deferred read: EIO at the first read, then the original
        assert exc.errno == errno.EIO
        served = (mnt / rel).read_bytes()
    assert served != bytes(damaged)
    assert served == original
    values = read_control(mnt)
    assert values["fallbacks"] >= 1 and values.get("backing_object", 0) == 0


def test_a_catalog_row_pointing_at_another_images_object_is_refused(tmp_path: Path) -> None:
    """A writer of the catalog copied another image's object name, size, checksum and stamp into a row: the
    stamp and the checksum then vouched for the other image's bytes. Only the object named after the row's own
    source is opened; anything else serves the original."""
    import dataclasses

    from liquidfs.datapath.backing import resolve
    from liquidfs.stores.local.reader import StoreReader

    src = tmp_path / "src"
    make_sample(src, count=2, width=64, height=48, seed=22)
    store = tmp_path / "store"
    prepare(src, store, ratio=1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    a, b = [n for n in catalog.files() if n.served_raw][:2]
    reader = StoreReader(catalog.source, store)
    try:
        forged = dataclasses.replace(a, object=b.object, served_size=b.served_size, checksum=b.checksum,
                                     object_stamp=b.object_stamp)
        with pytest.raises(OSError) as info:
            reader.open_object(forged)
        assert info.value.errno == errno.EIO
        content = reader.open(forged)
        try:
            assert bytes(content.data) == (src / os.fsdecode(a.path)).read_bytes() and not content.raw
        finally:
            content.close()
        backing = resolve(reader, forged)
        assert backing is not None
        try:
            assert not backing.raw and os.pread(backing.fd, backing.size + 1, 0) == (src / os.fsdecode(a.path)).read_bytes()
        finally:
            backing.close()
    finally:
        reader.close()
        catalog.close()


def _deny_acl(path: Path, uid: int) -> None:
    """A POSIX access ACL on ``path``: its mode bits, and no access at all for ``uid`` (``setfacl -m
    u:UID:---``), written as the kernel's xattr format so the test needs no acl package."""
    mode = path.stat().st_mode
    entries = [(0x01, mode >> 6 & 7, 0xFFFFFFFF),   # ACL_USER_OBJ
               (0x02, 0, uid),                       # ACL_USER: nothing
               (0x04, mode >> 3 & 7, 0xFFFFFFFF),   # ACL_GROUP_OBJ
               (0x10, mode >> 3 & 7, 0xFFFFFFFF),   # ACL_MASK
               (0x20, mode & 7, 0xFFFFFFFF)]        # ACL_OTHER
    os.setxattr(path, "system.posix_acl_access",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))


@pytest.mark.fuse
@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_an_acl_that_denies_a_user_binds_them_through_the_mount(public_dir: Path, tmp_path: Path, mounter: Mount,
                                                                data_path: str) -> None:
    """Only the owner, group and other bits were compared at open: an ACL entry denying a user (mode 0644) was
    ignored through an --allow-other mount, so they read through the mount what they cannot read directly.
    The check is now the kernel's own, made with the caller's credentials."""
    src = tmp_path / "data"
    src.mkdir()
    for name in ("denied.txt", "open.txt"):
        (src / name).write_text(f"{name}\n")
        (src / name).chmod(0o644)
    src.chmod(0o755)
    mnt = public_dir / "acl"
    mnt.mkdir()
    mounter.mount(src, "--allow-other", "--data-path", data_path, mountpoint=mnt)
    _deny_acl(src / "denied.txt", 65534)
    public = public_dir / "direct.txt"  # the same ACL where nobody can reach it directly: the kernel says no
    public.write_text("direct\n")
    public.chmod(0o644)
    _deny_acl(public, 65534)
    assert as_nobody("cat", str(public)).returncode != 0
    denied = as_nobody("cat", str(mnt / "denied.txt"))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    assert as_nobody("cat", str(mnt / "open.txt")).stdout == "open.txt\n"
    assert (mnt / "denied.txt").read_text() == "denied.txt\n"  # the mount's owner (root) still reads it
