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


def test_stop_sends_nothing_more_and_waits_for_the_call_under_way(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A long queue (a pushed file each) was still being sent after stop's wait, as the session closed: a call
    after ``pyfuse3.close`` uses the session it frees. At stop, what is queued is dropped; the call under way
    ends on its own."""
    import threading

    import pyfuse3

    from liquidfs.datapath import notifier as notifier_module

    entered, release = threading.Event(), threading.Event()
    sent: list[int] = []

    def invalidate(inode: int, attr_only: bool = False) -> None:
        sent.append(inode)
        entered.set()
        release.wait(30)

    monkeypatch.setattr(pyfuse3, "invalidate_inode", invalidate)
    monkeypatch.setattr(notifier_module, "STOP_WAIT", 0.05)
    notifier = notifier_module.Notifier()
    for inode in range(100):
        notifier.invalidate(inode)
    assert entered.wait(30)
    notifier.stop()  # the first call is under way: stop's wait runs out
    notifier.invalidate(1000)  # after stop: never queued
    release.set()
    assert notifier._thread is not None
    notifier._thread.join(30)
    assert not notifier._thread.is_alive() and sent == [0]
