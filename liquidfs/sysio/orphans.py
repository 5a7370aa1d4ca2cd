"""A worker process that ends with the process it works for: prepare's and verify's pool workers.

Their parent is multiprocessing's forkserver, not the command: killed outright (SIGKILL, the OOM killer), the
command leaves its workers blocked on a queue nobody will write, each holding its memory (which the next run's
plan of workers counts as taken) and its job's half-written object, for good. Each worker watches the command's
process through a pidfd (readable once it has exited) and exits at once when it has.
"""

from __future__ import annotations

import logging
import os
import select
import threading

from .thread_names import ORPHAN_WATCH, name_this_thread

log = logging.getLogger(__name__)

__all__ = ["exit_with"]


def exit_with(pid: int) -> None:
    """From now on, this process exits (status 1) as soon as process ``pid`` has; nothing where it cannot watch
    it (a kernel without pidfds: before 5.3). Already gone: at once."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError) as exc:
        log.debug("cannot watch process %d (%s): this worker outlives it if it is killed", pid, exc)
        return
    threading.Thread(target=_watch, args=(pidfd,), name=ORPHAN_WATCH, daemon=True).start()


def _watch(pidfd: int) -> None:
    name_this_thread(ORPHAN_WATCH)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while not poller.poll():  # (an interrupted poll returns nothing: waited again)
        continue
    os._exit(1)
