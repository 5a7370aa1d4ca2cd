"""Several jobs on one mount (issue 29, "Several jobs on one node"): k trainings of a search read the whole dataset
through one mount with one --cache-size, each in its own order, at the same pace or at different ones.

    python scripts/bench/bench_jobs.py [--images 800] [--size 512x256] [--jobs 3] [--paces 1,0.5,0.25]
        [--epochs 4] [--cache-size 30] [--cap-mb 200] [--scenarios one-job,same-pace,different-paces]
        [--json out/bench/jobs.json]
    python scripts/bench/bench_jobs.py --smoke      # 24 tiny images, 2 jobs, 2 epochs, < 1 min

Scenarios, each on a fresh mount of the sample dataset's PNGs (a ratio-0 store: every image served as its PNG):
    one-job          one job alone: the baseline (hit ratio ~C/D, storage ~(1 - C/D) of the dataset per epoch after
                     the first)
    same-pace        --jobs jobs at full speed, started together
    different-paces  one job per --paces entry: pace p reads a file at most every t / p seconds, t the per-file time
                     of the same-pace jobs (--pace-ms to set it; without same-pace, one-job's)

A job is a process in a session of its own (as a training started from its own shell or unit; the mount tells
jobs apart by cgroup and session, liquidfs/policy/jobs.py), without the variables that would name a job instead. Every
epoch it opens each image once in a seeded order of its own, reads it whole, checks its sha256 against the
source's and decodes it with Pillow; after each epoch it reads its own entry of the mount's statistics
(liquidfs.daemon.control.read_control: "jobs", the one whose openers are its session).

Figures per job: epochs the mount counted, the byte hit ratio after its first epoch (hit bytes over hit and
storage bytes, from its entries after epoch 1 and at the end), the mount's window hit ratio (reads per window of
64, epochs 2 on: mean and lowest), images/s over epochs 2 on, bytes it read from storage, failed reads, wrong
bytes. For all jobs of a scenario: storage bytes in datasets, in all and per epoch after the first, beside what
k jobs read with a random C/D of the dataset held (k x (1 - C/D) per epoch) and with no cache (k per epoch); and
the block layer's reads (the blkio group's count: the daemon and the jobs). Storage is the machine's disk behind a
blkio cap (--cap-mb, 0: none) holding the daemon and the jobs (with FUSE passthrough the kernel reads a backing
file in the reader's context); the page cache is dropped before each scenario, never during one (it holds the
mount's cache). Needs root on Linux.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402  (dataset, stores, mounts, page cache: one copy of each)
import _throttle  # noqa: E402
from liquidfs.policy.jobs import JOB_VARIABLES  # noqa: E402

SCENARIOS = ("one-job", "same-pace", "different-paces")

#: One training's loader, reduced to what the mount sees. Reads its settings from the JSON file argv[1] names and
#: writes its epochs to cfg["out"].
JOB = r"""
import hashlib, io, json, os, random, sys, time
from pathlib import Path
cfg = json.loads(Path(sys.argv[1]).read_text())
sys.path.insert(0, cfg["repo"])
from PIL import Image
from liquidfs.daemon.control import read_control

mnt, files, period = Path(cfg["mnt"]), cfg["files"], cfg["period_s"]
session = f"uid {os.getuid()}, session {os.getsid(0)},"  # how the mount labels this job's openers (liquidfs.policy.jobs)

def mine():
    for job, entry in read_control(mnt).get("jobs", {}).items():
        if str(entry.get("openers", "")).startswith(session):
            return job, entry
    return None, None

rng = random.Random(cfg["seed"])
order = list(range(len(files)))
epochs = []
Path(cfg["ready"]).write_text("")  # imported: the disk reads from here on are the dataset's
while not Path(cfg["go"]).exists():
    time.sleep(0.005)
for epoch in range(1, cfg["epochs"] + 1):
    rng.shuffle(order)
    e = {"epoch": epoch, "files": 0, "bytes": 0, "failed": 0, "undecodable": 0, "wrong_files": 0,
         "wrong_bytes": 0, "slept_s": 0.0}
    started = time.perf_counter()
    for i in order:
        rel, digest, where = files[i]
        begun = time.perf_counter()
        try:
            with open(mnt / rel, "rb") as f:
                data = f.read()
        except OSError as exc:
            e["failed"] += 1
            print(f"{rel}: {exc}", file=sys.stderr)
            continue
        e["files"] += 1
        e["bytes"] += len(data)
        if hashlib.sha256(data).hexdigest() != digest:
            good = Path(where).read_bytes()
            e["wrong_files"] += 1
            e["wrong_bytes"] += sum(a != b for a, b in zip(data, good)) + abs(len(data) - len(good))
        try:
            with Image.open(io.BytesIO(data)) as image:
                image.load()
        except OSError as exc:
            e["undecodable"] += 1
            print(f"{rel}: {exc}", file=sys.stderr)
        rest = period - (time.perf_counter() - begun)
        if rest > 0:
            time.sleep(rest)
            e["slept_s"] += rest
    e["seconds"] = time.perf_counter() - started
    e["job"], e["mount"] = mine()
    epochs.append(e)
    Path(cfg["out"]).write_text(json.dumps({"pid": os.getpid(), "epochs": epochs}))
"""


# -- the dataset -------------------------------------------------------------------------------------------


def expected_files(src: Path) -> tuple[list[tuple[str, str, str]], int]:
    """Every image as (path in the mount, sha256, source file), and their bytes: a ratio-0 store serves the PNGs
    themselves."""
    out = []
    total = 0
    for path in sorted((src / bench.SUBDIR).rglob("*.png")):
        data = path.read_bytes()
        total += len(data)
        out.append((str(path.relative_to(src)), hashlib.sha256(data).hexdigest(), str(path)))
    return out, total


# -- one scenario ----------------------------------------------------------------------------------------------


def job_env() -> dict[str, str]:
    """The environment of a job: without the variables that name a job, so its session tells it apart (a run
    inside a Slurm step or under torchrun would otherwise make the jobs one)."""
    names = {name for group in JOB_VARIABLES for name in group}
    return {k: v for k, v in os.environ.items() if k not in names}


def run_scenario(name: str, paces: list[float], pace_s: float, files: list[tuple[str, str, str]], src: Path,
                 store: Path, data_work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Mount, start one job per pace together, wait for all, unmount: the jobs' reports and the mount's end."""
    out: dict[str, Any] = {"scenario": name, "paces": paces, "pace_s": pace_s, "jobs": [], "error": None}
    scratch = args.work / "jobs" / name
    scratch.mkdir(parents=True, exist_ok=True)
    group: _throttle.ReadThrottle | None = None
    procs: list[subprocess.Popen[bytes]] = []
    m: bench.Mounted | None = None
    try:
        m = bench.mount(src, store, args.work / "mnt", "--cache-size", f"{args.cache_size:g}%")
        if args.cap_mb:
            group = _throttle.ReadThrottle(data_work, args.cap_mb * 1_000_000)
            group.add(m.pid)
        go = scratch / "go"
        go.unlink(missing_ok=True)
        bench.drop_caches()
        for k, pace in enumerate(paces):
            cfg = {"repo": str(bench.REPO), "mnt": str(m.mnt), "files": files, "epochs": args.epochs,
                   "seed": args.seed * 1000 + k, "period_s": 0.0 if pace >= 1 else pace_s / pace,
                   "out": str(scratch / f"job{k}.json"), "ready": str(scratch / f"job{k}.ready"), "go": str(go)}
            for stale in ("out", "ready"):
                Path(cfg[stale]).unlink(missing_ok=True)
            (scratch / f"job{k}.cfg.json").write_text(json.dumps(cfg))
            with open(scratch / f"job{k}.log", "wb") as log:
                # its own session: a job apart; in the blkio group before its first read
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", JOB, str(scratch / f"job{k}.cfg.json")], stdout=log, stderr=log,
                    env=job_env(), start_new_session=True,
                    preexec_fn=(lambda: group.add(os.getpid())) if group else None))
        # all start together, once each has loaded Python and Pillow: their disk reads are not the dataset's
        deadline = time.monotonic() + 120
        while not all((scratch / f"job{k}.ready").exists() for k in range(len(paces))):
            if gone := [k for k, proc in enumerate(procs) if proc.poll() is not None]:
                log_of = scratch / f"job{gone[0]}.log"
                raise RuntimeError(f"job {gone[0]} exited before it began: {bench.tail(log_of)}")
            if time.monotonic() > deadline:
                raise RuntimeError("the jobs did not start in 120 s")
            time.sleep(0.01)
        disk0 = group.read_bytes() if group else 0
        started = time.perf_counter()
        go.write_text("")
        deadline = time.monotonic() + args.timeout
        for k, proc in enumerate(procs):
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"job {k} exited {code}: {bench.tail(scratch / f'job{k}.log')}")
        out["wall_s"] = time.perf_counter() - started
        out["disk_bytes"] = group.read_bytes() - disk0 if group else None
        st = bench.control(m.mnt)
        out["mount"] = {k: st.get(k) for k in ("data_path", "jobs_reading", "jobs_retired", "cache_budget",
                                               "cache_held_bytes", "cache_hit_bytes", "cache_miss_bytes",
                                               "bytes_from_storage", "errors")}
        out["mount"]["jobs"] = st.get("jobs")
        for k, pace in enumerate(paces):
            report = json.loads((scratch / f"job{k}.json").read_text())
            out["jobs"].append({"index": k, "pace": pace, "period_s": 0.0 if pace >= 1 else pace_s / pace,
                                "pid": report["pid"], "epochs": report["epochs"]})
    except (subprocess.SubprocessError, RuntimeError, OSError, ValueError, KeyError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}".strip()
        print(f"  {name}: FAILED: {out['error']}", file=sys.stderr)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if m is not None:
            m.close(check=False)
        if group is not None:
            group.close()
    return out


# -- figures ---------------------------------------------------------------------------------------------------


def job_figures(job: dict[str, Any], dataset_bytes: int) -> dict[str, Any]:
    """One job's figures from its epochs and the mount entries it read after each."""
    epochs = job["epochs"]
    first, last = epochs[0]["mount"] or {}, epochs[-1]["mount"] or {}
    later = epochs[1:] or epochs
    storage = int(last.get("storage_bytes", 0))
    storage_later = storage - int(first.get("storage_bytes", 0)) if len(epochs) > 1 else None
    hit_later = int(last.get("hit_bytes", 0)) - int(first.get("hit_bytes", 0))
    seconds = sum(e["seconds"] for e in later)
    return {
        "index": job["index"], "pace": job["pace"], "id": epochs[-1]["job"],
        "epochs": last.get("epoch"), "files": sum(e["files"] for e in epochs),
        "hit_ratio_after_first": (hit_later / (hit_later + storage_later)
                                  if storage_later is not None and hit_later + storage_later else None),
        "window_mean": last.get("window_hit_ratio_mean"), "window_low": last.get("window_hit_ratio_low"),
        "windows": last.get("windows"),
        "images_per_s": sum(e["files"] for e in later) / seconds if seconds else None,
        "storage_bytes": storage, "storage_bytes_after_first": storage_later,
        "storage_datasets": storage / dataset_bytes,
        "failed": sum(e["failed"] for e in epochs), "undecodable": sum(e["undecodable"] for e in epochs),
        "wrong_files": sum(e["wrong_files"] for e in epochs), "wrong_bytes": sum(e["wrong_bytes"] for e in epochs),
    }


def scenario_figures(run: dict[str, Any], dataset_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    jobs = [job_figures(j, dataset_bytes) for j in run["jobs"]]
    k, epochs, share = len(run["paces"]), args.epochs, args.cache_size / 100
    fastest = max((j["images_per_s"] or 0 for j in jobs), default=0)
    for j in jobs:
        j["relative_pace"] = j["images_per_s"] / fastest if fastest and j["images_per_s"] else None
    storage = sum(j["storage_bytes"] for j in jobs)
    later = [j["storage_bytes_after_first"] for j in jobs]
    return {
        "scenario": run["scenario"], "jobs_started": k,
        "jobs_seen": len({j["id"] for j in jobs if j["id"] is not None}),
        "jobs": jobs,
        "storage_datasets": storage / dataset_bytes,
        "storage_per_epoch_after_first": (sum(later) / (epochs - 1) / dataset_bytes
                                          if epochs > 1 and None not in later else None),
        "random_held_per_epoch": k * (1 - share), "no_cache_per_epoch": k,
        "random_held_datasets": k * (1 + (epochs - 1) * (1 - share)), "no_cache_datasets": k * epochs,
        "disk_datasets": run["disk_bytes"] / dataset_bytes if run.get("disk_bytes") is not None else None,
        "mount_storage_datasets": ((run.get("mount") or {}).get("bytes_from_storage") or 0) / dataset_bytes,
        "failed": sum(j["failed"] + j["undecodable"] for j in jobs),
        "wrong_bytes": sum(j["wrong_bytes"] for j in jobs),
        "wall_s": run.get("wall_s"),
    }


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "" if v is None else format(v, spec)


def markdown(figures: list[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    cap = f"storage capped at {args.cap_mb} MB/s" if args.cap_mb else "storage not capped"
    lines = [f"{args.images} PNG images {args.size} ({meta['dataset_bytes'] / 1e6:.0f} MB), one mount with "
             f"--cache-size {args.cache_size:g}%, {args.epochs} epochs per job, {cap}, page cache dropped before "
             f"each scenario, data path {meta.get('data_path')}, {os.cpu_count()} cores. A job: a process in its own "
             f"session reading every image once per epoch in its own seeded order, sha256-checked and decoded "
             f"with Pillow; different paces: a file at most every t / pace, t = {meta['pace_ms']:.1f} ms. Hit "
             f"ratio: bytes, epochs 2 on; windows: {64} reads, epochs 2 on (the mount's); storage in datasets.",
             "",
             "| scenario | job | pace (measured) | epochs | hit ratio | window mean / low (n) | images/s "
             "| storage | failed | wrong bytes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in figures:
        for j in s["jobs"]:
            window = f"{fmt(j['window_mean'])} / {fmt(j['window_low'])} ({j['windows']})" if j["windows"] else ""
            lines.append(f"| {s['scenario']} | {j['index']} | {j['pace']:g} ({fmt(j['relative_pace'], '.2f')}) "
                         f"| {j['epochs']} | {fmt(j['hit_ratio_after_first'])} | {window} "
                         f"| {fmt(j['images_per_s'], '.0f')} "
                         f"| {j['storage_datasets']:.2f} | {j['failed'] + j['undecodable']} | {j['wrong_bytes']} |")
    lines += ["", f"All jobs of a scenario, storage in datasets (random held: {args.cache_size:g}% of the dataset "
              f"held at random for whichever job reads next; disk: the block layer's reads):", "",
              "| scenario | jobs seen / started | storage | per epoch after the first | random held: per epoch "
              "/ all | no cache: per epoch / all | disk | wall s |",
              "|---|---|---|---|---|---|---|---|"]
    for s in figures:
        lines.append(f"| {s['scenario']} | {s['jobs_seen']} / {s['jobs_started']} | {s['storage_datasets']:.2f} "
                     f"| {fmt(s['storage_per_epoch_after_first'], '.2f')} | {s['random_held_per_epoch']:.2f} / "
                     f"{s['random_held_datasets']:.2f} | {s['no_cache_per_epoch']} / {s['no_cache_datasets']} "
                     f"| {fmt(s['disk_datasets'], '.2f')} | {fmt(s['wall_s'], '.0f')} |")
    return "\n".join(lines)


# -- driver ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=800)
    parser.add_argument("--size", default="512x256", help="WIDTHxHEIGHT of the generated images")
    parser.add_argument("--jobs", type=int, default=3, help="jobs of same-pace")
    parser.add_argument("--paces", default="1,0.5,0.25", help="different-paces: one job per pace, 1 the fastest")
    parser.add_argument("--pace-ms", type=float, metavar="MS",
                        help="t: the per-file time of pace 1 (default: the same-pace jobs', else one-job's)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs every job reads")
    parser.add_argument("--cache-size", type=float, default=30.0, metavar="PERCENT",
                        help="the mount's --cache-size, percent of the dataset (default 30)")
    parser.add_argument("--cap-mb", type=int, default=200, help="storage read cap, MB/s (0: none)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument("--seed", type=int, default=0, help="job k's order: seed x 1000 + k")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a scenario's jobs may take")
    bench.add_run_arguments(parser, results="out/bench/jobs.json", work=bench.REPO / "out" / "bench-jobs",
                            work_help="dataset, store and the mountpoint (the dataset is kept per count and size)",
                            smoke="24 images of 256x128, 2 jobs (paces 1 and 0.5), 2 epochs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.images, args.size, args.jobs, args.paces, args.epochs = 24, "256x128", 2, "1,0.5", 2
    args.width, args.height = map(int, args.size.lower().split("x"))
    args.paces = [float(p) for p in args.paces.split(",") if p]
    if not args.paces or not all(0 < p <= 1 for p in args.paces):
        parser.error("--paces: numbers in (0, 1], 1 for full speed")
    chosen = set(bench.split_choices(parser, args.scenarios, SCENARIOS, "scenario"))
    args.scenarios = [s for s in SCENARIOS if s in chosen]  # calibration first: one-job, then same-pace
    args.json = (args.json or bench.REPO / "out" / "bench" / "jobs.json").absolute()
    args.work = args.work.absolute()
    return args


def preflight(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if problem := bench.root_problem("before every scenario"):
        return problem
    if args.cap_mb and (problem := _throttle.available()):
        return f"the storage cap needs cgroup v1 blkio: {problem} (--cap-mb 0: no cap)"
    return None


def per_file_s(run: dict[str, Any]) -> float | None:
    """The median job's seconds per file over its whole run (sleep-free: its pace was 1)."""
    times = [sum(e["seconds"] for e in j["epochs"]) / max(1, sum(e["files"] for e in j["epochs"]))
             for j in run["jobs"]]
    return statistics.median(times) if times else None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if problem := preflight(args):
        print(f"bench_jobs: {problem}", file=sys.stderr)
        return 2
    started = time.time()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    data_work = bench.dataset_dir(args.work, args.images, args.width, args.height)
    src = bench.dataset(data_work, args.images, args.width, args.height)
    store = bench.store_for(data_work, src, 0.0)
    files, dataset_bytes = expected_files(src)
    meta: dict[str, Any] = {
        "argv": sys.argv, "started": started, "images": len(files), "size": args.size, "epochs": args.epochs,
        "cache_size_percent": args.cache_size, "cap_mb_s": args.cap_mb, "seed": args.seed, "cores": os.cpu_count(),
        "dataset_bytes": dataset_bytes, "smoke": args.smoke,
        "loader": "one process per job in its own session, each image opened once per epoch, read whole, "
                  "sha256-checked, decoded with Pillow"}
    pace_s = args.pace_ms / 1000 if args.pace_ms else 0.02
    runs: list[dict[str, Any]] = []
    for name in args.scenarios:
        paces = {"one-job": [1.0], "same-pace": [1.0] * args.jobs, "different-paces": args.paces}[name]
        print(f"{name}: {len(paces)} job(s), {len(files)} images ({dataset_bytes / 1e6:.0f} MB), {args.epochs} "
              f"epochs", file=sys.stderr)
        run = run_scenario(name, paces, pace_s, files, src, store, data_work, args)
        runs.append(run)
        if run["error"] is None and name != "different-paces" and not args.pace_ms:
            pace_s = per_file_s(run) or pace_s  # same-pace's, where it ran, replaces one-job's
        meta["data_path"] = meta.get("data_path") or (run.get("mount") or {}).get("data_path")
        meta["pace_ms"] = pace_s * 1000
        (args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))  # a crash keeps what ran
    figures = [scenario_figures(r, dataset_bytes, args) for r in runs if r["error"] is None]
    meta["seconds"] = time.time() - started
    args.json.write_text(json.dumps({"meta": meta, "scenarios": figures, "runs": runs}, indent=1))
    print(markdown(figures, args, meta))
    print(f"\n(JSON {args.json}, {time.time() - started:.0f} s)")
    return 1 if any(r["error"] for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
