"""``liquidfs prepare`` and ``liquidfs verify``: expand a seeded share of the images to raw objects (BMP, or
lossless JPEG 2000 with ``--formats``).

Which images are served raw is a reproducible random choice: candidates are ranked by a hash of (seed, path) and
the first ``round(ratio * eligible)`` that expand losslessly are chosen. Raising the ratio extends that prefix and
lowering it shortens it, so changing the ratio reuses every expansion that is still wanted.

Crash safety: objects are written to a temporary name, fsynced and renamed, so an object under its final name is
always complete; what prepare learnt is committed to the catalog as it goes; the served selection changes in one
transaction at the end, and surplus objects are deleted only after that commit.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import errno
import logging
import multiprocessing
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol
from pathlib import Path

import xxhash

from . import formats, resources
from .catalog import SEALED, Catalog, CatalogError, Node, WorkingCopy, open_or_build
from .locks import MOUNTS_LOCK, PREPARE_LOCK, exclusive_lock, unique
from .reader import checksum, open_regular, open_under, read_fd, same_version
from .s3 import is_url

log = logging.getLogger(__name__)

#: Files considered for expansion; their real format is then detected from their content.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".jpe", ".jfif")
OBJECTS = "objects"
#: The file name suffix of a raw object of each raw format (``formats.RAW_FORMATS``).
OBJECT_SUFFIXES = {"bmp": ".bmp", "j2k": ".jp2"}
#: ``--formats`` names the originals may carry: they are always served for the images not expanded.
ORIGINAL_FORMATS = ("png", "jpeg", "jpg")


class PrepareError(Exception):
    """Prepare stopped; the message says why and what to do. The store is consistent."""


def parse_ratio(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"ratio must be a number in [0, 1], a percentage or 'auto', not {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"ratio must be within [0, 1], got {text}")
    return value


def parse_formats(text: str) -> tuple[str, ...]:
    """``--formats png,bmp,j2k``: the raw formats prepare may write, in the order it tries them (J2K first where
    listed, then BMP for the images J2K cannot hold exactly); the original formats are accepted and implied."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [n for n in names if n not in formats.RAW_FORMATS and n not in ORIGINAL_FORMATS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown format {', '.join(unknown)}: --formats takes png and any of {', '.join(formats.RAW_FORMATS)}")
    raw = tuple(f for f in ("j2k", "bmp") if f in names)
    if not raw:
        raise argparse.ArgumentTypeError("--formats needs a raw format to expand to: bmp, j2k or both")
    return raw


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


# -- the worker side ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
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


#: In a worker: the bytes it may spend on one image (``resources.plan_workers``); None where not known.
_budget: int | None = None


def _set_budget(budget: int | None) -> None:
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


# -- the coordinating side ------------------------------------------------------------------------------


@dataclass
class PrepareReport:
    candidates: int = 0
    target: int = 0
    expanded: int = 0
    reused: int = 0
    raw_served: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    deleted: int = 0
    kept_for_mounts: int = 0  # surplus objects not deleted: a running mount's catalog may name them
    bytes_objects: int = 0
    bytes_source: int = 0
    bytes_served: int = 0
    seconds: float = 0.0

    def lines(self) -> list[str]:
        share = self.raw_served / max(1, self.candidates - sum(self.skipped.values()))
        out = [
            f"images considered  {self.candidates}",
            f"served raw         {self.raw_served} ({share:.1%} of eligible; {self.expanded} expanded now, "
            f"{self.reused} reused)",
            f"skipped            {sum(self.skipped.values())}"
            + (" (" + ", ".join(f"{k}: {v}" for k, v in self.skipped.most_common()) + ")" if self.skipped else ""),
            f"surplus deleted    {self.deleted}" + (
                f" ({self.kept_for_mounts} kept while a mount of the store runs; the next prepare deletes them)"
                if self.kept_for_mounts else ""),
            f"raw objects        {self.bytes_objects / 1e6:.1f} MB on disk",
            f"dataset served     {self.bytes_served / 1e6:.1f} MB (source {self.bytes_source / 1e6:.1f} MB, "
            f"x{self.bytes_served / max(1, self.bytes_source):.2f})",
            f"time               {self.seconds:.1f} s"
            + (f" ({self.expanded / self.seconds:.1f} images/s expanded)" if self.expanded and self.seconds else ""),
        ]
        return out


def _candidates(catalog: Catalog, seed: int) -> list[Node]:
    nodes = [n for n in catalog.files() if n.name.lower().endswith(tuple(s.encode() for s in IMAGE_SUFFIXES))]
    nodes.sort(key=lambda n: rank(seed, n.path))
    return nodes


def _known(catalog: Catalog) -> dict[bytes, tuple]:
    rows = catalog.db.execute(
        "SELECT path, src_size, src_mtime_ns, format, object, raw_size, checksum, reason, src_etag FROM expansions"
    ).fetchall()
    return {row[0]: row[1:] for row in rows}


class Target(Protocol):
    """Where prepare puts raw objects: a local directory, or a prefix in a bucket (``s3store.BucketTarget``)."""

    label: str
    raw_formats: tuple[str, ...]  # what it expands to, in the order tried (``parse_formats``)

    def job(self, source_root: bytes, node: Node, obj: str) -> tuple[Callable[..., Outcome], tuple[object, ...]]:
        """The worker function and arguments that expand ``node`` into ``obj`` (run in a worker process)."""

    def exists(self, obj: str) -> bool: ...

    def delete(self, objs: list[str]) -> None: ...

    def stray(self, kept: set[str]) -> list[str]:
        """Objects under OBJECTS/ that ``kept`` does not name: leftovers of killed runs."""

    def deleting(self) -> AbstractContextManager[bool]:
        """Held while the surplus is deleted and the new selection published: True when objects may be deleted
        (no running mount's catalog can name them), False when they must be kept for now."""



class LocalTarget:
    def __init__(self, store_dir: Path, raw_formats: tuple[str, ...] = ("bmp",)) -> None:
        self.store_dir = store_dir
        self.label = str(store_dir)
        self.raw_formats = raw_formats

    def job(self, source_root: bytes, node: Node, obj: str) -> tuple[Callable[..., Outcome], tuple[object, ...]]:
        return expand_one, (source_root, node.path, str(self.store_dir), obj, node.size, node.mtime_ns, node.etag,
                            self.raw_formats)

    def exists(self, obj: str) -> bool:
        return (self.store_dir / obj).exists()

    def delete(self, objs: list[str]) -> None:
        for obj in objs:
            (self.store_dir / obj).unlink(missing_ok=True)

    @contextmanager
    def deleting(self) -> Iterator[bool]:
        # Every mount of this store holds MOUNTS_LOCK shared from before it opens the catalog until it ends:
        # taken here, no mount runs, and none can start until the new catalog is in place.
        held = exclusive_lock(self.store_dir / MOUNTS_LOCK, wait=False)
        if held is None:
            log.info("a mount of %s is running: surplus objects are kept for it", self.store_dir)
        try:
            yield held is not None
        finally:
            if held is not None:
                os.close(held)

    def stray(self, kept: set[str]) -> list[str]:
        objects = self.store_dir / OBJECTS
        if not objects.is_dir():
            return []
        return [name for sub in objects.iterdir() for f in sub.iterdir()
                if (name := f"{OBJECTS}/{sub.name}/{f.name}") not in kept]


def prepare(source: str | os.PathLike[str], store: str | os.PathLike[str], ratio: float, *, seed: int = 0,
            jobs: int | None = None, progress: bool = True, raw_formats: tuple[str, ...] = ("bmp",)) -> PrepareReport:
    if is_url(str(source)) or is_url(str(store)):
        if raw_formats != ("bmp",):
            raise PrepareError("--formats: stores in an object store hold BMP only for now (J2K: local stores)")
        from .s3store import prepare_in_bucket

        return prepare_in_bucket(str(source), str(store), ratio, seed=seed, jobs=jobs, progress=progress)
    started = time.monotonic()
    store_dir = Path(store).absolute()
    store_dir.mkdir(parents=True, exist_ok=True)
    held = exclusive_lock(store_dir / PREPARE_LOCK, wait=False)
    if held is None:  # prepares of one store run one after another: the next reuses what the first did
        log.warning("another prepare of %s is running: waiting for it", store_dir)
        held = exclusive_lock(store_dir / PREPARE_LOCK)
    try:
        open_or_build(source, store_dir).close()
        work = WorkingCopy(store_dir)
        try:
            return run(work.catalog, LocalTarget(store_dir, raw_formats), ratio, seed, jobs, progress, started,
                       publish=work.publish)
        except PrepareError:
            work.publish()  # the selection is unchanged; what was expanded before the failure is kept
            raise
        finally:
            work.discard()  # after a publish: nothing left to do
    finally:
        assert held is not None
        os.close(held)


def run(catalog: Catalog, target: Target, ratio: float, seed: int, jobs: int | None, progress: bool,
        started: float, publish: Callable[[], None] = lambda: None) -> PrepareReport:
    """Expand the seeded share of ``catalog``'s images into ``target``, commit the selection, ``publish`` it,
    and delete what no catalog in use names any more (``target.deleting``). ``jobs`` is lowered to the workers
    that fit in memory; None: as many as fit, up to the cores."""
    report = PrepareReport()
    nodes = _candidates(catalog, seed)
    plan = resources.plan_workers(jobs, max_pixels=formats.MAX_PIXELS,
                                  largest_source=max((n.size for n in nodes), default=0))
    jobs = plan.workers
    known = _known(catalog)
    report.candidates = len(nodes)
    chosen: list[Outcome] = []
    refused = 0

    def wanted() -> int:
        return round(ratio * (len(nodes) - refused))

    pending: list[Outcome] = []
    fatal: str | None = None
    src_root = catalog.source
    ctx = multiprocessing.get_context("forkserver")
    bar = _progress(progress, round(ratio * len(nodes)))
    queue = iter(nodes)
    in_flight: dict[cf.Future[Outcome], Node] = {}
    last_commit = time.monotonic()
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_set_budget,
                                initargs=(plan.budget,)) as pool:
        while True:
            # Keep enough work in flight to reach the target, in rank order.
            while fatal is None and len(chosen) + len(in_flight) < wanted() and len(in_flight) < 2 * jobs:
                node = next(queue, None)
                if node is None:
                    break
                prior = known.get(node.path)
                if prior is not None and prior[:2] == (node.size, node.mtime_ns) and prior[7] == node.etag:
                    if prior[3] is None and prior[6] is not None:  # refused before, for a lasting reason
                        refused += 1
                        report.skipped[_reason_key(prior[6])] += 1
                        continue
                    # Reused as is only in the format tried first: one of a later format is made again, as
                    # the first may now hold it (the worker adopts the same bytes if not).
                    if prior[3] and raw_format_of(prior[3]) == target.raw_formats[0] and target.exists(prior[3]):
                        chosen.append(Outcome(node.path, node.size, node.mtime_ns, prior[2], prior[3], prior[4],
                                              prior[5], None, reused=True, src_etag=node.etag))
                        report.reused += 1
                        bar(1)
                        continue
                func, job_args = target.job(src_root, node, object_name(node))
                future = pool.submit(func, *job_args)
                in_flight[future] = node
            if not in_flight:
                break
            done, _ = cf.wait(in_flight, return_when=cf.FIRST_COMPLETED)
            for future in done:
                in_flight.pop(future)
                outcome = future.result()
                if outcome.fatal:
                    fatal = fatal or outcome.fatal
                    continue
                pending.append(outcome)
                if outcome.object is not None:
                    chosen.append(outcome)
                    report.expanded += not outcome.reused
                    report.reused += outcome.reused
                    bar(1)
                else:
                    refused += 1
                    report.skipped[_reason_key(outcome.reason)] += 1
            if pending and (time.monotonic() - last_commit > 1.0 or not in_flight):
                _record(catalog, pending)
                pending.clear()
                last_commit = time.monotonic()
    _record(catalog, pending)
    bar(0, close=True)
    if fatal:
        raise PrepareError(
            f"{fatal} in {target.label} after {report.expanded} new expansions; the store is consistent and still "
            "serves the previous selection. Free some space (or lower --ratio) and run prepare again: finished "
            "work is kept."
        )
    # Completion order is not rank order: keep the best-ranked, so a given seed always picks the same files.
    chosen.sort(key=lambda o: rank(seed, o.path))
    chosen = chosen[: wanted()]
    _apply_selection(catalog, chosen, ratio)
    with target.deleting() as allowed:
        if allowed:
            report.deleted = _delete_surplus(catalog, target)
        else:
            report.kept_for_mounts = _surplus_count(catalog)
        report.raw_served = len(chosen)
        report.target = wanted()
        _, report.bytes_served, report.bytes_source, _ = catalog.file_totals()
        report.bytes_objects = catalog.db.execute(
            "SELECT coalesce(sum(raw_size), 0) FROM expansions WHERE object IS NOT NULL").fetchone()[0]
        publish()
    report.seconds = time.monotonic() - started
    return report


def _transient(reason: str | None) -> bool:
    """A refusal not worth remembering: the next run tries the image again (no-memory: maybe with more)."""
    return reason is not None and (reason in ("changed-during-prepare", "no-memory")
                                   or reason.startswith(("unreadable", "j2k-")))  # j2k-: BMP may hold it


def _reason_key(reason: str | None) -> str:
    return (reason or "unknown").split(":")[0]


def _progress(enabled: bool, total: int) -> Callable[..., None]:
    if not enabled:
        return lambda n, close=False: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="img", desc="expanding", dynamic_ncols=True, file=sys.stderr)

    def update(n: int, close: bool = False) -> None:
        bar.update(n)
        if close:
            bar.close()

    return update


def _record(catalog: Catalog, outcomes: list[Outcome]) -> None:
    if not outcomes:
        return
    with _transaction(catalog):
        catalog.db.executemany(
            "INSERT OR REPLACE INTO expansions(path, src_size, src_mtime_ns, format, object, raw_size, checksum, "
            "reason, src_etag) VALUES (?,?,?,?,?,?,?,?,?)",
            [(o.path, o.src_size, o.src_mtime_ns, o.format, o.object, o.raw_size, o.checksum,
              None if o.object else o.reason, o.src_etag) for o in outcomes
             if not _transient(o.reason)],
        )


class _transaction:
    def __init__(self, catalog: Catalog) -> None:
        self.db = catalog.db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def _apply_selection(catalog: Catalog, chosen: list[Outcome], ratio: float) -> None:
    with _transaction(catalog):
        catalog.db.execute("UPDATE nodes SET repr=0, served_size=NULL, object=NULL, checksum=NULL WHERE repr=1")
        catalog.db.executemany(
            "UPDATE nodes SET repr=1, served_size=?, object=?, checksum=? WHERE path=? AND kind=0",
            [(o.raw_size, o.object, o.checksum, o.path) for o in chosen],
        )
        catalog.set_meta("ratio", repr(ratio))
        # Every object the selection names is in place (written, fsynced, renamed): a mount may trust one whose
        # inode has not changed since (``StoreReader.vouch``).
        catalog.set_meta(SEALED, str(time.time_ns()))


_SURPLUS = ("SELECT path, object FROM expansions WHERE object IS NOT NULL "
            "AND object NOT IN (SELECT object FROM nodes WHERE repr=1)")


def _surplus_count(catalog: Catalog) -> int:
    return len(catalog.db.execute(_SURPLUS).fetchall())


def _delete_surplus(catalog: Catalog, target: Target) -> int:
    """Objects no node points at any more, and leftovers of killed runs; only after the selection commits."""
    surplus = catalog.db.execute(_SURPLUS).fetchall()
    target.delete([obj for _, obj in surplus])
    with _transaction(catalog):
        catalog.db.executemany("DELETE FROM expansions WHERE path=?", [(p,) for p, _ in surplus])
    kept = {row[0] for row in catalog.db.execute("SELECT object FROM expansions WHERE object IS NOT NULL")}
    target.delete(target.stray(kept))
    return len(surplus)


# -- verify ---------------------------------------------------------------------------------------------


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


def verify(store: str | os.PathLike[str], *, sample: int | None = None, jobs: int | None = None,
           progress: bool = True) -> list[tuple[str, str]]:
    """Every (or ``sample`` random) raw object checked against its source: the list of failures."""
    if is_url(str(store)):
        from .s3store import verify_jobs

        nodes, job = verify_jobs(str(store))
    else:
        store_dir = Path(store).absolute()
        catalog = Catalog.open(store_dir, readonly=True)
        try:
            nodes = [n for n in catalog.files() if n.repr == 1]
            root = catalog.source
        finally:
            catalog.close()

        def job(n: Node) -> tuple[Callable[..., str | None], tuple[object, ...]]:
            return verify_one, (root, n.path, str(store_dir / str(n.object)), str(n.checksum), n.size, n.mtime_ns,
                                n.etag)
    if sample is not None and sample < len(nodes):
        nodes = random.Random().sample(nodes, sample)
    failures: list[tuple[str, str]] = []
    bar = _progress(progress, len(nodes))
    ctx = multiprocessing.get_context("forkserver")
    # A check decodes the original and the object: about what an expansion takes (resources).
    workers = resources.plan_workers(jobs, max_pixels=formats.MAX_PIXELS, refusing=False,
                                     largest_source=max((n.size for n in nodes), default=0)).workers
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(func, *func_args): n for n in nodes for func, func_args in [job(n)]}
        for future in cf.as_completed(futures):
            problem = future.result()
            if problem:
                failures.append((os.fsdecode(futures[future].path), problem))
            bar(1)
    bar(0, close=True)
    return failures


# -- command line ---------------------------------------------------------------------------------------


def add_arguments(sub: argparse._SubParsersAction, add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "prepare", help="expand a share of the images to raw BMP in a store",
        description="Choose a seeded random share (--ratio) of the PNG/JPEG images under SOURCE, expand each to "
        "a BMP that decodes to exactly the same pixels (checked before it is accepted), and record the choice "
        "in the store's catalog. Resumable and idempotent; changing --ratio reuses existing expansions. The "
        "source is never written.")
    p.add_argument("source", help="the dataset directory, or s3://BUCKET/PREFIX")
    p.add_argument("--store", required=True,
                   help="directory for the catalog and the raw objects; s3://BUCKET/PREFIX for an s3:// source "
                   "(the catalog is uploaded there at the end, for every node's mounts)")
    p.add_argument("--ratio", type=parse_ratio, required=True,
                   help="share of eligible images served raw: 0..1, a percentage, or 'auto' (profile first)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choice (default 0)")
    p.add_argument("--formats", type=parse_formats, default=("bmp",), metavar="png,bmp[,j2k]",
                   help="what the expanded images are stored as: bmp (default: no decode work, for CPU decoders), "
                   "j2k (lossless JPEG 2000: about the PNG's size, decoded on a GPU by DALI's 'mixed' decoder; "
                   "on a CPU slower than PNG), or both (J2K, and BMP where J2K cannot hold an image exactly). "
                   "Every object is checked to decode to the source's pixels under Pillow")
    p.add_argument("--jobs", "-j", type=int,
                   help="worker processes (default: the cores this process may use, fewer where memory is short: "
                   "each worker gets room for the largest image expanded, 100 Mpx, about 2.5 GB). A larger "
                   "value is lowered to what fits in the memory left (cgroup limit, MemAvailable), with a warning")
    p.add_argument("--quick", action="store_true",
                   help="with --ratio auto: a quick profile (a smaller sample, shorter measurements)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common(p)
    p.set_defaults(func=_cmd_prepare)

    v = sub.add_parser(
        "verify", help="check every raw object against its source",
        description="Re-decode every raw object of the store and its source and compare pixels and checksums. "
        "Exit status 0 only when all hold.")
    v.add_argument("--store", required=True, help="the store directory, or the s3:// store prepare wrote to")
    v.add_argument("--sample", type=int, help="check only N random objects")
    v.add_argument("--jobs", "-j", type=int,
                   help="worker processes (default: the cores, fewer where memory is short; lowered to what fits)")
    v.add_argument("--no-progress", action="store_true")
    add_common(v)
    v.set_defaults(func=_cmd_verify)


def _cmd_prepare(args: argparse.Namespace) -> int:
    ratio = args.ratio
    if ratio == "auto" and "j2k" in args.formats:
        print("liquidfs prepare: --ratio auto cannot weigh J2K: profile measures CPU decoders, and J2K is decoded "
              "on a GPU; give --ratio (see scripts/bench_train.py for measuring it end to end)", file=sys.stderr)
        return 2
    if ratio == "auto":
        from .profile import auto_ratio

        ratio = auto_ratio(args.source, args.store, quick=args.quick)
        print(f"profile chose ratio {ratio:.2f}")
    try:
        report = prepare(args.source, args.store, ratio, seed=args.seed, jobs=args.jobs,
                         progress=not args.no_progress, raw_formats=args.formats)
    except PrepareError as exc:
        print(f"liquidfs prepare: {exc}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    for raw_format in args.formats:
        print(f"{raw_format} objects decode to the source's pixels under: {', '.join(formats.SAFE_FOR[raw_format])}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        failures = verify(args.store, sample=args.sample, jobs=args.jobs, progress=not args.no_progress)
    except CatalogError as exc:
        print(f"liquidfs verify: {exc}", file=sys.stderr)
        return 2
    for path, problem in failures:
        print(f"FAIL {path}: {problem}")
    print("verify: " + ("all raw objects sound" if not failures else f"{len(failures)} problems"))
    return 1 if failures else 0

