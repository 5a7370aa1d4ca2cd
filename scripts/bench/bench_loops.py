"""Several loops on one FUSE connection: do opens/s grow with the daemon's processes? (issue 40's design question)

    python scripts/bench/bench_loops.py [--files 2000] [--readers 16] [--loops 1,2,4,8] [--seconds 3]
        [--repeats 3] [--liquidfs] [--work DIR] [--json PATH]

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

``--liquidfs``: a liquidfs mount of the same files (``mount --loops N``; a store prepared at ratio 0, so every
open serves its source) is measured beside the mirror in each repeat, and each daemon's CPU per open is split
into its loops' own threads (the trio loop of each process) and its other threads (the closer, the read-ahead,
worker threads), and into user and system time: what liquidfs's own work per open costs beyond the mechanism's
(issue 40: "where each microsecond goes"). In the JSON, a row's ``mount`` is the mirror's files/s, its
``liquidfs`` what the liquidfs mount did.
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
            # The whole tree read once, before the mount: every request is then a dict's get, the least a daemon
            # can do for it (bench_opens's --mirror serves directories of files, this script's one directory).
            self.paths: dict[int, Path] = {pyfuse3.ROOT_INODE: source}
            self.children: dict[int, list[tuple[bytes, int]]] = {}
            self.by_name: dict[tuple[int, bytes], int] = {}
            self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
            todo = [pyfuse3.ROOT_INODE]
            while todo:
                parent = todo.pop()
                path = self.paths[parent]
                self.attrs[parent] = self._entry(parent, os.lstat(path))
                if not stat.S_ISDIR(self.attrs[parent].st_mode):
                    continue
                listing = self.children[parent] = []
                for name in sorted(os.listdir(path)):
                    ino = len(self.paths) + pyfuse3.ROOT_INODE
                    self.paths[ino] = path / name
                    self.by_name[parent, os.fsencode(name)] = ino
                    listing.append((os.fsencode(name), ino))
                    todo.append(ino)

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
            ino = self.by_name.get((parent, name))
            if ino is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self.attrs[ino]

        async def getattr(self, ino: int, ctx: Any) -> pyfuse3.EntryAttributes:
            return self.attrs[ino]

        async def opendir(self, ino: int, ctx: Any) -> int:
            return ino

        async def readdir(self, fh: int, start: int, token: Any) -> None:
            listing = self.children[fh]
            for i in range(start, len(listing)):
                name, ino = listing[i]
                if not pyfuse3.readdir_reply(token, name, self.attrs[ino], i + 1):
                    return

        async def open(self, ino: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
            fd = os.open(self.paths[ino], os.O_RDONLY | os.O_CLOEXEC)
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


def open_close(root: Path, names: list[str], readers: int, seconds: float) -> tuple[int, float]:
    """How many files ``readers`` processes opened and closed, each its own share of ``names`` under ``root``,
    in how many seconds."""
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
    return total, elapsed


def opens_per_s(root: Path, names: list[str], readers: int, seconds: float) -> float:
    """Files/s that ``readers`` processes open and close, each its own share of ``names`` under ``root``."""
    total, elapsed = open_close(root, names, readers, seconds)
    return total / elapsed


def _stat_fields(path: Path) -> list[str]:
    return path.read_text().rsplit(")", 1)[1].split()


def cpu_split(pids: list[int], *, children: bool = False) -> dict[str, float]:
    """CPU seconds of ``pids`` (and, with ``children``, the processes they started: a liquidfs mount's other
    loops, its read-ahead's helper and its watchdog), by kind of thread: ``loop_user``/``loop_sys`` for the main
    thread of each process of the first one's session (where each loop's trio loop runs), ``other_user``/
    ``other_sys`` for the rest (worker threads, the closer, the read-ahead; a process of another session, such as
    the watchdog or the read-ahead's helper, whole). A process's total is its own /proc stat, which keeps the time
    of threads that ended meanwhile."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"loop_user": 0.0, "loop_sys": 0.0, "other_user": 0.0, "other_sys": 0.0}
    session = None
    for pid in _processes(pids, children):
        try:
            # the main thread first: the whole read after it has at least its time (other threads never < 0)
            main = _stat_fields(Path(f"/proc/{pid}/task/{pid}/stat"))
            whole = _stat_fields(Path(f"/proc/{pid}/stat"))
        except (OSError, ValueError):
            continue  # ended meanwhile
        if session is None:
            session = whole[3]
        user, system = int(whole[11]), int(whole[12])
        loop_user, loop_sys = (int(main[11]), int(main[12])) if whole[3] == session else (0, 0)
        out["loop_user"] += loop_user / tick
        out["loop_sys"] += loop_sys / tick
        out["other_user"] += (user - loop_user) / tick
        out["other_sys"] += (system - loop_sys) / tick
    return out


def _processes(pids: list[int], children: bool) -> list[int]:
    """``pids``, and with ``children`` every process they started, theirs too (each once, parents first)."""
    found: list[int] = []
    todo = list(reversed(pids))
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        if children:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    todo.extend(int(c) for c in (task / "children").read_text().split())
                except (OSError, ValueError):
                    continue  # a thread that ended meanwhile
    return found


#: A thread as ``thread_times`` names it: (process id, thread id, the thread's start in clock ticks since boot).
ThreadKey = tuple[int, int, int]


def thread_times(pids: list[int], parts: dict[str, tuple[str, ...]], *, unnamed: str | None = None,
                 others: tuple[str, ...] = (), children: bool = True,
                 main: str | None = None) -> dict[ThreadKey, tuple[str | None, float]]:
    """Each thread of ``pids`` (and their children) other than a process's main thread, with the part its name
    puts it in (``parts``: part -> prefixes of /proc/PID/task/TID/comm; ``unnamed``: the part of the threads of
    the first one's session that no part names, nor ``others``, names of its threads in no part: a daemon naming
    every thread it starts did not start them) and its seconds on a CPU (schedstat: nanoseconds, where the ticks
    of 16 worker threads with a few ms each were 0 each). A process whose main thread's name puts it in a part
    (the read-ahead's helper) is one entry, its whole (its stat, which keeps its ended threads' time, in clock
    ticks). ``main``: the part of each process's main thread in the first one's session (a mount's loops: each
    its trio loop), in nanoseconds too, where ``cpu_split`` reads it in ticks (104 us a file at 96 files); the
    main thread of a process of another session (the watchdog) is in no part. ``parts_between`` makes the parts'
    CPU of two of these."""
    tick = os.sysconf("SC_CLK_TCK")

    def part(name: str, process_name: str | None) -> str | None:
        named = next((kind for kind, names in parts.items() if name.startswith(names)), None)
        # In the first one's session, a thread no part names is one the daemon did not name: its process's name,
        # or the name trio gives a worker for the length of a call (``to_thread``: "fn from task")
        if named is None and process_name is not None and not name.startswith(others):
            return unnamed
        return named

    out: dict[ThreadKey, tuple[str | None, float]] = {}
    session = None
    for pid in _processes(pids, children):
        try:
            whole = _stat_fields(Path(f"/proc/{pid}/stat"))
            name = Path(f"/proc/{pid}/comm").read_text().rstrip("\n")
        except (OSError, ValueError):
            continue  # ended meanwhile
        if session is None:
            session = whole[3]
        if (kind := part(name, None)) is not None:
            out[pid, pid, int(whole[19])] = (kind, (int(whole[11]) + int(whole[12])) / tick)
            continue
        process_name = name if whole[3] == session else None  # not the watchdog's (a session of its own)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            is_main = task.name == str(pid)
            if is_main and main is None:
                continue
            try:
                thread = _stat_fields(task / "stat")
                kind = (main if process_name is not None else None) if is_main else \
                    part((task / "comm").read_text().rstrip("\n"), process_name)
                ran = int((task / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                continue  # ended meanwhile
            out[pid, int(task.name), int(thread[19])] = (kind, ran)
    return out


def parts_between(before: dict[ThreadKey, tuple[str | None, float]], after: dict[ThreadKey, tuple[str | None, float]],
                  parts: dict[str, tuple[str, ...]], *, whole: str | None = None) -> dict[str, float]:
    """Seconds each part's threads spent on a CPU from ``before`` to ``after`` (``thread_times``), thread by
    thread: one that began meanwhile from 0; one that ended meanwhile (trio's idle workers end after 10 s) not
    at all, where subtracting its whole would have made a part less than 0; one renamed for a while (trio names
    a worker after the call it runs) in the part either look gave it. The part of ``thread_times``'s ``main``
    too, where it was given; ``whole``: the key of every thread's seconds together, those in no part too."""
    out = dict.fromkeys(parts, 0.0) | ({whole: 0.0} if whole is not None else {})
    for key, (kind, seconds) in after.items():
        was_kind, was = before.get(key, (None, 0.0))
        kind = kind or was_kind
        # never less than 0: a thread's time only grows, but the read-ahead's helper seen before it named itself
        # was its main thread in nanoseconds, and after it its whole in clock ticks
        spent = max(0.0, seconds - was)
        if kind is not None:
            out[kind] = out.get(kind, 0.0) + spent
        if whole is not None:
            out[whole] = out.get(whole, 0.0) + spent
    return out


def _per_open(before: dict[str, float], after: dict[str, float], opened: float) -> dict[str, float]:
    """Microseconds of each kind of CPU per open + close."""
    return {k: (after[k] - before[k]) / max(opened, 1) * 1e6 for k in before}


def timed_opens(root: Path, names: list[str], readers: int, seconds: float, pids: list[int],
                children: bool) -> tuple[float, dict[str, float]]:
    """Files/s the readers open and close under ``root``, and the daemon's CPU per open by kind (``cpu_split``)."""
    before = cpu_split(pids, children=children)
    opened, elapsed = open_close(root, names, readers, seconds)
    return opened / elapsed, _per_open(before, cpu_split(pids, children=children), opened)


def start_mirror(source: Path, mnt: Path, loops: int) -> tuple[subprocess.Popen[str], list[int]]:
    """The mirror served by ``loops`` processes on ``mnt``, and their pids."""
    daemon = subprocess.Popen([sys.executable, __file__, "--serve", str(source), str(mnt), str(loops)],
                              stdout=subprocess.PIPE, text=True)
    line = daemon.stdout.readline() if daemon.stdout else ""
    if not line.startswith("ready"):
        raise SystemExit(f"bench_loops: the mirror did not start ({daemon.wait()})")
    return daemon, [int(v) for v in line.split()[1:]]


def stop_mirror(daemon: subprocess.Popen[str], mnt: Path) -> None:
    """The mirror unmounted and its processes ended: detached lazily where the mount is busy, killed where they
    do not end (a benchmark that failed must leave no mount behind, nor hide why it failed)."""
    if subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False).returncode:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)
    try:
        daemon.wait(timeout=60)
    except subprocess.TimeoutExpired:
        daemon.kill()  # its other loops die with it (PR_SET_PDEATHSIG)
        daemon.wait(timeout=60)
    if daemon.stdout:
        daemon.stdout.close()


def _median_split(splits: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in splits) for k in splits[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000, help="files opened in turn (default 2000, 4 KB each)")
    parser.add_argument("--readers", type=int, default=16, help="reader processes (default 16)")
    parser.add_argument("--loops", default="1,2,4,8", help="daemon processes, a list (default 1,2,4,8)")
    parser.add_argument("--seconds", type=float, default=3.0, help="each measurement's time (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row, the median reported (default 3)")
    parser.add_argument("--liquidfs", action="store_true",
                        help="measure a liquidfs mount of the same files beside the mirror (mount --loops N), its "
                             "CPU per open split by thread and into user and system time")
    parser.add_argument("--work", type=Path, help="scratch (default: a new directory in the system's temp)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="default WORK/loops.json")
    parser.add_argument("--serve", nargs=3, metavar=("SRC", "MNT", "LOOPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(Path(args.serve[0]), Path(args.serve[1]), int(args.serve[2]))
    if os.geteuid() != 0:
        parser.error("needs root (passthrough registers backing files: CAP_SYS_ADMIN)")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-loops-"))
    source, mnt, liquid_mnt = work / "src", work / "mnt", work / "mnt-liquidfs"
    source.mkdir(parents=True, exist_ok=True)
    mnt.mkdir(exist_ok=True)
    names = [f"{i:06d}.bin" for i in range(args.files)]
    for n in names:
        if not (source / n).exists():
            (source / n).write_bytes(os.urandom(4096))
    bench: Any = None  # scripts/bench/_bench.py, which imports this checkout's liquidfs: only where it is measured
    store = None
    if args.liquidfs:
        import _bench

        bench = _bench
        store = bench.store_for(work, source, 0.0)
    rows = []
    print(f"{args.files} files, {args.readers} readers, {os.cpu_count()} cores; opens + closes, warm, "
          f"{args.seconds:g} s each, median of {args.repeats}")
    head = "| loops | direct files/s | mirror files/s | mirror/direct | mirror CPU us/open |"
    if args.liquidfs:
        head += (" liquidfs files/s | liquidfs/direct | liquidfs CPU us/open | its loops' threads (user + sys) |"
                 " its other threads (user + sys) |")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for loops in [int(v) for v in args.loops.split(",")]:
        daemon, pids = start_mirror(source, mnt, loops)
        liquid = None
        try:
            if bench is not None:
                liquid = bench.mount(source, store, liquid_mnt, "--loops", str(loops))
            for root in [mnt] + ([liquid_mnt] if liquid else []):
                for n in names:  # warm: every entry looked up once
                    os.stat(root / n)
            direct: list[float] = []
            mirror: list[float] = []
            mirror_cpu: list[dict[str, float]] = []
            ours: list[float] = []
            ours_cpu: list[dict[str, float]] = []
            for _ in range(args.repeats):  # direct, the mirror, liquidfs: side by side in each repeat
                direct.append(opens_per_s(source, names, args.readers, args.seconds))
                rate, cpu = timed_opens(mnt, names, args.readers, args.seconds, pids, children=False)
                mirror.append(rate)
                mirror_cpu.append(cpu)
                if liquid is not None:
                    rate, cpu = timed_opens(liquid_mnt, names, args.readers, args.seconds, [liquid.pid],
                                            children=True)
                    ours.append(rate)
                    ours_cpu.append(cpu)
        finally:
            try:
                if liquid is not None:
                    liquid.close(check=False)
            finally:
                stop_mirror(daemon, mnt)
        m_cpu = _median_split(mirror_cpu)
        row: dict[str, Any] = {
            "loops": loops, "direct": statistics.median(direct), "mount": statistics.median(mirror),
            "cpu_us_per_open": statistics.median(sum(c.values()) for c in mirror_cpu), "cpu_split": m_cpu,
            "direct_runs": direct, "mount_runs": mirror}
        line = (f"| {loops} | {row['direct']:,.0f} | {row['mount']:,.0f} | {row['mount'] / row['direct']:.2f} | "
                f"{row['cpu_us_per_open']:.0f} |")
        if ours:
            split = _median_split(ours_cpu)
            row["liquidfs"] = {"rate": statistics.median(ours), "runs": ours,
                               "cpu_us_per_open": statistics.median(sum(c.values()) for c in ours_cpu),
                               "cpu_split": split}
            ld = row["liquidfs"]
            line += (f" {ld['rate']:,.0f} | {ld['rate'] / row['direct']:.2f} | {ld['cpu_us_per_open']:.0f} |"
                     f" {split['loop_user'] + split['loop_sys']:.0f} ({split['loop_user']:.0f} + "
                     f"{split['loop_sys']:.0f}) | {split['other_user'] + split['other_sys']:.0f} "
                     f"({split['other_user']:.0f} + {split['other_sys']:.0f}) |")
        rows.append(row)
        print(line, flush=True)
    out = args.json or work / "loops.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"argv": sys.argv, "cores": os.cpu_count(), "files": args.files,
                                        "readers": args.readers, "seconds": args.seconds,
                                        "liquidfs": args.liquidfs}, "rows": rows}, indent=1))
    print(f"(JSON {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
