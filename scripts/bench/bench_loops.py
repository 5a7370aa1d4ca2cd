"""Several loops on one FUSE connection: do opens/s grow with the daemon's processes? (issue 40's design question)

    python scripts/bench/bench_loops.py [--files 2000] [--readers 16] [--loops 1,2,4,8] [--seconds 3]
        [--repeats 3] [--work DIR] [--json PATH]

liquidfs answers every request on one trio loop: on a 16-core GPU node its opens stop at one core's worth (4.8-6.0
k/s warm against 24-99 k/s direct, BENCHMARKS.md). The way past one core is more loops on the one connection:
processes forked after the kernel's INIT (``pyfuse3.handle_init``, scripts/passthrough/pyfuse3-clone.patch), each
reading a clone of the FUSE device (``FUSE_DEV_IOC_CLONE``) with its own pyfuse3 session and trio loop. The kernel
hands each request to whichever clone reads first, so an OPEN and its RELEASE may reach different processes.

This measures that mechanism alone, before liquidfs's state is shared between processes: a minimal passthrough
mirror of a directory of files (``Mirror``: LOOKUP, GETATTR, OPEN with a backing registered and its descriptor
closed at once, RELEASE closing the backing id, which is the connection's, from any process) served by 1, 2, 4, 8
processes. Readers open and close their share of the files in a loop (warm metadata, nothing read), against the
same opens of the files themselves, alternating; files/s and the daemon's CPU per open (all its processes),
medians of ``--repeats``. Needs root and a passthrough-capable kernel and pyfuse3 (``liquidfs doctor``).

The mirror does none of liquidfs's own work per open (the identity check, the catalog, the budget): what it shows
is the ceiling the mechanism allows and whether it scales, not liquidfs's rate.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import json
import multiprocessing as mp
import os
import signal
import stat
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: _IOR(229, 0, uint32_t): a new /dev/fuse descriptor becomes a clone of the given session's.
FUSE_DEV_IOC_CLONE = 0x8004E500
PR_SET_PDEATHSIG = 1


# -- the daemon: a passthrough mirror in N processes --------------------------------------------------------


def serve(source: Path, mountpoint: Path, loops: int) -> int:
    import pyfuse3
    import trio

    class Mirror(pyfuse3.Operations):
        enable_passthrough = True

        def __init__(self) -> None:
            super().__init__()
            self.names = sorted(os.listdir(source))
            self.by_name = {os.fsencode(n): i + 2 for i, n in enumerate(self.names)}
            self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
            for name, ino in self.by_name.items():
                st = os.lstat(source / os.fsdecode(name))
                self.attrs[ino] = self._entry(ino, st)
            self.attrs[pyfuse3.ROOT_INODE] = self._entry(pyfuse3.ROOT_INODE, os.lstat(source))

        @staticmethod
        def _entry(ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
            e = pyfuse3.EntryAttributes()
            e.st_ino = ino
            e.st_mode = st.st_mode
            e.st_nlink = st.st_nlink
            e.st_size = st.st_size
            e.st_mtime_ns = st.st_mtime_ns
            e.entry_timeout = e.attr_timeout = 300
            return e

        async def lookup(self, parent: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
            ino = self.by_name.get(name) if parent == pyfuse3.ROOT_INODE else None
            if ino is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self.attrs[ino]

        async def getattr(self, ino: int, ctx: Any) -> pyfuse3.EntryAttributes:
            return self.attrs[ino]

        async def opendir(self, ino: int, ctx: Any) -> int:
            return ino

        async def readdir(self, fh: int, start: int, token: Any) -> None:
            for ino in range(max(start, 1) + 1, len(self.names) + 2):
                if not pyfuse3.readdir_reply(token, os.fsencode(self.names[ino - 2]), self.attrs[ino], ino):
                    return

        async def open(self, ino: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
            fd = os.open(source / self.names[ino - 2], os.O_RDONLY | os.O_CLOEXEC)
            try:
                backing = pyfuse3.passthrough_open(fd)  # the connection's: any process may close it
            finally:
                os.close(fd)  # the kernel holds the file from here on
            info = pyfuse3.FileInfo(fh=backing, keep_cache=False)
            info.backing_id = backing
            return info

        async def release(self, fh: int) -> None:
            pyfuse3.passthrough_close(fh)

        async def flush(self, fh: int) -> None:
            raise pyfuse3.FUSEError(errno.ENOSYS)

    ops = Mirror()
    options = set(pyfuse3.default_options) | {"ro", "fsname=benchloops"}
    pyfuse3.init(ops, str(mountpoint), options)
    pyfuse3.handle_init()
    if not pyfuse3.passthrough_enabled():
        print("bench_loops: the kernel did not grant passthrough", file=sys.stderr)
        pyfuse3.close(unmount=True)
        return 2
    master = pyfuse3.device_fd()
    children = []
    for _ in range(loops - 1):
        pid = os.fork()
        if pid == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            clone = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
            fcntl.ioctl(clone, FUSE_DEV_IOC_CLONE, struct.pack("I", master))
            os.dup2(clone, master, inheritable=False)
            os.close(clone)
            trio.run(pyfuse3.main)
            os._exit(0)
        children.append(pid)
    print(f"ready {os.getpid()} {' '.join(map(str, children))}", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        for pid in children:
            os.waitpid(pid, 0)
        pyfuse3.close(unmount=False)
    return 0


# -- the driver -----------------------------------------------------------------------------------------------


def _reader(paths: list[str], seconds: float, start: Any, out: Any) -> None:
    start.wait()
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for p in paths:
            os.close(os.open(p, os.O_RDONLY))
        done += len(paths)
    out.put(done)


def opens_per_s(root: Path, names: list[str], readers: int, seconds: float) -> float:
    """Files/s that ``readers`` processes open and close, each its own share of ``names`` under ``root``."""
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    shares = [[str(root / n) for n in names[i::readers]] for i in range(readers)]
    procs = [ctx.Process(target=_reader, args=(s, seconds, start, out)) for s in shares]
    for p in procs:
        p.start()
    time.sleep(0.2)
    began = time.monotonic()
    start.set()
    total = sum(out.get(timeout=seconds + 120) for _ in procs)
    elapsed = time.monotonic() - began
    for p in procs:
        p.join()
    return total / elapsed


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000, help="files opened in turn (default 2000, 4 KB each)")
    parser.add_argument("--readers", type=int, default=16, help="reader processes (default 16)")
    parser.add_argument("--loops", default="1,2,4,8", help="daemon processes, a list (default 1,2,4,8)")
    parser.add_argument("--seconds", type=float, default=3.0, help="each measurement's time (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row, the median reported (default 3)")
    parser.add_argument("--work", type=Path, help="scratch (default: a new directory in the system's temp)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="default WORK/loops.json")
    parser.add_argument("--serve", nargs=3, metavar=("SRC", "MNT", "LOOPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(Path(args.serve[0]), Path(args.serve[1]), int(args.serve[2]))
    if os.geteuid() != 0:
        parser.error("needs root (passthrough registers backing files: CAP_SYS_ADMIN)")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-loops-"))
    source, mnt = work / "src", work / "mnt"
    source.mkdir(parents=True, exist_ok=True)
    mnt.mkdir(exist_ok=True)
    names = [f"{i:06d}.bin" for i in range(args.files)]
    for n in names:
        if not (source / n).exists():
            (source / n).write_bytes(os.urandom(4096))
    rows = []
    print(f"{args.files} files, {args.readers} readers, {os.cpu_count()} cores; opens + closes, warm, "
          f"{args.seconds:.0f} s each, median of {args.repeats}")
    print("| loops | direct files/s | mount files/s | mount/direct | daemon CPU us/open |")
    print("|---|---|---|---|---|")
    for loops in [int(v) for v in args.loops.split(",")]:
        daemon = subprocess.Popen([sys.executable, __file__, "--serve", str(source), str(mnt), str(loops)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            line = daemon.stdout.readline() if daemon.stdout else ""
            if not line.startswith("ready"):
                raise SystemExit(f"bench_loops: the daemon did not start ({daemon.wait()})")
            pids = [int(v) for v in line.split()[1:]]
            for n in names:  # warm: every entry looked up once
                os.stat(mnt / n)
            direct, mount, cpu = [], [], []
            for _ in range(args.repeats):
                direct.append(opens_per_s(source, names, args.readers, args.seconds))
                before = cpu_of(pids)
                began = time.monotonic()
                rate = opens_per_s(mnt, names, args.readers, args.seconds)
                opened = rate * (time.monotonic() - began)
                cpu.append((cpu_of(pids) - before) / max(opened, 1) * 1e6)
                mount.append(rate)
        finally:
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
            daemon.wait(timeout=60)
            if daemon.stdout:
                daemon.stdout.close()
        row = {"loops": loops, "direct": statistics.median(direct), "mount": statistics.median(mount),
               "cpu_us_per_open": statistics.median(cpu), "direct_runs": direct, "mount_runs": mount}
        rows.append(row)
        print(f"| {loops} | {row['direct']:,.0f} | {row['mount']:,.0f} | {row['mount'] / row['direct']:.2f} | "
              f"{row['cpu_us_per_open']:.0f} |", flush=True)
    out = args.json or work / "loops.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"argv": sys.argv, "cores": os.cpu_count(), "files": args.files,
                                        "readers": args.readers, "seconds": args.seconds}, "rows": rows}, indent=1))
    print(f"(JSON {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
