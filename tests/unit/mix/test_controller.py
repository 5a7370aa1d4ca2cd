"""The adaptive mix's controller on simulated machines: it converges, holds still, keeps to the prepared range and
follows a change of the machine (issue 16). No mount, no clock."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from liquidfs.mix.controller import MixController, Observation


@dataclass
class Machine:
    """A loader on ``cores`` cores reading from storage of ``io_bw`` bytes/s: PNG decodes cost ``d_png`` CPU-s and
    ``b_png`` bytes, raw ones ``d_raw`` and ``b_raw``. Each interval, the side that binds stalls."""

    cores: float = 2.0
    io_bw: float = 900e6
    d_png: float = 0.045
    d_raw: float = 0.009
    b_png: float = 2.5e6
    b_raw: float = 6.3e6
    noise: float = 0.03

    def rate(self, r: float) -> float:
        cpu = r * self.d_raw + (1 - r) * self.d_png
        size = r * self.b_raw + (1 - r) * self.b_png
        return min(self.cores / cpu, self.io_bw / size)

    def best(self, low: float = 0.0, high: float = 1.0) -> tuple[float, float]:
        grid = [low + (high - low) * i / 1000 for i in range(1001)]
        top = max(grid, key=self.rate)
        return top, self.rate(top)

    def observe(self, r: float, rng: random.Random) -> Observation:
        rate = self.rate(r)
        cpu_util = rate * (r * self.d_raw + (1 - r) * self.d_png) / self.cores
        io_util = rate * (r * self.b_raw + (1 - r) * self.b_png) / self.io_bw

        def pressure(util: float) -> float:  # waiting starts as a resource nears saturation
            return max(0.0, min(1.0, 2.0 * (util - 0.7) + rng.gauss(0, self.noise)))

        return Observation(rate * (1 + rng.gauss(0, self.noise)), rate * (r * self.b_raw + (1 - r) * self.b_png),
                           pressure(cpu_util), pressure(io_util))


def run(controller: MixController, machine: Machine, steps: int, rng: random.Random) -> list[float]:
    shares = []
    for _ in range(steps):
        controller.observe(machine.observe(controller.share, rng))
        shares.append(controller.share)
    return shares


def reversals(shares: list[float]) -> int:
    moves = [b - a for a, b in zip(shares, shares[1:]) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))


@pytest.mark.parametrize("io_bw", [300e6, 600e6, 900e6, 2000e6])
@pytest.mark.parametrize("start", [0.0, 0.5, 1.0])
def test_it_converges_within_two_minutes_of_5_s_intervals(io_bw: float, start: float) -> None:
    machine = Machine(io_bw=io_bw)
    best_share, best_rate = machine.best()
    controller = MixController(0.0, 1.0, start)
    shares = run(controller, machine, 24, random.Random(1))
    assert machine.rate(shares[-1]) >= 0.95 * best_rate, (shares, best_share)


@pytest.mark.parametrize("seed", range(5))
def test_once_there_it_holds_still(seed: int) -> None:
    machine = Machine(io_bw=700e6)
    controller = MixController(0.0, 1.0, 0.5)
    rng = random.Random(seed)
    run(controller, machine, 24, rng)
    later = run(controller, machine, 60, rng)
    _, best_rate = machine.best()
    assert max(later) - min(later) <= 0.1, later
    assert reversals(later) <= 4, later
    assert min(machine.rate(r) for r in later) >= 0.93 * best_rate


def test_it_never_leaves_the_prepared_range() -> None:
    machine = Machine(io_bw=5000e6)  # decode binds everywhere: all raw would be best, 0.6 was prepared
    controller = MixController(0.2, 0.6, 0.3)
    shares = run(controller, machine, 40, random.Random(2))
    assert all(0.2 <= r <= 0.6 for r in shares) and shares[-1] == 0.6
    machine = Machine(io_bw=50e6)  # storage binds everywhere: as few raw as prepared allows
    shares = run(controller, machine, 40, random.Random(3))
    assert all(0.2 <= r <= 0.6 for r in shares) and shares[-1] == 0.2


def test_it_follows_the_machine_when_storage_slows_down_and_recovers() -> None:
    machine = Machine(io_bw=1500e6)
    controller = MixController(0.0, 1.0, 0.5)
    rng = random.Random(4)
    run(controller, machine, 24, rng)
    machine.io_bw = 200e6  # a checkpoint storm: storage capped
    slow = run(controller, machine, 24, rng)
    assert machine.rate(slow[-1]) >= 0.95 * machine.best()[1]
    machine.io_bw = 1500e6
    fast = run(controller, machine, 24, rng)
    assert machine.rate(fast[-1]) >= 0.95 * machine.best()[1]


def test_every_decision_says_why() -> None:
    controller = MixController(0.0, 1.0, 0.5)
    run(controller, Machine(io_bw=300e6), 6, random.Random(5))
    assert all(d.reason for d in controller.decisions)
    assert any("storage binds" in d.reason for d in controller.decisions)


def test_a_noisy_rate_does_not_stall_a_move_the_pressure_keeps_asking_for() -> None:
    """Storage clearly binds, but the rate measured over one interval jumps around: a move is undone for regret
    at most once per direction, so the share still walks down to where storage stops binding."""
    controller = MixController(0.0, 1.0, start=1.0, step=0.1, patience=2)
    rate = 240.0
    for _ in range(80):
        before = controller.share
        controller.observe(Observation(rate, 0.0, cpu_pressure=0.02, io_pressure=0.8))
        rate = 160.0 if controller.share != before else 240.0  # the worst noise: every move looks like a loss
    undone = [d for d in controller.decisions if d.reason.startswith("undone")]
    assert controller.share <= 0.3
    assert len(undone) <= 2


@pytest.mark.parametrize("seed", range(5))
def test_bursty_opens_do_not_undo_a_move_decoding_asks_for(seed: int) -> None:
    """Decoding binds (every core busy) and the loader opens files in bursts: 7 to 35 opens in one 5 s interval
    and the next, whatever the share (as DALI did in bench_adaptive). Judged over as many intervals as led to
    a move and against the noise the rate shows, such noise undoes no move, and the share reaches the top
    within about two minutes."""
    rng = random.Random(seed)
    controller = MixController(0.0, 1.0, start=0.5, step=0.1, patience=2)
    for interval in range(24):  # 2 minutes of 5 s intervals
        controller.observe(Observation(rng.uniform(7, 35), 0.0, cpu_pressure=0.08, io_pressure=0.03,
                                       cpu_busy=0.95))
        if controller.share == 1.0:
            break
    assert controller.share == 1.0, [d.reason for d in controller.decisions]
    assert not [d for d in controller.decisions if d.reason.startswith("undone")]


def test_a_move_that_really_costs_throughput_is_undone() -> None:
    """The pressure asks for more raw, but every share above 0.5 runs at 60 % of the rate (the pressure
    misleads): that loss stands out of the noise, and the move is undone."""
    rng = random.Random(1)
    controller = MixController(0.0, 1.0, start=0.5, step=0.1, patience=2)
    for interval in range(10):
        rate = (100.0 if controller.share <= 0.5 else 60.0) * rng.uniform(0.95, 1.05)
        busy = 0.5 if interval < 4 else 0.95  # balanced for 20 s (the noise is seen), then decoding binds
        controller.observe(Observation(rate, 0.0, cpu_pressure=0.08, io_pressure=0.03, cpu_busy=busy))
    undone = [d for d in controller.decisions if d.reason.startswith("undone")]
    assert len(undone) == 1 and undone[0].share == 0.5, [d.reason for d in controller.decisions]


def test_a_changed_machine_is_followed_at_full_step_after_a_settled_while() -> None:
    """Session 9's bench: an early undo and a wobble had cut the step to its floor, the share then sat still at
    the top for a minute, and when storage was capped it crawled down at 0.0125 a move. Settled a while, a strong
    verdict starts afresh: from 0.95 to below 0.4 within ten 5 s intervals."""
    controller = MixController(0.0, 1.0, start=0.95, step=0.1, patience=2)
    controller.step = controller.min_step  # as the wobble left it
    controller._last_move = 1
    controller._regretted = -1  # an early move down undone: not held against this phase's moves down
    for _ in range(12):  # a minute settled (balanced)
        controller.observe(Observation(80, 0.0, cpu_pressure=0.1, io_pressure=0.05, cpu_busy=0.5))
    assert controller.share == 0.95
    for interval in range(10):
        controller.observe(Observation(30, 0.0, cpu_pressure=0.05, io_pressure=0.55, cpu_busy=0.3))
    assert controller.share < 0.4, [d.reason for d in controller.decisions]
    # the first move after the change (the settled minute, balanced with the pressures low, had a probe: issue 30)
    assert "afresh" in next(d.reason for d in list(controller.decisions)[12:] if d.share != 0.95)
    assert controller._regretted == 0  # a move down that costs throughput may be undone again


def test_a_weak_verdict_after_a_settled_while_keeps_the_small_step() -> None:
    """Near the balance the pressures differ a little now and then: that is no changed machine, and the step it
    moves by stays what the settling left."""
    controller = MixController(0.0, 1.0, start=0.8, step=0.1, patience=2)
    controller.step = 0.025
    controller._last_move = 1
    for _ in range(12):
        controller.observe(Observation(80, 0.0, cpu_pressure=0.5, io_pressure=0.5))
    for _ in range(2):
        controller.observe(Observation(80, 0.0, cpu_pressure=0.65, io_pressure=0.5))  # gap 0.15: weak
    assert controller.share == pytest.approx(0.825)


def test_strong_pressure_moves_every_interval_while_the_rate_holds() -> None:
    """Confirmed once, a strong verdict the same way moves again after one interval (not two): the way down from
    all raw under a storage cap takes half the time."""
    controller = MixController(0.0, 1.0, start=1.0, step=0.1, patience=2)
    for _ in range(6):
        controller.observe(Observation(30, 0.0, cpu_pressure=0.05, io_pressure=0.6))
    moves = [d for d in controller.decisions if d.reason.startswith("fewer raw")]
    assert len(moves) == 5 and controller.share <= 0.35, [d.reason for d in controller.decisions]


def test_a_first_move_is_not_undone_on_three_intervals_of_history() -> None:
    """Session 9's bench undid its first move (0.93 -> 1.0) on a rate seen over three intervals (87.5 img/s
    before, 73.3 after: a burst, not a loss), which also halved the step. Too little history tells no noise."""
    controller = MixController(0.0, 1.0, start=0.93, step=0.1, patience=2)
    controller.observe(Observation(83.2, 0.0, cpu_pressure=0.16, io_pressure=0.09, cpu_busy=0.56))  # balanced
    for rate in (92.8, 82.2, 61.6, 85.0, 66.6):  # decoding binds: the move comes after the third interval
        controller.observe(Observation(rate, 0.0, cpu_pressure=0.19, io_pressure=0.05, cpu_busy=0.93))
    assert not [d for d in controller.decisions if d.reason.startswith("undone")]
    assert controller.share == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_a_capped_storage_is_followed_down_and_back_up_within_a_minute(seed: int) -> None:
    """bench_adaptive's storage scenario as a simulated machine (2 cores; PNG 0.05 CPU-s and 3 MB an image, raw
    0.022 CPU-s and 7 MB): from the profile's 0.93, storage capped at 200 MB/s makes ~0.3 best, lifted 1.0 again.
    Within a minute (twelve 5 s intervals) of each change the rate is within 5 % of the best, and it stays near:
    from then on 5 % below it on average, never 10 %."""
    machine = Machine(cores=2, io_bw=2000e6, d_png=0.05, d_raw=0.022, b_png=3e6, b_raw=7e6)
    rng = random.Random(seed)
    controller = MixController(0.0, 1.0, 0.93)
    for io_bw in (2000e6, 200e6, 2000e6):
        machine.io_bw = io_bw
        _, best = machine.best()
        shares = run(controller, machine, 30, rng)
        rates = [machine.rate(r) / best for r in shares]
        assert max(rates[:12]) >= 0.95, (io_bw, shares)
        assert statistics.fmean(rates[12:]) >= 0.95 and min(rates[12:]) >= 0.9, (io_bw, shares)


def test_a_strong_verdict_moves_at_least_the_initial_step() -> None:
    """A first bench run of this controller: storage capped, the share wobbled near 0.37 and halved its step to
    0.0375; fifteen seconds later the cap was lifted, and with decoding clearly binding (busy 0.93, io 0.04) the
    way back up began at 0.0375 a move. Far from the balance, halved steps are of no use."""
    controller = MixController(0.0, 1.0, start=0.37, step=0.1, patience=2)
    controller.step, controller._last_move = 0.0375, -1
    for _ in range(2):
        controller.observe(Observation(47, 0.0, cpu_pressure=0.1, io_pressure=0.04, cpu_busy=0.93))
    assert controller.share == pytest.approx(0.47)


# Probing while balanced (issue 30): pressures both low tell nothing of which share delivers more.

def _balanced(rate: float) -> Observation:
    """An interval in which no pressure binds (DALI with augmentation: CPU half busy, little stall anywhere)."""
    return Observation(rate, 0.0, cpu_pressure=0.1, io_pressure=0.05, cpu_busy=0.5)


def _drive(controller: MixController, rate: Callable[[float], float], steps: int, rng: random.Random,
           noise: float = 0.1) -> list[float]:
    """The shares served over ``steps`` balanced intervals, the rate each delivered ``rate(share)`` with gaussian
    noise of ``noise`` of it."""
    shares = []
    for _ in range(steps):
        controller.observe(_balanced(rate(controller.share) * (1 + rng.gauss(0, noise))))
        shares.append(controller.share)
    return shares


def _longest_run(shares: list[float], away_from: float) -> int:
    longest = run_ = 0
    for share in shares:
        run_ = run_ + 1 if share != away_from else 0
        longest = max(longest, run_)
    return longest


@pytest.mark.parametrize("seed", range(5))
def test_balanced_it_probes_its_way_to_the_share_that_delivers_more(seed: int) -> None:
    """The DALI pipeline of issue 30: pressures balanced (both low) at every share, and 1.0 delivers 11 % more
    images/s than 0.9, the rate of an interval swinging by 10 %. From 0.9 the controller probes, keeps 1.0, and
    serves it at least 80 % of the last 100 intervals (before probing, it held at 0.9 for good)."""
    controller = MixController(0.0, 1.0, 0.9)
    shares = _drive(controller, lambda r: 100 * (1 + 1.1 * (r - 0.9)), 360, random.Random(seed))
    assert shares[-1] == 1.0, [d.reason for d in controller.decisions if d.reason.startswith("probe")]
    assert sum(r == 1.0 for r in shares[-100:]) >= 80
    kept = [d.reason for d in controller.decisions if d.reason.startswith("probe kept")]
    assert kept and "at 1.00" in kept[-1]


@pytest.mark.parametrize("seed", range(5))
def test_probes_around_the_best_share_cost_a_few_percent(seed: int) -> None:
    """Balanced, the rate peaks at the start share and each neighbour delivers 8 % less, 10 % noise: over 50 min
    of 5 s intervals the share is elsewhere at most 15 % of the intervals, never more than two minutes in a row,
    and the rate delivered is within 3 % of the peak's."""
    def rate(r: float) -> float:
        return 100 * (1 - 0.8 * abs(r - 0.5))
    controller = MixController(0.0, 1.0, 0.5)
    shares = _drive(controller, rate, 600, random.Random(seed))
    assert any(d.reason.startswith("probe:") for d in controller.decisions)  # it did probe
    assert sum(r != 0.5 for r in shares) <= 0.15 * len(shares)
    assert _longest_run(shares, 0.5) <= 24
    assert statistics.fmean(rate(r) for r in shares) >= 0.97 * rate(0.5)


def test_a_flat_rate_does_not_make_the_share_drift() -> None:
    """Balanced, every share delivers the same, 10 % noise: probes find nothing to keep, as a rule. The noise can
    still pass for a gain now and then (about one probe in forty), so this is judged over twenty 30 min runs:
    three in four stay at the start at least 70 % of the time and end within 0.1 of it, at most one wanders
    further than 0.2, and the share is at the start 75 % of the time over all of them."""
    at_start, good, far = [], 0, 0
    for seed in range(20):
        controller = MixController(0.0, 1.0, 0.5)
        shares = _drive(controller, lambda r: 100.0, 360, random.Random(seed))
        assert any(d.reason.startswith("probe:") for d in controller.decisions)
        far += any(abs(r - 0.5) > 0.2 + 1e-9 for r in shares)
        at_start.append(sum(r == 0.5 for r in shares) / len(shares))
        good += at_start[-1] >= 0.7 and abs(shares[-1] - 0.5) <= 0.1 + 1e-9
    assert good >= 15 and far <= 1, at_start
    assert statistics.fmean(at_start) >= 0.75, at_start


def _probing(seed: int = 7) -> MixController:
    """A controller balanced at 0.5 until its first probe (to 0.6, more raw) starts."""
    controller = MixController(0.0, 1.0, 0.5)
    rng = random.Random(seed)
    for _ in range(12):
        controller.observe(_balanced(100 * (1 + rng.gauss(0, 0.1))))
        if controller.decisions[-1].reason.startswith("probe:"):
            break
    assert controller.share == 0.6
    return controller


def test_a_strong_pressure_the_probes_way_ends_it_and_the_pressure_rule_moves() -> None:
    """Decoding clearly binds in the middle of a probe to more raw (the machine changed): the probe ends where it
    is, and the pressure rule moves on as it would have (after ``patience`` intervals, more raw); a weak verdict
    before it was ignored."""
    controller = _probing()
    controller.observe(Observation(100, 0.0, cpu_pressure=0.1, io_pressure=0.3, cpu_busy=0.5))  # weak: ignored
    assert controller.share == 0.6 and controller.decisions[-1].reason.startswith("probing")
    for _ in range(2):
        controller.observe(Observation(60, 0.0, cpu_pressure=0.6, io_pressure=0.05, cpu_busy=0.9))
    reasons = [d.reason for d in list(controller.decisions)[-2:]]
    assert reasons[0].startswith("hold: decode binds") and reasons[1].startswith("more raw"), reasons
    assert controller.share == pytest.approx(0.7)
    assert controller._probe is None


def test_a_strong_pressure_back_to_the_probes_base_undoes_it_as_worse() -> None:
    """Storage clearly binds once a probe moved to more raw: the probe raised it, and the share it left is the
    better one. Taken for a changed machine, the probe ended, what probes had shown worse was forgotten and the
    next probe came as soon as ever: where the pressures part steeply about the balance, a quarter of the time
    went to the same probe again and again. Undone as worse: back at once, and not probed again soon."""
    controller = _probing()
    wait = controller._probe_wait
    controller.observe(Observation(60, 0.0, cpu_pressure=0.05, io_pressure=0.6, cpu_busy=0.3))
    assert controller.share == 0.5 and controller.decisions[-1].reason.startswith("probe undone")
    assert controller._probe is None and 0.6 in controller._worse and controller._probe_wait == 2 * wait


def test_pressures_that_part_steeply_about_the_balance_let_the_share_settle() -> None:
    """Every move near such a balance is strong, and a strong verdict put the halved step back: the share swung
    across the balance for good (0.475 <-> 0.575 every two intervals, the balance at 0.53; 0.3875 -> 0.5375 and
    back at 0.47). Once strong verdicts crossed it both ways the steps only shrink: from any start, the share
    stays within two of the smallest steps of the balance (the reviewers' model of such a machine)."""
    worst = 0.0
    for start in [i / 10 for i in range(11)]:
        for balance in (0.47, 0.53, 0.55, 0.61):
            for steep in (10, 20, 40):
                controller = MixController(0.0, 1.0, start)
                shares = []
                for _ in range(400):
                    share = controller.share
                    gap = steep * (balance - share)
                    cpu, io = min(1, max(0, 0.5 + gap)), min(1, max(0, 0.5 - gap))
                    controller.observe(Observation(1000 * (1 - abs(share - balance)), 1e8, cpu, io, 0.0))
                    shares.append(share)
                worst = max(worst, max(abs(s - balance) for s in shares[300:]))
    assert worst <= 2 * MixController(0.0, 1.0, 0.5).min_step, worst


def test_a_share_a_probe_showed_worse_is_left_within_two_minutes() -> None:
    """A probe showed 0.6 worse than 0.5 (5 % less; too little for the regret rule). A weak pressure then leads
    there: balanced again, the controller goes back to 0.5 within 24 intervals."""
    def rate(r: float) -> float:
        return 100.0 if r <= 0.5 else 95.0
    controller = MixController(0.0, 1.0, 0.5)
    rng = random.Random(3)
    _drive(controller, rate, 12, rng, noise=0.01)
    assert any(d.reason.startswith("probe undone") and "at 0.60" in d.reason for d in controller.decisions)
    assert controller.share == 0.5
    for _ in range(2):  # decoding binds a little: the pressure rule moves to 0.6
        controller.observe(Observation(rate(controller.share), 0.0, cpu_pressure=0.25, io_pressure=0.05))
    assert controller.share == 0.6
    shares = _drive(controller, rate, 24, rng, noise=0.01)
    assert shares[-1] == 0.5 and _longest_run(shares, 0.5) <= 24
    assert any(d.reason.startswith("back:") for d in controller.decisions)


def test_a_share_shown_worse_is_left_within_two_minutes_with_both_pressures_high_too() -> None:
    """As above, but once at 0.6 both pressures read high and even (balanced, no probing there): the controller
    still goes back to 0.5 within 24 intervals (two minutes at 5 s)."""
    def rate(r: float) -> float:
        return 100.0 if r <= 0.5 else 95.0
    controller = MixController(0.0, 1.0, 0.5)
    rng = random.Random(3)
    _drive(controller, rate, 12, rng, noise=0.01)
    assert controller.share == 0.5
    for _ in range(2):
        controller.observe(Observation(rate(controller.share), 0.0, cpu_pressure=0.25, io_pressure=0.05))
    assert controller.share == 0.6
    shares = []
    for _ in range(30):
        controller.observe(Observation(rate(controller.share), 0.0, cpu_pressure=0.6, io_pressure=0.6))
        shares.append(controller.share)
    assert 0.5 in shares and shares.index(0.5) < 24 and shares[-1] == 0.5, shares
    assert any(d.reason.startswith("back:") for d in controller.decisions)


def test_a_range_end_of_more_decimals_than_a_share_is_reached_and_held_there() -> None:
    """`prepare --ratio 0.333333`: the shares are rounded to 4 decimals, so the top was never reached; every
    interval said "more raw" without a move, and grew the step. The range is taken at that rounding."""
    controller = MixController(0.0, 0.333333, 0.3)
    decode_binds = Observation(100, 0.0, cpu_pressure=0.9, io_pressure=0.0, cpu_busy=1.0)
    for _ in range(6):
        controller.observe(decode_binds)
    assert controller.share == 0.3333
    assert all(d.reason.startswith("hold: at the top") for d in list(controller.decisions)[-3:])


def test_a_range_of_few_decimals_is_taken_as_it_is() -> None:
    for end in (0.07, 0.14, 0.17, 0.28, 0.34, 0.56, 0.57, 0.68, 0.69, 0.81):  # end * 10,000 is no whole number
        assert MixController(0.0, end).high == end and MixController(end, 1.0).low == end


def test_the_decisions_kept_are_bounded() -> None:
    from liquidfs.mix.controller import DECISIONS_KEPT

    controller = MixController(0.0, 1.0, 0.5)
    for _ in range(DECISIONS_KEPT + 10):
        controller.observe(_balanced(100))
    assert len(controller.decisions) == DECISIONS_KEPT
