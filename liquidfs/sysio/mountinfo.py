"""The mount table as the kernel shows it (/proc/PID/mountinfo): one parser for whoever reads it (the watchdog
finding its mount and connection, the scan leaving mount points out, a filesystem's type).

Read as bytes: a mount point is whatever name its mounter chose, and one that is no UTF-8 (a user's FUSE mount on
a directory of theirs in a dataset) must not stop a reader of the table."""

from __future__ import annotations

import re
from typing import NamedTuple

#: This process's table.
SELF = "/proc/self/mountinfo"

_OCTAL = re.compile(rb"\\([0-7]{3})")


class Mount(NamedTuple):
    mount_id: int
    major: int
    minor: int
    point: bytes    # unescaped: a space is \040 in the table, a backslash \134
    fstype: bytes   # "fuse.liquidfs", "ext4"


def parse(table: bytes) -> list[Mount]:
    """Every well-formed line of ``table``, in its order (later lines are mounted over earlier ones at one point)."""
    found = []
    # Split where the kernel does only: it escapes a space, a tab, a newline and a backslash in a path, not a
    # carriage return or a form feed, which splitlines() and split() take for breaks (a mount on a directory
    # named "a\x0bb" read as one on "a", and one on "x\ry" lost).
    for line in table.split(b"\n"):
        fields = line.split(b" ")
        try:
            dash = fields.index(b"-", 6)
            major, minor = map(int, fields[2].split(b":"))
            found.append(Mount(int(fields[0]), major, minor, _OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]),
                                                                       fields[4]), fields[dash + 1]))
        except (ValueError, IndexError):  # no line the kernel writes: skipped
            continue
    return found


def read(path: str = SELF) -> bytes:
    """The whole table at ``path`` (OSError where it cannot be read)."""
    with open(path, "rb") as f:
        return f.read()


def mounts(path: str = SELF) -> list[Mount]:
    """``parse(read(path))``; none where the table cannot be read."""
    try:
        return parse(read(path))
    except OSError:
        return []
