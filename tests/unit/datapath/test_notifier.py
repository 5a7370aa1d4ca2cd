"""Kernel notifications from their worker thread (``notifier.Notifier``)."""

from __future__ import annotations

import trio


def test_a_failing_store_completion_does_not_end_the_loop() -> None:
    """Completions run on the trio thread through run_sync_soon: an exception there would end trio.run and with
    it the mount. (Without a mount the store itself fails too, with EINVAL: its completion still runs.)"""
    from liquidfs.datapath.notifier import Notifier

    notifier = Notifier()
    seen: list[bool] = []

    async def scenario() -> None:
        called = trio.Event()

        def done(ok: bool) -> None:
            seen.append(ok)
            called.set()
            raise RuntimeError("a bug in a completion")

        notifier.store(1, 0, memoryview(b"x" * 4096), done)
        await called.wait()
        await trio.sleep(0.01)  # the loop is still alive after the callback raised

    trio.run(scenario)
    notifier.stop()
    assert seen == [False]
