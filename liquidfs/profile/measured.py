"""``liquidfs profile --run CMD``: the user's own loader timed through a temporary mount at each candidate share.

The cost model (``profile``) adds per-format decode and load costs; a real pipeline also pays per-image work
(the reader, crops, flips, normalisation) and waits for a batch's slowest image, so its balance point lies
elsewhere (issue 30: the model chose 0.93 where all raw ran 11 % faster). Here the pipeline itself is timed, as
the published profiler does:

* a seeded sample of the dataset's images is copied, in the dataset's own layout, into a private scratch
  directory on the store's device and prepared there with every image raw;
* for a share, the scratch is mounted with ``--mix SHARE`` and the command run with ``{mount}`` replaced by the
  mount point; the files it reads are first dropped from the page cache (``posix_fadvise``, these files only),
  so every run reads storage as an epoch of a dataset larger than memory does;
* its rate is what the mount counted, without any help from the command: its opens per second from the first
  open to when it was done with the mount (no file open after its last open; else its exit): its start-up and
  exit are not its pace, its read-ahead's burst at the start is work the epoch waits for; and the bytes served;
* with a next-epoch cache (``--cache-size``), from the first open of the second epoch, as the mount's cache
  counts epochs: the first epoch of a mount has no hits, the later ones hit its share, and training is those;
* a binary search over the 11 shares compares two neighbours and keeps the half on the faster side; two rates
  within noise are measured again (``repeats``); still within noise, the pair's outer neighbours are run once
  (the faster member's side first), and one beyond noise faster than the pair's slower member moves the search to
  its side (a gentle slope, not the peak), else it ends there.
  The model's choice is the first midpoint. The chosen share is the fastest median measured; among shares within
  noise of it, the smallest (it takes the least disk).

Plain Python over ``liquidfs mount``/``umount`` commands; ``search`` is a pure function that tests drive with
simulated pipelines.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..expand.expansion import is_image
from ..stores.sample import ProfileError
from ..sysio import reexec
from ..sysio.locks import PrivateDir
from ..sysio.paths import list_below, open_under

log = logging.getLogger(__name__)

MOUNT_TOKEN = "{mount}"
#: Two rates closer than this share of the faster are within noise (a 3 % loss is the issue's bound).
TOLERANCE = 0.03
#: How often the mount's counters are read while the command runs.
POLL = 0.05
#: Seconds the scratch mount may take to answer a read of its control file once the command ended (past them its
#: daemon is stuck: the profile stops, never waits in the kernel for good).
STUCK_WAIT = 10.0
#: Seconds a mount or unmount of the profile's sample may take.
LIQUIDFS_WAIT = 300.0
#: Bytes of a --run command's output kept (its tail): its last lines and its last JSON line are all that is read.
OUTPUT_KEPT = 1 << 20
#: Fewer opens than this in a run cannot give a pace.
MIN_OPENS = 20
#: The measured search's copy of the dataset stops past this many bytes of originals (its raw objects take about
#: three times as much beside them), once it holds ``COPY_FLOOR`` images: 256 images of 100 megapixels had it
#: copy and prepare ~100 GB on the store's device. Cityscapes' 256 (2.5 MB each) fit.
COPY_BYTES = 1 << 30
COPY_FLOOR = 2 * MIN_OPENS
SHARES = [i / 10 for i in range(11)]


@dataclass
class RunRate:
    """One run of the command at a share, as the mount counted it."""

    share: float
    images_per_s: float   # opens/s from the run's first open to its exit
    bytes_per_s: float    # bytes served over the same span
    opens: int            # every open of the span timed
    seconds: float        # the command's wall time, start-up included
    said: dict[str, object] | None = None  # the command's last output line, where it is a JSON object
    from_epoch: int = 1   # the epoch (the cache's count) the span began with


@dataclass
class SearchResult:
    chosen: float
    steps: list[tuple[float, float]] = field(default_factory=list)  # (left share, right share) compared, in order
    rates: dict[float, list[float]] = field(default_factory=dict)    # images/s of every run, per share
    within_noise: list[float] = field(default_factory=list)          # shares within noise of the chosen one

    def median(self, share: float) -> float:
        return statistics.median(self.rates[share])


def within_noise(a: Sequence[float], b: Sequence[float], tolerance: float = TOLERANCE) -> bool:
    """Whether two shares' rates cannot be told apart: their medians closer than ``tolerance`` of the faster, or
    than the runs' own spread (half the range of each share's repeats, summed)."""
    ma, mb = statistics.median(a), statistics.median(b)
    spread = sum((max(x) - min(x)) / 2 for x in (a, b) if len(x) > 1)
    return abs(ma - mb) <= max(tolerance * max(ma, mb), spread)


def search(measure: Callable[[float], float], *, first: float | None = None, repeats: int = 3,
           tolerance: float = TOLERANCE, shares: Sequence[float] = SHARES) -> SearchResult:
    """A binary search over ``shares`` for the fastest, ``measure(share)`` giving one run's images/s. The rate
    is taken to rise to one peak and fall after it (storage and decoding cross once). Each step compares a share
    with its right neighbour and keeps the half on the faster side; within noise, both are measured again up to
    ``repeats`` runs each; still within noise, an outer neighbour faster than the pair's slower member moves the
    search to its side, and without one the peak is taken to be there."""
    result = SearchResult(chosen=shares[0])

    def rates(i: int) -> list[float]:
        share = shares[i]
        if share not in result.rates:
            result.rates[share] = [measure(share)]
        return result.rates[share]

    lo, hi = 0, len(shares) - 1
    mid = None
    if first is not None:
        mid = min(range(len(shares) - 1), key=lambda i: abs(shares[i] - first))
    while lo < hi:
        if mid is None or not lo <= mid < hi:
            mid = (lo + hi) // 2
        left, right = rates(mid), rates(mid + 1)
        result.steps.append((shares[mid], shares[mid + 1]))
        while within_noise(left, right, tolerance) and min(len(left), len(right)) < repeats:
            left.append(measure(shares[mid]))
            right.append(measure(shares[mid + 1]))
        if within_noise(left, right, tolerance):
            # A pair within noise is a plateau at the peak, or a gentle slope beside it (storage-bound shares lose
            # 3 % a step: a search begun at the model's 1.0 ended at 0.9 where 0.6 ran 15 % faster). One run each
            # of the pair's outer neighbours tells which: one beyond noise faster than the pair's slower member
            # puts the peak on its side, where the search goes on (the pair stays among the measured, so a peak
            # in it still wins); neither, and the peak is here.
            side = _faster_outside(rates, mid, lo, hi, left, right, tolerance)
            if side is None:
                lo, hi = mid, mid + 1
                break
            lo, hi = (lo, mid - 1) if side < mid else (mid + 2, hi)
            mid = None
            continue
        if statistics.median(right) > statistics.median(left):
            lo = mid + 1
        else:
            hi = mid
        mid = None
    best = max(result.rates, key=lambda s: statistics.median(result.rates[s]))
    fastest = statistics.median(result.rates[best])
    # Traded down only within the tolerance: a wide spread of the best's runs must not let a slower share win.
    close = sorted(s for s in result.rates if statistics.median(result.rates[s]) >= (1 - tolerance) * fastest)
    # Among the fastest within noise, the smallest share: the same pace for the least disk.
    result.chosen = close[0] if close else best
    result.within_noise = [s for s in close if s != result.chosen]
    return result


def _faster_outside(rates: Callable[[int], list[float]], mid: int, lo: int, hi: int, left: list[float],
                    right: list[float], tolerance: float) -> int | None:
    """Which outer neighbour of the pair (mid, mid + 1) within [lo, hi] runs beyond noise faster than the pair's
    slower member: the rate has one peak, so the peak is on that side of the pair or in it. Two steps apart, a
    slope too gentle for neighbours to tell shows. The side of the pair's faster member is run first (a slope
    falls away from the peak), and one that tells spares the other's run."""
    faster_left = statistics.median(left) >= statistics.median(right)
    slower = right if faster_left else left
    for i in ((mid - 1, mid + 2) if faster_left else (mid + 2, mid - 1)):
        if lo <= i <= hi and statistics.median(rates(i)) > statistics.median(slower) \
                and not within_noise(rates(i), slower, tolerance):
            return i
    return None


def pace(samples: Sequence[tuple[float, int, int, int]], end: float) -> tuple[float, float, int]:
    """(images/s, bytes/s, opens) of a run from the mount's counters read over it: (seconds, opens, bytes served,
    files open) samples, and ``end``, when the command exited. The span runs from the first open to when the
    command was done with the mount: the first reading after its last open with no file open, else its exit. A
    loader's start-up (imports, building its pipeline) is not its pace, nor is its exit (a DataLoader's workers
    take half a second to go); a read-ahead's burst of opens at the start (DALI's shuffle buffer opens up to
    1,024 files before its first batch) is work the epoch still waits for, and DALI keeps the files it read ahead
    open until it exits."""
    if len(samples) < 2:
        return 0.0, 0.0, 0
    o0, b0 = samples[0][1], samples[0][2]
    last_opens, last_bytes = samples[-1][1], samples[-1][2]
    total = last_opens - o0
    if total <= 0:
        return 0.0, 0.0, 0
    k = next(i for i, s in enumerate(samples) if s[1] > o0)
    # The first open fell between two readings of the counters: the middle of them.
    first = (samples[k - 1][0] + samples[k][0]) / 2 if k else samples[0][0]
    last = next(i for i, s in enumerate(samples) if s[1] == last_opens)
    done = next((s[0] for s in samples[last:] if s[3] == 0), end)
    span = min(done, end) - first
    if span <= 0:
        return 0.0, 0.0, total
    return total / span, (last_bytes - b0) / span, total


def from_epoch(samples: Sequence[tuple[float, int, int, int]], epochs: Sequence[int], epoch: int,
               min_opens: int = 0) -> tuple[Sequence[tuple[float, int, int, int]], bool]:
    """The counters' readings from the last one before ``epoch`` began (``epochs``: the mount cache's newest epoch
    at each reading), for ``pace``; all of them, and False, if it never began, or began with fewer than
    ``min_opens`` opens to come: then what began it was the command's read-ahead past its last epoch (DALI reads on
    into the next), not an epoch it read. The first epoch: all of them."""
    if epoch <= 1:
        return samples, True
    k = next((i for i, e in enumerate(epochs) if e >= epoch), None)
    if k is None:
        return samples, False
    timed = samples[max(0, k - 1):]
    if timed[-1][1] - timed[0][1] < min_opens:
        return samples, False
    return timed, True


def command_for(run: str, mountpoint: Path) -> list[str]:
    """The command's words with ``{mount}`` replaced; run without a shell."""
    try:
        words = shlex.split(run)
    except ValueError as exc:  # an unclosed quote: the user's line to mend, said as such
        raise ProfileError(f"--run: {exc} in {run!r}") from None
    if not any(MOUNT_TOKEN in w for w in words):
        raise ProfileError(f"--run: the command must name the mount point as {MOUNT_TOKEN} "
                           f"(e.g. --run 'python train.py --data {MOUNT_TOKEN}')")
    return [w.replace(MOUNT_TOKEN, str(mountpoint)) for w in words]


def builtin_command(decoder: str, threads: int, images: int, augment: bool = True, epochs: int = 1) -> str:
    """The built-in pipeline for ``decoder`` (``liquidfs.profile.loaders``) as a ``--run`` command over a sample of
    ``images``, ``epochs`` times (two where a cache's hits are to be timed). DALI's shuffle buffer is an eighth of
    the sample: with one as large as the sample (DALI's default 1,024 against 256 images) the reader opens the
    whole epoch before its first batch, so reading and decoding would not overlap, and every share's time would
    be their sum, best at an end; a real dataset is several times DALI's buffer (Cityscapes: 2,975 images)."""
    # Isolated (reexec): it runs where the user ran profile, maybe inside the dataset, maybe as root.
    words = reexec.python_words("liquidfs.profile.loaders", decoder, MOUNT_TOKEN, "--threads", str(threads),
                                "--shuffle-buffer", str(max(1, images // 8)))
    if epochs != 1:
        words += ["--epochs", str(epochs)]
    return shlex.join(words + ([] if augment else ["--no-augment"]))


# -- the scratch dataset ----------------------------------------------------------------------------------


def sample_paths(source: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` images of ``source`` (relative paths), a seeded uniform choice (reservoir over one walk).

    The walk asks each entry's type of the directory listing (d_type), not a stat per file: a dataset of
    millions of files is listed, not stat'ed. What the listing calls a regular file is checked again when it is
    copied (``open_under``)."""
    rng = random.Random(seed)
    chosen: list[Path] = []
    seen = 0
    folders = [Path()]
    # Each folder listed below the root's descriptor, never by path: a folder a dataset writer swaps for a link
    # between its listing and its own (to a directory of root's) is refused, not listed.
    try:
        root = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ProfileError(f"{source}: {exc.strerror}") from None
    try:
        while folders:
            rel = folders.pop()
            try:
                entries = sorted(list_below(root, os.fsencode(rel) if rel.parts else b"", os.fsencode(source)),
                                 key=lambda e: e.name)
            except OSError as exc:
                log.info("profile sample: %s left out: %s", rel, exc.strerror or exc)
                continue
            below = []
            for entry in entries:
                if entry.is_dir:
                    below.append(rel / entry.name)
                    continue
                if not entry.is_file or not is_image(os.fsencode(entry.name)):
                    continue
                seen += 1
                if len(chosen) < count:
                    chosen.append(rel / entry.name)
                else:
                    j = rng.randrange(seen)
                    if j < count:
                        chosen[j] = rel / entry.name
            folders.extend(reversed(below))  # depth first, in name order
    finally:
        os.close(root)
    return sorted(chosen)


def forget_pages(root: Path) -> None:
    """Drop the page cache of every file under ``root`` (written back first): the next read is storage's."""
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


#: The scratch directories of measured searches, under the store's directory.
SCRATCH_PREFIX = "profile-run-"


def _remove_scratch(root: Path) -> None:
    """A scratch directory, its mount detached first. Where the mount stays (an unmount that failed), the
    directory does too: the removal would walk into the mounted tree."""
    from ..daemon.control import unmount
    from ..daemon.watchdog import topmost_mount

    mnt = root / "mnt"
    try:  # mountinfo, not a stat of the mount: its daemon may answer nothing
        if topmost_mount(mnt) is not None:
            unmount(mnt, lazy=True)
    except Exception as exc:
        log.warning("unmounting %s: %s", mnt, exc)
    if topmost_mount(mnt) is not None:
        log.warning("%s is still mounted: %s is left", mnt, root)
        return
    shutil.rmtree(root, ignore_errors=True)


class ScratchMounts:
    """A sample of ``source`` copied into a private directory under ``parent``, prepared all raw, mounted at a
    share at a time."""

    def __init__(self, source: Path, parent: Path, count: int, *, seed: int = 0, mount_args: Sequence[str] = (),
                 timed_from_epoch: int = 1, progress: Callable[[str], None] = lambda s: None,
                 max_bytes: int | None = COPY_BYTES) -> None:
        """``timed_from_epoch``: each run's pace from that epoch's first open on, as the mount's cache counts
        epochs (mount_args must give it a ``--cache-size``), where the command reads that far. ``max_bytes``:
        the copy stops past that many bytes of originals, once it holds ``COPY_FLOOR`` images (None: ``count``
        images, as ``--run-images N`` asks)."""
        self.max_bytes = max_bytes
        self.source = source
        self.mount_args = list(mount_args)
        self.timed_from_epoch = timed_from_epoch
        self.progress = progress
        parent.mkdir(parents=True, exist_ok=True)
        # 0700 (mkdtemp): the copies are readable by no more people than the source files were. Its lock is held
        # while this run lives: a run killed outright leaves the directory and its mount to the next one.
        self._private = PrivateDir(parent, SCRATCH_PREFIX, _remove_scratch)
        self.root = self._private.path
        self.src, self.store, self.mnt = self.root / "data", self.root / "store", self.root / "mnt"
        try:
            self.mnt.mkdir()
            self.images = self._copy(count, seed)
            self._prepare()
        except BaseException:
            self.cleanup()
            raise

    def _copy(self, count: int, seed: int) -> int:
        paths = sample_paths(self.source, count, seed)
        if len(paths) < MIN_OPENS:
            raise ProfileError(f"{self.source}: {len(paths)} images; the measured search needs at least "
                               f"{MIN_OPENS}")
        self.progress(f"copying a sample of {len(paths)} images in the dataset's layout")
        copied = copied_bytes = 0
        for rel in paths:
            if self.max_bytes is not None and copied_bytes >= self.max_bytes and copied >= COPY_FLOOR:
                self.progress(f"the sample stops at {copied} images, {copied_bytes / 1e9:.1f} GB of originals")
                break
            target = self.src / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                # Never through a link anywhere below the source, never a FIFO (a writer of the dataset may swap a
                # file or a folder for one meanwhile); the copy is this user's, 0600 under liquidfs's umask, in a
                # 0700 directory.
                source = open_under(os.fsencode(self.source), os.fsencode(rel))
                with open(source, "rb") as fin, open(target, "xb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
                    copied_bytes += fout.tell()
                copied += 1
            except OSError as exc:
                target.unlink(missing_ok=True)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # every copy after it fails alike: said as it is
                    raise ProfileError(f"no room under {self.root} for the measured search's sample (after "
                                       f"{copied} images): free some, or give --run-images fewer") from None
                log.info("profile sample: %s left out: %s", rel, exc.strerror or exc)
        if copied < MIN_OPENS:
            raise ProfileError(f"{self.source}: only {copied} images could be read for the measured search")
        return copied

    def _prepare(self) -> None:
        from ..prepare import PrepareError, prepare

        self.progress("preparing the sample with every image raw")
        try:
            prepare(self.src, self.store, 1.0, progress=False)
        except PrepareError as exc:
            raise ProfileError(f"preparing the sample: {exc}") from None

    def measure(self, share: float, command: str, *, timeout: float) -> RunRate:
        """One run of ``command`` through a fresh mount at ``share``."""
        self._liquidfs("mount", str(self.src), str(self.mnt), "--store", str(self.store), "--mix", f"{share:g}",
                       *self.mount_args)
        rate = self._measure(share, command, timeout)
        self._liquidfs("umount", str(self.mnt))
        return rate

    def _measure(self, share: float, command: str, timeout: float) -> RunRate:
        """One run through the mount made for it; unmounted here only if it fails."""
        try:
            forget_pages(self.src)
            forget_pages(self.store)
            words = command_for(command, self.mnt)
            samples: list[tuple[float, int, int, int]] = []
            epochs: list[int] = []  # the cache's newest epoch at each reading
            stop = threading.Event()
            started = time.monotonic()

            def poll() -> None:
                while not stop.is_set():
                    reading = self._counters(time.monotonic() - started)
                    if reading is not None:
                        samples.append(reading[:4])
                        epochs.append(reading[4])
                    stop.wait(POLL)

            poller = threading.Thread(target=poll, name="profile-poll", daemon=True)
            poller.start()
            try:
                returncode, output, said = self._run(words, share, timeout)
            finally:
                stop.set()
                poller.join(STUCK_WAIT)
            if poller.is_alive():  # its read of the control file waits in the kernel: the mount answers nothing
                raise ProfileError(f"the profile's scratch mount {self.mnt} answered nothing in "
                                   f"{STUCK_WAIT:.0f} s (its daemon stuck?)")
            seconds = time.monotonic() - started
            last = self._counters(seconds, bounded=True)  # at the exit: what the command did last
            if last is not None:
                samples.append((*last[:3], 0))
                epochs.append(last[4])
            if returncode != 0:
                tail = output.strip().splitlines()[-12:]
                raise ProfileError(f"--run: the command exited with status {returncode} at share {share:g}"
                                   + ("; its last lines:\n" + "\n".join(f"  {t}" for t in tail) if tail else ""))
            # An epoch timed is one the command read at least half of.
            timed, reached = from_epoch(samples, epochs, self.timed_from_epoch, min_opens=self.images // 2)
            images_per_s, bytes_per_s, opens = pace(timed, seconds)
            if opens < MIN_OPENS or images_per_s <= 0:
                raise ProfileError(f"--run: the command opened {opens} files through the mount at share {share:g}; "
                                   f"its pace needs at least {MIN_OPENS} (does it read {MOUNT_TOKEN}? give it "
                                   "more steps)")
            return RunRate(share, images_per_s, bytes_per_s, opens, seconds, said,
                           from_epoch=self.timed_from_epoch if reached else 1)
        except BaseException:
            # Already failing (a failed run, Ctrl-C): an unmount that fails too is logged, not raised in its place;
            # cleanup() detaches what is left.
            try:
                self._liquidfs("umount", str(self.mnt))
            except ProfileError as exc:
                log.warning("%s", exc)
            raise

    def _counters(self, at: float, *, bounded: bool = False) -> tuple[float, int, int, int, int] | None:
        """(seconds, opens, bytes served, files open, the cache's newest epoch (0 without a cache)) from the
        mount's control file; None if it cannot be read. ``bounded``: read from a child process within
        ``STUCK_WAIT`` (``read_control_within``), where the caller must not wait for a stuck mount; the
        poller reads in its own thread (a fork 20 times a second would weigh on what it measures)."""
        from ..daemon.control import read_control, read_control_within

        try:
            c = read_control_within(self.mnt, STUCK_WAIT) if bounded else read_control(self.mnt)
        except (OSError, ValueError) as exc:
            log.debug("reading the mount's counters: %s", exc)
            return None
        values = [c.get(k) for k in ("opens", "bytes_from_storage", "bytes_from_memory", "bytes_from_disk",
                                     "bytes_from_cluster", "open_files")]
        opens, *served, held = [v if isinstance(v, int) else 0 for v in values]
        epochs = c.get("epochs")
        newest = max((int(e) for e in epochs if e.isdigit()), default=0) if isinstance(epochs, dict) else 0
        return at, opens, sum(served), held, newest

    def _run(self, words: list[str], share: float, timeout: float) -> tuple[int, str, dict[str, object] | None]:
        """Run the command in a session of its own (its children too are stopped once it exits, or if it must
        be): its exit status, its output, and what it said in a last JSON line, if it did. Its exit ends the run,
        not the end of its output: a worker it left behind (a loader's, orphaned) holds the pipe open, and the
        run waited for it to the timeout, then failed as one that never finished."""
        try:
            proc = subprocess.Popen(words, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=reexec.users_env())
        except OSError as exc:
            raise ProfileError(f"--run: cannot start {words[0]!r}: {exc.strerror}") from None
        assert proc.stdout is not None
        # Its output's tail only (its last lines and its last JSON line are all that is read of it): a training
        # script that logs every step for the run's minutes had the profile, as root often, hold all of it three
        # times over (300 MB of output: 1.5 GB).
        chunks: list[bytes] = []
        kept = threading.Lock()  # (the reader may still run when the tail is read: its writer left the pipe open)

        fd = proc.stdout.fileno()

        def read_tail() -> None:
            held = 0  # (trimmed by bytes: by count, a command of many short lines was joined every few reads)
            while chunk := os.read(fd, 1 << 16):
                with kept:
                    chunks.append(chunk)
                    held += len(chunk)
                    if held > 2 * OUTPUT_KEPT:
                        chunks[:] = [b"".join(chunks)[-OUTPUT_KEPT:]]
                        held = len(chunks[0])

        reader = threading.Thread(target=read_tail, name="profile-output", daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ProfileError(f"--run: the command did not finish within {timeout:.0f} s at share {share:g} "
                               "(give it less work, or --run-timeout)") from None
        finally:
            # The command's whole session: a launcher's workers would hold the mount open after it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(STUCK_WAIT)  # its session gone, the pipe ends (a writer that left it keeps it open)
            if not reader.is_alive():
                proc.stdout.close()
        with kept:
            text = b"".join(chunks)[-OUTPUT_KEPT:].decode(errors="replace")
        said = None
        lines = text.strip().splitlines()
        if lines:
            with contextlib.suppress(ValueError):
                parsed = json.loads(lines[-1])
                said = parsed if isinstance(parsed, dict) else None
        return proc.returncode, text, said

    def _liquidfs(self, *args: str) -> None:
        try:
            proc = reexec.run("liquidfs", args, capture_output=True, text=True, check=False, timeout=LIQUIDFS_WAIT,
                              stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:  # a message, never a traceback (nor one that hides the run's failure)
            raise ProfileError(f"liquidfs {args[0]} of the profile's sample did not end within {LIQUIDFS_WAIT:.0f} "
                               "s") from None
        except OSError as exc:
            raise ProfileError(f"liquidfs {args[0]} of the profile's sample: {exc.strerror}") from None
        if proc.returncode != 0:
            raise ProfileError(f"liquidfs {args[0]} of the profile's sample failed: "
                               f"{(proc.stderr or proc.stdout).strip()[-1500:]}")

    def cleanup(self) -> None:
        self._private.remove()

    def __enter__(self) -> ScratchMounts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
