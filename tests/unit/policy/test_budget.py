"""A budget given as a percentage is a share of what holding every file costs on the level that holds them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from liquidfs.catalog.build import build
from liquidfs.catalog.catalog import Catalog
from liquidfs.daemon.build import make_policy
from liquidfs.daemon.config import Share
from liquidfs.held.base import MEMFD_OVERHEAD, PAGE, MemfdLevel, MemoryLevel
from liquidfs.metrics.stats import MountStats
from liquidfs.policy.budget import DatasetCost, ShareOfCost
from liquidfs.policy.next_epoch import NextEpochCache

FILES = 1200


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Catalog, dict[str, int]]:
    """A catalog of FILES files of 100 B to 3 KB (each takes one memfd page), and their sizes by name."""
    root = tmp_path_factory.mktemp("tiny")
    rng = random.Random(38)
    sizes = {}
    for i in range(FILES):
        name = f"f{i:04d}.png"
        sizes[name] = rng.randint(100, 3000)
        (root / "src" / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / "src" / f"d{i % 4}" / name).write_bytes(rng.randbytes(sizes[name]))
    build(root / "src", root / "store")
    return Catalog.open(root / "store", readonly=True, immutable=True), sizes


def _epochs(policy: NextEpochCache, sizes: list[tuple[int, int]], epochs: int) -> list[tuple[int, int]]:
    """(hits, reads) of each epoch, read in a new random order each."""
    rng = random.Random(7)
    out = []
    for _ in range(epochs):
        rng.shuffle(sizes)
        hits = reads = 0
        for file, size in sizes:
            decision = policy.read(file, size)
            if decision.same_epoch:  # (the first read of an epoch rarely passes for a retry)
                continue
            hits += decision.hit
            reads += 1
        out.append((hits, reads))
    return out


@pytest.mark.parametrize("share", [0.3, 1.0])
def test_a_percentage_of_tiny_files_holds_that_share_of_them_in_memfds(
        tiny: tuple[Catalog, dict[str, int]], share: float) -> None:
    """30 % of a dataset of tiny files was 30 % of their bytes, which in memfds (a page and 1,280 B each) held
    under a tenth of the files, and 100 % did not hold all of them. The percentage is of what holding every
    file costs at the memfd level's charge: the budget is that share of it, and the next epochs hit that share."""
    catalog, _ = tiny
    nodes = list(catalog.files())
    charged = sum(max(1, -(-node.size // PAGE)) * PAGE + MEMFD_OVERHEAD for node in nodes)
    policy = make_policy(catalog, catalog.file_totals(), Share(share))
    assert policy is not None
    level = MemfdLevel(policy, MountStats(), max_files=100_000)  # as the daemon's: a cap far past the files
    assert policy.budget == int(share * charged) and policy.share == pytest.approx(share)
    later = _epochs(policy, [(node.id, node.size) for node in nodes], 3)[1:]
    for hits, reads in later:
        assert reads >= FILES - 2
        if share == 1.0:
            assert hits >= reads - 2, later  # all of it held (a read taken for a retry aside)
        else:
            assert abs(hits / reads - share) <= 0.05, later
    assert policy.held_bytes <= policy.budget
    level.close()


def test_on_the_daemons_memory_a_percentage_is_of_the_bytes(tiny: tuple[Catalog, dict[str, int]]) -> None:
    """The daemon path's memory level charges a file its bytes: there the percentage is of the bytes served."""
    catalog, sizes = tiny
    policy = make_policy(catalog, catalog.file_totals(), Share(0.3))
    assert policy is not None
    MemoryLevel(policy, MountStats())
    assert policy.budget == int(0.3 * sum(sizes.values())) and policy.share == pytest.approx(0.3)


def test_bytes_are_a_share_of_what_holding_every_file_costs(tiny: tuple[Catalog, dict[str, int]]) -> None:
    """A budget in bytes is what it says; its share (what the quota keeps of each epoch) is its part of the
    files' cost at the level's charge, so the quota never chooses more than the budget can hold."""
    catalog, _ = tiny
    charged = DatasetCost(FILES, catalog.paged_bytes([PAGE])).of(PAGE, MEMFD_OVERHEAD)
    policy = make_policy(catalog, catalog.file_totals(), charged // 4)
    assert policy is not None
    MemfdLevel(policy, MountStats())
    assert policy.budget == charged // 4 and policy.share == pytest.approx(0.25, abs=1e-3)


def test_paged_bytes_round_each_file_up_to_whole_pages(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name, size in (("empty", 0), ("one", 1), ("page", 4096), ("more", 4097)):
        (src / name).write_bytes(b"x" * size)
    build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    assert catalog.paged_bytes([1, 4096]) == {1: 1 + 1 + 4096 + 4097, 4096: 4096 * 5}


