"""Two byte strings of one length with one xxh3_64, as a writer of a store object makes them in a moment: what an
xxh3 checksum could not keep out (issue 38); and a store as a prepare that recorded xxh3 checksums left it.

XXH3 adds each 8-byte lane of a 64-byte stripe to one accumulator and the product of its halves, XORed with the
secret, to the other. A lane whose low half equals the secret's adds no product, whatever its high half: two such
lanes of one block whose high halves move by +d and -d leave both accumulators, and so the hash, unchanged.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import xxhash

#: The start of XXH3's default secret (``XXH3_kSecret`` in xxhash.h: public, the same in every build).
_SECRET = bytes.fromhex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
                        "cb79e64eccc0e578825ad07dccff7221")
_STRIPE = 64
_MASK = (1 << 64) - 1


def _key(stripe: int) -> int:
    """The secret lane 0 of ``stripe`` (of the first block) is XORed with."""
    return int.from_bytes(_SECRET[8 * stripe:8 * stripe + 8], "little")


def xxh3_twins(data: bytes, stripes: tuple[int, int] = (4, 5)) -> tuple[bytes, bytes]:
    """``data`` with lane 0 of two stripes of its first 1 KiB block set as the attack needs, and a second string
    that differs from it in those 16 bytes only, with the same xxh3_64. ``data`` must be longer than a block and
    a stripe (the long-input path), and the caller must not mind those bytes changing (pixels, not a header)."""
    assert len(data) > 1024 + _STRIPE and all(0 <= s < 16 for s in stripes)
    s, t = stripes
    a = _key(s) ^ (0x1234_5678 << 32)
    b = _key(t) ^ (0x9ABC_DEF0 << 32)
    forged_a = _key(s) ^ (0x0BAD_CAFE << 32)
    forged_b = (a + b - forged_a) & _MASK  # the sum is kept; its low half is still the secret's

    def with_lanes(x: int, y: int) -> bytes:
        out = bytearray(data)
        out[_STRIPE * s:_STRIPE * s + 8] = x.to_bytes(8, "little")
        out[_STRIPE * t:_STRIPE * t + 8] = y.to_bytes(8, "little")
        return bytes(out)

    one, other = with_lanes(a, b), with_lanes(forged_a, forged_b)
    assert one != other and xxhash.xxh3_64_hexdigest(one) == xxhash.xxh3_64_hexdigest(other), "not twins"
    return one, other


def as_before_blake2b(store: Path) -> int:
    """The local ``store`` as a prepare before BLAKE2b left it: each raw object's xxh3_64 recorded where its
    BLAKE2b digest is, in a catalog of schema version 4. The number of objects."""
    db = sqlite3.connect(store / "catalog.sqlite")
    try:
        objects = [row[0] for row in db.execute("SELECT DISTINCT object FROM expansions WHERE object IS NOT NULL")]
        for obj in objects:
            old = xxhash.xxh3_64_hexdigest((store / obj).read_bytes())
            db.execute("UPDATE expansions SET checksum=? WHERE object=?", (old, obj))
            db.execute("UPDATE nodes SET checksum=? WHERE object=?", (old, obj))
        db.execute("UPDATE meta SET value='4' WHERE key='schema_version'")
        db.commit()
    finally:
        db.close()
    return len(objects)
