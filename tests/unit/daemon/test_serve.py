"""``daemon.serve``'s parts that need no mount: the metrics endpoint's start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from liquidfs.daemon import serve
from liquidfs.daemon.config import MountConfig


def test_a_metrics_endpoint_that_cannot_start_leaves_the_mount_serving(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Its port taken since the command checked it, or its threads refused (a pids limit): the error left the
    daemon's main and took the mount down (a traceback where it was a RuntimeError). Said; the mount serves."""
    async def failing(*args: object, task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(serve, "serve_metrics", failing)
    config = MountConfig(source="/data", mountpoint=Path("/mnt"), store="/s", metrics_port=9100)

    class Ops:
        def mount_statistics(self) -> dict[str, object]:
            return {}

    async def main() -> bool:
        async with trio.open_nursery() as nursery:
            return await serve._metrics_started(nursery, config, Ops())  # type: ignore[arg-type]

    with caplog.at_level(logging.ERROR):
        assert trio.run(main) is False
    assert "could not start (can't start new thread): the mount serves without it" in caplog.text
