"""Deployment assets under mount/: the fstab helper (mount/mount.fuse.liquidfs) and install-host.sh.

Fast tests run the helper with a fake `liquidfs` that records its argv. One test touches the real system (run it
as root): ``test_fstab_mount_real`` (``fuse``) installs mount/mount.fuse.liquidfs as /sbin/mount.fuse.liquidfs for
the duration of the test and mounts a temp dir with ``mount -t fuse.liquidfs``. With CI set, it fails instead of
skipping when it cannot run (saying why); elsewhere it skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from deployhelpers import (MOUNT_DIR, assert_same_dataset, force_unmount, is_fuse_mounted, make_source_tree,
                           mounts_at, run, skip_or_fail)

HELPER = MOUNT_DIR / "mount.fuse.liquidfs"
INSTALL_HOST = MOUNT_DIR / "install-host.sh"


@pytest.fixture
def fake_liquidfs(tmp_path: Path):
    """A fake `liquidfs` that records its argv (NUL-separated) and exits with $FAKE_RC."""
    record = tmp_path / "argv"
    fake = tmp_path / "fake-liquidfs"
    fake.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$FAKE_ARGV"\nexit "${FAKE_RC:-0}"\n')
    fake.chmod(0o755)

    def invoke(*args: str, liquidfs: str | None = None, rc: int = 0) -> tuple[subprocess.CompletedProcess, list[str] | None]:
        record.unlink(missing_ok=True)
        env = dict(os.environ, LIQUIDFS=liquidfs or str(fake), FAKE_ARGV=str(record), FAKE_RC=str(rc))
        proc = run([str(HELPER), *args], env=env, timeout=30)
        argv = record.read_bytes().decode().split("\0")[:-1] if record.exists() else None
        return proc, argv

    invoke.fake = fake
    return invoke


def test_helper_is_executable_posix_sh():
    assert os.access(HELPER, os.X_OK), "mount/mount.fuse.liquidfs must be executable (git mode 100755)"
    assert HELPER.read_text().startswith("#!/bin/sh\n")
    assert os.access(INSTALL_HOST, os.X_OK), "mount/install-host.sh must be executable"


@pytest.mark.parametrize(("opts", "expected"), [
    (["-o", ("store=/nvme/liquid,cache_size=30%,allow_other,ro,nofail,_netdev,x-systemd.automount,"
             "x-systemd.requires=network-online.target")],
     ["--store", "/nvme/liquid", "--cache-size", "30%", "--allow-other"]),
    (["-o", "defaults,rw,auto,noauto,nouser,nofail,_netdev,comment=x-gvfs-show,x-gvfs-name=data"], []),
    # The kernel's flags: mount(8) leaves them to the helper (a `noexec` dropped would be an exec-able mount).
    (["-o", "user,users,owner,group,user=alice,dev,nodev,suid,nosuid,exec,noexec"],
     ["-o", "nosuid,nodev,noexec"]),
    (["-o", "noexec,fsname=imagenet"], ["-o", "fsname=imagenet,noexec"]),
    (["-o", "user"], ["-o", "nosuid,nodev,noexec"]),           # as mount(8): user implies all three
    (["-o", "users,exec,dev"], ["-o", "nosuid"]),               # undone by what comes after
    (["-o", "owner"], ["-o", "nosuid,nodev"]),
    (["-o", "exec,suid,dev"], []),                             # never passed on: libfuse's defaults stand
    (["-o", "cache-size=24G,metrics_port=9180,log_level=debug,log_file=/var/log/liquidfs.log"],
     ["--cache-size", "24G", "--metrics-port", "9180", "--log-level", "debug", "--log-file", "/var/log/liquidfs.log"]),
    (["-o", "store=/a,fsname=imagenet,noatime", "-o", "allow_other,default_permissions"],  # -o given twice
     ["--store", "/a", "--allow-other", "-o", "fsname=imagenet,noatime,default_permissions"]),
    (["-o", "io_timeout=30,threads=8,warmup"], ["--io-timeout", "30", "--threads", "8", "--warmup"]),
    # every flag of mount that takes a value (passed on to FUSE, mix=adaptive failed inside the daemon)
    (["-o", "mix=adaptive,loops=4,data_path=passthrough,page-cache=keep,disk_cache=/d,disk_cache_size=10G"],
     ["--mix", "adaptive", "--loops", "4", "--data-path", "passthrough", "--page-cache", "keep", "--disk-cache",
      "/d", "--disk-cache-size", "10G"]),
    (["-o", "cluster=memcached://h:11211,cluster_size=5G,verify_reads,no_lookahead"],
     ["--cluster-size", "5G", "--verify-reads", "--no-lookahead", "--cluster", "memcached://h:11211"]),
    # several memcacheds: a comma ends an fstab option, so one cluster= each, gathered into one --cluster
    (["-o", "cluster=memcached://a:11211,cluster=memcached://[fd00::2]:11212", "-o", "cluster=memcached://c"],
     ["--cluster", "memcached://a:11211,[fd00::2]:11212,c"]),
    (["-o", "time_requests"], ["--time-requests"]),
    (["-ostore=/with space/x,,ro"], ["--store", "/with space/x"]),                       # attached -oOPTS
    (["-s", "-n", "-t", "fuse.liquidfs", "-o", "allow_other"], ["--allow-other"]),        # flags mount(8) passes
    (["-sn", "-tfuse.liquidfs"], []),
    ([], []),
])
def test_helper_translates_options(fake_liquidfs, opts: list[str], expected: list[str]):
    proc, argv = fake_liquidfs("/data/src", "/mnt/dst", *opts)
    assert proc.returncode == 0, proc.stderr
    assert argv == ["mount", "/data/src", "/mnt/dst", *expected]


def test_helper_source_forms(fake_liquidfs):
    proc, argv = fake_liquidfs("liquidfs#/data/it's here", "/mnt/x", "-o", "ro")  # old `-t fuse` spec form
    assert proc.returncode == 0, proc.stderr
    assert argv == ["mount", "/data/it's here", "/mnt/x"]
    proc, argv = fake_liquidfs("-o", "allow_other", "--", "/src", "/mnt/x")         # options first, then --
    assert proc.returncode == 0, proc.stderr
    assert argv == ["mount", "/src", "/mnt/x", "--allow-other"]


def test_helper_multiword_command_and_exit_status(fake_liquidfs):
    proc, argv = fake_liquidfs("/src", "/mnt/x", "-o", "allow_other", liquidfs=f"{fake_liquidfs.fake} --flag")
    assert proc.returncode == 0, proc.stderr
    assert argv == ["--flag", "mount", "/src", "/mnt/x", "--allow-other"]
    proc, _ = fake_liquidfs("/src", "/mnt/x", rc=32)
    assert proc.returncode == 32, "liquidfs's exit status must reach mount(8)"


def test_helper_fake_and_verbose(fake_liquidfs):
    proc, argv = fake_liquidfs("/s p", "/mnt/x", "-f", "-v", "-o", "store=/st,allow_other,nofail")
    assert proc.returncode == 0, proc.stderr
    assert argv is None, "-f must not run liquidfs"
    assert proc.stderr.strip() == f"{fake_liquidfs.fake} mount '/s p' /mnt/x --store /st --allow-other"
    proc, argv = fake_liquidfs("/src", "/mnt/x", "-fv")
    assert argv is None and "mount /src /mnt/x" in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    ([], "usage"),
    (["/src"], "usage"),
    (["/src", "/mnt/x", "/extra"], "unexpected argument"),
    (["/src", "/mnt/x", "-N", "/proc/1/ns/mnt"], "not supported"),
    (["/src", "/mnt/x", "-o", "store="], "needs a value"),
    (["/src", "/mnt/x", "-o", "cluster=a:11211"], "one memcached per cluster= option"),
    (["/src", "/mnt/x", "-o", "cluster=memcached://"], "one memcached per cluster= option"),
    (["/src", "/mnt/x", "-q"], "unknown flag"),
    (["/src", "/mnt/x", "-o"], "usage"),
])
def test_helper_rejects_bad_invocations(fake_liquidfs, args: list[str], message: str):
    proc, argv = fake_liquidfs(*args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert argv is None


def test_shell_scripts_shellcheck():
    if shutil.which("shellcheck") is None:
        skip_or_fail("shellcheck not installed (apt-get install shellcheck)")
    run(["shellcheck", "-s", "sh", str(HELPER), str(INSTALL_HOST)], check=True)


def test_install_host_destdir(tmp_path: Path):
    dest = tmp_path / "root"
    env = dict(os.environ, DESTDIR=str(dest), LIQUIDFS_BIN="/opt/liquidfs/bin/liquidfs")
    run(["sh", str(INSTALL_HOST)], env=env, check=True)
    helper = dest / "sbin" / "mount.fuse.liquidfs"
    unit = dest / "etc" / "systemd" / "system" / "liquidfs@.service"
    example = dest / "etc" / "liquidfs" / "example.env"
    assert helper.stat().st_mode & 0o777 == 0o755
    assert unit.stat().st_mode & 0o777 == 0o644
    assert "ExecStart=/opt/liquidfs/bin/liquidfs mount --foreground " in unit.read_text()
    # the --cluster drop-in runs the same liquidfs (a venv's install ran /usr/local/bin/liquidfs there: 203/EXEC)
    dropin = dest / "etc" / "liquidfs" / "liquidfs-cluster.conf"
    assert dropin.stat().st_mode & 0o777 == 0o644
    assert "\nExecStart=/opt/liquidfs/bin/liquidfs mount --foreground " in dropin.read_text()
    assert "/usr/local/bin/liquidfs mount" not in dropin.read_text()
    # the installed helper runs the baked-in liquidfs
    proc = run([str(helper), "/src", "/mnt/x", "-fv", "-o", "allow_other"], env={"PATH": os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "/opt/liquidfs/bin/liquidfs mount /src /mnt/x --allow-other"
    # a second run never overwrites the admin's config
    example.write_text("LIQUIDFS_SOURCE=/mine\n")
    run(["sh", str(INSTALL_HOST)], env=env, check=True)
    assert example.read_text() == "LIQUIDFS_SOURCE=/mine\n"
    # systemd and mount(8) do not search the user's PATH
    proc = run(["sh", str(INSTALL_HOST)], env=dict(env, LIQUIDFS_BIN="liquidfs"))
    assert proc.returncode != 0 and "absolute" in proc.stderr
    # a blank split the command where the helper and ExecStart= run it (the path's first word ran), % is systemd's
    for bad in ("/opt/my venv/bin/liquidfs", "/opt/%i/liquidfs", "/opt/$HOME/liquidfs"):
        proc = run(["sh", str(INSTALL_HOST)], env=dict(env, LIQUIDFS_BIN=bad))
        assert proc.returncode != 0 and "may not contain" in proc.stderr, (bad, proc.stderr)


def test_install_host_writes_its_confdir_where_the_unit_reads_it(tmp_path: Path):
    """CONFDIR chose where the example and the drop-in went, while the unit read /etc/liquidfs/NAME.env (and its
    ConditionPathExists skipped it, silently) and the drop-in /etc/liquidfs/cluster.key."""
    dest = tmp_path / "root"
    env = dict(os.environ, DESTDIR=str(dest), LIQUIDFS_BIN="/opt/liquidfs/bin/liquidfs",
               CONFDIR="/usr/local/etc/liquidfs")
    proc = run(["sh", str(INSTALL_HOST)], env=env)
    assert proc.returncode == 0, proc.stderr
    unit = (dest / "etc" / "systemd" / "system" / "liquidfs@.service").read_text()
    dropin = (dest / "usr" / "local" / "etc" / "liquidfs" / "liquidfs-cluster.conf").read_text()
    assert "ConditionPathExists=/usr/local/etc/liquidfs/%i.env" in unit
    assert "EnvironmentFile=/usr/local/etc/liquidfs/%i.env" in unit
    assert "LoadCredential=cluster-key:/usr/local/etc/liquidfs/cluster.key" in dropin
    assert "/etc/liquidfs/" not in unit.replace("/usr/local/etc/liquidfs/", "")
    assert (dest / "usr" / "local" / "etc" / "liquidfs" / "example.env").exists()
    proc = run(["sh", str(INSTALL_HOST)], env=dict(env, CONFDIR="etc/liquidfs"))
    assert proc.returncode != 0 and "CONFDIR must be an absolute path" in proc.stderr


# ------------------------------------------------------------------------------------------------------
# Real FUSE: fstab helper through mount(8)
# ------------------------------------------------------------------------------------------------------

def _require_fuse_root() -> None:
    if os.geteuid() != 0:
        skip_or_fail("needs root (mount(8) helpers run from /sbin)")
    if not os.path.exists("/dev/fuse"):
        skip_or_fail("/dev/fuse is missing")
    for tool in ("mount", "umount", "fusermount3"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} not installed (apt-get install fuse3 util-linux)")


@pytest.fixture
def sbin_helper():
    """mount/mount.fuse.liquidfs as /sbin/mount.fuse.liquidfs for one test; restores what was there."""
    _require_fuse_root()
    target = Path("/sbin/mount.fuse.liquidfs")
    backup = target.with_name(f".mount.fuse.liquidfs.pytest-{uuid.uuid4().hex[:8]}")
    had = target.exists() or target.is_symlink()
    if had:
        os.rename(target, backup)
    try:
        shutil.copyfile(HELPER, target)
        target.chmod(0o755)
        yield target
    finally:
        target.unlink(missing_ok=True)
        if had:
            os.rename(backup, target)


@pytest.mark.fuse
def test_fstab_mount_real(sbin_helper: Path, tmp_path: Path):
    src, mnt, store = tmp_path / "src", tmp_path / "mnt", tmp_path / "store"
    for d in (src, mnt, store):
        d.mkdir()
    files = make_source_tree(src)
    env = dict(os.environ, LIQUIDFS=f"{sys.executable} -m liquidfs")  # this interpreter's liquidfs
    try:
        proc = run(["mount", "-t", "fuse.liquidfs", str(src), str(mnt), "-o",
                    f"store={store},allow_other,ro,nofail,_netdev,x-systemd.automount,noexec"], env=env, timeout=120)
        assert proc.returncode == 0, f"mount failed:\n{proc.stdout}{proc.stderr}"
        # liquidfs mount (no --foreground) returns only once the mount answers: no waiting here
        assert ("fuse.liquidfs", ) == tuple(t for t, _ in mounts_at(mnt))[-1:], mounts_at(mnt)
        flags = os.statvfs(mnt).f_flag
        assert flags & os.ST_NOEXEC and flags & os.ST_RDONLY, flags  # as fstab asked (nosuid: libfuse's default)
        assert_same_dataset(mnt, files)
        proc = run(["umount", str(mnt)], timeout=60)
        assert proc.returncode == 0, f"umount failed:\n{proc.stdout}{proc.stderr}"
        assert not is_fuse_mounted(mnt)
        assert not os.path.ismount(mnt)
    finally:
        force_unmount(mnt)
