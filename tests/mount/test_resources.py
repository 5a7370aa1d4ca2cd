"""The mount serves the original of an image prepare refused for want of memory (``liquidfs.expand.workers``; the
in-process side is tests/unit/test_resources.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusehelpers import Mount
from liquidfs.prepare import prepare
from smallmachine import limit_for, two_images


@pytest.mark.fuse
def test_the_mount_serves_the_original_of_an_image_that_did_not_fit(tmp_path: Path, mounter: Mount,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    small, big = two_images(tmp_path / "data")
    with monkeypatch.context() as m:
        limit_for(small, m)
        report = prepare(tmp_path / "data", tmp_path / "store", 1.0, progress=False)
    assert report.skipped == {"no-memory": 1}
    mnt = mounter.mount(tmp_path / "data", store=tmp_path / "store")
    assert (mnt / "big.png").read_bytes() == big.read_bytes()
    assert (mnt / "small.png").read_bytes()[:2] == b"BM"
