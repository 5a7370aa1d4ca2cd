"""End-to-end benchmark: an unmodified DALI CPU pipeline reading the sample dataset directly and through liquidfs.

    python scripts/bench/bench_e2e.py e2e   [--images 128] [--ratios 0,0.5,1,auto] [--caps 0,200] [--repeats 3]
    python scripts/bench/bench_e2e.py sweep [--caps 0,200,100]     # all 11 ratios + the profiler's choice, cold
    python scripts/bench/bench_e2e.py cache [--cap 200] [--epochs 3] [--cache-size 30%]
    python scripts/bench/bench_e2e.py pagecache --ratios 0,1 --repeats 5   # mount --page-cache drop/keep/direct
    ... --shuffle-buffer 44   # DALI's initial_fill (default 1024, DALI's own)
    ... --loader torch     # torchvision ImageFolder + DataLoader (workers = cores) instead of DALI

Every configuration runs in its own loader process (scripts/bench/dali_epoch.py: fn.readers.file with random shuffle +
fn.decoders.image, batch 16, threads = cores), repeated; medians are reported with ratios to the all-PNG direct
read of the same state. "cold": page cache dropped before each run and liquidfs without a memory cache, so every
byte comes from storage; "warm": the page cache pre-filled for direct reads, and for liquidfs every file held in
its memory cache (--cache-size 100% --warmup, plus one pass so the kernel keeps the held files' pages).
Storage caps use a cgroup v1 blkio throttle on the loader (direct) or on the daemon (liquidfs).
Results: a markdown table on stdout, JSON at --json (default WORK/MODE.json) and a PNG chart beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402
import _throttle  # noqa: E402
from _bench import (REPO, SUBDIR, Mounted, auto_ratio, bmp_copy, control, cpu_seconds, dataset,  # noqa: E402
                    drop_caches, mount, read_all, run_loader, served_copy, store_for, tree_bytes)


def measure(name: str, root: Path, *, state: str, cap: int, repeats: int, images: int, args: argparse.Namespace,
            daemon: Mounted | None = None) -> dict:
    group = _throttle.ReadThrottle(root if daemon is None else args.work, cap * 1_000_000) if cap else None
    if group and daemon:
        group.add(daemon.pid)
    runs = []
    try:
        for rep in range(repeats):
            if state == "cold":
                drop_caches()
            elif daemon is None:
                read_all(root / SUBDIR)
            before = (cpu_seconds(daemon.pid), control(daemon.mnt)) if daemon else None
            result = run_loader(root, images, seed=rep, group=None if daemon else group,
                                threads=args.threads,
                                batch=args.batch)
            if daemon and before:
                after = control(daemon.mnt)
                result["daemon_cpu_s"] = cpu_seconds(daemon.pid) - before[0]
                result["daemon_bytes_read"] = after["bytes_read"] - before[1]["bytes_read"]
                result["served_bytes"] = (after["bytes_from_storage"] + after["bytes_from_memory"]
                                          - before[1]["bytes_from_storage"] - before[1]["bytes_from_memory"])
                # what storage gave the daemon: each file once, plus the chunks of pages the kernel lost
                result["storage_bytes"] = (after["bytes_from_storage"] + after["bytes_refetched"]
                                           - before[1]["bytes_from_storage"] - before[1]["bytes_refetched"])
            runs.append(result)
    finally:
        if group:
            group.close()
    n_files, n_bytes = tree_bytes(root / SUBDIR)
    ips = statistics.median(r["images_per_s"] for r in runs)
    row = {"config": name, "state": state, "cap_mb_s": cap, "images_per_s": ips,
           "runs": [round(r["images_per_s"], 2) for r in runs],
           "mb_per_s": ips * n_bytes / n_files / 1e6,
           "loader_cpu_ms_per_image": 1000 * statistics.median(r["loader_cpu_s"] / r["images"] for r in runs)}
    if daemon:
        served = [r["served_bytes"] for r in runs if r.get("served_bytes")]
        row["daemon_cpu_s_per_gb"] = statistics.median(
            r["daemon_cpu_s"] / (r["served_bytes"] / 1e9) for r in runs if r.get("served_bytes")) if served else None
        row["daemon_cpu_ms_per_image"] = 1000 * statistics.median(r["daemon_cpu_s"] / r["images"] for r in runs)
        row["storage_mb_per_image"] = statistics.median(r["storage_bytes"] / 1e6 / r["images"] for r in runs)
        row["bytes_reaching_daemon_share"] = statistics.median(
            r["daemon_bytes_read"] / r["served_bytes"] for r in runs if r.get("served_bytes")) if served else None
    print(f"  {name:<22} {state:<5} cap {cap or '-':>4}  {ips:7.1f} img/s  runs {row['runs']}", file=sys.stderr)
    return row


# -- modes ----------------------------------------------------------------------------------------------


def mode_e2e(args: argparse.Namespace) -> list[dict]:
    src = dataset(args.work, args.images, args.width, args.height)
    bmp = bmp_copy(args.work, src)
    rows = []
    for cap in args.caps:
        ratios = []
        for r in args.ratios:
            ratios.append(auto_ratio(args.work, src, cap_mb=cap) if r == "auto" else float(r))
        for state in ("cold", "warm"):
            rows.append(measure("direct all-PNG", src, state=state, cap=cap, repeats=args.repeats,
                                images=args.images, args=args))
            rows.append(measure("direct all-BMP", bmp, state=state, cap=cap, repeats=args.repeats,
                                images=args.images, args=args))
            for label, r in zip(args.ratios, ratios):
                if label == "auto" and r not in (0.0, 1.0):  # the profiled mix, read directly, is its own bar
                    rows.append(measure(f"direct r={r:.2f} (auto)", served_copy(args.work, src, r), state=state,
                                        cap=cap, repeats=args.repeats, images=args.images, args=args))
                store = store_for(args.work, src, r)
                extra = ["--cache-size", "100%", "--warmup"] if state == "warm" else []
                m = mount(src, store, args.work / "mnt", *extra)
                try:
                    if state == "warm":
                        read_all(m.mnt / SUBDIR)  # one pass: the kernel keeps the held files' pages
                    name = f"liquidfs r={r:.2f}" + (" (auto)" if label == "auto" else "")
                    rows.append(measure(name, m.mnt, state=state, cap=cap, repeats=args.repeats,
                                        images=args.images, args=args, daemon=m))
                finally:
                    m.close()
    return rows


def mode_sweep(args: argparse.Namespace) -> list[dict]:
    src = dataset(args.work, args.images, args.width, args.height)
    rows = []
    for cap in args.caps:
        chosen = auto_ratio(args.work, src, cap_mb=cap)
        for r, profiled in [(i / 10, False) for i in range(11)] + [(chosen, True)]:
            store = store_for(args.work, src, r)
            m = mount(src, store, args.work / "mnt")
            try:
                name = f"liquidfs r={r:.2f}" + (" (profile)" if profiled else "")
                row = measure(name, m.mnt, state="cold", cap=cap, repeats=args.repeats, images=args.images,
                              args=args, daemon=m)
                row["ratio"] = r
                row["profiled"] = profiled
                rows.append(row)
            finally:
                m.close()
    return rows


def mode_cache(args: argparse.Namespace) -> list[dict]:
    src = dataset(args.work, args.images, args.width, args.height)
    ratio = auto_ratio(args.work, src, cache_share=float(args.cache_size.rstrip("%")) / 100, cap_mb=args.cap)
    store = store_for(args.work, src, ratio)
    rows = []
    for label, extra in (("cache off", []), (f"cache {args.cache_size}", ["--cache-size", args.cache_size])):
        m = mount(src, store, args.work / "mnt", *extra)
        group = _throttle.ReadThrottle(args.work, args.cap * 1_000_000) if args.cap else None
        if group:
            group.add(m.pid)
        try:
            drop_caches()
            for epoch in range(1, args.epochs + 1):
                result = run_loader(m.mnt, args.images, seed=epoch, group=None, threads=args.threads,
                                    batch=args.batch)
                st = control(m.mnt)
                rows.append({"config": f"liquidfs r={ratio:.2f}, {label}", "epoch": epoch, "cap_mb_s": args.cap,
                             "images_per_s": result["images_per_s"],
                             "byte_hit_ratio": st.get("epochs", {}).get(str(epoch), {}).get("byte_hit_ratio")})
                print(f"  {rows[-1]}", file=sys.stderr)
        finally:
            if group:
                group.close()
            m.close()
    return rows


def mode_pagecache(args: argparse.Namespace) -> list[dict]:
    """The --page-cache lever, cold: drop vs keep vs direct at each ratio, interleaved repeat by repeat (the
    machine drifts; an A/B run as blocks would measure the drift), plus direct all-BMP/all-PNG as the bar."""
    src = dataset(args.work, args.images, args.width, args.height)
    bmp = bmp_copy(args.work, src)
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for r in map(float, args.ratios):
            store = store_for(args.work, src, r)
            for mode in ("drop", "keep", "direct"):
                m = mount(src, store, args.work / "mnt", "--page-cache", mode)
                try:
                    drop_caches()
                    cpu0, st0 = cpu_seconds(m.pid), control(m.mnt)
                    result = run_loader(m.mnt, args.images, seed=rep, group=None, threads=args.threads,
                                        batch=args.batch)
                    st1 = control(m.mnt)
                    served = st1["bytes_from_storage"] - st0["bytes_from_storage"]
                    result["daemon_cpu_s_per_gb"] = (cpu_seconds(m.pid) - cpu0) / (served / 1e9)
                    result["cached_mb_after"] = _meminfo_cached_mb()
                finally:
                    m.close()
                runs.setdefault(f"liquidfs r={r:.2f} --page-cache {mode}", []).append(result)
                print(f"  rep {rep} r={r:.2f} {mode:<6} {result['images_per_s']:6.1f} img/s "
                      f"daemon {result['daemon_cpu_s_per_gb']:.2f} CPU-s/GB", file=sys.stderr)
        for name, root in (("direct all-PNG", src), ("direct all-BMP", bmp)):
            drop_caches()
            runs.setdefault(name, []).append(run_loader(root, args.images, seed=rep, group=None,
                                                        threads=args.threads, batch=args.batch))
    rows = []
    for name, results in runs.items():
        row = {"config": name, "state": "cold", "cap_mb_s": 0,
               "images_per_s": statistics.median(r["images_per_s"] for r in results),
               "runs": [round(r["images_per_s"], 2) for r in results],
               "loader_cpu_ms_per_image": 1000 * statistics.median(r["loader_cpu_s"] / r["images"] for r in results)}
        if "daemon_cpu_s_per_gb" in results[0]:
            row["daemon_cpu_s_per_gb"] = statistics.median(r["daemon_cpu_s_per_gb"] for r in results)
            row["page_cache_mb_after"] = statistics.median(r["cached_mb_after"] for r in results)
        rows.append(row)
    return rows


def _meminfo_cached_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- output ---------------------------------------------------------------------------------------------


def markdown(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k not in ("runs",)]
    for r in rows:
        for k in r:
            if k not in keys and k != "runs":
                keys.append(k)
    base = {(r["state"], r["cap_mb_s"]): r["images_per_s"] for r in rows
            if r.get("config") == "direct all-PNG" and "state" in r}
    lines = ["| " + " | ".join(keys + (["x all-PNG direct"] if base else [])) + " |",
             "|" + "---|" * (len(keys) + (1 if base else 0))]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v if v is not None else ""))
        if base:
            b = base.get((r.get("state"), r.get("cap_mb_s")))
            cells.append(f"{r['images_per_s'] / b:.2f}" if b else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path, loader: str = "dali") -> None:
    from PIL import Image, ImageDraw

    bar_h, left, width = 18, 330, 900
    img = Image.new("RGB", (width, 40 + bar_h * len(rows)), "white")
    draw = ImageDraw.Draw(img)
    top = max(r["images_per_s"] for r in rows)
    title = "DALI CPU pipeline" if loader == "dali" else "torchvision ImageFolder + DataLoader"
    draw.text((10, 10), f"{title}, images/s (median)", fill="black")
    for i, r in enumerate(rows):
        y = 30 + i * bar_h
        label = f"{r['config']} {r.get('state', '')} cap {r.get('cap_mb_s') or '-'}" + (
            f" ep{r['epoch']}" if "epoch" in r else "")
        draw.text((10, y + 3), label[:48], fill="black")
        w = int((width - left - 80) * r["images_per_s"] / top)
        draw.rectangle((left, y + 2, left + w, y + bar_h - 2), fill="steelblue")
        draw.text((left + w + 5, y + 3), f"{r['images_per_s']:.1f}", fill="black")
    img.save(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["e2e", "sweep", "cache", "pagecache"])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--ratios", default="0,0.5,1,auto")
    parser.add_argument("--caps", default="0,200", help="storage caps in MB/s (0: uncapped)")
    parser.add_argument("--cap", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cache-size", default="30%")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--shuffle-buffer", type=int, default=1024,
                        help="DALI's initial_fill (default: DALI's own, 1024): with fewer images than this the "
                        "reader opens the whole epoch at once; Cityscapes' 2,975 training images are ~3x it")
    parser.add_argument("--loader", choices=["dali", "torch"], default="dali",
                        help="DALI CPU pipeline (threads = cores) or torchvision ImageFolder + DataLoader "
                        "(workers = cores)")
    bench.add_run_arguments(parser, results="WORK/MODE.json, e.g. out/bench/e2e.json", work=REPO / "out" / "bench")
    args = parser.parse_args()
    bench.LOADER["name"] = args.loader
    bench.LOADER["shuffle_buffer"] = args.shuffle_buffer
    args.work = bench.work_dir(args.work)
    args.ratios = args.ratios.split(",")
    args.caps = [int(c) for c in args.caps.split(",")]
    problem = _throttle.available()
    if problem and any(args.caps):
        raise SystemExit(f"storage caps need cgroup v1 blkio: {problem}")
    started = time.time()
    rows = {"e2e": mode_e2e, "sweep": mode_sweep, "cache": mode_cache, "pagecache": mode_pagecache}[args.mode](args)
    tag = args.mode if args.loader == "dali" else f"{args.mode}-{args.loader}"
    if args.loader == "dali" and args.shuffle_buffer != 1024:
        tag += f"-sb{args.shuffle_buffer}"
    out = (args.json or args.work / f"{tag}.json").absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"mode": args.mode, "loader": args.loader, "argv": sys.argv, "started": started, "seconds": time.time() - started,
            "images": args.images, "size": f"{args.width}x{args.height}", "threads": args.threads,
            "batch": args.batch, "repeats": args.repeats, "shuffle_buffer": args.shuffle_buffer}
    if args.mode == "sweep":
        for cap in args.caps:
            these = [r for r in rows if r["cap_mb_s"] == cap]
            best = max(r["images_per_s"] for r in these if not r["profiled"])
            chosen = next(r for r in these if r["profiled"])
            meta[f"choice_vs_best_cap{cap}"] = chosen["images_per_s"] / best
            print(f"cap {cap or 'none'}: profile chose {chosen['ratio']:.2f}: "
                  f"{chosen['images_per_s'] / best:.3f} of the best of the 11 mixes", file=sys.stderr)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    chart(rows, out.with_suffix(".png"), args.loader)
    print(markdown(rows))
    print(f"\n(JSON {out}, chart {out.with_suffix('.png')}, {time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
