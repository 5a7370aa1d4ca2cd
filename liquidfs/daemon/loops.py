"""``mount --loops N``: N processes answer the one FUSE connection, each with its own trio loop on its own core.

One Python loop answers a few thousand opens a second (BENCHMARKS.md: one core's worth on a 16-core node, where
direct opens ran 10-20x faster). After the kernel's INIT is answered here (``pyfuse3.handle_init``, our patch),
the daemon forks: each child puts a clone of the FUSE device (``FUSE_DEV_IOC_CLONE``) where the session reads,
builds its own parts over the catalog connection it inherited (``build.over_catalog``), and runs its own loop.
The kernel hands each request to whichever loop reads first. What the loops must agree on is shared: the backing
of each open inode and the sizes told (``datapath.shared_inodes``); a request for another loop's file handle goes
there (``fuse.peers``). Each child dies with the first loop (``PR_SET_PDEATHSIG``); a child that ends while the
mount serves is logged, its backings are let go, and the other loops go on.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import socket
import struct
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from ..datapath import passthrough
from ..datapath.shared_inodes import SharedInodes
from ..datapath.storage_calls import FUSE_WORKERS
from ..fuse.operations import Operations
from ..fuse.peers import Peers
from ..stores import Store
from . import build
from .config import MountConfig

log = logging.getLogger(__name__)

#: _IOR(229, 0, uint32_t): a new descriptor of /dev/fuse becomes a clone of the given session's.
FUSE_DEV_IOC_CLONE = 0x8004E500
_PR_SET_PDEATHSIG = 1


@dataclass
class Loops:
    """The first loop's view of the others."""

    peers: Peers
    shared: SharedInodes
    pids: list[int] = field(default_factory=list)


def handle_init_here() -> bool:
    """Answer INIT on this thread (our pyfuse3 patch), so that processes forked afterwards have the session;
    False where this pyfuse3 cannot."""
    handle_init = getattr(pyfuse3, "handle_init", None)
    if handle_init is None or not hasattr(pyfuse3, "set_operations"):
        return False
    handle_init()
    return True


def fork(config: MountConfig, store: Store, mount: build.Mount, first_loops_own: tuple[int, ...] = ()
         ) -> Loops | None:
    """The other ``config.loops - 1`` loops, forked after INIT (which this answers); None where one loop serves
    (the reason logged): a pyfuse3 without our clone patch, or no passthrough granted. ``first_loops_own``:
    descriptors the forked loops close at once (the mount command's ready pipe: a fork keeps every descriptor,
    and a loop holding it kept the command from seeing the daemon end)."""
    if not handle_init_here():
        log.info("--loops %d: one loop serves, as this pyfuse3 cannot answer INIT before its loop "
                 "(scripts/passthrough/build.sh builds one that can)", config.loops)
        return None
    why = passthrough.engaged()
    if why is not None:
        log.info("--loops %d: one loop serves, as passthrough is not available (%s)", config.loops, why)
        return None
    shared = SharedInodes(config.loops)
    pairs = Peers.made(config.loops)
    device = pyfuse3.device_fd()  # type: ignore[attr-defined]
    pids = []
    # Held back across each fork: a stop signal that reached a child before it set its own handlers ran the first
    # loop's (``serve._note_stop``), which only notes it, and the child went on serving until SIGKILL.
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    first_loop = os.getpid()  # taken before the fork: in the child, getppid() is 1 already if it died meanwhile
    for index in range(1, config.loops):
        held = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            pid = os.fork()
        except OSError as exc:  # a pids limit, no memory: the loops forked so far serve (they hold the pairs)
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            log.warning("--loops %d: loop %d could not be started (%s): %d loops answer", config.loops, index,
                        exc.strerror or exc, index)
            break
        if pid == 0:  # pragma: no cover (a child: its coverage dies with it)
            status = 1
            for fd in first_loops_own:
                with contextlib.suppress(OSError):
                    os.close(fd)
            try:
                status = _child(index, device, config, store, mount, shared, pairs, held, first_loop)
            except BaseException:
                log.exception("loop %d failed", index)
            finally:
                os._exit(status)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        pids.append(pid)
    log.info("%d loops answer the mount (pids %d, %s)", len(pids) + 1, os.getpid(), ", ".join(map(str, pids)))
    peers = Peers.mine(pairs, 0)
    for never in range(len(pids) + 1, config.loops):  # asked nothing, as a loop that ended
        peers.gone(never)
    return Loops(peers, shared, pids)


def _child(index: int, device: int, config: MountConfig, store: Store, first: build.Mount,
           shared: SharedInodes, pairs: list[tuple[socket.socket, socket.socket]],
           mask: set[int | signal.Signals], parent: int) -> int:
    _name_the_loop(index)
    # The first loop's own handlers (``serve._note_stop``) are not this one's: ``stop`` ends it with SIGTERM. A
    # terminal's Ctrl-C or hangup reaches the whole process group: the first loop decides (it unmounts and stops
    # the others), and a child that died of it first logged a traceback for a loop that had not failed.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return 1  # the first loop ended before the line above
    clone = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    fcntl.ioctl(clone, FUSE_DEV_IOC_CLONE, struct.pack("I", device))
    os.dup2(clone, device, inheritable=False)  # where the session reads and answers
    os.close(clone)
    with ExitStack() as stack:
        mount = build.over_catalog(config, store, first.catalog, stack)
        ops = mount.ops
        path = mount.parts.passthrough_path(passthrough.FuseKernel())
        path.join_loops(shared, index)
        ops.serve_with(path)
        stack.enter_context(mount.serving.pop_all())
        peers = Peers.mine(pairs, index)
        ops.join_loops(peers, shared)
        pyfuse3.set_operations(ops)  # type: ignore[attr-defined]
        trio.run(_serve, ops, peers)
    return 0


def _name_the_loop(index: int) -> None:
    """This process's log lines name their loop (``liquidfs.daemon.build[loop 2]: ...``): the loops write one
    log, and a line of the first loop's is told from another's."""
    make = logging.getLogRecordFactory()

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = make(*args, **kwargs)
        made.name = f"{made.name}[loop {index}]"
        return made

    logging.setLogRecordFactory(record)


async def _serve(ops: Operations, peers: Peers) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peers.serve, ops)
        await answer(ops)
        nursery.cancel_scope.cancel()


#: pyfuse3's worker tasks kept waiting for requests (``main(min_tasks=...)``; 1 by default). A worker that takes a
#: request while none waits starts another, and each that finds more than ``min_tasks`` waiting retires: at 1, a
#: loop with requests queued started and retired a trio task for about every request (py-spy of a loop during cold
#: reads: ~6 % of its samples in spawning tasks and naming them), 15-20 % of its CPU a small file (BENCHMARKS.md,
#: "Worker tasks kept"). A waiting task costs nothing a request, and memory: its coroutine and the receive buffer
#: libfuse gave it (a few resident pages of ~1 MiB mapped). 8, 32 and 128 measured alike; 64 leaves room for a
#: GPU node's 16 readers with an open, a lookup and a release each in flight.
IDLE_WORKERS = 64


async def answer(ops: Operations) -> None:
    """What every loop runs, the first and the others alike: pyfuse3's loop over ``ops`` with ``FUSE_WORKERS``
    requests at most at once (the open budget's bounds count on them), ``IDLE_WORKERS`` kept waiting, until the
    mount ends."""
    # scripts/passthrough/build.sh patches pyfuse3's loop to take requests already queued without waiting
    # through trio (~70 us of CPU less per small file opened); the stock loop serves as well, slower.
    ops.stats.dispatch = "queued-first" if getattr(pyfuse3, "queued_requests_first", False) else "stock"
    if ops.lookahead is not None:
        ops.lookahead.start()  # its helper process, this loop's own
    await pyfuse3.main(min_tasks=IDLE_WORKERS, max_tasks=FUSE_WORKERS)


async def watch(loops: Loops, ops: Operations) -> None:
    """Until cancelled: each other loop that ends is logged, told to the peers, and its backings let go."""

    async def one(index: int, pid: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # reaped already
        try:
            await trio.lowlevel.wait_readable(pidfd)  # readable once it has ended
        finally:
            os.close(pidfd)
        try:
            _, status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (it has ended: WNOHANG never waits)
        except ChildProcessError:
            return
        code = os.waitstatus_to_exitcode(status)
        # Status 0: it saw the mount end, as this loop is about to. Else it failed: the others go on.
        log.log(logging.INFO if code == 0 else logging.ERROR, "loop %d (pid %d) ended (status %d)", index, pid, code)
        loops.peers.gone(index)
        freed = loops.shared.reap(index, passthrough.FuseKernel().unregister)
        if freed:
            log.info("let go of %d backings loop %d held", freed, index)

    async with trio.open_nursery() as nursery:
        for index, pid in enumerate(loops.pids, start=1):
            nursery.start_soon(one, index, pid)


#: Seconds the first loop waits for the others to end at the mount's end before it unmounts anyway (a loop
#: stuck in the kernel, on a dead disk, must not keep the mount from being unmounted; PR_SET_PDEATHSIG ends it).
STOP_WAIT = 5.0


def stop(loops: Loops) -> None:
    """At the mount's end: every other loop is told to end (SIGTERM) and reaped, for at most ``STOP_WAIT``."""
    running = []
    for pid in loops.pids:
        try:
            if not os.waitpid(pid, os.WNOHANG)[0]:
                os.kill(pid, signal.SIGTERM)
                running.append(pid)
        except (ChildProcessError, ProcessLookupError):
            pass
    deadline = time.monotonic() + STOP_WAIT
    while running and time.monotonic() < deadline:
        time.sleep(0.02)
        running = [pid for pid in running if not _reaped(pid)]
    if running:
        log.warning("loops %s did not end in %.0f s: unmounting without them", running, STOP_WAIT)


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True
