"""``SharedInodes``: the backings and sizes a mount's loops agree on, in memory shared across a fork."""

from __future__ import annotations

import fcntl
import json
import os
import random

import pytest

from liquidfs.datapath.shared_inodes import Conflict, SharedInodes, TableFull, _home


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
    first = shared.attach(7, 0, (1, 70), kernel.register, kernel.unregister)
    assert shared.attach(7, 2, (1, 70), kernel.register, kernel.unregister) == first  # the same file: its id, not a new one
    assert shared.attach(7, 2, (1, 70), kernel.register, kernel.unregister) == first
    assert kernel.open == {first} and shared.backings() == 1
    assert not shared.detach(7, 0, kernel.unregister)
    assert not shared.detach(7, 2, kernel.unregister)
    assert kernel.open == {first}  # loop 2 still has one user
    assert shared.detach(7, 2, kernel.unregister)  # the last: no loop serves the file now
    assert kernel.open == set() and shared.backings() == 0
    assert shared.attach(7, 1, (1, 71), kernel.register, kernel.unregister) != first  # a new file after the last release: new id


def test_another_file_for_an_inode_in_use_is_refused() -> None:
    shared, kernel = SharedInodes(2), Kernel()
    shared.attach(5, 0, (1, 50), kernel.register, kernel.unregister)
    with pytest.raises(Conflict):
        shared.attach(5, 1, (1, 51), kernel.register, kernel.unregister)  # the source changed between the two loops' checks
    assert len(kernel.open) == 1


def test_a_gone_loops_users_are_reaped() -> None:
    shared, kernel = SharedInodes(3), Kernel()
    only_gone = shared.attach(1, 1, (1, 10), kernel.register, kernel.unregister)
    both = shared.attach(2, 1, (1, 20), kernel.register, kernel.unregister)
    shared.attach(2, 0, (1, 20), kernel.register, kernel.unregister)
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
            model[inode] = shared.attach(inode, 0, (1, inode), kernel.register, kernel.unregister)
        for known, backing_id in list(model.items())[:8]:
            assert shared.attach(known, 0, (1, known), kernel.register, kernel.unregister) == backing_id
            shared.detach(known, 0, kernel.unregister)
    assert kernel.open == set(model.values()) and shared.backings() == len(model)


def test_a_full_table_refuses_and_lets_go_again(seed: int = 5) -> None:
    """ENFILE past its slots (EMFILE told the reader its own process was out of descriptors); and a detach from a
    full table, whose run never meets an empty slot, looped for good under the lock every loop takes."""
    import errno

    shared, kernel = SharedInodes(1, backing_slots=4), Kernel()
    for inode in range(1, 5):
        shared.attach(inode, 0, (1, inode), kernel.register, kernel.unregister)
    with pytest.raises(TableFull) as refused:
        shared.attach(9, 0, (1, 9), kernel.register, kernel.unregister)
    assert refused.value.errno == errno.ENFILE
    rng = random.Random(seed)
    held = list(range(1, 5))
    for _ in range(200):  # churn through a table kept full: every entry found, every removal ends
        gone = held.pop(rng.randrange(len(held)))
        shared.detach(gone, 0, kernel.unregister)
        new = rng.randrange(10, 1000)
        while new in held:
            new = rng.randrange(10, 1000)
        shared.attach(new, 0, (1, new), kernel.register, kernel.unregister)
        held.append(new)
        for inode in held:
            assert shared.attach(inode, 0, (1, inode), kernel.register, kernel.unregister) > 0
            shared.detach(inode, 0, kernel.unregister)
    assert shared.backings() == 4


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


def test_backings_attached_in_two_processes_share_one_id_per_inode() -> None:
    """Two loops opening the same files at once: each inode ends with one backing both use (the kernel allows
    one per inode), registered once or, where both registered at once, the other id unregistered again."""
    shared = SharedInodes(2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ids, registered, spare = [], [], []
            for inode in range(1, 200):
                ids.append(shared.attach(inode, 1, (1, inode), lambda: registered.append(2000 + inode) or 2000 + inode,
                                         spare.append))
            os.write(w, json.dumps([ids, registered, spare]).encode())
        finally:
            os._exit(0)
    ids, registered, spare = [], [], []
    for inode in range(1, 200):
        ids.append(shared.attach(inode, 0, (1, inode), lambda: registered.append(1000 + inode) or 1000 + inode,
                                 spare.append))
    os.waitpid(pid, 0)
    their_ids, their_registered, their_spare = json.loads(os.read(r, 1 << 16))
    assert ids == their_ids  # one id per inode, whichever loop registered first
    # every id registered is kept (once) or unregistered (once), never both
    assert sorted(registered + their_registered) == sorted(ids + spare + their_spare)
    assert not set(ids) & set(spare + their_spare)
    closed: list[int] = []
    for inode in range(1, 200):
        shared.detach(inode, 0, closed.append)
    assert closed == []  # the other process's users remain
    assert shared.reap(1, closed.append) == 199 and sorted(closed) == sorted(ids)


def _lock_is_free(shared: SharedInodes) -> bool:
    """Whether another process could take ``shared``'s lock now (record locks are per process: a child asks)."""
    pid = os.fork()
    if pid == 0:
        try:
            fcntl.lockf(shared._lock._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1)
        except OSError:
            os._exit(1)
        os._exit(0)
    return os.waitpid(pid, 0)[1] == 0


def test_registering_and_unregistering_happen_outside_the_lock() -> None:
    """Every open and release of every loop takes the lock: the kernel's ioctls must not be made holding it,
    neither a first open's nor a release's, nor the unregistering of an id another loop's made spare, nor a
    reap's."""
    shared = SharedInodes(2)
    free_while: list[str] = []

    def register(name: str, backing_id: int, then=lambda: None):
        def call() -> int:
            free_while.append(f"{name}:{_lock_is_free(shared)}")
            then()
            return backing_id
        return call

    def unregister(backing_id: int) -> None:
        free_while.append(f"unregister {backing_id}:{_lock_is_free(shared)}")

    assert shared.attach(9, 0, (1, 9), register("first", 41), unregister) == 41
    shared.detach(9, 0, unregister)
    # loop 0 finds no backing and registers; meanwhile loop 1 registers and writes its slot first
    assert shared.attach(8, 0, (1, 8), register("raced", 51, lambda: shared.attach(
        8, 1, (1, 8), register("winner", 52), unregister)), unregister) == 52
    shared.attach(7, 1, (1, 7), register("reaped", 61), unregister)
    assert shared.reap(1, unregister) == 1
    assert free_while == ["first:True", "unregister 41:True", "raced:True", "winner:True", "unregister 51:True",
                          "reaped:True", "unregister 61:True"]


def test_a_file_another_loop_has_open_is_joined_without_registering_it_again() -> None:
    shared, kernel = SharedInodes(2), Kernel()
    theirs = shared.attach(4, 1, (1, 40), kernel.register, kernel.unregister)
    registered = kernel.next
    assert shared.attach(4, 0, (1, 40), kernel.register, kernel.unregister) == theirs
    assert kernel.open == {theirs} and kernel.next == registered  # no ioctl made
    with pytest.raises(Conflict):  # another file for it: refused, nothing registered
        shared.attach(4, 0, (1, 41), kernel.register, kernel.unregister)
    assert kernel.open == {theirs} and kernel.next == registered


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
    attaching = threading.Thread(target=lambda: got.append(shared.attach(3, 0, (1, 3), lambda: 42, lambda backing_id: None)), daemon=True)
    attaching.start()
    attaching.join(10)
    assert got == [42], "the lock stayed held by a process that was killed (a semaphore would)"


def test_sizes_of_files_no_loop_has_open_are_let_go_when_the_table_fills() -> None:
    shared, kernel = SharedInodes(2, size_slots=8), Kernel()
    shared.attach(1, 0, (1, 1), kernel.register, kernel.unregister)  # inode 1 is open
    let_go: list[int] = []
    for inode in range(1, 30):
        let_go += shared.tell(inode, 1000 + inode)  # never full: the closed ones' sizes go
    assert shared.size(1) == 1001 and shared.size(29) == 1029
    assert sum(shared.size(i) is not None for i in range(1, 30)) <= 8
    # Each size let go is named, for the kernel to drop it (it still holds the size it was told): every one
    # recorded and no longer there, and never the open file's.
    assert 1 not in let_go and len(let_go) == len(set(let_go))
    assert sorted(let_go) == [i for i in range(2, 30) if shared.size(i) is None]


def test_a_directory_is_claimed_by_one_loop_at_a_time() -> None:
    shared = SharedInodes(2, claim_slots=8)
    assert shared.claim_directory(5, 100.0, 60.0)
    assert not shared.claim_directory(5, 159.0, 60.0)  # another loop, within the minute
    assert shared.claim_directory(5, 160.5, 60.0)  # past it: warmed again
    assert not shared.claim_directory(5, 161.0, 1.0)
    assert shared.claim_directory(5, 162.0, 1.0)
    pid = os.fork()
    if pid == 0:  # another process, the same memory and clock
        os._exit(0 if not shared.claim_directory(5, 162.5, 60.0) else 1)
    assert os.waitpid(pid, 0)[1] == 0
    # a directory whose slot another took is claimed again (at worst warmed twice)
    other = next(i for i in range(6, 10_000) if _home(i, 8) == _home(5, 8))
    assert shared.claim_directory(other, 163.0, 60.0)
    assert shared.claim_directory(5, 163.0, 60.0)
    # a warm's claim holds while it runs (busy_for at most), and the others' windows count from its end
    assert shared.claim_directory(11, 200.0, 1.0, busy_for=30.0)
    assert not shared.claim_directory(11, 229.0, 1.0)
    shared.directory_warmed(11, 205.0)
    assert not shared.claim_directory(11, 205.5, 1.0)
    assert shared.claim_directory(11, 206.5, 1.0)
    assert shared.claim_directory(11, 208.0, 1.0, busy_for=30.0)
    mate = next(i for i in range(12, 10_000) if _home(i, 8) == _home(11, 8))
    shared.directory_warmed(mate, 209.0)  # another directory's end changes not this one's claim
    assert not shared.claim_directory(11, 210.5, 1.0)


def test_a_second_thread_of_the_holder_waits_for_the_lock() -> None:
    """A record lock is the process's: the read-ahead's thread (``claim_directory``) would pass straight into the
    loop thread's section, and its unlock open that section to the other loops. It waits instead."""
    import threading

    shared = SharedInodes(2)
    claimed = threading.Event()
    with shared._lock:  # the loop, inside attach
        other = threading.Thread(target=lambda: (shared.claim_directory(3, 1.0, 60.0), claimed.set()), daemon=True)
        other.start()
        assert not claimed.wait(1.0), "another thread of the process entered the section held"
        assert not _lock_is_free(shared)  # and the other processes are still kept out
    assert claimed.wait(10)


def test_a_warning_is_written_outside_the_lock_every_loop_takes() -> None:
    """A log write may wait (a full pipe, a slow disk): written under the lock every loop's requests take, it
    stalled them all."""
    import logging

    shared = SharedInodes(2)
    free_at_write: list[bool] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            free_at_write.append(_lock_is_free(shared))

    probe = Probe(logging.WARNING)
    logger = logging.getLogger("liquidfs.datapath.shared_inodes")
    logger.addHandler(probe)
    try:
        shared.detach(12345, 0, lambda backing_id: None)  # no such backing: said
    finally:
        logger.removeHandler(probe)
    assert free_at_write == [True]
