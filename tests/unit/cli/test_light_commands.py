"""The commands that only talk to a running mount (``umount``, ``stats``) and the parser every command builds load
none of the daemon's heavy modules: trio, pyfuse3, NumPy, Pillow and the hashes took 0.5 s of a CPU at every
command (``liquidfs stats`` in a probe loop, a test suite's hundreds of mounts), of which the command used nothing.
Each case runs in a fresh interpreter, the way a user's command does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("trio", "pyfuse3", "numpy", "PIL", "xxhash", "liquidfs.fuse.operations", "liquidfs.profile.choose")

RUN = f"""
import json, sys
from liquidfs.cli import main
status = main(sys.argv[1:]) if len(sys.argv) > 1 else 0
print(json.dumps({{"status": status, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def _loaded_by(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, timeout=60,
                          check=False)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [(), ("umount", "/nonexistent/mnt"), ("stats", "/"), ("stats", "/", "--json")])
def test_the_parser_umount_and_stats_load_none_of_the_daemons_modules(argv: tuple[str, ...]) -> None:
    ran = _loaded_by(*argv)
    assert ran["loaded"] == [], ran
    assert ran["status"] == (0 if not argv else 1)  # not a mount: one line and status 1 (test_errors)


def test_profiles_help_still_shows_its_long_description() -> None:
    """``profile --help`` reads its description (``profile.choose``'s docstring) when it is shown."""
    done = subprocess.run([sys.executable, "-m", "liquidfs", "profile", "--help"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    from liquidfs.profile import choose

    first = (choose.__doc__ or "").strip().splitlines()[0]
    assert first and first in done.stdout, done.stdout[:2000]
    assert "Two estimates of the best mix" in done.stdout


@pytest.mark.parametrize("given", ["{not json", "[1, 2]", '{"source": "/data"}'])
def test_a_daemon_config_that_is_none_is_one_line_never_a_traceback(given: str) -> None:
    """The daemon's own flag, hidden: what it is given is said in a line when it is no mount's config."""
    result = subprocess.run([sys.executable, "-m", "liquidfs", "mount", "--daemon-config", given, "/data", "/mnt"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--daemon-config: not a mount's config" in result.stderr


@pytest.mark.parametrize("flag", [["--quick"], ["--model-only"], ["--run-images", "32"], ["--repeats", "3"],
                                  ["--run-timeout", "600"], ["--readers", "4"], ["--gpu-train-rate", "900"]])
def test_prepare_with_a_given_ratio_refuses_the_flags_of_its_profile(tmp_path, flag: list[str]) -> None:  # type: ignore[no-untyped-def]
    """--quick, --model-only, --run-images (and the search's --repeats and --run-timeout, the model's --readers
    and --gpu-train-rate, even at their defaults) shape the profile of --ratio auto: with a given ratio they did
    nothing, and said nothing."""
    (tmp_path / "src").mkdir()
    result = subprocess.run([sys.executable, "-m", "liquidfs", "prepare", str(tmp_path / "src"), "--store",
                             str(tmp_path / "store"), "--ratio", "0.5", *flag], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "shape the profile of --ratio auto" in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["profile", "prepare"])
@pytest.mark.parametrize("flag", [["--run", "true {mount}"], ["--run-images", "32"], ["--repeats", "2"],
                                  ["--run-timeout", "60"]])
def test_model_only_refuses_the_flags_of_the_search_it_skips(tmp_path, command: str, flag: list[str]) -> None:  # type: ignore[no-untyped-def]
    """--model-only chooses by the cost model alone: the measured search's flags beside it were dropped without a
    word (the user's --run never ran)."""
    (tmp_path / "src").mkdir()
    result = subprocess.run([sys.executable, "-m", "liquidfs", command, str(tmp_path / "src"), "--store",
                             str(tmp_path / "store"), "--model-only", *flag]
                            + (["--ratio", "auto"] if command == "prepare" else []),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode in (1, 2) and "which --model-only skips" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "store").exists()
