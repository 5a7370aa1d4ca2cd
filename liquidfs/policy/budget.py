"""What a next-epoch budget is: bytes, or a share (``--cache-size 30%``) of what holding every file of the dataset
costs on the level that holds them.

A held file costs a level more than its bytes: a memfd takes whole pages (a 512 B file takes 4 KiB) and a
file's overhead (``held.base.MEMFD_OVERHEAD``). A percentage of the bytes as served held less than that share
of the files on such a level (30 % of a dataset of tiny files hit a quarter of the opens, 100 % did not hold
all of it), so a percentage is of the cost of all of them at the level's charge (``DatasetCost.of``), resolved
once the level says what it charges (``NextEpochCache.charge_files``), and the policy's share is the budget's
part of that cost whichever way the budget was given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["DatasetCost", "ShareOfCost"]


@dataclass(frozen=True, slots=True)
class ShareOfCost:
    """A budget given as a share in [0, ...) of what holding every file costs (``--cache-size 30%``: 0.3)."""

    share: float


@dataclass(frozen=True, slots=True)
class DatasetCost:
    """What holding every file of a dataset costs a level that charges each file whole pages and an overhead."""

    files: int
    #: Page size -> the bytes of every file as served, each rounded up to whole pages of it and to one at least
    #: (``catalog.catalog.Catalog.paged_bytes``); page 1 is the bytes as served (an empty file counted as one byte).
    paged: Mapping[int, int] = field(default_factory=dict)

    def of(self, page: int, overhead: int) -> int:
        """The cost of holding all of the dataset's files at ``page`` and ``overhead`` (at least 1)."""
        paged = self.paged.get(page)
        if paged is None:
            # Only policies built by hand (tests, tools) lack the catalog's figure: each file is taken to waste
            # half a page, the expectation for sizes that are not multiples of it.
            paged = self.paged.get(1, 0) + self.files * (page // 2)
        return max(1, paged + self.files * max(0, overhead))
