"""``liquidfs doctor``: each ingredient of the passthrough path read from what the machine shows."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from liquidfs.cli.doctor import (capability_check, checks, kernel_check, kernel_config_check, store_check, verdict,
                                 verity_check)

ROOT_STATUS = "Name:\tx\nCapEff:\t000001ffffffffff\n"
NO_ADMIN = "Name:\tx\nCapEff:\t0000000000000000\n"
INITIAL = "         0          0 4294967295\n"


def test_kernel_versions() -> None:
    assert kernel_check("6.18.44-fc").ok
    assert kernel_check("6.9.0").ok
    assert not kernel_check("6.8.12-generic").ok
    assert not kernel_check("5.15.0").ok


def test_kernel_config_lines() -> None:
    assert kernel_config_check("CONFIG_FUSE_FS=y\nCONFIG_FUSE_PASSTHROUGH=y\n").ok
    assert kernel_config_check("CONFIG_FUSE_FS=y\n# CONFIG_FUSE_PASSTHROUGH is not set\n").ok is False
    assert "without CONFIG_FS_VERITY" in verity_check("# CONFIG_FS_VERITY is not set\n").found
    assert "has CONFIG_FS_VERITY" in verity_check("CONFIG_FS_VERITY=y\n").found


def test_cap_sys_admin_in_the_initial_user_namespace_only() -> None:
    assert capability_check(ROOT_STATUS, INITIAL).ok
    assert not capability_check(NO_ADMIN, INITIAL).ok
    inside = capability_check(ROOT_STATUS, "         0       1000          1\n")
    assert not inside.ok and "user namespace" in inside.found


def test_verdict_names_what_is_missing() -> None:
    found = checks()
    text = verdict(found)
    missing = [c for c in found if c.ok is False]
    assert text.startswith("daemon path") == bool(missing)
    for c in missing:
        assert c.name in text


@pytest.mark.needs_root("doctor's verdict is passthrough only with CAP_SYS_ADMIN")
def test_the_command_says_the_same_as_json(tmp_path) -> None:
    done = run_cli("doctor", "--store", str(tmp_path), "--json")
    values = json.loads(done.stdout)
    names = [c["name"] for c in values["checks"]]
    assert names[:5] == ["kernel", "CONFIG_FUSE_PASSTHROUGH", "libfuse", "pyfuse3 passthrough patch",
                         "CAP_SYS_ADMIN"] and "store filesystem" in names
    # this suite runs where passthrough is built and granted (CI: root on a 6.x kernel, install.sh's pyfuse3)
    assert values["verdict"].startswith("passthrough"), values
    text = run_cli("doctor").stdout
    assert "passthrough" in text.splitlines()[-1]


def test_doctor_reports_what_it_cannot_load_or_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A machine without libfuse3 (pyfuse3 does not load) is what doctor is run on: each check says so, not a
    traceback. A kernel config that is a torn gzip is no config; one in another encoding is read as it is."""
    import builtins
    import gzip

    from liquidfs.cli import doctor

    real_import = builtins.__import__

    def no_pyfuse3(name: str, *args: object, **kwargs: object) -> object:
        if name == "pyfuse3":
            raise ImportError("libfuse3.so.3: cannot open shared object file")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as patched:
        patched.delitem(sys.modules, "pyfuse3", raising=False)
        patched.setattr(builtins, "__import__", no_pyfuse3)
        for check in (doctor.libfuse_check(), doctor.pyfuse3_check()):
            assert check.ok is False and "libfuse3.so.3" in check.found
    torn = tmp_path / "config.gz"
    torn.write_bytes(gzip.compress(b"CONFIG_FUSE_PASSTHROUGH=y\n")[:-6])
    latin = tmp_path / "config"
    latin.write_bytes(b"# caf\xe9\nCONFIG_FUSE_PASSTHROUGH=y\n")
    paths = iter([torn, latin])
    monkeypatch.setattr(doctor, "Path", lambda *a: next(paths))
    assert "CONFIG_FUSE_PASSTHROUGH=y" in (doctor._kernel_config() or "")


def test_a_store_not_made_yet_is_said_so_with_the_filesystem_it_would_be_made_on(tmp_path: Path) -> None:
    """It read as a store found on that filesystem: ``doctor --store /typo`` approved a store that is not there."""
    check = store_check(tmp_path / "not" / "yet")
    assert f"{tmp_path / 'not' / 'yet'} is not there yet: made on {tmp_path}'s" in check.found, check
    assert "not there" not in store_check(tmp_path).found


@pytest.mark.needs_root("a directory nobody may search")
def test_a_store_below_a_directory_the_user_may_not_search_is_no_traceback(tmp_path: Path) -> None:
    """``Path.exists`` raised PermissionError there, and ``doctor`` ended in one error line, none of its checks."""
    private = tmp_path / "private"
    (private / "store").mkdir(parents=True)
    private.chmod(0o700)
    tmp_path.chmod(0o755)
    os.setegid(65534)
    os.seteuid(65534)
    try:
        check = store_check(private / "store")
    finally:
        os.seteuid(0)
        os.setegid(0)
    assert "not there yet" not in check.found and str(private / "store") in check.found, check
