"""Where the FUSE loop's time goes, per request type: how many, their wall time, and (``mount --time-requests``)
the CPU each costs the loop itself.

A request's wall time includes its waits (a worker thread reading storage, other requests run between its
awaits); its loop CPU is the thread CPU time of its own steps only, measured around each resumption of its
coroutine (``on_loop_cpu``), so the CPU of the requests interleaved with it is not counted twice. Worker threads'
CPU is the process's less the loop's.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

R = TypeVar("R")


@dataclass(slots=True)
class RequestTimes:
    count: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the loop's CPU in this type's own steps (with --time-requests; else 0)


class _LoopCpu:
    """Awaits a coroutine, adding the thread CPU time of each of its steps to ``times.cpu_s``."""

    __slots__ = ("coro", "times")

    def __init__(self, coro: Coroutine[Any, Any, Any], times: RequestTimes) -> None:
        self.coro = coro
        self.times = times

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, times = self.coro, self.times
        value: Any = None
        error: BaseException | None = None
        while True:
            started = time.thread_time()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as done:
                return done.value
            finally:
                times.cpu_s += time.thread_time() - started
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # a cancellation, or an error the event loop throws in
                value, error = None, exc


def on_loop_cpu(coro: Coroutine[Any, Any, R], times: RequestTimes) -> Coroutine[Any, Any, R]:
    """``coro``, its steps' CPU time added to ``times``."""

    async def timed() -> R:
        result: R = await _LoopCpu(coro, times)
        return result

    return timed()
