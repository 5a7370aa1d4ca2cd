"""The operating system's name of a thread (what ``top -H``, ``ps -L`` and /proc/PID/task/TID/comm show).

Python before 3.14 gives a thread no name the system sees: every thread of the daemon shows as ``python``, and where
its CPU goes (the loop, the worker threads trio names itself, the closer, the read-ahead) cannot be told apart,
by an operator's ``top -H`` or by ``scripts/bench/bench_opens.py``'s split of it (issue 40).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

__all__ = ["CLOSER", "CLUSTER_DNS", "DISCARD", "METRICS", "NAME_MAX", "NOTIFIER", "ORPHAN_WATCH", "READ_AHEAD",
           "WARMER", "name_this_thread"]

#: Bytes of a thread's name the kernel keeps (TASK_COMM_LEN, 16, less the NUL); longer names are cut.
NAME_MAX = 15

# The names of the daemon's own threads (trio names its worker threads ``Trio thread N`` itself; each loop's main
# thread keeps its process's name). ``scripts/bench/bench_opens.py`` splits the daemon's CPU by them.
#: Closes released backings and drops their pages (``datapath.backing.Closer``).
CLOSER = "liquidfs-close"
#: Tells the kernel of changed sizes and pushed pages (``datapath.notifier``).
NOTIFIER = "liquidfs-notify"
#: The metadata read-ahead's thread: reads a directory's rows, hands its warms out (``fuse.lookahead``).
READ_AHEAD = "liquidfs-ahead"
#: The threads that warm inodes: the read-ahead's helper process (its main thread too), else the daemon's own.
WARMER = "liquidfs-warm"
#: Closes what a storage call returned after its caller gave up on it (``datapath.storage_calls.in_thread``).
DISCARD = "liquidfs-discard"
#: A pool worker's watch of the command it works for (``sysio.orphans``).
ORPHAN_WATCH = "liquidfs-orphan"
#: The ``/metrics`` endpoint's threads (``metrics.server``).
METRICS = "liquidfs-metric"
#: Re-resolves the cluster's peers (``held.cluster_peers``).
CLUSTER_DNS = "liquidfs-dns"
_PR_SET_NAME = 15

_libc = ctypes.CDLL(None, use_errno=True)


def name_this_thread(name: str) -> None:
    """The calling thread named ``name`` for the system (cut to ``NAME_MAX`` bytes). A label only: a failure is
    logged at debug level and changes nothing else."""
    if _libc.prctl(_PR_SET_NAME, name.encode()[:NAME_MAX], 0, 0, 0) != 0:
        log.debug("naming thread %r: errno %d", name, ctypes.get_errno())
