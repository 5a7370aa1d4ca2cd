"""Where a path lies (``paths.filesystem_type``, ``filesystem_type_of``): what decides whether a source is
checked on the loop, and whether it may have ACLs of its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from liquidfs.sysio import paths

MOUNTINFO = """22 1 8:1 / / rw - ext4 /dev/sda1 rw
30 22 0:40 / /data rw - nfs srv:/x rw
31 30 0:41 / /data/my\\040set rw - fuse.sshfs a rw
32 22 0:42 / /data2 rw - tmpfs t rw
33 32 0:43 / /data2 rw - nfs4 s:/y rw
"""

def test_the_filesystem_under_a_source_decides_where_it_is_checked() -> None:
    from liquidfs.sysio.paths import LOCAL_FILESYSTEMS, filesystem_type

    found = {p: filesystem_type(p, MOUNTINFO) for p in ("/", "/data/a", "/data/my set/b", "/data/my", "/data2/x")}
    assert found == {"/": "ext4", "/data/a": "nfs", "/data/my set/b": "fuse.sshfs", "/data/my": "nfs",
                     "/data2/x": "nfs4"}  # the innermost mount, the last one mounted over the same point
    assert {t for t in found.values() if t in LOCAL_FILESYSTEMS} == {"ext4"}


def test_the_mount_points_below_a_root_are_named_relative_to_it() -> None:
    """Strictly below the root (not the root itself, nor a sibling that shares its prefix: /data2 is not below
    /data), escaped spaces read as spaces."""
    assert paths.mounted_below("/data", MOUNTINFO) == frozenset({b"my set"})
    assert paths.mounted_below("/", MOUNTINFO) == frozenset({b"data", b"data/my set", b"data2"})
    assert paths.mounted_below("/data/my set", MOUNTINFO) == frozenset()


def test_a_catalog_path_that_leaves_its_root_or_hides_a_nul_is_refused(tmp_path) -> None:
    import errno
    import os

    import pytest

    from liquidfs.sysio.paths import open_below, open_dir, stat_below

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.bin").write_bytes(b"x")
    root = open_dir(tmp_path)
    try:
        os.close(open_below(root, b"d/f.bin"))
        # "d/f.bin\0junk" would reach d/f.bin through a system call: a row naming a file it does not say
        for rel in (b"d/f.bin\0junk", b"d/../d/f.bin", b"/d/f.bin", b"d//f.bin", b"./d/f.bin", b""):
            for walk in (open_below, stat_below):
                with pytest.raises(OSError) as refused:
                    walk(root, rel)
                assert refused.value.errno == errno.EIO, (rel, walk)
    finally:
        os.close(root)


def test_a_descriptors_filesystem_is_found_by_its_device_not_a_path(tmp_path: Path) -> None:
    """Whether a source has ACLs of its own (NFSv4's) is asked of what the daemon holds open: a path may name
    another filesystem by now (a link swapped in, a mount over it)."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        device = os.fstat(fd).st_dev
        line = f"36 25 {os.major(device)}:{os.minor(device)} / {tmp_path} rw shared:1 - nfs4 server:/x rw\n"
        assert paths.filesystem_type_of(fd, "1 0 0:1 / / rw - ext4 /dev/root rw\n" + line) == "nfs4"
        assert paths.filesystem_type_of(fd, "1 0 0:1 / / rw - ext4 /dev/root rw\n") is None
        assert paths.filesystem_type_of(fd) == paths.filesystem_type(str(tmp_path))  # this machine's own
    finally:
        os.close(fd)


def test_a_kernel_with_openat2_but_no_cached_walks_walks_with_openat2(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One probe of openat2 and RESOLVE_CACHED together took a 5.6-5.11 kernel (openat2, no RESOLVE_CACHED) for
    one without openat2: every walk there went one component at a time, the weaker way. openat2 walks there; a
    walk asking for the caches only is sent to a worker thread at once."""
    from liquidfs.sysio import paths

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    if not paths.HAS_OPENAT2:
        pytest.fail("this kernel has openat2 (5.6+): the probe of it must say so")
    monkeypatch.setattr(paths, "CACHED_WALKS", False)
    asked: list[int] = []
    real = paths._openat2

    def recorded(dir_fd: int, rel: bytes, flags: int, resolve: int) -> int:
        asked.append(resolve)
        return real(dir_fd, rel, flags, resolve)

    monkeypatch.setattr(paths, "_openat2", recorded)
    root = paths.open_dir(tmp_path)
    try:
        os.close(paths.open_below(root, b"d/f"))
        assert asked and not asked[0] & paths._RESOLVE_CACHED
        with pytest.raises(BlockingIOError):
            paths.open_below(root, b"d/f", cached_only=True)
        assert len(asked) == 1
    finally:
        os.close(root)


def test_a_mount_table_watch_that_cannot_be_made_keeps_no_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(self: paths.MountsBelow) -> frozenset[bytes]:
        raise KeyboardInterrupt  # amid the first read of the table

    monkeypatch.setattr(paths.MountsBelow, "_read", failing)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyboardInterrupt):
        paths.MountsBelow(b"/")
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_listing_tells_each_entrys_kind_while_its_directory_is_open(tmp_path: Path) -> None:
    """``DirEntry``s outlived the descriptor they were listed from: where the filesystem gives no type
    (DT_UNKNOWN: XFS without ftype, some FUSE and NFS), their is_dir() stat-ed through a closed descriptor
    (EBADF), or through another directory's that took its number. The kinds are decided at the listing."""
    from liquidfs.sysio.paths import list_below

    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "f.png").write_bytes(b"x")
    (tmp_path / "d" / "link").symlink_to("sub")
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        listed = {e.name: (e.is_dir, e.is_file) for e in list_below(root, b"d")}
    finally:
        os.close(root)
    assert listed == {"sub": (True, False), "f.png": (False, True), "link": (False, False)}
