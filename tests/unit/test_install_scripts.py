"""scripts/install.sh, scripts/test.sh and scripts/passthrough/build.sh as a newcomer meets them, run in a sandbox:
a copy of the script, a PATH of stubs (``id`` says which user runs it; apt-get, sudo, the venv's python and
pip record what they were asked) and nothing else, so no package is installed and nothing is built."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
BASH = shutil.which("bash") or "/bin/bash"
#: The real tools the scripts use besides the stubs (their paths taken from this machine's PATH).
REAL_TOOLS = ["bash", "sh", "env", "grep", "tail", "sed", "df", "cat", "dirname", "basename", "mkdir", "rm", "mktemp",
              "chmod"]


def _stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def _recorder(path: Path, log: Path, rc: int = 0) -> None:
    """A command that appends its name and arguments to ``log`` and exits with ``rc``."""
    _stub(path, f'echo "{path.name} $*" >> "{log}"\nexit {rc}')


class Sandbox:
    """A checkout with the named scripts copied in and a PATH of stubs only (no sudo unless ``sudo()``)."""

    def __init__(self, root: Path, uid: int) -> None:
        self.root = root
        self.bin = root / "bin"
        self.log = root / "calls.log"
        self.log.touch()
        self.bin.mkdir()
        for tool in REAL_TOOLS:
            real = shutil.which(tool)
            assert real is not None, f"{tool} not found"
            (self.bin / tool).symlink_to(real)
        _stub(self.bin / "id", f'if [ "$1" = -u ]; then echo {uid}; else exec {shutil.which("id")} "$@"; fi')
        _recorder(self.bin / "apt-get", self.log)
        _recorder(root / ".venv" / "bin" / "python", self.log)

    def copy(self, *scripts: str) -> None:
        for name in scripts:
            dest = self.root / "scripts" / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(SCRIPTS / name, dest)

    def sudo(self) -> None:
        _stub(self.bin / "sudo", f'echo "sudo $*" >> "{self.log}"\nexec "$@"')

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    def run(self, script: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([BASH, str(self.root / "scripts" / script)], cwd=self.root, capture_output=True,
                              text=True, timeout=60, env={"PATH": str(self.bin), "HOME": str(self.root), **env})


def _install_sandbox(tmp_path: Path, uid: int, *, missing: tuple[str, ...] = ()) -> Sandbox:
    """install.sh with every build dependency present except the packages named in ``missing``, and a
    passthrough build stub that records its run."""
    box = Sandbox(tmp_path, uid)
    box.copy("install.sh")
    for tool in ("fusermount3", "pkg-config", "gcc", "patch"):
        if tool not in missing:
            _recorder(box.bin / tool, box.log)
    _stub(box.bin / "dpkg", 'exit 1' if "libfuse3-dev" in missing else 'exit 0')
    include = tmp_path / "include"
    include.mkdir()
    (include / "Python.h").touch()
    # install.sh asks it where Python.h is, whether ensurepip is there (python3-venv), and to make the venv
    venv = "\n".join(["mkdir -p .venv/bin",
                       f"printf '#!/bin/sh\\necho \"python $*\" >> {box.log}\\n' > .venv/bin/python",
                       "chmod +x .venv/bin/python"])
    _stub(box.bin / "python3", f'echo "python3 $*" >> "{box.log}"\n'
          f'case "$*" in *ensurepip*) exit {int("python3-venv" in missing)};; "-m venv .venv") {venv}; exit 0;; esac\n'
          f'echo "{include}"')
    _stub(box.root / "scripts" / "passthrough" / "build.sh", f'echo "build.sh $*" >> "{box.log}"\necho built')
    return box


def _built(box: Sandbox) -> bool:
    return any(call.startswith("build.sh ") for call in box.calls())


def test_install_without_root_skips_the_passthrough_build_with_one_line(tmp_path: Path) -> None:
    """A non-root user's mounts cannot use passthrough (CAP_SYS_ADMIN): the build is skipped, and one line says why
    and how to force it; ``patch``, needed only by that build, is not asked for."""
    box = _install_sandbox(tmp_path, 1000, missing=("patch",))
    done = box.run("install.sh")
    assert done.returncode == 0, done.stderr
    assert not _built(box) and not any(c.startswith("apt-get") for c in box.calls()), box.calls()
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "CAP_SYS_ADMIN" in lines[0] and "LIQUIDFS_PASSTHROUGH=1" in lines[0], done.stderr


@pytest.mark.parametrize(("uid", "forced"), [(1000, "1"), (0, None)], ids=["user-forced", "root"])
def test_install_builds_passthrough_as_root_or_when_asked(tmp_path: Path, uid: int, forced: str | None) -> None:
    box = _install_sandbox(tmp_path, uid)
    done = box.run("install.sh", **({"LIQUIDFS_PASSTHROUGH": forced} if forced else {}))
    assert done.returncode == 0, done.stderr
    assert _built(box), box.calls()
    assert "CAP_SYS_ADMIN" not in done.stderr, done.stderr


def test_install_without_root_or_sudo_says_what_to_install(tmp_path: Path) -> None:
    """It used to run ``sudo apt-get`` regardless and end in ``sudo: command not found``."""
    box = _install_sandbox(tmp_path, 1000, missing=("libfuse3-dev", "gcc"))
    done = box.run("install.sh", LIQUIDFS_PASSTHROUGH="0")
    assert done.returncode == 1, done.stderr
    assert "run as root or install libfuse3-dev gcc" in done.stderr, done.stderr
    assert "command not found" not in done.stderr and not any(c.startswith("apt-get") for c in box.calls())


def test_install_without_root_uses_sudo_when_there_is_one(tmp_path: Path) -> None:
    box = _install_sandbox(tmp_path, 1000, missing=("libfuse3-dev",))
    box.sudo()
    done = box.run("install.sh", LIQUIDFS_PASSTHROUGH="0")
    assert done.returncode == 0, done.stderr
    calls = box.calls()
    assert "sudo apt-get update -qq" in calls and "apt-get install -y -qq libfuse3-dev" in calls, calls


def test_install_without_ensurepip_installs_python3_venv_and_remakes_a_venv_left_without_pip(tmp_path: Path) -> None:
    """Debian's python3 has no ensurepip: ``python3 -m venv`` failed on a fresh machine, and the venv it left
    behind (no pip in it) made every later run fail at "pip could not install"."""
    box = _install_sandbox(tmp_path, 0, missing=("python3-venv",))
    _stub(box.root / ".venv" / "bin" / "python", 'case "$*" in "-m pip --version") exit 1;; esac')
    done = box.run("install.sh", LIQUIDFS_PASSTHROUGH="0")
    assert done.returncode == 0, done.stderr
    calls = box.calls()
    assert "apt-get install -y -qq python3-venv" in calls and "python3 -m venv .venv" in calls, calls
    assert any(c.startswith("python -m pip install") for c in calls) and "no pip" in done.stderr, calls


def _test_sh_sandbox(tmp_path: Path, uid: int) -> Sandbox:
    box = Sandbox(tmp_path, uid)
    box.copy("test.sh")
    _recorder(box.root / "scripts" / "install.sh", box.log)
    return box


def test_test_sh_without_root_or_sudo_names_the_missing_tools_and_runs_the_tests(tmp_path: Path) -> None:
    """Tools in /usr/sbin and /sbin (debootstrap, runc) are found though a user's PATH lacks them; the rest are named
    with "run as root or install", and the suite runs anyway (it used to stop at ``sudo: command not found``)."""
    box = _test_sh_sandbox(tmp_path, 1000)
    done = box.run("test.sh")
    assert done.returncode == 0, done.stderr
    assert "python -m pytest -rs --durations=15" in box.calls(), box.calls()
    [line] = [line for line in done.stderr.splitlines() if "run as root or install" in line]
    assert "podman" in line and "command not found" not in done.stderr and "sudo" not in line, done.stderr
    missing = line.split("(", 1)[1].split(")", 1)[0].split()
    for tool in ("debootstrap", "runc"):  # each is its own package's name
        in_sbin = any(Path(d, tool).exists() for d in ("/usr/local/sbin", "/usr/sbin", "/sbin"))
        assert (tool in missing) != in_sbin, (tool, in_sbin, missing)


def test_test_sh_as_root_installs_the_missing_tools_with_apt(tmp_path: Path) -> None:
    box = _test_sh_sandbox(tmp_path, 0)
    done = box.run("test.sh")
    assert done.returncode == 0, done.stderr
    installs = [c for c in box.calls() if c.startswith("apt-get install")]
    assert len(installs) == 1 and "podman" in installs[0].split(), box.calls()


def test_passthrough_build_fetches_only_pyfuse3_as_source(tmp_path: Path) -> None:
    """``pip download --no-binary :all:`` built pyfuse3's build requirements from source to read its metadata
    (Cython: most of the install's time, issue 31); only pyfuse3 itself is needed as an sdist."""
    venv = tmp_path / "venv"
    log = tmp_path / "calls.log"
    log.touch()
    _stub(venv / "bin" / "python", "exit 1")  # no pyfuse3 with passthrough yet
    _recorder(venv / "bin" / "pip", log, rc=1)  # the download fails: the build stops right after it
    _stub(tmp_path / "bin" / "pkg-config", 'case "$1" in --modversion) echo 3.17.2;; esac; exit 0')  # a new libfuse
    done = subprocess.run([BASH, str(SCRIPTS / "passthrough" / "build.sh"), str(venv)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert done.returncode == 1 and "pip download pyfuse3" in done.stderr.splitlines()[-1], done.stderr
    [download] = [call.split() for call in log.read_text().splitlines() if " download " in f" {call} "]
    assert download[download.index("--no-binary") + 1] == "pyfuse3" and ":all:" not in download, download


def test_the_install_scripts_are_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck not installed (scripts/test.sh installs it)")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    scripts = [SCRIPTS / "install.sh", SCRIPTS / "test.sh", SCRIPTS / "passthrough" / "build.sh"]
    done = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
