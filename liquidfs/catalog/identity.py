"""What tells a recorded thing apart: the digest of a raw object's bytes, and whether a local file is still
the version the catalog recorded."""

from __future__ import annotations

import hashlib
import os
import re
from typing import TypeGuard

from . import file_version

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


def same_version(st: os.stat_result, size: int, mtime_ns: int, version: str | None) -> bool:
    """True while the local file behind ``st`` has the recorded size, mtime and, where it was recorded, version
    (inode and ctime: ``catalog.file_version``)."""
    return (st.st_size, st.st_mtime_ns) == (size, mtime_ns) and (version is None or version == file_version(st))
