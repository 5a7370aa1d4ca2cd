"""Every flag's value read once, where the user typed it: shares, sizes, ratios and modes become values here, and
a value refused is said naming its flag. ``mount``'s options become a ``daemon.config.MountConfig``.

Two ways to refuse, as the commands always have: a value argparse checks (``type=``: ``argument``) ends the
command with its usage and status 2; ``mount``'s values, checked after parsing (``mount_config``), end it with one
line and status 1, before anything is mounted.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..daemon.config import (MAX_READAHEAD_KB, MAX_THREADS, MIN_SECONDS, OWN_FUSE_OPTIONS, Amount, MountConfig,
                             Share, one_loop_only)
from ..mix.modes import MIX_MODES

if TYPE_CHECKING:
    from ..stores import Store

T = TypeVar("T")

#: ``MountConfig``'s defaults: the mount parser's, never written a second time.
MOUNT_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(MountConfig)}


class CommandParser(argparse.ArgumentParser):
    """A command's parser whose long description may be read only when its ``--help`` is shown: ``profile``'s
    is the docstring of ``profile.choose``, which imports NumPy and the decoders (0.2 s of a CPU that ``umount``
    and ``stats`` would pay to build the parser)."""

    def __init__(self, *args: Any, describe: Callable[[], str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.describe = describe

    def format_help(self) -> str:
        if self.describe is not None:
            self.description, self.describe = self.describe(), None
        return super().format_help()


class OptionError(ValueError):
    """A flag's value refused; the message names the flag and says what it takes."""


class OutOfRange(ValueError):
    """A share read as a number that is not within [0, 1]."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def share_or_size(text: str, *, sizes: bool = True, percent: bool = True, fraction: bool = False) -> Amount:
    """The one reading of a share or a size: a percentage of the dataset (``30%``, where ``percent``), a share
    in [0, 1] (``0.3``, where ``fraction``), or bytes with an optional K/M/G/T suffix (powers of 1024, where
    ``sizes``). ValueError says what is wrong with ``text``, without naming a flag."""
    text = text.strip()
    if text.endswith("%") and percent:
        try:
            value = float(text[:-1])
        except ValueError:
            raise ValueError(f"{text}: a share of the dataset is 0% to 100%") from None
        try:
            return Share(value / 100)
        except ValueError:
            raise OutOfRange(f"{text}: a share of the dataset is 0% to 100%") from None
    if text.endswith("%") and sizes:
        raise ValueError("takes bytes (512M, 2G), not a percentage")
    if fraction:
        try:
            number: float | None = float(text)
        except ValueError:
            number = None
        if number is not None:
            try:
                return Share(number)
            except ValueError:
                raise OutOfRange(f"{text}: a share is within [0, 1]") from None
    match = _SIZE.match(text) if sizes else None
    if match:
        amount = float(match.group(1)) * _UNITS[match.group(2).upper()]
        if not math.isfinite(amount):  # digits past a float's range: inf, which no int is
            raise ValueError(f"{text[:40]!r}: more bytes than any machine holds")
        return int(amount)
    forms = [form for form, takes in (("a percentage (30%)", percent), ("a share in [0, 1]", fraction),
                                      ("bytes (512M, 24G)", sizes)) if takes]
    raise ValueError(f"{text!r}: use {' or '.join(forms)}")


def argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse ``type=``: its ValueError said by argparse, after the flag's name."""
    def checked(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    checked.__name__ = parse.__name__  # argparse names a type in its "invalid ... value" message
    return checked


def cache_share(text: str) -> float:
    """``--cache-size`` of profile and prepare: a percentage of the dataset, as a share."""
    try:
        share = share_or_size(text, sizes=False)
    except ValueError:
        share = None
    if not isinstance(share, Share):
        raise ValueError(f"a percentage from 0% to 100% here (e.g. 30%), not {text.strip()!r}")
    return share.fraction


def _share(text: str, *, beyond: str, unreadable: str) -> float:
    """A share in [0, 1] or a percentage, for a flag whose other values are words: ``beyond`` said for a number
    outside [0, 1], ``unreadable`` for anything else."""
    try:
        share = share_or_size(text, sizes=False, fraction=True)
    except OutOfRange:
        raise ValueError(beyond) from None
    except ValueError:
        raise ValueError(unreadable) from None
    assert isinstance(share, Share)
    return share.fraction


def ratio(text: str) -> float | str:
    """``prepare --ratio``: a share in [0, 1], a percentage, or "auto"."""
    if text == "auto":
        return text
    return _share(text, beyond=f"ratio must be within [0, 1], got {text}",
                  unreadable=f"ratio must be a number in [0, 1], a percentage or 'auto', not {text!r}")


def mix(text: str) -> str | float:
    """``mount --mix``: "prepared", "adaptive", or a share in [0, 1] (a percentage with %)."""
    if text in MIX_MODES:
        return text
    return _share(text, beyond=f"--mix share must be within [0, 1], not {text}",
                  unreadable=f"--mix takes 'prepared', 'adaptive' or a share in [0, 1], not {text!r}")


def _fuse_options(given: list[str]) -> tuple[str, ...]:
    """``-o`` options, one each. ``allow_other`` is ``--allow-other`` (with the check of every other user's open
    that it turns on: as an option passed through, others read by the modes the scan saw); one that overrides
    what liquidfs sets is refused. Of ``fsname=`` (the source mountinfo shows: liquidfs's own unless given) the
    last one given."""
    options: list[str] = []
    for option in (o.strip() for opts in given for o in opts.split(",")):
        if not option or option in options:
            continue
        if "\\" in option:  # libfuse's escape of a comma: what it would make of it is not what is checked here
            raise OptionError(f"-o {option}: a FUSE option with a backslash is not taken")
        name = option.split("=", 1)[0]
        if name in OWN_FUSE_OPTIONS:
            raise OptionError(f"-o {option}: liquidfs sets it (a read-only mount of type fuse.liquidfs, which "
                              "umount and stats find it by)")
        if name == "fsname":
            options = [o for o in options if not o.startswith("fsname=")]
        options.append(option)
    return tuple(options)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"a positive whole number, not {text!r}") from None
    if value < 1:
        raise ValueError(f"a positive whole number, not {value}")
    return value


def workers(text: str) -> int:
    """A count of threads, processes or readers (``profile --threads``/``--readers``, ``prepare --jobs``): past
    ``MAX_THREADS`` it is a typo, never a setting (each is a thread or a process started, and the profile's
    sample holds four images a reader in memory)."""
    value = positive_int(text)
    if value > MAX_THREADS:
        raise ValueError(f"at most {MAX_THREADS}, not {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"a positive number, not {text!r}") from None
    if not 0 < value < math.inf or not 1 / value < math.inf:  # (a rate of 1e-320 is a time of inf)
        raise ValueError(f"a positive number, not {text}")
    return value


def formats(text: str) -> tuple[str, ...]:
    """``--formats png,bmp,j2k``: the raw formats prepare may write, in the order it tries them (J2K first where
    listed, then BMP for the images J2K cannot hold exactly: ``expand.rawformats.parse_formats``)."""
    from ..expand import rawformats

    return rawformats.parse_formats(text)


def _flagged(flag: str, parse: Callable[[str], T], text: str) -> T:
    try:
        return parse(text)
    except ValueError as exc:
        raise OptionError(f"{flag} {exc}") from None


def size_option(flag: str, text: str | None, *, percent: bool = True) -> Amount | None:
    """A size flag of ``mount``: bytes, or (``percent``) a share of the dataset; None where not given."""
    if text is None or not text.strip():
        return None
    return _flagged(flag, lambda t: share_or_size(t, percent=percent), text)


def _positive_seconds(flag: str, value: float) -> float:
    if not value > 0 or not math.isfinite(value):
        raise OptionError(f"{flag} must be a positive number of seconds, not {value}")
    if value < MIN_SECONDS:  # 1e-9: every read EIO, or a mix that steers without a pause
        raise OptionError(f"{flag} must be at least {MIN_SECONDS:g} s, not {value:g}")
    return value


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """What ``mount`` was given that does nothing with the rest of its flags, each said in a line (the mount goes
    on): a value given and silently dropped reads, to its user, as a setting that holds."""
    said = []
    if args.metrics_address != MOUNT_DEFAULTS["metrics_address"] and args.metrics_port is None:
        said.append("--metrics-address does nothing without --metrics-port")
    if args.mix != "adaptive":
        for flag, value, default in (("--mix-interval", args.mix_interval, MOUNT_DEFAULTS["mix_interval"]),
                                     ("--pressure-dir", args.pressure_dir, str(MOUNT_DEFAULTS["pressure_dir"]))):
            if value != default:
                said.append(f"{flag} does nothing without --mix adaptive")
    if args.warmup and args.cache_size is None:
        said.append("--warmup does nothing without --cache-size (it fills that cache)")
    if args.verify_reads and args.data_path == "daemon":
        said.append("--verify-reads is the passthrough path's: the daemon path reads every file whole and checks "
                    "it already")
    if args.readahead_kb != MOUNT_DEFAULTS["readahead_kb"] and args.data_path == "passthrough":
        said.append("--readahead-kb does nothing on the passthrough path (the kernel reads the backing files)")
    return said


def _within(flag: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise OptionError(f"{flag} must be at least {low}, not {value}" if value < low else
                          f"{flag} must be at most {high}, not {value}")
    return value


#: ``mount --loops auto``: a loop per this many cores the mount may use (the loader's workers need the rest), and
#: at most this many loops (8 opened 3.4-4.1x what one did on a 16-core node: BENCHMARKS.md, "Several loops").
CORES_PER_LOOP = 4
AUTO_LOOPS = 8


def loops(text: str) -> int | str:
    """``mount --loops``: "auto" or a number of processes."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--loops takes 'auto' or a number of processes, not {text!r}") from None


def _loops(args: argparse.Namespace) -> int:
    """``--loops N``: each loop has its own memory, so whatever is held or decided across opens (the caches, the
    adaptive mix's share) must stay in one; reads go through the kernel (passthrough) so that no READ needs the
    loop that opened. A fixed ``--mix`` share is the same in every loop, and so is each image's choice at it (its
    rank: a hash of its path). "auto": as many as the cores allow, where those options leave more than one
    possible."""
    from ..datapath.shared_inodes import MAX_LOOPS
    from ..sysio.cgroups import usable_cores

    clashes = one_loop_only(args)
    if os.environ.get("LIQUIDFS_CACHE_SIZE") == args.cache_size and "--cache-size" in clashes:
        # a flag the user never typed is named by where it came from
        clashes[clashes.index("--cache-size")] = "--cache-size (from $LIQUIDFS_CACHE_SIZE)"
    if args.loops == "auto":
        return 1 if clashes else max(1, min(AUTO_LOOPS, usable_cores() // CORES_PER_LOOP))
    if not 1 <= args.loops <= MAX_LOOPS:
        raise OptionError(f"--loops must be in 1..{MAX_LOOPS}, not {args.loops}")
    if args.loops > 1 and clashes:
        raise OptionError(f"--loops {args.loops} cannot go with {', '.join(clashes)}: each loop would hold or "
                          "decide its own (use one loop)")
    return int(args.loops)


def mount_config(args: argparse.Namespace, storage: Store) -> MountConfig:
    """``mount``'s options as a ``MountConfig``, every value checked; an OptionError names the flag refused."""
    from ..daemon.control import mount_point_named
    from ..held.cluster_peers import CLUSTER_NEEDS_KEY, ClusterError, parse_cluster
    from ..held.disk import root_refusal as disk_root_refusal
    from ..held.sealing import KeyFileError, read_key_file

    threads = _within("--threads", storage.default_threads if args.threads is None else args.threads, 1, MAX_THREADS)
    _within("--open-threads", args.open_threads, 1, MAX_THREADS)
    _within("--readahead-kb", args.readahead_kb, 0, MAX_READAHEAD_KB)
    cache_size = size_option("--cache-size", args.cache_size)
    open_bytes = size_option("--open-bytes", args.open_bytes, percent=False)
    assert not isinstance(open_bytes, Share)  # bytes only: a share is refused
    if bool(args.disk_cache) != bool(args.disk_cache_size):
        raise OptionError("--disk-cache and --disk-cache-size go together")
    disk_cache_size = size_option("--disk-cache-size", args.disk_cache_size)
    if args.disk_cache and (why := disk_root_refusal(Path(args.disk_cache).absolute())) is not None:
        raise OptionError(why)
    if args.cluster_size and not args.cluster:
        raise OptionError("--cluster-size needs --cluster")
    cluster_size = size_option("--cluster-size", args.cluster_size)
    cluster = None
    if args.cluster:
        try:
            cluster = tuple(parse_cluster(args.cluster))
        except ClusterError as exc:
            raise OptionError(str(exc)) from None
    key_file = None
    if args.cluster_key_file:
        if not args.cluster:
            raise OptionError("--cluster-key-file goes with --cluster")
        key_file = Path(args.cluster_key_file).absolute()  # the daemon runs in /
        try:  # here, before the daemon starts: a key refused is said on the terminal (the daemon reads it again)
            read_key_file(key_file)
        except KeyFileError as exc:
            raise OptionError(str(exc)) from None
    if cluster and key_file is None and not storage.shares_by_modes:
        raise OptionError(CLUSTER_NEEDS_KEY)
    loop_count = _loops(args)
    given_options = _fuse_options(args.options)
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise OptionError(f"--metrics-port must be a TCP port (0 to 65535), not {args.metrics_port}")
    config = MountConfig(
        # As mountinfo will show it (links resolved): what the watchdog and umount find the mount by.
        source=storage.source_label, mountpoint=mount_point_named(Path(args.mountpoint)), store=storage.label,
        allow_other=args.allow_other or "allow_other" in given_options,
        fuse_options=tuple(o for o in given_options if o != "allow_other"),
        threads=threads, open_threads=args.open_threads, loops=loop_count, metrics_port=args.metrics_port, metrics_address=args.metrics_address,
        cache_size=cache_size, warmup=args.warmup and cache_size is not None, readahead_kb=args.readahead_kb,
        io_timeout=_positive_seconds("--io-timeout", args.io_timeout), page_cache=args.page_cache,
        open_bytes=MOUNT_DEFAULTS["open_bytes"] if open_bytes is None else open_bytes,
        push_pages=args.push_pages, disk_cache=Path(args.disk_cache).absolute() if args.disk_cache else None,
        disk_cache_size=disk_cache_size, cluster=cluster, cluster_size=cluster_size, cluster_key_file=key_file,
        data_path=args.data_path, verify_reads=args.verify_reads, time_requests=args.time_requests,
        lookahead=args.lookahead, mix=args.mix, mix_interval=_positive_seconds("--mix-interval", args.mix_interval),
        pressure_dir=Path(args.pressure_dir).absolute())
    try:  # what the daemon checks its config by (``MountConfig.check``): the command and it never disagree
        config.check()
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    return config
