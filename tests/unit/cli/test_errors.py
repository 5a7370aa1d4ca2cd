"""What the ``liquidfs`` command says when it cannot do what it was asked (issue 31): one line that names the
path, the cause and what to do, exit status 1, never a traceback; quiet in a pipe whose reader went away.

The store cases run ``cli.main`` in this process with the effective uid of nobody (65534): root passes every
permission check, so a store root cannot write is only met as another user. The process's python is not always
executable by others (a venv's interpreter under /root), so the user is switched in-process, not by exec."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from liquidfs import cli
from liquidfs.cli import mount as cli_mount
from liquidfs.daemon import control
from liquidfs.daemon.config import MountConfig, MountError
from liquidfs.daemon.spawn import spawn_daemon
from liquidfs.catalog.catalog import CATALOG_NAME, default_store_dir
from deployhelpers import force_unmount
from sample import make_sample

NOBODY = 65534

Run = Callable[..., tuple[int, str]]

#: What the commands import when they run: imported as root first, since nobody may not be able to read the
#: interpreter's own library (a pyenv build under /root).
_LAZY_IMPORTS = ("liquidfs.prepare", "liquidfs.daemon.serve", "liquidfs.stores.local", "liquidfs.profile.choose", "multiprocessing",
                 "concurrent.futures.process", "hashlib", "select", "sqlite3", "resource")


@pytest.fixture
def run(restore_logging: None, capsys: pytest.CaptureFixture[str]) -> Run:
    """``run(*argv)``: ``cli.main`` in this process; (exit status, stderr). The umask it sets is put back."""
    def call(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        umask = os.umask(0o022)
        try:
            status = cli.main(list(argv))
        finally:
            os.umask(umask)
        return status, capsys.readouterr().err

    return call


@contextmanager
def _acting_as(uid: int) -> Iterator[None]:
    groups = os.getgroups()
    os.setgroups([])  # root's group would otherwise still open what is group-readable by root
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


@pytest.fixture
def as_nobody() -> Callable[[], AbstractContextManager[None]]:
    """``with as_nobody(): ...`` runs with the effective uid and gid of nobody; needs root (as CI runs)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the permission tests act as nobody: they need root")
        pytest.skip("needs root (acts as nobody to meet the permission checks root is exempt from)")
    for name in _LAZY_IMPORTS:
        importlib.import_module(name)
    return lambda: _acting_as(NOBODY)


@pytest.fixture
def public() -> Iterator[Path]:
    """A directory nobody can reach (pytest's tmp_path is root's only), with a small dataset in ``data`` and a
    directory of nobody's own in ``mine`` (an empty mount point in ``mine/mnt``)."""
    path = Path(tempfile.mkdtemp(prefix="liquidfs-cli-", dir="/tmp"))
    try:
        path.chmod(0o755)
        make_sample(path / "data", count=2, width=64, height=32, seed=5)
        for dirpath, dirnames, filenames in os.walk(path / "data"):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o755)
            for name in filenames:
                os.chmod(os.path.join(dirpath, name), 0o644)
        (path / "mine" / "mnt").mkdir(parents=True)
        for p in (path / "mine", path / "mine" / "mnt"):
            os.chown(p, NOBODY, NOBODY)
        yield path
    finally:
        shutil.rmtree(path)


def _one_line(status: int, err: str) -> str:
    assert status == 1, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def _root_prepared(run: Run, public: Path, name: str) -> Path:
    """A store prepared by root as the CLI makes it: owner-only (a 0700 directory, a 0600 catalog)."""
    store = public / name
    status, err = run("prepare", str(public / "data"), "--store", str(store), "--ratio", "1", "--no-progress")
    assert status == 0, err
    assert (store / CATALOG_NAME).stat().st_mode & 0o777 == 0o600
    return store


# -- stores that cannot be written or read ------------------------------------------------------------------------


def test_prepare_into_a_directory_the_user_cannot_write_is_one_line_naming_it(
        run: Run, public: Path, as_nobody: Callable[[], AbstractContextManager[None]]) -> None:
    (public / "rootonly").mkdir(mode=0o755)  # as /var/lib is
    store = public / "rootonly" / "store"
    with as_nobody():
        err = _one_line(*run("prepare", str(public / "data"), "--store", str(store), "--ratio", "0.5",
                             "--no-progress"))
    assert str(store) in err and "Permission denied" in err and "--store" in err


def test_mount_and_prepare_with_a_store_in_a_0555_directory_are_one_line_each(
        run: Run, public: Path, as_nobody: Callable[[], AbstractContextManager[None]]) -> None:
    readonly = public / "mine" / "r555"
    readonly.mkdir()
    os.chown(readonly, NOBODY, NOBODY)
    readonly.chmod(0o555)
    store = readonly / "store"
    with as_nobody():
        mounted = _one_line(*run("mount", str(public / "data"), str(public / "mine" / "mnt"), "--store", str(store)))
        prepared = _one_line(*run("prepare", str(public / "data"), "--store", str(store), "--ratio", "0.5",
                                  "--no-progress"))
    for err in (mounted, prepared):
        assert str(store) in err and "Permission denied" in err and "--store" in err


def test_a_store_read_only_to_the_user_mounts_with_log_file_and_the_error_says_so(
        run: Run, public: Path, as_nobody: Callable[[], AbstractContextManager[None]]) -> None:
    store = _root_prepared(run, public, "shared-store")
    for dirpath, _, filenames in os.walk(store):  # readable by all, writable by root only
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    with as_nobody():
        err = _one_line(*run("mount", str(public / "data"), str(public / "mine" / "mnt"), "--store", str(store)))
    assert str(store / "mount.log") in err and "Permission denied" in err and "--log-file" in err


@pytest.mark.parametrize("store_mode", [0o700, 0o755], ids=["owner-only-store", "open-store-0600-catalog"])
def test_a_store_prepared_by_root_is_named_as_roots_to_another_user(
        run: Run, public: Path, as_nobody: Callable[[], AbstractContextManager[None]], store_mode: int) -> None:
    store = _root_prepared(run, public, "root-store")
    store.chmod(store_mode)
    with as_nobody():
        errs = [
            _one_line(*run("mount", str(public / "data"), str(public / "mine" / "mnt"), "--store", str(store))),
            _one_line(*run("prepare", str(public / "data"), "--store", str(store), "--ratio", "1", "--no-progress")),
            _one_line(*run("verify", "--store", str(store), "--no-progress")),
        ]
    for err in errs:
        assert str(store) in err and "Permission denied" in err, err
        assert "uid 0" in err and "owner-only" in err and "--store" in err, err
        assert "not a liquidfs catalog" not in err, err


def test_the_default_store_under_a_home_the_user_cannot_write_says_to_give_store(
        run: Run, public: Path, as_nobody: Callable[[], AbstractContextManager[None]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    home = public / "roothome"
    home.mkdir(mode=0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert str(home) in str(default_store_dir(public / "data"))
    with as_nobody():
        err = _one_line(*run("mount", str(public / "data"), str(public / "mine" / "mnt")))
    assert str(home) in err and "Permission denied" in err and "--store" in err and "default" in err


def test_any_permission_error_ends_in_one_line_with_the_path(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(args: object) -> int:
        raise PermissionError(13, "Permission denied", b"/srv/x\xff/catalog.sqlite")

    monkeypatch.setattr(cli_mount, "cmd_stats", refused)
    err = _one_line(*run("stats", "/mnt/x"))
    assert err.startswith("liquidfs stats: /srv/x") and "Permission denied" in err and "b'" not in err

    def full(args: object) -> int:
        raise OSError(28, "No space left on device", "/srv/store/objects/ab/x.bmp")

    monkeypatch.setattr(cli_mount, "cmd_stats", full)
    err = _one_line(*run("stats", "/mnt/x"))
    assert "/srv/store/objects/ab/x.bmp: No space left on device" in err


# -- wrong words ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["prepare", "mount"])
def test_a_missing_source_is_named_plainly(run: Run, tmp_path: Path, command: str) -> None:
    missing = tmp_path / "nope"
    argv = ["prepare", str(missing), "--store", str(tmp_path / "st"), "--ratio", "0.5", "--no-progress"] \
        if command == "prepare" else ["mount", str(missing), str(tmp_path), "--store", str(tmp_path / "st")]
    err = _one_line(*run(*argv))
    assert f"source {missing}: no such directory" in err
    assert "Errno" not in err and "b'" not in err
    assert not (tmp_path / "st").exists()  # a typo makes no store


@pytest.mark.parametrize("command", ["prepare", "mount"])
@pytest.mark.parametrize("inside", ["store-in-source", "source-in-store", "same"])
def test_a_store_and_a_source_that_contain_each_other_are_refused(run: Run, tmp_path: Path, command: str,
                                                                   inside: str) -> None:
    """A store in its source showed in the mount and made every scan find the source changed; a source in its
    store was among what a prepare removes as unused."""
    top = tmp_path / "top"
    (top / "inner").mkdir(parents=True)
    source, store = {"store-in-source": (top, top / "inner"), "source-in-store": (top / "inner", top),
                     "same": (top, top)}[inside]
    (tmp_path / "link").symlink_to(store)  # named through a link: compared where it leads
    argv = ["prepare", str(source), "--store", str(tmp_path / "link"), "--ratio", "0.5", "--no-progress"] \
        if command == "prepare" else ["mount", str(source), str(tmp_path / "mnt"), "--store", str(tmp_path / "link")]
    (tmp_path / "mnt").mkdir()
    try:
        err = _one_line(*run(*argv))
    finally:
        force_unmount(tmp_path / "mnt")  # (a mount made where it should have been refused: not left behind)
    assert "must not contain each other" in err, err
    assert sorted(p.name for p in top.rglob("*")) == ["inner"]  # nothing written in either


def test_a_store_path_that_is_not_utf8_is_refused_in_one_line(run: Run, tmp_path: Path) -> None:
    """SQLite takes a catalog's name as UTF-8: a store named in other bytes built once, then every open of it
    (every mount, every later prepare) ended in a UnicodeEncodeError traceback."""
    (tmp_path / "src").mkdir()
    store = os.fsdecode(os.fsencode(str(tmp_path)) + b"/st\xff")
    err = _one_line(*run("prepare", str(tmp_path / "src"), "--store", store, "--ratio", "0", "--no-progress"))
    assert "the store's path is not UTF-8" in err and "Traceback" not in err, err
    assert not os.path.lexists(store)


def test_umount_of_a_path_that_does_not_exist_says_so(run: Run, tmp_path: Path) -> None:
    err = _one_line(*run("umount", str(tmp_path / "nope")))
    assert f"{tmp_path / 'nope'} does not exist" in err


@pytest.mark.parametrize("size", ["150%", "100.5%", "-5%", "nan%"])
def test_a_cache_share_outside_0_to_100_percent_is_refused(run: Run, tmp_path: Path, size: str) -> None:
    (tmp_path / "data").mkdir()
    # refused before the mount point is looked at (a missing one here: nothing is mounted if it is not)
    err = _one_line(*run("mount", str(tmp_path / "data"), str(tmp_path / "mnt"), "--store", str(tmp_path / "st"),
                         f"--cache-size={size}"))
    assert "--cache-size" in err and size in err


@pytest.mark.parametrize("args, said", [
    (["--cluster-size", "50%"], "--cluster-size needs --cluster"),
    (["--cluster", "redis://h:1", "--cluster-size", "50%"], "expected memcached://HOST:PORT"),
    (["--cluster", "memcached://h:1,h:1", "--cluster-size", "50%"], "names a memcached twice"),
    (["--cluster", "memcached://h:1", "--cluster-size", "150%"], "--cluster-size"),
])
def test_a_cluster_is_named_whole_or_refused_in_one_line(run: Run, tmp_path: Path, args: list[str],
                                                         said: str) -> None:
    (tmp_path / "data").mkdir()
    err = _one_line(*run("mount", str(tmp_path / "data"), str(tmp_path / "mnt"), "--store", str(tmp_path / "st"),
                         *args))
    assert said in err


@pytest.mark.parametrize("mode, data, said", [
    (0o644, os.urandom(32), "mode 0644 lets group or others read or write the key"),
    (0o400, os.urandom(32).hex().encode(), "holds 64 bytes; a key is exactly 32 raw random bytes"),
    (0o400, bytes(32), "not random"),
], ids=["group-readable", "hex-text", "zeros"])
def test_a_cluster_key_file_that_vouches_for_nothing_is_refused_in_one_line(run: Run, tmp_path: Path, mode: int,
                                                                             data: bytes, said: str) -> None:
    (tmp_path / "data").mkdir()
    key = tmp_path / "key"
    key.write_bytes(data)
    key.chmod(mode)
    mount = ["mount", str(tmp_path / "data"), str(tmp_path / "mnt"), "--store", str(tmp_path / "st")]
    err = _one_line(*run(*mount, "--cluster", "memcached://127.0.0.1:11211", "--cluster-size", "50%",
                         "--cluster-key-file", str(key)))
    assert "--cluster-key-file" in err and said in err
    err = _one_line(*run(*mount, "--cluster-key-file", str(key)))
    assert "--cluster-key-file goes with --cluster" in err


def test_umount_refuses_a_mount_that_is_not_liquidfs(run: Run, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from liquidfs.daemon import watchdog as guard

    ran: list[list[str]] = []
    monkeypatch.setattr(guard, "topmost_mount", lambda path: (b"fuse.sshfs", 0, 1))
    monkeypatch.setattr(os.path, "ismount", lambda path: True)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    err = _one_line(*run("umount", str(tmp_path)))
    assert "fuse.sshfs" in err and "not a liquidfs mount" in err
    assert ran == []  # fusermount3 never ran: as root it unmounts anything


# -- mount: --allow-other, and a daemon that fails at once --------------------------------------------------------


def test_allow_other_without_user_allow_other_is_refused_before_the_mount_starts(
        run: Run, public: Path, as_nobody: Callable[[], AbstractContextManager[None]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    conf = public / "fuse.conf"
    conf.write_text("# user_allow_other\nmount_max = 1000\n")
    monkeypatch.setattr(control, "FUSE_CONF", conf)
    store = public / "mine" / "store"
    for flags in (["--allow-other"], ["-o", "ro,allow_other"]):
        with as_nobody():
            err = _one_line(*run("mount", str(public / "data"), str(public / "mine" / "mnt"), "--store", str(store),
                                 *flags))
        assert "user_allow_other" in err and str(conf) in err
        assert not store.exists()  # said before a catalog is built
    conf.write_text("user_allow_other\n")
    with as_nobody():  # allowed: the mount goes on, and fails on the missing mount point instead
        err = _one_line(*run("mount", str(public / "data"), str(public / "mine" / "nope"), "--store", str(store),
                             "--allow-other"))
    assert "does not exist" in err


def test_a_daemon_that_fails_at_once_is_reported_with_its_reason_and_this_runs_lines_only(tmp_path: Path) -> None:
    log_file = tmp_path / "mount.log"
    log_file.write_text("".join(f"an earlier mount's line {i}\n" for i in range(40)))
    (tmp_path / "mnt").mkdir()
    with pytest.raises(MountError) as failed:
        # a daemon finds the catalog its parent made ready: there is none, so it says so and exits 1 at once
        config = MountConfig(source=str(tmp_path), mountpoint=tmp_path / "mnt", store=str(tmp_path / "st"))
        spawn_daemon(["mount", str(tmp_path), str(tmp_path / "mnt"), "--log-file", str(log_file),
                            "--daemon-config", config.to_json()], log_file)
    text = str(failed.value)
    assert text.splitlines()[0] == f"no catalog at {tmp_path / 'st' / CATALOG_NAME}", text
    assert "did not answer" not in text and "earlier mount" not in text
    assert "status 1" in text


# -- a reader that goes away ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["doctor"], ["doctor", "--json"], ["--help"], ["mount", "--help"], ["--version"]],
                         ids=" ".join)
def test_a_command_printing_into_a_closed_pipe_ends_quietly(argv: list[str]) -> None:
    with subprocess.Popen([sys.executable, "-m", "liquidfs", *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # as `| head -0` does: the reader is gone before the command prints
        err = proc.stderr.read().decode()
        status = proc.wait(60)
    assert err == "", err
    assert status in (0, 141)  # 0: argparse's own output (help, version) ignores a closed pipe


@pytest.mark.parametrize("size", ["150%", "-5%", "abc%", "30"])
@pytest.mark.parametrize("command", ["profile", "prepare"])
def test_profile_and_prepare_take_a_cache_share_from_0_to_100_percent_only(tmp_path: Path, size: str,
                                                                           command: str) -> None:
    done = subprocess.run([sys.executable, "-m", "liquidfs", command, str(tmp_path / "data"), "--store",
                           str(tmp_path / "st"), f"--cache-size={size}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--cache-size: a percentage from 0% to 100%" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "st").exists()


@pytest.mark.parametrize("flag", ["--threads=-1", "--threads=0", "--sample=0", "--run-timeout=nan",
                                  "--run-timeout=inf", "--target-rate=-3",
                                  "--gpu-train-rate=1e-320"])  # (its time, 1/rate, is inf: JSON's Infinity)
def test_profile_refuses_counts_and_times_out_of_range_with_a_message(tmp_path: Path, flag: str) -> None:
    """A thread count below one, a NaN time-out: a message at once, never a traceback from deep in the run."""
    done = subprocess.run([sys.executable, "-m", "liquidfs", "profile", str(tmp_path / "data"), "--store",
                           str(tmp_path / "st"), flag], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and flag.split("=")[0] in done.stderr and "a positive" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "st").exists()


@pytest.mark.parametrize("argv", [["profile", "--threads=5000"], ["profile", "--readers=100000"],
                                  ["prepare", "--jobs=100000"], ["verify", "--jobs=100000"]])
def test_a_thread_reader_or_job_count_past_the_bound_is_a_typo_refused_at_once(tmp_path: Path,
                                                                                argv: list[str]) -> None:
    """Each is a thread or a process started, and the profile's sample holds four images a reader in memory:
    ``--jobs 100000`` is a typo, refused before anything starts."""
    command = [argv[0], str(tmp_path / "data"), "--store", str(tmp_path / "st")] if argv[0] != "verify" \
        else [argv[0], str(tmp_path / "st")]
    done = subprocess.run([sys.executable, "-m", "liquidfs", *command, argv[1]], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and argv[1].split("=")[0] in done.stderr and "at most 4096" in done.stderr, \
        done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "st").exists()


def test_profiles_threads_are_the_cores_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not os.cpu_count(): in a pod limited to 4 of 64 cores, 64 readers and 64 cores of decoding chose too much
    raw. The default is ``sysio.cgroups.usable_cores`` (affinity, then the cgroup's cpu.max)."""
    from liquidfs.profile import choose

    asked: list[tuple[object, object]] = []
    monkeypatch.setattr(choose, "usable_cores", lambda: 3)

    def measured(store: object, count: object, max_bytes: object, decoder: object, threads: object,
                 readers: object, *rest: object, **kw: object) -> None:
        asked.append((threads, readers))
        raise RuntimeError("measured enough")

    monkeypatch.setattr(choose, "_measure_bmp", measured)
    with pytest.raises(RuntimeError, match="measured enough"):
        choose.profile_store(object(), decoder="pil")  # type: ignore[arg-type]
    assert asked == [(3, 3)]


def test_prepare_takes_a_cache_share_only_to_choose_the_ratio(run: Run, tmp_path: Path) -> None:
    make_sample(tmp_path / "data", count=2, width=64, height=32, seed=5)
    status, err = run("prepare", str(tmp_path / "data"), "--store", str(tmp_path / "st"), "--ratio", "0.5",
                      "--cache-size", "30%")
    assert status == 2 and "--cache-size weighs the mount's cache for --ratio auto" in err
    assert not (tmp_path / "st").exists()


def test_a_full_disk_while_the_catalog_is_written_is_one_line(run: Run, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's "database or disk is full" while a catalog is built (the build's writer) or updated (prepare's
    records): one line that names the catalog's trouble, no traceback, and no catalog in the making left."""
    from liquidfs.catalog import build as build_module
    from liquidfs.catalog.catalog import Catalog

    make_sample(tmp_path / "data", count=2, width=64, height=32, seed=5)

    class _FullDisk(build_module.LocalSink):  # type: ignore[misc,valid-type]
        def many(self, statement: str, rows: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

    with monkeypatch.context() as patched:
        patched.setattr(build_module, "LocalSink", _FullDisk)
        err = _one_line(*run("prepare", str(tmp_path / "data"), "--store", str(tmp_path / "st"), "--ratio", "1",
                             "--no-progress"))
    assert "disk is full" in err and str(tmp_path / "st") in err, err
    assert [p.name for p in (tmp_path / "st").iterdir() if "new" in p.name] == []

    def full(self: Catalog, *args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Catalog, "record_expansions", full)
    err = _one_line(*run("prepare", str(tmp_path / "data"), "--store", str(tmp_path / "st"), "--ratio", "1",
                         "--no-progress"))
    assert "catalog: database or disk is full" in err, err


def test_sigterm_ends_a_command_as_ctrl_c_does_and_nohup_keeps_sighup_ignored() -> None:
    """SIGTERM in a command that cleans up (prepare, profile, verify, mount) raises where it lands, so its
    clean-up runs; its status says which signal. A SIGHUP ignored when it started (`nohup liquidfs prepare &`)
    stays ignored: closing the terminal must not stop hours of work. The handlers before are restored after."""
    import signal

    from liquidfs.cli.main import Terminated, _terminated_raises

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as ended, _terminated_raises("prepare"):
        os.kill(os.getpid(), signal.SIGTERM)
    assert ended.value.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _terminated_raises("prepare"):
            os.kill(os.getpid(), signal.SIGHUP)  # nohup's: nothing happens
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    with _terminated_raises("mount", daemon=True):  # a mount's daemon: its own handlers, none of these
        assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("signal_name", ["KeyboardInterrupt", "Terminated"])
def test_a_mount_interrupted_once_its_daemon_said_ready_exits_0(restore_logging: None, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str],
                                                              signal_name: str) -> None:
    """Ctrl-C or SIGTERM while the command asked the new mount which data path it serves through (up to 10 s):
    it exited 130 or 143 with the mount made and serving, and a script that mounted again got 'already mounted'."""
    from liquidfs.cli.main import Terminated

    src = make_sample(tmp_path / "data", count=2, width=32, height=16, seed=3)
    (tmp_path / "mnt").mkdir()
    spawned: list[list[str]] = []
    from liquidfs.daemon import spawn

    monkeypatch.setattr(spawn, "spawn_daemon", lambda argv, log_file, mountpoint: spawned.append(argv))

    def interrupted(mountpoint: Path) -> str:
        raise Terminated(signal.SIGTERM) if signal_name == "Terminated" else KeyboardInterrupt()

    monkeypatch.setattr(cli_mount, "_data_path_said", interrupted)
    status = cli.main(["mount", str(src), str(tmp_path / "mnt"), "--store", str(tmp_path / "store")])
    out = capsys.readouterr()
    assert status == 0 and len(spawned) == 1, out.err
    assert f"mounted on {tmp_path / 'mnt'}" in out.out and "data path: see `liquidfs stats`" in out.out


def test_prepare_and_verify_import_nothing_from_the_directory_they_run_in(tmp_path: Path) -> None:
    """multiprocessing's forkserver and resource tracker run as ``python -c``, whose import path starts with the
    working directory: root's prepare run in a directory a dataset's writer may write (the source, /tmp) ran
    their ``multiprocessing/__init__.py`` as root."""
    src = make_sample(tmp_path / "data", count=3, width=32, height=16, seed=4)
    planted = tmp_path / "planted"
    (planted / "multiprocessing").mkdir(parents=True)
    marker = tmp_path / "ran"
    (planted / "multiprocessing" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'a').write('planted code ran\\n')\nraise ImportError('planted')\n")
    command = Path(sys.executable).parent / "liquidfs"  # the console script, as a user runs it
    for argv in (["prepare", str(src), "--store", str(tmp_path / "store"), "--ratio", "1", "--no-progress"],
                 ["verify", "--store", str(tmp_path / "store"), "--no-progress"]):
        done = subprocess.run([str(command), *argv], cwd=planted, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert not marker.exists(), marker.read_text()


@pytest.mark.parametrize("case", ["dali", "json-dir", "plot-nowhere"])
def test_profile_refuses_what_would_fail_after_its_measurements_before_them(run: Run, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            case: str) -> None:
    """--decoder dali without DALI ended in an ImportError's traceback once the sample was expanded and storage
    timed; a --json naming a directory, or a --plot in no directory, failed at the end (naming a temporary file
    of its own). Each is one line at once, and nothing is made."""
    from liquidfs.profile import decoders

    src = make_sample(tmp_path / "data", count=3, width=32, height=16, seed=2)
    monkeypatch.setattr(decoders, "dali_available", lambda: False)
    args = {"dali": ["--decoder", "dali"], "json-dir": ["--decoder", "pil", "--json", str(tmp_path)],
            "plot-nowhere": ["--decoder", "pil", "--plot", str(tmp_path / "none" / "p.png")]}[case]
    status, err = run("profile", str(src), "--store", str(tmp_path / "store"), *args)
    said = {"dali": "DALI is not installed", "json-dir": "a directory", "plot-nowhere": "no directory"}[case]
    assert status == 1 and said in err and "Traceback" not in err, err
    assert not (tmp_path / "store").exists()
