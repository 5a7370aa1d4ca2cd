"""Many nodes, one dataset (issue 29, "Measured, side by side"): N simulated nodes on this machine, each its own
mount of one source and store with its own --cache-size, reading rank r's share of every epoch at once; no
cache, per-node caches, and the cluster level on memcached, with and without a memcached killed mid-run.

    python scripts/bench/bench_cluster.py [--images 2048] [--size 512x256] [--nodes 4] [--epochs 6]
        [--cache-size 10] [--cap-mb 200] [--configs none,per-node,cluster,cluster-kill] [--repeats 3]
        [--json out/bench/cluster.json]
    python scripts/bench/bench_cluster.py --smoke      # 16 tiny images, 2 nodes, 2 epochs, < 1 min
    python scripts/bench/bench_cluster.py --sealing-only [--sealing-size BYTES]   # the sealing's cost alone

Configurations (each on fresh mounts and, where it has them, fresh empty memcacheds):
    none          no --cache-size: every read is a storage read
    per-node      --cache-size C% on every node: its own next-epoch cache, nothing shared
    cluster       --cache-size C% plus --cluster memcached://(all N) --cluster-size N x C%: the memcacheds together
                  hold N x C of the dataset (a fixed share of the raw objects, the same on every node)
    cluster-kill  as cluster; memcached 0 is killed (SIGKILL) as epoch --kill-at starts and started again, empty,
                  before epoch --restart-at

The nodes: N processes, one per mount, in step (a barrier between epochs). Every epoch is one seeded permutation
of the images, the same on every node, and node r reads its share of it (--shard contiguous: the r-th quarter,
as DALI's shard_id/num_shards; strided: every N-th). The loader is plain Python, one whole-file read per image,
each checked against the sha256 of what the mount must serve (the raw object or the original); a mismatch counts
its differing bytes. After every window of --window reads the node reads its mount's statistics
(liquidfs.daemon.control.read_control), so each window's bytes are known to come from the node's memory, the cluster or
storage; with --per-file (the smoke run's) after every file, which also tells the cluster hits on files a peer
read last epoch (``peer_hits``), at ~3 ms of the daemon's CPU per file here.

Storage is the machine's disk behind a cgroup v1 blkio cap (--cap-mb for all readers together): the daemons and
the node processes are in the group (with FUSE passthrough the kernel reads a backing file in the reader's
context). The page cache is dropped before every configuration and every epoch: on N machines a file one node
read last epoch is a storage read for another, which one machine's shared page cache would hide.

Figures per node and per epoch: hit ratio (bytes from the node's memory + the cluster over bytes read), bytes
from storage (the mount's count: bytes_from_storage; a cluster hit is bytes_from_cluster), bytes from
peers (the cluster's hits), disk bytes (the block layer's: daemons' and nodes' /proc/PID/io), images/s (files
over the epoch's time, barrier to barrier; per node, over its own), failed reads, wrong bytes. Goals printed
beside them (issue 29): cluster hit ratio per window >= 0.95 x min(1, N x C / D); storage bytes per epoch
falling by that share; 0 failed reads and 0 wrong bytes through the kill. Needs root on Linux (drop_caches, blkio) and memcached.

The cluster configurations seal every value under a cluster key (``--cluster-key-file``, issue 38), as a job's
mounts are deployed. What sealing costs is measured apart, on one core (CPU time of this process, never the
mounts'): MB/s to seal a value of the dataset's mean raw-object size and to open one, the catalog's checksum of
the opened bytes (which a fetch also checks), and the bytes sealing adds to every value; in the table and the JSON
(``summary.sealing``). ``--sealing-only`` measures just that (no root, no mounts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402  (dataset, stores, mounts, page cache: one copy of each)
import _throttle  # noqa: E402
from liquidfs.catalog.catalog import Catalog  # noqa: E402
from liquidfs.catalog.identity import checksum  # noqa: E402
from liquidfs.held.sealing import KEY_BYTES, ClusterKey, Sealer  # noqa: E402

CONFIGS = ("none", "per-node", "cluster", "cluster-kill")
GOAL = 0.95  # of min(1, N x C / D): the cluster's hit ratio per window, and the storage bytes it saves
VICTIM = 0  # the memcached cluster-kill kills


# -- memcached ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A port nothing listens on now (as tests/support/ports.py: bound once and let go)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memcached_ask(port: int, command: bytes, end: bytes = b"\r\n", timeout: float = 1.0) -> bytes:
    """One command of memcached's text protocol, its answer read up to ``end``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(command)
        answer = b""
        while not answer.endswith(end):
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            answer += chunk
        return answer


class Memcached:
    """One memcached on 127.0.0.1 (as a node runs one beside its mount), started and killed by the benchmark."""

    def __init__(self, binary: str, memory_mb: int, item_max: str) -> None:
        self.binary, self.memory_mb, self.item_max = binary, memory_mb, item_max
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # -I: items over 1 MB; -U 0: no UDP; -u root: memcached refuses to run as root otherwise
        self.proc = subprocess.Popen([self.binary, "-l", "127.0.0.1", "-p", str(self.port), "-U", "0",
                                      "-m", str(self.memory_mb), "-I", self.item_max, "-u", "root"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if memcached_ask(self.port, b"version\r\n").startswith(b"VERSION"):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"memcached on port {self.port} did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stats(self) -> dict[str, int] | None:
        """What it holds and has thrown out (None while it is down)."""
        try:
            answer = memcached_ask(self.port, b"stats\r\n", b"END\r\n").decode()
        except OSError:
            return None
        values = dict(line.split()[1:3] for line in answer.splitlines() if line.startswith("STAT "))
        keep = ("curr_items", "bytes", "evictions", "get_hits", "get_misses", "limit_maxbytes")
        return {k: int(values[k]) for k in keep if k in values}


def item_max(largest: int) -> str:
    """memcached's -I for the largest object: a power of two MB, 1m at least."""
    mb = 1
    while mb * (1 << 20) < largest + 4096:  # the item header and key beside the value
        mb *= 2
    return f"{mb}m"


# -- the dataset as the mount must serve it ------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    rel: str  # path inside the mount
    size: int
    sha256: str
    where: str  # the file holding those bytes: the raw object in the store, or the original


def expected_files(src: Path, store: Path) -> tuple[list[Expected], int]:
    """Every image the mount serves, with the digest of what it must serve, and the raw objects' bytes."""
    catalog = Catalog.open(store, readonly=True)
    try:
        nodes = [n for n in catalog.files() if os.fsdecode(n.path).startswith(str(bench.SUBDIR) + "/")]
        raw_bytes = catalog.raw_bytes()
    finally:
        catalog.close()
    out = []
    for node in nodes:
        rel = os.fsdecode(node.path)
        where = store / str(node.object) if node.served_raw else src / rel
        data = where.read_bytes()
        out.append(Expected(rel, len(data), hashlib.sha256(data).hexdigest(), str(where)))
    out.sort(key=lambda e: e.rel)
    return out, raw_bytes


def epoch_order(files: int, seed: int, epoch: int) -> list[int]:
    """The epoch's permutation of the file indexes: the same on every node (one seed for the job)."""
    order = list(range(files))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def share_of(order: list[int], rank: int, nodes: int, shard: str) -> list[int]:
    """Rank ``rank``'s files of an epoch's order: DALI's shard (contiguous, sizes differing by one at most) or
    every ``nodes``-th (strided, as DistributedSampler)."""
    if shard == "strided":
        return order[rank::nodes]
    n = len(order)
    return order[rank * n // nodes:(rank + 1) * n // nodes]


# -- one node: a process reading its share of each epoch through its own mount --------------------------------


@dataclass
class NodeJob:
    rank: int
    nodes: int
    mnt: str
    daemon_pid: int
    epochs: int
    seed: int
    shard: str
    window: int
    files: list[Expected]
    timeout: float
    per_file: bool  # read the mount's statistics after every file, not every window


def counters(mnt: Path) -> tuple[int, int, int, int, int, int]:
    """(bytes served from the node's held memory, cluster hits, their bytes, bytes from storage, errors, reads the
    next-epoch cache took for retries) of the mount so far. Memory is what the mount served from held bytes, not
    the cache's hit count: a read the cache takes for a retry in the same epoch (``cache_same_epoch_reads``)
    counts neither as a hit nor a miss, whichever it was."""
    st = bench.control(mnt)
    return (int(st.get("bytes_from_memory", 0)), int(st.get("cluster_hits", 0)), int(st.get("cluster_hit_bytes", 0)),
            int(st.get("bytes_from_storage", 0)), int(st.get("errors", 0)), int(st.get("cache_same_epoch_reads", 0)))


def wrong_bytes(data: bytes, want: Expected) -> int:
    """How many bytes of ``data`` differ from what the mount must serve (a length difference counts whole)."""
    good = Path(want.where).read_bytes()
    same = min(len(data), len(good))
    return sum(a != b for a, b in zip(data[:same], good[:same])) + abs(len(data) - len(good))


def new_window() -> dict[str, int]:
    return {"files": 0, "bytes": 0, "memory_hits": 0, "memory_bytes": 0, "cluster_hits": 0, "cluster_bytes": 0,
            "storage_bytes": 0}


def node_main(job: NodeJob, barrier: Barrier, results: Any) -> None:
    """The node process: per epoch, wait for the driver, read this rank's share, report, wait again."""
    try:
        node_epochs(job, barrier, results)
    except BaseException:
        barrier.abort()  # the driver and the other nodes stop waiting for this one at once
        raise


def node_epochs(job: NodeJob, barrier: Barrier, results: Any) -> None:
    mnt = Path(job.mnt)
    for epoch in range(1, job.epochs + 1):
        barrier.wait(timeout=job.timeout)
        order = epoch_order(len(job.files), job.seed, epoch)
        mine = share_of(order, job.rank, job.nodes, job.shard)
        # who read each file last epoch: a cluster hit on a file a peer read is the peer's storage read saved
        last_reader: dict[int, int] = {}
        if epoch > 1:
            before = epoch_order(len(job.files), job.seed, epoch - 1)
            for r in range(job.nodes):
                last_reader.update((f, r) for f in share_of(before, r, job.nodes, job.shard))
        out: dict[str, Any] = {"rank": job.rank, "epoch": epoch, "failed": 0, "wrong_files": 0, "wrong_bytes": 0,
                               "peer_hits": 0 if job.per_file else None, "peer_bytes": 0 if job.per_file else None,
                               "errors": 0, "cache_retries": 0, **new_window()}
        if not job.per_file:
            out["memory_hits"] = None  # counted per file only: per window the bytes say it
        windows: list[dict[str, int]] = []
        window = new_window()
        io0, daemon_io0 = bench.io_read_bytes(os.getpid()), bench.io_read_bytes(job.daemon_pid)
        stats_s = 0.0
        prev = counters(mnt)
        started = time.perf_counter()
        for i, index in enumerate(mine, 1):
            want = job.files[index]
            try:
                with open(mnt / want.rel, "rb") as f:
                    data = f.read()
            except OSError as exc:
                out["failed"] += 1
                print(f"node {job.rank}: {want.rel}: {exc}", file=sys.stderr)
                data = None
            if data is not None:
                if hashlib.sha256(data).hexdigest() != want.sha256:
                    out["wrong_files"] += 1
                    out["wrong_bytes"] += wrong_bytes(data, want)
                for w in (out, window):
                    w["files"] += 1
                    w["bytes"] += len(data)
            if not (job.per_file or window["files"] == job.window or i == len(mine)):
                continue
            t = time.perf_counter()
            now = counters(mnt)
            stats_s += time.perf_counter() - t
            mem_b, clu, clu_b, storage, errors, retries = (x - y for x, y in zip(now, prev))
            prev = now
            for w in (out, window):
                w["memory_bytes"] += mem_b
                w["cluster_hits"] += clu
                w["cluster_bytes"] += clu_b
                w["storage_bytes"] += storage
            out["errors"] += errors
            out["cache_retries"] += retries
            if job.per_file and data is not None:
                out["memory_hits"] += mem_b > 0
                window["memory_hits"] += mem_b > 0
                if clu and last_reader.get(index, job.rank) != job.rank:
                    out["peer_hits"] += 1
                    out["peer_bytes"] += clu_b
            if window["files"] == job.window:
                windows.append(window)
                window = new_window()
        elapsed = time.perf_counter() - started
        out.update(seconds=elapsed, stats_s=stats_s, windows=windows,
                   partial_window=window if window["files"] else None, images_per_s=out["files"] / elapsed,
                   disk_bytes=bench.io_read_bytes(os.getpid()) - io0 + bench.io_read_bytes(job.daemon_pid) - daemon_io0)
        results.put(out)
        barrier.wait(timeout=job.timeout)


# -- one configuration -----------------------------------------------------------------------------------------


@dataclass
class Run:
    config: str
    repeat: int
    mount_args: list[str]
    epochs: list[dict[str, Any]] = field(default_factory=list)
    data_path: str | None = None
    memcached_mb: int | None = None
    error: str | None = None


def mount_flags(config: str, args: argparse.Namespace, url: str | None) -> list[str]:
    flags: list[str] = []
    if config != "none":
        flags += ["--cache-size", f"{args.cache_size:g}%"]
    if config.startswith("cluster"):
        assert url is not None
        flags += ["--cluster", url, "--cluster-size", f"{args.cluster_size:g}%", "--cluster-key-file",
                  str(cluster_key(args.work))]
    return flags


def cluster_key(work: Path) -> Path:
    """The job's cluster key, as a deployment makes it: 32 random bytes, mode 0400 (made once per work dir)."""
    path = work / "cluster.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as out:
            out.write(os.urandom(KEY_BYTES))
    return path


def sealing_cost(size: int, seconds: float = 1.0) -> dict[str, float]:
    """What sealing a value of ``size`` bytes costs on one core: MB/s to seal, to open, to check the opened bytes
    against the catalog's checksum; and the bytes it adds. CPU time of this thread, each for about ``seconds``."""
    sealer = Sealer(ClusterKey(os.urandom(KEY_BYTES)))
    data = os.urandom(size)
    identity = f"liquidfs2s-00000000:{'0' * 16}:{size}".encode()
    sealed = sealer.seal(identity, data)

    def rate(step: Any) -> float:
        done, begun = 0, time.thread_time()
        while (spent := time.thread_time() - begun) < seconds or done < 3:
            step()
            done += 1
        return done * size / spent / 1e6

    opened = sealer.open(identity, sealed)
    assert opened == data
    return {"value_bytes": size, "overhead_bytes": len(sealed) - size,
            "seal_mb_s": rate(lambda: sealer.seal(identity, data)),
            "open_mb_s": rate(lambda: sealer.open(identity, sealed)),
            "check_mb_s": rate(lambda: checksum(data))}


def sealing_lines(sealing: dict[str, float]) -> list[str]:
    return ["", "Sealing (AES-256-GCM under --cluster-key-file), one core:", "",
            "| value bytes | seal MB/s | open MB/s | checksum of the opened bytes MB/s | overhead bytes per value |",
            "|---|---|---|---|---|",
            f"| {sealing['value_bytes']:.0f} | {sealing['seal_mb_s']:.0f} | {sealing['open_mb_s']:.0f} | "
            f"{sealing['check_mb_s']:.0f} | {sealing['overhead_bytes']:.0f} |"]


def run_config(run: Run, src: Path, store: Path, files: list[Expected], data_work: Path,
               args: argparse.Namespace) -> None:
    memcacheds: list[Memcached] = []
    mounts: list[bench.Mounted] = []
    procs: list[multiprocessing.process.BaseProcess] = []
    group: _throttle.ReadThrottle | None = None
    ctx = multiprocessing.get_context("fork")  # the node processes need nothing but what is loaded here
    try:
        url = None
        if run.config.startswith("cluster"):
            memcacheds = [Memcached(args.memcached, args.memcached_mb, item_max(max(f.size for f in files)))
                          for _ in range(args.nodes)]
            run.memcached_mb = args.memcached_mb
            for mc in memcacheds:
                mc.start()
            url = "memcached://" + ",".join(f"127.0.0.1:{mc.port}" for mc in memcacheds)
        run.mount_args = mount_flags(run.config, args, url)
        for rank in range(args.nodes):
            mounts.append(bench.mount(src, store, args.work / f"mnt{rank}", *run.mount_args))
        run.data_path = bench.control(mounts[0].mnt).get("data_path")
        group = _throttle.ReadThrottle(data_work, args.cap_mb * 1_000_000)
        for m in mounts:
            group.add(m.pid)
        barrier = ctx.Barrier(args.nodes + 1)
        results = ctx.Queue()
        for rank, m in enumerate(mounts):
            job = NodeJob(rank, args.nodes, str(m.mnt), m.pid, args.epochs, args.seed, args.shard, args.window,
                          files, args.epoch_timeout, args.per_file)
            proc = ctx.Process(target=node_main, args=(job, barrier, results), name=f"node{rank}")
            proc.start()
            assert proc.pid is not None
            group.add(proc.pid)  # before the first barrier: no read happens outside the cap
            procs.append(proc)
        for epoch in range(1, args.epochs + 1):
            event = None
            if run.config == "cluster-kill" and epoch == args.restart_at:
                memcacheds[VICTIM].start()  # empty, on its old port: the nodes' clients take it back
                event = f"memcached {VICTIM} restarted"
            bench.drop_caches()
            disk0 = group.read_bytes()
            started = time.perf_counter()
            barrier.wait(timeout=args.epoch_timeout)
            if run.config == "cluster-kill" and epoch == args.kill_at:
                memcacheds[VICTIM].kill()  # as the nodes' first reads of the epoch go out
                event = f"memcached {VICTIM} killed"
            barrier.wait(timeout=args.epoch_timeout)
            wall = time.perf_counter() - started
            nodes = sorted((results.get(timeout=60) for _ in procs), key=lambda n: n["rank"])
            run.epochs.append({"epoch": epoch, "event": event, "wall_s": wall, "blkio_read_bytes":
                               group.read_bytes() - disk0, "nodes": nodes,
                               "memcached": [mc.stats() for mc in memcacheds]})
            print(f"  {run.config:<12} epoch {epoch}: {epoch_line(run.epochs[-1])}"
                  + (f"  ({event})" if event else ""), file=sys.stderr)
        for done in procs:
            done.join(timeout=60)
    finally:
        for left in procs:
            if left.is_alive():
                left.kill()
                left.join(timeout=10)
        for m in mounts:
            m.close(check=False)
        if group is not None:
            group.close()
        for mc in memcacheds:
            mc.kill()


def epoch_line(e: dict[str, Any]) -> str:
    t = totals(e["nodes"], e["wall_s"])
    return (f"hit {t['hit_ratio']:.3f} (memory {t['memory_ratio']:.3f}, cluster {t['cluster_ratio']:.3f}), "
            f"storage {t['storage_bytes'] / 1e6:.0f} MB, cluster {t['cluster_bytes'] / 1e6:.0f} MB, "
            f"{t['images_per_s']:.0f} img/s, failed {t['failed']}, wrong {t['wrong_bytes']}")


# -- figures ---------------------------------------------------------------------------------------------------


def totals(nodes: list[dict[str, Any]], wall: float | None = None) -> dict[str, Any]:
    """One epoch's (or one node's) figures summed over nodes; images/s over ``wall`` (the epoch's time, barrier
    to barrier) where given, else the sum of the nodes' own rates (they read side by side)."""
    s: dict[str, Any] = {k: sum(n[k] for n in nodes) for k in (
        "files", "bytes", "memory_bytes", "cluster_bytes", "storage_bytes", "cluster_hits", "disk_bytes", "failed",
        "wrong_bytes", "errors", "cache_retries")}
    for k in ("peer_hits", "peer_bytes", "memory_hits"):  # counted per file only (--per-file)
        s[k] = None if any(n[k] is None for n in nodes) else sum(n[k] for n in nodes)
    b = max(1, s["bytes"])
    s.update(hit_ratio=(s["memory_bytes"] + s["cluster_bytes"]) / b, memory_ratio=s["memory_bytes"] / b,
             cluster_ratio=s["cluster_bytes"] / b,
             images_per_s=s["files"] / wall if wall else sum(n["images_per_s"] for n in nodes))
    return s


def window_ratios(nodes: list[dict[str, Any]]) -> list[float]:
    return [(w["memory_bytes"] + w["cluster_bytes"]) / w["bytes"] for n in nodes for w in n["windows"] if w["bytes"]]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(runs: list[Run], args: argparse.Namespace, dataset_bytes: int) -> dict[str, Any]:
    """Per configuration and epoch (medians over repeats), per configuration and node (epochs 2 on), goals."""
    by_config: dict[str, list[Run]] = {}
    for run in runs:
        if run.error is None and run.epochs:
            by_config.setdefault(run.config, []).append(run)
    epoch_rows, node_rows = [], []
    keys = ("hit_ratio", "memory_ratio", "cluster_ratio", "storage_bytes", "cluster_bytes", "disk_bytes",
            "images_per_s", "errors", "files", "cache_retries")
    for config, rs in by_config.items():
        for i in range(min(len(r.epochs) for r in rs)):
            per_run = [totals(r.epochs[i]["nodes"], r.epochs[i]["wall_s"]) for r in rs]
            windows = [window_ratios(r.epochs[i]["nodes"]) for r in rs]
            row: dict[str, Any] = {"config": config, "epoch": i + 1, "event": rs[0].epochs[i]["event"],
                                   **{k: median([t[k] for t in per_run]) for k in keys},
                                   "peer_hits": per_run[0]["peer_hits"],
                                   # what the memcacheds held after the epoch, and threw out for want of room
                                   "memcached_items": median([sum(m["curr_items"] for m in r.epochs[i]["memcached"]
                                                                  if m) for r in rs]),
                                   "memcached_evictions": max(sum(m["evictions"] for m in r.epochs[i]["memcached"]
                                                                  if m) for r in rs)}
            # failures are summed over repeats, never a median: one is one too many
            row["failed"] = sum(t["failed"] for t in per_run)
            row["wrong_bytes"] = sum(t["wrong_bytes"] for t in per_run)
            flat = [w for ws in windows for w in ws]
            row.update(windows=len(flat), window_mean=median([statistics.fmean(ws) for ws in windows if ws]),
                       window_min=min(flat) if flat else None)
            epoch_rows.append(row)
        for rank in range(args.nodes):
            per_run = []
            for r in rs:
                mine = [n for e in r.epochs[1:] for n in e["nodes"] if n["rank"] == rank]
                if not mine:
                    continue
                t = totals(mine)
                ws = window_ratios(mine)
                per_run.append({**t, "epochs": len(mine), "window_mean": statistics.fmean(ws) if ws else None,
                                "window_sd": statistics.pstdev(ws) if len(ws) > 1 else None,
                                "window_min": min(ws) if ws else None, "windows": len(ws),
                                "images_per_s": statistics.fmean(n["images_per_s"] for n in mine)})
            if not per_run:
                continue
            row = {"config": config, "rank": rank, "epochs": per_run[0]["epochs"], "windows": per_run[0]["windows"]}
            for k in ("hit_ratio", "window_mean", "window_sd", "window_min", "images_per_s"):
                row[k] = median([p[k] for p in per_run if p[k] is not None])
            for k in ("storage_bytes", "cluster_bytes"):
                row[k + "_per_epoch"] = median([p[k] / p["epochs"] for p in per_run])
            row["failed"] = sum(p["failed"] for p in per_run)
            row["wrong_bytes"] = sum(p["wrong_bytes"] for p in per_run)
            node_rows.append(row)
    return {"epochs": epoch_rows, "nodes": node_rows, "goals": goals(epoch_rows, args, dataset_bytes)}


def goals(rows: list[dict[str, Any]], args: argparse.Namespace, dataset_bytes: int) -> dict[str, Any]:
    target = min(1.0, args.nodes * args.cache_size / 100)
    out: dict[str, Any] = {"target_share": target, "goal_hit_ratio": GOAL * target}
    later = {c: [r for r in rows if r["config"] == c and r["epoch"] >= 2] for c in CONFIGS}
    cluster = later["cluster"]
    if cluster:
        means = [r["window_mean"] for r in cluster if r["window_mean"] is not None]
        mins = [r["window_min"] for r in cluster if r["window_min"] is not None]
        out["cluster_window_mean"] = statistics.fmean(means) if means else None
        out["cluster_window_min"] = min(mins) if mins else None
        out["cluster_hit_ratio_met"] = bool(means) and min(means) >= GOAL * target
        # a window of W reads of a random order holds a share p of a fixed set with sd sqrt(p(1-p)/W)
        out["window_sd_sampling"] = math.sqrt(target * (1 - target) / args.window)
        storage = statistics.fmean(r["storage_bytes"] for r in cluster)
        out["cluster_storage_per_epoch"] = storage
        out["storage_goal_per_epoch"] = (1 - GOAL * target) * dataset_bytes
        out["cluster_storage_met"] = storage <= out["storage_goal_per_epoch"]
        if later["per-node"]:
            per_node = statistics.fmean(r["storage_bytes"] for r in later["per-node"])
            out["per_node_storage_per_epoch"] = per_node
            out["storage_fall_vs_per_node"] = 1 - storage / per_node if per_node else None
    out["failed"] = sum(r["failed"] for r in rows)
    out["wrong_bytes"] = sum(r["wrong_bytes"] for r in rows)
    kill = [r for r in rows if r["config"] == "cluster-kill"]
    out["kill_clean"] = bool(kill) and sum(r["failed"] + r["wrong_bytes"] + r["errors"] for r in kill) == 0
    return out


def mb(v: float | None) -> str:
    return "" if v is None else f"{v / 1e6:.0f}"


def ratio(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"


def markdown(s: dict[str, Any], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    lines = [f"{args.nodes} nodes (mounts) x {args.images} images {args.size} ({meta['dataset_bytes'] / 1e6:.0f} MB "
             f"served, {meta['raw_bytes'] / 1e6:.0f} MB raw), --cache-size {args.cache_size:g}% per node, cluster "
             f"{args.cluster_size:g}%, storage capped at {args.cap_mb} MB/s for all, page cache dropped before each "
             f"epoch, data path {meta.get('data_path')}. Loader: plain Python whole-file reads, one process per node, "
             f"{args.shard} shards of one seeded permutation per epoch, every file checked by sha256, the mount's "
             f"statistics read every {'file' if args.per_file else f'{args.window} files'}. Hit ratio = bytes "
             f"from node memory + cluster over bytes read; windows of {args.window} reads; peers = cluster hits"
             + (f"; medians of {args.repeats} repeats" if args.repeats > 1 else "") + ".",
             "",
             "| config | epoch | hit ratio | memory | cluster | window mean / min (n) | storage MB | from peers MB "
             "| disk MB | images/s | failed | wrong bytes | event |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["epochs"]:
        win = f"{ratio(r['window_mean'])} / {ratio(r['window_min'])} ({r['windows']})" if r["windows"] else ""
        lines.append(f"| {r['config']} | {r['epoch']} | {ratio(r['hit_ratio'])} | {ratio(r['memory_ratio'])} "
                     f"| {ratio(r['cluster_ratio'])} | {win} | {mb(r['storage_bytes'])} | {mb(r['cluster_bytes'])} "
                     f"| {mb(r['disk_bytes'])} | {r['images_per_s']:.0f} | {r['failed']} | {r['wrong_bytes']} "
                     f"| {r['event'] or ''} |")
    lines += ["", "Per node, epochs 2 on:", "",
              "| config | node | hit ratio | window mean / sd / min (n) | storage MB/epoch | peers MB/epoch "
              "| images/s | failed | wrong bytes |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in s["nodes"]:
        win = (f"{ratio(r['window_mean'])} / {ratio(r['window_sd'])} / {ratio(r['window_min'])} ({r['windows']})"
               if r["windows"] else "")
        lines.append(f"| {r['config']} | {r['rank']} | {ratio(r['hit_ratio'])} | {win} "
                     f"| {mb(r['storage_bytes_per_epoch'])} | {mb(r['cluster_bytes_per_epoch'])} "
                     f"| {r['images_per_s'] or 0:.0f} | {r['failed']} | {r['wrong_bytes']} |")
    g = s["goals"]
    lines += ["", f"Goals (N x C / D = {g['target_share']:.2f}):"]
    if "cluster_window_mean" in g:
        lines.append(f"- cluster hit ratio per window >= {g['goal_hit_ratio']:.3f}: mean per epoch (2 on) "
                     f"{ratio(g['cluster_window_mean'])}, lowest epoch mean >= goal: "
                     f"{'met' if g['cluster_hit_ratio_met'] else 'NOT met'}; lowest single window "
                     f"{ratio(g['cluster_window_min'])} (sampling sd of a {args.window}-read window alone: "
                     f"{g['window_sd_sampling']:.3f})")
        vs = (f", {g['storage_fall_vs_per_node']:.0%} below per-node's {mb(g['per_node_storage_per_epoch'])} MB"
              if g.get("storage_fall_vs_per_node") is not None else "")
        lines.append(f"- storage per epoch (2 on) <= {mb(g['storage_goal_per_epoch'])} MB: cluster "
                     f"{mb(g['cluster_storage_per_epoch'])} MB{vs}: {'met' if g['cluster_storage_met'] else 'NOT met'}")
    if s.get("sealing"):
        lines += sealing_lines(s["sealing"])
        lines.append("")
    lines.append(f"- 0 failed reads, 0 wrong bytes (all configurations): failed {g['failed']}, wrong bytes "
                 f"{g['wrong_bytes']}" + (f"; through the kill: {'met' if g['kill_clean'] else 'NOT met'}"
                                          if any(r["config"] == "cluster-kill" for r in s["epochs"]) else ""))
    return "\n".join(lines)


# -- driver ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--size", default="512x256", help="WIDTHxHEIGHT of the generated images")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes: mounts, readers, memcacheds")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per configuration (default 6: two after the "
                        "restart)")
    parser.add_argument("--cache-size", type=float, default=10.0, metavar="PERCENT",
                        help="each node's --cache-size, percent of the dataset (default 10: N x C / D = 40%%)")
    parser.add_argument("--cluster-size", type=float, metavar="PERCENT",
                        help="--cluster-size, percent of the dataset (default N x --cache-size)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--cap-mb", type=int, default=200, help="storage read cap for all readers, MB/s")
    parser.add_argument("--shard", choices=("contiguous", "strided"), default="contiguous",
                        help="rank r's files of an epoch's order: its contiguous 1/N (DALI) or every N-th")
    parser.add_argument("--window", type=int, default=64, help="reads per window")
    parser.add_argument("--kill-at", type=int, default=3, help="cluster-kill: the epoch memcached 0 is killed in")
    parser.add_argument("--restart-at", type=int, default=4, help="cluster-kill: the epoch it is back for")
    parser.add_argument("--seed", type=int, default=0, help="the job's shuffle seed")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each configuration, interleaved (medians reported; default 3)")
    parser.add_argument("--memcached", default=shutil.which("memcached") or "/usr/bin/memcached")
    parser.add_argument("--memcached-mb", type=int,
                        help="each memcached's -m (default: its share of the cluster x 1.5 + 64)")
    parser.add_argument("--per-file", action="store_true",
                        help="read the mount's statistics after every file, not every window: which reads hit "
                        "the cluster on a file a peer read last epoch (peer_hits; the smoke run's default). Each "
                        "read of them costs the daemon ~3 ms of CPU here: slower epochs")
    parser.add_argument("--epoch-timeout", type=float, default=900.0)
    parser.add_argument("--sealing-only", action="store_true",
                        help="measure only what sealing the cluster's values costs, on one core (no root, no mounts)")
    parser.add_argument("--sealing-size", type=int, metavar="BYTES",
                        help="the value size sealing is measured at (default: the dataset's mean raw object)")
    bench.add_run_arguments(parser, results="out/bench/cluster.json", work=bench.REPO / "out" / "bench-cluster",
                            work_help="dataset, store and the mountpoints (the dataset is kept per count and size)",
                            smoke="16 images of 256x128, 2 nodes at --cache-size 25%%, 2 epochs, windows of 4, "
                                  "the kill in epoch 2")
    args = parser.parse_args(argv)
    if args.smoke:
        args.images, args.size, args.nodes, args.epochs, args.window, args.repeats = 16, "256x128", 2, 2, 4, 1
        # 25 %: the cluster holds half the objects, so 16 images surely put some in it
        args.cache_size, args.kill_at, args.restart_at, args.per_file = 25.0, 2, 3, True
    args.width, args.height = map(int, args.size.lower().split("x"))
    args.configs = bench.split_choices(parser, args.configs, CONFIGS, "config")
    if args.cluster_size is None:
        args.cluster_size = args.nodes * args.cache_size
    if args.nodes < 2:
        parser.error("--nodes: 2 at least (a cluster of one is a per-node cache)")
    args.json = (args.json or bench.REPO / "out" / "bench" / "cluster.json").absolute()
    args.work = args.work.absolute()
    return args


def preflight(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if problem := bench.root_problem("before every epoch"):
        return problem
    if problem := _throttle.available():
        return f"the storage cap needs cgroup v1 blkio: {problem}"
    if any(c.startswith("cluster") for c in args.configs) and not os.access(args.memcached, os.X_OK):
        return f"no memcached at {args.memcached} (apt-get install memcached)"
    return None


def write_json(path: Path, meta: dict[str, Any], runs: list[Run], s: dict[str, Any] | None) -> None:
    path.write_text(json.dumps({"meta": meta, "summary": s, "runs": [asdict(r) for r in runs]}, indent=1))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.sealing_only and args.sealing_size:
        sealing = sealing_cost(args.sealing_size)
        print("\n".join(sealing_lines(sealing)))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, {"argv": sys.argv, "cores": os.cpu_count()}, [], {"sealing": sealing})
        return 0
    if not args.sealing_only and (problem := preflight(args)):
        print(f"bench_cluster: {problem}", file=sys.stderr)
        return 2
    started = time.time()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    data_work = bench.dataset_dir(args.work, args.images, args.width, args.height)
    src = bench.dataset(data_work, args.images, args.width, args.height)
    store = bench.store_for(data_work, src, 1.0)
    files, raw_bytes = expected_files(src, store)
    dataset_bytes = sum(f.size for f in files)
    raw_files = [f for f in files if f.where.startswith(str(store))]
    sealing = sealing_cost(args.sealing_size or (raw_bytes // max(1, len(raw_files))) or 1)
    if args.sealing_only:
        print("\n".join(sealing_lines(sealing)))
        write_json(args.json, {"argv": sys.argv, "cores": os.cpu_count(), "raw_bytes": raw_bytes}, [],
                   {"sealing": sealing})
        return 0
    if args.memcached_mb is None:
        # rendezvous hashing spreads the share unevenly, and a killed peer's keys land on the others meanwhile
        args.memcached_mb = math.ceil(args.cluster_size / 100 * dataset_bytes / args.nodes * 1.5 / 2**20) + 64
    meta: dict[str, Any] = {
        "argv": sys.argv, "started": started, "images": args.images, "size": args.size, "nodes": args.nodes,
        "epochs": args.epochs, "cache_size_percent": args.cache_size, "cluster_size_percent": args.cluster_size,
        "cap_mb_s": args.cap_mb, "shard": args.shard, "window": args.window, "seed": args.seed,
        "kill_at": args.kill_at, "restart_at": args.restart_at, "repeats": args.repeats, "cores": os.cpu_count(),
        "dataset_bytes": dataset_bytes, "raw_bytes": raw_bytes, "memcached_mb": args.memcached_mb,
        "loader": "plain Python, one whole-file read per image, sha256-checked, one process per node",
        "goal": f"cluster window hit ratio >= {GOAL} x min(1, N x C / D); storage per epoch falling by that share; "
                "0 failed reads and 0 wrong bytes through the kill"}
    print(f"{args.nodes} nodes, {len(files)} images ({dataset_bytes / 1e6:.0f} MB), {args.epochs} epochs, "
          f"configs {','.join(args.configs)}", file=sys.stderr)
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for config in args.configs:
            run = Run(config, repeat, [])
            runs.append(run)
            try:
                run_config(run, src, store, files, data_work, args)
            except (subprocess.CalledProcessError, RuntimeError, TimeoutError, OSError, EOFError,
                    threading.BrokenBarrierError, queue.Empty) as exc:  # a node that died breaks the barrier
                run.error = f"{type(exc).__name__}: {exc}".strip()
                print(f"  {config}: FAILED: {run.error}", file=sys.stderr)
            meta["data_path"] = meta.get("data_path") or run.data_path
            meta["seconds"] = time.time() - started
            write_json(args.json, meta, runs, None)  # after every run: a crash keeps what was measured
    s = summary(runs, args, dataset_bytes)
    s["sealing"] = sealing
    meta["seconds"] = time.time() - started
    write_json(args.json, meta, runs, s)
    print(markdown(s, args, meta))
    print(f"\n(JSON {args.json}, {time.time() - started:.0f} s)")
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
