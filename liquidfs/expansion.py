"""One image's expansion and its check, as a worker process runs them: decode a source, write the raw object
that holds exactly its pixels (or say why not), and judge an object against its source.

Objects are named by the path and identity of their source (a changed source gets a new object) and carry the
suffix of what they hold; nothing here knows the catalog's tables or which kind of store holds the objects.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import xxhash

from . import formats, resources
from .catalog import ExpansionRow, Node
from .locks import unique
from .directio import read_fd
from .paths import open_regular, open_under
from .reader import checksum, same_version

#: Files considered for expansion; their real format is then detected from their content.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".jpe", ".jfif")
_IMAGE_SUFFIXES_B = tuple(s.encode() for s in IMAGE_SUFFIXES)
OBJECTS = "objects"
#: The file name suffix of a raw object of each raw format (``formats.RAW_FORMATS``).
OBJECT_SUFFIXES = {"bmp": ".bmp", "j2k": ".jp2"}


def is_image(name: bytes) -> bool:
    """Whether a file of this name is a candidate for expansion (by its suffix; its content decides later)."""
    return name.lower().endswith(_IMAGE_SUFFIXES_B)


def raw_format_of(obj: str) -> str | None:
    """The raw format a raw object's name says it holds."""
    return next((fmt for fmt, suffix in OBJECT_SUFFIXES.items() if obj.endswith(suffix)), None)


def rank(seed: int, path: bytes) -> int:
    return xxhash.xxh3_64_intdigest(path, seed=seed)


def object_name(node: Node, raw_format: str = "bmp") -> str:
    """Objects are named by the path and identity of their source (a changed source gets a new object), and
    their suffix by what they hold."""
    identity = b"%s\0%d\0%d" % (node.path, node.size, node.mtime_ns)
    if node.etag is not None:
        identity += b"\0" + node.etag.encode()
    digest = xxhash.xxh3_128_hexdigest(identity)
    return f"{OBJECTS}/{digest[:2]}/{digest}{OBJECT_SUFFIXES[raw_format]}"


def _named_as(obj: str, raw_format: str) -> str:
    """``obj`` (an ``object_name``) for an object of ``raw_format``."""
    stem = obj.rsplit(".", 1)[0]
    return stem + OBJECT_SUFFIXES[raw_format]


@dataclass(frozen=True)
class Outcome:
    """What a worker did with one image: the object it holds now (maybe ``reused``), or why it was refused."""

    path: bytes
    src_size: int
    src_mtime_ns: int
    format: str | None
    object: str | None
    raw_size: int | None
    checksum: str | None
    reason: str | None
    reused: bool = False
    fatal: str | None = None  # stops the whole run (out of disk space)
    src_etag: str | None = None

    def row(self) -> ExpansionRow:
        """What the catalog keeps of it."""
        return ExpansionRow(self.src_size, self.src_mtime_ns, self.format, self.object, self.raw_size,
                            self.checksum, None if self.object else self.reason, self.src_etag)


#: In a worker: the bytes it may spend on one image (``resources.plan_workers``); None where not known.
_budget: int | None = None


def set_budget(budget: int | None) -> None:
    """The worker pool's initializer."""
    global _budget
    _budget = budget


def _too_large_for_memory(pixels: int, source_size: int) -> bool:
    return _budget is not None and resources.expansion_need(pixels, source_size) > _budget


def expand_bytes(rel: bytes, size: int, mtime_ns: int, source: bytes, etag: str | None = None,
                 raw_formats: tuple[str, ...] = ("bmp",)) -> tuple[Outcome | None, bytes | None, str | None]:
    """Expand one image held in memory to the first of ``raw_formats`` that holds it exactly: (None, raw bytes,
    source format), or (the refusal, None, format). The raw bytes say what they are (``formats.sniff``).
    Never raises."""
    pixels = formats.pixel_count(source)
    if pixels is not None and pixels <= formats.MAX_PIXELS and _too_large_for_memory(pixels, len(source)):
        # Refused from the header, before any pixel is decoded: decoding would get this worker OOM-killed.
        fmt = formats.sniff(source[:32])
        return Outcome(rel, size, mtime_ns, fmt, None, None, None, "no-memory", src_etag=etag), None, fmt
    try:
        for raw_format in raw_formats:
            result = formats.expand(source, to=raw_format)
            if result.data is not None or not (result.reason or "").startswith(f"{raw_format}-"):
                break  # accepted, or refused for a reason no other raw format would change
    except MemoryError:
        return Outcome(rel, size, mtime_ns, None, None, None, None, "too-large", src_etag=etag), None, None
    if result.data is None:
        return Outcome(rel, size, mtime_ns, result.source_format, None, None, None, result.reason,
                       src_etag=etag), None, result.source_format
    return None, result.data, result.source_format


def expand_one(root: bytes, rel: bytes, store: str, obj: str, want_size: int, want_mtime: int,
               want_version: str | None, raw_formats: tuple[str, ...] = ("bmp",)) -> Outcome:
    """Runs in a worker process: expand one image into the store, or say why not. Never raises.

    The source is opened below its root without following any link (as the mount opens it) and must be the
    file the catalog recorded, before and after it is read: root reads it, and another user may be able to
    swap it for a link to a file of theirs or of nobody's, or write it while it is read.
    """
    def outcome(reason: str | None, fmt: str | None = None, raw: bytes | None = None, *,
                reused: bool = False, fatal: str | None = None) -> Outcome:
        if raw is None:
            return Outcome(rel, want_size, want_mtime, fmt, None, None, None, reason, fatal=fatal,
                           src_etag=want_version)
        return Outcome(rel, want_size, want_mtime, fmt, obj, len(raw), checksum(raw), None, reused=reused,
                       src_etag=want_version)

    if _too_large_for_memory(0, want_size):
        return outcome("no-memory")  # reading it alone would not fit
    def unchanged(st: os.stat_result) -> bool:
        return same_version(st, want_size, want_mtime, want_version)

    try:
        fd = open_under(root, rel)
    except OSError as exc:
        return outcome(f"unreadable: {exc.strerror}")
    try:
        if not unchanged(os.fstat(fd)):
            return outcome("changed-during-prepare")
        try:
            source = bytes(read_fd(fd))  # O_DIRECT: prepare does not fill the page cache with the source
        except OSError as exc:
            return outcome(f"unreadable: {exc.strerror}")
        if not unchanged(os.fstat(fd)):
            return outcome("changed-during-prepare")  # written while read: the bytes may be torn
    finally:
        os.close(fd)
    refused, raw, fmt = expand_bytes(rel, want_size, want_mtime, source, want_version, raw_formats)
    if raw is None:
        return refused  # type: ignore[return-value]
    obj = _named_as(obj, formats.sniff(raw[:32]) or "bmp")
    final = os.path.join(store, obj)
    if _holds(final, raw):
        # A previous run (maybe killed before it recorded it) left exactly these bytes: nothing to write.  An
        # object is adopted only byte for byte, never on its name alone (a damaged one is rewritten).
        return outcome(None, fmt, raw, reused=True)
    tmp = f"{final}.{unique('tmp-')}"  # never a PID: prepares in two PID namespaces may share a store
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        fatal = "out of disk space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else f"cannot write {tmp}: {exc}"
        return outcome("write-failed", fmt, fatal=fatal)
    return outcome(None, fmt, raw)


def _holds(path: str, data: bytes) -> bool:
    """True when ``path`` is a regular file holding exactly ``data`` (never following a link)."""
    try:
        with open(open_regular(path), "rb") as f:
            return f.read(len(data) + 1) == data
    except OSError:
        return False


def verify_one(root: bytes, rel: bytes, obj: str, want_checksum: str, want_size: int, want_mtime: int,
               want_version: str | None = None) -> str | None:
    """None when the raw object is sound and decodes to the source's pixels; else what is wrong.  The source
    is read as the mount reads it (below its root, no link followed) and must be the file that was expanded."""
    try:
        with open(open_under(root, rel), "rb") as f:
            if not same_version(os.fstat(f.fileno()), want_size, want_mtime, want_version):
                return "source changed since prepare (it is served as the original)"
            original = f.read()
        with open(open_regular(obj), "rb") as f:  # EIO: not a regular file
            raw = f.read()
    except OSError as exc:
        return f"cannot read: {exc}"
    return judge(original, raw, want_checksum)


def judge(original: bytes, raw: bytes, want_checksum: str) -> str | None:
    """None when ``raw`` is the recorded object and decodes to the pixels of ``original``; else what is wrong."""
    if checksum(raw) != want_checksum:
        return "checksum mismatch"
    try:
        # mode, size, samples, and for palette images the palette and transparency too
        same = formats.same_pixels(original, raw)
    except Exception as exc:  # a decoder failure is a verdict here, not a crash
        return f"cannot decode: {exc}"
    return None if same else "pixels differ"
