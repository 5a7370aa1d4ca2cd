"""``liquidfs``: the command's parser (one module per subcommand adds its own), logging, and every error
turned into one line for the user and an exit status."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from .. import __version__
from ..sysio import reexec
from . import doctor, mount, prepare, profile
from .options import CommandParser, OptionError

log = logging.getLogger(__name__)

#: Commands whose end by SIGTERM or SIGHUP runs their clean-up as Ctrl-C's does (``Terminated``): what they make
#: outside their process (a profile's scratch mount and sample copies, a mount's daemon still starting) would
#: outlive a process the signal killed. Not a mount's daemon (``--foreground``): its handlers are its own
#: (``daemon.serve``) to its last instant, where signals that keep coming must find no default action.
CLEANS_UP_ON_TERM = ("profile", "prepare", "verify", "mount")


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`timeout`, a Job's deadline, a closed terminal), raised where the signal landed, so the
    ``finally`` blocks and context managers that Ctrl-C runs run for it too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


TERM_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_terminated(signum: int, frame: object) -> None:
    # Once: a second signal while the clean-up runs (a shell's kill repeated) must not cut it short.
    for each in TERM_SIGNALS:
        if signal.getsignal(each) is not signal.SIG_IGN:  # (nohup's stays)
            signal.signal(each, lambda *_: None)  # not SIG_IGN: an ignored signal stays ignored in children exec'd
    raise Terminated(signum)


@contextlib.contextmanager
def _terminated_raises(command: str, *, daemon: bool = False) -> Iterator[None]:
    """``Terminated`` raised by SIGTERM/SIGHUP for the command's run, where it cleans up (``CLEANS_UP_ON_TERM``),
    is no mount's daemon (``daemon``) and runs in the main thread (where Python runs handlers); the handlers
    before restored after it (``main`` called in a process that has its own)."""
    if command not in CLEANS_UP_ON_TERM or daemon or threading.current_thread() is not threading.main_thread():
        yield
        return
    # A signal ignored already stays so (`nohup liquidfs prepare ... &`: a closed terminal must not stop it).
    before = {each: handler for each in TERM_SIGNALS if (handler := signal.getsignal(each)) is not signal.SIG_IGN}
    for each in before:
        signal.signal(each, _raise_terminated)
    try:
        yield
    finally:
        for each, handler in before.items():
            signal.signal(each, handler)

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


LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_common(p: argparse.ArgumentParser) -> None:
    # argparse checks a flag's value against its choices, never a default: the environment's is checked in _run.
    # (str.lower: INFO as the environment's is taken, an fstab's log_level=INFO or a ConfigMap's)
    p.add_argument("--log-level", default=os.environ.get("LIQUIDFS_LOG_LEVEL", "warning"), choices=LOG_LEVELS,
                   type=str.lower,
                   help="logging verbosity (default: warning, or $LIQUIDFS_LOG_LEVEL)")
    p.add_argument("--log-file", help="log to this file instead of stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liquidfs", description="A read-only FUSE filesystem that serves image datasets as a lossless "
        "mix of original and pre-expanded raw (BMP) images, for unmodified data loaders.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"liquidfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)

    mount.add_arguments(sub, _add_common)
    doctor.add_arguments(sub, _add_common)
    prepare.add_arguments(sub, _add_common)
    profile.add_arguments(sub, _add_common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status: 0, 1 for an error said in one line, 130 interrupted (143 by SIGTERM, 129 by SIGHUP), 141
    when stdout's reader left."""
    # Names are bytes, not text: one that is no UTF-8 (os.fsdecode's surrogates) is written as its own bytes. A
    # strict stream raised UnicodeEncodeError at the line that said a mount was made, and `mount` exited 1 with a
    # traceback over a daemon that served.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="surrogateescape")
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
    # The Python helpers multiprocessing starts run as ``python -c ...``, with the working directory first on
    # their import path: root's prepare in a directory a dataset's writer may write imported theirs.
    reexec.helpers_off_cwd()
    args = build_parser().parse_args(argv)
    args.log_level = args.log_level.lower()  # LIQUIDFS_LOG_LEVEL=INFO as well (argparse checks flags only)
    if args.log_level not in LOG_LEVELS:  # a typo in a sidecar's environment: said, never every command broken
        from ..sysio.safefiles import escape_controls

        print(f"liquidfs {args.command}: LIQUIDFS_LOG_LEVEL={escape_controls(args.log_level)[:40]} is none of "
              f"{', '.join(LOG_LEVELS)}: warning used", file=sys.stderr)
        args.log_level = "warning"
    try:
        _setup_logging(args.log_level, args.log_file)
    except OSError as exc:  # a --log-file that is a link, or cannot be written
        print(f"liquidfs {args.command}: cannot log to {args.log_file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    from ..catalog.schema import CatalogError
    from ..daemon.config import MountError
    from ..stores.sample import ProfileError

    try:
        with _terminated_raises(args.command, daemon=bool(getattr(args, "foreground", False))):
            return int(args.func(args))
    except (MountError, CatalogError, ProfileError, OptionError) as exc:
        print(f"liquidfs {args.command}: {exc}", file=sys.stderr)
        return 1
    except Terminated as exc:
        print(f"liquidfs {args.command}: terminated ({exc})", file=sys.stderr)
        return 128 + exc.signum  # what a shell reports for a process the signal killed
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
        if type(exc).__module__.startswith(("botocore", "boto3", "s3transfer", "liquidfs.stores.s3")):
            print(f"liquidfs {args.command}: object store: {exc}", file=sys.stderr)
            return 1
        # A catalog that cannot be read or written (a full disk, a corrupt file): the user's to fix as well.
        import sqlite3

        if isinstance(exc, sqlite3.Error):
            log.debug("%s failed", args.command, exc_info=True)
            print(f"liquidfs {args.command}: catalog: {exc}", file=sys.stderr)
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

    from ..sysio.home import cache_home

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
    from ..catalog.catalog import default_store_dir

    return default_store_dir(source), True
