"""Raw read throughput, whole files, directly vs through liquidfs; daemon CPU per GB served.

    python scripts/bench/bench_read.py [--work out/bench] [--repeats 3] [--json WORK/read.json]

Uses the e2e benchmark's dataset and its ratio-1 store (all images served raw, ~6.3 MB each). Configurations:
direct cold (page cache dropped) and warm; liquidfs from storage (no cache: O_DIRECT reads), and from its memory
cache (--cache-size 100% --warmup), first pass (reads reach the daemon, answered from its memory) and later passes
(the kernel keeps the held files' pages). The reader is `cat`-like: 1 MiB reads, one file after another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402
from _bench import REPO, SUBDIR, control, cpu_seconds, dataset, drop_caches, mount, store_for  # noqa: E402


def read_tree(root: Path) -> tuple[int, float]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    started = time.perf_counter()
    total = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    bench.add_run_arguments(parser, results="WORK/read.json", work=REPO / "out" / "bench")
    args = parser.parse_args()
    work = args.work.absolute()
    out = (args.json or work / "read.json").absolute()
    src = dataset(work, args.images, 2048, 1024)
    store = store_for(work, src, 1.0)
    bmp = work / "bmp"
    rows = []

    def record(name: str, results: list[tuple[int, float, float | None]]) -> None:
        mbs = statistics.median(b / s / 1e6 for b, s, _ in results)
        cpu = [c / (b / 1e9) for b, _, c in results if c is not None]
        rows.append({"config": name, "mb_per_s": mbs, "daemon_cpu_s_per_gb": statistics.median(cpu) if cpu else None,
                     "runs": [round(b / s / 1e6) for b, s, _ in results]})
        print(f"  {name:<40} {mbs:8.0f} MB/s  daemon {rows[-1]['daemon_cpu_s_per_gb']}", file=sys.stderr)

    for name, root in (("direct all-BMP copy", bmp / SUBDIR), ("direct all-PNG", src / SUBDIR)):
        cold = []
        for _ in range(args.repeats):
            drop_caches()
            cold.append((*read_tree(root), None))
        record(f"{name}, cold", cold)
        record(f"{name}, warm", [(*read_tree(root), None) for _ in range(args.repeats)])

    m = mount(src, store, work / "mnt")
    try:
        runs = []
        for _ in range(args.repeats):
            drop_caches()
            c0 = cpu_seconds(m.pid)
            b, s = read_tree(m.mnt / SUBDIR)
            runs.append((b, s, cpu_seconds(m.pid) - c0))
        record("liquidfs r=1, from storage", runs)
    finally:
        m.close()
    m = mount(src, store, work / "mnt", "--cache-size", "100%", "--warmup")
    try:
        c0 = cpu_seconds(m.pid)
        b, s = read_tree(m.mnt / SUBDIR)
        record("liquidfs r=1, memory cache, first pass", [(b, s, cpu_seconds(m.pid) - c0)])
        runs = []
        for _ in range(args.repeats):
            c0 = cpu_seconds(m.pid)
            b, s = read_tree(m.mnt / SUBDIR)
            runs.append((b, s, cpu_seconds(m.pid) - c0))
        record("liquidfs r=1, memory cache, kernel-held pages", runs)
        st = control(m.mnt)
        print(f"  reclaimed {st['reclaimed']}, hits {st['cache_hits']}", file=sys.stderr)
    finally:
        m.close()
    print("| configuration | MB/s (median) | daemon CPU-s per GB | runs |")
    print("|---|---|---|---|")
    for r in rows:
        cpu = "" if r["daemon_cpu_s_per_gb"] is None else f"{r['daemon_cpu_s_per_gb']:.3f}"
        print(f"| {r['config']} | {r['mb_per_s']:.0f} | {cpu} | {r['runs']} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
