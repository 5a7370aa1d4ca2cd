"""liquidfs's re-execs of itself (``liquidfs.sysio.reexec``) import nothing from the caller's directory or ``PYTHON*``
variables: a dataset writer who plants ``liquidfs/__init__.py`` in the dataset gets no code run when root runs
``cd dataset && liquidfs profile .``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from liquidfs.profile.measured import ScratchMounts, builtin_command, command_for
from liquidfs.stores.sample import ProfileError


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding a ``liquidfs`` package that leaves a marker when imported; the cwd, and on
    ``PYTHONPATH``. The marker's path is returned (it must never exist)."""
    dataset = tmp_path / "dataset"
    (dataset / "liquidfs").mkdir(parents=True)
    marker = tmp_path / "marker"
    code = f"open({str(marker)!r}, 'w').write('planted code ran')\n"
    (dataset / "liquidfs" / "__init__.py").write_text(code)
    (dataset / "liquidfs" / "pipelines.py").write_text(code)
    monkeypatch.chdir(dataset)
    monkeypatch.setenv("PYTHONPATH", str(dataset))
    monkeypatch.setenv("PYTHONSTARTUP", str(dataset / "liquidfs" / "__init__.py"))
    # The planted package is what a plain `python -m liquidfs` would import here: the test's premise.
    subprocess.run([sys.executable, "-c", "import liquidfs"], capture_output=True, check=False)
    assert marker.exists(), "the planted package is not what an unisolated interpreter imports"
    marker.unlink()
    return marker


def test_the_helper_runs_the_installed_liquidfs(planted: Path) -> None:
    from liquidfs.sysio import reexec  # here, not at the top: the other tests run on a liquidfs without it too

    shown = reexec.run("liquidfs", ["--help"], capture_output=True, text=True, check=False)
    assert shown.returncode == 0 and "usage: liquidfs" in shown.stdout, shown.stderr
    assert not planted.exists()


def test_the_helper_hands_on_no_python_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from liquidfs.sysio import reexec

    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("PYTHONSTARTUP", "/somewhere/start.py")
    monkeypatch.setenv("LIQUIDFS_JOB", "kept")
    env = reexec.isolated_env()
    assert not [name for name in env if name.startswith("PYTHON")]
    assert env["LIQUIDFS_JOB"] == "kept" and env["PATH"] == os.environ["PATH"]
    assert reexec.python_words("liquidfs", "stats")[1:] == ["-I", "-m", "liquidfs", "stats"]


def test_the_profiles_scratch_mount_commands_import_nothing_from_the_dataset(planted: Path,
                                                                            tmp_path: Path) -> None:
    scratch = object.__new__(ScratchMounts)  # only its re-exec of `liquidfs umount` is run here
    with pytest.raises(ProfileError, match="liquidfs umount of the profile's sample failed"):
        scratch._liquidfs("umount", str(tmp_path / "not-mounted"))
    assert not planted.exists()


def test_the_profiles_built_in_loader_imports_nothing_from_the_dataset(planted: Path, tmp_path: Path) -> None:
    # run as profile runs a --run command: in the caller's directory and environment
    words = command_for(builtin_command("pil", threads=1, images=8), tmp_path / "no-such-mount")
    subprocess.run(words, capture_output=True, check=False, timeout=120)
    assert not planted.exists()
