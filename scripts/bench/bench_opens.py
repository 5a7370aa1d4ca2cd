"""Opens at the kernel's pace (issue 28): files per second through the mount against direct reads of the same
bytes, side by side in one run, and what each file costs the daemon.

Three shapes (``--shapes``): small files (``--small`` of 110 KB, ImageNet's average JPEG; no raw objects: every
open serves the source), Cityscapes-sized raw objects (``--large`` 6.3 MB BMPs of a store prepared all raw; direct
reads are of the store's objects, the very bytes the mount serves), and ``opens``: the same large objects opened and
closed with nothing read, what the opens cost alone (issue 40: a GPU node's loader workers opened 0.06x as fast through
the mount as directly). Each is read by 1, 2, 4, 8 and 16 reader processes (``--readers``), each opening, reading
whole and closing its share of the files in a shuffled order, in two states:

* cold: page cache, dentries and inodes dropped (the mount gets a LOOKUP for every file, the source a path walk);
* warm metadata: every file stat'ed first, then only the page cache dropped (the bytes come from the disk, the
  names and attributes from the kernel's caches: no LOOKUP reaches the daemon).

Each reader times every open(2) it makes: the table gives their p50 and p99 directly and through the mount (an open
that waits behind other opens shows in the tail). The mount runs with ``--time-requests``: the daemon's CPU per
file (from /proc, its worker threads and helper process included) and, per request type, how many reached it,
their wall time and the CPU they cost its loop. Medians of ``--repeats``; direct and mount alternate within each
repeat.

``--mirror``: a bare passthrough mirror of the same files in pyfuse3 (``bench_loops.py``'s: every name and
attribute read before it mounts, each OPEN one open(2) and the backing registered, nothing checked) is measured
beside them in each repeat, with the same states and readers: the ceiling any pyfuse3 daemon reaches here, against
which the mount's own work shows (issue 40: how far the mount's ratio can go).

    python scripts/bench/bench_opens.py                          # 5,000 small files and 48 large, ~10 min
    python scripts/bench/bench_opens.py --shapes opens --readers 16 --large 256   # the opens alone, 16 readers
    python scripts/bench/bench_opens.py --shapes small --mirror  # small files: direct, mirror and mount
    python scripts/bench/bench_opens.py --smoke                  # a few files: the script works, no figure
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _bench as bench
import bench_loops

from liquidfs.catalog.catalog import Catalog
from liquidfs.fuse import lookahead
from liquidfs.sysio import thread_names as names

STATES = ("cold", "warm")
#: Seconds between the mount's last run and a cold one's drop of the caches, at least: an epoch's caches are dropped
#: long after the last warm of its directories, and the read-ahead holds a directory whose inodes the kernel drops
#: again within twice ``AGAIN_COLD`` of its last warm to one warm a second (``fuse.lookahead``): cold runs a second
#: apart, as they came, would measure that bound, not a cold epoch.
COLD_QUIET = 2 * lookahead.AGAIN_COLD + 0.5
#: Parts of the daemon's CPU beside its loops' own threads, by the names its threads carry (``thread_names``): the
#: opens that went cold, in worker threads (trio's: those without a name of ours, since trio names its threads
#: before they exist, and most keep their process's name); the closer's page drops and closes; the read-ahead (its
#: thread, its warms, its helper process). The rest of ``other``: the notifier, the metrics and DNS threads, the
#: watchdog. Each thread's time is its schedstat's nanoseconds (the helper's whole its stat's clock ticks), and a
#: thread that began and ended within a run is in none (trio's workers stay 10 s after their last call).
PARTS = {"workers": ("Trio thread",), "closer": (names.CLOSER,), "read_ahead": (names.READ_AHEAD, names.WARMER)}
#: The loops' own threads (each process's main thread: its trio loop), and every thread of the daemon together.
LOOP, WHOLE = "loop", "daemon"
UNNAMED = "workers"
#: The daemon's other threads, in no part: not workers, though no part names them.
OTHERS = (names.NOTIFIER, names.METRICS, names.CLUSTER_DNS)
SHAPES = ("small", "large", "opens")
_BUFFER = 1 << 20


def small_dataset(work: Path, files: int, size: int) -> Path:
    """``files`` files of ``size`` random bytes, 100 to a directory (what a loader's tree of JPEGs looks like to
    the filesystem; their bytes are never decoded)."""
    src = work / f"small-{files}x{size}"
    marker = src / ".done"
    if marker.exists():
        return src
    rng = random.Random(28)
    for i in range(files):
        path = src / f"d{i // 100:04d}" / f"f{i:06d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    marker.write_text("")
    return src


def _reader(paths: list[str], read: bool, start: Any, out: Any) -> None:
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    opens: list[float] = []  # each open's seconds, as this reader sees them (the open(2) call alone)
    start.wait()
    began = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every reader
    total = 0
    for path in paths:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        opens.append(time.perf_counter() - t0)
        try:
            while read and (n := os.readv(fd, [view])):
                total += n
        finally:
            os.close(fd)
    out.put((began, time.perf_counter(), total, opens))


def read_files(paths: list[str], readers: int, read: bool = True) -> tuple[float, int, list[float]]:
    """Seconds for ``readers`` processes to open, read whole (``read``; else only open and close) and close their
    shares of ``paths`` (each its own slice of one shuffled order), the bytes read, and every open's seconds. The
    seconds are the readers' own, from the first one's start to the last one's end: not this process's wake-up
    nor the results' trip back, which are milliseconds, and the opens of 192 files alone take 3-40."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(paths[i::readers], read, start, out)) for i in range(readers)]
    for p in procs:
        p.start()
    time.sleep(0.2)  # every reader forked and waiting
    start.set()
    results = []
    while len(results) < readers:  # a reader that failed (a path that cannot be opened) must not hang the run
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            if any(p.exitcode for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError("a reader failed: " + ", ".join(f"exit {p.exitcode}" for p in procs)) from None
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a reader failed (exit {p.exitcode})")
    elapsed = max(ended for _, ended, _, _ in results) - min(began for began, _, _, _ in results)
    return elapsed, sum(n for _, _, n, _ in results), [t for _, _, _, opens in results for t in opens]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prepare_state(state: str, paths: list[str]) -> None:
    if state == "cold":
        bench.drop_caches(3)
    else:
        for path in paths:
            os.stat(path)
        bench.drop_caches(1)


def _requests_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {name: {k: after[name][k] - before.get(name, {}).get(k, 0) for k in after[name]}
            for name in after if after[name]["count"] - before.get(name, {}).get("count", 0)}


@dataclass
class Mirror:
    """The bare pyfuse3 mirror (``--mirror``) of a directory: where it is mounted, and its process."""

    mnt: Path
    pid: int


@contextmanager
def mirrored(source: Path, mnt: Path) -> Iterator[Mirror]:
    """``source`` served by ``bench_loops.py``'s passthrough mirror (one loop) on ``mnt`` while in the block."""
    mnt.mkdir(parents=True, exist_ok=True)
    if bench.is_mounted(mnt):  # left by an interrupted run
        subprocess.run([bench.FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True, check=False)
    daemon, pids = bench_loops.start_mirror(source, mnt, 1)
    try:
        yield Mirror(mnt, pids[0])
    finally:
        bench_loops.stop_mirror(daemon, mnt)


def measure(shape: str, direct: list[Path], mounted: bench.Mounted, rel: list[str], readers: list[int],
            repeats: int, read: bool = True, mirror: Mirror | None = None,
            mirror_rel: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows of ``rel`` (names below the mount) read through the mount against ``direct`` (the same bytes, file by
    file) read directly; ``read`` False: only opened and closed (the opens' own cost). ``mirror``: the same bytes
    read through it too (``mirror_rel``, names below it; default ``rel``)."""
    rows = []
    mount_ended = -COLD_QUIET
    wheres = ("direct", "mirror", "mount") if mirror is not None else ("direct", "mount")
    below = {"mount": rel, "mirror": mirror_rel or rel}
    for state in STATES:
        for n in readers:
            runs: dict[str, list[float]] = {where: [] for where in wheres}
            read_bytes: dict[str, int] = {}  # what each read in its last run: the same bytes everywhere
            latencies: dict[str, list[float]] = {where: [] for where in wheres}
            cpu_per_file: list[float] = []
            # where it went: the loops' own threads (each loop's trio loop) and every other thread and process
            # of the daemon (worker threads, the closer, the read-ahead and its helper), microseconds a file
            cpu_split: list[dict[str, float]] = []
            mirror_cpu: list[float] = []
            requests: dict[str, dict[str, float]] = {}
            for _ in range(repeats):
                order = list(range(len(rel)))
                random.shuffle(order)
                for where in wheres:
                    if where == "direct":
                        paths = [str(direct[i]) for i in order]
                    else:
                        root = mounted.mnt if where == "mount" else mirror.mnt  # type: ignore[union-attr]
                        paths = [str(root / below[where][i]) for i in order]
                    if where == "mount" and state == "cold":
                        time.sleep(max(0.0, mount_ended + COLD_QUIET - time.monotonic()))
                    prepare_state(state, paths)
                    if where == "mount":
                        control0 = bench.control(mounted.mnt)
                        req0 = control0.get("requests", {})
                        threads0 = bench_loops.thread_times([mounted.pid], PARTS, unnamed=UNNAMED, others=OTHERS,
                                                            main=LOOP)
                    elif where == "mirror":
                        mirror0 = bench_loops.thread_times([mirror.pid], {}, main=LOOP)  # type: ignore[union-attr]
                    seconds, read_bytes[where], opens = read_files(paths, n, read)
                    if where == "mount":
                        mount_ended = time.monotonic()
                    runs[where].append(len(paths) / seconds)
                    latencies[where] += opens
                    if where == "mirror":
                        mirror1 = bench_loops.thread_times([mirror.pid], {}, main=LOOP)  # type: ignore[union-attr]
                        mirror_cpu.append(bench_loops.parts_between(mirror0, mirror1, {}, whole=WHOLE)[WHOLE]
                                          / len(paths) * 1e6)
                    if where == "mount":
                        threads = bench_loops.thread_times([mounted.pid], PARTS, unnamed=UNNAMED, others=OTHERS,
                                                           main=LOOP)
                        spent = {kind: seconds / len(paths) * 1e6 for kind, seconds
                                 in bench_loops.parts_between(threads0, threads, PARTS, whole=WHOLE).items()}
                        loop = spent.get(LOOP, 0.0)
                        cpu_split.append({"loop": loop, "other": spent[WHOLE] - loop,
                                          **{kind: spent[kind] for kind in PARTS}})
                        cpu_per_file.append(spent[WHOLE])  # the daemon's whole
                        control1 = bench.control(mounted.mnt)
                        requests = _requests_delta(req0, control1.get("requests", {}))
                        # opens that went to a worker thread (their inodes not in memory) in the last run
                        cold_opens = (control1.get("cold_opens", 0) - control0.get("cold_opens", 0)) / len(paths)
                        # inodes the read-ahead warmed per file (with --loops, each loop had warmed its own)
                        warms = (control1.get("lookahead_files", 0) - control0.get("lookahead_files", 0)) / len(paths)
            direct_rate, mount_rate = statistics.median(runs["direct"]), statistics.median(runs["mount"])
            per_file = {name: {"per_file": r["count"] / len(rel),
                               "wall_us": r["wall_s"] / max(1, r["count"]) * 1e6,
                               "loop_cpu_us": r["cpu_s"] / max(1, r["count"]) * 1e6}
                        for name, r in requests.items()}
            # Every open of every repeat, as the readers saw them: the tail is what waits behind other opens.
            opens_us = {f"{where}_open_{name}_us": percentile(latencies[where], q) * 1e6
                        for where in wheres for name, q in (("p50", 0.5), ("p99", 0.99))}
            row = {**opens_us, "shape": shape, "state": state, "readers": n, "files": len(rel),
                   "direct_files_s": direct_rate, "mount_files_s": mount_rate, "ratio": mount_rate / direct_rate,
                   "daemon_cpu_us_per_file": statistics.median(cpu_per_file),
                   "daemon_cpu_split_us_per_file": {kind: statistics.median(c[kind] for c in cpu_split)
                                                    for kind in ("loop", "other", *PARTS)},
                   "runs": runs, "bytes_read": read_bytes, "requests_last_run": per_file,
                   "cold_opens_per_file": cold_opens, "lookahead_warms_per_file": warms}
            mirrored_line = ""
            if mirror is not None:
                mirror_rate = statistics.median(runs["mirror"])
                row.update(mirror_files_s=mirror_rate, mirror_ratio=mirror_rate / direct_rate,
                           mirror_cpu_us_per_file=statistics.median(mirror_cpu))
                mirrored_line = (f"mirror {mirror_rate:8.0f} ({mirror_rate / direct_rate:.2f}x, open p50/p99 us "
                                 f"{opens_us['mirror_open_p50_us']:.0f}/{opens_us['mirror_open_p99_us']:.0f}, "
                                 f"{row['mirror_cpu_us_per_file']:.0f} us CPU/file), ")
            rows.append(row)
            print(f"{shape:5} {state:4} {n} readers: direct {direct_rate:8.0f} files/s, {mirrored_line}"
                  f"mount {mount_rate:8.0f} "
                  f"({mount_rate / direct_rate:.2f}x), open p50/p99 us direct {opens_us['direct_open_p50_us']:.0f}/"
                  f"{opens_us['direct_open_p99_us']:.0f} mount {opens_us['mount_open_p50_us']:.0f}/"
                  f"{opens_us['mount_open_p99_us']:.0f}, daemon {statistics.median(cpu_per_file):6.0f} us CPU/file "
                  f"({_split(row)}), read-ahead warms {warms:.2f}/file  "
                  + " ".join(f"{k} {v['per_file']:.2f}x{v['loop_cpu_us']:.0f}us" for k, v in per_file.items()),
                  file=sys.stderr)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    mirror = any("mirror_files_s" in r for r in rows)
    lines = ["| shape | metadata | readers | direct files/s | "
             + ("mirror files/s | mirror/direct | mirror open p50 / p99 us | mirror CPU us/file | " if mirror else "")
             + "mount files/s | mount/direct | open p50 / p99 us, direct | mount | daemon CPU us/file (its loops' "
             "threads + the rest: of it worker threads, closer, read-ahead) "
             "| opens in a thread | loop CPU us per request (requests per file) |"]
    lines.append("|---" * (lines[0].count("|") - 1) + "|")
    for r in rows:
        req = ", ".join(f"{k} {v['loop_cpu_us']:.0f} ({v['per_file']:.2f})" for k, v in r["requests_last_run"].items())
        mirrored = (f"{r['mirror_files_s']:.0f} | {r['mirror_ratio']:.2f} | {r['mirror_open_p50_us']:.0f} / "
                    f"{r['mirror_open_p99_us']:.0f} | {r['mirror_cpu_us_per_file']:.0f} | ") if mirror else ""
        lines.append(f"| {r['shape']} | {r['state']} | {r['readers']} | {r['direct_files_s']:.0f} | {mirrored}"
                     f"{r['mount_files_s']:.0f} | {r['ratio']:.2f} | {r['direct_open_p50_us']:.0f} / "
                     f"{r['direct_open_p99_us']:.0f} | {r['mount_open_p50_us']:.0f} / {r['mount_open_p99_us']:.0f} | "
                     f"{r['daemon_cpu_us_per_file']:.0f} ({_split(r)}) | "
                     f"{r['cold_opens_per_file']:.0%} | {req} |")
    return "\n".join(lines)


def _split(row: dict[str, Any]) -> str:
    """A row's daemon CPU per file as its loops' threads + the rest, and the rest's parts (JSON of a version
    without them: blank)."""
    split = row.get("daemon_cpu_split_us_per_file")
    if not split:
        return ""
    parts = ", ".join(f"{split[kind]:.0f}" for kind in PARTS if kind in split)
    return f"{split['loop']:.0f} + {split['other']:.0f}" + (f": {parts}" if parts else "")


@contextmanager
def optional_mirror(wanted: bool, source: Path, work: Path) -> Iterator[Mirror | None]:
    """``mirrored`` where ``--mirror`` asks for it, else None."""
    if not wanted:
        yield None
        return
    with mirrored(source, work / "mnt-mirror") as mirror:
        yield mirror


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_run_arguments(parser, results="WORK/opens.json", work=Path("out/bench-opens"),
                            smoke="40 small files and 4 large, one repeat")
    parser.add_argument("--small", type=int, default=5000, help="small files (default 5000)")
    parser.add_argument("--small-size", type=int, default=110_000, help="their size in bytes (default 110000)")
    parser.add_argument("--large", type=int, default=48, help="large raw objects (default 48; 0: none)")
    parser.add_argument("--readers", default="1,2,4,8,16",
                        help="reader processes, comma-separated (default 1,2,4,8,16)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="which shapes, comma-separated: small (open, read, close), large (the same), opens "
                             "(the large objects opened and closed, nothing read: what the opens cost alone); "
                             f"default {','.join(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row, the median reported (default 3)")
    parser.add_argument("--data-path", default="auto", choices=["auto", "passthrough", "daemon"],
                        help="the mount's --data-path (default auto)")
    parser.add_argument("--mount-options", default="", metavar="OPTS",
                        help="more options for liquidfs mount, space-separated (e.g. '--no-lookahead')")
    parser.add_argument("--no-time-requests", action="store_true",
                        help="mount without --time-requests (a version without it; no loop CPU per request)")
    parser.add_argument("--mirror", action="store_true",
                        help="also read the files through a bare pyfuse3 passthrough mirror (bench_loops.py's), "
                             "beside direct and the mount: the ceiling of any pyfuse3 daemon here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root: it drops the page cache, dentries and inodes between runs")
    if args.smoke:
        args.small, args.large, args.repeats, args.readers = 40, 4, 1, "1,2"
    readers = [int(n) for n in args.readers.split(",") if n]
    shapes = bench.split_choices(parser, args.shapes, SHAPES, "--shapes")
    work = bench.work_dir(args.work)
    out = args.json or work / "opens.json"
    rows: list[dict[str, Any]] = []
    mnt = work / "mnt"

    options = ["--data-path", args.data_path, *([] if args.no_time_requests else ["--time-requests"]),
               *args.mount_options.split()]
    data_path = "?"
    if "small" in shapes:
        src = small_dataset(work, args.small, args.small_size)
        store = bench.store_for(work, src, 0.0)
        rel = sorted(str(p.relative_to(src)) for p in src.rglob("*.bin"))
        with bench.mounted(src, store, mnt, *options) as m, optional_mirror(args.mirror, src, work) as mirror:
            data_path = bench.control(mnt)["data_path"]
            rows += measure("small", [src / r for r in rel], m, rel, readers, args.repeats, mirror=mirror)
    if args.large and {"large", "opens"} & set(shapes):
        big = bench.dataset(bench.dataset_dir(work, args.large, 2048, 1024), args.large, 2048, 1024)
        raw = bench.store_for(work / "large", big, 1.0)
        # Direct: each image's raw object, the very bytes the mount serves under the image's name.
        pairs = [(os.fsdecode(n.path), raw / n.object) for n in Catalog.open(raw).files() if n.object]
        # The mirror serves the store itself: the objects, under their own names.
        with bench.mounted(big, raw, mnt, *options) as m, optional_mirror(args.mirror, raw, work) as mirror:
            data_path = bench.control(mnt)["data_path"]
            for shape in ("large", "opens"):
                if shape in shapes:
                    rows += measure(shape, [o for _, o in pairs], m, [p for p, _ in pairs], readers, args.repeats,
                                    read=shape == "large", mirror=mirror,
                                    mirror_rel=[str(o.relative_to(raw)) for _, o in pairs])
    result = {"data_path": data_path, "rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(f"data path: {data_path}; results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
