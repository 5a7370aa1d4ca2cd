"""The adaptive mix's controller on simulated machines: it converges, holds still, keeps to the prepared range and
follows a change of the machine (issue 16). No mount, no clock."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from liquidfs.mixcontrol import MixController, Observation, read_pressure


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


def test_pressure_files_are_read_as_shares() -> None:
    text = "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=4\n"
    assert read_pressure(text) == 0.125
    with pytest.raises(ValueError):
        read_pressure("")


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
