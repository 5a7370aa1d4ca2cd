"""Metadata read ahead: the kernel's dentries and inodes of a directory's files warmed ahead (by a helper process, else
worker threads) when a lookup there shows they are cold, so the opens that follow are answered on the loop.

An open on the loop walks the source (and the raw object) with ``RESOLVE_CACHED``; where a dentry or an inode is not
in memory it goes to a worker thread, which costs the loop a thread hop and the reader the disk's latency in line
with its open. A LOOKUP reaching the daemon means the kernel had no entry for the name: the loader is reading a
directory whose metadata is cold. The first such lookup in a directory queues it; one worker thread takes the
directories in turn, with its own connection to the catalog, and has each one's files warmed (``warm``: a stat of
the source, and of the raw object, below their roots, as the opens walk them). Where the reader names its walks
(``warm_walks``), a helper process warms them (``fuse.warm_helper``): in this process each wait for the disk would
end in a wait for the GIL the loop holds; should the helper fail, the warms go on in this process's own threads.
Either way ``WARMERS`` threads warm a directory at once, each a run of neighbours in its order. The rows of its
files, read for that, are kept (``row``, at most ``HOT_ROWS``): the LOOKUPs that follow in the directory take them
instead of querying the catalog on the loop, where a cold LOOKUP waited for the catalog's pages. An open that still
finds its source's inode cold (the kernel dropped what the last warm brought in: a drop of the caches, pressure
between epochs) warms its directory again (``went_cold``). Bounded: a LOOKUP warms a directory at most once per
``AGAIN_AFTER`` seconds, a cold open at most once per ``AGAIN_DROPPED`` after the last warm ended where that warm
warmed every file (twice that after each re-warm asked for within twice ``AGAIN_COLD`` of the last, up to it), and
``AGAIN_COLD`` where it left some cold (their opens go cold whatever is warmed), and never sooner than ``RESTS``
times as long as its last warm took after that warm (a flat directory of a million files is no minute's warm each
minute); a directory is never queued twice, and at most ``MAX_QUEUED`` wait; the rest are skipped, never queued
without end. These bounds are
each loop's (``mount --loops``); across the loops, the one that claims a directory warms its inodes (the kernel's
caches serve every loop) and the others read only its rows (``join_loops``).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..catalog.catalog import Catalog
from ..catalog.nodes import KIND_FILE, Node
from ..metrics.stats import Statistics
from ..sysio.thread_names import READ_AHEAD, WARMER, name_this_thread
from .listing import MAX_ROWS, child_rows
from .warm_helper import STOP_WAIT, HelperFailed, Walks, WarmHelper, warm_in_runs

log = logging.getLogger(__name__)

#: Seconds before a LOOKUP may warm a directory warmed once again (the kernel may have dropped its inodes since).
AGAIN_AFTER = 60.0
#: Seconds after a warm of a directory that left some of its files cold (gone, refused: their opens go cold whatever is
#: warmed) ended before an open there that found its inodes cold warms it again; and the most ``AGAIN_DROPPED``
#: grows to.
AGAIN_COLD = 1.0
#: The same after a warm that warmed every file: an open that finds its inodes cold now says the kernel dropped them
#: since (a drop of the caches, memory pressure between epochs). With ``AGAIN_COLD`` only, every open of a directory
#: whose caches were dropped within a second of its last warm went cold (bench_opens's cold runs, one in two: all
#: 96 of their opens in worker threads, where the others had 9-24). Where the kernel drops a directory's inodes as
#: fast as they are read, the re-warms are asked for soon after one another: each within twice ``AGAIN_COLD`` of the
#: last warm's end doubles the bound, up to ``AGAIN_COLD`` (four warms in the first 1.5 s, then no more than before:
#: one a second, however the opens are spaced), and one asked for later starts it anew.
AGAIN_DROPPED = 0.1
#: A directory's next warm, whatever asks for it, waits at least this many times as long as its last warm took, from
#: that warm's end: the read-ahead spends a fifth of its time on one directory at most. The bounds above are sized
#: for directories of hundreds or thousands of files, warmed in milliseconds; a flat directory of a million (a
#: dataset in one directory) takes 10-100 s a warm, and its first epoch's LOOKUPs (each file's first reaches the
#: daemon) warmed all of it every AGAIN_AFTER, its cold opens every AGAIN_COLD once its inodes outgrew the kernel's
#: caches: a core and the disk kept busy for nothing the opens could use.
RESTS = 4.0
#: The longest a directory rests (``RESTS``): a warm that stalled on storage for an hour must not hold the
#: directory's warms off for four.
MAX_REST = 600.0
#: ``mount --loops``: seconds a loop's claim to warm a directory holds the others off while its warm runs, at most
#: (a loop that died warming lets go then); its end is recorded when it ends (``MetadataAhead.join_loops``).
WARM_CLAIM = 30.0
#: Directories waiting to be warmed at most; more lookups in cold directories meanwhile are not queued.
MAX_QUEUED = 16
#: Threads that warm one directory's files (the helper's, else the daemon's own), each a run of neighbours in the
#: directory's order (``warm_helper.warm_in_runs``): a cold inode is a read of the disk, and the disk answers several at
#: once, but a directory's inodes are neighbours on disk, read in blocks, and threads taking every eighth file had
#: contended for the same blocks. In runs, 3,000 cold 110 KB files read by 8-16 readers: 3.9-4.3 k files/s against
#: 2.8-4.0 k, 237-283 us of the daemon's CPU a file against 260-393 (BENCHMARKS.md, "The read-ahead in runs of
#: neighbours"). One thread alone cost the least CPU, but fell behind readers of 6.3 MB raw objects (their opens in
#: worker threads 18-41 % -> 65-84 %).
WARMERS = 8
#: Rows of files the read-ahead read, kept for the LOOKUPs that follow in their directories (``row``): each such
#: LOOKUP is a dict's pop instead of a query of the catalog (whose pages, cold, the loop waited for) and a ``Node``
#: made. 3,000 cold 110 KB files at 8-16 readers: the LOOKUP's loop CPU 33-55 -> 12-18 us. The oldest go first
#: past the bound: ~10 MB of rows (~630 bytes each), per loop.
HOT_ROWS = 16_384
#: Directories remembered (when last queued, when last warmed) before those that no longer matter are dropped
#: (``_forget_past``): a dataset of a directory a sample (video frames, a patient's slices) has millions, ~190 bytes
#: each for good, per loop. Past AGAIN_AFTER (the loop's) and twice AGAIN_COLD (the thread's) an entry decides
#: nothing: a directory without one is queued as it would have been with it.
REMEMBERED_DIRECTORIES = 65_536


@dataclass(frozen=True, slots=True)
class LookaheadStatistics(Statistics):
    prefix = "lookahead_"

    directories: int  # directories whose files' metadata was warmed
    files: int        # ... and their files
    helper: int       # 1 while the warms go to a helper process (fuse.warm_helper), else 0
    rows_hit: int     # LOOKUPs answered from the rows the read-ahead read (``row``)
    left_to_others: int  # directories another loop had claimed to warm (``mount --loops``): their rows read only


class MetadataAhead:
    """Warms the metadata of the directories the loader is about to open files in (see the module)."""

    def __init__(self, catalog_path: Path, warm: Callable[[Node], None], *,
                 walks: Callable[[Node], Walks] | None = None, descriptors: Sequence[int] = (),
                 catalog_id: tuple[int, int] | None = None) -> None:
        """``warm``: one file's warm in this process. ``walks`` (with the ``descriptors`` it names): one file's
        walks, for a helper process to warm instead (None: the warms stay in this process). ``catalog_id``: the
        ``Catalog.file_id`` of the catalog the lookups answer from; the rows read ahead answer lookups only where
        this thread's own connection reads that very file (None: never)."""
        self.catalog_path = catalog_path
        self.catalog_id = catalog_id
        self.warm = warm
        self.walks = walks
        self.descriptors = tuple(descriptors)
        self._helper: WarmHelper | None = None  # started by ``start`` (else at the first directory), the thread's
        self._in_process = walks is None  # no walks, or the helper failed
        self._killed = False  # the helper was killed by ``stop``, a warm stuck
        self._queue: queue.SimpleQueue[tuple[int, float] | None] = queue.SimpleQueue()  # (directory, claim window)
        #: ``mount --loops``: whether this loop warms a directory's inodes, or another loop does, and the end of
        #: a warm this loop claimed (``join_loops``)
        self._claim: Callable[[int, float], bool] | None = None
        self._warmed: Callable[[int, float], None] = lambda directory, rest: None
        self.left_to_others = 0
        self._lock = threading.Lock()
        self._warmed_at: dict[int, float] = {}  # when a LOOKUP last queued each directory (the loop's)
        self._busy: set[int] = set()              # directories queued or being warmed (under _lock): <= MAX_QUEUED
        self._done_at: dict[int, float] = {}      # when the last warm of each directory ended (under _lock)
        self._whole: set[int] = set()             # directories whose last warm here warmed every file (under _lock)
        self._again: dict[int, float] = {}        # the bound of a whole directory's next re-warm, where not
                                                  # AGAIN_DROPPED (under _lock)
        self._rest_until: dict[int, float] = {}   # directories whose last warm took long: the earliest the next
                                                  # may be queued (``RESTS``; under _lock)
        self._warmed_prune_at = self._done_prune_at = REMEMBERED_DIRECTORIES
        self._thread: threading.Thread | None = None
        self._warmers: ThreadPoolExecutor | None = None  # the warming thread's own, made at its first directory
        self._stopped = False
        self.directories = 0  # directories warmed
        self.files = 0        # files warmed
        # The rows of the files of the directories warmed, by (parent, name): put by the warming thread, taken by the
        # loop. An OrderedDict's put, pop and popitem are each one call the GIL makes whole: no lock on the loop.
        self._rows: OrderedDict[tuple[int, bytes], Node] = OrderedDict()
        self.rows_hit = 0

    def looked_up(self, parent: int) -> None:
        """A LOOKUP reached the daemon for a name in directory ``parent`` (on the loop: a dict look and a put)."""
        now = time.monotonic()
        if now - self._warmed_at.get(parent, -AGAIN_AFTER) < AGAIN_AFTER:
            return
        if self._queue_directory(parent, AGAIN_AFTER):
            self._warmed_at[parent] = now
            if len(self._warmed_at) > self._warmed_prune_at:
                self._warmed_prune_at = _forget_past(self._warmed_at, now - AGAIN_AFTER)

    def row(self, parent: int, name: bytes) -> Node | None:
        """The catalog's row of ``name`` in ``parent`` where the read-ahead read it (from the very file the mount
        reads, ``catalog_id``, which never changes under it: the row a query finds), taken: a name looked up
        again is the kernel's to keep."""
        node = self._rows.pop((parent, name), None)
        if node is not None:
            self.rows_hit += 1
        return node

    def went_cold(self, node: Node) -> None:
        """An open of ``node`` found its metadata not in the kernel's memory (it went to a worker thread). A
        LOOKUP says only that the mount's own entry was missing, and warms a directory once a minute; an open
        gone cold says the source's inodes are: warm them again, unless a warm of this directory is under way or
        ended less than ``AGAIN_DROPPED`` seconds ago (twice that after each re-warm asked for within twice
        ``AGAIN_COLD`` of the last warm's end, up to ``AGAIN_COLD``; ``AGAIN_COLD`` where it left some files
        cold)."""
        parent = node.parent
        with self._lock:
            whole = parent in self._whole
            wait = self._again.get(parent, AGAIN_DROPPED) if whole else AGAIN_COLD
            since = time.monotonic() - self._done_at.get(parent, -math.inf)
            if parent in self._busy or since < wait:
                return
            if whole and since < 2 * AGAIN_COLD:  # soon after: the kernel may drop them as fast as they are read
                self._again[parent] = min(2 * wait, AGAIN_COLD)
            elif whole:  # a while after it: a drop of its own
                self._again.pop(parent, None)
        self._queue_directory(parent, wait)

    def join_loops(self, claim: Callable[[int, float], bool], warmed: Callable[[int, float], None]) -> None:
        """One of several loops: ``claim(directory, within)`` says whether this loop warms a directory's inodes
        (no loop claimed it in the last ``within`` seconds, nor is warming it: ``SharedInodes.claim_directory``,
        held for ``WARM_CLAIM`` seconds at most), and ``warmed(directory, rest)`` that such a warm ended, and
        that no loop is to warm it again within ``rest`` seconds (``RESTS``) on top of their own bound. Every loop
        still reads the rows of the directories its lookups reach, for the lookups that follow there, but one
        reads the inodes from the disk, where each loop had queued its own warm of a cold directory at once."""
        self._claim, self._warmed = claim, warmed

    def _queue_directory(self, parent: int, within: float) -> bool:
        with self._lock:
            if self._stopped or len(self._busy) >= MAX_QUEUED or parent in self._busy:
                return False
            if self._rest_until and time.monotonic() < self._rest_until.get(parent, -math.inf):
                return False
            self._busy.add(parent)
        if self._thread is None:
            thread = threading.Thread(target=self._run, name=READ_AHEAD, daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had (a pids limit): the read-ahead is a hint
                self._give_up(f"cannot start its thread ({exc})")
                return False
            self._thread = thread
        self._queue.put((parent, within))
        return True

    def _give_up(self, why: str) -> None:
        """The read-ahead off for the mount's life (its lookups answered as without it), said once."""
        log.warning("metadata read-ahead: %s; the mount goes on without it", why)
        with self._lock:
            self._stopped = True
            self._busy.clear()

    def _run(self) -> None:
        name_this_thread(READ_AHEAD)
        try:
            catalog = Catalog.open_path(self.catalog_path, readonly=True, immutable=True)  # the loop's is the loop's
        except Exception as exc:  # (CatalogError, sqlite3.Error, OSError: descriptors short)
            self._give_up(f"cannot open the catalog {self.catalog_path} ({exc})")
            self._close_helper()
            return
        # prepare may have renamed a new catalog over the path since the mount opened its own (other ids, other
        # sizes): its rows may still steer warms, never answer a lookup.
        keep = self.catalog_id is not None and catalog.file_id == self.catalog_id
        if not keep:
            log.info("the store's catalog is not the one this mount opened (replaced since?): lookups are not "
                     "answered from the rows the read-ahead reads")
        try:
            while (queued := self._queue.get()) is not None:
                parent, within = queued
                whole = False
                started, warmed = time.monotonic(), False
                try:
                    whole = self._take(catalog, parent, within, keep)
                    warmed = True
                except Exception:  # a read-ahead is a hint: its failure costs only the hint
                    log.debug("metadata read-ahead of directory %d failed", parent, exc_info=True)
                finally:
                    with self._lock:
                        self._busy.discard(parent)
                        self._done_at[parent] = ended = time.monotonic()
                        self._rest(parent, started, ended if warmed else started)  # (a failure: no rest)
                        if whole:
                            self._whole.add(parent)
                        else:
                            self._whole.discard(parent)
                        if len(self._done_at) > self._done_prune_at:
                            self._done_prune_at = _forget_past(self._done_at, time.monotonic() - 2 * AGAIN_COLD)
                            self._whole &= self._done_at.keys()
                            self._again = {d: bound for d, bound in self._again.items() if d in self._done_at}
        finally:
            catalog.close()
            self._close_helper()

    def _rest(self, parent: int, started: float, ended: float) -> None:
        """``parent``'s next warm held off ``RESTS`` times as long as the one that ran from ``started`` to
        ``ended`` took, where that is longer than the other bounds hold it off anyway (under _lock)."""
        rest = _rest_after(ended - started)
        if rest:
            if len(self._rest_until) >= REMEMBERED_DIRECTORIES:
                _forget_past(self._rest_until, ended)
            self._rest_until[parent] = ended + rest
        else:
            self._rest_until.pop(parent, None)

    def _take(self, catalog: Catalog, parent: int, within: float, keep_rows: bool) -> bool:
        """A directory dequeued: warmed here (its end told the other loops), or, where another loop claimed it
        (``join_loops``), only its rows kept. Whether every one of its files was warmed here."""
        if self._claim is not None and not self._claim(parent, within):
            self.left_to_others += 1
            if keep_rows:
                self._warm_directory(catalog, parent, keep_rows, warm=False)
            return False
        started, rest = time.monotonic(), 0.0
        try:
            whole = self._warm_directory(catalog, parent, keep_rows)
            rest = _rest_after(time.monotonic() - started)  # (a warm that failed rests nothing)
            return whole
        finally:
            # (a no-op with one loop; with several, the others' claims wait out the rest too)
            self._warmed(parent, rest)

    def _warm_directory(self, catalog: Catalog, parent: int, keep_rows: bool, warm: bool = True) -> bool:
        """``parent``'s files' rows kept (``keep_rows``) and their inodes warmed (``warm``; else another loop's).
        Whether every file was warmed."""
        files = (node for node in child_rows(catalog.children, parent, 0, MAX_ROWS, lambda node: node.id)
                 if node.kind == KIND_FILE)
        whole = warm
        while batch := list(itertools.islice(files, MAX_ROWS)):  # a bounded number of files in flight
            if keep_rows:
                self._keep_rows(batch)
            if warm:
                warmed = self._warm_batch(batch)
                self.files += warmed
                whole = whole and warmed == len(batch)
        if warm:
            self.directories += 1
        return whole

    def _keep_rows(self, batch: list[Node]) -> None:
        rows = self._rows
        for node in batch:
            rows[node.parent, node.name] = node
        while len(rows) > HOT_ROWS:
            try:
                rows.popitem(last=False)
            except KeyError:  # emptied by the loop meanwhile
                break

    def _warm_batch(self, batch: list[Node]) -> int:
        """How many of ``batch``'s files were warmed: by the helper process, else (none, or it failed) here."""
        if (helper := self._helper_now()) is not None:
            assert self.walks is not None
            try:
                return helper.warm([self.walks(node) for node in batch])
            except HelperFailed as exc:
                if self._killed:
                    return 0  # killed at unmount (``stop``), stuck: nothing more is warmed
                self._fall_back(exc)
        return warm_in_runs(self._pool(), self._warm_one, batch, WARMERS)

    def _helper_now(self) -> WarmHelper | None:
        """The helper process, started if it is not yet; None where the warms are this process's."""
        if self._helper is None and not self._in_process:
            try:
                self._helper = WarmHelper(self.descriptors, WARMERS)
                log.debug("metadata read-ahead in helper process %d", self._helper.pid)
            except HelperFailed as exc:
                self._fall_back(exc)
        return self._helper

    def _fall_back(self, why: HelperFailed) -> None:
        """The helper could not start, has gone or answered nonsense: this process's threads warm from now on."""
        log.warning("%s: the metadata read-ahead goes on in the daemon's own threads", why)
        self._in_process = True
        self._close_helper()

    def _close_helper(self) -> None:
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    def _warm_one(self, node: Node) -> int:
        try:
            self.warm(node)
            return 1
        except OSError:
            return 0  # gone, changed, refused: the open will say so
        except Exception:  # a read-ahead is a hint (a path no open could walk either): the rest go on
            log.debug("metadata read-ahead of %r failed", node.path, exc_info=True)
            return 0

    def _pool(self) -> ThreadPoolExecutor:
        if self._warmers is None:
            self._warmers = ThreadPoolExecutor(WARMERS, thread_name_prefix=WARMER,
                                               initializer=name_this_thread, initargs=(WARMER,))
        return self._warmers

    def statistics(self) -> LookaheadStatistics:
        return LookaheadStatistics(directories=self.directories, files=self.files,
                                   helper=int(self._helper is not None), rows_hit=self.rows_hit,
                                   left_to_others=self.left_to_others)

    def start(self) -> None:
        """The helper process started now, before the first lookup (on the loop, once the process that serves
        exists: each loop forked after INIT starts its own): started at the first cold directory instead, it
        took ~70 ms (an interpreter's start), and that directory's opens went cold meanwhile."""
        if not self._stopped:
            self._helper_now()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True  # a lookup after this queues nothing: no thread or pool is made again
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=STOP_WAIT)
            waited = STOP_WAIT
            if self._thread.is_alive() and (helper := self._helper) is not None:
                self._killed = True
                helper.kill()  # a warm stuck in the kernel: the thread's wait for the helper ends with it
                self._thread.join(timeout=STOP_WAIT)
                waited += STOP_WAIT
            if self._thread.is_alive():
                # A warm stuck in the kernel (storage that no longer answers) even so: the thread is a daemon
                # thread, and the unmount goes on without it.
                log.warning("the metadata read-ahead has not ended its warms within %g s (storage slow or not "
                            "answering): the unmount goes on without it", waited)
                return
            self._thread = None
        self._close_helper()  # started, and no directory warmed since
        if self._warmers is not None:
            self._warmers.shutdown(wait=True)
            self._warmers = None


def _rest_after(took: float) -> float:
    """The seconds a directory whose warm took ``took`` rests after it (``RESTS``, at most ``MAX_REST``), where
    that is longer than the other bounds hold it off anyway; else 0."""
    rest = min(RESTS * took, MAX_REST)
    return rest if rest > AGAIN_COLD else 0.0


def _forget_past(when: dict[int, float], before: float) -> int:
    """``when``'s entries older than ``before`` dropped; the size past which it is pruned next: twice what is
    left (at least REMEMBERED_DIRECTORIES), so a prune is amortised over as many entries as it keeps."""
    for directory in [d for d, at in when.items() if at < before]:
        del when[directory]
    return max(REMEMBERED_DIRECTORIES, 2 * len(when))
