"""Shared fixtures: real mounts started as the user starts them, always cleaned up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `from conftest import run_cli`
sys.path.insert(0, str(Path(__file__).parent / "support"))  # helpers: fusehelpers, s3server, trees, ...

from fusehelpers import FUSERMOUNT, Mount, fuse_available, is_mounted  # noqa: E402
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


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path is private to root); needs root and setpriv to
    act as another user (``fusehelpers.as_nobody``): a failure in CI, a skip elsewhere."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        if os.environ.get("CI"):
            pytest.fail("the other-user tests need root and setpriv (util-linux)")
        pytest.skip("needs root and setpriv")
    path = Path(tempfile.mkdtemp(prefix="liquidfs-perm-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for child in path.iterdir():
            if is_mounted(child):
                subprocess.run([FUSERMOUNT, "-u", "-z", str(child)], capture_output=True)
        shutil.rmtree(path)


@pytest.fixture(scope="session")
def liquidfs_cmd() -> list[str]:
    return [sys.executable, "-m", "liquidfs"]


def run_cli(*args: str, check: bool = True, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "liquidfs", *args], capture_output=True, text=True,
                          check=check, timeout=timeout, **kw)  # type: ignore[call-overload]
