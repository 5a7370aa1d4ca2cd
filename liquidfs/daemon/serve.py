"""A mount's daemon at work: the FUSE session over the parts ``build.mount`` made, the trio loop, signals,
readiness, the data path chosen after INIT, and the warm-up. Every part, the session and the watchdog included,
is on one ``ExitStack``: each is closed in reverse order of its making, whichever close raises.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pyfuse3
import trio

from ..datapath import passthrough
from ..datapath.base import warm_up as warm_up_path
from ..fuse.operations import CONTROL_NAME, Operations
from ..metrics.server import serve_metrics
from ..mix.controller import MixController
from ..mix.pressure import CpuBusy, Stalls
from ..mix.share import steer
from ..stores import Store
from . import build
from . import loops
from . import watchdog
from .config import MountConfig, MountError
from .control import still_the_mount_point

log = logging.getLogger(__name__)

#: Seconds between gatherings of the other loops' counters for ``/metrics`` (``mount --loops``; Prometheus
#: scrapes every 15-60 s).
METRICS_LOOPS_INTERVAL = 2.0


#: The signals that unmount (``_stop_on_signals``).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Those that came while no loop listened (from the mount to the loop's start, and while it unmounts).
_stops_noted: list[int] = []


def _note_stop(signum: int, frame: object) -> None:
    """Outside the loop's receiver: noted (the loop, once it runs, unmounts), never the default action, which
    would end the process between its mount and its unmount and leave a dead mount."""
    if not _stops_noted:
        log.info("received %s: unmounting", signal.Signals(signum).name)
    _stops_noted.append(signum)


def _ignore_stops() -> None:
    """From here the mount only unmounts: further signals are ignored, neither a handler's EINTR in the unmount's
    wait for fusermount3 nor, at the interpreter's exit (which puts its handlers back to the default action), a
    death by the next one."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def serve(config: MountConfig, store: Store, store_dir: Path, *, ready_fd: int | None = None) -> int:
    """Mount ``config`` over ``store`` (its catalog in ``store_dir``) and serve in this process until unmounted
    or signalled; returns the exit status."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if ready_fd is not None:
        # The mount command's pipe: not handed on to anything libfuse runs (nor to the other loops: ``loops.fork``
        # closes it there), which would hold it open past this daemon's word.
        os.set_inheritable(ready_fd, False)
    with ExitStack() as stack:
        stack.callback(log.info, "unmounted %s", config.mountpoint)
        mount = build.mount(config, store, store_dir, stack)
        for signum in STOP_SIGNALS:  # from the mount on (before it, the default action leaves nothing behind);
            signal.signal(signum, _note_stop)  # to the process's end: it serves this mount alone
        start_session(config, mount.ops, stack)
        stack.callback(_ignore_stops)  # (before the session closes: where the loop never ran, too)
        more = loops.fork(config, store, mount, () if ready_fd is None else (ready_fd,)) \
            if config.loops > 1 else None
        if more is not None:
            stack.callback(loops.stop, more)
            mount.ops.join_loops(more.peers, more.shared)
        stack.enter_context(mount.serving.pop_all())  # the parts that answer requests stop before the session
        try:
            trio.run(_main, config, mount.ops, mount.parts, ready_fd, more)
        except BaseException as exc:
            log.exception("the filesystem loop failed; unmounting")
            leaf = _only_leaf(exc)
            if leaf is not exc:  # one error in a nursery's group: said as itself (a port taken: one line, not a
                raise leaf from None  # traceback on a terminal, nor a group's frame as the daemon's last words)
            raise
        finally:
            _ignore_stops()
    if config.data_path == "passthrough" and mount.ops.stats.data_path != "passthrough":
        return 1  # --data-path passthrough could not be had: the mount was refused (logged why)
    return 0


def exit_past_stuck_threads(code: int, *, leave: Callable[[int], object] = os._exit) -> None:
    """The daemon's end, where threads of its own are still in the kernel (a metadata warm of storage that no
    longer answers: ``fuse.lookahead``'s pool, whose workers the interpreter joins at its exit): said, the log
    flushed, and the process left at once with ``code``. Waited for, the daemon never exited, and ``umount``
    reported a daemon still running over a mount already gone. Nothing is done where none is left."""
    stuck = [t.name for t in threading.enumerate()
             if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not stuck:
        return
    log.warning("threads still waiting on storage at the unmount (%s): the daemon exits without them",
                ", ".join(sorted(stuck)))
    for handler in logging.getLogger().handlers:  # what os._exit would drop
        try:
            handler.flush()
        except (OSError, ValueError):  # a stream gone (a closed stderr, a full disk): the exit goes on
            pass
    leave(code)


def _only_leaf(exc: BaseException) -> BaseException:
    """The one exception a group of trio's nurseries holds, however nested; else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def start_session(config: MountConfig, ops: Operations, stack: ExitStack) -> None:
    """The FUSE session of ``ops`` on the mount point, and its watchdog, each on ``stack``."""
    before = watchdog.mount_ids()
    still_the_mount_point(config.mountpoint, config.mountpoint_seen)
    try:
        pyfuse3.init(ops, str(config.mountpoint), fuse_options(config))
    except RuntimeError as exc:
        raise MountError(f"cannot mount {config.mountpoint}: {exc}") from exc
    stack.callback(pyfuse3.close, unmount=True)
    log.info("mounted %s on %s (pid %d)", config.source, config.mountpoint, os.getpid())
    try:
        process = watchdog.start(os.getpid(), config.mountpoint, before)
    except OSError as exc:  # (no mount(8) for fusectl, a pids limit): a helper, never a reason to unmount
        log.warning("no watchdog for %s: it could not start (%s)", config.mountpoint, exc)
        process = None
    if process is not None:
        stack.callback(process.wait)
        stack.callback(process.terminate)


def fuse_options(config: MountConfig) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel enforces file modes
    options |= {"ro", "subtype=liquidfs", "noatime"}
    if not any(option.startswith("fsname=") for option in config.fuse_options):
        options.add("fsname=liquidfs")  # one fsname, the user's where given: a set of two mounts either
    if config.allow_other:
        options.add("allow_other")
    options.update(config.fuse_options)
    return options


async def _steer_mix(ops: Operations, config: MountConfig) -> None:
    """``--mix adaptive``: the controller moves the raw share within what prepare expanded."""
    mix = ops.mix
    assert mix is not None
    controller = MixController(0.0, mix.prepared, mix.share)
    await steer(mix, controller, lambda: (ops.stats.opens, ops.stats.bytes_from_storage),
                interval=config.mix_interval, pressure=Stalls(config.pressure_dir),
                busy=CpuBusy(config.pressure_dir))


async def _main(config: MountConfig, ops: Operations, built: build.Parts, ready_fd: int | None,
                more: loops.Loops | None = None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals)
        if more is not None:
            nursery.start_soon(more.peers.serve, ops)
            nursery.start_soon(loops.watch, more, ops)
        if config.metrics_port is not None and await _metrics_started(nursery, config, ops) and more is not None:
            nursery.start_soon(ops.gather_loops, METRICS_LOOPS_INTERVAL)
        if ops.mix is not None and ops.mix.mode == "adaptive":
            nursery.start_soon(_steer_mix, ops, config)
        nursery.start_soon(_signal_ready, config, ops, built, ready_fd)
        await loops.answer(ops)
        # main() returns once the kernel says the filesystem was unmounted (fusermount3 -u) or terminate().
        nursery.cancel_scope.cancel()


async def _metrics_started(nursery: trio.Nursery, config: MountConfig, ops: Operations) -> bool:
    """The metrics endpoint started in ``nursery``; False where it cannot be (its port taken since the command
    checked it, threads refused by a pids limit): said, and the mount serves without it, as it does when the
    endpoint fails later. It took the mount down, which a loader would have seen as its files gone."""
    assert config.metrics_port is not None
    try:
        await nursery.start(serve_metrics, config.metrics_port, ops.mount_statistics, config.metrics_address)
    except Exception as exc:  # (trio.Cancelled and KeyboardInterrupt are BaseExceptions: they go on)
        log.error("the metrics endpoint on %s port %d could not start (%s): the mount serves without it",
                  config.metrics_address, config.metrics_port, exc)
        return False
    return True


async def _stop_on_signals() -> None:
    # pyfuse3.terminate() ends the loop's main, and ``_main`` cancels the nursery then. The receiver puts
    # ``_note_stop`` back when the loop ends: a signal while the mount unmounts is noted too.
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        if _stops_noted:  # before the loop ran (terminate before pyfuse3's main: it returns at once)
            pyfuse3.terminate()
        async for signum in signals:
            _note_stop(signum, None)
            pyfuse3.terminate()


async def _signal_ready(config: MountConfig, ops: Operations, built: build.Parts,
                        ready_fd: int | None) -> None:
    # A stat of the control entry goes through the kernel to this very loop: once it answers, so does the mount.
    # Abandoned where the loop ends first (a stop signal while it started): its request then waits in the kernel
    # until the session closes, and a thread trio waited for held up the daemon's end, and the mount, for good.
    await trio.to_thread.run_sync(os.stat, config.mountpoint / os.fsdecode(CONTROL_NAME), abandon_on_cancel=True)
    if not choose_data_path(config, ops, built):
        pyfuse3.terminate()
        return
    if config.readahead_kb and ops.stats.data_path == "daemon":
        set_readahead(config.mountpoint, config.readahead_kb)
    log.info("mount answers")
    if ready_fd is not None:
        try:
            os.write(ready_fd, b"ready\n")
        except OSError as exc:  # the mount command is gone (killed): nobody to tell, and the mount serves on
            log.warning("the mount command did not hear that the mount answers (%s): serving all the same",
                        exc.strerror)
        finally:
            os.close(ready_fd)
    # After ready, not before: a dataset that takes longer to warm than the mount command waits (or a probe
    # allows) must not make a dead mount. Its progress is in stats (warmup, warmup_files, warmup_bytes).
    if config.warmup and ops.policy is not None:
        await warm_up(ops)


async def warm_up(ops: Operations) -> None:
    stats = ops.stats
    stats.warmup = "running"

    def progress(files: int, total: int) -> None:
        stats.warmup_files, stats.warmup_bytes = files, total

    started = time.monotonic()
    assert ops.data_path is not None
    try:
        files, total = await warm_up_path(ops.data_path, ops.catalog, progress)
    except Exception as exc:  # the warm-up is an optimisation: whatever stops it, the mount goes on answering
        log.warning("warm-up stopped: %s", exc)
        stats.warmup = "failed"
        return
    progress(files, total)
    stats.warmup = "done"
    log.info("warm-up: %d files, %.0f MB in %.1f s", files, total / 1e6, time.monotonic() - started)


def choose_data_path(config: MountConfig, ops: Operations, built: build.Parts) -> bool:
    """After INIT: serve through passthrough where it works, else the daemon path; say which, and why, in one
    line of the log and in ``stats``. False when ``--data-path passthrough`` cannot be had (the mount stops)."""
    if ops.data_path is not None:  # the daemon's from the start (``daemon_only``)
        why: str | None = ops.stats.data_path_why
    elif ops.peers is not None:
        # One of several loops (``loops.fork``, which forks them only where passthrough engaged): every loop
        # serves through it. Probed again, a failure of the moment (EMFILE, ENOMEM) had this loop serve through
        # the daemon beside the others' backings, and the kernel refuses an inode opened both ways (EIO).
        why = None
    else:
        why = passthrough.engaged()
    if why is not None:
        ops.stats.data_path_why = why
        if config.data_path == "passthrough":
            log.error("--data-path passthrough: not available: %s", why)
            return False
        if ops.data_path is None:
            ops.serve_with(built.daemon_path())
        log.info("data path: daemon (%s)", why)
        return True
    path = built.passthrough_path(passthrough.FuseKernel())
    if ops.peers is not None and ops.inodes.shared is not None:  # --loops: the backings are every loop's
        path.join_loops(ops.inodes.shared, ops.peers.index)
    ops.serve_with(path)
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
