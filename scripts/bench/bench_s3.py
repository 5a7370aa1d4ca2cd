"""liquidfs over an object store vs s3fs, rclone and plain boto3: an unmodified DALI CPU pipeline, epoch by epoch.

    .venv/bin/python scripts/bench/bench_s3.py                    # 48 images, 3 rounds x 3 epochs, --ratio auto
    .venv/bin/python scripts/bench/bench_s3.py --smoke            # smoke test: 12 images, 1 round x 2 epochs
    .venv/bin/python scripts/bench/bench_s3.py --ratio 0.8 --all  # a fixed ratio; also liquidfs at ratio 0
    .venv/bin/python scripts/bench/bench_s3.py --dataset out/bench/data --keep

(as root: drop_caches needs it; the project VM runs everything as root.)

What it does:
1. starts a real S3 server (OpenStack Swift + s3api on 127.0.0.1, tests/support/s3server.py) under the work directory,
   makes the sample dataset (scripts/sample.py's make_sample, 2048x1024 PNG mosaics of real photos, seed 42) or
   takes --dataset, and uploads it to s3://bench/cs/ (keys = relative paths);
2. ``liquidfs prepare s3://bench/cs --store s3://bench/cs.liquid --ratio auto --quick`` (or --ratio R): the ratio
   the profiler chose and prepare's wall time are recorded;
3. measures each configuration in --repeats rounds; a round is: a fresh mount, ``sync; echo 3 >
   /proc/sys/vm/drop_caches``, then --epochs epochs back to back on that mount, each one run of
   scripts/bench/dali_epoch.py (fn.readers.file with random shuffle + fn.decoders.image, batch 16, threads = cores, one
   epoch = every image once, its own process). Epoch 1 of a round is cold everywhere: no FUSE/daemon cache, no page
   cache, and Swift's object files (on this machine's disk) are not in the page cache either, so the server side
   is cold too. Later epochs find Swift's files in the page cache (a "warm" server) and whatever the filesystem
   kept (liquidfs: its --cache-size 30% memory cache; rclone's capped disk cache in its own row; s3fs and plain
   rclone as configured below: nothing).
   Reported: the median of the rounds' epoch 1, and the median of all later epochs.
     liquidfs     mount s3://bench/cs --store s3://bench/cs.liquid --cache-size 30% --threads 8
     liquidfs r=0 (--all only) the same over a store prepared at --ratio 0: every image as the original PNG
     s3fs         on the original PNGs: s3fs defaults + ro (see S3FS_OPTIONS)
     rclone       on the original PNGs: rclone mount --read-only --vfs-cache-mode off --use-server-modtime
     rclone vfs-cache full 30%  the same with rclone's disk cache, capped at the share of the data liquidfs'
                  memory cache gets (see RCLONE_ARGS for why this row matters)
     boto3        no filesystem: this script's ``boto3-epoch`` subcommand (own process) GETs every object with
                  --threads concurrent get_object calls into memory and feeds the bytes to a DALI pipeline
                  (fn.external_source -> fn.decoders.image, same batch and threads); downloads and decoding
                  overlap (a window of batches is fetched ahead while DALI decodes).
   Also per epoch: the FUSE daemon's CPU time (/proc/PID/stat), Swift's CPU time, and the client requests and
   bytes Swift's proxy logged (how each client reads the store).
   With fewer images than a batch (--smoke: 12) the batch is the images, so that a run is one epoch.
4. prints a markdown table and writes JSON to --json and the table beside it (.md; default out/bench_s3.json,
   --smoke: out/bench_s3_smoke.json). The server, every mount and (unless --keep) the files it made are removed
   at the end, errors and ^C included.

Caveat worth keeping in mind when reading the numbers: the Swift servers run on the same (2) cores as the loader
and the FUSE daemon, so every byte served costs server CPU too; "Swift CPU ms/img" shows how much.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402  (dataset, mount, page cache, CPU seconds: one copy of each)
from _bench import REPO, SUBDIR  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "support"))  # s3server.py and its fusehelpers live with the tests

BUCKET = "bench"
PREFIX = "cs"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
LOADER_TIMEOUT = 900

# The competitors' settings, recorded in the JSON. The s3fs and rclone rows mount read-only and without any local
# data cache, so that a later epoch re-reads from the server (liquidfs' memory cache is the thing being measured);
# both are otherwise at their defaults, which suit whole-file sequential reads of 2-3 MB objects:
#  * s3fs 1.90 (the tests' helper adds ro, url, use_path_request_style, endpoint, passwd_file, logfile): no
#    use_cache (no disk cache; reads go to the server, through s3fs' own temporary file); parallel_count=5 and
#    multipart_size=10 (MB) only split downloads of objects of tens of MB, not these 2-3 MB images;
#    multireq_max=20 bounds the parallel HEADs of a directory listing (done at DALI's pipeline build, untimed);
#    the stat cache stays at its default. No kernel_cache, so the kernel drops a file's pages at each open.
#    Measured (--smoke): ~2 GETs and ~5 HEADs per image cold, ~1.4 and 2 later, each byte sent once.
#  * rclone (the helper adds --read-only --vfs-cache-mode off): --use-server-modtime, so a stat needs no HEAD
#    for rclone's mtime metadata (the listing's LastModified is used), as s3fs and liquidfs need none per read;
#    --vfs-read-chunk-size stays 128M (one ranged GET covers a whole image), --buffer-size 16M (in-memory
#    read-ahead per open file), --dir-cache-time 5m.
#    Gotcha: DALI's reads of a file are not sequential (rclone's debug log: the first 128 KiB, then a jump to the
#    file's last bytes, then back; more jumps when decoder threads interleave), and without a cache rclone answers
#    every jump with a new ranged GET from there to the end of the object: ~3-6 GETs and 1.2-3.5x the bytes per
#    image here, whatever --async-read=false, --vfs-read-wait 200ms or --buffer-size 0 say (tried); cat and a
#    sequential mmap read cost 1 GET per file. s3fs reads through a temporary file and is immune. Hence the extra
#    row with --vfs-cache-mode full, capped at the share liquidfs' cache gets: 1 GET per image.
S3FS_OPTIONS: tuple[str, ...] = ()
RCLONE_ARGS: tuple[str, ...] = ("--use-server-modtime",)
RCLONE_CACHE_SETTINGS = ("as rclone, but --vfs-cache-mode full (a disk cache under the work dir, new each round) "
                         "--vfs-cache-max-size {share} of the uploaded bytes --vfs-cache-poll-interval 1s")
S3FS_SETTINGS = "defaults + ro (no use_cache; parallel_count=5, multipart_size=10, multireq_max=20 as default)"
RCLONE_SETTINGS = ("--read-only --vfs-cache-mode off --use-server-modtime (defaults: --vfs-read-chunk-size 128M, "
                   "--buffer-size 16M, --dir-cache-time 5m)")


# -- small helpers ----------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_seconds_of(pids: list[int]) -> float:
    return sum(bench.cpu_seconds(pid) for pid in pids)


def images_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# -- dataset, server, prepare -----------------------------------------------------------------------------


def upload(client: Any, root: Path, threads: int) -> tuple[int, int]:
    """Every file of the tree as s3://BUCKET/PREFIX/<relative path>; returns (objects, bytes)."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()]
    client.create_bucket(Bucket=BUCKET)

    def put(path: Path) -> int:
        body = path.read_bytes()
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{path.relative_to(root).as_posix()}", Body=body)
        return len(body)

    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(put, files))
    return len(files), total


def prepare(env: dict[str, str], store: str, ratio: str, quick_profile: bool) -> dict[str, Any]:
    """``liquidfs prepare`` into ``store``; returns the ratio used (the profiler's choice for auto) and wall time."""
    args = ["prepare", f"s3://{BUCKET}/{PREFIX}", "--store", store, "--ratio", ratio, "--no-progress"]
    if ratio == "auto" and quick_profile:
        args.append("--quick")
    started = time.perf_counter()
    out = bench.liquidfs(*args, env=env, timeout=1800)
    seconds = time.perf_counter() - started
    chosen = re.search(r"profile chose ratio ([0-9.]+)", out)
    used = float(chosen.group(1)) if chosen else float(ratio)
    log(f"prepare {store} --ratio {ratio}{' --quick' if '--quick' in args else ''}: ratio {used:.2f}, "
        f"{seconds:.1f} s")
    return {"store": store, "ratio_arg": ratio, "quick_profile": "--quick" in args, "ratio": used,
            "seconds": seconds, "output": out.strip().splitlines()[-12:]}


# -- targets: what one epoch reads ------------------------------------------------------------------------


@dataclass
class Target:
    """One mounted (or not: boto3) configuration for the length of a round."""

    root: Path | None  # dataset root to read, None for boto3
    daemon_pid: int | None = None  # the FUSE daemon, for its CPU time
    stats: Callable[[], dict[str, Any]] | None = None  # liquidfs' counters
    notes: dict[str, Any] = field(default_factory=dict)


def find_pid(program: str, mountpoint: Path) -> int | None:
    """The process running ``program`` with ``mountpoint`` on its command line (s3fs daemonizes: no Popen)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == program.encode() and os.fsencode(mountpoint) in argv:
            return int(pid)
    return None


def wait_gone(pid: int | None, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while pid is not None and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def force_unmount(mnt: Path) -> None:
    """Last resort in a finally: a lazy unmount, so that nothing is left mounted whatever went wrong."""
    if bench.is_mounted(mnt):
        subprocess.run([bench.FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True, check=False)


@contextmanager
def liquidfs_mounted(env: dict[str, str], store: str, mnt: Path, threads: int,
                     cache_size: str) -> Iterator[Target]:
    mounted = None
    try:
        mounted = bench.mount(f"s3://{BUCKET}/{PREFIX}", store, mnt, "--cache-size", cache_size, "--threads",
                              str(threads), env=env, timeout=300)

        def stats() -> dict[str, Any]:
            return json.loads(bench.liquidfs("stats", str(mnt), "--json", env=env, timeout=60))

        yield Target(mnt, mounted.pid, stats)
    finally:
        if mounted is not None:
            mounted.close(check=False)  # waits for the daemon to exit; a failure is printed, the mount detached
        force_unmount(mnt)
        wait_gone(mounted.pid if mounted else None)


@contextmanager
def s3fs_mounted(server: Any, mnt: Path) -> Iterator[Target]:
    from s3server import mount_s3fs, unmount

    mnt.mkdir(parents=True, exist_ok=True)
    pid = None
    try:
        mount_s3fs(server, BUCKET, mnt, *S3FS_OPTIONS)
        pid = find_pid("s3fs", mnt)
        yield Target(mnt / PREFIX, pid)  # the whole bucket is mounted; the dataset is its cs/ prefix
    finally:
        try:
            unmount(mnt)
        finally:
            force_unmount(mnt)
            wait_gone(pid)  # s3fs' daemon exits by itself once unmounted


@contextmanager
def rclone_mounted(server: Any, mnt: Path, cache_bytes: int | None = None) -> Iterator[Target]:
    """rclone mount without a data cache, or (cache_bytes) with its VFS disk cache capped at that size; the cache
    directory is new for each mount, so that epoch 1 is cold, and removed after."""
    from s3server import mount_rclone, unmount

    mnt.mkdir(parents=True, exist_ok=True)
    extra = list(RCLONE_ARGS)
    cache_dir = mnt.parent / f"rclone-vfs-cache-{mnt.name}"
    if cache_bytes is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)
        extra += rclone_cache_args(cache_dir, cache_bytes)
    proc = None
    try:
        proc = mount_rclone(server, BUCKET, mnt, *extra)
        yield Target(mnt / PREFIX, proc.pid)
    finally:
        try:
            unmount(mnt, proc)
        finally:
            force_unmount(mnt)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
            shutil.rmtree(cache_dir, ignore_errors=True)


def rclone_cache_args(cache_dir: Path, cache_bytes: int) -> list[str]:
    # A bare number is KiB to rclone. The cap is enforced only when the cache is polled (default every 1 m, longer
    # than a round here, which would let the cache hold everything): poll every second.
    return ["--vfs-cache-mode", "full", "--cache-dir", str(cache_dir), "--vfs-cache-max-size",
            f"{max(1, cache_bytes // 1024)}K", "--vfs-cache-poll-interval", "1s"]


@contextmanager
def boto3_target() -> Iterator[Target]:
    yield Target(None)


# -- one epoch --------------------------------------------------------------------------------------------


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=LOADER_TIMEOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def dali_epoch(root: Path, images: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    return run_json([sys.executable, str(bench.DALI_EPOCH), str(root / SUBDIR), "--images", str(images),
                     "--batch", str(args.batch), "--threads", str(args.loader_threads), "--seed", str(seed)])


def boto3_epoch_cmd(images: int, seed: int, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    return run_json([sys.executable, str(Path(__file__).resolve()), "boto3-epoch", "--images", str(images),
                     "--batch", str(args.batch), "--threads", str(args.loader_threads), "--pool", str(args.threads),
                     "--seed", str(seed)], env=env)


@dataclass
class ServerWatch:
    """Swift's side of an epoch: its processes' CPU time, and the S3 requests its proxy logged (one line per
    client request, with method, path, status and bytes sent), which shows how each client reads."""

    pids: list[int]
    proxy_log: Path

    def mark(self) -> tuple[float, int]:
        return cpu_seconds_of(self.pids), self.proxy_log.stat().st_size

    def since(self, mark: tuple[float, int]) -> dict[str, Any]:
        cpu0, offset = mark
        with open(self.proxy_log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        gets = heads = lists = other = sent = 0
        for line in text.splitlines():
            fields = line.split()
            # "proxy-server: CLIENT REMOTE DATE METHOD PATH PROTO STATUS REFERER AGENT TOKEN RECVD SENT ..."; the
            # proxy's own subrequests (client "-") and non-request lines are left out.
            if len(fields) < 13 or fields[0] != "proxy-server:" or fields[1] == "-" or not fields[7].isdigit():
                continue
            method, path = fields[4], fields[5]
            if method == "GET" and ("?" in path or path.count("/") < 2):
                lists += 1
            elif method == "GET":
                gets += 1
            elif method == "HEAD":
                heads += 1
            else:
                other += 1
            sent += int(fields[12]) if fields[12].isdigit() else 0
        return {"server_cpu_s": cpu_seconds_of(self.pids) - cpu0, "s3_gets": gets, "s3_heads": heads,
                "s3_lists": lists, "s3_other": other, "s3_bytes_sent": sent}


def measure_round(name: str, target: Target, images: int, image_bytes: int, rnd: int, server: ServerWatch,
                  args: argparse.Namespace, s3_env: dict[str, str]) -> list[dict[str, Any]]:
    """The round's epochs back to back on one target: page cache dropped before the first only (the loader's
    files and Swift's object files alike: same disk, same kernel)."""
    bench.drop_caches()
    epochs = []
    for epoch in range(1, args.epochs + 1):
        seed = 100 * rnd + epoch  # the same orders for every configuration
        d0 = bench.cpu_seconds(target.daemon_pid) if target.daemon_pid else None
        st0 = target.stats() if target.stats else None
        mark = server.mark()
        if target.root is None:
            result = boto3_epoch_cmd(images, seed, args, s3_env)
        else:
            result = dali_epoch(target.root, images, seed, args)
        result.update(server.since(mark))
        if d0 is not None and target.daemon_pid:
            result["daemon_cpu_s"] = bench.cpu_seconds(target.daemon_pid) - d0
        if st0 is not None and target.stats:
            st1 = target.stats()
            result["served_bytes"] = (st1["bytes_from_memory"] + st1["bytes_from_storage"]
                                      - st0["bytes_from_memory"] - st0["bytes_from_storage"])
            result["bytes_from_memory"] = st1["bytes_from_memory"] - st0["bytes_from_memory"]
            result["bytes_from_storage"] = st1["bytes_from_storage"] - st0["bytes_from_storage"]
            result["cache_hits"] = st1.get("cache_hits", 0) - st0.get("cache_hits", 0)
        elif target.root is not None:
            # s3fs and rclone count nothing themselves: an epoch serves every image once.
            result["served_bytes"] = image_bytes
        result.update(round=rnd, epoch=epoch, seed=seed)
        epochs.append(result)
        log(f"  {name:<14} round {rnd} epoch {epoch}: {result['images_per_s']:6.1f} img/s"
            + (f", daemon {result['daemon_cpu_s']:.2f} CPU-s" if "daemon_cpu_s" in result else "")
            + f", Swift {result['server_cpu_s']:.2f} CPU-s, {result['s3_gets']} GET {result['s3_heads']} HEAD "
            f"{result['s3_lists']} LIST, {result['s3_bytes_sent'] / 1e6:.0f} MB sent")
    return epochs


def measure(name: str, mounted: Callable[[], Any], images: int, image_bytes: int, server: ServerWatch,
            args: argparse.Namespace, s3_env: dict[str, str]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    final_stats = []
    for rnd in range(1, args.repeats + 1):
        with mounted() as target:
            runs += measure_round(name, target, images, image_bytes, rnd, server, args, s3_env)
            if target.stats:
                keep = ("bytes_from_memory", "bytes_from_storage", "cache_hits", "cache_hit_bytes", "cache_misses",
                        "cache_share", "cache_held_bytes", "opens", "opens_raw", "fallbacks", "errors", "epochs")
                st = target.stats()
                final_stats.append({k: st[k] for k in keep if k in st})
    return summarize(name, runs, final_stats)


def summarize(name: str, runs: list[dict[str, Any]], final_stats: list[dict[str, Any]]) -> dict[str, Any]:
    first = [r for r in runs if r["epoch"] == 1]
    later = [r for r in runs if r["epoch"] > 1]

    def per_image(key: str, rows: list[dict[str, Any]]) -> float | None:
        return median([1000 * r[key] / r["images"] for r in rows if key in r])

    def per_gb(rows: list[dict[str, Any]]) -> float | None:
        return median([r["daemon_cpu_s"] / (r["served_bytes"] / 1e9) for r in rows
                       if r.get("daemon_cpu_s") is not None and r.get("served_bytes")])

    def per_request(rows: list[dict[str, Any]]) -> float | None:
        return median([(r["s3_gets"] + r["s3_heads"] + r["s3_lists"] + r["s3_other"]) / r["images"] for r in rows])

    return {
        "config": name,
        "img_s_epoch1": median([r["images_per_s"] for r in first]),
        "img_s_later": median([r["images_per_s"] for r in later]),
        "loader_cpu_ms_per_img_epoch1": per_image("loader_cpu_s", first),
        "loader_cpu_ms_per_img_later": per_image("loader_cpu_s", later),
        "daemon_cpu_ms_per_img_epoch1": per_image("daemon_cpu_s", first),
        "daemon_cpu_ms_per_img_later": per_image("daemon_cpu_s", later),
        "daemon_cpu_s_per_gb_epoch1": per_gb(first),
        "daemon_cpu_s_per_gb_later": per_gb(later),
        "swift_cpu_ms_per_img_epoch1": per_image("server_cpu_s", first),
        "swift_cpu_ms_per_img_later": per_image("server_cpu_s", later),
        "s3_requests_per_img_epoch1": per_request(first),
        "s3_requests_per_img_later": per_request(later),
        "s3_mb_sent_per_img_epoch1": median([r["s3_bytes_sent"] / 1e6 / r["images"] for r in first]),
        "s3_mb_sent_per_img_later": median([r["s3_bytes_sent"] / 1e6 / r["images"] for r in later]),
        "runs_epoch1": [round(r["images_per_s"], 2) for r in first],
        "runs_later": [round(r["images_per_s"], 2) for r in later],
        "liquidfs_stats_at_round_end": final_stats or None,
        "epochs": runs,
    }


# -- the boto3 baseline (its own process, like dali_epoch.py) ---------------------------------------------


def boto3_epoch(args: argparse.Namespace) -> None:
    """GET every image object with a pool of ``--pool`` threads and decode the bytes with DALI, overlapped: a
    window of batches is downloading while DALI decodes the previous ones. Credentials and endpoint come from
    the AWS_* environment. Prints a JSON line shaped like dali_epoch.py's."""
    import boto3
    import numpy as np
    from botocore.config import Config

    from liquidfs.profile.loaders import dali_pipeline, dali_run

    client = boto3.session.Session().client("s3", config=Config(
        max_pool_connections=args.pool, s3={"addressing_style": "path"},
        retries={"max_attempts": 5, "mode": "standard"}))
    prefix = f"{PREFIX}/{SUBDIR.as_posix()}/"
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", ()) if o["Key"].lower().endswith(IMAGE_SUFFIXES)]
    random.Random(args.seed).shuffle(keys)  # like fn.readers.file's random_shuffle: a new order each epoch
    keys = keys[:args.images]
    pool = ThreadPoolExecutor(args.pool)
    pending: deque[Future[np.ndarray]] = deque()
    submitted = 0
    downloaded = 0
    # Ahead of the batch being fed: enough for the pool to stay busy and for DALI's prefetch queue (depth 2).
    window = max(3 * args.batch, 2 * args.pool)

    def fetch(key: str) -> np.ndarray:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        return np.frombuffer(body, dtype=np.uint8)

    def top_up() -> None:
        nonlocal submitted
        while submitted < len(keys) and len(pending) < window:
            pending.append(pool.submit(fetch, keys[submitted]))
            submitted += 1

    def batches() -> Iterator[list[np.ndarray]]:
        nonlocal downloaded
        left = len(keys)
        while left:
            top_up()
            batch = [pending.popleft().result() for _ in range(min(args.batch, left))]
            left -= len(batch)
            downloaded += sum(b.size for b in batch)
            top_up()
            yield batch

    p = dali_pipeline(source=batches(), batch=args.batch, threads=args.threads, seed=args.seed)
    # As in dali_epoch.py, timed from the first run: the pipeline pulls (and so starts the downloads) only then.
    run = dali_run(p, len(keys), count_bytes=True)
    pool.shutdown(wait=True)
    print(json.dumps({"images": run.images, "seconds": run.seconds, "images_per_s": run.images / run.seconds,
                      "loader_cpu_s": run.cpu_seconds, "bytes_decoded": run.decoded_bytes,
                      "bytes_downloaded": downloaded}))


# -- output -----------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: str = ".1f") -> str:
    return "" if value is None else format(value, digits)


def pair(row: dict[str, Any], key: str, digits: str = ".1f") -> str:
    """'epoch 1 / later epochs' of one measure."""
    first, later = fmt(row[key + "_epoch1"], digits), fmt(row[key + "_later"], digits)
    return f"{first} / {later}" if first or later else ""


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def markdown(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["config"] == "s3fs"), None)

    def ratio(r: dict[str, Any], key: str) -> str:
        if not base or not base.get(key) or r.get(key) is None:
            return ""
        return f"{r[key] / base[key]:.2f}"

    lines = [("| configuration | img/s epoch 1 | img/s later epochs | x s3fs epoch 1 | x s3fs later | "
              "loader CPU ms/img | FUSE daemon CPU ms/img | daemon CPU-s/GB | Swift CPU ms/img | S3 requests/img | "
              "MB sent/img |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {fmt(r['img_s_epoch1'])} | {fmt(r['img_s_later'])} | "
                     f"{ratio(r, 'img_s_epoch1')} | {ratio(r, 'img_s_later')} | {pair(r, 'loader_cpu_ms_per_img')} | "
                     f"{pair(r, 'daemon_cpu_ms_per_img')} | {pair(r, 'daemon_cpu_s_per_gb', '.2f')} | "
                     f"{pair(r, 'swift_cpu_ms_per_img')} | {pair(r, 's3_requests_per_img', '.2f')} | "
                     f"{pair(r, 's3_mb_sent_per_img', '.2f')} |")
    lines.append("")
    lines.append("Columns with two figures: epoch 1 / later epochs (medians). Epoch 1: page cache dropped, so Swift's object "
                 "files are cold too; later epochs: Swift's files in the page cache, liquidfs with its memory cache, "
                 "rclone vfs-cache full with its disk cache capped at the same share, s3fs and rclone without "
                 "data cache. boto3: GETs into memory + DALI decode (no FUSE "
                 "daemon; its loader CPU includes the downloads). S3 requests and MB sent: client requests in Swift's "
                 "proxy log during the epoch (GET, HEAD, LIST), per image decoded.")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, help="images to generate (default 48, --smoke 12); with --dataset: "
                        "every image found is used")
    parser.add_argument("--dataset", type=Path, help="use this tree (leftImg8bit/train/...) instead of a sample")
    parser.add_argument("--repeats", type=int, help="rounds per configuration (fresh mount, cold epoch 1; "
                        "default 3, --smoke 1)")
    parser.add_argument("--epochs", type=int, help="epochs per round, back to back (default 3, --smoke 2)")
    parser.add_argument("--ratio", default="auto", help="prepare's --ratio: 'auto' (profiled with --quick unless "
                        "--full-profile) or a number 0..1 (default auto)")
    parser.add_argument("--full-profile", action="store_true", help="with --ratio auto: the full profile")
    parser.add_argument("--threads", type=int, default=8, help="storage requests in flight: liquidfs --threads "
                        "and the boto3 baseline's pool (default 8)")
    parser.add_argument("--cache-size", default="30%", help="liquidfs --cache-size (default 30%%)")
    parser.add_argument("--loader-threads", type=int, default=os.cpu_count() or 2,
                        help="DALI threads (default: cores)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--all", action="store_true", help="also liquidfs at ratio 0 (all PNG through liquidfs)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (dataset, server data, logs)")
    bench.add_run_arguments(parser, results="out/bench_s3.json, --smoke out/bench_s3_smoke.json; the table beside "
                            "it as .md", work=REPO / "out" / "bench_s3_work",
                            work_help="the dataset, the server's data, the mountpoints and logs: what this run makes "
                            "there is removed at the end, unless --keep",
                            smoke="12 images, 1 round of 2 epochs")
    args = parser.parse_args(argv)
    args.images = args.images or (12 if args.smoke else 48)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.epochs = args.epochs or (2 if args.smoke else 3)
    args.json = (args.json or REPO / "out" / ("bench_s3_smoke.json" if args.smoke else "bench_s3.json")).absolute()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (epoch 1 is cold, later epochs are reported apart)")
    if args.ratio != "auto" and not re.fullmatch(r"(0(\.[0-9]*)?|1(\.0*)?)", args.ratio):
        parser.error("--ratio: 'auto' or a number from 0 to 1")  # now, not after minutes of setup
    if not re.fullmatch(r"[0-9.]+%", args.cache_size):
        parser.error("--cache-size: a percentage here (rclone's cache gets the same share)")
    args.work = args.work.absolute()
    return args


def boto3_epoch_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_s3.py boto3-epoch")
    parser.add_argument("--images", type=int, required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="DALI threads")
    parser.add_argument("--pool", type=int, default=8, help="concurrent get_object calls")
    parser.add_argument("--seed", type=int, default=0)
    boto3_epoch(parser.parse_args(argv))


def cleanup(work: Path, made: list[Path], keep: bool) -> None:
    """Remove only what this run made (never a --work that held other things), and never a live mount."""
    mounts = [p for p in work.glob("mnt-*") if bench.is_mounted(p)]
    if mounts:
        log(f"NOT removing {work}: still mounted: {mounts}")
        return
    if keep:
        log(f"kept {work}")
        return
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
    for path in [*work.glob("mnt-*"), work]:
        try:
            path.rmdir()
        except OSError:
            pass  # not empty: not (only) ours


def run(args: argparse.Namespace) -> dict[str, Any]:
    from s3server import SwiftS3Server

    started = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    xdg = args.work / "xdg-cache"
    shutil.rmtree(xdg, ignore_errors=True)  # a fresh liquidfs work dir: the catalog is fetched from the store
    made.append(xdg)
    if args.dataset:
        src = args.dataset.absolute()
    else:
        src = bench.dataset(args.work, args.images, 2048, 1024)
        made.append(src)
    files = images_under(src / SUBDIR)
    if not files:
        raise SystemExit(f"no images under {src / SUBDIR}")
    images = len(files)
    image_bytes = sum(p.stat().st_size for p in files)
    args.batch = min(args.batch, images)  # else a run of dali_epoch.py decodes a whole batch: more than an epoch
    server = SwiftS3Server(args.work)
    try:
        server.start()
        log(f"Swift S3 on {server.endpoint} (started in {server.startup_seconds:.1f} s, data in {server.root})")
        s3_env = {**os.environ, **server.env()}
        env = {**s3_env, "XDG_CACHE_HOME": str(xdg)}
        objects, total = upload(server.client(), src, args.threads)
        # rclone's disk cache gets the share of the dataset that liquidfs' memory cache gets (of the originals,
        # which are what rclone serves; liquidfs' share is of the dataset as served, larger with raw images).
        rclone_cache_bytes = int(total * float(args.cache_size.rstrip("%")) / 100)
        log(f"uploaded {objects} objects, {total / 1e6:.0f} MB to s3://{BUCKET}/{PREFIX}/")
        preps = [prepare(env, f"s3://{BUCKET}/{PREFIX}.liquid", args.ratio, not args.full_profile)]
        if args.all:
            preps.append(prepare(env, f"s3://{BUCKET}/{PREFIX}.liquid0", "0", False))
        watch = ServerWatch([p.pid for p in server.procs.values()], server.log_dir / "proxy.log")
        configs: list[tuple[str, Callable[[], Any]]] = [
            (f"liquidfs r={preps[0]['ratio']:.2f}", lambda: liquidfs_mounted(
                env, preps[0]["store"], args.work / "mnt-liquidfs", args.threads, args.cache_size))]
        if args.all:
            configs.append(("liquidfs r=0", lambda: liquidfs_mounted(
                env, preps[1]["store"], args.work / "mnt-liquidfs0", args.threads, args.cache_size)))
        configs += [("s3fs", lambda: s3fs_mounted(server, args.work / "mnt-s3fs")),
                    ("rclone", lambda: rclone_mounted(server, args.work / "mnt-rclone")),
                    (f"rclone vfs-cache full {args.cache_size}", lambda: rclone_mounted(
                        server, args.work / "mnt-rclone-cache", rclone_cache_bytes)),
                    (f"boto3 ({args.threads} GETs in flight)", boto3_target)]
        rows = []
        for name, mounted in configs:
            log(f"{name}:")
            rows.append(measure(name, mounted, images, image_bytes, watch, args, s3_env))
    finally:
        server.stop(keep_dir=args.keep)
        cleanup(args.work, made, args.keep)
    meta = {
        "argv": sys.argv, "started": started, "seconds": time.time() - started, "images": images,
        "image_bytes": image_bytes, "dataset": str(src), "generated": not args.dataset, "repeats": args.repeats,
        "epochs_per_round": args.epochs, "batch": args.batch, "loader_threads": args.loader_threads,
        "requests_in_flight": args.threads, "cache_size": args.cache_size, "prepare": preps,
        "server": "OpenStack Swift s3api on 127.0.0.1 (tests/support/s3server.py), same machine and cores as the loader",
        "cold": "epoch 1 of each round: fresh mount, page cache dropped (sync; echo 3 > drop_caches), so Swift's "
                "object files are cold on the server side too; later epochs: Swift's files in the page cache",
        "liquidfs": f"mount --cache-size {args.cache_size} --threads {args.threads}",
        "s3fs": S3FS_SETTINGS, "s3fs_extra_options": list(S3FS_OPTIONS),
        "rclone": RCLONE_SETTINGS, "rclone_extra_args": list(RCLONE_ARGS),
        "rclone_vfs_cache_full": RCLONE_CACHE_SETTINGS.format(share=args.cache_size),
        "boto3": f"{args.threads} concurrent get_object into memory, fn.external_source -> fn.decoders.image; "
                 "downloads overlap decoding; loader CPU includes the downloads",
        "dali": f"scripts/bench/dali_epoch.py: fn.readers.file random_shuffle + fn.decoders.image cpu, batch "
                f"{args.batch}, {args.loader_threads} threads, pipeline built (files listed) before the clock starts",
    }
    return {"meta": meta, "rows": rows}


def main() -> int:
    if sys.argv[1:2] == ["boto3-epoch"]:
        boto3_epoch_main(sys.argv[2:])
        return 0
    args = parse_args()
    # SIGTERM (e.g. timeout(1)) must run the finally blocks too: unmount, stop the server.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    result = run(args)
    table = markdown(result["rows"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    header = (f"{result['meta']['images']} images, {result['meta']['repeats']} round(s) x "
              f"{result['meta']['epochs_per_round']} epochs, liquidfs ratio "
              f"{result['meta']['prepare'][0]['ratio']:.2f} (--ratio {args.ratio}; prepare "
              f"{result['meta']['prepare'][0]['seconds']:.0f} s)\n\n")
    args.json.with_suffix(".md").write_text(header + table + "\n")
    print(header + table)
    print(f"\n(JSON {args.json}, table {args.json.with_suffix('.md')}, "
          f"{result['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
