"""Every flag's value read once, in the command (``cli.options``): one reading of a share or a size, and a value
refused in a message that names its flag."""

from __future__ import annotations

import argparse
import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from liquidfs import cli
from liquidfs.cli import options
from liquidfs.cli.options import OptionError, share_or_size
from liquidfs.daemon.config import MountConfig, Share
from liquidfs.stores import Store

STORAGE = cast(Store, SimpleNamespace(default_threads=4, source_label="/data", label="/srv/store"))


def test_a_share_or_a_size_is_read_one_way() -> None:
    assert share_or_size("30%") == Share(0.3)
    assert share_or_size(" 100% ") == Share(1.0) and share_or_size("0%") == Share(0.0)
    assert share_or_size("24G") == 24 << 30 and share_or_size("512M") == 512 << 20
    assert share_or_size("1.5GiB") == int(1.5 * (1 << 30)) and share_or_size("4096") == 4096
    assert share_or_size("0.25", sizes=False, fraction=True) == Share(0.25)
    for bad in ["abc", "-5%", "150%", "nan%", "12X", "", "-1", "inf"]:
        with pytest.raises(ValueError):
            share_or_size(bad)
    with pytest.raises(ValueError, match="not a percentage"):
        share_or_size("30%", percent=False)
    with pytest.raises(ValueError):
        share_or_size("512M", sizes=False, fraction=True)


def test_mix_and_ratio_are_shares_too() -> None:
    assert options.mix("adaptive") == "adaptive" and options.mix("prepared") == "prepared"
    assert options.mix("0.25") == 0.25 and options.mix("40%") == 0.4 and options.mix("0") == 0.0
    for bad in ("1.5", "-0.1", "half", "", "adaptiv", "nan"):
        with pytest.raises(ValueError, match="--mix"):
            options.mix(bad)
    assert options.ratio("auto") == "auto" and options.ratio("0.7") == 0.7 and options.ratio("70%") == 0.7
    with pytest.raises(ValueError, match="within"):
        options.ratio("1.5")
    with pytest.raises(ValueError, match="a number in"):
        options.ratio("most")
    assert options.cache_share("30%") == 0.3
    for bad in ("150%", "-5%", "abc%", "30", "1G"):
        with pytest.raises(ValueError, match="a percentage from 0% to 100%"):
            options.cache_share(bad)


@pytest.mark.parametrize("argv, flag", [
    (["prepare", "/d", "--store", "/s", "--ratio", "2"], "--ratio"),
    (["prepare", "/d", "--store", "/s", "--ratio", "1", "--formats", "webp"], "--formats"),
    (["prepare", "/d", "--store", "/s", "--ratio", "auto", "--cache-size", "150%"], "--cache-size"),
    (["profile", "/d", "--store", "/s", "--cache-size", "30"], "--cache-size"),
    (["profile", "/d", "--store", "/s", "--run-images", "0"], "--run-images"),
    (["profile", "/d", "--store", "/s", "--repeats", "x"], "--repeats"),
    (["mount", "/d", "/m", "--mix", "1.5"], "--mix"),
    (["mount", "/d", "/m", "--page-cache", "some"], "--page-cache"),
    (["mount", "/d", "/m", "--data-path", "kernel"], "--data-path"),
    (["verify", "--store", "/s", "--sample", "0"], "--sample"),  # checked nothing, and said all was sound
    (["verify", "--store", "/s", "--sample", "-1"], "--sample"),
    (["prepare", "/d", "--store", "/s", "--ratio", "1", "--jobs", "0"], "--jobs"),
    (["umount", "/m", "--timeout", "-1"], "--timeout"),
    (["stats", "/m", "--watch", "nan"], "--watch"),
    (["stats", "/m", "--watch", "1e10"], "--watch"),  # overflowed the sleep: a traceback
    (["stats", "/m", "--watch", "1e-9"], "--watch"),  # the control file read in a tight loop
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_value_argparse_refuses_names_its_flag(argv: list[str], flag: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument {flag}" in err.splitlines()[-1], err


def _mount_args(*flags: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["mount", "/data", "/mnt", *flags])


@pytest.mark.parametrize("flags, said", [
    (["--cache-size", "150%"], "--cache-size 150%: a share of the dataset is 0% to 100%"),
    (["--cache-size", "lots"], "--cache-size 'lots': use a percentage (30%) or bytes (512M, 24G)"),
    (["--open-bytes", "50%"], "--open-bytes takes bytes (512M, 2G), not a percentage"),
    (["--open-bytes", "x"], "--open-bytes 'x': use bytes"),
    (["--disk-cache", "/c", "--disk-cache-size=-5%"], "--disk-cache-size -5%"),
    (["--disk-cache", "/c"], "--disk-cache and --disk-cache-size go together"),
    (["--cluster", "memcached://h:1", "--cluster-size", "2Q"], "--cluster-size '2Q'"),
    (["--cluster-size", "5G"], "--cluster-size needs --cluster"),
    (["--threads", "0"], "--threads must be at least 1, not 0"),
    (["--threads", "100000000"], "--threads must be at most 4096"),
    (["--open-threads", "0"], "--open-threads must be at least 1, not 0"),
    (["--readahead-kb", "-5"], "--readahead-kb must be at least 0, not -5"),
    (["--io-timeout", "1e-9"], "--io-timeout must be at least 0.01 s"),
    (["--mix-interval", "1e-300"], "--mix-interval must be at least 0.01 s"),
    (["--io-timeout", "0"], "--io-timeout must be a positive number of seconds"),
    (["--io-timeout", "nan"], "--io-timeout must be a positive number of seconds"),
    (["--mix-interval", "-1"], "--mix-interval must be a positive number of seconds"),
    (["--metrics-port", "70000"], "--metrics-port must be a TCP port"),
    (["--cache-size", "1" + "0" * 400], "more bytes than any machine holds"),  # inf, not an OverflowError
    (["-o", "noexec,subtype=sshfs"], "-o subtype=sshfs: liquidfs sets it"),
    (["-o", "rw"], "-o rw: liquidfs sets it"),
    (["-o", "fsname=a\\,allow_other"], "with a backslash is not taken"),
    (["--cluster-key-file", "/nonexistent"], "--cluster-key-file goes with --cluster"),
    (["--cluster", "memcached://h:1", "--cluster-key-file", "/nonexistent/key"], "--cluster-key-file"),
])
def test_a_mount_value_refused_after_parsing_names_its_flag(flags: list[str], said: str) -> None:
    with pytest.raises(OptionError) as refused:
        options.mount_config(_mount_args(*flags), STORAGE)
    assert said in str(refused.value)


def test_mount_options_become_values_the_daemon_never_parses(tmp_path: Path) -> None:
    config = options.mount_config(_mount_args("--cache-size", "30%", "--disk-cache", "rel/dir", "--disk-cache-size",
                                              "2G", "--open-bytes", "1M", "--mix", "40%"), STORAGE)
    assert config.cache_size == Share(0.3) and config.disk_cache_size == 2 << 30 and config.open_bytes == 1 << 20
    assert config.mix == 0.4 and config.disk_cache == Path("rel/dir").absolute()
    assert config.source == "/data" and config.store == "/srv/store" and config.threads == 4


@pytest.mark.parametrize("mode, owner, said", [
    (0o777, 0, "group or others may remove what a mount keeps there"),
    (0o700, 65534, "owned by uid 65534"),
    (0o1777, 0, None),  # sticky, as /tmp: others cannot remove root's entries
    (0o700, 0, None),
])
def test_a_disk_cache_directory_others_may_change_is_refused(tmp_path: Path, mode: int, owner: int,
                                                             said: str | None) -> None:
    """The mount (root) makes its directory there and sweeps every ``liquidfs-*`` one whose lock nobody holds:
    whoever else owns the directory, or may remove a live mount's lock from it, chose what root removes."""
    if os.geteuid() != 0:
        pytest.fail("the disk cache's owner is checked as root runs it") if os.environ.get("CI") else \
            pytest.skip("needs root to give the directory away")
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chown(cache, owner, owner)
    cache.chmod(mode)
    args = _mount_args("--disk-cache", str(cache), "--disk-cache-size", "1G")
    if said is None:
        assert options.mount_config(args, STORAGE).disk_cache == cache
    else:
        with pytest.raises(OptionError, match=said):
            options.mount_config(args, STORAGE)


@pytest.mark.parametrize("made", [True, False])
def test_a_disk_cache_below_a_directory_of_roots_others_may_write_is_taken(tmp_path: Path, made: bool) -> None:
    """mount/README.md's setup: an emptyDir (root's, 0777) at /nvme/liquidfs and `--disk-cache
    /nvme/liquidfs/cache`, which the mount makes (or made at an earlier start). Refused by the check of who may
    move it, which counts owners only here."""
    if os.geteuid() != 0:
        pytest.fail("the disk cache's owner is checked as root runs it") if os.environ.get("CI") else \
            pytest.skip("needs root")
    volume = tmp_path / "nvme" / "liquidfs"
    volume.mkdir(parents=True)
    volume.chmod(0o777)
    cache = volume / "cache"
    if made:
        cache.mkdir(mode=0o700)
    args = _mount_args("--disk-cache", str(cache), "--disk-cache-size", "1G")
    assert options.mount_config(args, STORAGE).disk_cache == cache
    # ... but not a link a writer of the volume put at the cache's name (the trainer's: owners are what count)
    target = tmp_path / "target"
    target.mkdir()
    if made:
        cache.rmdir()
    cache.symlink_to(target)
    os.lchown(cache, 1000, 1000)
    for given in (cache, cache / "below"):
        with pytest.raises(OptionError, match="a link of uid 1000's"):
            options.mount_config(_mount_args("--disk-cache", str(given), "--disk-cache-size", "1G"), STORAGE)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("through", ["link", "parent", "link, not there yet"])
def test_a_disk_cache_another_user_may_point_elsewhere_is_refused(tmp_path: Path, through: str) -> None:
    """A link to a directory of root's (its check followed it), or a directory below one of another user's: they
    may point it elsewhere after the check, choosing where root writes and which liquidfs-* directories it
    sweeps."""
    if os.geteuid() != 0:
        pytest.fail("the disk cache's owner is checked as root runs it") if os.environ.get("CI") else \
            pytest.skip("needs root to give the directory away")
    theirs = tmp_path / "home"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    target = tmp_path / "usr"
    target.mkdir()
    cache = theirs / "cache"
    if through.startswith("link"):
        cache.symlink_to(target)
        os.lchown(cache, 65534, 65534)
    else:
        cache.mkdir()
    given = cache / "new" if through.endswith("not there yet") else cache  # made by the mount, through the link
    args = _mount_args("--disk-cache", str(given), "--disk-cache-size", "1G")
    with pytest.raises(OptionError, match="(owned by|a link of) uid 65534(, who may|'s)"):
        options.mount_config(args, STORAGE)
    assert list(target.iterdir()) == []


def test_the_mount_parser_defaults_are_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIQUIDFS_CACHE_SIZE", raising=False)
    config = options.mount_config(_mount_args(), STORAGE)
    defaults: dict[str, Any] = dict(options.MOUNT_DEFAULTS)
    given = {"source": "/data", "mountpoint": Path("/mnt"), "store": "/srv/store"}
    assert config == MountConfig(**{**defaults, **given})
    assert os.environ.get("LIQUIDFS_CACHE_SIZE") is None


def test_an_unknown_log_level_in_the_environment_is_said_and_warning_used(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A typo in a sidecar's LIQUIDFS_LOG_LEVEL broke every command with a traceback, its probe included."""
    monkeypatch.setenv("LIQUIDFS_LOG_LEVEL", "verbose")
    assert cli.main(["stats", str(tmp_path), "--probe"]) == 1  # no mount there: the probe's answer, no traceback
    assert "LIQUIDFS_LOG_LEVEL=verbose is none of debug, info, warning, error: warning used" in capsys.readouterr().err
    monkeypatch.setenv("LIQUIDFS_LOG_LEVEL", "INFO")  # as it was read before the check: any case
    assert cli.main(["stats", str(tmp_path), "--probe"]) == 1
    assert "LIQUIDFS_LOG_LEVEL" not in capsys.readouterr().err


@pytest.mark.parametrize("held, said", [
    (b"{}", ""),
    (b"[1]", "not a liquidfs mount's statistics"),
    (b"not json", "not a liquidfs mount's statistics"),
])
def test_stats_of_a_file_that_holds_no_statistics_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], held: bytes, said: str) -> None:
    """Any user can mount something of type fuse.liquidfs: whatever its control file holds is a line, never a
    traceback."""
    (tmp_path / ".__liquidfs__").write_bytes(held)
    status = cli.main(["stats", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == (1 if said else 0) and said in err and "Traceback" not in err, err


def test_stats_prints_what_a_mount_wrote_escaped_and_jobs_it_cannot_read_as_they_are(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / ".__liquidfs__").write_text(
        '{"title": "\\u001b]0;owned\\u0007", "jobs": {"x": 1, "2": {"epoch": 1, "window_hit_ratio_mean": "a"}}}')
    assert cli.main(["stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b]0;owned\\x07" in out, out
    assert "job x: 1" in out and "job 2: {" in out, out


def test_stats_of_a_crafted_control_file_is_bounded_lines_never_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A count past a float's range raised OverflowError (a traceback in root's terminal), and one long key padded
    every line to its width: 50,000 short keys and one of 400 kB made ~20 GB of output from 1 MB."""
    values: dict[str, object] = {f"k{i}": i for i in range(2000)}
    values["x" * 100_000] = 1
    values["jobs"] = {"1": {"storage_bytes": 10 ** 400, "epoch": 1}}
    (tmp_path / ".__liquidfs__").write_text(json.dumps(values))
    assert cli.main(["stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "job 1: " in out and max(len(line) for line in out.splitlines()) <= 400
    assert len(out) < 2002 * 402, len(out)


def test_stats_watch_goes_on_past_a_read_that_timed_out(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A mount busy for a moment ended the watch, which is there to watch such moments."""
    from liquidfs.daemon import control

    answers: list[object] = [TimeoutError(errno.ETIMEDOUT, "no answer in 10 s"), {"opens": 7},
                             FileNotFoundError()]

    def read(mountpoint: Path) -> dict[str, object]:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]

    monkeypatch.setattr(control, "read_control_within", read)
    assert cli.main(["stats", "/mnt", "--watch", "0.1"]) == 1  # ended by the mount gone, not by the time-out
    captured = capsys.readouterr()
    assert "stuck?" in captured.err and "opens" in captured.out and not answers


def test_allow_other_given_as_a_fuse_option_is_allow_other() -> None:
    """``-o allow_other`` as other FUSE tools take it: the same as --allow-other, with its check of every other
    user's open against the source as it is now (passed through, others read by the modes the scan saw)."""
    config = options.mount_config(_mount_args("-o", "allow_other,noexec,fsname=a", "-o", "noexec,fsname=b"),
                                  STORAGE)
    assert config.allow_other and config.fuse_options == ("noexec", "fsname=b")  # one fsname: the last
    assert not options.mount_config(_mount_args("-o", "noexec"), STORAGE).allow_other


def test_the_daemon_mounts_with_one_fsname_and_its_own_type() -> None:
    """A set of options with liquidfs's fsname and the user's mounted with either, as the set ordered them."""
    from liquidfs.daemon.serve import fuse_options

    given = options.mount_config(_mount_args("-o", "fsname=imagenet,noexec"), STORAGE)
    mounted = fuse_options(given)
    assert {o for o in mounted if o.startswith("fsname=")} == {"fsname=imagenet"}
    assert "subtype=liquidfs" in mounted and "ro" in mounted and "noexec" in mounted
    assert "fsname=liquidfs" in fuse_options(options.mount_config(_mount_args(), STORAGE))


def test_a_cache_size_from_the_environment_is_named_by_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """$LIQUIDFS_CACHE_SIZE sets --cache-size (a sidecar's environment): --loops refused a flag the user never
    typed, naming it as typed."""
    monkeypatch.setenv("LIQUIDFS_CACHE_SIZE", "30%")
    with pytest.raises(OptionError, match=r"cannot go with --cache-size \(from \$LIQUIDFS_CACHE_SIZE\)"):
        options.mount_config(_mount_args("--loops", "4"), STORAGE)
    assert "LIQUIDFS_CACHE_SIZE" in cli.build_parser()._subparsers._group_actions[0].choices["mount"].format_help()


@pytest.mark.parametrize("flags, said", [
    (["--metrics-address", "0.0.0.0"], "--metrics-address does nothing without --metrics-port"),
    (["--mix-interval", "9"], "--mix-interval does nothing without --mix adaptive"),
    (["--mix", "50%", "--pressure-dir", "/sys/fs/cgroup/x"], "--pressure-dir does nothing without --mix adaptive"),
    (["--verify-reads", "--data-path", "daemon"], "--verify-reads is the passthrough path's"),
    (["--readahead-kb", "2048", "--data-path", "passthrough"], "--readahead-kb does nothing on the passthrough"),
    (["--warmup"], "--warmup does nothing without --cache-size"),
])
def test_a_mount_flag_that_does_nothing_with_the_others_is_said(flags: list[str], said: str) -> None:
    """Given and silently dropped, a value reads to its user as a setting that holds."""
    assert any(said in line for line in options.ignored_flags(_mount_args(*flags)))


def test_warmup_without_a_cache_is_dropped_and_keeps_the_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """It fills the memory cache: with none it did nothing, silently, and still took ``--loops auto`` to one."""
    monkeypatch.delenv("LIQUIDFS_CACHE_SIZE", raising=False)
    config = options.mount_config(_mount_args("--warmup", "--loops", "2"), STORAGE)
    assert not config.warmup and config.loops == 2
    assert options.mount_config(_mount_args("--warmup", "--cache-size", "10%"), STORAGE).warmup


def test_the_log_level_is_taken_in_any_case() -> None:
    """As ``LIQUIDFS_LOG_LEVEL`` is: an fstab's ``log_level=INFO`` made the mount exit 2."""
    assert cli.build_parser().parse_args(["umount", "/mnt", "--log-level", "INFO"]).log_level == "info"


def test_flags_that_go_together_say_nothing() -> None:
    assert options.ignored_flags(_mount_args("--metrics-port", "9100", "--metrics-address", "0.0.0.0",
                                             "--mix", "adaptive", "--mix-interval", "9")) == []
    assert options.ignored_flags(_mount_args()) == []
