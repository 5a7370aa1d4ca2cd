"""The metadata read-ahead's warms in a helper process, off the daemon's interpreter: each warm is a few system
calls that wait for the disk, and in the daemon's own threads each of those waits ended in a wait for the GIL
the trio loop holds, and cost the loop its hand-over (issue 40: 3,000 cold 110 KB files read by eight readers,
3,316-3,435 files/s with the warms in the daemon's threads, 4,070-4,089 with them here, the daemon's CPU per
file, the helper's included, 307-317 against 257-277 us; BENCHMARKS.md, "The read-ahead in a helper process").

The daemon (``WarmHelper``) starts ``python -I -m liquidfs.fuse.warm_helper THREADS FD...``, handing it only the
directories held since mount (the source's root, the objects directory: ``StoreReader.warm_descriptors``) and two
pipes. It writes a batch of files, one line each (the walks of its open, ``FD:HEXPATH`` separated by spaces,
``StoreReader.warm_walks``), ended by a line ``.``; the helper stats each walk below its directory as every
open walks it (``sysio.paths.stat_below``: no link, never above the directory, never onto another filesystem), in
THREADS threads (each a run of neighbours, in the batch's order: ``runs``), and answers the number of files whose
every walk succeeded. It reads no byte of any file, writes nothing, and trusts the lines no more than a catalog: a
descriptor it was not handed, a malformed line or a path that leaves its root is a file not warmed. It ends when
its input does (the daemon closed it, or died).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import IO, TypeVar

from ..sysio import reexec
from ..sysio.paths import stat_below
from ..sysio.thread_names import WARMER, name_this_thread

log = logging.getLogger(__name__)

#: Seconds the helper may take to end once its input is closed before it is killed (at unmount).
STOP_WAIT = 5.0

Walks = list[tuple[int, bytes]]
T = TypeVar("T")


class HelperFailed(Exception):
    """The helper process could not be started, has gone, or answered what it cannot have meant."""


class WarmHelper:
    """The daemon's side: a helper process that warms batches of files (see the module)."""

    def __init__(self, descriptors: Sequence[int], threads: int) -> None:
        try:
            # Isolated and in / as every re-exec of the daemon (``sysio.reexec``), in a session of its own: a
            # terminal's Ctrl-C for a --foreground mount is the daemon's to handle, and it ends the helper.
            self._process = reexec.popen(__name__, [str(threads), *map(str, descriptors)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, pass_fds=tuple(descriptors), start_new_session=True)
        except OSError as exc:
            raise HelperFailed(f"the read-ahead's helper process could not start: {exc}") from exc
        assert self._process.stdin is not None and self._process.stdout is not None
        self._to: IO[bytes] = self._process.stdin
        self._from: IO[bytes] = self._process.stdout

    @property
    def pid(self) -> int:
        return self._process.pid

    def warm(self, batch: Sequence[Walks]) -> int:
        """How many of ``batch``'s files the helper warmed: each file's walks, all of them at once."""
        lines = [b" ".join(b"%d:%s" % (fd, rel.hex().encode()) for fd, rel in walks) + b"\n" for walks in batch]
        try:
            self._to.write(b"".join(lines) + b".\n")
            self._to.flush()
            answer = self._from.readline(32)
        except OSError as exc:  # a broken pipe: the helper has gone
            raise HelperFailed(f"the read-ahead's helper process has gone ({exc})") from exc
        try:
            warmed = int(answer)
        except ValueError:
            warmed = -1
        if not 0 <= warmed <= len(batch):
            raise HelperFailed(f"the read-ahead's helper process answered {answer[:32]!r} for {len(batch)} files")
        return warmed

    def kill(self) -> None:
        """Sends the helper SIGKILL (a warm stuck in the kernel must not hold up the unmount)."""
        self._process.kill()

    def close(self) -> None:
        """Ends the helper: its input closed, then, should it not end within ``STOP_WAIT`` seconds, killed; one
        that a stuck system call keeps from dying even then is left to end on its own, never waited for."""
        try:
            self._to.close()
        except OSError:
            pass  # it has gone already
        try:
            self._process.wait(timeout=STOP_WAIT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            try:
                self._process.wait(timeout=STOP_WAIT)
            except subprocess.TimeoutExpired:
                log.warning("the read-ahead's helper process %d is stuck in the kernel: left to end on its own",
                            self._process.pid)
                return
        self._from.close()


# -- the helper process ---------------------------------------------------------------------------------------


def parse(line: bytes, allowed: frozenset[int]) -> Walks | None:
    """The walks of one file's line; None where the line is malformed or names a descriptor not handed over."""
    walks: Walks = []
    for word in line.split():
        fd_text, sep, path_hex = word.partition(b":")
        if not sep or not fd_text.isdigit():
            return None
        fd = int(fd_text)
        if fd not in allowed:
            return None
        try:
            walks.append((fd, bytes.fromhex(path_hex.decode("ascii"))))
        except (UnicodeDecodeError, ValueError):
            return None
    return walks or None


def warm(walks: Walks | None) -> int:
    """1 where every walk reached its file (the kernel holds its dentries and inode now), else 0."""
    if walks is None:
        return 0
    try:
        for dir_fd, rel in walks:
            stat_below(dir_fd, rel)
    except Exception:  # noqa: BLE001 -- a path no open could walk either (a NUL without openat2): not warmed
        return 0
    return 1


def batches(lines: IO[bytes], allowed: frozenset[int]) -> Iterator[list[Walks | None]]:
    """The batches the daemon writes, each ended by a line ``.``; a last one cut short is dropped."""
    batch: list[Walks | None] = []
    for line in lines:
        if line.rstrip(b"\n") == b".":
            yield batch
            batch = []
        else:
            batch.append(parse(line, allowed))


def main(argv: list[str]) -> int:
    # A loop other than the first ignores Ctrl-C and hangups (the first decides), and its helper inherited that
    # through exec: this one ends at SIGINT and SIGHUP as any process does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    threads, *descriptors = (int(arg) for arg in argv)
    allowed = frozenset(descriptors)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    name_this_thread(WARMER)  # the process's name too (its main thread's): ``ps`` tells it from the daemon
    with ThreadPoolExecutor(max(1, threads), initializer=name_this_thread, initargs=(WARMER,)) as pool:
        for batch in batches(stdin, allowed):
            stdout.write(b"%d\n" % warm_in_runs(pool, warm, batch, threads))
            stdout.flush()
    return 0


def runs(batch: list[T], count: int) -> list[list[T]]:
    """``batch`` cut into at most ``count`` runs of neighbours, for a thread each. Files made one after another
    (a dataset unpacked) have neighbouring inodes, read in blocks: threads given every n-th file waited for the
    same blocks (and contended for their locks), where a thread's run is mostly in memory after its first."""
    size = -(-len(batch) // max(1, count))
    return [batch[i:i + size] for i in range(0, len(batch), size)] if batch else []


def warm_in_runs(pool: Executor, warm_one: Callable[[T], int], batch: list[T], count: int) -> int:
    """How many of ``batch``'s files ``warm_one`` warmed (1 or 0 each), in ``count`` runs of neighbours at once
    (``runs``), each run one file after another: the helper's warms and the daemon's own where it has none."""
    return sum(pool.map(lambda run: sum(map(warm_one, run)), runs(batch, count)))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
