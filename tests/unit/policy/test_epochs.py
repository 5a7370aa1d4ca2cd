"""A job's per-file arrays (``policy.epochs.zeros``): zeros read and set one element at a time as Python ints, in
memory that is resident only where its reads reached (measured over the arrays' own pages with
mincore), private to a process forked after them."""

from __future__ import annotations

import ctypes
import os

import pytest

from liquidfs.policy.epochs import Job, zeros


def _resident_kb(view: memoryview) -> int:
    """The KiB of ``view``'s own pages that are resident (mincore(2) over exactly its bytes: the smaps entry of
    its mapping may also hold the next array's, where the kernel merged two neighbouring mappings into one)."""
    page = os.sysconf("SC_PAGE_SIZE")
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = address - address % page
    pages = -(-(address + view.nbytes - start) // page)
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(flag & 1 for flag in flags) * page // 1024


def test_zeros_hold_python_ints_of_their_type_and_their_count() -> None:
    epochs, reads = zeros("i", 5), zeros("q", 5)
    assert list(epochs) == [0] * 5 and list(reads) == [0] * 5 and len(zeros("i", 0)) == 0
    reads[4] = 2**40  # past an int32
    epochs[0] = 7
    assert reads[4] == 2**40 and type(reads[4]) is int and epochs[0] == 7
    with pytest.raises(IndexError):
        epochs[5] = 1
    with pytest.raises((ValueError, OverflowError)):
        epochs[1] = 2**40


def test_a_new_jobs_arrays_for_ten_million_files_are_resident_only_where_read() -> None:
    """A job is made on an open's path: its 120 MB of arrays must not be written out there, nor held whole for a
    job that reads a shard (an ``array`` of zeros was both)."""
    job = Job(id=1, size=10_000_000)
    assert _resident_kb(job.epoch_of) == 0 and _resident_kb(job.read_at) == 0
    for file in range(0, 10_000_000, 1_000_000):  # ten files read: ten pages
        job.epoch_of[file] = 1
        job.read_at[file] = 5
    assert _resident_kb(job.epoch_of) <= 10 * 4 and _resident_kb(job.read_at) <= 10 * 4


def test_a_process_forked_after_them_has_a_copy_of_its_own() -> None:
    epochs = zeros("i", 4)
    pid = os.fork()
    if pid == 0:  # the child: its write stays its own
        epochs[1] = 9
        os._exit(0 if epochs[1] == 9 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and epochs[1] == 0
