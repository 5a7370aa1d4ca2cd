"""The interface between the FUSE layer and what serves file bytes: a data path.

``fuse.operations.Operations`` translates the kernel's requests and hands every open, read and release of a file
to the one data path the mount serves with, never asking which it is: ``datapath.daemon.DaemonPath`` (this
process answers every read) or ``datapath.passthrough.PassthroughPath`` (the kernel reads a backing descriptor
itself). Each keeps what it holds for the next epoch in a level of held bytes (``held.base.HeldLevel``); the
warm-up before the first epoch is written once, here, over ``warm_one``.
"""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio

from ..catalog.nodes import KIND_FILE, Node
from ..held.base import HeldLevel
from ..metrics.stats import Statistics
from .inodes import Handle, Inode

if TYPE_CHECKING:
    from ..catalog.catalog import Catalog

log = logging.getLogger(__name__)


class DataPath(Protocol):
    #: What ``stats`` and the log call it: "daemon" or "passthrough".
    name: str
    @property
    def held(self) -> HeldLevel | None:
        """Where the next-epoch cache keeps its files on this path; None without a cache."""
        ...

    async def open(self, node: Node, inode: Inode, fh: int, job: int = 0) -> Handle:
        """A new open of ``node`` (a file) by a reader of ``job`` (``policy.jobs.JobOf``), to be registered as
        ``fh``. The handle's content says its size: where that is not what the kernel was told
        (``inode.size_told``), the caller tells the kernel."""
        ...

    async def read(self, handle: Handle, off: int, size: int) -> bytes | memoryview: ...

    async def release(self, handle: Handle) -> None: ...

    async def warm_one(self, node: Node) -> int | None:
        """Warm-up: read ``node`` into the held level if the budget allows; the bytes held, or None."""
        ...

    def statistics(self) -> Statistics:
        """The path's own counters (its held level's are the level's: ``held``)."""
        ...

    def close(self) -> None:
        """At unmount: let go of what the path holds outside the kernel's requests."""
        ...


#: Rows of the catalog read on the loop at a time by the warm-up (~20 ms): the requests meanwhile wait one page.
WARM_UP_PAGE = 16384


async def warm_up(path: DataPath, catalog: Catalog,
                  progress: Callable[[int, int], None] = lambda files, total: None) -> tuple[int, int]:
    """Load a random budget's worth of the catalog's files into ``path``'s held level before the first epoch, so
    that epoch hits too. Storage reads go to worker threads; the policy and the held bytes change only on the loop.
    The choice is made among every file from its id and size, read a page at a time with the loop answering in
    between: a ``Node`` of each file blocked the loop for a minute and took 6 GB at ten million files."""
    held = path.held
    assert held is not None
    files, sizes = array("q"), array("q")
    after = 0
    while page := catalog.served_sizes(after, WARM_UP_PAGE):
        for file, served in page:
            files.append(file)
            sizes.append(served)
        after = page[-1][0]
        await trio.lowlevel.checkpoint()
    chosen = await trio.to_thread.run_sync(held.policy.warmup_choice, files, sizes)
    del files, sizes
    count = total = 0
    for node_id in chosen:
        node = catalog.get(node_id)
        if node is None or node.kind != KIND_FILE:
            continue
        try:
            size = await path.warm_one(node)
        except Exception as exc:  # one file's fault (a read, a row of the wrong type) is that file's: never the mount's
            log.warning("warm-up: %s: %s", os.fsdecode(node.path), exc)
            continue
        if size is None:
            continue
        count += 1
        total += size
        progress(count, total)
    return count, total
