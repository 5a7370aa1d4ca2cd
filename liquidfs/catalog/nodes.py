"""A catalog's rows as the rest of liquidfs reads them: a node of the tree (``Node``: a directory, file or
symlink, and which of its representations is served), what prepare learnt of one image (``ExpansionRow``), and
the codes a row stores for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

ROOT_ID = 1  # pyfuse3.ROOT_INODE
#: The mount's control file: a hidden entry at the root, found by lookup, never listed by readdir (so `ls -a`
#: shows the tree unchanged), its inode far above any row's.
CONTROL_NAME = b".__liquidfs__"
CONTROL_ID = 1 << 62

KIND_FILE = 0
KIND_DIR = 1
KIND_SYMLINK = 2

REPR_ORIGINAL = 0
REPR_RAW = 1


@dataclass(frozen=True, slots=True)
class Node:
    id: int
    parent: int
    name: bytes
    path: bytes
    kind: int
    mode: int
    size: int
    mtime_ns: int
    nsubdirs: int
    target: bytes | None
    representation: int          # REPR_ORIGINAL or REPR_RAW: which bytes are served
    served_size: int | None
    object: str | None
    checksum: str | None
    etag: str | None = None
    #: The raw object's identity (``object_stamp``) when prepare wrote it or last read it whole and checked it:
    #: what lets a stat vouch for it. None: only its checksum can.
    object_stamp: str | None = None

    @property
    def served_raw(self) -> bool:
        return self.representation == REPR_RAW

    @property
    def nlink(self) -> int:
        return 2 + self.nsubdirs if self.kind == KIND_DIR else 1

    @property
    def size_served(self) -> int:
        """The size a reader sees: the raw object's when it is served, else the source's."""
        if self.served_raw and self.served_size is not None:
            return self.served_size
        return self.size


class ExpansionRow(NamedTuple):
    """What prepare learnt of one image (a row of ``expansions``): the source version it saw, and the object it
    wrote or why it refused."""

    src_size: int
    src_mtime_ns: int
    format: str | None
    object: str | None       # None when refused
    raw_size: int | None
    checksum: str | None
    reason: str | None       # why it was refused; None when expanded
    src_etag: str | None
    object_stamp: str | None = None  # the object's identity when written or last checked (``object_stamp``)

    def describes(self, node: Node) -> bool:
        """Whether it was learnt of the version of the source ``node`` describes."""
        return (self.src_size, self.src_mtime_ns, self.src_etag) == (node.size, node.mtime_ns, node.etag)
