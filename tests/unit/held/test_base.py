"""The levels of held bytes (``held.HeldLevel``): memory, memfds and the local disk answer the data paths' few
questions the same way, each over the real next-epoch policy."""

from __future__ import annotations

import dataclasses

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from liquidfs.datapath.backing import memfd_with
from liquidfs.policy.next_epoch import NextEpochCache
from liquidfs.catalog.nodes import KIND_FILE, REPR_ORIGINAL, REPR_RAW, Node
from liquidfs.held.disk import DiskLevel
from liquidfs.held.base import MEMFD_OVERHEAD, PAGE, HeldLevel, Level, MemfdLevel, MemoryLevel
from liquidfs.stores.reader import Content
from liquidfs.metrics.stats import MountStats

SIZE = 1000
FILES = 10


class _Store:
    """The store under the disk level: every file is SIZE bytes of its id."""

    inline_check = True

    def open(self, node: Node) -> Content:
        data = bytes([node.id]) * SIZE
        return Content(size=SIZE, raw=False, data=memoryview(data))

    def check_source(self, node: Node, st: object = None, *, cached_only: bool = False) -> str | None:
        return None


def _node(i: int) -> Node:
    return Node(i, 1, b"f%d" % i, b"f%d" % i, KIND_FILE, 0o100444, SIZE, 0, 0, None, REPR_ORIGINAL, None, None, None)


def _policy() -> NextEpochCache:
    # room for everything, at what a memfd costs (whole pages and its overhead)
    return NextEpochCache(FILES * (max(SIZE, PAGE) + MEMFD_OVERHEAD), SIZE * FILES, FILES, max_id=FILES + 1)


def _memory(tmp_path: Path) -> tuple[HeldLevel, Callable[[int], None]]:
    level = MemoryLevel(_policy(), MountStats())
    return level, lambda i: level.hold(i, memoryview(bytes([i]) * SIZE), raw=False)


def _memfd(tmp_path: Path) -> tuple[HeldLevel, Callable[[int], None]]:
    level = MemfdLevel(_policy(), MountStats())
    return level, lambda i: level.keep(i, memfd_with(bytes([i]) * SIZE), SIZE, raw=False)


def _disk(tmp_path: Path) -> tuple[HeldLevel, Callable[[int], None]]:
    level = DiskLevel(_Store(), tmp_path, _policy())  # type: ignore[arg-type]
    return level, lambda i: level.open(_node(i)) and None  # its own open keeps what the policy holds


@pytest.mark.parametrize("make", [_memory, _memfd, _disk], ids=["memory", "memfd", "disk"])
def test_every_level_holds_what_the_policy_chose_and_forgets_a_dropped_file(tmp_path: Path, make) -> None:
    level, fill = make(tmp_path)
    node = _node(3)
    assert level.held_raw(node) is None
    decision = level.decide(node.id, SIZE)
    assert decision.hold and not decision.hit  # a first read, with room: held for the next epoch
    fill(node.id)
    assert level.held_raw(node) is False  # held, as the original
    assert node.id in level.policy.held
    level.drop(node.id)  # stale: the bytes and their room in the budget both go
    assert level.held_raw(node) is None and node.id not in level.policy.held
    assert level.policy.held_bytes == 0


@pytest.mark.parametrize("make", [_memory, _memfd], ids=["memory", "memfd"])
def test_a_hit_whose_bytes_were_lost_is_counted_as_a_miss(tmp_path: Path, make) -> None:
    level, fill = make(tmp_path)
    for epoch in range(2):
        for i in range(1, FILES + 1):
            decision = level.decide(i, SIZE)
            if epoch == 0:
                fill(i)
    hits = level.policy.stats.hits
    assert hits == FILES and decision.hit and decision.epoch
    level.lost_hit(decision, SIZE)
    assert level.policy.stats.hits == hits - 1 and level.policy.stats.misses == FILES + 1
    assert level.stats.reclaimed == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("level", [MemoryLevel, MemfdLevel, DiskLevel])
def test_every_level_answers_the_policy_s_questions_with_the_one_base_s_methods(level: type) -> None:
    """Copies of ``decide``, ``drop`` and ``lost_hit`` drift apart: each level is a ``Level`` and answers them
    with the base's methods, its own bookkeeping (a lock, a counter, files to remove) in hooks."""
    assert issubclass(level, Level)
    for name in ("decide", "drop", "lost_hit", "get", "held_items"):
        assert getattr(level, name) is getattr(Level, name), f"{level.__name__} copies {name}"


def test_a_hit_the_disk_level_lost_is_counted_as_a_miss_in_its_own_counter(tmp_path: Path) -> None:
    level = DiskLevel(_Store(), tmp_path, _policy())  # type: ignore[arg-type]
    for _ in range(2):
        for i in range(1, FILES + 1):
            level.open(_node(i))
    decision = level.decide(1, SIZE)
    hits = level.policy.stats.hits
    assert decision.hit
    level.lost_hit(decision, SIZE)
    assert level.policy.stats.hits == hits - 1 and level.lost == 1
    level.close()


def test_the_memfd_level_closes_what_it_lets_go(tmp_path: Path) -> None:
    level = MemfdLevel(_policy(), MountStats())
    level.decide(1, SIZE)
    fd = memfd_with(b"x" * SIZE)
    level.keep(1, fd, SIZE, raw=True)
    assert level.held_raw(_node(1)) is True and level.statistics().values()["memfd_bytes"] == SIZE
    level.drop(1)
    with pytest.raises(OSError):
        os.fstat(fd)
    assert level.statistics().values()["memfd_bytes"] == 0 and level.statistics().values()["memfd_files"] == 0


def test_held_memfds_cost_their_pages_and_never_pass_the_descriptor_cap() -> None:
    """24,000 files of 512 B in a budget of their bytes left 19,984 memfds open (every descriptor but 16) and
    94 MB of shmem for 12 MB counted: each held file is charged whole pages and its overhead, and at least its
    share of the budget by the memfds the level may hold, so the policy never chooses more than that."""
    tiny, count, cap = 512, 2000, 50
    policy = NextEpochCache(tiny * count, tiny * count, count, max_id=count + 1)  # --cache-size 100%
    level = MemfdLevel(policy, MountStats(), max_files=cap)
    most = 0
    for epoch in range(2):
        for i in range(1, count + 1):
            decision = level.decide(i, tiny)
            if decision.hold and level.get(i) is None:
                level.keep(i, memfd_with(b"x" * tiny), tiny, raw=False)
            most = max(most, len(level.held_items()))
    assert 0 < most <= cap and len(policy.held) <= cap
    assert set(level.held_items()) == set(policy.held)
    assert policy.held_bytes <= policy.budget
    assert policy.charge(tiny) >= PAGE + MEMFD_OVERHEAD
    level.close()


def test_the_memory_level_says_which_representation_it_holds_whatever_the_size() -> None:
    """Told from its size, an original padded to its raw object's size (a source writer's choice) was taken for
    the raw object, and served under that label beside opens of the raw object's bytes."""
    level = MemoryLevel(_policy(), MountStats())
    node = dataclasses.replace(_node(1), representation=REPR_RAW, served_size=SIZE, object="objects/x", checksum="c")
    level.hold(1, memoryview(b"o" * SIZE), raw=False)
    assert level.held_raw(node) is False
    level.hold(1, memoryview(b"r" * SIZE), raw=True)
    assert level.held_raw(node) is True
    level.drop(1)
    assert level.held_raw(node) is None
    level.hold(1, memoryview(b"o" * SIZE), raw=False)
    assert level.held_raw(node) is False  # not raw from an earlier hold
