"""The ``liquidfs`` command: argument parsing and user-facing messages for every subcommand."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..daemon.config import DATA_PATHS
from ..datapath.daemon import PAGE_CACHE_MODES
from ..expand.rawformats import DEFAULT, DEFAULT_FORMATS, RAW_FORMATS
from . import options
from .options import MOUNT_DEFAULTS, argument

if TYPE_CHECKING:
    from ..stores import Store

log = logging.getLogger(__name__)

EPILOG = """\
typical use:
  liquidfs prepare /data/cityscapes --store /nvme/liquid --ratio 0.7
  liquidfs mount /data/cityscapes /mnt/cityscapes --store /nvme/liquid
  python train.py --data /mnt/cityscapes
  liquidfs umount /mnt/cityscapes
"""


def _setup_logging(level: str, log_file: str | None) -> None:
    """Every record one line (names are escaped); a log file is never opened through a link (``safefiles``)."""
    from ..sysio.safefiles import LOG_FORMAT, EscapingFormatter, LogFileHandler, log_uncaught

    handler: logging.Handler
    if log_file:
        handler = LogFileHandler(log_file)
        log_uncaught()  # the daemon's tracebacks go to this file too: escaped like any record
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The AWS SDK's debug output carries request headers (the access key id, signatures): kept out of the log.
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLevelName(level.upper())))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=os.environ.get("LIQUIDFS_LOG_LEVEL", "warning"),
                   choices=["debug", "info", "warning", "error"], help="logging verbosity (default: warning)")
    p.add_argument("--log-file", help="log to this file instead of stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liquidfs", description="A read-only FUSE filesystem that serves image datasets as a lossless "
        "mix of original and pre-expanded raw (BMP) images, for unmodified data loaders.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"liquidfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    m.add_argument("--cache-size", default=os.environ.get("LIQUIDFS_CACHE_SIZE") or None, metavar="SIZE",
                   help="memory for the next-epoch cache: a percentage of the dataset as served (30%%) or bytes "
                   "(24G, 512M); a constant SIZE/dataset share of every epoch is then served from memory. "
                   "Default: no cache (and the page cache keeps no copy of served files)")
    tuning.add_argument("--page-cache", choices=PAGE_CACHE_MODES, default=MOUNT_DEFAULTS["page_cache"],
                   help="what the kernel's page cache keeps of served files the daemon's cache does not hold: "
                   "drop their pages when closed (default: no second copy of the dataset in memory), keep them "
                   "(less daemon CPU; the kernel reclaims them under pressure), or direct (direct_io: no pages; "
                   "see BENCHMARKS.md for what each costs)")
    tuning.add_argument("--open-bytes", metavar="SIZE",
                   help="memory for files opened and not yet read to their end, outside the cache's budget "
                   f"(default {MOUNT_DEFAULTS['open_bytes'] >> 20}M). Files whose content is known without reading them (a local source "
                   "unchanged, a raw object as prepare left it) are always read at their first read; others "
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
                   "everyone may read go to the cluster")
    tuning.add_argument("--cluster-size", metavar="SIZE",
                   help="what the memcacheds of --cluster hold together: a percentage of the dataset as served or "
                   "bytes; the share of the raw objects they hold follows (default: what they say they hold, "
                   "the sum of their -m less ~5 %%, at most the raw objects' bytes)")
    m.add_argument("--warmup", action="store_true",
                   help="fill the cache right after the mount is ready, in the background, so the first epoch hits "
                   "too (progress: `liquidfs stats`, warmup)")
    tuning.add_argument("--readahead-kb", type=int, default=MOUNT_DEFAULTS["readahead_kb"], metavar="KB",
                   help=f"readahead of the mount, so the kernel sends larger reads (default {MOUNT_DEFAULTS['readahead_kb']}; 0 leaves the "
                   "kernel's default; needs root)")
    tuning.add_argument("--io-timeout", type=float, default=MOUNT_DEFAULTS["io_timeout"], metavar="SECONDS",
                   help="a read of the store or the source that takes longer answers EIO to the reader, and the "
                   f"mount goes on serving other files (hung network storage, failing disks; default {MOUNT_DEFAULTS['io_timeout']:g})")
    m.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this TCP port (off by default)")
    tuning.add_argument("--metrics-address", default=MOUNT_DEFAULTS["metrics_address"], metavar="ADDR",
                   help=f"address the metrics port listens on (default {MOUNT_DEFAULTS['metrics_address']}: this host only; 0.0.0.0 for a "
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
                   "stat of each file's source and raw object, in catalog order, in one worker thread) so the "
                   "opens that follow are answered without a thread hop (default on)")
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
                   f"{MOUNT_DEFAULTS['pressure_dir']}) or a cgroup v2 group's directory (its cpu.pressure and io.pressure)")
    tuning.add_argument("--rescan", action="store_true", help="rebuild the catalog even if the source looks unchanged")
    tuning.add_argument("--refresh", action="store_true",
                   help="s3:// sources: list the source bucket again on this node instead of using the store's "
                   "catalog as is (new or changed objects; prepared images stay raw while unchanged)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.add_argument("--daemon-config", metavar="JSON", help=argparse.SUPPRESS)  # a started daemon's MountConfig
    _add_common(m)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to exit",
                       description="Unmount MOUNTPOINT and wait until its daemon has exited. A busy mount is "
                       "refused with the list of processes holding it, unless --lazy.")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", "-z", action="store_true", help="detach now, finish when the last user lets go")
    u.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon (default 30)")
    _add_common(u)
    u.set_defaults(func=cmd_umount)

    s = sub.add_parser("stats", help="show a running mount's statistics",
                       description="Print the statistics of the liquidfs mount at MOUNTPOINT (read from its "
                       "hidden control file).")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                   help="repeat every SECONDS (default 2) until Ctrl-C")
    s.add_argument("--probe", action="store_true",
                   help="print nothing; exit 0 only if the mount answers (for readiness probes)")
    _add_common(s)
    s.set_defaults(func=cmd_stats)

    d = sub.add_parser("doctor", help="say whether this machine can serve through FUSE passthrough, and why not",
                       description="Check each ingredient of the passthrough data path (kernel, its config, the "
                       "libfuse pyfuse3 is linked to, the pyfuse3 patch, CAP_SYS_ADMIN, the store's filesystem) "
                       "without mounting. A mount decides for itself at start and logs which path it took.")
    d.add_argument("--store", help="also check the filesystem of this store directory")
    d.add_argument("--json", action="store_true", help="print JSON")
    _add_common(d)
    d.set_defaults(func=cmd_doctor)

    _add_prepare_arguments(sub, _add_common)
    _add_profile_arguments(sub, _add_common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status: 0, 1 for an error said in one line, 130 interrupted, 141 when stdout's reader left."""
    try:
        try:
            return _run(argv)
        finally:
            # What print() left in the buffer meets a reader that has gone here, where it is caught, rather than
            # at the interpreter's exit.
            sys.stdout.flush()
    except BrokenPipeError:
        # `liquidfs stats MNT | head`: the reader has what it wanted. Nothing more is written (stdout now goes
        # nowhere, so the exit's own flush cannot fail again), and the status is what a shell reports for a
        # tool killed by SIGPIPE (128 + 13): `set -o pipefail` sees what it sees of `cat | head`, where 0
        # would claim that everything was printed.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _run(argv: Sequence[str] | None) -> int:
    # Everything liquidfs writes (catalogs, raw objects, the disk cache, logs) is its owner's only: a raw object
    # of a 0600 image, or the names of a 0700 directory, must not become readable by every local user.
    os.umask(0o077)
    args = build_parser().parse_args(argv)
    try:
        _setup_logging(args.log_level, args.log_file)
    except OSError as exc:  # a --log-file that is a link, or cannot be written
        print(f"liquidfs {args.command}: cannot log to {args.log_file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    from ..catalog import CatalogError
    from ..daemon.config import MountError
    from ..stores.sample import ProfileError

    try:
        return int(args.func(args))
    except (MountError, CatalogError, ProfileError, options.OptionError) as exc:
        print(f"liquidfs {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"liquidfs {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            raise  # main() ends quietly
        log.debug("%s failed", args.command, exc_info=True)  # the traceback, for --log-level debug
        print(f"liquidfs {args.command}: {_describe_os_error(exc, args)}", file=sys.stderr)
        return 1
    except Exception as exc:
        # The object store's client errors (no credentials, endpoint unreachable, access denied) are the
        # user's to fix: one line that says which, not a traceback.
        if type(exc).__module__.startswith(("botocore", "boto3", "s3transfer")):
            print(f"liquidfs {args.command}: object store: {exc}", file=sys.stderr)
            return 1
        raise


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll says POLLERR): a BrokenPipeError of a socket is an
    error like any other."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _describe_os_error(exc: OSError, args: argparse.Namespace) -> str:
    """One line for an OSError: the path (decoded, never a bytes repr), the cause, and what to do where known."""
    from ..sysio.safefiles import escape_controls

    if exc.strerror is None:
        return escape_controls(str(exc))  # raised with a message of liquidfs's own
    path = os.fsdecode(exc.filename) if exc.filename is not None else None
    text = f"{path}: {exc.strerror}" if path else exc.strerror
    advice = _store_advice(exc, args, path)
    return escape_controls(f"{text} ({advice})" if advice else text)


def _store_advice(exc: OSError, args: argparse.Namespace, path: str | None) -> str | None:
    """What to do when the store (or a directory on the way to it) is not this user's to write or read."""
    import errno

    from ..catalog import cache_home

    if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or path is None:
        return None
    store, default = _local_store(args)
    failed = Path(os.path.abspath(path))
    if store is None or not (failed == store or store in failed.parents or failed in store.parents):
        return None
    try:
        owner: int | None = os.stat(store).st_uid
    except OSError:
        owner = None
    if owner is not None and owner != os.geteuid():
        who = "root (uid 0)" if owner == 0 else f"uid {owner}"
        return (f"the store belongs to {who}, and stores are owner-only: give --store a directory of your own, "
                f"or run this as {'root' if owner == 0 else who}")
    if default:
        return (f"the default store is under {cache_home()}, which you cannot write: give --store a directory "
                "of your own, or set XDG_CACHE_HOME")
    return "give --store a directory you can write; liquidfs makes it, owner-only"


def _local_store(args: argparse.Namespace) -> tuple[Path | None, bool]:
    """The local store directory this command works on (None for none, or a store with a URL scheme: s3://), and
    whether it is the default one (a mount without --store)."""
    from ..stores import scheme

    store = getattr(args, "store", None)
    if store is not None:
        return (None, False) if scheme(str(store)) else (Path(os.path.abspath(store)), False)
    source = getattr(args, "source", None)
    if args.command != "mount" or source is None or scheme(str(source)):
        return None, False
    from ..catalog import default_store_dir

    return default_store_dir(source), True


def cmd_mount(args: argparse.Namespace) -> int:
    from ..daemon.config import MountConfig
    from ..daemon.control import check_allow_other, check_mountpoint
    from ..daemon.serve import serve
    from ..daemon.spawn import spawn_daemon
    from ..stores import open_store

    if args.daemon_config is not None:
        # The daemon a mount started: its options were parsed and checked by that mount, and it finds the catalog
        # that mount made ready.
        config = MountConfig.from_json(args.daemon_config)
        storage = open_store(config.source, config.store)
        return serve(config, storage, storage.found_catalog(), ready_fd=args.ready_fd)
    storage = open_store(args.source, args.store)
    config = options.mount_config(args, storage)
    check_allow_other(config.allow_other, list(config.fuse_options))
    check_mountpoint(config.mountpoint)
    started = time.monotonic()
    if args.foreground:
        # A --ready-fd is a starter's that has just made the catalog ready: found, never built, here.
        store = storage.found_catalog() if args.ready_fd is not None else \
            storage.mount_catalog(rescan=args.rescan or args.refresh)
        return serve(config, storage, store, ready_fd=args.ready_fd)
    store = storage.mount_catalog(rescan=args.rescan or args.refresh)
    log_file = Path(args.log_file).absolute() if args.log_file else store / "mount.log"
    # The daemon gets the parsed options whole (it runs in /: every path in them is absolute), and of the
    # command line only what it needs before it reads them: where to log, and how much.
    argv = ["mount", config.source, str(config.mountpoint), "--log-file", str(log_file),
            "--log-level", args.log_level if args.log_level != "warning" else "info",
            "--daemon-config", config.to_json()]
    spawn_daemon(argv, log_file)
    print(f"liquidfs: {config.source} mounted on {config.mountpoint} ({time.monotonic() - started:.1f} s; "
          f"log {log_file}); " + _data_path_said(config.mountpoint))
    return 0


def _data_path_said(mountpoint: Path) -> str:
    """Which data path the new mount serves through, and why the daemon's where it is (its ``stats``)."""
    from ..daemon.control import read_control

    try:
        values = read_control(mountpoint)
    except (OSError, ValueError):
        return "data path: see `liquidfs stats`"
    path, why = values.get("data_path"), values.get("data_path_why")
    said = f"data path: {path}" + (f", since {why}" if path != "passthrough" and why else "")
    size, share = values.get("cluster_bytes"), values.get("cluster_share")
    if isinstance(size, int) and isinstance(share, (int, float)):
        said += (f"; cluster: {size / 2**20:.0f} MiB from {values.get('cluster_size_from', '--cluster-size')}, "
                 f"{100 * share:.0f}% of the raw objects")
    return said


def cmd_doctor(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .doctor import checks, verdict

    found = checks(Path(args.store) if args.store else None)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in found], "verdict": verdict(found)}, indent=1))
        return 0
    width = max(len(c.name) for c in found)
    for c in found:
        mark = {True: "ok", False: "NO", None: "?"}[c.ok]
        print(f"{mark:<3} {c.name:<{width}}  {c.found}" + (f"  (needs {c.needed})" if c.ok is False else ""))
    print(verdict(found))
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    from ..daemon.control import unmount

    unmount(Path(args.mountpoint), lazy=args.lazy, timeout=args.timeout)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from ..daemon.control import read_control

    mountpoint = Path(args.mountpoint)
    if args.probe:
        try:
            read_control(mountpoint)
        except (OSError, ValueError):
            return 1
        return 0
    while True:
        try:
            values = read_control(mountpoint)
        except FileNotFoundError:
            print(f"liquidfs stats: {mountpoint} is not a liquidfs mount", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"liquidfs stats: cannot read {mountpoint}: {exc.strerror}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(values, indent=1, sort_keys=True))
        else:
            jobs = values.pop("jobs", None)
            width = max(len(k) for k in values)
            for key in sorted(values):
                print(f"{key:<{width}}  {values[key]}")
            if isinstance(jobs, dict):
                for job, entry in sorted(jobs.items(), key=lambda item: int(item[0])):
                    print(_job_line(job, entry))
        if not args.watch:
            return 0
        sys.stdout.flush()
        time.sleep(args.watch)
        print()


def _job_line(job: str, entry: dict[str, Any]) -> str:
    """One job of a mount's next-epoch cache, in words (``liquidfs stats``)."""
    ratio = entry.get("hit_ratio")
    mean, low = entry.get("window_hit_ratio_mean"), entry.get("window_hit_ratio_low")
    windows = f", windows after its first epoch {mean:.2f} mean, {low:.2f} lowest" if mean is not None else ""
    return (f"job {job}: epoch {entry.get('epoch')}, {entry.get('reads')} reads, hit ratio "
            f"{'-' if ratio is None else f'{ratio:.2f}'}{windows}, "
            f"{entry.get('storage_bytes', 0) / 1e6:.1f} MB from storage ({entry.get('openers', '?')})")


# -- prepare, verify, profile ---------------------------------------------------------------------------

#: ``--formats``'s metavar: png, the default raw format, and the others optional.
FORMATS_METAVAR = ",".join(["png", DEFAULT.name]) + "".join(f"[,{n}]" for n in sorted(RAW_FORMATS) if n != DEFAULT.name)


def _formats_help() -> str:
    """What prepare's ``--formats`` help says of each raw format, from the registry."""
    each = ", ".join(f"{f.name} ({'default: ' if f is DEFAULT else ''}{f.about})"
                     for f in sorted(RAW_FORMATS.values(), key=lambda f: f.name))
    several = "both" if len(RAW_FORMATS) == 2 else "several"
    order = ", ".join(f.label for f in RAW_FORMATS.values())
    return (f"what the expanded images are stored as: {each}, or {several} (each image as the first of {order} "
            "that holds it exactly). Every object is checked to decode to the source's pixels under Pillow")


def _add_prepare_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                           add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "prepare", help="expand a share of the images to raw BMP in a store",
        description="Choose a seeded random share (--ratio) of the PNG/JPEG images under SOURCE, expand each to "
        "a BMP that decodes to exactly the same pixels (checked before it is accepted), and record the choice "
        "in the store's catalog. Resumable and idempotent; changing --ratio reuses existing expansions. The "
        "source is never written.")
    p.add_argument("source", help="the dataset directory, or s3://BUCKET/PREFIX")
    p.add_argument("--store", required=True,
                   help="directory for the catalog and the raw objects; s3://BUCKET/PREFIX for an s3:// source "
                   "(the catalog is uploaded there at the end, for every node's mounts)")
    p.add_argument("--ratio", type=argument(options.ratio), required=True,
                   help="share of eligible images served raw: 0..1, a percentage, or 'auto' (profile first)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choice (default 0)")
    p.add_argument("--formats", type=argument(options.formats), default=DEFAULT_FORMATS, metavar=FORMATS_METAVAR,
                   help=_formats_help())
    p.add_argument("--jobs", "-j", type=int,
                   help="worker processes (default: the cores this process may use, fewer where memory is short: "
                   "each worker gets room for the largest image expanded, 100 Mpx, about 2.5 GB). A larger "
                   "value is lowered to what fits in the memory left (cgroup limit, MemAvailable), with a warning")
    p.add_argument("--quick", action="store_true",
                   help="with --ratio auto: a quick profile (a smaller sample, shorter measurements)")
    _add_run_arguments(p, prefix="with --ratio auto: ")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common(p)
    p.set_defaults(func=cmd_prepare)

    v = sub.add_parser(
        "verify", help="check every raw object against its source",
        description="Re-decode every raw object of the store and its source and compare pixels and checksums. "
        "Exit status 0 only when all hold.")
    v.add_argument("--store", required=True, help="the store directory, or the s3:// store prepare wrote to")
    v.add_argument("--sample", type=int, help="check only N random objects")
    v.add_argument("--jobs", "-j", type=int,
                   help="worker processes (default: the cores, fewer where memory is short; lowered to what fits)")
    v.add_argument("--no-progress", action="store_true")
    add_common(v)
    v.set_defaults(func=cmd_verify)


def cmd_prepare(args: argparse.Namespace) -> int:
    ratio, raw_formats = args.ratio, args.formats
    from ..prepare import PrepareError, prepare_store
    from ..stores import open_store

    store = open_store(args.source, args.store)
    if ratio != "auto" and args.run is not None:
        print("liquidfs prepare: --run times a loader for --ratio auto; with a given ratio there is nothing to "
              "measure", file=sys.stderr)
        return 2
    if ratio != "auto" and args.cache_size:
        print("liquidfs prepare: --cache-size weighs the mount's cache for --ratio auto; give it to mount",
              file=sys.stderr)
        return 2
    if ratio == "auto":
        ratio, chosen_format = _auto_ratio(store, quick=args.quick, formats=raw_formats,
                                           run_options=_run_options(args))
        # The chosen format, and those tried after it for the images it cannot hold (J2K chosen: BMP, if listed;
        # BMP chosen: BMP alone).
        raw_formats = raw_formats[raw_formats.index(chosen_format):]
        print(f"profile chose ratio {ratio:.2f} (raw images as {chosen_format.upper()})")
    try:
        report = prepare_store(store, ratio, seed=args.seed, jobs=args.jobs, progress=not args.no_progress,
                               raw_formats=raw_formats)
    except PrepareError as exc:
        print(f"liquidfs prepare: {exc}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    written = [RAW_FORMATS[f] for f in raw_formats]
    for fmt in written:
        print(f"{fmt.name} objects decode to the source's pixels under: {', '.join(fmt.exact_for)}")
    for fmt in written:
        if fmt.gpu_decoder is not None and fmt.gpu_decoder not in fmt.exact_for:
            print(f"liquidfs prepare: {fmt.label} objects are for DALI's 'mixed' decoder (nvJPEG2000), which this "
                  "project has not yet shown exact on a GPU: check it on yours with "
                  "`python scripts/bench/bench_j2k.py` before training", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..catalog import CatalogError
    from ..prepare import verify

    try:
        failures = verify(args.store, sample=args.sample, jobs=args.jobs, progress=not args.no_progress)
    except CatalogError as exc:
        print(f"liquidfs verify: {exc}", file=sys.stderr)
        return 2
    for path, problem in failures:
        print(f"FAIL {path}: {problem}")
    print("verify: " + ("all raw objects sound" if not failures else f"{len(failures)} problems"))
    return 1 if failures else 0


def _auto_ratio(store: Store, *, quick: bool = False, formats: tuple[str, ...] = DEFAULT_FORMATS,
                run_options: dict[str, object] | None = None) -> tuple[float, str]:
    """``prepare --ratio auto``: profile (weighing the raw ``formats``), and keep the result in the store
    (``mount --mix adaptive`` starts at its choice). The share, and the raw format it is for."""
    from ..profile.choose import profile_store, render, to_json

    run_options = run_options or {}
    profile = profile_store(store, quick=quick, formats=formats, **run_options,  # type: ignore[arg-type]
                            progress=lambda s: print(f"profile: {s}", file=sys.stderr))
    print(render(profile))
    try:
        store.keep_profile(json.dumps(to_json(profile), indent=1))
    except OSError as exc:
        print(f"profile: cannot keep the result in {store.label}: {exc.strerror}", file=sys.stderr)
    return profile.chosen, profile.raw_format


def _add_run_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The measured search's flags, shared by ``profile`` and ``prepare --ratio auto``."""
    p.add_argument("--run", metavar="CMD",
                   help=prefix + "time this loader command through a temporary mount of a sample at each share a "
                   "binary search asks for; {mount} in CMD is replaced by the mount point, e.g. --run 'python "
                   "train.py --data {mount} --steps 40' (run without a shell; its rate is the opens/s the mount "
                   "counts). Default: a built-in DALI or Pillow pipeline (decode, random resized crop, flip, "
                   "normalise)")
    p.add_argument("--run-images", type=argument(options.positive_int), metavar="N",
                   help=prefix + "images in the mounted sample (default 256, --quick 64)")
    p.add_argument("--repeats", type=argument(options.positive_int), default=3, metavar="N",
                   help=prefix + "runs per share at most, where two shares' rates are within noise (default 3)")
    p.add_argument("--run-timeout", type=float, default=600.0, metavar="SECONDS",
                   help=prefix + "the longest one run of the command may take (default 600)")
    p.add_argument("--model-only", action="store_true",
                   help=prefix + "no measured search: choose by the cost model alone (no mount; seconds)")
    p.add_argument("--cache-size", type=argument(options.cache_share), default=0.0, metavar="PERCENT",
                   help=prefix + "the --cache-size the dataset will be mounted with, as a percentage (default 0%%): "
                   "its hits take that share of the bytes off storage, which moves the balance towards raw; the "
                   "measured runs have it and are timed from their second epoch")


def _run_options(args: argparse.Namespace) -> dict[str, object]:
    return {"run": args.run, "measured": not args.model_only, "run_images": args.run_images,
            "repeats": args.repeats, "run_timeout": args.run_timeout, "cache_share": args.cache_size}


def _add_profile_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                           add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    from ..profile.choose import __doc__ as profile_doc

    p = sub.add_parser(
        "profile", help="measure this machine and choose the share of images to serve raw",
        description=profile_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source")
    p.add_argument("--store", required=True, help="the store (the sample is expanded on its device)")
    p.add_argument("--decoder", choices=["dali", "pil"], help="the loader's decoder (default: dali if installed)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="decoder threads (default: all cores)")
    p.add_argument("--sample", type=int, help="images in the sample (default 24, --quick 8)")
    p.add_argument("--quick", action="store_true",
                   help="a smaller sample and shorter measurements: the model in < 30 s, the measured search over "
                   "64 images")
    on_gpu = [f for f in RAW_FORMATS.values() if f.gpu_decoder]
    p.add_argument("--formats", type=argument(options.formats), default=DEFAULT_FORMATS, metavar=FORMATS_METAVAR,
                   help=f"the raw formats to weigh (as prepare's --formats): {DEFAULT.name} (default), or also "
                   + ", ".join(f"{f.name} ({f.about})" for f in on_gpu)
                   + f"; {'/'.join(f.label for f in on_gpu)} weighed only where the decoder is DALI and a CUDA "
                   "device is visible, and chosen where predicted faster")
    p.add_argument("--target-rate", type=float, metavar="IMG_PER_S",
                   help="choose the smallest raw share that reaches this rate (saves disk space)")
    _add_run_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot of the curves")
    add_common(p)
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from ..profile.choose import plot, profile_store, render, to_json
    from ..stores import open_store
    from ..sysio.safefiles import replace_file

    profile = profile_store(open_store(args.source, args.store), decoder=args.decoder, threads=args.threads,
                            sample=args.sample, quick=args.quick,
                            target_rate=args.target_rate, formats=args.formats,
                            **_run_options(args),  # type: ignore[arg-type]
                            progress=lambda s: print(f"profile: {s}", file=sys.stderr))
    print(render(profile))
    if args.json:
        # a path in a directory others may write (/tmp): replaced whole, never written through a link
        replace_file(args.json, json.dumps(to_json(profile), indent=1).encode())
    if args.plot:
        plot(profile, args.plot)
    return 0
