"""The controller of the adaptive mix (issue 16): which share of the images to serve raw, from what the node shows.

Serving an image raw saves its PNG decode (CPU) and costs ~2.5x its bytes (storage). The best share is where
neither side waits for the other, and it moves when the machine does (another job takes cores, storage slows
down). The controller sees, every ``interval`` seconds, an ``Observation``: the images per second the mount
served, the bytes per second it took from storage, and the kernel's pressure stall information for CPU and IO
(the share of time some task waited for that resource: ``/proc/pressure/*`` or the cgroup's). It answers with a
share within ``[low, high]`` (what ``prepare`` expanded), moving towards the side that does not bind:

* CPU stalls clearly more than IO: decoding binds, serve more raw (less decode);
* IO stalls clearly more than CPU: storage binds, serve fewer raw (fewer bytes);
* otherwise (within ``deadband``) it holds: the balance is near.

It does not oscillate: a move needs the same verdict ``patience`` times in a row (hysteresis), each move is at
most ``step`` and halves each time the direction reverses (down to ``min_step``), and grows back only while
moves keep the same direction. A move that made throughput fall by more than ``regret`` is undone once: the
next move the same way, if the pressure still asks for it, stands. Throughput is judged as the mean over
``patience`` intervals before the move against as many after it: a loader opens files in bursts (DALI's opens
per 5 s swung from 7 to 35 in one steady phase of bench_adaptive), so one interval against one undid sound moves
and halved the step each time; and a fall counts only past twice the noise the rate showed lately (its standard
error over such a window), since with bursts that large even means of two intervals fall by 10 % half of the
time. Every decision carries its reason, for ``stats`` and the log.

Plain Python without a clock or a mount: tests drive it with simulated machines.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Observation:
    images_per_s: float
    storage_bytes_per_s: float
    cpu_pressure: float  # share of the interval some task waited for a CPU (0..1)
    io_pressure: float   # share of the interval some task waited for IO (0..1)
    #: Share of the CPU time that was busy (0..1). A decoder with as many threads as cores keeps every core busy
    #: without any task waiting for one, so CPU pressure alone misses that decoding binds: a saturated CPU counts
    #: as CPU pressure too (``cpu_signal``).
    cpu_busy: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    share: float
    reason: str


class MixController:
    def __init__(self, low: float, high: float, start: float | None = None, *, step: float = 0.1,
                 min_step: float = 0.0125, deadband: float = 0.1, patience: int = 2, regret: float = 0.1) -> None:
        if not 0 <= low <= high <= 1:
            raise ValueError(f"the range must be within [0, 1], got [{low}, {high}]")
        self.low, self.high = low, high
        self.share = min(high, max(low, start if start is not None else (low + high) / 2))
        self.step = step
        self.min_step = min_step
        self.deadband = deadband
        self.patience = patience
        self.regret = regret
        self._pending = 0          # the verdict seen last (+1 more raw, -1 fewer raw, 0 hold)
        self._streak = 0           # how many times in a row
        self._last_move = 0        # direction of the last move
        # (share, mean images/s, its noise) before the last move; noise None: too little seen to judge it
        self._before_move: tuple[float, float, float | None] | None = None
        self._since_move: list[float] = []                   # images/s of the intervals since the last move
        self._history: deque[float] = deque(maxlen=4 * patience + 2)  # images/s of the last intervals
        # The direction of the last move undone for regret: the next move that way, if the pressure still asks
        # for it, is not undone again (a rate measured over one interval is noisy; the pressure is the signal).
        self._regretted = 0
        self.decisions: list[Decision] = []

    def observe(self, seen: Observation) -> Decision:
        """The share to serve from now on, given what the last interval showed."""
        self._history.append(seen.images_per_s)
        decision = self._undo_if_worse(seen) or self._follow_pressure(seen)
        self.decisions.append(decision)
        if decision.share != self.share:
            log.info("mix: raw share %.3f -> %.3f (%s)", self.share, decision.share, decision.reason)
        self.share = decision.share
        return decision

    def _undo_if_worse(self, seen: Observation) -> Decision | None:
        if self._before_move is None:
            return None
        self._since_move.append(seen.images_per_s)
        if len(self._since_move) < self.patience:
            return None  # judged over as many intervals as led to the move
        share, rate, noise = self._before_move
        after = statistics.fmean(self._since_move)
        self._before_move = None
        moved = self._last_move
        if noise is None:
            return None  # too little seen before the move to tell a loss from the noise: the pressure decides
        margin = max(rate * self.regret, 2 * noise * (2 / self.patience) ** 0.5)  # the standard error of a difference
        if rate > 0 and after < rate - margin and moved != self._regretted:
            self._regretted = moved
            self._reverse()
            self._pending = self._streak = 0
            return Decision(share, f"undone: {after:.1f} img/s after the move, {rate:.1f} before")
        return None

    def _follow_pressure(self, seen: Observation) -> Decision:
        cpu = cpu_signal(seen)
        gap = cpu - seen.io_pressure
        verdict = 0 if abs(gap) <= self.deadband else (1 if gap > 0 else -1)
        self._streak = self._streak + 1 if verdict == self._pending else 1
        self._pending = verdict
        why = (f"cpu pressure {seen.cpu_pressure:.2f}, busy {seen.cpu_busy:.2f} -> {cpu:.2f}; "
               f"io {seen.io_pressure:.2f}")
        if verdict == 0:
            return Decision(self.share, f"hold: balanced ({why})")
        if self._streak < self.patience:
            return Decision(self.share, f"hold: {'decode' if verdict > 0 else 'storage'} binds, waiting to be "
                                        f"sure ({why})")
        target = min(self.high, max(self.low, self.share + verdict * self.step))
        if target == self.share:
            return Decision(self.share, f"hold: at the {'top' if verdict > 0 else 'bottom'} of the prepared "
                                        f"range ({why})")
        if verdict != self._regretted:
            self._regretted = 0  # a move the other way: a later regret may undo again
        if self._last_move and verdict != self._last_move:
            self._reverse()
            target = min(self.high, max(self.low, self.share + verdict * self.step))
        elif self._last_move == verdict:
            self.step = min(self.step * 1.5, 0.2)  # still the same way: go faster, within a bound
        self._last_move = verdict
        noise = statistics.stdev(self._history) if len(self._history) >= 3 else None
        # the rate of the intervals that led to the move (the last ``patience``)
        recent = list(self._history)[-self.patience:]
        self._before_move = (self.share, statistics.fmean(recent), noise)
        self._since_move = []
        self._streak = 0
        return Decision(round(target, 4), f"{'more' if verdict > 0 else 'fewer'} raw: "
                                          f"{'decode' if verdict > 0 else 'storage'} binds ({why})")

    def _reverse(self) -> None:
        self.step = max(self.min_step, self.step / 2)
        self._last_move = -self._last_move


#: CPU busy above this share of the time counts as pressure, reaching 1 when every core is busy all the time.
BUSY_FLOOR = 0.8


def cpu_signal(seen: Observation) -> float:
    """How much decoding binds (0..1): the CPU pressure, or the CPU's saturation if that says more."""
    saturation = min(1.0, max(0.0, (seen.cpu_busy - BUSY_FLOOR) / (1 - BUSY_FLOOR)))
    return max(seen.cpu_pressure, saturation)


class CpuBusy:
    """The share of CPU time that was busy since the previous call: a cgroup v2 group's (its ``cpu.stat``
    ``usage_usec`` over the cores it may use) when ``where`` holds one, else the node's (``/proc/stat``; time
    waiting for IO counts as idle). None where it cannot be read."""

    def __init__(self, where: Path = Path("/proc/pressure"), proc_stat: Path = Path("/proc/stat"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.group_stat = where / "cpu.stat"
        self.proc_stat = proc_stat
        self.clock = clock
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._last = self._sample()

    def _sample(self) -> tuple[float, float] | None:
        """(busy seconds, total seconds) so far, as counters."""
        try:
            if self.group_stat.exists():
                fields = dict(line.split() for line in self.group_stat.read_text().splitlines() if line.strip())
                return int(fields["usage_usec"]) / 1e6, self.clock() * self.cores
            ticks = [int(v) for v in self.proc_stat.read_text().split("\n", 1)[0].split()[1:9]]
        except (OSError, ValueError, KeyError) as exc:
            log.debug("cpu busy: %s", exc)
            return None
        idle = ticks[3] + ticks[4]  # idle, iowait
        return float(sum(ticks) - idle), float(sum(ticks))

    def __call__(self) -> float | None:
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1]:
            return None
        return min(1.0, max(0.0, (now[0] - last[0]) / (now[1] - last[1])))


def read_pressure(text: str) -> float:
    """The ``some avg10`` of a pressure file (``/proc/pressure/cpu``, a cgroup's ``cpu.pressure``), as 0..1."""
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            return float(fields.get("avg10", 0.0)) / 100
    raise ValueError("no 'some' line in a pressure file")


def node_pressure(kind: str, root: Path = Path("/proc/pressure")) -> float | None:
    """The pressure for ``kind`` (cpu, io) in ``root``: the node's (``/proc/pressure/cpu``) or a cgroup v2
    group's (``/sys/fs/cgroup/GROUP/cpu.pressure``); None where the kernel has no PSI."""
    path = root / kind
    if not path.exists():
        path = root / f"{kind}.pressure"
    try:
        return read_pressure(path.read_text())
    except (OSError, ValueError) as exc:
        log.debug("no %s pressure in %s: %s", kind, root, exc)
        return None
