"""The progress of long work on stderr: a bar where stderr is a terminal, a plain line now and then where it is not.

A bar redraws itself with carriage returns ten times a second: right on a terminal, a flood in a sidecar's or a
batch job's log, where each redraw is kept (and a log collector makes one record of each). There the work says
where it stands in a line every ``LINE_EVERY`` seconds and once at its end, as ``profile`` does.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO, Any, Self

#: Seconds between two lines where stderr is not a terminal.
LINE_EVERY = 30.0


class Progress:
    """``update(n)`` as work is done, ``close()`` (or the end of a ``with``) when it is.

    ``desc`` says what is done, ``unit`` of what (``"entries"``), ``total`` how much is to be done where that is
    known. ``delay``: nothing is shown before that many seconds, so short work says nothing. ``shown=False``:
    nothing is ever shown (``--no-progress``), the work counted all the same.
    """

    def __init__(self, desc: str, unit: str, *, total: int | None = None, initial: int = 0, delay: float = 0.0,
                 shown: bool = True, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.desc, self.unit, self.total = desc, unit, total
        self.done = initial
        self.started = time.monotonic()
        self.delay = delay if shown else float("inf")
        self._next_line = self.started + max(self.delay, LINE_EVERY)
        self._bar: Any = None
        if shown and _is_terminal(self.stream):
            from tqdm import tqdm  # here: work on a log, and short work, never loads it

            self._bar = tqdm(total=total, initial=initial, unit=f" {unit}", desc=desc, dynamic_ncols=True,
                             file=self.stream, delay=delay)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now >= self._next_line:
            self._say(now)
            self._next_line = now + LINE_EVERY

    def set_total(self, total: int) -> None:
        """The work turned out to be ``total`` (a refused image lowers how many prepare expands): shown with the
        next draw, and the bar of the work done is not left short of its end."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
        self.update(0)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            return
        now = time.monotonic()
        if now - self.started >= self.delay:
            self._say(now)
        self.delay = float("inf")  # said once: a second close says nothing

    def _say(self, now: float) -> None:
        of = f" of {self.total}" if self.total is not None else ""
        try:
            print(f"{self.desc}: {self.done}{of} {self.unit}, {now - self.started:.0f} s", file=self.stream,
                  flush=True)
        except OSError:  # a log whose reader has gone: the work goes on, saying nothing more
            self._next_line = self.delay = float("inf")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stream without a descriptor, or closed
        return False
