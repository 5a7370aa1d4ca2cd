"""``mount`` hands the daemon it starts its options as parsed values (``daemon.config.MountConfig`` as JSON), so
a new flag needs no copy and the daemon parses no text."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from liquidfs import cli
from liquidfs.cli import options
from liquidfs.daemon.config import MountConfig, Share
from liquidfs.stores import Store

STORAGE = cast(Store, SimpleNamespace(default_threads=4, source_label="/data", label="/srv/store", shares_by_modes=True))

# A value other than the default for every option the daemon is given (the parent's own are left out).
NON_DEFAULT = ["--store", "/srv/store", "--allow-other", "-o", "ro,noatime", "-o", "max_read=131072",
               "--threads", "7", "--open-threads", "9", "--cache-size", "30%", "--page-cache", "keep", "--open-bytes", "32M",
               "--no-push-pages", "--disk-cache", "/nvme/cache", "--disk-cache-size", "20G", "--warmup",
               "--cluster", "memcached://10.0.0.1:11211,10.0.0.2:11211", "--cluster-size", "60%",
               "--readahead-kb", "512", "--io-timeout", "9.5", "--metrics-port", "9100", "--metrics-address",
               "0.0.0.0", "--data-path", "daemon", "--verify-reads", "--time-requests", "--no-lookahead",
               "--mix", "0.25", "--mix-interval", "3", "--pressure-dir", "/sys/fs/cgroup/x", "--log-level", "debug",
               "--log-file", "/tmp/m.log"]
#: The command's own options: what the daemon is not handed as a value (logging goes on its command line).
LEFT_OUT = {"foreground", "rescan", "refresh", "ready_fd", "daemon_config", "log_level", "log_file", "func",
            "command", "store", "source", "mountpoint"}
#: Options that cannot go with some of NON_DEFAULT's: each is checked by a test of its own below.
APART = {"loops"}


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser().parse_args(["mount", "/data", "/mnt", *argv])


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o400)
    return key


def test_the_test_covers_every_option_of_mount(key_file: Path) -> None:
    """A flag added to ``mount`` must be added above too, or this fails: the trip is checked for all."""
    defaults = vars(_parse([]))
    given = vars(_parse([*NON_DEFAULT, "--cluster-key-file", str(key_file)]))
    untested = {k for k in given if given[k] == defaults[k]} - LEFT_OUT - APART
    assert not untested, f"options without a non-default value in NON_DEFAULT: {sorted(untested)}"


def test_every_option_reaches_the_config_as_a_value(key_file: Path) -> None:
    config = options.mount_config(_parse([*NON_DEFAULT, "--cluster-key-file", str(key_file)]), STORAGE)
    default = MountConfig(source="/data", mountpoint=Path("/mnt"), store="/srv/store")
    same = [f.name for f in dataclasses.fields(MountConfig)
            if getattr(config, f.name) == getattr(default, f.name)
            and f.name not in {"source", "mountpoint", "mountpoint_seen", "store", *APART}]
    assert not same, f"mount options that never reach MountConfig: {same}"
    assert config.cache_size == Share(0.3) and config.cluster_size == Share(0.6)
    assert config.cluster == (("10.0.0.1", 11211), ("10.0.0.2", 11211)) and config.cluster_key_file == key_file


def test_every_value_survives_the_trip_to_the_daemon(key_file: Path) -> None:
    given = options.mount_config(_parse([*NON_DEFAULT, "--cluster-key-file", str(key_file)]), STORAGE)
    assert MountConfig.from_json(given.to_json()) == given
    defaults = options.mount_config(_parse([]), STORAGE)
    assert MountConfig.from_json(defaults.to_json()) == defaults
    checked = dataclasses.replace(defaults, mountpoint_seen=(2049, 1234567))  # as the command's check sets it
    assert MountConfig.from_json(checked.to_json()) == checked


@pytest.mark.parametrize("change", [
    {"threads": True}, {"threads": "4"}, {"cache_size": "30%"}, {"cache_size": {"share": 1.5}},
    {"cache_size": -1}, {"page_cache": "some"}, {"data_path": "kernel"}, {"mix": 2.0}, {"mix": "most"},
    {"io_timeout": "60"}, {"cluster": [["h"]]}, {"fuse_options": "ro"}, {"unknown": 1}, {"metrics_port": 1.5},
    {"mountpoint_seen": [1]}, {"mountpoint_seen": ["1", "2"]}, {"mountpoint_seen": 12},
    # values of the right kind the command refuses: allow_other as a FUSE option skipped the check of every other
    # user's open; loops past what the shared table holds, or with what one loop must hold
    {"fuse_options": ["allow_other"]}, {"fuse_options": ["subtype=x"]}, {"fuse_options": ["fsname=x,allow_other"]},
    {"fuse_options": ["fsname=x\\,allow_other"]}, {"loops": 0}, {"loops": 33},
    {"loops": 2, "cache_size": 5}, {"loops": 2, "verify_reads": True}, {"threads": 0}, {"open_threads": 0},
    {"readahead_kb": -1}, {"metrics_port": 70000}, {"io_timeout": 0.0}, {"mountpoint": "mnt"},
], ids=str)
def test_the_daemon_takes_no_config_but_one_of_values_of_the_right_kind(change: dict[str, object]) -> None:
    values = json.loads(MountConfig(source="/data", mountpoint=Path("/mnt"), store="/s").to_json())
    with pytest.raises(ValueError):
        MountConfig.from_json(json.dumps({**values, **change}))
    for name in values:
        with pytest.raises(ValueError):
            MountConfig.from_json(json.dumps({k: v for k, v in values.items() if k != name}))


def test_fuse_options_the_command_passes_through_reach_the_daemon() -> None:
    """allow_root (root may enter; no other user), fsname=, default_permissions: the command passes them on, and
    the daemon's check of its config takes them (the check refused allow_root: every such daemon failed)."""
    config = MountConfig(source="/data", mountpoint=Path("/mnt"), store="/s",
                         fuse_options=("allow_root", "fsname=x", "default_permissions"))
    assert MountConfig.from_json(config.to_json()) == config


def test_loops_reach_the_config_and_refuse_what_one_loop_must_hold(key_file: Path) -> None:
    config = options.mount_config(_parse(["--loops", "3", "--threads", "5"]), STORAGE)
    assert config.loops == 3 and MountConfig.from_json(config.to_json()) == config
    with pytest.raises(options.OptionError) as refused:
        options.mount_config(_parse([*NON_DEFAULT, "--cluster-key-file", str(key_file), "--loops", "3"]), STORAGE)
    # the daemon refuses the same in a config written by hand, and names them alike
    one = options.mount_config(_parse([*NON_DEFAULT, "--cluster-key-file", str(key_file), "--loops", "1"]), STORAGE)
    with pytest.raises(ValueError) as refused_config:
        MountConfig.from_json(json.dumps({**json.loads(one.to_json()), "loops": 3}))
    for flag in ("--cache-size", "--disk-cache", "--cluster", "--warmup", "--data-path daemon",
                 "--verify-reads"):
        assert flag in str(refused.value) and flag in str(refused_config.value)
    assert "--mix" not in str(refused.value)  # a fixed share (NON_DEFAULT's 0.25) is the same in every loop
    with pytest.raises(options.OptionError, match="--mix adaptive"):
        options.mount_config(_parse(["--mix", "adaptive", "--loops", "3"]), STORAGE)
    assert options.mount_config(_parse(["--mix", "0.25", "--loops", "3"]), STORAGE).loops == 3
    for loops in ("0", "33"):
        with pytest.raises(options.OptionError, match="--loops must be in 1..32"):
            options.mount_config(_parse(["--loops", loops]), STORAGE)


@pytest.mark.parametrize(("cores", "flags", "chosen"), [(16, [], 4), (64, [], 8), (7, [], 1), (2, [], 1),
                                                         (16, ["--cache-size", "10%"], 1), (16, ["--mix", "adaptive"], 1),
                                                         (16, ["--mix", "0.5"], 4),
                                                         # an empty value (a template's "$CLUSTER") is none
                                                         (16, ["--cluster", ""], 4), (16, ["--disk-cache", ""], 4)])
def test_loops_auto_follow_the_cores_and_the_options(monkeypatch: pytest.MonkeyPatch, cores: int, flags: list[str],
                                                      chosen: int) -> None:
    from liquidfs.sysio import cgroups

    monkeypatch.setattr(cgroups, "usable_cores", lambda: cores)
    assert options.mount_config(_parse(flags), STORAGE).loops == chosen  # auto is the default


def test_the_mount_point_is_taken_as_mountinfo_will_show_it(tmp_path: Path) -> None:
    """Links on the way resolved, the last one too: the watchdog finds its mount, and `umount`, by that path
    (a mount point named through a link was mounted on where the link pointed, and no watchdog was started)."""
    (tmp_path / "real" / "mnt").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "to-mnt").symlink_to(tmp_path / "real" / "mnt")
    for named in (tmp_path / "link" / "mnt", tmp_path / "to-mnt", tmp_path / "link" / ".." / "real" / "mnt"):
        args = cli.build_parser().parse_args(["mount", "/data", str(named)])
        assert options.mount_config(args, STORAGE).mountpoint == tmp_path / "real" / "mnt", named


def test_a_cluster_of_an_object_stores_source_needs_the_key(key_file: Path) -> None:
    """Nothing of a bucket is everyone's (its catalog's modes are made up: every object 0444): without a key its
    raw objects would go to a memcached anyone may read, so the mount is refused, naming the flag."""
    bucket = cast(Store, SimpleNamespace(default_threads=16, source_label="s3://b/data", label="s3://b/store",
                                         shares_by_modes=False))
    cluster = ["--cluster", "memcached://10.0.0.1:11211"]
    with pytest.raises(options.OptionError, match="object-store source needs --cluster-key-file"):
        options.mount_config(_parse(cluster), bucket)
    assert options.mount_config(_parse([*cluster, "--cluster-key-file", str(key_file)]), bucket).cluster
    assert options.mount_config(_parse(cluster), STORAGE).cluster  # a local source: what everyone may read


def test_the_mount_point_is_named_without_touching_what_is_mounted_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stat of a mount's root waits for its daemon (once its cached attributes expire: a second on sshfs):
    the mount point the daemon is handed is found from mountinfo and the links above it, and a link at its name
    is read only where nothing is mounted on it; ``check_mountpoint`` then asks a stuck one from a child."""
    from liquidfs.daemon import watchdog

    real = tmp_path / "real"
    (real / "mnt").mkdir(parents=True)
    (tmp_path / "up").symlink_to(real)
    (tmp_path / "named").symlink_to(real / "mnt")
    stuck = os.fsencode(real / "mnt")
    lstat = os.lstat

    def never_the_mount(path: object, *args: object, **kwargs: object) -> os.stat_result:
        assert os.fsencode(os.fspath(path)) != stuck, "the mount's root was stat-ed"  # type: ignore[arg-type]
        return lstat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: (b"fuse.sshfs", 30, 1) if os.fsencode(path) == stuck
                        else None)
    monkeypatch.setattr(os, "lstat", never_the_mount)
    config = options.mount_config(cli.build_parser().parse_args(["mount", "/data", str(tmp_path / "up" / "mnt")]),
                                  STORAGE)
    assert config.mountpoint == real / "mnt"
    monkeypatch.setattr(watchdog, "topmost_mount", lambda path: None)  # nothing mounted: a link's name is read
    monkeypatch.setattr(os, "lstat", lstat)
    config = options.mount_config(cli.build_parser().parse_args(["mount", "/data", str(tmp_path / "named")]), STORAGE)
    assert config.mountpoint == real / "mnt"
