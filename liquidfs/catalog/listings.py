"""Packed listings: a directory's entries (id, mode, name) as records in a few blobs of the catalog, written by
the build, so that a listing reads one row per ``CHUNK`` entries and hands it to the reply whole.

A ``find`` over ten million files spent ~1.2 us per entry in the daemon reading the entries as SQLite rows (0.65
us: a Python tuple, a ``bytes`` and two ints per row) and adding each to the reply from Python (BENCHMARKS
"Ten million files"); the walk of the source takes 0.6 us. A chunk of 1,024 records is one SQLite row and one
``bytes``, and our pyfuse3 patch adds its records to the reply in C (``pyfuse3.readdir_reply_packed``).

A record is ``RECORD`` (an 8-byte id, a 4-byte mode and a 2-byte name length, little-endian), then the name.
A chunk holds up to ``CHUNK`` records of one directory in ascending id order, keyed by its directory and the id
of its last record (``listings`` table). Only a catalog whose meta says ``listings = FORMAT`` has them, whole
(every build writes them; a catalog built by an older liquidfs has none): other catalogs are listed from their
rows, as every catalog was before.

The catalog may be written by whoever can write the store: a chunk longer than a build writes is not read, a
record is checked before it is used (its length, its name's, ids ascending), and a malformed one makes the
listing go on from the rows (``fuse.listing``). What a record says of an entry listed bare (its inode number and
type) is not checked against the rows: the kernel makes no inode or dentry of a bare entry, so a tampered record
can show a wrong number or type in a listing, never a file under another's name, and a LOOKUP of the name reads
the rows. A directory's or link's record, which is listed with attributes, must name the node of that name.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

#: A record's head: id, mode, name length.
RECORD = struct.Struct("<QIH")
#: Records of one chunk: a chunk is read whole for each reply that lists from it (~20 KB here).
CHUNK = 1024
#: The meta key, and the format its value names.
META_KEY = "listings"
FORMAT = "1"
#: A name's length in bytes, as Linux allows.
NAME_MAX = 255


def longest_chunk() -> int:
    """Bytes of the longest chunk a build writes: a longer one is not read (a reply reads its chunk whole)."""
    return CHUNK * (RECORD.size + NAME_MAX)


def chunks(ids: Sequence[int], records: Sequence[bytes]) -> Iterator[tuple[int, bytes]]:
    """One directory's ``records`` (``record``'s), whose ids ``ids`` ascend one for one, as (id of the last
    record, chunk) items of up to ``CHUNK`` records each."""
    size = CHUNK
    for start in range(0, len(records), size):
        end = min(start + size, len(records))
        yield ids[end - 1], b"".join(records[start:end])


def fit_name(name: bytes) -> bool:
    """Whether a catalog's ``name`` can be a directory entry: 1 to ``NAME_MAX`` bytes, no NUL or '/', not '.'
    or '..'. The catalog may be written by whoever can write the store: a '/' in a listed name makes the kernel
    fail the whole listing (EIO), and libfuse cuts a name at a NUL (an alias of another entry)."""
    return 0 < len(name) <= NAME_MAX and b"\0" not in name and b"/" not in name and name not in (b".", b"..")


def record(ident: int, mode: int, name: bytes) -> bytes:
    return RECORD.pack(ident, mode, len(name)) + name


class MalformedRecord(ValueError):
    """A record that is short, has a name of 0 or over ``NAME_MAX`` bytes, with a NUL or a '/', or '.' or '..',
    or an id not above the previous record's; ``pos`` is its first byte."""

    def __init__(self, pos: int, why: str) -> None:
        super().__init__(f"the record at byte {pos} {why}")
        self.pos = pos


def read(chunk: bytes, pos: int = 0, after: int = 0) -> Iterator[tuple[int, int, bytes, int, int]]:
    """The records of ``chunk`` from byte ``pos`` on whose id is above ``after``: (id, mode, name, the record's
    first byte, the byte after it). The reference for ``pyfuse3.readdir_reply_packed``, which reads the same
    records in C; raises ``MalformedRecord`` where it says -1."""
    previous = 0  # the record's before, listed or passed over: ids ascend
    while pos < len(chunk):
        if len(chunk) - pos < RECORD.size:
            raise MalformedRecord(pos, "is cut short")
        ident, mode, length = RECORD.unpack_from(chunk, pos)
        end = pos + RECORD.size + length
        name = chunk[pos + RECORD.size:end]
        if len(name) != length or not fit_name(name) or ident >= 2**63:
            raise MalformedRecord(pos, "has a malformed name or id")
        if ident <= previous:
            raise MalformedRecord(pos, f"does not ascend (id {ident} after {previous})")
        previous = ident
        if ident > after:
            yield ident, mode, name, pos, end
        pos = end
