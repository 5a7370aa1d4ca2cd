"""``mount`` hands every option to the daemon it starts (``cli._as_options``), so a new flag needs no copy."""

from __future__ import annotations

import argparse

from liquidfs import cli

# A value other than the default for every option the daemon is given (the parent's own are left out).
NON_DEFAULT = ["--store", "/srv/store", "--allow-other", "-o", "ro,noatime", "-o", "max_read=131072",
               "--threads", "7", "--open-threads", "9", "--cache-size", "30%", "--page-cache", "keep", "--open-bytes", "32M",
               "--no-push-pages", "--disk-cache", "/nvme/cache", "--disk-cache-size", "20G", "--warmup",
               "--cluster", "memcached://10.0.0.1:11211,10.0.0.2:11211", "--cluster-size", "60%",
               "--cluster-key-file", "/etc/liquidfs/cluster.key",
               "--readahead-kb", "512", "--io-timeout", "9.5", "--metrics-port", "9100", "--metrics-address",
               "0.0.0.0", "--data-path", "daemon", "--verify-reads", "--time-requests", "--no-lookahead", "--mix", "0.25", "--mix-interval", "3",
               "--pressure-dir", "/sys/fs/cgroup/x", "--log-level", "debug", "--log-file", "/tmp/m.log"]
LEFT_OUT = {"foreground", "rescan", "refresh"}


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser().parse_args(["mount", "/data", "/mnt", *argv])


def test_every_option_survives_the_trip_to_the_daemon() -> None:
    given = _parse([*NON_DEFAULT, "--foreground", "--rescan"])
    again = _parse(cli._as_options(cli._subparser("mount"), given, leave_out=LEFT_OUT))
    ours = {k: v for k, v in vars(given).items() if k not in LEFT_OUT}
    theirs = {k: v for k, v in vars(again).items() if k not in LEFT_OUT}
    assert theirs == ours
    assert not again.foreground and not again.rescan  # the parent's own: the daemon never rescans


def test_the_test_covers_every_option_of_mount() -> None:
    """A flag added to ``mount`` must be added above too, or this fails: the trip is checked for all."""
    defaults = vars(_parse([]))
    given = vars(_parse(NON_DEFAULT))
    untested = {k for k in given if given[k] == defaults[k]} - LEFT_OUT - {"ready_fd", "func", "command",
                                                                             "source", "mountpoint"}
    assert not untested, f"options without a non-default value in NON_DEFAULT: {sorted(untested)}"


def test_defaults_survive_too() -> None:
    given = _parse([])
    again = _parse(cli._as_options(cli._subparser("mount"), given, leave_out=LEFT_OUT))
    assert vars(again) == vars(given)
