"""``SharedInodes``: the backings and sizes a mount's loops agree on, in memory shared across a fork."""

from __future__ import annotations

import os
import random

import pytest

from liquidfs.datapath.shared_inodes import Conflict, SharedInodes, TableFull


class Kernel:
    def __init__(self) -> None:
        self.next = 100
        self.open: set[int] = set()

    def register(self) -> int:
        self.next += 1
        self.open.add(self.next)
        return self.next

    def unregister(self, backing_id: int) -> None:
        self.open.remove(backing_id)


def test_loops_share_one_backing_per_inode_and_the_last_user_closes_it() -> None:
    shared, kernel = SharedInodes(3), Kernel()
    first = shared.attach(7, 0, (1, 70), kernel.register)
    assert shared.attach(7, 2, (1, 70), kernel.register) == first  # the same file: its id, not a new one
    assert shared.attach(7, 2, (1, 70), kernel.register) == first
    assert kernel.open == {first} and shared.backings() == 1
    shared.detach(7, 0, kernel.unregister)
    shared.detach(7, 2, kernel.unregister)
    assert kernel.open == {first}  # loop 2 still has one user
    shared.detach(7, 2, kernel.unregister)
    assert kernel.open == set() and shared.backings() == 0
    assert shared.attach(7, 1, (1, 71), kernel.register) != first  # a new file after the last release: new id


def test_another_file_for_an_inode_in_use_is_refused() -> None:
    shared, kernel = SharedInodes(2), Kernel()
    shared.attach(5, 0, (1, 50), kernel.register)
    with pytest.raises(Conflict):
        shared.attach(5, 1, (1, 51), kernel.register)  # the source changed between the two loops' checks
    assert len(kernel.open) == 1


def test_a_gone_loops_users_are_reaped() -> None:
    shared, kernel = SharedInodes(3), Kernel()
    only_gone = shared.attach(1, 1, (1, 10), kernel.register)
    both = shared.attach(2, 1, (1, 20), kernel.register)
    shared.attach(2, 0, (1, 20), kernel.register)
    assert shared.reap(1, kernel.unregister) == 1
    assert kernel.open == {both}
    shared.detach(2, 0, kernel.unregister)
    assert kernel.open == set()
    del only_gone


def test_entries_stay_found_through_many_removals() -> None:
    """Linear probing with removals that shift entries back: a model dict agrees after random churn in a small
    table, where runs wrap around and collide."""
    shared, kernel = SharedInodes(1, backing_slots=64), Kernel()
    rng = random.Random(3)
    model: dict[int, int] = {}
    for _ in range(5000):
        inode = rng.randrange(1, 400)
        if inode in model:
            shared.detach(inode, 0, kernel.unregister)
            del model[inode]
        elif len(model) < 60:
            model[inode] = shared.attach(inode, 0, (1, inode), kernel.register)
        for known, backing_id in list(model.items())[:8]:
            assert shared.attach(known, 0, (1, known), kernel.register) == backing_id
            shared.detach(known, 0, kernel.unregister)
    assert kernel.open == set(model.values()) and shared.backings() == len(model)


def test_a_full_table_refuses() -> None:
    shared, kernel = SharedInodes(1, backing_slots=4), Kernel()
    for inode in range(1, 5):
        shared.attach(inode, 0, (1, inode), kernel.register)
    with pytest.raises(TableFull):
        shared.attach(9, 0, (1, 9), kernel.register)


def test_sizes_told_are_seen_by_every_process() -> None:
    shared = SharedInodes(2)
    assert shared.size(3) is None
    pid = os.fork()
    if pid == 0:  # another loop tells a fallback's size
        shared.tell(3, 1234)
        shared.tell(4, 99)
        shared.tell(4, None)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert shared.size(3) == 1234 and shared.size(4) is None
    shared.tell(3, None)
    assert shared.size(3) is None


def test_backings_attached_in_two_processes_are_registered_once() -> None:
    shared = SharedInodes(2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        registered = []
        for inode in range(1, 200):
            shared.attach(inode, 1, (1, inode), lambda: registered.append(1) or 1000 + inode)
        os.write(w, str(len(registered)).encode())
        os._exit(0)
    mine = []
    for inode in range(1, 200):
        shared.attach(inode, 0, (1, inode), lambda: mine.append(1) or 1000 + inode)
    os.waitpid(pid, 0)
    theirs = int(os.read(r, 16))
    assert len(mine) + theirs == 199  # each inode registered by exactly one of the two
    closed = []
    for inode in range(1, 200):
        shared.detach(inode, 0, closed.append)
    assert closed == []  # the other process's users remain
    assert shared.reap(1, closed.append) == 199 and len(closed) == 199


def test_a_process_killed_holding_the_lock_does_not_stop_the_others() -> None:
    """A loop killed inside a section (SIGKILL) must not leave the other loops waiting for the lock for ever."""
    import signal
    import threading
    import time

    shared = SharedInodes(2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        shared._lock.__enter__()  # and never leaves it
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    os.read(r, 1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    got: list[int] = []
    attaching = threading.Thread(target=lambda: got.append(shared.attach(3, 0, (1, 3), lambda: 42)), daemon=True)
    attaching.start()
    attaching.join(10)
    assert got == [42], "the lock stayed held by a process that was killed (a semaphore would)"


def test_sizes_of_files_no_loop_has_open_are_let_go_when_the_table_fills() -> None:
    shared, kernel = SharedInodes(2, size_slots=8), Kernel()
    shared.attach(1, 0, (1, 1), kernel.register)  # inode 1 is open
    let_go: list[int] = []
    for inode in range(1, 30):
        let_go += shared.tell(inode, 1000 + inode)  # never full: the closed ones' sizes go
    assert shared.size(1) == 1001 and shared.size(29) == 1029
    assert sum(shared.size(i) is not None for i in range(1, 30)) <= 8
    # Each size let go is named, for the kernel to drop it (it still holds the size it was told): every one
    # recorded and no longer there, and never the open file's.
    assert 1 not in let_go and len(let_go) == len(set(let_go))
    assert sorted(let_go) == [i for i in range(2, 30) if shared.size(i) is None]
