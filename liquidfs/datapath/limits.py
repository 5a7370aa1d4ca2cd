"""The data path's limits and modes that ``mount``'s options default to (``daemon.config``), in a module that
imports nothing: the command line builds its parser, and ``umount`` and ``stats`` run, without loading trio,
pyfuse3 or NumPy (0.5 s of a CPU at every command here)."""

from __future__ import annotations

#: Bytes that open files may keep in the daemon beyond the cache's budget (files read whole at open, not yet
#: served to the end); past it the oldest let go of theirs and read them again if asked (``DaemonPath._count_open``).
MAX_OPEN_BYTES = 64 << 20
#: ``mount --page-cache``: "drop" the pages of a file the daemon does not hold when it is closed (no second
#: copy of the dataset in memory; the kernel's work of dropping them is charged to the daemon), "keep" them
#: like any file's (the kernel reclaims them under pressure), or serve such files "direct" (direct_io: no pages
#: at all, every read reaches the daemon).
PAGE_CACHE_MODES = ("drop", "keep", "direct")
#: Seconds a storage read may take before the reader gets EIO (``mount --io-timeout``).
IO_TIMEOUT = 60.0
#: Storage calls of opens at once (``mount --open-threads``; ``StorageCalls.opening``). An open's calls are
#: metadata (the source's identity, the raw object's inode) that each wait on the disk's latency, not its
#: bandwidth: under the reads' ``--threads`` (4) a node's 16 loader workers could have only four opens in storage,
#: and a slow one held a slot that reads wanted. Opens get a pool of their own, sized for a node's loader workers;
#: threads idle for 10 s exit (trio's thread cache). (On a GPU node the four were not what made cold opens slow:
#: the loop's CPU per open is, BENCHMARKS.md "Opens on a GPU node".)
OPEN_THREADS = 64
