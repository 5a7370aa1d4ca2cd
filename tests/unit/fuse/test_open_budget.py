"""The open-file budget (``fuse.open_budget.OpenBudget``) alone: its share per user, the part kept back for root
and the mount's user, slots given back by a release or a failed open. Through a mount's opens:
``test_operations.py``."""

from __future__ import annotations

import errno

import pytest
from pyfuse3 import FUSEError

from liquidfs.fuse.open_budget import OpenBudget

OWNER = 1234


def _take_until_refused(budget: OpenBudget, uid: int, at_most: int) -> int:
    """Slots ``uid`` takes before a refusal (which must be ENFILE), ``at_most`` tries."""
    for taken in range(at_most):
        try:
            budget.take(uid)
        except FUSEError as exc:
            assert exc.errno == errno.ENFILE
            return taken
    return at_most


def test_a_user_other_than_root_and_the_owner_holds_half_of_what_is_not_kept_back() -> None:
    budget = OpenBudget(16, owner=OWNER)  # 2 kept back; 14 for everyone, 7 for any one other user
    assert _take_until_refused(budget, 1000, 16) == 7
    assert _take_until_refused(budget, 1001, 16) == 7
    assert _take_until_refused(budget, 1002, 1) == 0  # only the part kept back is left
    assert _take_until_refused(budget, OWNER, 1) == 1 and _take_until_refused(budget, 0, 2) == 1
    assert budget.taken == 16 and _take_until_refused(budget, 0, 1) == 0  # the whole budget


def test_a_release_gives_the_slot_back_to_whoever_took_it_and_the_control_file_takes_none() -> None:
    budget = OpenBudget(16, owner=OWNER)
    for fh in range(7):
        budget.take(1000)
        budget.opened(fh, 1000)
    budget.released(3)
    assert budget.held_by(1000) == 6 and budget.taken == 6
    budget.released(99)  # no slot (the control file): nothing given back
    budget.released(3)  # released once only
    assert budget.taken == 6
    for fh in (0, 1, 2, 4, 5, 6):
        budget.released(fh)
    assert budget.taken == 0 and budget.held_by(1000) == 0


def test_a_failed_open_gives_its_slot_back() -> None:
    budget = OpenBudget(8, owner=OWNER)
    for _ in range(100):
        budget.take(1000)
        budget.give_back(1000)
    assert budget.taken == 0 and budget.held_by(1000) == 0


def test_each_kind_of_refusal_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    seen: set[tuple[object, ...]] = set()

    def first(key: tuple[object, ...]) -> bool:
        new = key not in seen
        seen.add(key)
        return new

    budget = OpenBudget(8, owner=OWNER, first_error=first)
    assert _take_until_refused(budget, 1000, 10) == 3
    for _ in range(5):
        assert _take_until_refused(budget, 1000, 1) == 0
    assert [r.getMessage() for r in caplog.records].count(
        "uid 1000 holds 3 open files, its share of the 8 of the mount: its further opens fail with ENFILE until "
        "it closes some") == 1
