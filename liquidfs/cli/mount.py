"""``liquidfs mount``, ``umount`` and ``stats``: a mount's options read into a ``MountConfig``, the daemon
started with it (or served in the foreground), and a running mount unmounted or asked for its counters."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..daemon.config import DATA_PATHS
from ..daemon.control import UNMOUNT_TIMEOUT
from ..datapath.limits import PAGE_CACHE_MODES
from . import options
from .options import MOUNT_DEFAULTS, CommandParser, argument

if TYPE_CHECKING:
    from ..daemon.config import MountConfig
    from ..stores.base import Store


def add_arguments(sub: argparse._SubParsersAction[CommandParser],
                  add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    """The parsers of ``mount``, ``umount`` and ``stats``."""
    m = sub.add_parser("mount", help="mount a dataset (daemonizes; returns once the mount answers)",
                       description="Mount SOURCE read-only on MOUNTPOINT. The tree is answered from a catalog "
                       "(built on first mount, reused while the source is unchanged). Without --foreground the "
                       "daemon detaches and this command returns once the mount answers. A stale mount left "
                       "by a killed daemon ('Transport endpoint is not connected') is cleaned up automatically.")
    m.add_argument("source", help="the dataset directory, or s3://BUCKET/PREFIX (then --store s3://... too)")
    m.add_argument("mountpoint", help="an empty directory to mount on")
    m.add_argument("--store", help="directory holding the catalog and the raw objects "
                   "(default: ~/.cache/liquidfs/<hash of SOURCE>); for an s3:// source the s3:// prefix "
                   "prepare wrote to (read only by mounts)")
    m.add_argument("--foreground", "-f", action="store_true",
                   help="stay in the foreground (containers, debugging); Ctrl-C or SIGTERM unmounts")
    m.add_argument("--allow-other", action="store_true",
                   help="let other users read the mount (file modes are enforced); needs user_allow_other "
                   "in /etc/fuse.conf when not root")
    m.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT]",
                   help="extra FUSE mount options")
    # Flags that tune internals: the defaults suit a local store on one node (docs/commands.md, "Advanced").
    tuning = m.add_argument_group("advanced", "tuning internals; the defaults suit a local store on one node")
    tuning.add_argument("--threads", type=int,
                   help="storage reads in flight at once (default 4 for a local store, 16 for an object store: "
                   "each request waits on the network more than on the disk)")
    tuning.add_argument("--open-threads", type=int, default=MOUNT_DEFAULTS["open_threads"], metavar="N",
                   help="storage calls of opens in flight at once, apart from the reads' --threads: an open waits "
                   "on the disk's latency (the source's identity, the raw object's inode), so as many as the "
                   f"loader has workers should proceed together (default {MOUNT_DEFAULTS['open_threads']})")
    tuning.add_argument("--loops", type=argument(options.loops), default="auto", metavar="N|auto",
                   help="processes that answer the mount's requests, each on a core of its own: one answers a few "
                   "thousand opens a second, so loaders with many workers opening files want more. Needs the "
                   "passthrough data path, and none of --cache-size, --disk-cache, --cluster, --mix adaptive, "
                   f"--warmup, --verify-reads (each loop would hold or decide its own; a fixed --mix is the same "
                   f"in every loop). Default auto: one per {options.CORES_PER_LOOP} "
                   f"cores this mount may use, at most {options.AUTO_LOOPS}, where those options allow; else 1")
    m.add_argument("--cache-size", default=os.environ.get("LIQUIDFS_CACHE_SIZE") or None, metavar="SIZE",
                   help="memory for the next-epoch cache: bytes (24G, 512M) or a percentage (30%%) of what "
                   "holding every file would cost (on the passthrough path each file takes whole pages and "
                   "1.25 KB besides; on the daemon path its bytes); that share of every epoch is then served "
                   "from memory. "
                   "Default: $LIQUIDFS_CACHE_SIZE where set (a sidecar's environment), else no cache (and the "
                   "page cache keeps no copy of served files)")
    tuning.add_argument("--page-cache", choices=PAGE_CACHE_MODES, default=MOUNT_DEFAULTS["page_cache"],
                   help="what the kernel's page cache keeps of served files the daemon's cache does not hold: "
                   "drop their pages when closed (default: no second copy of the dataset in memory), keep them "
                   "(less daemon CPU; the kernel reclaims them under pressure), or direct (direct_io: no pages; "
                   "see BENCHMARKS.md for what each costs)")
    tuning.add_argument("--open-bytes", metavar="SIZE",
                   help="memory for files opened and not yet read to their end, outside the cache's budget "
                   f"(default {MOUNT_DEFAULTS['open_bytes'] >> 20}M). Files whose content is known without "
                   "reading them (a local source unchanged, a raw object as prepare left it) are always read at "
                   "their first read; others "
                   "(object stores, objects touched since prepare) are read at open, unless opened past this "
                   "bound: loaders that open many files ahead (DALI maps its whole shuffle buffer) then do "
                   "not wait for each file at open")
    tuning.add_argument("--push-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="at a file's first read, hand the rest of it to the kernel's page cache at once instead "
                   "of waiting for each read (default on: the daemon's buffer is free for the next file at "
                   "once; see BENCHMARKS.md)")
    tuning.add_argument("--disk-cache", metavar="DIR",
                   help="a second cache level on local disk (NVMe in front of an object store): the same "
                   "next-epoch policy for what memory misses; files go to a directory of this mount's own "
                   "in DIR, removed at unmount. Needs --disk-cache-size")
    tuning.add_argument("--disk-cache-size", metavar="SIZE",
                   help="budget of --disk-cache: a percentage of the dataset as served or bytes (200G)")
    tuning.add_argument("--cluster", metavar="memcached://HOST:PORT,...",
                   help="the memcached of every node reading this dataset (one beside each mount, started with "
                   "-I 64m or more): together they hold a fixed share of the raw objects for all nodes, so a "
                   "miss here that another node read is fetched from memory, not storage. Values are checked "
                   "against the catalog's checksums; a memcached that is down costs hits, never a read")
    tuning.add_argument("--cluster-key-file", metavar="FILE",
                   help="seal every value stored to --cluster with this key (authenticated encryption): a value "
                   "no mount with the key stored for that object is a miss, and only they can read one, whatever "
                   "the source's modes. FILE: exactly 32 random bytes (head -c 32 /dev/urandom > FILE), root's, "
                   "mode 0400 or 0600, the same on every node of the job. Without it only objects whose source "
                   "everyone may read go to the cluster (none of an object store's: there it is needed)")
    tuning.add_argument("--cluster-size", metavar="SIZE",
                   help="what the memcacheds of --cluster hold together: a percentage of the dataset as served or "
                   "bytes; the share of the raw objects they hold follows (default: what they say they hold, "
                   "the sum of their -m less ~5 %%, at most the raw objects' bytes)")
    m.add_argument("--warmup", action="store_true",
                   help="with --cache-size: fill the cache right after the mount is ready, in the background, so the "
                   "first epoch hits too (progress: `liquidfs stats`, warmup)")
    tuning.add_argument("--readahead-kb", type=int, default=MOUNT_DEFAULTS["readahead_kb"], metavar="KB",
                   help="readahead of the mount, so the kernel sends larger reads "
                   f"(default {MOUNT_DEFAULTS['readahead_kb']}; 0 leaves the "
                   "kernel's default; needs root)")
    tuning.add_argument("--io-timeout", type=float, default=MOUNT_DEFAULTS["io_timeout"], metavar="SECONDS",
                   help="a read of the store or the source that takes longer answers EIO to the reader, and the "
                   "mount goes on serving other files (hung network storage, failing disks; "
                   f"default {MOUNT_DEFAULTS['io_timeout']:g})")
    m.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this TCP port (off by default)")
    tuning.add_argument("--metrics-address", default=MOUNT_DEFAULTS["metrics_address"], metavar="ADDR",
                   help=f"address the metrics port listens on (default {MOUNT_DEFAULTS['metrics_address']}: "
                   "this host only; 0.0.0.0 for a "
                   "Prometheus that scrapes a pod's IP, behind a NetworkPolicy)")
    tuning.add_argument("--data-path", choices=DATA_PATHS, default=MOUNT_DEFAULTS["data_path"],
                   help="who serves the bytes: passthrough (the kernel reads each open file from a backing file "
                   "the daemon picked and checked at open; needs Linux >= 6.9, the pyfuse3 scripts/install.sh "
                   "builds, and CAP_SYS_ADMIN), daemon (every read answered by this process), or auto (default: "
                   "passthrough where available; the log and `liquidfs stats` say which, and why)")
    tuning.add_argument("--verify-reads", action="store_true",
                   help="passthrough: read every file whole and check it (a raw object against its checksum) "
                   "before the open answers, instead of trusting a raw object that is as prepare left it "
                   "(size and inode unchanged since). Costs a copy in memory per open file")
    tuning.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True,
                   help="local stores: when a lookup shows a directory's metadata is not in memory, warm it (a "
                   "stat of each file's source and raw object, eight at once, in a helper process each loop "
                   "starts, or the daemon's own threads should it fail) so the opens that follow are answered "
                   "without a thread hop (default on)")
    tuning.add_argument("--time-requests", action="store_true",
                   help="profiling: also time the CPU each FUSE request costs the daemon's loop, per request "
                   "type (`liquidfs stats` shows count, wall and CPU seconds of each; count and wall are always "
                   "kept). Costs about a microsecond a request")
    m.add_argument("--mix", type=argument(options.mix), default=MOUNT_DEFAULTS["mix"], metavar="MODE",
                   help="which images with a raw object are served raw: 'prepared' (all of them; default), a "
                   "share in [0, 1] up to prepare's --ratio (the rest are served as their originals, chosen at "
                   "random per image), or 'adaptive' (a share chosen while the mount runs, from the node's CPU "
                   "and IO pressure: more raw when decoding binds, fewer when storage does; `liquidfs stats` "
                   "shows the share and why)")
    tuning.add_argument("--mix-interval", type=float, default=MOUNT_DEFAULTS["mix_interval"], metavar="SECONDS",
                   help="--mix adaptive: seconds between two decisions, each from the pressure and rates seen "
                   f"over the last interval (default {MOUNT_DEFAULTS['mix_interval']:g})")
    tuning.add_argument("--pressure-dir", default=str(MOUNT_DEFAULTS["pressure_dir"]), metavar="DIR",
                   help="--mix adaptive: where the CPU and IO pressure are read: the node's (default "
                   f"{MOUNT_DEFAULTS['pressure_dir']}; the CPU use that of a cgroup limiting the daemon to fewer "
                   "cores than it may run on, if one does) or a cgroup v2 group's directory (its cpu.pressure, "
                   "io.pressure and cpu.stat: the loader's, where the daemon runs apart from it)")
    tuning.add_argument("--rescan", action="store_true", help="rebuild the catalog even if the source looks unchanged")
    tuning.add_argument("--refresh", action="store_true",
                   help="s3:// sources: list the source bucket again on this node instead of using the store's "
                   "catalog as is (new or changed objects; prepared images stay raw while unchanged)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.add_argument("--daemon-config", metavar="JSON", help=argparse.SUPPRESS)  # a started daemon's MountConfig
    add_common(m)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to exit",
                       description="Unmount MOUNTPOINT and wait until its daemon has exited. A busy mount is "
                       "refused with the list of processes holding it, unless --lazy.")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", "-z", action="store_true", help="detach now, finish when the last user lets go")
    u.add_argument("--timeout", type=argument(options.positive_float), default=UNMOUNT_TIMEOUT,
                   help=f"seconds to wait for the daemon (default {UNMOUNT_TIMEOUT:g})")
    add_common(u)
    u.set_defaults(func=cmd_umount)

    s = sub.add_parser("stats", help="show a running mount's statistics",
                       description="Print the statistics of the liquidfs mount at MOUNTPOINT (read from its "
                       "hidden control file).")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--watch", type=argument(_watch_seconds), nargs="?", const=2.0, metavar="SECONDS",
                   help="repeat every SECONDS (default 2; 0.1 to a day) until Ctrl-C (after the mount point, or as "
                   "--watch=SECONDS before it)")
    s.add_argument("--probe", action="store_true",
                   help="print nothing; exit 0 only if the mount answers (for readiness probes)")
    add_common(s)
    s.set_defaults(func=cmd_stats)


#: ``stats --watch``'s interval: past a day a value is a typo (``1e10`` overflowed the sleep, a traceback); below
#: a tenth of a second, each read of the control file (statistics built on the mount's loop) in a tight loop.
MAX_WATCH_SECONDS = 86400.0
MIN_WATCH_SECONDS = 0.1


def _watch_seconds(text: str) -> float:
    seconds = options.positive_float(text)
    if not MIN_WATCH_SECONDS <= seconds <= MAX_WATCH_SECONDS:
        raise ValueError(f"from {MIN_WATCH_SECONDS:g} seconds to {MAX_WATCH_SECONDS:g} (a day), not {text}")
    return seconds


def cmd_mount(args: argparse.Namespace) -> int:
    from ..daemon.config import MountConfig, MountError
    from ..daemon.control import check_allow_other, check_metrics_listen, check_mountpoint
    from ..daemon.spawn import spawn_daemon
    from ..stores import open_store

    if args.daemon_config is not None:
        # The daemon a mount started: its options were parsed and checked by that mount, and it finds the catalog
        # that mount made ready.
        try:
            config = MountConfig.from_json(args.daemon_config)
        except (ValueError, TypeError) as exc:  # (json's errors are ValueErrors) a line, never a traceback
            raise MountError(f"--daemon-config: not a mount's config ({exc})") from None
        storage = open_store(config.source, config.store)
        return _serve(config, storage, storage.found_catalog(), args.ready_fd)
    storage = open_store(args.source, args.store)
    config = options.mount_config(args, storage)
    for line in options.ignored_flags(args):
        print(f"liquidfs mount: {line}", file=sys.stderr)
    check_allow_other(config.allow_other, list(config.fuse_options))
    check_metrics_listen(config.metrics_port, config.metrics_address)
    config = dataclasses.replace(config, mountpoint_seen=check_mountpoint(config.mountpoint))
    started = time.monotonic()
    if args.foreground:
        # A --ready-fd is a starter's that has just made the catalog ready: found, never built, here.
        store = storage.found_catalog() if args.ready_fd is not None else \
            storage.mount_catalog(rescan=args.rescan or args.refresh)
        return _serve(config, storage, store, args.ready_fd)
    store = storage.mount_catalog(rescan=args.rescan or args.refresh)
    log_file = Path(args.log_file).absolute() if args.log_file else store / "mount.log"
    # The daemon gets the parsed options whole (it runs in /: every path in them is absolute), and of the
    # command line only what it needs before it reads them: where to log, and how much.
    argv = ["mount", config.source, str(config.mountpoint), "--log-file", str(log_file),
            "--log-level", args.log_level if args.log_level != "warning" else "info",
            "--daemon-config", config.to_json()]
    spawn_daemon(argv, log_file, mountpoint=config.mountpoint)
    took = time.monotonic() - started
    try:
        said = _data_path_said(config.mountpoint)
    except KeyboardInterrupt:  # (SIGTERM's too): the mount is made and serves; a script must not mount it again
        said = "data path: see `liquidfs stats`"
    print(f"liquidfs: {config.source} mounted on {config.mountpoint} ({took:.1f} s; log {log_file}); {said}")
    return 0


def _serve(config: MountConfig, storage: Store, store: Path, ready_fd: int | None) -> int:
    """Serve the mount in this process (the daemon, or ``--foreground``). Its modules are imported here: a mount
    that starts a daemon, like ``umount`` and ``stats``, runs without trio, pyfuse3 or NumPy."""
    from ..daemon.serve import exit_past_stuck_threads, serve

    try:
        code = serve(config, storage, store, ready_fd=ready_fd)
    except BaseException:
        exit_past_stuck_threads(1)  # (the failure is in the log already: serve said it)
        raise
    exit_past_stuck_threads(code)
    return code


def _data_path_said(mountpoint: Path) -> str:
    """Which data path the new mount serves through, and why the daemon's where it is (its ``stats``)."""
    from ..daemon.control import read_control_within

    try:  # from a child: a daemon that stops answering right after it said ready must not hold `mount` for good
        values = read_control_within(mountpoint)
    except (OSError, ValueError):
        return "data path: see `liquidfs stats`"
    path, why = values.get("data_path"), values.get("data_path_why")
    said = f"data path: {path}" + (f", since {why}" if path != "passthrough" and why else "")
    loops = values.get("loops")
    if isinstance(loops, list) and len(loops) > 1:
        said += f"; {len(loops)} loops"
    size, share = values.get("cluster_bytes"), values.get("cluster_share")
    if isinstance(size, int) and isinstance(share, (int, float)):
        said += (f"; cluster: {size / 2**20:.0f} MiB from {values.get('cluster_size_from', '--cluster-size')}, "
                 f"{100 * share:.0f}% of the raw objects")
    return said


def cmd_umount(args: argparse.Namespace) -> int:
    from ..daemon.control import unmount

    unmount(Path(args.mountpoint), lazy=args.lazy, timeout=args.timeout)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from ..daemon.control import read_control_within

    mountpoint = Path(args.mountpoint)
    if args.probe:
        try:
            read_control_within(mountpoint)
        except (OSError, ValueError):
            return 1
        return 0
    while True:
        try:
            values = read_control_within(mountpoint)
        except TimeoutError as exc:
            print(f"liquidfs stats: {mountpoint}: {exc.strerror} (stuck?)", file=sys.stderr)
            if not args.watch:
                return 1
            time.sleep(args.watch)  # a mount busy for a while: watched on, as a watch is for
            continue
        except FileNotFoundError:
            print(f"liquidfs stats: {mountpoint} is not a liquidfs mount", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"liquidfs stats: cannot read {mountpoint}: {exc.strerror}", file=sys.stderr)
            return 1
        except ValueError as exc:  # a file of that name that holds no statistics of ours
            print(f"liquidfs stats: {mountpoint}: not a liquidfs mount's statistics ({exc})", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(values, indent=1, sort_keys=True))
        else:
            print(_table(values))
        if not args.watch:
            return 0
        sys.stdout.flush()
        time.sleep(args.watch)
        print()


def _table(values: dict[str, Any]) -> str:
    """A mount's statistics in lines, escaped: any user can mount something that answers as a liquidfs mount,
    and a root's terminal must not take its escape sequences."""
    from ..sysio.safefiles import escape_controls

    jobs = values.pop("jobs", None)
    # Keys padded to the longest of ours, at most: one key of 400 kB padded each of 50,000 lines to it (20 GB of
    # output from a 1 MB control file); and each line cut to what a terminal shows.
    width = min(max((len(k) for k in values), default=0), _KEY_WIDTH)
    lines = [f"{key:<{width}}  {values[key]}"[:_LINE_CHARS] for key in sorted(values)]
    if isinstance(jobs, dict):
        for job, entry in sorted(jobs.items(), key=lambda item: str(item[0]).zfill(20)):
            try:
                lines.append(_job_line(job, entry)[:_LINE_CHARS])
            # (ArithmeticError: a count too large for a float, in a control file someone else's mount answers)
            except (AttributeError, TypeError, ValueError, ArithmeticError):  # shown as it is
                lines.append(f"job {job}: {entry}"[:_LINE_CHARS])
    return "\n".join(escape_controls(line) for line in lines)


#: ``stats``' table: the widest key column, and the longest line shown.
_KEY_WIDTH = 40
_LINE_CHARS = 400


def _job_line(job: str, entry: dict[str, Any]) -> str:
    """One job of a mount's next-epoch cache, in words (``liquidfs stats``)."""
    ratio = entry.get("hit_ratio")
    mean, low = entry.get("window_hit_ratio_mean"), entry.get("window_hit_ratio_low")
    windows = f", windows after its first epoch {mean:.2f} mean, {low:.2f} lowest" if mean is not None else ""
    return (f"job {job}: epoch {entry.get('epoch')}, {entry.get('reads')} reads, hit ratio "
            f"{'-' if ratio is None else f'{ratio:.2f}'}{windows}, "
            f"{entry.get('storage_bytes', 0) / 1e6:.1f} MB from storage ({entry.get('openers', '?')})")
