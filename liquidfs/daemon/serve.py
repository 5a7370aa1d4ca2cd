"""Mount lifecycle: checks of the mount point, daemonizing, readiness, signals, clean unmount.

``liquidfs mount`` (no ``--foreground``) prepares the catalog in the calling process, so errors and progress reach
the user's terminal, then starts the daemon as a detached child and returns once the child says the mount answers.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from ..catalog import Catalog, Node
from ..datapath import passthrough
from ..datapath.base import warm_up as warm_up_path
from ..datapath.storage_calls import FUSE_WORKERS
from ..fuse.lookahead import MetadataAhead
from ..fuse.operations import CONTROL_NAME, Operations
from ..held.base import held_descriptors
from ..held.cluster import ClusterTier, EveryoneReads, call_timeout
from ..held.cluster_peers import memcached_client
from ..held.disk import DiskTier
from ..held.sealing import KeyFileError, Sealer, read_key_file
from ..metrics.server import serve_metrics
from ..metrics.stats import MountStats
from ..mix.controller import CpuBusy, MixController, Stalls
from ..mix.share import Mix, steer
from ..policy.next_epoch import NextEpochCache
from ..stores import Store
from ..stores.reader import ChecksCallers, LendsDescriptors, Reader
from ..sysio import reexec
from ..sysio.privileges import has_cap_sys_admin
from ..sysio.safefiles import escape_controls, open_append
from . import build as assemble
from . import watchdog as guard
from .config import Amount, MountConfig, bytes_of

log = logging.getLogger(__name__)


class MountError(Exception):
    """A mount that cannot be made; the message is for the user."""


def is_stale(mountpoint: Path) -> bool:
    """A FUSE mount whose daemon is gone: every access that reaches it fails with ENOTCONN."""
    try:
        # statfs always reaches the daemon; a stat of the root may be answered from cached attributes.
        os.statvfs(mountpoint)
    except OSError as exc:
        # ENOTCONN, or ECONNABORTED for the first access after the daemon died (newer kernels)
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def clean_stale(mountpoint: Path) -> None:
    log.warning("%s is a stale mount (its daemon died); unmounting it lazily", mountpoint)
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False, capture_output=True)


def check_mountpoint(mountpoint: Path) -> None:
    """Refuse what cannot be mounted on, with a message that says what to do; clean a stale mount."""
    if is_stale(mountpoint):
        clean_stale(mountpoint)
    if not mountpoint.exists():
        raise MountError(f"mount point {mountpoint} does not exist (mkdir it first)")
    if not mountpoint.is_dir():
        raise MountError(f"mount point {mountpoint} is not a directory")
    if _fuse_mounted(mountpoint):
        raise MountError(f"{mountpoint} is already mounted; run `liquidfs umount {mountpoint}` first")
    if any(os.scandir(mountpoint)):
        raise MountError(f"mount point {mountpoint} is not empty")


def _fuse_mounted(mountpoint: Path) -> bool:
    """A FUSE filesystem is mounted on ``mountpoint`` (the topmost mount there).

    Any other mount is fine to mount over: in a container the mount point is itself a volume (a bind mount or
    an emptyDir) shared back to the host.
    """
    found = guard.topmost_mount(mountpoint)
    return found is not None and found[0].startswith(b"fuse")


#: Where fusermount3 reads whether users other than root may mount with allow_other.
FUSE_CONF = Path("/etc/fuse.conf")


def check_allow_other(allow_other: bool, options: list[str]) -> None:
    """Refuse an allow_other mount that fusermount3 will refuse (a user's, without ``user_allow_other`` in
    fuse.conf): said here, before a catalog is built and a daemon started, not as the daemon's last words."""
    if not (allow_other or "allow_other" in options) or os.geteuid() == 0 or _has_cap_sys_admin():
        return  # root, or CAP_SYS_ADMIN: libfuse mounts without fusermount3
    try:
        lines = FUSE_CONF.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    except OSError:
        return  # fusermount3 (setuid root) reads what this user cannot: it decides
    if "user_allow_other" not in (line.split("#", 1)[0].strip() for line in lines):  # as fusermount3 reads it
        raise MountError(f"--allow-other: fusermount3 allows it to a user other than root only where {FUSE_CONF} "
                         "has a line user_allow_other (ask root to add it), or mount as root")


def _has_cap_sys_admin() -> bool:
    try:
        return has_cap_sys_admin(Path("/proc/self/status").read_text())
    except OSError:
        return False


def fuse_options(config: MountConfig) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel enforces file modes
    options |= {"ro", "fsname=liquidfs", "subtype=liquidfs", "noatime"}
    if config.allow_other:
        options.add("allow_other")
    options.update(config.fuse_options)
    return options


#: Descriptors kept for everything but open files: the catalog, sockets, worker threads' files, the guard.
_RESERVED_FDS = 1024


def descriptor_budget(ceiling: int = 1 << 20) -> int:
    """How many files may be open through the mount at once: RLIMIT_NOFILE raised as far as this process may
    (a loader such as DALI keeps its whole shuffle buffer open, and every open file may hold a descriptor),
    less a reserve for everything else."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        nr_open = hard
    for limit in (min(max(hard, ceiling), nr_open), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            soft = limit
            break
        except (OSError, ValueError):
            continue  # raising the hard limit needs CAP_SYS_RESOURCE: the soft one still goes up to it
    return max(64, soft - _RESERVED_FDS)


def serve(config: MountConfig, storage: Store, store_dir: Path, *, ready_fd: int | None = None) -> int:
    """Mount ``config`` over ``storage`` (its catalog in ``store_dir``) and serve in this process until unmounted
    or signalled; returns the exit status."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    storage.hold_for_mount(store_dir)
    catalog = Catalog.open(store_dir, readonly=True, immutable=True)
    stats = MountStats(source=config.source, store=storage.label)
    base_reader = storage.reader(catalog, config.threads, config.io_timeout)
    totals = catalog.file_totals()  # one scan of the catalog serves every cache level
    cache = make_cache(totals, config.cache_size)
    disk = make_disk_tier(totals, config, base_reader, cache) if config.disk_cache is not None else None
    cluster = make_cluster_tier(totals, catalog, config, disk or base_reader) if config.cluster else None
    levels = [level.statistics for level in (disk, cluster) if level is not None]
    # A local store's metadata may be warmed ahead of the opens (a disk level in front still walks it at a miss).
    warm = base_reader.warm if isinstance(base_reader, LendsDescriptors) and base_reader.inline_check else None
    ops, built = build_operations(config, catalog, stats, cluster or disk or base_reader, cache,
                                  mix=make_mix(catalog, config, storage),
                                  may_read=base_reader.may_read if isinstance(base_reader, ChecksCallers) else None,
                                  extra_statistics=(lambda: {k: v for f in levels for k, v in f().items()})
                                  if levels else None,
                                  warm=warm if config.lookahead else None)
    before = guard.mount_ids()
    try:
        pyfuse3.init(ops, str(config.mountpoint), fuse_options(config))
    except RuntimeError as exc:
        raise MountError(f"cannot mount {config.mountpoint}: {exc}") from exc
    log.info("mounted %s on %s (pid %d)", config.source, config.mountpoint, os.getpid())
    watchdog = guard.start(os.getpid(), config.mountpoint, before)
    unmount = True
    try:
        trio.run(_main, config, ops, built, ready_fd)
    except BaseException:
        log.exception("the filesystem loop failed; unmounting")
        raise
    finally:
        if watchdog is not None:
            watchdog.terminate()
            watchdog.wait()
        ops.notifier.stop()
        if ops.data is not None:
            ops.data.close()
        if ops.lookahead is not None:
            ops.lookahead.stop()
        pyfuse3.close(unmount=unmount)
        catalog.close()
        if cluster is not None:
            cluster.close()
        if disk is not None:
            disk.close()
        base_reader.close()
        log.info("unmounted %s", config.mountpoint)
    if config.data_path == "passthrough" and ops.stats.data_path != "passthrough":
        return 1  # --data-path passthrough could not be had: the mount was refused (logged why)
    return 0


def build_operations(config: MountConfig, catalog: Catalog, stats: MountStats, reader: Reader,
                     cache: NextEpochCache | None, *, mix: Mix | None = None,
                     may_read: Callable[[Node, int, int, int], bool] | None = None,
                     extra_statistics: Callable[[], dict[str, Any]] | None = None,
                     warm: Callable[[Node], None] | None = None) -> tuple[Operations, assemble.Parts]:
    """The finished ``Operations`` of a mount with these options, and the parts its data path is built from
    (the data path is chosen after INIT where passthrough may be granted: ``choose_data_path``)."""
    # The data path is the daemon's from the start where passthrough cannot be had, whatever INIT says.
    why_not = daemon_only(config)
    descriptors = descriptor_budget()
    # Held memfds are descriptors too: where passthrough may hold them, a share of the budget is theirs and open
    # files have the rest, so the two together never reach RLIMIT_NOFILE (an EMFILE for every open).
    held_files = held_descriptors(descriptors) if cache is not None and not why_not else None
    built = assemble.parts(reader, stats, policy=cache, thread_limiter=trio.CapacityLimiter(config.threads),
                           io_timeout=config.io_timeout, page_cache=config.page_cache,
                           max_open_bytes=config.open_bytes, push_pages=config.push_pages,
                           verify_reads=config.verify_reads, held_files=held_files)
    ops = assemble.operations(catalog, built, data_path="daemon" if why_not else "at init",
                              mix=mix, may_read=may_read if config.allow_other else None,
                              max_open_files=descriptors - (held_files or 0), extra_statistics=extra_statistics,
                              enable_passthrough=config.data_path != "daemon" and passthrough.built_in() is None,
                              time_requests=config.time_requests,
                              lookahead=MetadataAhead(catalog.path, warm) if warm is not None else None)
    if why_not:
        stats.data_path_why = why_not
    return ops, built


def daemon_only(config: MountConfig) -> str | None:
    """Why the daemon path serves whatever the kernel offers, or None where passthrough is worth asking for."""
    if config.data_path == "daemon":
        return "--data-path daemon"
    if config.page_cache == "direct":
        return "--page-cache direct: every read is served by the daemon"
    return None


def make_mix(catalog: Catalog, config: MountConfig, storage: Store) -> Mix | None:
    """``--mix``: None for "prepared" (every raw object served, nothing to decide per open)."""
    if config.mix == "prepared":
        return None
    try:
        prepared = float(catalog.meta("ratio") or 0.0)
        seed = int(catalog.meta("seed") or 0)
    except ValueError as exc:
        raise MountError(f"the store's catalog has an unreadable ratio or seed: {exc}") from exc
    start = storage.profile_choice() if config.mix == "adaptive" else None
    try:
        mix = Mix(config.mix, prepared, seed=seed, start=start)
    except ValueError as exc:
        raise MountError(str(exc)) from exc
    log.info("mix: %s, raw share %.3f of the images (prepared %.3f): %s", mix.mode, mix.share, prepared, mix.reason)
    return mix


def make_cluster_tier(totals: tuple[int, int, int, int], catalog: Catalog, config: MountConfig,
                      reader: Reader) -> ClusterTier:
    """The cluster level: the share of the raw objects the memcacheds of ``--cluster`` hold together; ``totals``
    are ``Catalog.file_totals()``."""
    assert config.cluster
    raw_bytes = catalog.raw_bytes()
    size: int | None = None
    if config.cluster_size is not None:
        size_from = "--cluster-size"
        size = bytes_of(config.cluster_size, totals[1])
    client = memcached_client(config.cluster, timeout=call_timeout(config.io_timeout))
    if size is None:
        size_from = "the memcacheds' stats"
        size = cluster_size_from_limits(client.limits(), raw_bytes)
        if size is None:
            client.close()
            raise MountError(f"--cluster {', '.join(f'{h}:{p}' for h, p in config.cluster)}: no memcached told its "
                             "size (stats: limit_maxbytes) in time; is it running? Or give --cluster-size")
    share = min(1.0, size / raw_bytes) if raw_bytes else 0.0
    log.info("cluster of %d memcached (%s): %d bytes (from %s) hold %.0f%% of the raw objects; %s",
             len(config.cluster), ", ".join(f"{host}:{port}" for host, port in config.cluster), size, size_from,
             100 * share,
             "values sealed under the cluster key" if config.cluster_key_file else
             "no --cluster-key-file: values in the clear, only of sources everyone may read")
    if config.cluster_key_file is not None:
        try:  # checked by the command that started this daemon; read again here, as the key never travels
            key = read_key_file(config.cluster_key_file)
        except KeyFileError as exc:
            client.close()
            raise MountError(str(exc)) from None
        return ClusterTier(reader, client, share, sealer=Sealer(key), key_id=key.id, size=size, size_from=size_from)
    return ClusterTier(reader, client, share, public=EveryoneReads(catalog.get), size=size, size_from=size_from)


#: Of what the memcacheds may hold (their ``-m``), what is counted on for values: memcached's slabs and item
#: headers take the rest (BENCHMARKS.md: 726 MiB allocated for 715 MiB of 5 MB values).
CLUSTER_USABLE = 0.95


def cluster_size_from_limits(limits: dict[str, int | None], raw_bytes: int) -> int | None:
    """``--cluster-size`` where none is given: the smaller of what the memcacheds that told their size hold
    together (less their own overhead) and the raw objects' bytes; None where none told it."""
    told = [limit for limit in limits.values() if limit is not None]
    if not told:
        return None
    silent = sorted(name for name, limit in limits.items() if limit is None)
    if silent:
        log.warning("cluster: %s did not tell their size; counting only the others'", ", ".join(silent))
    return min(int(sum(told) * CLUSTER_USABLE), raw_bytes)


def make_disk_tier(totals: tuple[int, int, int, int], config: MountConfig, reader: Reader,
                   cache: NextEpochCache | None) -> DiskTier:
    """The disk level sees what the memory level misses: its quota is of the dataset minus the memory budget."""
    assert config.disk_cache is not None and config.disk_cache_size is not None
    files, served, _, max_id = totals
    budget = bytes_of(config.disk_cache_size, served)
    reaching = max(1, served - (cache.budget if cache is not None else 0))
    log.info("disk cache budget %d bytes in %s", budget, config.disk_cache)
    policy = NextEpochCache(budget, reaching, files, max_id=max_id)
    held = (lambda node_id: node_id in cache.held) if cache is not None else (lambda node_id: False)
    return DiskTier(reader, config.disk_cache, policy, memory_holds=held)


def make_cache(totals: tuple[int, int, int, int], cache_size: Amount | None) -> NextEpochCache | None:
    """The memory level; ``totals`` are ``Catalog.file_totals()``."""
    if cache_size is None:
        return None
    files, served, _, max_id = totals
    budget = bytes_of(cache_size, served)
    log.info("cache budget %d bytes (%.1f %% of %d served bytes)", budget, 100 * budget / max(1, served), served)
    return NextEpochCache(budget, served, files, max_id=max_id)


async def _steer_mix(ops: Operations, config: MountConfig) -> None:
    """``--mix adaptive``: the controller moves the raw share within what prepare expanded."""
    mix = ops.mix
    assert mix is not None
    controller = MixController(0.0, mix.prepared, mix.share)
    await steer(mix, controller, lambda: (ops.stats.opens, ops.stats.bytes_from_storage),
                interval=config.mix_interval, pressure=Stalls(config.pressure_dir),
                busy=CpuBusy(config.pressure_dir))


async def _main(config: MountConfig, ops: Operations, built: assemble.Parts, ready_fd: int | None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, nursery.cancel_scope)
        if config.metrics_port is not None:
            await nursery.start(serve_metrics, config.metrics_port, ops.statistics,
                                config.metrics_address)
        if ops.mix is not None and ops.mix.mode == "adaptive":
            nursery.start_soon(_steer_mix, ops, config)
        nursery.start_soon(_signal_ready, config, ops, built, ready_fd)
        # scripts/passthrough/build.sh patches pyfuse3's loop to take requests already queued without waiting
        # through trio (~70 us of CPU less per small file opened); the stock loop serves as well, slower.
        ops.stats.dispatch = "queued-first" if getattr(pyfuse3, "queued_requests_first", False) else "stock"
        await pyfuse3.main(max_tasks=FUSE_WORKERS)
        # main() returns once the kernel says the filesystem was unmounted (fusermount3 -u) or terminate().
        nursery.cancel_scope.cancel()


async def _stop_on_signals(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


async def _signal_ready(config: MountConfig, ops: Operations, built: assemble.Parts,
                        ready_fd: int | None) -> None:
    # A stat of the control entry goes through the kernel to this very loop: once it answers, so does the mount.
    await trio.to_thread.run_sync(os.stat, config.mountpoint / os.fsdecode(CONTROL_NAME))
    if not choose_data_path(config, ops, built):
        pyfuse3.terminate()
        return
    if config.readahead_kb and ops.stats.data_path == "daemon":
        set_readahead(config.mountpoint, config.readahead_kb)
    log.info("mount answers")
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    # After ready, not before: a dataset that takes longer to warm than the mount command waits (or a probe
    # allows) must not make a dead mount. Its progress is in stats (warmup, warmup_files, warmup_bytes).
    if config.warmup and ops.cache is not None:
        await warm_up(ops)


async def warm_up(ops: Operations) -> None:
    stats = ops.stats
    stats.warmup = "running"

    def progress(files: int, total: int) -> None:
        stats.warmup_files, stats.warmup_bytes = files, total

    started = time.monotonic()
    assert ops.data is not None
    files, total = await warm_up_path(ops.data, list(ops.catalog.files()), progress)
    progress(files, total)
    stats.warmup = "done"
    log.info("warm-up: %d files, %.0f MB in %.1f s", files, total / 1e6, time.monotonic() - started)


def choose_data_path(config: MountConfig, ops: Operations, built: assemble.Parts) -> bool:
    """After INIT: serve through passthrough where it works, else the daemon path; say which, and why, in one
    line of the log and in ``stats``. False when ``--data-path passthrough`` cannot be had (the mount stops)."""
    if ops.data is not None:  # the daemon's from the start (``daemon_only``)
        why: str | None = ops.stats.data_path_why
    else:
        why = passthrough.engaged()
    if why is not None:
        ops.stats.data_path_why = why
        if config.data_path == "passthrough":
            log.error("--data-path passthrough: not available: %s", why)
            return False
        if ops.data is None:
            ops.serve_with(built.daemon_path())
        log.info("data path: daemon (%s)", why)
        return True
    ops.serve_with(built.passthrough_path(passthrough.FuseKernel()))
    log.info("data path: passthrough (the kernel serves reads from backing files%s)",
             "; each file checked whole before it is served" if config.verify_reads else "")
    return True


def set_readahead(mountpoint: Path, kb: int) -> None:
    """Raise the FUSE connection's readahead: the kernel then asks for up to 1 MiB per read request instead
    of 128 KiB, so a 6 MB raw image costs ~6 requests to the daemon instead of ~48 (pyfuse3 cannot set
    max_read; see BENCHMARKS.md). Needs root (sysfs); otherwise the default stays, with a note in the log."""
    dev = os.stat(mountpoint).st_dev
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        path.write_text(f"{kb}\n")
        log.info("readahead of %s set to %d KiB", mountpoint, kb)
    except OSError as exc:
        log.info("cannot set readahead (%s): %s; the kernel's default stays", path, exc.strerror)


def spawn_daemon(argv: list[str], log_file: Path, timeout: float = 120.0) -> None:
    """Start ``liquidfs mount --foreground`` detached and wait until it reports the mount answers."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        # STORE/mount.log is in a directory a store writer may write: a link there to a root-owned startup file
        # is refused, never appended to. Held open to read the daemon's last words from, whatever is at the
        # name by then.
        log_fd = open_append(log_file)
    except OSError as exc:
        # The log is the one file a mount writes in its store: a store read-only to this user mounts with the
        # log elsewhere.
        advice = (" (a store that is read-only to you mounts with --log-file naming a file you can write)"
                  if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "")
        raise MountError(f"cannot write the log {log_file}: {exc.strerror}{advice}") from None
    try:
        # Where this daemon's lines begin: the log keeps every earlier mount's, which say nothing of this one.
        start = os.fstat(log_fd).st_size
        read_end, write_end = os.pipe()
        # Isolated and in / (reexec): a root mount started from a directory someone else can write must not
        # import code from it.
        proc = reexec.popen("liquidfs", [*argv, "--foreground", "--ready-fd", str(write_end)],
                            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                            pass_fds=(write_end,), start_new_session=True)
        os.close(write_end)
        _wait_ready(proc, read_end, log_fd, log_file, timeout, start)
    finally:
        os.close(log_fd)


#: How long a daemon that closed its ready pipe without the mount answering gets to exit: it is on its way out
#: (the pipe closes as its descriptors do, a moment before its exit status exists).
EXIT_WAIT = 10.0
#: Log lines of a failed daemon shown to the user.
SHOWN_LINES = 15


def _wait_ready(proc: subprocess.Popen[bytes], read_end: int, log_fd: int, log_file: Path, timeout: float,
                start: int = 0) -> None:
    """Return once the daemon says "ready" on ``read_end``; else a MountError whose first line says why (from
    the daemon's lines of the log, those past offset ``start``), then those lines."""
    deadline = time.monotonic() + timeout
    with os.fdopen(read_end, "rb") as ready:
        # EOF without "ready" means the daemon died before the mount answered.
        import select

        while time.monotonic() < deadline:
            readable, _, _ = select.select([ready], [], [], 0.5)
            if readable:
                line = ready.readline()
                if line.startswith(b"ready"):
                    return
                break
            if proc.poll() is not None:
                break
    if time.monotonic() < deadline:
        try:
            proc.wait(EXIT_WAIT)
        except subprocess.TimeoutExpired:
            pass
    lines = _log_since(log_fd, start)
    if lines:
        shown = f"; its lines in {log_file}:\n" + "\n".join(f"  {line}" for line in lines[-SHOWN_LINES:])
    else:
        shown = f"; nothing from it in {log_file}"
    if proc.returncode is None:
        proc.kill()
        proc.wait()
        what = (f"did not answer within {timeout:.0f} s" if time.monotonic() >= deadline
                else "gave up before the mount answered but did not exit")
        raise MountError(f"the daemon {what}: killed" + shown)
    status = f"the daemon exited with status {proc.returncode} before the mount answered" + shown
    reason = failure_reason(lines)
    raise MountError(f"{reason}\n{status}" if reason else status)


#: A log record of the daemon's at ERROR or above (``safefiles.LOG_FORMAT``: date, time, level, logger, message).
_ERROR_RECORD = re.compile(r"\S+ \S+ (?:ERROR|CRITICAL) \S+: (.*)")


def failure_reason(lines: list[str]) -> str | None:
    """The line of a failed daemon's log that says why: fusermount3's or libfuse's own words (they name the
    option or the permission refused; liquidfs only sees "fuse_session_new() failed"), else the daemon's
    one-line error, else its last error record."""
    for line in lines:
        if line.startswith(("fusermount3:", "fusermount:", "fuse:")) and "warning" not in line.lower():
            return line
    prefix = "liquidfs mount: "
    for line in reversed(lines):
        if line.startswith(prefix) and line != prefix + "interrupted":
            return line[len(prefix):]
    for line in reversed(lines):
        found = _ERROR_RECORD.fullmatch(line)
        if found:
            # A record with a traceback is one line, its line breaks escaped: its first and last parts say it.
            parts = found.group(1).split("\\n")
            return parts[0] if len(parts) == 1 else f"{parts[0]}: {parts[-1].strip()}"
    return None


def _log_since(fd: int, start: int, size: int = 64 << 10) -> list[str]:
    """The lines of the log open at ``fd`` past offset ``start`` (its last ``size`` bytes at most)."""
    end = os.fstat(fd).st_size
    begin = max(start, end - size)
    text = os.pread(fd, max(0, end - begin), begin).decode(errors="replace")
    lines = text.splitlines()
    if begin > start and lines:
        lines = lines[1:]  # cut in the middle
    return [line for line in lines if line.strip()]


# -- unmount -------------------------------------------------------------------------------------------


def read_control(mountpoint: Path) -> dict[str, object]:
    with open(mountpoint / os.fsdecode(CONTROL_NAME), "rb") as f:
        values = json.loads(f.read())
    if not isinstance(values, dict):
        raise ValueError(f"{mountpoint}: the control file holds no object")
    return values


def holders(mountpoint: Path) -> list[str]:
    """Processes with a file, cwd or root inside ``mountpoint`` (what fuser -m would show)."""
    prefix = str(mountpoint.resolve())
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        paths = []
        for link in ("cwd", "root"):
            try:
                paths.append(os.readlink(f"/proc/{pid}/{link}"))
            except OSError:
                pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
        if any(p == prefix or p.startswith(prefix + "/") for p in paths):
            found.append(_named(pid))
    return found


def _named(pid: str | int) -> str:
    """``pid`` and its command line, for a message."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = "?"
    return f"{pid} {escape_controls(cmd.strip())}"


#: Seconds between scans of /proc for copies of the mount while ``unmount`` waits for the daemon.
NAMESPACE_SCAN_S = 0.5
#: Processes named per mount namespace that holds a copy of a mount (a container's every process would).
NAMED_PER_NAMESPACE = 3


def namespace_holders(connection: int) -> list[str]:
    """Processes in other mount namespaces whose copy of the mounts holds FUSE ``connection`` (``unshare
    --mount``, a container started while it was mounted): the kernel keeps the connection, and so its daemon,
    while any copy of the mount lives, whatever is unmounted here."""
    try:
        own = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return []
    holds: dict[str, bool] = {}  # each namespace's mountinfo read once, from its first process seen
    found: dict[str, list[str]] = {}
    for pid in sorted(filter(str.isdigit, os.listdir("/proc")), key=int):
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            continue
        if namespace == own:
            continue
        if namespace not in holds:
            holds[namespace] = guard.sees_connection(int(pid), connection)
        named = found.setdefault(namespace, [])
        if holds[namespace] and len(named) < NAMED_PER_NAMESPACE:
            named.append(f"{_named(pid)} (mount namespace {namespace})")
    return [line for named in found.values() for line in named]


#: The filesystem type of a liquidfs mount in /proc/self/mountinfo (``fuse_options``: subtype=liquidfs).
FSTYPE = b"fuse.liquidfs"


def unmount(mountpoint: Path, *, lazy: bool = False, timeout: float = 30.0) -> None:
    mountpoint = mountpoint.absolute()
    # What is mounted there, from mountinfo: a stat would wait for a hung daemon. Only a liquidfs mount is
    # unmounted: fusermount3 run by root unmounts any FUSE filesystem, someone else's included.
    found = guard.topmost_mount(Path(os.path.realpath(mountpoint)))
    if found is None:
        if not os.path.lexists(mountpoint):
            raise MountError(f"{mountpoint} does not exist")
        raise MountError(f"{mountpoint} is not mounted")
    if found[0] != FSTYPE:
        raise MountError(f"{mountpoint} is a {os.fsdecode(found[0])} mount, not a liquidfs mount: left mounted "
                         "(unmount it with what mounted it)")
    if is_stale(mountpoint):
        clean_stale(mountpoint)
        return
    pid = None
    try:
        pid = int(str(read_control(mountpoint)["pid"]))
    except (OSError, ValueError, KeyError):
        log.warning("%s: its control file does not answer; unmounting without waiting for its daemon", mountpoint)
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        msg = done.stderr.strip()
        if "busy" in msg.lower():
            who = holders(mountpoint)
            raise MountError(
                f"{mountpoint} is busy; held by:\n  " + "\n  ".join(who or ["(unknown)"])
                + "\nclose those, or use `liquidfs umount --lazy` to detach it now and finish when they let go"
            )
        raise MountError(f"fusermount3 failed: {msg}")
    if pid is not None and not lazy:
        deadline = time.monotonic() + timeout
        scan_at = time.monotonic() + NAMESPACE_SCAN_S
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            elsewhere: list[str] = []
            if time.monotonic() >= scan_at:  # a scan of every process: not at each poll, nor before the daemon
                scan_at = time.monotonic() + NAMESPACE_SCAN_S  # had its moment to exit
                elsewhere = namespace_holders(found[1])
            if elsewhere:  # the daemon serves that copy until its last holder goes: waiting would not help
                raise MountError(
                    f"unmounted here, but the daemon (pid {pid}) still serves a copy of the mount in another mount "
                    "namespace, held by:\n  " + "\n  ".join(elsewhere)
                    + "\nit exits once those end (or unmount it in their namespace)")
            time.sleep(0.05)
        raise MountError(f"unmounted, but the daemon (pid {pid}) is still running after {timeout:.0f} s")


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a container's PID 1 may never reap the detached daemon)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
