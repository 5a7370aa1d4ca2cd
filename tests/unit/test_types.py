"""The package type-checks strictly (mypy, configured in pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_package_type_checks_strictly() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout and "liquidfs" not in done.stderr


def test_the_mypy_cache_is_the_checkouts_own_and_git_ignored() -> None:
    """A fixed cache outside the checkout (it was /tmp/liquidfs-mypy-cache) belongs to whoever ran mypy first:
    every other user's run then ended in a mypy INTERNAL ERROR. The cache is the checkout's, and git ignores it."""
    configured = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["cache_dir"]
    cache = (REPO / os.path.expanduser(os.path.expandvars(configured))).resolve()  # mypy: relative to its cwd, REPO
    assert cache.is_relative_to(REPO.resolve()), f"mypy's cache_dir {configured!r} is outside the checkout"
    assert cache != REPO.resolve()
    if not (REPO / ".git").exists():  # a copy without git: the directory's first component is what .gitignore names
        first = cache.relative_to(REPO.resolve()).parts[0]
        assert f"{first}/" in (REPO / ".gitignore").read_text().split(), f"{cache} is not git-ignored"
        return
    ignored = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(REPO), "check-ignore", "-q",
                              str(cache / "liquidfs" / "cli.data.json")], capture_output=True, text=True)
    assert ignored.returncode == 0, f"{cache} is not git-ignored: {ignored.stderr}"
