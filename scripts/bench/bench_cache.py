"""Hit ratio per window of 64 file reads: liquidfs's next-epoch cache vs the OS page cache, same memory.

    python scripts/bench/bench_cache.py [--files 400] [--share 0.3] [--epochs 4] [--json WORK/cache.json]

Each epoch reads every file once, whole, in a new random order. liquidfs: a mount with --cache-size SHARE, hits
from its statistics. Page cache: the same files read directly by a process in a cgroup v1 memory group limited
to SHARE of the dataset (+40 MB for the process), hits = 1 - (bytes the group read from disk / bytes requested)
per window, from the group's blkio counters. Prints a table and writes JSON to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402  (mount, page cache: one copy of each)

WINDOW = 64
MEMCG = Path("/sys/fs/cgroup/memory")
BLKIO = Path("/sys/fs/cgroup/blkio")

READER = r"""
import json, os, random, sys
root, seed, window, io_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".bin"))
random.Random(seed).shuffle(files)
def disk_read():
    if io_file == "-":
        return 0
    for line in open(io_file):
        parts = line.split()
        if len(parts) == 3 and parts[1] == "Read":
            return int(parts[2])
    return 0
out = []
start, asked = disk_read(), 0
for i, f in enumerate(files, 1):
    with open(f, "rb", buffering=0) as fh:
        while chunk := fh.read(1 << 20):
            asked += len(chunk)
    if i % window == 0:
        now = disk_read()
        out.append(max(0.0, 1 - (now - start) / asked))
        start, asked = now, 0
print(json.dumps(out))
"""


def make_files(root: Path, n: int, seed: int = 3) -> int:
    rng = random.Random(seed)
    if (root / ".done").exists():
        return sum(p.stat().st_size for p in root.rglob("*.bin"))
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(n):
        size = int(rng.uniform(2.2e6, 3.6e6))  # PNG-like sizes
        (root / f"f{i:05d}.bin").write_bytes(os.urandom(size))
        total += size
    (root / ".done").write_text("")
    return total


def liquidfs_windows(root: Path, work: Path, share: float, epochs: int) -> dict[int, list[float]]:
    with bench.mounted(root, work / "store", work / "mnt", "--cache-size", f"{share * 100:g}%") as m:
        out: dict[int, list[float]] = {}
        seen = 0
        for epoch in range(1, epochs + 1):
            subprocess.run([sys.executable, "-c", READER, str(m.mnt), str(epoch), str(WINDOW), "-"], check=True,
                           capture_output=True)
            st = bench.control(m.mnt)
            windows = st["window_byte_hit_ratios"]  # by bytes, as the page cache side is measured
            out[epoch] = windows[seen:]
            seen = len(windows)
        return out


def pagecache_windows(root: Path, total: int, share: float, epochs: int) -> dict[int, list[float]]:
    name = f"liquidfs-bench-{uuid.uuid4().hex[:6]}"
    mem, blk = MEMCG / name, BLKIO / name
    mem.mkdir()
    blk.mkdir()
    (mem / "memory.limit_in_bytes").write_text(str(int(share * total) + 40 * 2**20))
    bench.drop_caches()
    out: dict[int, list[float]] = {}

    def enter() -> None:
        (mem / "cgroup.procs").write_text(str(os.getpid()))
        (blk / "cgroup.procs").write_text(str(os.getpid()))

    try:
        for epoch in range(1, epochs + 1):
            done = subprocess.run([sys.executable, "-c", READER, str(root), str(epoch), str(WINDOW),
                                   str(blk / "blkio.throttle.io_service_bytes")], check=True,
                                  capture_output=True, text=True, preexec_fn=enter)
            out[epoch] = json.loads(done.stdout)
    finally:
        time.sleep(0.5)
        for d in (mem, blk):
            try:
                d.rmdir()
            except OSError:
                pass
    return out


def summarize(name: str, windows: dict[int, list[float]]) -> list[dict]:
    rows = []
    for epoch, w in windows.items():
        rows.append({"cache": name, "epoch": epoch, "windows": len(w),
                     "mean": statistics.fmean(w) if w else None,
                     "sd": statistics.pstdev(w) if len(w) > 1 else None,
                     "min": min(w) if w else None, "max": max(w) if w else None})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=400)
    parser.add_argument("--share", type=float, default=0.3)
    parser.add_argument("--epochs", type=int, default=4)
    bench.add_run_arguments(parser, results="WORK/cache.json", work=bench.REPO / "out" / "bench-cache",
                            work_help="the files, the store and the mountpoint")
    args = parser.parse_args()
    work = bench.work_dir(args.work)
    out = (args.json or work / "cache.json").absolute()
    root = work / "data"
    total = make_files(root, args.files)
    rows = summarize("liquidfs", liquidfs_windows(root, work, args.share, args.epochs))
    rows += summarize("page cache (memcg)", pagecache_windows(root, total, args.share, args.epochs))
    print(f"{args.files} files, {total / 1e9:.2f} GB, memory {args.share:.0%} of it, windows of {WINDOW} reads")
    print("| cache | epoch | windows | mean hit ratio | sd | min | max |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        f = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"| {r['cache']} | {r['epoch']} | {r['windows']} | {f(r['mean'])} | {f(r['sd'])} | {f(r['min'])} "
              f"| {f(r['max'])} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": sys.argv, "files": args.files, "bytes": total, "share": args.share,
                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
