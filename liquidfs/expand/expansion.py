"""One image's expansion and its check, as a worker process runs them: decode a source, write the raw object
that holds exactly its pixels (or say why not), and judge an object against its source.

Objects are named by the path and identity of their source (a changed source gets a new object) and carry the
suffix of what they hold; nothing here knows the catalog's tables or which kind of store holds the objects.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from ..catalog.identity import checksum, digest_refusal, object_key, object_stamp, same_version
from ..catalog.nodes import ExpansionRow, Node
from ..sysio.directio import read_span
from ..sysio.locks import unique
from ..sysio.orphans import exit_with
from ..sysio.paths import (RootReplaced, open_below, open_dir, open_regular, open_to_others, open_under,
                           renamed_only_by_its_writer)
from . import workers as resources
from .rawformats import DEFAULT, DEFAULT_FORMATS, MAX_OBJECT_BYTES, RAW_FORMATS

#: Files considered for expansion; their real format is then detected from their content.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".jpe", ".jfif")
_IMAGE_SUFFIXES_B = tuple(s.encode() for s in IMAGE_SUFFIXES)
OBJECTS = "objects"

log = logging.getLogger(__name__)


def is_image(name: bytes) -> bool:
    """Whether a file of this name is a candidate for expansion (by its suffix; its content decides later)."""
    return name.lower().endswith(_IMAGE_SUFFIXES_B)


def rank(seed: int, path: bytes) -> int:
    # xxh3: an order, not a check (a path that ranks first is served raw, nothing more).
    return xxhash.xxh3_64_intdigest(path, seed=seed)


def object_name(node: Node, raw_format: str = DEFAULT.name) -> str:
    """Objects are named by the path and identity of their source (a changed source gets a new object), and
    their suffix by what they hold (``rawformats``: ``reader.OBJECT_NAME`` matches every such name)."""
    digest = object_key(node)
    return f"{OBJECTS}/{digest[:2]}/{digest}{RAW_FORMATS[raw_format].suffix}"


def _named_as(obj: str, raw_format: str) -> str:
    """``obj`` (an ``object_name``) for an object of ``raw_format``."""
    stem = obj.rsplit(".", 1)[0]
    return stem + RAW_FORMATS[raw_format].suffix


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
    object_stamp: str | None = None  # the object's identity right after it was written or read and checked

    def row(self) -> ExpansionRow:
        """What the catalog keeps of it."""
        return ExpansionRow(self.src_size, self.src_mtime_ns, self.format, self.object, self.raw_size,
                            self.checksum, None if self.object else self.reason, self.src_etag,
                            self.object_stamp)


#: In a worker: the bytes it may spend on one image (``expand.workers.plan_workers``); None where not known.
_budget: int | None = None


def set_budget(budget: int | None, command: int | None = None) -> None:
    """The worker pool's initializer: the memory a worker may take, and the command's pid (it exits with it,
    ``sysio.orphans``)."""
    global _budget
    _budget = budget
    if command is not None:
        exit_with(command)


def _too_large_for_memory(pixels: int, source_size: int, raw_formats: tuple[str, ...] = DEFAULT_FORMATS) -> bool:
    return _budget is not None and resources.expansion_need(pixels, source_size, raw_formats) > _budget


def source_fits(size: int) -> bool:
    """Whether a source of ``size`` bytes may be read into this worker at all (its decode is judged from its
    header once read): a size whoever writes the source chooses, 60 GB as well."""
    return not _too_large_for_memory(0, size)


def expand_bytes(rel: bytes, size: int, mtime_ns: int, source: bytes, etag: str | None = None,
                 raw_formats: tuple[str, ...] = DEFAULT_FORMATS) -> tuple[Outcome | None, bytes | None, str | None]:
    """Expand one image held in memory to the first of ``raw_formats`` that holds it exactly: (None, raw bytes,
    source format), or (the refusal, None, format). The raw bytes say what they are (``formats.sniff``).
    Never raises."""
    from . import formats  # NumPy and Pillow load where an image is expanded, not in every mount that imports this

    pixels = formats.pixel_count(source)
    if pixels is not None and pixels <= formats.MAX_PIXELS:
        # Each format at its own need (a J2K encode takes three times a BMP's): one that would not fit is not
        # tried, so a later one (a BMP after a J2K) may still hold the image. None fits: refused from the header,
        # before any pixel is decoded, as decoding would get this worker OOM-killed.
        raw_formats = tuple(f for f in raw_formats if not _too_large_for_memory(pixels, len(source), (f,)))
        if not raw_formats:
            fmt = formats.sniff(source[:32])
            return Outcome(rel, size, mtime_ns, fmt, None, None, None, "no-memory", src_etag=etag), None, fmt
    try:
        for raw_format in raw_formats:
            result = formats.expand(source, to=raw_format)
            if result.data is not None or not RAW_FORMATS[raw_format].owns(result.reason):
                break  # accepted, or refused for a reason no other raw format would change
    except MemoryError:  # this run's memory, not the image's size (refused above): tried again by the next run
        return Outcome(rel, size, mtime_ns, None, None, None, None, "no-memory", src_etag=etag), None, None
    if result.data is None:
        return Outcome(rel, size, mtime_ns, result.source_format, None, None, None, result.reason,
                       src_etag=etag), None, result.source_format
    return None, result.data, result.source_format


def expand_one(root: bytes, rel: bytes, store: str, obj: str, want_size: int, want_mtime: int,
               want_version: str | None, raw_formats: tuple[str, ...] = DEFAULT_FORMATS,
               root_id: tuple[int, int] | None = None) -> Outcome:
    """Runs in a worker process: expand one image into the store, or say why not. Never raises. ``root_id``: the
    root's (st_dev, st_ino) as the coordinator holds it (``sysio.paths.open_under``)."""
    return never_raising(lambda: _expand_one(root, rel, store, obj, want_size, want_mtime, want_version,
                                             raw_formats, root_id), rel, want_size, want_mtime, want_version)


def never_raising(work: Callable[[], Outcome], rel: bytes, size: int, mtime_ns: int, etag: str | None) -> Outcome:
    """``work()``, a worker's expansion of one image, or the refusal that says why it raised: a fault of ours on
    one image (``worker-error``, tried again by the next run), or this run's memory (``no-memory``), must not
    end a prepare of millions, as an exception out of a worker's job does."""
    try:
        return work()
    except MemoryError:
        return Outcome(rel, size, mtime_ns, None, None, None, None, "no-memory", src_etag=etag)
    except Exception as exc:
        # The reason names the fault in prepare's report; its traceback is for --log-level debug.
        log.debug("expanding %s: %r", os.fsdecode(rel), exc, exc_info=True)
        return Outcome(rel, size, mtime_ns, None, None, None, None, f"worker-error:{type(exc).__name__}",
                       src_etag=etag)


def _expand_one(root: bytes, rel: bytes, store: str, obj: str, want_size: int, want_mtime: int,
                want_version: str | None, raw_formats: tuple[str, ...],
                root_id: tuple[int, int] | None = None) -> Outcome:
    """``expand_one``'s work.

    The source is opened below its root without following any link (as the mount opens it) and must be the
    file the catalog recorded, before and after it is read: root reads it, and another user may be able to
    swap it for a link to a file of theirs or of nobody's, or write it while it is read.
    """
    def outcome(reason: str | None, fmt: str | None = None, raw: bytes | None = None, *,
                reused: bool = False, fatal: str | None = None, stamp: str | None = None) -> Outcome:
        if raw is None:
            return Outcome(rel, want_size, want_mtime, fmt, None, None, None, reason, fatal=fatal,
                           src_etag=want_version)
        return Outcome(rel, want_size, want_mtime, fmt, obj, len(raw), checksum(raw), None, reused=reused,
                       src_etag=want_version, object_stamp=stamp)

    if not source_fits(want_size):
        return outcome("no-memory")  # reading it alone would not fit
    def unchanged(st: os.stat_result) -> bool:
        return same_version(st, want_size, want_mtime, want_version)

    try:
        fd = open_under(root, rel, root_id)
    except RootReplaced as exc:
        # Every image after it would be read from another tree (or refused, and a smaller selection published):
        # the run stops, and says why.
        return outcome("root-replaced", fatal=f"{exc.filename}: {exc.strerror}")
    except OSError as exc:
        return outcome(f"unreadable: {exc.strerror}")
    try:
        if not unchanged(os.fstat(fd)):
            return outcome("changed-during-prepare")
        try:
            # O_DIRECT: prepare does not fill the page cache with the source. No further than the size checked: a
            # source grown meanwhile (a sparse 100 GB) is never read into the worker's memory.
            source = bytes(read_span(fd, 0, want_size))
        except OSError as exc:
            return outcome(f"unreadable: {exc.strerror}")
        if not unchanged(os.fstat(fd)):
            return outcome("changed-during-prepare")  # written while read: the bytes may be torn
    finally:
        os.close(fd)
    refused, raw, fmt = expand_bytes(rel, want_size, want_mtime, source, want_version, raw_formats)
    if raw is None:
        return refused  # type: ignore[return-value]
    from . import formats  # loaded by expand_bytes already

    obj = _named_as(obj, formats.sniff(raw[:32]) or DEFAULT.name)
    try:
        sub_fd = _object_dir(store, obj)
    except OSError as exc:
        return outcome("write-failed", fmt, fatal=f"cannot open the objects directory for {obj}: {exc}")
    try:
        return _write_object(sub_fd, os.path.basename(obj), raw, outcome, fmt,
                             where=os.path.join(store, os.path.dirname(obj)))
    finally:
        os.close(sub_fd)


#: Why prepare writes, adopts and reuses no object in an ``objects`` directory others may rename in, and the fix.
OBJECTS_OPEN_TO_OTHERS = ("group or others may write it and rename what is in it: a mount would not serve an object "
                          "from there; chmod go-w (or +t) it, and run prepare again")


def _object_dir(store: str, obj: str) -> int:
    """The directory ``objects/<sub>`` of ``obj``, made if missing and held open, never through a link: a store
    writer who turns ``objects/<sub>`` into a link to /etc must not have root prepare write (or adopt) there.
    ``objects`` itself is taken as the store's owner set it up (it may be a link to another disk), as the
    mount takes it.

    Where group or others may rename what is in ``objects`` (no sticky bit), no object is written: a mount would
    not trust one there (``StoreReader.may_serve``, which ``_write_object`` asks of each subdirectory too)."""
    objects = os.path.join(store, OBJECTS)
    os.makedirs(objects, 0o700, exist_ok=True)
    objects_fd = open_dir(objects)
    try:
        if open_to_others(os.fstat(objects_fd)):
            raise OSError(errno.EPERM, OBJECTS_OPEN_TO_OTHERS, objects)
        sub = obj.split("/")[1]
        try:
            os.mkdir(sub, 0o700, dir_fd=objects_fd)
        except FileExistsError:
            pass
        return os.open(sub, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=objects_fd)
    finally:
        os.close(objects_fd)


def _write_object(sub_fd: int, name: str, raw: bytes, outcome: Callable[..., Outcome], fmt: str | None,
                  where: str = "") -> Outcome:
    """``raw`` as the object ``name`` below ``sub_fd`` (``where``: that directory, for messages): adopted if a
    previous run left exactly these bytes, else written to a name of its own, fsynced and renamed into place,
    never through a link."""
    held = _holds(sub_fd, name, raw)
    if held is not None:
        # A previous run (maybe killed before it recorded it) left exactly these bytes: nothing to write.  An
        # object is adopted only byte for byte, never on its name alone (a damaged one is rewritten); the
        # stamp of the object as it was read is what vouches for it from now on.
        return outcome(None, fmt, raw, reused=True, stamp=held)
    tmp = f"{name}.{unique('tmp-')}"  # never a PID: prepares in two PID namespaces may share a store
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=sub_fd)
        # Whom the object belongs to is known once it exists (root's, or whom an NFS server squashes root to):
        # the directory must be one nobody else may rename in, as the mount asks (``StoreReader.may_serve``).
        sub_st, owner = os.fstat(sub_fd), os.fstat(fd).st_uid
        untrusted = _untrusted_directory(sub_st, owner, where or ".")
        if untrusted is not None:
            os.close(fd)
            os.unlink(tmp, dir_fd=sub_fd)
            fix = "chmod go-w it" if sub_st.st_uid in (0, owner) else f"chown it to uid {owner}, or remove it"
            return outcome("write-failed", fmt, fatal=(
                f"{untrusted}: a mount would not serve an object from there (another user could give it another "
                f"image's name); {fix}, and run prepare again"))
        with open(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
            os.rename(tmp, name, src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
            # Taken on the descriptor after the rename (which moves the ctime): the object as written, whatever
            # is at its name by now.
            written = object_stamp(os.fstat(f.fileno()))
    except OSError as exc:
        try:
            os.unlink(tmp, dir_fd=sub_fd)
        except OSError:
            pass
        fatal = "out of disk space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else f"cannot write {tmp}: {exc}"
        return outcome("write-failed", fmt, fatal=fatal)
    return outcome(None, fmt, raw, stamp=written)


def _holds(sub_fd: int, name: str, data: bytes) -> str | None:
    """The stamp (``catalog.identity.object_stamp``) of the regular file ``name`` below ``sub_fd`` when it holds exactly
    ``data`` (never following a link), taken around the read: a write during it gives another stamp, and None."""
    try:
        with open(open_below(sub_fd, os.fsencode(name)), "rb") as f:
            st = os.fstat(f.fileno())
            if not renamed_only_by_its_writer(os.fstat(sub_fd), st.st_uid):
                return None  # not adopted where a mount would not serve it: written anew (and refused there)
            if st.st_mode & 0o077:
                # Written by a prepare before objects were made 0600 (0644 then): a 0600 source's pixels readable
                # by anyone who may enter the store. Adopted, it becomes what this run would write; one that
                # cannot be made so (another user's, on an NFS store that squashes root) is written anew.
                os.fchmod(f.fileno(), 0o600)
                st = os.fstat(f.fileno())
            before = object_stamp(st)
            same = f.read(len(data) + 1) == data
            return before if same and object_stamp(os.fstat(f.fileno())) == before else None
    except OSError:
        return None


def verify_one(root: bytes, rel: bytes, obj: str, want_checksum: str, want_size: int, want_mtime: int,
               want_version: str | None = None) -> str | None:
    """None when the raw object is sound and decodes to the source's pixels; else what is wrong.  The source
    is read as the mount reads it (below its root, no link followed) and must be the file that was expanded."""
    try:
        with open(open_under(root, rel), "rb") as f:
            if not same_version(os.fstat(f.fileno()), want_size, want_mtime, want_version):
                return "source changed since prepare (it is served as the original)"
            original = bytes(read_span(f.fileno(), 0, want_size))  # no further than the size checked
            if not same_version(os.fstat(f.fileno()), want_size, want_mtime, want_version):
                return "source changed since prepare (it is served as the original)"  # while it was read
        with open(open_regular(obj), "rb") as f:  # EIO: not a regular file
            ost = os.fstat(f.fileno())
            untrusted = _renamed_in_by_others(obj, ost.st_uid)
            if untrusted is not None:  # a mount would serve the original: not "sound", whatever it holds
                return untrusted
            size = ost.st_size
            if size > MAX_OBJECT_BYTES:  # a sparse object a store writer grew: never read into memory
                return f"raw object of {size} bytes, more than any prepare writes"
            raw = bytes(read_span(f.fileno(), 0, size))
    except OSError as exc:
        return f"cannot read: {exc}"
    except MemoryError:  # (ulimit -v, no overcommit): this check's verdict, never the whole run's traceback
        return "cannot check: not enough memory to read the source and the object"
    try:
        return judge(original, raw, want_checksum)
    except MemoryError:
        return "cannot check: not enough memory to decode the source and the object"


def _renamed_in_by_others(obj: str, owner: int) -> str | None:
    """Why a mount would not serve the object at ``obj`` (``objects/<sub>/<name>`` below a store; ``owner``: its
    owner) for where it is: an objects directory open to others, or a subdirectory someone else than root and
    ``owner`` may rename in (``StoreReader.may_serve``); None where it would."""
    sub = os.path.dirname(obj)
    objects = os.path.dirname(sub)
    if open_to_others(os.stat(objects)):
        return f"{objects}: group or others may write it and rename what is in it: a mount serves the originals"
    untrusted = _untrusted_directory(os.stat(sub, follow_symlinks=False), owner, sub)
    return None if untrusted is None else f"{untrusted}: a mount serves the original"


def _untrusted_directory(directory: os.stat_result, owner: int, where: str) -> str | None:
    """Why an object of uid ``owner`` is not trusted at its name in the directory ``where`` (``directory``: its
    stat; ``sysio.paths.renamed_only_by_its_writer``), for prepare's and verify's messages; None where it is."""
    if renamed_only_by_its_writer(directory, owner):
        return None
    if not stat.S_ISDIR(directory.st_mode):
        return f"{where}: not a directory (a link?)"
    if directory.st_mode & 0o022:
        return f"{where}: group or others may write it and rename what is in it"
    return (f"{where}: owned by uid {directory.st_uid}, not the object's owner (uid {owner}) or root, who may "
            "rename what is in it")


def judge(original: bytes, raw: bytes, want_checksum: str) -> str | None:
    """None when ``raw`` is the recorded object (its BLAKE2b digest), decodes to the pixels of ``original``, and
    is what prepare would make of it now; else what is wrong. An xxh3 digest (a prepare before BLAKE2b) vouches
    for nothing here either.

    Pillow's decodes agreeing is not enough: a prepare reuses the objects of runs before it, and a liquidfs that
    refused less (a 16-bit PNG, an EXIF orientation, a damaged chunk OpenCV fails on) made objects whose pixels
    other decoders of the original do not give. The original is expanded again (to BMP, whatever the object's
    format): refused now, the object is not sound."""
    refused = digest_refusal(want_checksum)
    if refused is not None:
        return refused
    if checksum(raw) != want_checksum:
        return "checksum mismatch"
    from . import formats  # NumPy and Pillow: loaded by the checks that decode, not by every mount

    try:
        # mode, size, samples, and for palette images the palette and transparency too
        same = formats.same_pixels(original, raw)
    except Exception as exc:  # a decoder failure is a verdict here, not a crash
        return f"cannot decode: {exc}"
    if not same:
        return "pixels differ"
    raw_format = formats.sniff(raw[:32])
    if raw_format is None or raw_format not in RAW_FORMATS:
        return f"not a raw object ({raw_format or 'unknown format'}): a mount serves the original"
    # Expanded to BMP whatever the object's format: the source's refusals are the same for each, and a J2K
    # encode (seconds an image) to learn only whether it is refused would make verify of a J2K store crawl.
    again = formats.expand(original, to=DEFAULT.name)
    if again.data is None:
        return (f"prepare refuses its source now ({again.reason}): other decoders of the original may not give "
                "the object's pixels; run prepare again")
    return None
