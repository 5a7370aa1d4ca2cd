"""What tells a recorded thing apart: the digest of a raw object's bytes, whether a local file is still the
version the catalog recorded, a raw object's name and its stamp."""

from __future__ import annotations

import hashlib
import os
import re
from typing import TypeGuard

import xxhash

from .nodes import Node

#: What ``checksum`` returns. A catalog is anyone's: a row's digest of any other form vouches for nothing.
DIGEST = re.compile(r"[0-9a-f]{64}")
#: An xxh3_64 digest, as a prepare before BLAKE2b recorded it: it vouches for no bytes anyone may have chosen.
LEGACY_DIGEST = re.compile(r"[0-9a-f]{16}")
#: Why an object whose recorded digest is xxh3 is served as its original (``check_raw``).
LEGACY_REASON = ("its recorded digest is an xxh3 one, which cannot vouch for bytes a writer of the store may have "
                 "chosen: run `liquidfs prepare` again to record BLAKE2b digests")


def is_digest(value: str | None) -> TypeGuard[str]:
    """Whether ``value`` is a digest ``checksum`` gives (a catalog row's, an object's metadata)."""
    return value is not None and DIGEST.fullmatch(value) is not None


def digest_refusal(recorded: str | None) -> str | None:
    """None where ``recorded`` is a digest ``checksum`` gives; else why it vouches for no bytes: an xxh3 one, of a
    prepare before BLAKE2b (``LEGACY_REASON``), or one of no form prepare gives."""
    if is_digest(recorded):
        return None
    if recorded is not None and LEGACY_DIGEST.fullmatch(recorded):
        return LEGACY_REASON
    return "the recorded digest is not one prepare gives: refused"


def checksum(data: bytes | memoryview) -> str:
    """The digest prepare records of a raw object and every check of the object compares (BLAKE2b-256, hex)."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


#: The range of an SQLite INTEGER (a signed 64-bit number).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def stored_ns(ns: int) -> int:
    """A time in nanoseconds as the catalog records it and every comparison with a recorded one takes it: within
    SQLite's range. A file dated after 2262 (``touch -d 2400-01-01``: ext4 keeps dates to 2446; an object's
    LastModified) has an mtime past it, and one such file anyone may write failed every scan of the dataset with
    an OverflowError."""
    return min(max(ns, INT64_MIN), INT64_MAX)


def same_version(st: os.stat_result, size: int, mtime_ns: int, version: str | None) -> bool:
    """True while the local file behind ``st`` has the recorded size, mtime and, where it was recorded, version
    (inode and ctime: ``file_version``)."""
    return ((st.st_size, stored_ns(st.st_mtime_ns)) == (size, mtime_ns)
            and (version is None or version == file_version(st)))


def file_version(st: os.stat_result) -> str:
    """What, besides size and mtime, tells a local file apart from any other content at the same path.

    Size and mtime alone can be put back (``touch -d``, ``cp -p``, ``rsync -t``): a file rewritten that way would
    keep a stale raw object in service.  The inode number changes with a replaced file and the ctime with any
    write, truncation, rename or mode change, and neither can be set back by an unprivileged user.
    """
    return f"ino:{st.st_ino}:ctime:{st.st_ctime_ns}"


def version_inode(version: str | None) -> int | None:
    """The inode number ``file_version`` recorded in ``version``; None for another kind of version (an object
    store's ETag) or none."""
    if version is None or not version.startswith("ino:"):
        return None
    try:
        return int(version.split(":", 2)[1])
    except ValueError:
        return None


def object_key(node: Node) -> str:
    """The hex digest a raw object of ``node`` is named by (``expansion.object_name``): the path and identity of
    its source, so a changed source gets a new object, and a catalog row can only name the object of its own
    source (``stores.local.reader.StoreReader.open_object``), never another image's."""
    identity = b"%s\0%d\0%d" % (node.path, node.size, node.mtime_ns)
    if node.etag is not None:
        identity += b"\0" + node.etag.encode()
    return xxhash.xxh3_128_hexdigest(identity)


def object_stamp(st: os.stat_result) -> str:
    """What tells a raw object apart from any other content under its name: its inode, ctime and size. Any write,
    truncation, rename or replacement changes one of them, and none can be set back by anyone but root."""
    return f"ino:{st.st_ino}:ctime:{st.st_ctime_ns}:size:{st.st_size}"

