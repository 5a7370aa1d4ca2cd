"""The watchdog's reading of mountinfo (``daemon.watchdog``): which fusectl connection a mount is, and where."""

from __future__ import annotations

from pathlib import Path

from liquidfs.daemon import watchdog


def test_a_mount_is_the_connection_fusectl_names_after_its_device_past_minor_255(tmp_path: Path) -> None:
    """fusectl names a connection after the kernel's device number (20 bits of minor): a node with hundreds of
    anonymous superblocks (a host of pods) gives FUSE mounts minors past 255, where glibc's makedev numbers
    differently (0:300 would be 1048620) and the watchdog found no connection to watch. Mount points come
    back with every escape mountinfo writes decoded (a backslash is \\134)."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_bytes(
        b"36 25 0:300 / /mnt/a\\040b rw,nosuid,nodev - fuse.liquidfs liquidfs rw,user_id=0,group_id=0\n"
        b"37 25 0:45 / /mnt/back\\134slash rw - fuse.liquidfs liquidfs rw\n"
        b"38 25 8:1 / /data rw shared:1 - ext4 /dev/sda1 rw\n")
    assert watchdog._mounts(str(mountinfo)) == [
        (36, 300, b"/mnt/a b", b"fuse.liquidfs"), (37, 45, b"/mnt/back\\slash", b"fuse.liquidfs"),
        (38, 8 << 20 | 1, b"/data", b"ext4")]
    assert watchdog.kernel_device(0, 300) == 300


def test_this_machines_mounts_are_read_whole() -> None:
    """Every line of the process's own mountinfo parses (optional fields and all)."""
    mounts = watchdog._mounts()
    assert mounts and any(point == b"/" for _, _, point, _ in mounts)


def test_a_mount_point_is_named_as_mountinfo_shows_it_without_touching_it(tmp_path: Path) -> None:
    """The links above it resolved in the kernel's order ("link/.." goes up from where the link led, not back
    to where it was written), its own name kept as it is (a stat of it would wait for its daemon)."""
    (tmp_path / "real" / "deep" / "mnt").mkdir(parents=True)
    (tmp_path / "real" / "mnt").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real" / "deep")
    shows = watchdog.as_mountinfo_shows
    assert shows(tmp_path / "link" / "mnt") == bytes(tmp_path / "real" / "deep" / "mnt")
    assert shows(Path(f"{tmp_path}/link/../mnt")) == bytes(tmp_path / "real" / "mnt")
    assert shows(Path(f"{tmp_path}/real/mnt/")) == bytes(tmp_path / "real" / "mnt")


def test_a_namespace_holds_a_copy_of_the_mount_only_through_a_fuse_mount_of_its_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once unmounted here, the connection's anonymous device number goes to the next mount made (a starting
    container's tmpfs): its processes were named as holding a copy of the mount, and umount failed."""
    from liquidfs.daemon import watchdog

    tables = {"tmpfs": [(7, 300, b"/run", b"tmpfs")], "copy": [(8, 300, b"/data", b"fuse.liquidfs")]}
    monkeypatch.setattr(watchdog, "_mounts", lambda table: tables[table.split("/")[2]])
    assert not watchdog.sees_connection("tmpfs", 300)  # type: ignore[arg-type]
    assert watchdog.sees_connection("copy", 300)  # type: ignore[arg-type]


def test_an_absolute_mount_point_is_named_from_a_deleted_working_directory(tmp_path: Path) -> None:
    """`liquidfs umount /abs/path` run from a directory since deleted failed with a bare "No such file or
    directory" (the working directory was asked for an absolute path too)."""
    import os

    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    os.chdir(gone)
    gone.rmdir()
    try:
        assert watchdog.as_mountinfo_shows(tmp_path / "mnt") == os.fsencode(os.path.realpath(tmp_path) + "/mnt")
    finally:
        os.chdir(here)
