"""``daemon.serve``'s parts that need no mount: the metrics endpoint's start."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

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


def _ready_config(tmp_path: Path) -> MountConfig:
    return MountConfig(source="/data", mountpoint=tmp_path, store="/s")


def test_a_mount_command_gone_before_ready_leaves_the_mount_serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The command killed while its daemon started: the write of "ready" to its pipe failed (EPIPE) out of the
    loop, which unmounted the mount it had just made. Said; the mount serves on."""
    (tmp_path / os.fsdecode(serve.CONTROL_NAME)).touch()
    monkeypatch.setattr(serve, "choose_data_path", lambda config, ops, built: True)
    read_end, write_end = os.pipe()
    os.close(read_end)
    with caplog.at_level(logging.WARNING):
        ops = SimpleNamespace(stats=SimpleNamespace(data_path="passthrough"), policy=None)
        trio.run(serve._signal_ready, _ready_config(tmp_path), ops, object(), write_end)
    assert "did not hear that the mount answers" in caplog.text
    with pytest.raises(OSError):
        os.fstat(write_end)  # closed all the same


def test_a_stop_while_the_mount_starts_ends_the_loop_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop signal before the loop answered the readiness stat: the loop ended without reading it, and trio
    waited for the thread stuck in it for good (the mount hung). The stat is abandoned at the cancel."""
    release = threading.Event()
    answered = threading.Event()

    def stuck_stat(path: object) -> None:  # the request in the kernel, nobody to answer it (10 s: the test's bound)
        release.wait(10)
        answered.set()

    monkeypatch.setattr(serve, "os", SimpleNamespace(stat=stuck_stat, fsdecode=os.fsdecode))

    async def main() -> None:
        with trio.move_on_after(0.2):
            await serve._signal_ready(_ready_config(tmp_path), object(), object(), None)  # type: ignore[arg-type]

    try:
        trio.run(main)
        assert not answered.is_set()  # the loop ended while the stat still waited
    finally:
        release.set()


def test_a_watchdog_that_cannot_start_leaves_the_mount_serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """No mount(8) to mount fusectl with, a pids limit at its start: the OSError left the session's start after
    the mount was made, and the mount was taken down for a helper."""
    from contextlib import ExitStack

    from liquidfs.daemon import watchdog

    def cannot_start(*args: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", "mount")

    monkeypatch.setattr(serve, "pyfuse3", SimpleNamespace(init=lambda *args: None, close=lambda **kwargs: None,
                                                          default_options=frozenset()))
    monkeypatch.setattr(serve, "still_the_mount_point", lambda *args: None)
    monkeypatch.setattr(watchdog, "start", cannot_start)
    with caplog.at_level(logging.WARNING), ExitStack() as stack:
        serve.start_session(_ready_config(tmp_path), object(), stack)  # type: ignore[arg-type]
    assert "no watchdog for" in caplog.text and "could not start" in caplog.text
