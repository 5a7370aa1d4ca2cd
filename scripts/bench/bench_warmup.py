#!/usr/bin/env python3
"""``mount --warmup``'s choice of files over a whole catalog: its time, how long the mount's loop went without
answering meanwhile, and the peak RSS, in a fresh process per run; with ``--against DIR`` (another checkout, an
older commit's: ``git worktree add DIR COMMIT``) the two side by side, alternated, medians of ``--repeats``.

The choice runs under a budget of every file with a data path that holds none of them: what is measured is the
choice among every file (the catalog read, the shuffle), not the reads of the chosen. A task on the same trio loop
ticks every millisecond; its longest gap is how long the mount's requests would have waited.

    python scripts/bench/bench_scale.py --files 1000000 --mounts 1 --work /tmp/scale1m   # makes a catalog
    python scripts/bench/bench_warmup.py --store /tmp/scale1m/store --against /tmp/old --json out/warmup.json

A checkout whose ``warm_up`` takes a list of ``Node`` (before this script) is given ``list(catalog.files())``, as
its daemon made it, on the loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402

#: Run as ``python -I -c CODE CHECKOUT STORE``: that checkout's liquidfs, the catalog in STORE.
CODE = """
import inspect, json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import trio
from liquidfs.catalog.catalog import Catalog
from liquidfs.datapath import base
from liquidfs.policy.next_epoch import NextEpochCache
catalog = Catalog.open(sys.argv[2], readonly=True, immutable=True)
files, served, _, max_id = catalog.file_totals()
takes_nodes = "files" in inspect.signature(base.warm_up).parameters
class Held:
    policy = NextEpochCache(1 << 62, max(served, 1), files, max_id=max_id)
class Path:
    held = Held()
    chosen = 0
    async def warm_one(self, node):
        Path.chosen += 1
        return None
gaps = []
async def main():
    async def ticker():
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.05)
        started = time.perf_counter()
        await base.warm_up(Path(), list(catalog.files()) if takes_nodes else catalog)
        seconds = time.perf_counter() - started
        await trio.sleep(0.02)  # the ticker records the gap the choice made before it is cancelled
        nursery.cancel_scope.cancel()
    return seconds
seconds = trio.run(main)
print(json.dumps({"seconds": seconds, "longest_gap_ms": max(gaps) * 1000, "files": files, "chosen": Path.chosen,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(store: Path, checkout: Path = bench.REPO) -> dict[str, Any]:
    """One run of ``checkout``'s warm-up choice over the catalog in ``store``, in a fresh process."""
    out = subprocess.run([sys.executable, "-I", "-c", CODE, str(checkout), str(store)], capture_output=True,
                         text=True, check=True, cwd="/")
    return json.loads(out.stdout)


def run(store: Path, against: Path | None, repeats: int) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {"this": []} | ({"against": []} if against else {})
    for _ in range(repeats):
        if against is not None:
            runs["against"].append(measure(store, against))
        runs["this"].append(measure(store))
    return runs


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = [f"{'checkout':<10} {'files':>11} {'seconds':>8} {'loop gap ms':>12} {'peak RSS MB':>12}   (medians)"]
    for name, each in runs.items():
        lines.append(f"{name:<10} {each[0]['files']:>11,} {statistics.median(r['seconds'] for r in each):>8.2f} "
                     f"{statistics.median(r['longest_gap_ms'] for r in each):>12.0f} "
                     f"{statistics.median(r['maxrss_mb'] for r in each):>12.0f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, required=True, help="a store directory with a catalog")
    parser.add_argument("--against", type=Path, metavar="DIR", help="another checkout to run side by side")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternated (default 3)")
    bench.add_run_arguments(parser, results="not written: printed only")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    runs = run(args.store.absolute(), args.against.absolute() if args.against else None, args.repeats)
    print(table(runs))
    bench.write_results(args.json, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
