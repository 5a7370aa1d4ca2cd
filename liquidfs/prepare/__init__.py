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

import concurrent.futures as cf
import logging
import multiprocessing
import os
import random
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TypeVar

from ..catalog.catalog import Catalog
from ..catalog.identity import is_digest
from ..catalog.nodes import Node
from ..expand import formats
from ..expand import workers as resources
from ..expand.expansion import Outcome, is_image, object_name, rank, set_budget
from ..expand.rawformats import DEFAULT, DEFAULT_FORMATS, RAW_FORMATS, of_object, own_refusal
from ..stores import Store, open_prepared, open_store
from ..sysio.orphans import exit_with
from ..sysio.progress import Progress

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
V = TypeVar("V")


class PrepareError(Exception):
    """Prepare stopped; the message says why and what to do. The store is consistent."""


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
    nodes = [n for n in catalog.files() if is_image(n.name)]
    nodes.sort(key=lambda n: rank(seed, n.path))
    return nodes


def prepare(source: str | os.PathLike[str], store: str | os.PathLike[str], ratio: float, *, seed: int = 0,
            jobs: int | None = None, progress: bool = True,
            raw_formats: tuple[str, ...] = DEFAULT_FORMATS) -> PrepareReport:
    """Expand the seeded share ``ratio`` of the images of ``source`` into ``store`` (``open_store``)."""
    return prepare_store(open_store(source, store), ratio, seed=seed, jobs=jobs, progress=progress,
                         raw_formats=raw_formats)


def prepare_store(store: Store, ratio: float, *, seed: int = 0, jobs: int | None = None, progress: bool = True,
                  raw_formats: tuple[str, ...] = DEFAULT_FORMATS) -> PrepareReport:
    cannot = [f for f in raw_formats if f not in store.raw_formats]
    if cannot:
        raise PrepareError(f"--formats: {store.label} cannot hold {', '.join(cannot)} objects "
                           f"(it holds {', '.join(store.raw_formats)}; "
                           f"{', '.join(RAW_FORMATS[f].label for f in cannot)}: local stores)")
    started = time.monotonic()
    with store.preparing(progress) as prep:
        try:
            report = run(prep.catalog, store, ratio, seed, jobs, progress, started, raw_formats=raw_formats,
                         publish=prep.publish)
        except (PrepareError, KeyboardInterrupt):
            # Ctrl-C, SIGTERM (``cli.main.Terminated``) too: what the run learnt (its expansions, the images that
            # kill a worker) is committed as it goes, and the selection changes in one transaction; thrown away,
            # hours of work were done again by the next run, and a worker lost to the same image again.
            prep.keep_after_failure()
            raise
        except (sqlite3.Error, OSError):
            # A catalog write that failed (a full disk: "disk I/O error"), a store that refused a write: what was
            # committed before it is kept as well, where it can be (the failure may stop that too).
            try:
                prep.keep_after_failure()
            except Exception as exc:
                log.warning("what this prepare learnt could not be kept either: %s", exc)
            raise
    return report


def run(catalog: Catalog, store: Store, ratio: float, seed: int, jobs: int | None, progress: bool,
        started: float, *, raw_formats: tuple[str, ...] = DEFAULT_FORMATS,
        publish: Callable[[], None] = lambda: None) -> PrepareReport:
    """Expand the seeded share of ``catalog``'s images into ``store``, commit the selection, ``publish`` it,
    and delete what no catalog in use names any more (``store.deleting``). ``jobs`` is lowered to the workers
    that fit in memory; None: as many as fit, up to the cores."""
    report = PrepareReport()
    nodes = _candidates(catalog, seed)
    plan = resources.plan_workers(jobs, max_pixels=formats.MAX_PIXELS, raw_formats=raw_formats,
                                  largest_source=resources.largest_planned(n.size for n in nodes))
    jobs = plan.workers
    known = catalog.expansions()
    report.candidates = len(nodes)
    chosen: list[Outcome] = []
    refused = 0

    def wanted() -> int:
        return round(ratio * (len(nodes) - refused))

    pending: list[Outcome] = []
    fatal: str | None = None
    src_root = catalog.source
    ctx = multiprocessing.get_context("forkserver")
    queue = iter(nodes)
    in_flight: dict[cf.Future[Outcome], tuple[Node, Callable[..., Outcome], tuple[object, ...]]] = {}
    last_commit = time.monotonic()

    def new_pool(workers: int) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=set_budget,
                                      initargs=(plan.budget, os.getpid()))

    def take(outcome: Outcome) -> None:
        nonlocal fatal, refused
        if outcome.fatal:
            fatal = fatal or outcome.fatal
            return
        pending.append(outcome)
        if outcome.object is not None:
            chosen.append(outcome)
            report.expanded += not outcome.reused
            report.reused += outcome.reused
            bar.update(1)
        else:
            refused += 1
            report.skipped[_reason_key(outcome.reason)] += 1
            bar.set_total(wanted())  # a share of the images that can be expanded: one fewer to reach

    pool = new_pool(jobs)
    with Progress("expanding", "images", total=round(ratio * len(nodes)), shown=progress) as bar:
        try:
            while True:
                # Keep enough work in flight to reach the target, in rank order.
                while fatal is None and len(chosen) + len(in_flight) < wanted() and len(in_flight) < 2 * jobs:
                    node = next(queue, None)
                    if node is None:
                        break
                    now = store.since_scan(node)
                    if now is not None:  # changed in place: its row said what it was at the scan
                        catalog.refresh_file(now)
                        node = now
                    prior = known.get(node.path)
                    if prior is not None and prior.describes(node):
                        if prior.object is None and prior.reason is not None:  # refused before, for a lasting reason
                            refused += 1
                            report.skipped[_reason_key(prior.reason)] += 1
                            bar.set_total(wanted())
                            continue
                        # Reused as is only in the format tried first: one of a later format is made again, as
                        # the first may now hold it (the worker adopts the same bytes if not). Reused unread, an
                        # object keeps the stamp it had: what vouches for it is evidence about it, never this
                        # run's say-so; and only one as it was then (its size, its stamp): one damaged since, or
                        # a copy of the store's (other inodes), was reused for good, the mount falling back. One
                        # without a stamp (an older store), or with an xxh3 digest (recorded before BLAKE2b: it is
                        # never carried forward), is made again by a worker, who adopts the object only if it
                        # holds exactly the expansion's bytes, and records their digest.
                        if (prior.object and of_object(prior.object) is RAW_FORMATS[raw_formats[0]]
                                and (prior.object_stamp is not None or not store.stamps_objects)
                                and is_digest(prior.checksum)
                                and store.exists(prior.object, prior.raw_size, prior.object_stamp)):
                            chosen.append(Outcome(node.path, node.size, node.mtime_ns, prior.format, prior.object,
                                                  prior.raw_size, prior.checksum, None, reused=True,
                                                  src_etag=node.etag, object_stamp=prior.object_stamp))
                            report.reused += 1
                            bar.update(1)
                            continue
                    func, job_args = store.expansion_job(src_root, node, object_name(node), raw_formats)
                    in_flight[_submitted(pool, func, job_args)] = (node, func, tuple(job_args))
                if not in_flight:
                    break
                finished, broken = _settled(in_flight)
                for _, outcome in finished:
                    take(outcome)
                if broken:
                    # A worker died (the kernel's OOM killer, a decoder that crashed on a file): the pool and
                    # every job still in it are lost. Each of them runs again alone, so the one that kills its
                    # worker is known and refused for good (until its source changes); a new pool goes on.
                    pool.shutdown(wait=True, cancel_futures=True)
                    for future, (node, func, job_args) in list(in_flight.items()):
                        if future.done() and not future.cancelled() and future.exception() is None:
                            take(future.result())
                        elif fatal is None:  # once workers die idle, what is left is tried by the next run
                            take(_expanded_alone(new_pool, node, func, job_args))
                    in_flight.clear()
                    pool = new_pool(jobs)
                if pending and (time.monotonic() - last_commit > 1.0 or not in_flight):
                    _record(catalog, pending)
                    pending.clear()
                    last_commit = time.monotonic()
        except KeyboardInterrupt:
            # Ctrl-C, SIGTERM: what finished is recorded before the run stops (the last second's results, and
            # the jobs the pool's shutdown lets finish), else the next run decodes and encodes them again.
            pool.shutdown(wait=True, cancel_futures=True)
            for future in in_flight:
                if future.done() and not future.cancelled() and future.exception() is None:
                    take(future.result())
            _record(catalog, pending)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    _record(catalog, pending)
    if fatal:
        advice = ("Free some space (or lower --ratio) and run prepare again" if fatal == "out of disk space" else
                  "Mend that and run prepare again")
        raise PrepareError(
            f"{fatal} in {store.label} after {report.expanded} new expansions; the store is consistent and still "
            f"serves the previous selection. {advice}: finished work is kept."
        )
    # Completion order is not rank order: keep the best-ranked, so a given seed always picks the same files.
    chosen.sort(key=lambda o: rank(seed, o.path))
    chosen = chosen[: wanted()]
    ids = {node.path: node.id for node in nodes}
    catalog.select_raw(((ids[o.path], o.row()) for o in chosen), ratio)
    with store.deleting() as allowed:
        surplus = catalog.surplus_objects()
        if allowed:
            catalog.forget_expansions(path for path, _ in surplus)
        else:
            report.kept_for_mounts = len(surplus)
        report.raw_served = len(chosen)
        report.target = wanted()
        _, report.bytes_served, report.bytes_source, _ = catalog.file_totals()
        kept, report.bytes_objects = catalog.expanded_objects()
        publish()  # (the catalog is closed)
        if allowed:
            # Only once the catalog that names none of them is the one in place: a run killed between the two
            # left the catalog mounts read naming deleted objects (each served as its original, at another
            # size than its lookup said, until the next prepare). Killed after it, the objects are strays the
            # next run removes.
            report.deleted = _delete_surplus(store, [obj for _, obj in surplus], kept, progress)
    report.seconds = time.monotonic() - started
    return report


def _submitted(pool: cf.ProcessPoolExecutor, func: Callable[..., R], args: tuple[object, ...]) -> cf.Future[R]:
    """``pool.submit(func, *args)``; where the pool broke meanwhile (a worker died while this thread recorded or
    looked at a file), a future failed as the pool's own are: the run's recovery (``_settled``) takes it as one
    of them. Raised here, it ended prepare with a traceback and the run's work unpublished."""
    try:
        return pool.submit(func, *args)
    except BrokenProcessPool as exc:
        failed: cf.Future[R] = cf.Future()
        failed.set_exception(exc)
        return failed


def _settled(in_flight: dict[cf.Future[R], V]) -> tuple[list[tuple[V, R]], bool]:
    """At least one job of ``in_flight`` done: what each that finished was given and gave back, taken out of
    ``in_flight``; and whether a worker died (the pool's jobs are then lost, and stay in ``in_flight``)."""
    done, _ = cf.wait(in_flight, return_when=cf.FIRST_COMPLETED)
    finished: list[tuple[V, R]] = []
    broken = False
    for future in done:
        if isinstance(future.exception(), BrokenProcessPool):
            broken = True
        else:
            finished.append((in_flight.pop(future), future.result()))
    return finished, broken


def _alone(new_pool: Callable[[int], cf.ProcessPoolExecutor], func: Callable[..., T],
           job_args: tuple[object, ...]) -> tuple[T | None, str | None]:
    """``func(*job_args)`` (a job lost with a pool whose worker died) run again in a pool of one worker of its
    own: (its result, None); (None, ``WORKER_DIED``) where it kills that worker too; or (None, ``WORKERS_DIE``)
    where a new worker dies even doing nothing (out of memory): then its death says nothing of the job."""
    with new_pool(1) as pool:
        try:
            return pool.submit(func, *job_args).result(), None
        except BrokenProcessPool:
            pass
    return None, (WORKER_DIED if _workers_live(new_pool) else WORKERS_DIE)


def _workers_live(new_pool: Callable[[int], cf.ProcessPoolExecutor]) -> bool:
    """Whether a new worker survives doing nothing."""
    with new_pool(1) as pool:
        try:
            pool.submit(os.getpid).result()
        except BrokenProcessPool:
            return False
    return True


#: Why a run stops where its workers die with nothing to do.
WORKERS_DIE = "worker processes die before doing any work (out of memory? the kernel log says)"
#: The refusal of an image whose expansion killed its worker process, alone: remembered until its source changes.
WORKER_DIED = "worker-died"


def _expanded_alone(new_pool: Callable[[int], cf.ProcessPoolExecutor], node: Node, func: Callable[..., Outcome],
                    job_args: tuple[object, ...]) -> Outcome:
    """The expansion of ``node`` run again alone (``_alone``): its outcome; a refusal where it kills its worker;
    or a stop of the run (``Outcome.fatal``) where workers die doing nothing."""
    outcome, death = _alone(new_pool, func, job_args)
    if death is None:
        assert outcome is not None
        return outcome
    if death == WORKERS_DIE:
        return Outcome(node.path, node.size, node.mtime_ns, None, None, None, None, None, fatal=WORKERS_DIE)
    log.warning("%s: expanding it killed the worker process (out of memory, or a decoder crashed); it is "
                "served as its original", os.fsdecode(node.path))
    return Outcome(node.path, node.size, node.mtime_ns, None, None, None, None, WORKER_DIED, src_etag=node.etag)


def _transient(reason: str | None) -> bool:
    """A refusal not worth remembering: the next run tries the image again (no-memory: maybe with more)."""
    return reason is not None and (reason in ("changed-during-prepare", "no-memory")
                                   or reason.startswith(("unreadable", "worker-error")) or own_refusal(reason))  # another may hold it


def _reason_key(reason: str | None) -> str:
    return (reason or "unknown").split(":")[0]


def _record(catalog: Catalog, outcomes: list[Outcome]) -> None:
    """What the outcomes taught, except refusals worth trying again."""
    catalog.record_expansions((o.path, o.row()) for o in outcomes if not _transient(o.reason))


#: Objects deleted per call of the store's ``delete`` (the progress bar moves between them).
_DELETED_AT_ONCE = 1000


def _delete_surplus(store: Store, surplus: list[str], kept: set[str], progress: bool = False) -> int:
    """The ``surplus`` objects no node points at any more (their expansions forgotten), and leftovers of killed
    runs (any object but those ``kept``); only after the catalog that names none of them is published. Minutes
    where a lower ratio drops a million objects (on NFS, from a bucket): shown as it goes."""
    with Progress("deleting surplus objects", "objects", total=len(surplus), delay=1.0,
                  shown=progress and bool(surplus)) as bar:
        for start in range(0, len(surplus), _DELETED_AT_ONCE):
            batch = surplus[start:start + _DELETED_AT_ONCE]
            store.delete(batch)
            bar.update(len(batch))
    with Progress("looking for leftovers of killed runs", "objects", delay=1.0, shown=progress) as bar:
        strays = store.stray(kept)
        bar.update(len(strays))
        store.delete(strays)
    return len(surplus)


# -- verify ---------------------------------------------------------------------------------------------


def verify(store: str | os.PathLike[str], *, sample: int | None = None, jobs: int | None = None,
           progress: bool = True) -> list[tuple[str, str]]:
    """Every (or ``sample`` random) raw object of ``store`` checked against its source: the list of failures."""
    return verify_store(open_prepared(store), sample=sample, jobs=jobs, progress=progress)


def verify_store(store: Store, *, sample: int | None = None, jobs: int | None = None,
                 progress: bool = True) -> list[tuple[str, str]]:
    nodes, job = store.verify_jobs()
    if sample is not None and sample < len(nodes):
        nodes = random.Random().sample(nodes, sample)
    failures: list[tuple[str, str]] = []
    ctx = multiprocessing.get_context("forkserver")
    # A check decodes the original and the object: about what an expansion to the object's format takes
    # (resources; a J2K object is budgeted as its encoding was, at its measured peak).
    held = tuple(sorted({(of_object(str(n.object)) or DEFAULT).name for n in nodes})) or DEFAULT_FORMATS
    workers = resources.plan_workers(jobs, max_pixels=formats.MAX_PIXELS, refusing=False, raw_formats=held,
                                     largest_source=resources.largest_planned(n.size for n in nodes)).workers
    def new_pool(count: int) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(max_workers=count, mp_context=ctx, initializer=exit_with,
                                      initargs=(os.getpid(),))

    def check(node: Node, problem: object) -> None:
        if problem:
            failures.append((os.fsdecode(node.path), str(problem)))
        bar.update(1)

    queue = iter(nodes)
    in_flight: dict[cf.Future[str | None], Node] = {}
    pool = new_pool(workers)
    with Progress("verifying", "images", total=len(nodes), shown=progress) as bar:
        try:
            while True:
                # A window of checks in flight, not every one: where a worker dies, the checks lost with its
                # pool are few, and each runs again alone (so only the one that kills its worker fails).
                while len(in_flight) < 2 * workers and (node := next(queue, None)) is not None:
                    func, func_args = job(node)
                    in_flight[_submitted(pool, func, func_args)] = node
                if not in_flight:
                    break
                finished, broken = _settled(in_flight)
                for node, problem in finished:
                    check(node, problem)
                if broken:
                    pool.shutdown(wait=True, cancel_futures=True)
                    for future, node in list(in_flight.items()):
                        if future.done() and not future.cancelled() and future.exception() is None:
                            check(node, future.result())
                            continue
                        func, func_args = job(node)
                        problem, death = _alone(new_pool, func, func_args)
                        if death == WORKERS_DIE:
                            raise PrepareError(f"{WORKERS_DIE}; the checks made so far found {len(failures)} "
                                               "problems")
                        check(node, "checking it killed the worker process (out of memory, or a decoder "
                                    "crashed)" if death else problem)
                    in_flight.clear()
                    pool = new_pool(workers)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return failures
