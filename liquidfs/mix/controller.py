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

It does not oscillate: a first move, and any move that reverses the last one, needs the same verdict ``patience``
times in a row (hysteresis); a move on in the direction of the last one needs only one interval when the evidence
is strong (the two sides' pressures more than ``strong`` apart), since going on where the machine clearly asks
costs less than crawling. Each move is at most ``step``, which halves at each reversal (down to ``min_step``) and
grows back (up to ``max_step``) while moves keep one direction; a strongly asked move is at least the initial step
(halved steps are for settling near the balance, not for getting there). After ``settle`` intervals without a move
the share was right for the machine as it was: the next move starts afresh (the initial step, no direction), for
what asks for it now is a changed machine, not the last oscillation (a step halved while settling made the share
crawl for a whole phase of bench_adaptive after storage was capped). A move that made throughput fall by more than
``regret`` is undone once: the next move the same way, if the pressure still asks for it, stands. Throughput is
judged as the mean over ``patience`` intervals before the move against as many after it: a loader opens files in
bursts (DALI's opens per 5 s swung from 7 to 35 in one steady phase of bench_adaptive), so one interval against
one undid sound moves and halved the step each time; a fall counts only past twice the noise the rate showed
lately (its standard error over such a window), since with bursts that large even means of two intervals fall by
10 % half of the time; and the noise is known only after ``2 * patience + 1`` intervals (three had undone a sound
first move in bench_adaptive). Every decision carries its reason, for ``stats`` and the log.

When no pressure binds (both within ``deadband`` of each other and both below ``probe_below``), the pressures do
not tell which side of the balance is faster: both low, the loader waits on something else (augmentation, the
GPU, its own threads), and a DALI pipeline with augmentation held at 0.93 while 1.0 delivered 11 % more images/s
(issue 30). There the rate the loader draws is the signal, and the controller probes (``_probe_decision``): after
``probe_after`` such intervals in a row, and not while a move is being judged, it moves ``probe_step`` one way (the
other way than the last probe, the only way at a bound, never to a share a probe showed worse) and judges the
move with the noise rule above: the mean rate over the balanced intervals before the probe (the last
``probe_memory``) against the mean at the probe share, against twice the standard error of their difference (the
two sides' spread pooled). Lower by that much: back at once; halfway through ``probe_window`` intervals without a
sign of a gain: back; at the end of the window, kept when higher by that much, else back (a gain looked for every
interval showed up on a flat rate in a tenth of the probes, once in a fortieth). A probe not kept doubles the wait
before the next one (up to ``probe_max_wait``), so that probing costs a few percent of the rate over time; a kept
one resets it. A share a probe showed worse is remembered for ``forget_after`` intervals: when the pressure rule
leads back there and no pressure binds, the controller goes back to the better share within ``worse_limit``
intervals. A strong pressure verdict ends a probe (the pressure rule takes it from there) and forgets all that: the
machine changed; a weak one is ignored while probing. Probes are no moves of the pressure rule: its step,
direction and settling stay as they were. With both pressures high and even, both sides bind: that is the
balance itself, where a probe only loses, and none is made.

The pressure is what the kernel's stall counters grew by during the interval (``pressure.Stalls``), not its
``avg10``: a 10 s running average still shows, five seconds after a move, most of what the machine did before it.

Plain Python without a clock or a mount: tests drive it with simulated machines.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: Decisions kept (``MixController.decisions``): a day of the default 5 s interval's is 17,280.
DECISIONS_KEPT = 1024


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
class ShareDecision:
    share: float
    reason: str


@dataclass(slots=True)
class _Probe:
    """A probe in flight: from ``base`` to ``share``, the rate before it (mean, stdev, intervals) and since."""

    base: float
    share: float
    way: int
    before: float
    noise: float
    seen_before: int
    rates: list[float]
    kept_before: list[float]  # the balanced rates at the base, to go on with if the probe is undone


class MixController:
    def __init__(self, low: float, high: float, start: float | None = None, *, step: float = 0.1,
                 min_step: float = 0.0125, max_step: float = 0.2, deadband: float = 0.1, strong: float = 0.3,
                 patience: int = 2, settle: int | None = None, regret: float = 0.1, probe_step: float = 0.1,
                 probe_after: int = 6, probe_window: int = 8, probe_max_wait: int = 48, probe_memory: int = 24,
                 worse_limit: int = 24, forget_after: int = 120, probe_below: float = 0.4) -> None:
        if not 0 <= low <= high <= 1:
            raise ValueError(f"the range must be within [0, 1], got [{low}, {high}]")
        # At the 4 decimals every share is rounded to: a range end of more (`prepare --ratio 0.333333`) was never
        # reached by a rounded share, and "more raw" was said (and the step grown) at every interval at the top.
        # (rounded to 6 first: 0.57 * 10,000 is 5699.999...)
        self.low = math.ceil(round(low * 10_000, 6)) / 10_000
        self.high = math.floor(round(high * 10_000, 6)) / 10_000
        if self.low > self.high:  # a range narrower than the rounding: its one share
            self.low = self.high = round((low + high) / 2, 4)
        self.share = round(min(self.high, max(self.low, start if start is not None else (low + high) / 2)), 4)
        self.initial_step = self.step = step
        self.min_step = min_step
        self.max_step = max(max_step, step)
        self.deadband = deadband
        self.strong = strong
        self.patience = patience
        self.settle = settle if settle is not None else 4 * patience
        self.regret = regret
        self.probe_step = probe_step
        self.probe_after = max(2, probe_after)  # the noise needs two intervals at least
        self.probe_window = max(probe_window, patience)
        self.probe_max_wait = max(probe_max_wait, self.probe_after)
        self.worse_limit = max(worse_limit, self.probe_after)
        self.forget_after = forget_after
        self.probe_below = probe_below
        self._pending = 0          # the verdict seen last (+1 more raw, -1 fewer raw, 0 hold)
        self._streak = 0           # how many times in a row
        self._last_move = 0        # direction of the last move (0: none, or started afresh)
        # Whether the last move was asked for strongly, and whether a strong verdict has reversed a strong move
        # since the start (or the last fresh one): the balance lies between two shares the pressures part
        # steeply about, and the step is no longer put back to the initial one there (``_follow_pressure``).
        self._last_strong = False
        self._crossed_strong = False
        self._quiet = 0            # intervals since the last move
        # (share, mean images/s, its noise) before the last move; noise None: too little seen to judge it
        self._before_move: tuple[float, float, float | None] | None = None
        self._since_move: list[float] = []                   # images/s of the intervals since the last move
        self._history: deque[float] = deque(maxlen=4 * patience + 2)  # images/s of the last intervals
        # The direction of the last move undone for regret: the next move that way, if the pressure still asks
        # for it, is not undone again (a rate measured over one interval is noisy; the pressure is the signal).
        self._regretted = 0
        # Probing while balanced (issue 30)
        self._intervals = 0                                  # intervals observed so far (the controller's clock)
        self._at_share = 0                                   # intervals since the share last changed
        self._balanced = 0                                   # balanced verdicts in a row (outside probes)
        self._balanced_rates: deque[float] = deque(maxlen=max(probe_memory, self.probe_after))  # their rates
        self._probe_wait = self.probe_after                  # balanced intervals before the next probe
        self._probe_next = 1                                 # the way the next probe tries first
        self._probe: _Probe | None = None                    # the probe in flight
        self._worse: dict[float, tuple[float, int]] = {}     # share a probe showed worse: (better share, when)
        #: The last decisions (the stats' history; every one of a long mount was kept, 3 MB a day).
        self.decisions: deque[ShareDecision] = deque(maxlen=DECISIONS_KEPT)

    def observe(self, seen: Observation) -> ShareDecision:
        """The share to serve from now on, given what the last interval showed."""
        self._history.append(seen.images_per_s)
        self._quiet += 1
        self._intervals += 1
        self._at_share += 1
        self._worse = {share: seen_at for share, seen_at in self._worse.items()
                       if self._intervals - seen_at[1] <= self.forget_after}
        decision = self._undo_if_worse(seen)
        probed = False
        if decision is None:
            verdict, strong, why = self._verdict(seen)
            backfired = self._probe is not None and strong and verdict == -self._probe.way
            if strong and not backfired:
                # The machine changed: what probes learned of it is stale, and the next probe may come soon.
                self._worse.clear()
                self._probe_wait = self.probe_after
            low = max(cpu_signal(seen), seen.io_pressure) < self.probe_below
            probing = self._probe_decision(seen.images_per_s, verdict if low or verdict else None, strong)
            probed = probing is not None
            decision = probing or self._follow_pressure(verdict, strong, why)
        self.decisions.append(decision)
        if decision.share != self.share:
            log.info("mix: raw share %.3f -> %.3f (%s)", self.share, decision.share, decision.reason)
            if not probed:
                self._quiet = 0  # a probe is no move of the pressure rule: the share may still be settled
                self._balanced, self._balanced_rates = 0, deque(maxlen=self._balanced_rates.maxlen)
            self._at_share = 0
        self.share = decision.share
        return decision

    def _undo_if_worse(self, seen: Observation) -> ShareDecision | None:
        if self._before_move is None:
            return None
        self._since_move.append(seen.images_per_s)
        if len(self._since_move) < self.patience:
            return None  # judged over as many intervals as led to the move
        share, rate, _ = self._before_move
        fell = self._fell_since_move()
        self._before_move = None
        moved = self._last_move
        if fell and moved != self._regretted:
            self._regretted = moved
            # Back where it was, the step as it was: a move the pressure asks for again that way is a reversal
            # and halves it then; halving here too cut it by four for one undone move.
            self._last_move = -moved
            self._pending = self._streak = 0
            return ShareDecision(share, f"undone: {statistics.fmean(self._since_move):.1f} img/s after the move, "
                                   f"{rate:.1f} before")
        return None

    def _fell_since_move(self) -> bool:
        """Whether the rate since the last move fell below the rate before it by more than ``regret`` and the
        noise allow. False when there is nothing to judge, or too little was seen before the move to tell a loss
        from the noise (then the pressure decides)."""
        if self._before_move is None or not self._since_move:
            return False
        _, rate, noise = self._before_move
        if noise is None or rate <= 0:
            return False
        after = statistics.fmean(self._since_move)
        # twice the standard error of the difference of two means, over patience intervals and len(since) ones
        margin = max(rate * self.regret, 2 * noise * math.sqrt(1 / self.patience + 1 / len(self._since_move)))
        return after < rate - margin

    def _verdict(self, seen: Observation) -> tuple[int, bool, str]:
        """The pressures' verdict (+1 more raw, -1 fewer raw, 0 balanced), whether it is strong, and why."""
        cpu = cpu_signal(seen)
        gap = cpu - seen.io_pressure
        verdict = 0 if abs(gap) <= self.deadband else (1 if gap > 0 else -1)
        why = (f"cpu pressure {seen.cpu_pressure:.2f}, busy {seen.cpu_busy:.2f} -> {cpu:.2f}; "
               f"io {seen.io_pressure:.2f}")
        return verdict, verdict != 0 and abs(gap) >= self.strong, why

    def _follow_pressure(self, verdict: int, strong: bool, why: str) -> ShareDecision:
        self._streak = self._streak + 1 if verdict == self._pending else 1
        self._pending = verdict
        if verdict == 0:
            return ShareDecision(self.share, f"hold: balanced ({why})")
        # Settled a while, then a strong verdict: the machine changed (a weak one is the balance's own wobble).
        fresh = strong and self._quiet > self.settle and self._last_move != 0
        going_on = verdict == self._last_move and not fresh
        # On the way the last move went, strongly asked, and the rate did not fall since: no need to wait.
        needed = 1 if going_on and strong and not self._fell_since_move() else self.patience
        if self._streak < needed:
            return ShareDecision(self.share, f"hold: {'decode' if verdict > 0 else 'storage'} binds, waiting to be "
                                        f"sure ({why})")
        if fresh:
            # Settled for a while: the machine changed. Start as at first, not with the last oscillation's step,
            # nor with a regret of an old phase's (which kept every move that way from being undone).
            self.step, self._last_move, self._regretted = self.initial_step, 0, 0
            self._last_strong = self._crossed_strong = False
        at_the_bound = self.share >= self.high if verdict > 0 else self.share <= self.low
        if at_the_bound:
            return ShareDecision(self.share, f"hold: at the {'top' if verdict > 0 else 'bottom'} of the prepared "
                                        f"range ({why})")
        if verdict != self._regretted:
            self._regretted = 0  # a move the other way: a later regret may undo again
        if self._last_move and verdict != self._last_move:
            self._reverse()
            self._crossed_strong = self._crossed_strong or (strong and self._last_strong)
        elif self._last_move == verdict and self._quiet <= self.patience:
            # On the way, move after move: go faster, within a bound. (After a hold, the same way again is the
            # balance's wobble, not a way to go.)
            self.step = min(self.step * 1.5, self.max_step)
        if strong and self.step < self.initial_step and not self._crossed_strong:
            # Far from the balance (the pressures far apart): steps halved to settle near it would crawl here.
            # Not once strong verdicts crossed it both ways: where the pressures part steeply about the balance
            # every move near it is strong, and putting the step back swung the share across it for good
            # (0.475 <-> 0.575 every two intervals, the balance at 0.53). Moves on one way grow the step by half
            # each (up to max_step), so a machine that changed is not crawled after either.
            self.step = self.initial_step
        self._last_strong = strong
        target = min(self.high, max(self.low, self.share + verdict * self.step))
        self._last_move = verdict
        # the noise of the rate, once enough intervals were seen to tell it (fewer undid a sound first move)
        noise = statistics.stdev(self._history) if len(self._history) > 2 * self.patience else None
        # the rate of the intervals that led to the move (the last ``patience``)
        recent = list(self._history)[-self.patience:]
        self._before_move = (self.share, statistics.fmean(recent), noise)
        self._since_move = []
        self._streak = 0
        return ShareDecision(round(target, 4), f"{'more' if verdict > 0 else 'fewer'} raw: "
                                          f"{'decode' if verdict > 0 else 'storage'} binds ({why})"
                                          + ("; afresh after a settled while" if fresh else ""))

    def _probe_decision(self, rate: float, verdict: int | None, strong: bool) -> ShareDecision | None:
        """A probe's decision while no pressure binds (issue 30): start one, judge the one in flight, or go back
        from a share a probe showed worse. None: the pressure rule decides. ``verdict`` None: balanced with both
        pressures high (both sides bind: the balance itself, where a probe only loses)."""
        probe = self._probe
        if probe is not None:
            if strong and verdict == -probe.way:
                # The pressure the probe raised says back to where it came from: the probe share is worse, as a
                # fall of the rate would have shown (taken for a changed machine, the probe was tried again
                # every few intervals for good, a quarter of the time off the balance).
                self._end_probe(kept=False, worse=True)
                return ShareDecision(probe.base, f"probe undone: the pressure it raised says back to "
                                                 f"{probe.base:.2f}")
            if strong:
                # The machine changed under the probe: the pressure rule takes it from here, at the probe share.
                self._end_probe(kept=None)
                return None
            if verdict:
                self._pending = self._streak = 0  # a weak verdict is ignored while probing
            probe.rates.append(rate)
            return self._judge_probe(probe)
        if verdict != 0:  # a pressure binds (or both do): no probing
            self._balanced = 0
            self._balanced_rates.clear()
            worse = self._worse.get(self.share)
            if verdict is None and worse is not None and self._at_share >= self.worse_limit \
                    and self._before_move is None:
                # Balanced with both pressures high at a share a probe showed worse: no longer than worse_limit.
                return self._leave_worse(worse[0])
            return None
        self._balanced += 1
        self._balanced_rates.append(rate)
        if self._before_move is not None:
            return None  # a move of the pressure rule is being judged
        worse = self._worse.get(self.share)
        if worse is not None:
            better, _ = worse
            if self._balanced >= self.probe_after or self._at_share >= self.worse_limit:
                return self._leave_worse(better)
            return None
        if self._balanced < self._probe_wait:
            return None
        for way in (self._probe_next, -self._probe_next):
            target = round(min(self.high, max(self.low, self.share + way * self.probe_step)), 4)
            if target != self.share and target not in self._worse:
                break
        else:
            return None  # at a bound with the only way shown worse, or both ways shown worse: hold
        before = list(self._balanced_rates)
        self._probe = _Probe(self.share, target, way, statistics.fmean(before), statistics.stdev(before),
                             len(before), [], before)
        self._probe_next = -way
        self._pending = self._streak = 0
        return ShareDecision(target, f"probe: {'more' if way > 0 else 'fewer'} raw (balanced {self._balanced} "
                                     f"intervals; {self._probe.before:.1f} img/s before)")

    def _leave_worse(self, better: float) -> ShareDecision:
        """Back to ``better`` from a share a probe showed worse than it."""
        self._pending = self._streak = 0
        self._balanced, self._balanced_rates = 0, deque(maxlen=self._balanced_rates.maxlen)
        return ShareDecision(better, f"back: a probe showed {self.share:.2f} worse than {better:.2f} "
                                     f"({self._at_share} intervals here)")

    def _judge_probe(self, probe: _Probe) -> ShareDecision:
        """Back at once when the probe share's rate is lower than before by more than the noise allows; at the end
        of ``probe_window`` intervals, kept when it is higher by as much, else back. Judged after ``patience``
        intervals at the least, at once when the rate shows no noise at all (a steady rate: the means tell)."""
        after = statistics.fmean(probe.rates)
        seen = len(probe.rates)
        noise = probe.noise
        if seen >= 2:
            # The spread of the intervals before and of those since, pooled: more intervals tell the noise better
            # than the probe's first ones alone (a margin from six lucky intervals kept a probe on a flat rate).
            noise = math.sqrt(((probe.seen_before - 1) * probe.noise ** 2
                               + (seen - 1) * statistics.variance(probe.rates)) / (probe.seen_before + seen - 2))
        # twice the standard error of the difference of the two means
        margin = 2 * noise * math.sqrt(1 / probe.seen_before + 1 / seen)
        what = (f"{after:.1f} img/s at {probe.share:.2f} vs {probe.before:.1f} at {probe.base:.2f} "
                f"(margin {margin:.1f})")
        if seen < self.patience:
            return ShareDecision(probe.share, f"probing: {what}, {seen} of {self.probe_window} intervals")
        if after < probe.before - margin:
            self._end_probe(kept=False, worse=True)
            return ShareDecision(probe.base, f"probe undone: {what}")
        if seen >= self.probe_window / 2 and after <= probe.before and margin > 0:
            # Halfway through the window without a sign of a gain: one is unlikely to show by its end (half the
            # probes on a flat rate end here, and the probes' cost with them).
            self._end_probe(kept=False, worse=after < probe.before)
            return ShareDecision(probe.base, f"probe undone: {what}; no gain within {seen} intervals")
        if seen < self.probe_window and margin > 0:
            # A gain is judged once, at the end of the window: looked for every interval, the noise alone showed
            # one on a flat rate in about a tenth of the probes (a fortieth looked for once), and each moved the
            # share away for good.
            return ShareDecision(probe.share, f"probing: {what}, {seen} of {self.probe_window} intervals")
        if after > probe.before + margin:
            self._end_probe(kept=True)
            return ShareDecision(probe.share, f"probe kept: {what}")
        # Not shown better: back, for a share that is no better is not worth the risk of one that is worse. Below
        # the rate before, it counts as worse (no probe goes there for a while).
        self._end_probe(kept=False, worse=after < probe.before)
        return ShareDecision(probe.base, f"probe undone: {what}; not better within {seen} intervals")

    def _end_probe(self, kept: bool | None, worse: bool = False) -> None:
        """Done with the probe in flight: kept (True), undone (False, ``worse`` when its rate fell), or ended by a
        strong pressure (None)."""
        probe = self._probe
        assert probe is not None
        self._probe = None
        self._balanced = 0
        self._balanced_rates = deque(maxlen=self._balanced_rates.maxlen)
        if kept:
            self._worse[probe.base] = (probe.share, self._intervals)
            self._worse.pop(probe.share, None)
            self._probe_wait = self.probe_after
        elif kept is not None:
            if worse:
                self._worse[probe.share] = (probe.base, self._intervals)
            self._balanced_rates.extend(probe.kept_before)  # back at the base: what it showed still holds
            self._probe_wait = min(2 * self._probe_wait, self.probe_max_wait)

    def _reverse(self) -> None:
        self.step = max(self.min_step, self.step / 2)
        self._last_move = -self._last_move


#: CPU busy above this share of the time counts as pressure, reaching 1 when every core is busy all the time.
BUSY_FLOOR = 0.8


def cpu_signal(seen: Observation) -> float:
    """How much decoding binds (0..1): the CPU pressure, or the CPU's saturation if that says more."""
    saturation = min(1.0, max(0.0, (seen.cpu_busy - BUSY_FLOOR) / (1 - BUSY_FLOOR)))
    return max(seen.cpu_pressure, saturation)
