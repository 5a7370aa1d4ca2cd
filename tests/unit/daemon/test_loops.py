"""daemon.loops: what each loop asks of pyfuse3's main loop."""

from __future__ import annotations

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
