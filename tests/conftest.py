"""Shared fixtures: real mounts started as the user starts them, always cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fusehelpers import Mount, fuse_available  # noqa: E402
from s3server import s3_server  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _fuse_gate(request: pytest.FixtureRequest) -> None:
    """A FUSE test that cannot run fails in CI; it is never a silent skip counted as a pass."""
    if request.node.get_closest_marker("fuse") is None:
        return
    problem = fuse_available()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"FUSE unavailable in CI: {problem}")
    pytest.skip(f"FUSE unavailable: {problem}")


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator[Mount]:
    """Mount factory: ``mounter.mount(source, **opts)`` returns the mount point; every mount is torn down."""
    m = Mount(tmp_path)
    try:
        yield m
    finally:
        m.cleanup()


@pytest.fixture(scope="session")
def liquidfs_cmd() -> list[str]:
    return [sys.executable, "-m", "liquidfs"]


def run_cli(*args: str, check: bool = True, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "liquidfs", *args], capture_output=True, text=True,
                          check=check, timeout=timeout, **kw)  # type: ignore[call-overload]
