"""The per-open choice of representation (``mount --mix``) and the loop that steers it, without a mount."""

from __future__ import annotations

import json
import logging

import pytest
import trio
import trio.testing

from liquidfs.catalog.nodes import REPR_ORIGINAL, REPR_RAW, Node
from liquidfs.mix.share import Mix, as_original, steer
from liquidfs.mix.controller import MixController


def raw_node(i: int) -> Node:
    return Node(id=100 + i, parent=1, name=b"%d.png" % i, path=b"d/%d.png" % i, kind=0, mode=0o100644,
                size=1000 + i, mtime_ns=0, nsubdirs=0, target=None, representation=REPR_RAW, served_size=3000 + i,
                object="ab/%032x.bmp" % i, checksum="c")


def test_a_fixed_share_above_what_was_prepared_is_refused() -> None:
    with pytest.raises(ValueError, match="more than the store holds raw"):
        Mix(0.6, prepared=0.5)
    assert Mix(0.5, prepared=0.5).share == 0.5


def test_a_fixed_share_serves_that_share_of_the_prepared_images_raw() -> None:
    nodes = [raw_node(i) for i in range(4000)]
    mix = Mix(0.3, prepared=0.6, seed=7)
    views = [mix.view(n) for n in nodes]
    raw = sum(v.served_raw for v in views)
    assert abs(raw / len(nodes) - 0.5) < 0.03  # 0.3 of all eligible = half of the 0.6 prepared
    for node, view in zip(nodes, views):
        if view.representation == REPR_ORIGINAL:
            assert view.size_served == node.size and view.object is None and view.checksum is None
        else:
            assert view is node
    stats = mix.statistics()
    assert stats.opens_raw == raw and stats.opens_original == len(nodes) - raw and stats.mode == "fixed"


def test_the_choice_is_seeded_and_stable() -> None:
    nodes = [raw_node(i) for i in range(200)]
    a, b, c = Mix(0.5, 1.0, seed=1), Mix(0.5, 1.0, seed=1), Mix(0.5, 1.0, seed=2)
    pick = lambda m: [m.wants_raw(n) for n in nodes]  # noqa: E731
    assert pick(a) == pick(b) and pick(a) != pick(c)


def test_a_higher_share_keeps_every_image_that_was_raw() -> None:
    """Only images whose rank lies between the old and the new share switch."""
    nodes = [raw_node(i) for i in range(500)]
    mix = Mix("adaptive", prepared=1.0, start=0.3)
    before = {n.id for n in nodes if mix.wants_raw(n)}
    mix.set_share(0.6, "test")
    after = {n.id for n in nodes if mix.wants_raw(n)}
    assert before < after


def test_an_open_file_keeps_its_representation_until_its_last_release() -> None:
    node = raw_node(1)
    mix = Mix("adaptive", prepared=1.0, start=1.0)
    assert mix.view(node).served_raw
    mix.set_share(0.0, "storage binds")
    assert mix.view(node).served_raw  # a second open while the first is open: same bytes, same size
    mix.release(node.id)
    assert mix.view(node).served_raw
    mix.release(node.id)
    mix.release(node.id)
    assert mix.view(node).representation == REPR_ORIGINAL  # no open left: the next first open switches
    assert mix.statistics().switches == 1


def test_a_cache_hit_is_served_as_held() -> None:
    node = raw_node(2)
    mix = Mix(0.0, prepared=1.0)
    assert mix.view(node, held_raw=True).served_raw
    mix.release(node.id)
    assert mix.view(node, held_raw=False).representation == REPR_ORIGINAL


def test_originals_are_untouched() -> None:
    node = as_original(raw_node(3))
    mix = Mix(1.0, prepared=1.0)
    assert mix.view(node) is node


def test_adaptive_starts_at_the_profile_or_the_middle() -> None:
    assert Mix("adaptive", prepared=0.8).share == pytest.approx(0.4)
    assert Mix("adaptive", prepared=0.8, start=0.7).share == pytest.approx(0.7)
    assert Mix("adaptive", prepared=0.8, start=0.95).share == pytest.approx(0.8)  # never above what exists


def test_steer_follows_the_pressure_and_says_why() -> None:
    """The loop feeds the controller from the mount's counters and the pressure, and applies its decisions."""
    mix = Mix("adaptive", prepared=1.0, start=0.5)
    controller = MixController(0.0, 1.0, mix.share, step=0.1, patience=2)
    opens = [0]
    pressure = {"cpu": 0.6, "io": 0.05}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: steer(mix, controller, lambda: (opens[0], 0), interval=1.0,
                                             pressure=pressure.get, busy=lambda: 0.1))
            await trio.sleep(0.5)  # between the loop's decisions, which come at whole seconds
            for _ in range(6):
                opens[0] += 50
                await trio.sleep(1.0)
            assert mix.share > 0.5 and ("decode binds" in mix.reason or "top of the prepared" in mix.reason)
            high = mix.share
            pressure.update(cpu=0.02, io=0.7)
            for _ in range(8):
                opens[0] += 50
                await trio.sleep(1.0)
            assert mix.share < high and ("storage binds" in mix.reason or "bottom of the prepared" in mix.reason)
            await trio.sleep(3.0)  # no opens: it holds, and says so
            assert "no opens" in mix.reason
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert mix.decisions >= 14


def test_steer_holds_without_pressure_information() -> None:
    mix = Mix("adaptive", prepared=1.0, start=0.5)
    controller = MixController(0.0, 1.0, mix.share)

    async def main() -> None:
        with trio.move_on_after(5):
            await steer(mix, controller, lambda: (1, 0), interval=1.0, pressure=lambda kind: None,
                        busy=lambda: None)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert mix.share == 0.5 and "no pressure stall information" in mix.reason


def test_steer_holds_the_share_when_an_interval_cannot_be_judged(caplog: pytest.LogCaptureFixture) -> None:
    """The steering runs in the mount's nursery: an exception of one interval (a reading no parser expected)
    ended the mount. The share holds, the steering goes on, and the next sound interval is judged again."""
    mix = Mix("adaptive", prepared=1.0, start=0.5)
    controller = MixController(0.0, 1.0, mix.share, step=0.1, patience=1)
    opens = [0]
    broken = [True]

    def pressure(kind: str) -> float | None:
        if broken[0]:
            raise OverflowError("integer division result too large for a float")
        return {"cpu": 0.6, "io": 0.05}[kind]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: steer(mix, controller, lambda: (opens[0], 0), interval=1.0,
                                             pressure=pressure, busy=lambda: 0.1))
            await trio.sleep(0.5)
            for _ in range(3):
                opens[0] += 50
                await trio.sleep(1.0)
            assert mix.share == 0.5 and "could not be judged (OverflowError)" in mix.reason
            broken[0] = False
            for _ in range(4):
                opens[0] += 50
                await trio.sleep(1.0)
            assert mix.share > 0.5  # judged again
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, logger="liquidfs.mix.share"):
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(caplog.records) == 1 and caplog.records[0].exc_info  # at the first failure, not every interval


def test_statistics_are_json() -> None:
    from dataclasses import asdict

    assert json.loads(json.dumps(asdict(Mix("adaptive", 1.0).statistics())))["mode"] == "adaptive"


def test_a_saturated_cpu_counts_as_decode_binding() -> None:
    """A decoder with as many threads as cores keeps them all busy with no task waiting for one: CPU pressure
    stays low (measured: 0.07-0.08 while DALI decoded on both cores), the saturation says it."""
    from liquidfs.mix.controller import Observation, cpu_signal

    assert cpu_signal(Observation(40, 0, cpu_pressure=0.07, io_pressure=0.05, cpu_busy=0.98)) > 0.8
    assert cpu_signal(Observation(40, 0, cpu_pressure=0.07, io_pressure=0.05, cpu_busy=0.6)) == 0.07
    controller = MixController(0.0, 1.0, start=0.5, patience=2)
    for _ in range(6):
        controller.observe(Observation(40, 0, cpu_pressure=0.07, io_pressure=0.05, cpu_busy=0.98))
    assert controller.share > 0.5


class _Held:
    """A level holding some files as their original (``held_raw`` False)."""

    def __init__(self, originals: set[int]) -> None:
        self.originals = set(originals)
        self.dropped: list[int] = []

    def held_raw(self, node: Node) -> bool | None:
        return False if node.id in self.originals else None

    def drop(self, file: int) -> None:
        self.dropped.append(file)
        self.originals.discard(file)


def test_a_held_original_is_let_go_when_the_share_wants_the_file_raw_unless_it_is_open() -> None:
    """A hit on a held original would still cost the loader its decode, the work a risen share is to spare: it
    is let go and the open serves raw; but never under another open of it, which keeps what it served."""
    mix = Mix(1.0, 1.0)
    node, other = raw_node(1), raw_node(2)
    held = _Held({node.id, other.id})
    view, swapped = mix.view_held(node, held)
    assert swapped and held.dropped == [node.id] and view.representation == REPR_RAW
    mix.release(node.id)
    mix.set_share(0.0, "test")
    first, _ = mix.view_held(other, None)  # an open of it, served as its original
    mix.set_share(1.0, "test")
    view, swapped = mix.view_held(other, held)
    assert not swapped and held.dropped == [node.id] and view.representation == first.representation
    assert mix.view_held(raw_node(3), None) == (raw_node(3), False)  # nothing held: the share decides


def test_what_the_mix_remembers_of_each_file_is_a_byte_of_it() -> None:
    """The switches count remembers each file's last representation for as long as the mount lives: a byte a file
    (a dict's entry took 74, 740 MB a loop at ten million files, for a statistic)."""
    import tracemalloc

    nodes = [raw_node(i) for i in range(50_000)]
    mix = Mix(0.3, prepared=0.6, seed=7)
    tracemalloc.start()
    try:
        for node in nodes:
            mix.view(node)
            mix.release(node.id)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * (100 + len(nodes)) + 100_000, peak
