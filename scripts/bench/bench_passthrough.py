"""Both data paths side by side: FUSE passthrough against the daemon path, and each against direct reads.

    python scripts/bench/bench_passthrough.py [--images 1000] [--repeats 3] [--readers 1,2,4,8] [--parts dali,cat,cache]

Dataset: ``--images`` 2048x1024 sample images (bench_e2e's, under --work), a ratio-1 store (every image raw,
~6.3 MB) and a ratio-0 store, and a plain copy of what the ratio-1 mount serves (the "same files read
directly"). Page cache dropped before every cold run. Parts:

* dali: an unmodified DALI CPU pipeline (scripts/bench/dali_epoch.py: random shuffle, 2 threads), one epoch, cold:
  r=1 through each data path against the all-BMP copy read directly; r=0 against all-PNG read directly. The
  daemon's CPU seconds per GB served and per open come from /proc/<daemon>/stat.
* cat: N parallel readers of disjoint file sets (1 MiB reads), cold, MB/s through each path and directly.
* daemon-ab: a data path (``--ab-path``, default daemon) of this tree against the same of ``--baseline-rev``
  (checked out in a temporary worktree; a revision before passthrough has only the daemon path), DALI r=1 cold,
  interleaved A/B, medians: a change must not have made the path slower.
* mix: the ratio ``liquidfs profile`` chooses on this machine (DALI decoder, all cores), prepared, through
  passthrough against direct all-PNG: cold, and warm (direct: the page cache filled; liquidfs: every file in
  its memfds, --cache-size 100% --warmup).
* cache: --cache-size 30 %, 3 epochs of DALI through each path (the first cold); per-epoch images/s and the
  per-window hit ratios of epochs 2-3; and direct reads of the all-BMP copy in a memory cgroup of the same size
  (the page cache as the cache: the paper's baseline).

Prints a markdown table per part, writes JSON to --json (default WORK/passthrough.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402
from _bench import (DALI_EPOCH, REPO, SUBDIR, Mounted, control, cpu_seconds, dataset, drop_caches,  # noqa: E402
                    run_loader, served_copy, store_for)

PATHS = ("passthrough", "daemon")


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in (root / SUBDIR).rglob("*") if p.is_file())


def mount(src: Path, store: Path, work: Path, path: str, *extra: str) -> Mounted:
    m = bench.mount(src, store, work / "mnt", "--data-path", path, *extra)
    got = control(m.mnt)["data_path"]
    if got != path:
        m.close()
        raise SystemExit(f"asked for the {path} data path, got {got}")
    return m


def dali_epoch(root: Path, images: int, seed: int, daemon: Mounted | None) -> dict:
    before = (cpu_seconds(daemon.pid), control(daemon.mnt)) if daemon else None
    result = run_loader(root, images, seed=seed, group=None, threads=2, batch=16)
    if daemon and before:
        after = control(daemon.mnt)
        result["daemon_cpu_s"] = cpu_seconds(daemon.pid) - before[0]
        result["opens"] = after["opens"] - before[1]["opens"]
        result["served_bytes"] = sum(after[k] - before[1][k] for k in ("bytes_from_storage", "bytes_from_memory"))
        result["daemon_read_requests"] = after["read_requests"] - before[1]["read_requests"]
    return result


def summarize(name: str, runs: list[dict], baseline: float | None = None) -> dict:
    ips = statistics.median(r["images_per_s"] for r in runs)
    row: dict = {"config": name, "images_per_s": ips, "runs": [round(r["images_per_s"], 1) for r in runs],
                 "ratio": ips / baseline if baseline else None}
    if "daemon_cpu_s" in runs[0]:
        row["daemon_cpu_s_per_gb"] = statistics.median(r["daemon_cpu_s"] / max(1, r["served_bytes"]) * 1e9
                                                       for r in runs)
        row["daemon_ms_per_open"] = statistics.median(r["daemon_cpu_s"] * 1e3 / max(1, r["opens"]) for r in runs)
        row["daemon_read_requests"] = statistics.median(r["daemon_read_requests"] for r in runs)
    print(f"  {name:<44} {ips:7.1f} img/s" + (f"  {row['ratio']:.3f}x" if baseline else "")
          + (f"  daemon {row['daemon_cpu_s_per_gb']:.3f} CPU-s/GB, {row['daemon_ms_per_open']:.2f} ms/open"
             if "daemon_cpu_s_per_gb" in row else ""), file=sys.stderr, flush=True)
    return row


def part_dali(args: argparse.Namespace, src: Path, stores: dict[float, Path], bmp: Path) -> list[dict]:
    rows = []
    n = args.images
    for ratio, direct, label in ((1.0, bmp, "all-BMP copy"), (0.0, src, "all-PNG")):
        runs = []
        for rep in range(args.repeats):
            drop_caches()
            runs.append(dali_epoch(direct, n, rep, None))
        base = summarize(f"r={ratio:g} direct ({label}), cold", runs)
        rows.append(base)
        for path in PATHS:
            m = mount(src, stores[ratio], args.work, path)
            try:
                runs = []
                for rep in range(args.repeats):
                    drop_caches()
                    runs.append(dali_epoch(m.mnt, n, rep, m))
            finally:
                m.close()
            rows.append(summarize(f"r={ratio:g} liquidfs {path}, cold", runs, base["images_per_s"]))
    return rows


CAT = r"""
import sys
total = 0
for f in sys.argv[1:]:
    with open(f, "rb", buffering=0) as fh:
        while chunk := fh.read(1 << 20):
            total += len(chunk)
print(total)
"""


def parallel_cat(files: list[Path], readers: int) -> tuple[int, float]:
    parts = [files[i::readers] for i in range(readers)]
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", CAT, *map(str, part)], stdout=subprocess.PIPE, text=True)
             for part in parts]
    total = sum(int(p.communicate()[0]) for p in procs)
    return total, time.perf_counter() - started


def part_cat(args: argparse.Namespace, src: Path, stores: dict[float, Path], bmp: Path) -> list[dict]:
    rows = []
    count = min(args.cat_files, args.images)
    mounts = {path: mount(src, stores[1.0], args.work / path, path) for path in PATHS}
    try:
        for readers in args.readers:
            cells: dict = {"readers": readers}
            for name, root in (("direct", bmp), *((p, m.mnt) for p, m in mounts.items())):
                runs = []
                for _ in range(args.repeats):
                    drop_caches()
                    c0 = cpu_seconds(mounts[name].pid) if name in mounts else 0.0
                    b, s = parallel_cat(files_of(root)[:count], readers)
                    cpu = cpu_seconds(mounts[name].pid) - c0 if name in mounts else None
                    runs.append((b / s / 1e6, cpu / (b / 1e9) if cpu is not None else None))
                cells[name] = statistics.median(r[0] for r in runs)
                cells[f"{name}_runs"] = [round(r[0]) for r in runs]
                if name in mounts:
                    cells[f"{name}_cpu_s_per_gb"] = statistics.median(r[1] for r in runs)
            for p in PATHS:
                cells[f"{p}_ratio"] = cells[p] / cells["direct"]
            print(f"  {readers} readers: direct {cells['direct']:.0f} MB/s, passthrough {cells['passthrough']:.0f} "
                  f"({cells['passthrough_ratio']:.2f}x), daemon {cells['daemon']:.0f} ({cells['daemon_ratio']:.2f}x)",
                  file=sys.stderr, flush=True)
            rows.append(cells)
    finally:
        for m in mounts.values():
            m.close()
    return rows


def part_cache(args: argparse.Namespace, src: Path, stores: dict[float, Path], bmp: Path) -> list[dict]:
    rows = []
    n = args.images
    for path in PATHS:
        m = mount(src, stores[1.0], args.work, path, "--cache-size", "30%")
        try:
            drop_caches()
            epochs = [dali_epoch(m.mnt, n, e, m) for e in range(3)]
            st = control(m.mnt)
        finally:
            m.close()
        windows = [r for r in st["window_hit_ratios"]][-(2 * n // st["window_size"]):]
        row = {"config": f"liquidfs {path}, --cache-size 30%", "epochs": [round(e["images_per_s"], 1) for e in epochs],
               "byte_hit_ratio": {k: v["byte_hit_ratio"] for k, v in st["epochs"].items()},
               "window_hit_ratio_mean": st["window_hit_ratio_mean"], "window_hit_ratio_sd": st["window_hit_ratio_sd"],
               "windows": len(windows),
               "daemon_cpu_s_per_gb": [round(e["daemon_cpu_s"] / max(1, e["served_bytes"]) * 1e9, 3) for e in epochs]}
        print(f"  {row['config']}: epochs {row['epochs']} img/s, window hit ratio {row['window_hit_ratio_mean']}"
              f" +- {row['window_hit_ratio_sd']}", file=sys.stderr, flush=True)
        rows.append(row)
    # the page cache as the cache: direct reads in a memory cgroup of the same size (+ the loader's own memory)
    served = sum(p.stat().st_size for p in files_of(bmp))
    limit = int(served * 0.30) + args.loader_memory
    cg = Path("/sys/fs/cgroup/memory/liquidfs-bench")
    cg.mkdir(exist_ok=True)
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        drop_caches()
        epochs = []
        for e in range(3):
            cmd = [sys.executable, str(DALI_EPOCH), str(bmp / SUBDIR), "--images", str(n),
                   "--seed", str(e), "--threads", "2", "--batch", "16"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                  preexec_fn=lambda: (cg / "cgroup.procs").write_text(str(os.getpid())))
            epochs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        rows.append({"config": f"direct all-BMP copy, memory cgroup {limit / 1e9:.2f} GB",
                     "epochs": [round(e["images_per_s"], 1) for e in epochs]})
        print(f"  {rows[-1]['config']}: epochs {rows[-1]['epochs']} img/s", file=sys.stderr, flush=True)
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    return rows


def _baseline_mount(tree: Path, src: Path, store: Path, mnt: Path, path: str = "daemon") -> Mounted:
    """A mount of the baseline, its code imported from ``tree``: in the foreground (a detached daemon is
    started with ``python -I``, which would import the installed liquidfs, this tree's), with ``--data-path
    path`` where the revision has data paths (before passthrough, every mount is the daemon path)."""
    argv = [sys.executable, "-m", "liquidfs", "mount", str(src), str(mnt), "--store", str(store), "--foreground"]
    if "--data-path" in subprocess.run([*argv[:3], "mount", "--help"], cwd=tree, capture_output=True,
                                       text=True).stdout:
        argv += ["--data-path", path]
    elif path != "daemon":
        raise RuntimeError(f"{tree} has no --data-path: only its daemon path can be measured")
    proc = subprocess.Popen(argv, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            pid = int(control(mnt)["pid"])
            break
        except (OSError, ValueError, KeyError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the baseline mount of {tree} did not answer") from None
            time.sleep(0.2)
    assert pid == proc.pid, "the control file answers for another mount"
    return Mounted(mnt, pid)


def part_daemon_ab(args: argparse.Namespace, src: Path, stores: dict[float, Path], bmp: Path) -> list[dict]:
    import tempfile

    tree = Path(tempfile.mkdtemp(prefix="liquidfs-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.baseline_rev],
                   check=True, capture_output=True)
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    mnt = args.work / "mnt"
    mnt.mkdir(exist_ok=True)
    try:
        for rep in range(args.repeats):
            for name in ("baseline", "this"):
                if name == "baseline":
                    m = _baseline_mount(tree, src, stores[1.0], mnt, args.ab_path)
                else:
                    m = mount(src, stores[1.0], args.work, args.ab_path)
                try:
                    drop_caches()
                    runs[name].append(dali_epoch(m.mnt, args.images, rep, m))
                finally:
                    m.close()
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    base = summarize(f"r=1 {args.ab_path} path of {args.baseline_rev}, cold", runs["baseline"])
    return [base, summarize(f"r=1 {args.ab_path} path of this tree, cold", runs["this"], base["images_per_s"])]


def part_mix(args: argparse.Namespace, src: Path, stores: dict[float, Path], bmp: Path) -> list[dict]:
    from _bench import auto_ratio, read_all

    ratio = auto_ratio(args.work, src)
    print(f"  profiled ratio {ratio:g}", file=sys.stderr, flush=True)
    store = store_for(args.work, src, ratio)
    rows = []
    for state in ("cold", "warm"):
        runs = []
        for rep in range(args.repeats):
            if state == "cold":
                drop_caches()
            else:
                read_all(src / SUBDIR)
            runs.append(dali_epoch(src, args.images, rep, None))
        base = summarize(f"direct all-PNG, {state}", runs)
        rows.append(base)
        extra = ("--cache-size", "100%", "--warmup") if state == "warm" else ()
        m = mount(src, store, args.work, "passthrough", *extra)
        try:
            runs = []
            if state == "warm":
                dali_epoch(m.mnt, args.images, 99, m)  # one pass: every file has been opened once
            for rep in range(args.repeats):
                if state == "cold":
                    drop_caches()
                runs.append(dali_epoch(m.mnt, args.images, rep, m))
        finally:
            m.close()
        rows.append(summarize(f"liquidfs passthrough, profiled r={ratio:g}, {state}", runs, base["images_per_s"]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--readers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--cat-files", type=int, default=300, help="files read by the parallel readers")
    parser.add_argument("--loader-memory", type=int, default=1_500_000_000,
                        help="bytes the cgroup baseline allows the loader itself, on top of 30 %% of the data")
    parser.add_argument("--parts", default="dali,cat,cache", help="any of dali,cat,cache,daemon-ab,mix")
    parser.add_argument("--ab-path", choices=["daemon", "passthrough"], default="daemon",
                        help="daemon-ab: the data path both sides are measured on (default daemon)")
    parser.add_argument("--baseline-rev", default="b820bfa",
                        help="daemon-ab: the revision whose daemon path is the baseline (default: the last before "
                        "passthrough)")
    bench.add_run_arguments(parser, results="WORK/passthrough.json", work=REPO / "out" / "bench-pt")
    args = parser.parse_args()
    args.work = args.work.absolute()
    out = (args.json or args.work / "passthrough.json").absolute()
    src = dataset(args.work, args.images, 2048, 1024)
    stores = {1.0: store_for(args.work, src, 1.0), 0.0: store_for(args.work, src, 0.0)}
    bmp = served_copy(args.work, src, 1.0)
    results: dict = {"argv": sys.argv, "images": args.images, "kernel": os.uname().release}
    for part in args.parts.split(","):
        print(f"{part}:", file=sys.stderr, flush=True)
        results[part] = {"dali": part_dali, "cat": part_cat, "cache": part_cache,
                         "daemon-ab": part_daemon_ab, "mix": part_mix}[part](args, src, stores, bmp)
        out.write_text(json.dumps(results, indent=1))
    for part in ("dali", "daemon-ab", "mix"):
        if part not in results:
            continue
        print("| configuration | images/s (median) | x baseline | daemon CPU-s/GB | daemon ms/open | runs |")
        print("|---|---|---|---|---|---|")
        for r in results[part]:
            ratio = f"{r['ratio']:.3f}" if r["ratio"] else ""
            cpu = f"{r['daemon_cpu_s_per_gb']:.3f}" if "daemon_cpu_s_per_gb" in r else ""
            ms = f"{r['daemon_ms_per_open']:.2f}" if "daemon_ms_per_open" in r else ""
            print(f"| {r['config']} | {r['images_per_s']:.1f} | {ratio} | {cpu} | {ms} | {r['runs']} |")
    if "cat" in results:
        print("\n| readers | direct MB/s | passthrough MB/s (x direct) | daemon MB/s (x direct) | "
              "passthrough CPU-s/GB | daemon CPU-s/GB |")
        print("|---|---|---|---|---|---|")
        for c in results["cat"]:
            print(f"| {c['readers']} | {c['direct']:.0f} | {c['passthrough']:.0f} ({c['passthrough_ratio']:.2f}) | "
                  f"{c['daemon']:.0f} ({c['daemon_ratio']:.2f}) | {c['passthrough_cpu_s_per_gb']:.3f} | "
                  f"{c['daemon_cpu_s_per_gb']:.3f} |")
    if "cache" in results:
        print("\n| configuration | epoch 1-3 images/s | window hit ratio (mean +- sd) | byte hit ratio per epoch |")
        print("|---|---|---|---|")
        for r in results["cache"]:
            hit = f"{r['window_hit_ratio_mean']} +- {r['window_hit_ratio_sd']}" if "window_hit_ratio_mean" in r else ""
            print(f"| {r['config']} | {r['epochs']} | {hit} | {r.get('byte_hit_ratio', '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
