"""``sysio.short``: which errors say this process or node is short of something, not that what it reached is bad."""

from __future__ import annotations

import errno

import pytest

from liquidfs.sysio.short import short_of_resources


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS])
def test_out_of_descriptors_or_memory_is_short(code: int) -> None:
    assert short_of_resources(OSError(code, "short"))


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "medium error"), FileNotFoundError(errno.ENOENT, "gone"),
                                 OSError("no errno"), MemoryError(), ValueError("EMFILE")])
def test_anything_else_is_not(exc: BaseException) -> None:
    assert not short_of_resources(exc)
