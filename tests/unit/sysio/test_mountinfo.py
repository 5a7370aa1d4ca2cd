"""The one parser of the mount table (``sysio.mountinfo``): its escapes, a name that is no UTF-8, a mount point
named "-", and lines no kernel writes."""

from __future__ import annotations

from liquidfs.sysio import mountinfo, paths
from liquidfs.sysio.mountinfo import Mount

TABLE = (b"36 25 0:300 / /mnt/a\\040b rw,nosuid - fuse.liquidfs liquidfs rw,user_id=0\n"
         b"37 25 0:45 / /data/\xff\xfe rw shared:1 master:2 - fuse.sshfs alice@host: rw\n"
         b"38 25 8:1 / /- rw - ext4 /dev/sda1 rw\n"
         b"not a line of the kernel's\n"
         b"39 25 8:2 / /short\n")


def test_every_line_the_kernel_writes_is_read_and_no_other() -> None:
    assert mountinfo.parse(TABLE) == [
        Mount(36, 0, 300, b"/mnt/a b", b"fuse.liquidfs"),
        Mount(37, 0, 45, b"/data/\xff\xfe", b"fuse.sshfs"),  # optional fields skipped; the name as its bytes
        Mount(38, 8, 1, b"/-", b"ext4"),
    ]


def test_this_processs_table_is_read_whole() -> None:
    found = mountinfo.mounts()
    assert found and any(m.point == b"/" for m in found)
    assert mountinfo.mounts("/nonexistent/mountinfo") == []


def test_a_mount_point_that_is_no_utf8_stops_no_reader_of_the_table() -> None:
    """A user's FUSE mount on a directory of theirs with such a name: the table read as text (strict UTF-8) made
    every lookup of a filesystem's type, and the scan's mount points, fail."""
    text = TABLE.decode("utf-8", "surrogateescape")
    assert paths.mounted_below(b"/data", text) == frozenset({b"\xff\xfe"})
    assert paths.filesystem_type(b"/mnt/a b/x", text) == "fuse.liquidfs"


def test_a_mount_point_with_a_carriage_return_or_a_form_feed_is_read_whole() -> None:
    """The kernel escapes a space, a tab, a newline and a backslash in a path, nothing else: splitlines() and
    split() broke a line at a carriage return, a vertical tab or a form feed too. A user's FUSE mount on a
    directory of the source so named was lost, or read as one on a shorter name, and the scan stat-ed into it."""
    table = (b"40 25 0:301 / /data/bob/x\ry rw - fuse.sshfs bob@host: rw\n"
             b"41 25 0:302 / /data/bob/a\x0bb\x0cc rw - fuse.sshfs bob@host: rw\n")
    assert mountinfo.parse(table) == [Mount(40, 0, 301, b"/data/bob/x\ry", b"fuse.sshfs"),
                                      Mount(41, 0, 302, b"/data/bob/a\x0bb\x0cc", b"fuse.sshfs")]
    text = table.decode("utf-8", "surrogateescape")
    assert paths.mounted_below(b"/data", text) == frozenset({b"bob/x\ry", b"bob/a\x0bb\x0cc"})
