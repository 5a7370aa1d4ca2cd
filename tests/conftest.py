"""Shared fixtures: real mounts started as the user starts them, always cleaned up."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `from conftest import run_cli`
sys.path.insert(0, str(Path(__file__).parent / "support"))  # helpers: fusehelpers, s3server, trees, ...
# Beside the package, shared with the demo and the benchmarks: the sample dataset (scripts/sample.py) and the
# storage throttle (scripts/bench/_throttle.py)
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts" / "bench"))
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

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


@pytest.fixture(autouse=True)
def _root_gate(request: pytest.FixtureRequest) -> None:
    """A test marked ``needs_root("what needs it")`` -- passthrough (CAP_SYS_ADMIN), /proc/sys/vm/drop_caches, a
    chown to another user, fusectl's files (the watchdog), taking another user's credentials -- is skipped with
    that reason for another user, and fails in CI, which runs the suite as root: there none may skip. Autouse,
    so it runs before the test's own function-scoped fixtures (a chown in one would fail first)."""
    marker = request.node.get_closest_marker("needs_root")
    if marker is None or os.geteuid() == 0:
        return
    if marker.kwargs.get("allow_other") and user_allow_other():  # what --allow-other needs of a user
        return
    why = marker.args[0] if marker.args else "root"
    if os.environ.get("CI"):
        pytest.fail(f"needs root ({why}): CI runs the suite as root")
    pytest.skip(f"needs root: {why}")


def user_allow_other() -> bool:
    """/etc/fuse.conf lets users other than root mount with --allow-other (fusermount3's user_allow_other)."""
    try:
        lines = Path("/etc/fuse.conf").read_text().splitlines()
    except OSError:
        return False
    return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in lines)


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


@pytest.fixture
def reachable_tmp() -> Iterator[Path]:
    """A temporary directory every user may search down to (pytest's tmp_path is private to its user, and so
    is what is in it): where a cluster without a key may share a source in the clear."""
    path = Path(tempfile.mkdtemp(prefix="liquidfs-open-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture(scope="session")
def liquidfs_cmd() -> list[str]:
    return [sys.executable, "-m", "liquidfs"]


@pytest.fixture(autouse=True)
def restore_umask() -> Iterator[None]:
    """``cli.main`` sets liquidfs's umask (077) for its process: a test that calls it in-process would leave
    the next ones making 0700 directories (test_cli_errors' files for nobody, after test_profile's prepare)."""
    umask = os.umask(0o022)
    os.umask(umask)
    try:
        yield
    finally:
        os.umask(umask)


@pytest.fixture(autouse=True)
def restore_python_safepath() -> Iterator[None]:
    """``cli.main`` sets PYTHONSAFEPATH for its process (``sysio.reexec.helpers_off_cwd``): a test that calls it
    in-process would hand it to every later test's subprocesses (a `python rank.py` that imports a module beside
    it among them)."""
    from liquidfs.sysio import reexec

    before, users = os.environ.get("PYTHONSAFEPATH"), reexec._USERS_SAFEPATH
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = before
        reexec._USERS_SAFEPATH = users


def run_cli(*args: str, check: bool = True, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "liquidfs", *args], capture_output=True, text=True,
                          check=check, timeout=timeout, **kw)  # type: ignore[call-overload]


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """``cli.main`` sets up the root logger (and the excepthooks with --log-file): put back what pytest had, after
    every test (autouse): a test that ran ``main`` without asking left its handler on a stream pytest then closed,
    and a later test's log record printed "--- Logging error ---" into its output."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    hooks = sys.excepthook, threading.excepthook
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        sys.excepthook, threading.excepthook = hooks
