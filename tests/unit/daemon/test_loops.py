"""daemon.loops: what each loop asks of pyfuse3's main loop."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest
import trio

from liquidfs.daemon import loops
from liquidfs.datapath.storage_calls import FUSE_WORKERS


def test_each_loop_keeps_idle_workers_waiting_and_bounds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyfuse3 retires a worker task past ``min_tasks`` waiting ones and starts one whenever none waits: at its
    default of 1, a loop under load started and retired a task for about every request (BENCHMARKS.md, "Worker
    tasks kept"). Every loop asks for ``IDLE_WORKERS`` kept, and at most ``FUSE_WORKERS`` at once."""
    asked: dict[str, Any] = {}

    async def main(**kwargs: Any) -> None:
        asked.update(kwargs)

    monkeypatch.setattr(pyfuse3, "main", main)
    ops = SimpleNamespace(stats=SimpleNamespace(dispatch=None), lookahead=None)
    trio.run(loops.answer, ops)
    assert asked == {"min_tasks": loops.IDLE_WORKERS, "max_tasks": FUSE_WORKERS}
    assert 8 <= loops.IDLE_WORKERS < FUSE_WORKERS
    assert ops.stats.dispatch in ("queued-first", "stock")


def test_each_loop_serves_through_passthrough_once_the_fork_found_it_engaged(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The loops are forked only where passthrough engaged; each then probed it again, and a failure of the
    moment (EMFILE, ENOMEM) had that loop serve through the daemon beside the others' backings, an inode opened
    both ways being refused by the kernel (EIO). One of several loops serves through passthrough, unprobed."""
    from contextlib import ExitStack

    from liquidfs.catalog.build import build as build_catalog
    from liquidfs.catalog.catalog import Catalog
    from liquidfs.daemon import build as assemble
    from liquidfs.daemon import serve
    from liquidfs.datapath import passthrough
    from liquidfs.datapath.passthrough import PassthroughPath
    from liquidfs.fuse.peers import Peers
    from liquidfs.metrics.stats import MountStats
    from liquidfs.stores.local.reader import StoreReader
    from operations import FakeKernel, config

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a")
    build_catalog(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    with ExitStack() as stack:
        ops, parts = assemble.operations(config(), catalog, StoreReader(catalog.source, tmp_path / "store"),
                                         MountStats(), stack, data_path="at init")
        pairs = Peers.made(2)
        stack.callback(Peers.close_pairs, pairs)
        ops.peers = Peers.mine(pairs, 0)
        monkeypatch.setattr(passthrough, "engaged", lambda kernel=None: "registering a backing file failed: EMFILE")
        monkeypatch.setattr(passthrough, "FuseKernel", FakeKernel)
        assert serve.choose_data_path(config(), ops, parts)
        assert isinstance(ops.data_path, PassthroughPath)


def test_a_loop_that_cannot_be_forked_leaves_the_others_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork refused (a pids limit, no memory) left ``fork`` with the loops started so far never stopped and the
    mount failed; the loops that could be started serve, the rest asked nothing, as loops that ended."""
    import errno
    import os

    from liquidfs.daemon.config import MountConfig
    from liquidfs.datapath import passthrough

    monkeypatch.setattr(loops, "handle_init_here", lambda: True)
    monkeypatch.setattr(passthrough, "engaged", lambda: None)
    monkeypatch.setattr(pyfuse3, "device_fd", lambda: 0, raising=False)

    def refused() -> int:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", refused)
    config = MountConfig(source="/data", mountpoint=Path("/mnt"), store="/s", loops=3)
    found = loops.fork(config, None, None)  # type: ignore[arg-type]
    assert found is not None
    try:
        assert found.pids == [] and found.peers.gone_loops == {1, 2}
    finally:
        for sock in (*found.peers._send, found.peers._receive):
            sock.close()
