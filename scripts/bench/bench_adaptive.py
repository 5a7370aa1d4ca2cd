"""The mix that follows the machine (issue 16): one long DALI run per configuration while the machine changes.

    python scripts/bench/bench_adaptive.py [--images 1000] [--size 2048x1024] [--epochs 6] [--scenarios storage,cpu]
        [--configs png,profiled,prepared,adaptive] [--prepared-ratio 1.0] [--cap-mb 200]
        [--json out/adaptive/adaptive.json]
    python scripts/bench/bench_adaptive.py --smoke --configs png,prepared      # 24 tiny images, 3 epochs, < 1 min

Every configuration is a liquidfs mount of the same source (so each pays the same FUSE cost):
    png       a store prepared at ratio 0 (every image served as its PNG)
    profiled  a store prepared at the ratio `liquidfs profile` chose on the unchanged machine (measured once)
    prepared  a store prepared at --prepared-ratio, mounted without --mix (every prepared raw object served)
    fixed     the same store mounted with --mix at the prepared share (what adaptive does at its top, with no
              controller: the cost of the mix's own code path; not in the default list)
    adaptive  the same store mounted with --mix adaptive (the mount picks the raw share online, 0..prepared)
A static share R equals a store prepared at R (prepare keeps a seeded prefix), so only `adaptive` needs --mix.

Each (scenario, configuration) is ONE loader process, an unmodified DALI CPU pipeline as training scripts write
it (fn.readers.file with random shuffle over the mount, fn.decoders.image on the CPU, a random resized crop, a
flip + normalize, batch 16, threads = cores), iterating --epochs epochs. Before each epoch it waits for the
driver, which drops the page cache (cold storage) and applies the phase:
    epoch 1 "before"; epochs --change-from .. --lift-at - 1 "changed"; from --lift-at on "after".
Scenario `storage`: while changed, a cgroup v1 blkio group caps reads at --cap-mb MB/s; it holds both the liquidfs
daemon and the loader, because with FUSE passthrough the kernel reads the backing files in the reader's context.
Scenario `cpu`: while changed, --hogs busy-looping processes compete for the cores (the CPU they got is recorded).
Scenario `none`: nothing changes (to compare configurations on the unchanged machine).

Two DALI defaults blur the phase edges a little, the same for every configuration. The reader fills its shuffle
buffer (--shuffle-buffer, initial_fill 1024) before the first batch, which epoch 1 pays; after that each sample
taken out is replaced by one read, so the read rate still bounds every phase, but the files a phase reads are
decoded later. And while the loader waits between epochs its pipeline has already made its next two batches
(prefetch_queue_depth 2): 2 x --batch images of each epoch are made before its clock starts, under the previous
phase (3% of 1,000 images).

Output: a markdown table per phase (images/s per configuration, adaptive / best static), one per epoch, JSON with
every epoch, per-minute rates and the mount's `mix` statistics sampled over time at --json, and beside it a PNG
chart when matplotlib imports and each loader's log. Needs root on Linux (drop_caches, blkio).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402  (dataset, stores, profile, mount, page cache: one copy of each)
import _throttle  # noqa: E402
from liquidfs.profile.loaders import dali_pipeline, dali_run  # noqa: E402
from liquidfs.stores import open_store  # noqa: E402

CONFIGS = ("png", "profiled", "prepared", "fixed", "adaptive")
STATIC = ("png", "profiled", "prepared", "fixed")
SCENARIOS = ("storage", "cpu", "none")
PHASES = ("before", "changed", "after")
GOAL = 0.95  # adaptive must reach this share of the best static configuration in every phase


# -- the loader (a child process: its CPU, its cgroup and its DALI threads are its own) --------------------


def loader_main(argv: list[str]) -> int:
    """`bench_adaptive.py loader ROOT ...`: build the pipeline, then run one epoch per line read on stdin."""
    parser = argparse.ArgumentParser(prog="bench_adaptive.py loader")
    parser.add_argument("file_root")
    parser.add_argument("--images", type=int, required=True, help="images per epoch (the dataset's count)")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--crop", type=int, default=512)
    parser.add_argument("--shuffle-buffer", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    p = dali_pipeline(file_root=args.file_root, batch=args.batch, threads=args.threads, seed=args.seed,
                      shuffle_buffer=args.shuffle_buffer, crop=args.crop)
    say({"ready": True, "pid": os.getpid()})
    total = 0
    for epoch in range(1, args.epochs + 1):
        if not sys.stdin.readline():  # the driver went away
            return 1
        # An epoch is the next `images` images of the stream: DALI's reader wraps its last batch into the next
        # epoch, so counting to epoch * images keeps every epoch at the dataset's size without drift.
        run = dali_run(p, epoch * args.images - total)
        total += run.images
        say({"epoch": epoch, "images": run.images, "seconds": run.seconds, "images_per_s": run.images / run.seconds,
             "loader_cpu_s": run.cpu_seconds, "marks": [(round(t, 3), n) for t, n in run.marks]})
    return 0


def say(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


class Loader:
    """The driver's handle on one loader process."""

    def __init__(self, root: Path, args: argparse.Namespace, log: Path) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "loader", str(root / bench.SUBDIR),
               "--images", str(args.images), "--epochs", str(args.epochs), "--batch", str(args.batch),
               "--threads", str(args.threads), "--crop", str(args.crop), "--shuffle-buffer", str(args.shuffle_buffer)]
        self.log = log
        self._stderr = open(log, "wb")  # a file, not a pipe: DALI's warnings must never fill a pipe and stall it
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self.pid = self.proc.pid
        self._pending = b""
        try:
            self.receive(timeout=300, key="ready")
        except BaseException:
            self.close()
            raise

    def epoch(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        return self.receive(timeout, key="epoch")

    def receive(self, timeout: float, key: str) -> dict[str, Any]:
        """The loader's next JSON line holding ``key`` (anything else on stdout is a library's chatter)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(deadline, key)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and key in message:
                return message

    def _line(self, deadline: float, key: str) -> bytes:
        # Raw reads on the pipe's descriptor: select() cannot see lines already sitting in a Python buffer.
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the loader sent no {key!r} in time (log {self.log})")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.proc.wait(timeout=30)
                raise RuntimeError(f"the loader exited ({self.proc.returncode}): {bench.tail(self.log)}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()


# -- what changes during the run ---------------------------------------------------------------------------


class Change(Protocol):
    """One scenario's change of the machine: on while the phase is "changed", off otherwise."""

    def apply(self, on: bool, pids: Iterable[int]) -> None: ...
    def begin(self) -> None: ...  # the epoch starts now
    def epoch_stats(self, seconds: float) -> dict[str, Any]: ...
    def close(self) -> None: ...


class StorageCap:
    """A blkio read cap on the disk under ``path``, holding the daemon and the loader while on. Off removes the
    group (its processes go back to the root group): the cap is lifted at once, mid-run."""

    def __init__(self, path: Path, mb_per_s: int) -> None:
        self.path = path
        self.bytes_per_s = mb_per_s * 1_000_000
        self.group: _throttle.ReadThrottle | None = None

    def apply(self, on: bool, pids: Iterable[int]) -> None:
        if on and self.group is None:
            self.group = _throttle.ReadThrottle(self.path, self.bytes_per_s)
            for pid in pids:
                self.group.add(pid)
        elif not on:
            self.close()

    def begin(self) -> None:
        pass

    def epoch_stats(self, seconds: float) -> dict[str, Any]:
        return {"cap_mb_s": self.bytes_per_s / 1e6 if self.group else None}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class CpuHog:
    """``count`` busy-looping processes. The scheduler shares the cores among runnable threads, so one loop
    takes about a core's share of them, not a whole core: the CPU they actually got is recorded per epoch."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []
        self._cpu0 = 0.0

    def apply(self, on: bool, pids: Iterable[int]) -> None:
        if on and not self.procs:
            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        elif not on:
            self.close()

    def begin(self) -> None:
        self._cpu0 = self._cpu()

    def _cpu(self) -> float:
        return sum(bench.cpu_seconds(p.pid) for p in self.procs if p.poll() is None)

    def epoch_stats(self, seconds: float) -> dict[str, Any]:
        if not self.procs:
            return {"hog_cores": None}
        return {"hog_cores": (self._cpu() - self._cpu0) / seconds, "hogs": len(self.procs)}

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


class NoChange:
    """Scenario `none`: the machine stays as it is."""

    def apply(self, on: bool, pids: Iterable[int]) -> None:
        pass

    def begin(self) -> None:
        pass

    def epoch_stats(self, seconds: float) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def make_change(scenario: str, args: argparse.Namespace, data_work: Path) -> Change:
    if scenario == "storage":
        return StorageCap(data_work, args.cap_mb)
    return CpuHog(args.hogs) if scenario == "cpu" else NoChange()


def changed_epochs(args: argparse.Namespace) -> str:
    last = min(args.lift_at, args.epochs + 1) - 1
    return f"epoch {last}" if last == args.change_from else f"epochs {args.change_from}-{last}"


def phase_of(epoch: int, args: argparse.Namespace) -> str:
    if epoch < args.change_from:
        return "before"
    return "changed" if epoch < args.lift_at else "after"


# -- sampling the mount's statistics -----------------------------------------------------------------------


class Sampler(threading.Thread):
    """Reads the control file every ``interval`` s: the mix share over time (the `mix` key; absent on a mount
    without --mix) and the bytes the daemon took from storage."""

    def __init__(self, mnt: Path, interval: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.mnt, self.interval, self.t0 = mnt, interval, t0
        self.samples: list[dict[str, Any]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def sample(self) -> None:
        try:
            st = bench.control(self.mnt)
        except (OSError, ValueError):  # the mount is going away: the last samples are enough
            return
        row: dict[str, Any] = {"t": round(time.time() - self.t0, 2),
                               "bytes_from_storage": st.get("bytes_from_storage")}
        if "mix" in st:
            row["mix"] = st["mix"]
        self.samples.append(row)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=self.interval + 5)
        self.sample()


# -- one long run ------------------------------------------------------------------------------------------


@dataclass
class Run:
    scenario: str
    config: str
    ratio: float
    mount_args: list[str]
    epochs: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    per_minute: list[dict[str, float]] = field(default_factory=list)
    data_path: str | None = None
    error: str | None = None


def mount_flags(config: str, ratio: float, mix_interval: float) -> list[str]:
    args = ["--data-path", "auto"]
    if config == "adaptive":
        args += ["--mix", "adaptive", "--mix-interval", str(mix_interval)]
    elif config == "fixed":
        args += ["--mix", f"{ratio:g}"]
    return args


def run_one(run: Run, src: Path, store: Path, data_work: Path, args: argparse.Namespace) -> None:
    mnt = args.work / "mnt"
    t0 = time.time()
    change = make_change(run.scenario, args, data_work)
    mount = loader = sampler = None
    try:
        mount = bench.mount(src, store, mnt, *run.mount_args)
        run.data_path = bench.control(mnt).get("data_path")
        sampler = Sampler(mnt, args.sample_s, t0)
        sampler.start()
        loader = Loader(mnt, args, args.json.parent / f"loader-{run.scenario}-{run.config}.log")
        for epoch in range(1, args.epochs + 1):
            run.epochs.append(one_epoch(epoch, mount, loader, change, t0, args))
            e = run.epochs[-1]
            print(f"  {run.scenario:<8} {run.config:<9} epoch {epoch} {e['phase']:<8} {e['images_per_s']:7.1f} img/s"
                  f"  storage {e['storage_mb_s']:6.1f} MB/s" + (f"  share {e['mix_share']:.2f}"
                                                               if e.get("mix_share") is not None else ""),
                  file=sys.stderr)
    finally:
        change.close()  # first: a hog left running would slow every later cleanup step
        if loader:
            loader.close()
        if sampler:
            sampler.stop()
            run.samples = sampler.samples
        if mount:
            mount.close()
    run.per_minute = per_minute(run.epochs)


def one_epoch(epoch: int, mount: bench.Mounted, loader: Loader, change: Change, t0: float,
              args: argparse.Namespace) -> dict[str, Any]:
    phase = phase_of(epoch, args)
    change.apply(phase == "changed", [mount.pid, loader.pid])
    bench.drop_caches()  # cold storage: every epoch's bytes come from the disk
    change.begin()
    # storage bytes: the daemon's and the loader's (passthrough reads are the loader's); epoch 1's also hold the
    # pages of the libraries DALI loads at its first batch (~60 MB here)
    before = (time.time(), bench.cpu_seconds(mount.pid), bench.io_read_bytes(mount.pid) + bench.io_read_bytes(loader.pid))
    result = loader.epoch(args.epoch_timeout)
    after = (time.time(), bench.cpu_seconds(mount.pid), bench.io_read_bytes(mount.pid) + bench.io_read_bytes(loader.pid))
    result.update(phase=phase, start_s=round(before[0] - t0, 2), end_s=round(after[0] - t0, 2),
                  daemon_cpu_s=after[1] - before[1], storage_mb_s=(after[2] - before[2]) / 1e6 / result["seconds"],
                  **change.epoch_stats(after[0] - before[0]))
    mix = control_mix(mount.mnt)
    if mix is not None:
        result["mix"] = mix
        result["mix_share"] = mix.get("share")
    return result


def control_mix(mnt: Path) -> dict[str, Any] | None:
    try:
        return bench.control(mnt).get("mix")
    except (OSError, ValueError):
        return None


def per_minute(epochs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Images/s per minute of loading time (the pauses between epochs, for the driver, left out)."""
    counts: dict[int, int] = {}
    offset = 0.0
    for e in epochs:
        last = 0
        for t, done in e["marks"]:
            # a batch finished at t was made in (t_prev, t]: one ending on a minute's edge belongs to that minute
            minute = max(0, math.ceil((offset + t) / 60) - 1)
            counts[minute] = counts.get(minute, 0) + done - last
            last = done
        offset += e["seconds"]
    rows = []
    for minute in sorted(counts):
        span = min(60.0, offset - 60 * minute)
        rows.append({"minute": minute + 1, "images": counts[minute], "images_per_s": counts[minute] / span})
    return rows


# -- output ------------------------------------------------------------------------------------------------


def phase_rate(run: Run, phase: str) -> float | None:
    epochs = [e for e in run.epochs if e["phase"] == phase]
    if not epochs or run.error:
        return None
    return sum(e["images"] for e in epochs) / sum(e["seconds"] for e in epochs)


def summary(runs: list[Run], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per scenario x phase: images/s per configuration, and adaptive against the best static one."""
    rows = []
    for scenario in args.scenarios:
        for phase in PHASES:
            if not any(phase_of(e, args) == phase for e in range(1, args.epochs + 1)):
                continue
            rates = {r.config: phase_rate(r, phase) for r in runs if r.scenario == scenario}
            static = {c: v for c, v in rates.items() if c in STATIC and v}
            row: dict[str, Any] = {"scenario": scenario, "phase": phase, "images_per_s": rates}
            if static:
                best = max(static, key=static.__getitem__)
                row["best_static"] = best
                if rates.get("adaptive"):
                    row["adaptive_vs_best"] = rates["adaptive"] / static[best]
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], configs: list[str]) -> str:
    lines = ["| scenario | phase | " + " | ".join(configs) + " | best static | adaptive / best |",
             "|---|---|" + "---|" * (len(configs) + 2)]
    for row in rows:
        rates = row["images_per_s"]
        cells = ["-" if c not in rates else "failed" if rates[c] is None else f"{rates[c]:.1f}" for c in configs]
        ratio = row.get("adaptive_vs_best")
        verdict = "" if ratio is None else f"{ratio:.3f}" + (" ok" if ratio >= GOAL else " BELOW")
        lines.append(f"| {row['scenario']} | {row['phase']} | " + " | ".join(cells)
                     + f" | {row.get('best_static', '')} | {verdict} |")
    return "\n".join(lines)


def epoch_markdown(runs: list[Run], args: argparse.Namespace) -> str:
    lines = ["| scenario | epoch | phase | " + " | ".join(args.configs) + " | adaptive share |",
             "|---|---|---|" + "---|" * (len(args.configs) + 1)]
    for scenario in args.scenarios:
        by_config = {r.config: r for r in runs if r.scenario == scenario}
        for epoch in range(1, args.epochs + 1):
            cells = []
            for c in args.configs:
                es = by_config[c].epochs if c in by_config else []
                cells.append(f"{es[epoch - 1]['images_per_s']:.1f}" if len(es) >= epoch else "")
            adaptive = by_config.get("adaptive")
            share = adaptive.epochs[epoch - 1].get("mix_share") if adaptive and len(adaptive.epochs) >= epoch else None
            lines.append(f"| {scenario} | {epoch} | {phase_of(epoch, args)} | " + " | ".join(cells)
                         + f" | {'' if share is None else f'{share:.2f}'} |")
    return "\n".join(lines)


def chart(runs: list[Run], args: argparse.Namespace, path: Path) -> bool:
    """Per scenario: images/s per epoch per configuration (the changed phase shaded) above the adaptive
    mount's share over time. False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, len(args.scenarios), figsize=(6 * len(args.scenarios), 7), squeeze=False)
    for col, scenario in enumerate(args.scenarios):
        top, bottom = axes[0][col], axes[1][col]
        top.axvspan(args.change_from - 0.5, min(args.lift_at, args.epochs + 1) - 0.5, color="0.9")
        for run in (r for r in runs if r.scenario == scenario and r.epochs):
            xs = [e["epoch"] for e in run.epochs]
            top.plot(xs, [e["images_per_s"] for e in run.epochs], marker="o", label=f"{run.config} ({run.ratio:.2f})"
                     if run.config != "adaptive" else f"adaptive (0..{run.ratio:.2f})")
            if run.config == "adaptive":
                shares = [(s["t"], s["mix"]["share"]) for s in run.samples if isinstance(s.get("mix"), dict)]
                if shares:
                    bottom.step(*zip(*shares), where="post", label="adaptive share")
                for e in run.epochs:
                    if e["phase"] == "changed":
                        bottom.axvspan(e["start_s"], e["end_s"], color="0.9")
        change = {"storage": f"storage capped at {args.cap_mb} MB/s", "cpu": f"{args.hogs} CPU hog(s)"}.get(
            scenario, "no change")
        top.set(title=f"{scenario}: {change} in {changed_epochs(args)}", xlabel="epoch", ylabel="images/s")
        top.set_xticks(range(1, args.epochs + 1))
        top.set_ylim(bottom=0)
        top.legend(fontsize="small")
        bottom.set(xlabel="seconds since the mount", ylabel="raw share", ylim=(-0.02, 1.02))
        if not bottom.lines:
            bottom.text(0.5, 0.5, "no adaptive run (or no `mix` statistics)", ha="center", transform=bottom.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_json(path: Path, meta: dict[str, Any], runs: list[Run], rows: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"meta": meta, "summary": rows, "runs": [asdict(r) for r in runs]}, indent=1))


# -- driver ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--size", default="2048x1024", help="WIDTHxHEIGHT of the generated images")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--change-from", type=int, default=2, help="first epoch of the changed phase")
    parser.add_argument("--lift-at", type=int, default=4, help="first epoch after it (the change lifted)")
    parser.add_argument("--scenarios", default="storage,cpu", help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument("--configs", default="png,profiled,prepared,adaptive", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--prepared-ratio", type=float, default=1.0)
    parser.add_argument("--cap-mb", type=int, default=200, help="the storage scenario's read cap, MB/s")
    parser.add_argument("--hogs", type=int, default=1, help="busy-looping processes in the cpu scenario")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="DALI threads (default: cores)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--crop", type=int, default=512, help="random resized crop, pixels a side")
    parser.add_argument("--shuffle-buffer", type=int, default=1024, help="DALI's initial_fill (default DALI's own)")
    parser.add_argument("--profiled-ratio", type=float,
                        help="the profiled configuration's ratio, from an earlier profile (default: profile now)")
    parser.add_argument("--mix-interval", type=float, default=5.0,
                        help="adaptive: the mount's --mix-interval, seconds between decisions (default 5, as mount)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between control-file samples")
    parser.add_argument("--epoch-timeout", type=float, default=3600.0)
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="do not read the source and every store once before the runs (by default they are: "
                        "the first configuration to read a store must not pay for the disk's own warming)")
    bench.add_run_arguments(parser, results="out/adaptive/adaptive.json", work=bench.REPO / "out" / "bench-adaptive",
                            work_help="dataset, stores and the mountpoint (the dataset is kept per count and size)",
                            smoke="24 images of 256x128, 3 epochs, changed in epoch 2 only, 64-pixel crops, batch 4, "
                                  "shuffle buffer 8")
    args = parser.parse_args(argv)
    if args.smoke:
        args.images, args.size, args.epochs, args.change_from, args.lift_at = 24, "256x128", 3, 2, 3
        # batches of 4 and an 8-file shuffle buffer: with DALI's 16 and 1,024 the pipeline's two prefetched
        # batches and the reader's buffer would hold all 24 images, and epochs 2+ would time nothing
        args.crop, args.sample_s, args.batch, args.shuffle_buffer = 64, 1.0, 4, 8
    args.width, args.height = map(int, args.size.lower().split("x"))
    args.scenarios = bench.split_choices(parser, args.scenarios, SCENARIOS, "scenario")
    args.configs = bench.split_choices(parser, args.configs, CONFIGS, "config")
    if not 1 < args.change_from <= args.lift_at:
        parser.error("need 1 < --change-from <= --lift-at (epoch 1 is the unchanged machine)")
    args.json = (args.json or bench.REPO / "out" / "adaptive" / "adaptive.json").absolute()
    args.work = args.work.absolute()
    return args


def preflight(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if problem := bench.root_problem("before every epoch"):
        return problem
    if "storage" in args.scenarios and (problem := _throttle.available()):
        return f"the storage scenario needs cgroup v1 blkio: {problem} (or run --scenarios cpu)"
    return None


def ratios_for(args: argparse.Namespace, data_work: Path, src: Path) -> dict[str, float]:
    ratios = {"png": 0.0, "prepared": args.prepared_ratio, "fixed": args.prepared_ratio,
              "adaptive": args.prepared_ratio}
    if "profiled" in args.configs and args.profiled_ratio is not None:
        ratios["profiled"] = args.profiled_ratio  # what an earlier `liquidfs profile` of this dataset chose
    elif "profiled" in args.configs:
        # on the unchanged machine, once: the static choice a user makes before training
        print("profiling (liquidfs profile) ...", file=sys.stderr)
        ratios["profiled"] = bench.auto_ratio(data_work, src)
        print(f"profile chose ratio {ratios['profiled']:.2f}", file=sys.stderr)
    return {c: ratios[c] for c in args.configs}


def main(argv: list[str]) -> int:
    if argv[:1] == ["loader"]:
        return loader_main(argv[1:])
    args = parse_args(argv)
    if problem := preflight(args):
        print(f"bench_adaptive: {problem}", file=sys.stderr)
        return 2
    started = time.time()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    data_work = bench.dataset_dir(args.work, args.images, args.width, args.height)
    src = bench.dataset(data_work, args.images, args.width, args.height)
    ratios = ratios_for(args, data_work, src)
    stores = {r: bench.store_for(data_work, src, r) for r in sorted(set(ratios.values()))}
    if "adaptive" in ratios and "profiled" in ratios:
        # As ``prepare --ratio auto`` does, so the adaptive mix starts at the profile's choice, not mid-range.
        open_store(src, stores[ratios["adaptive"]]).keep_profile(json.dumps(
            {"chosen": ratios["profiled"], "by": "bench_adaptive (--profiled-ratio or its own profile run)"}))
    meta = {"argv": sys.argv, "started": started, "images": args.images, "size": args.size, "epochs": args.epochs,
            "phases": {"changed_epochs": list(range(args.change_from, min(args.lift_at, args.epochs + 1)))},
            "cap_mb_s": args.cap_mb, "hogs": args.hogs, "threads": args.threads, "batch": args.batch,
            "crop": args.crop, "shuffle_buffer": args.shuffle_buffer, "cores": os.cpu_count(), "ratios": ratios,
            "warm_up": args.warm_up,
            "goal": f"adaptive >= {GOAL} x the best static configuration in every phase"}
    print(f"{args.images} images {args.size}, {args.epochs} epochs, changed in {changed_epochs(args)}; "
          f"cpu scenario: {args.hogs} busy-loop process(es); ratios {ratios}", file=sys.stderr)
    if args.warm_up:
        # On this VM the disk below the guest caches too: the first configuration to read a store after a while
        # ran its epoch 1 at half the storage rate of the next one (BENCHMARKS, out/adaptive5), whichever it was.
        # Every tree is read once here, so that no configuration pays for its place in the order; the guest's
        # page cache is still dropped before every epoch.
        for root in [src, *sorted(set(stores.values()))]:
            print(f"warming up: reading {root} once", file=sys.stderr)
            bench.read_all(root)
    out = args.json
    runs: list[Run] = []
    for scenario in args.scenarios:
        for config in args.configs:
            run = Run(scenario, config, ratios[config], mount_flags(config, ratios[config], args.mix_interval))
            runs.append(run)
            try:
                run_one(run, src, stores[ratios[config]], data_work, args)
            except (subprocess.CalledProcessError, RuntimeError, TimeoutError, OSError) as exc:
                # one configuration failing (say a mount without --mix) must not cost the others' hours; what
                # the failed command printed is in the message (bench.CommandFailed)
                run.error = str(exc).strip()
                print(f"  {scenario} {config}: FAILED: {run.error}", file=sys.stderr)
            meta["seconds"] = time.time() - started
            write_json(out, meta, runs, summary(runs, args))  # after every run: a crash keeps what was measured
    rows = summary(runs, args)
    write_json(out, meta, runs, rows)
    drawn = chart(runs, args, out.with_suffix(".png"))
    print(markdown(rows, args.configs))
    print()
    print(epoch_markdown(runs, args))
    judged = [r["adaptive_vs_best"] for r in rows if "adaptive_vs_best" in r]
    if judged:
        print(f"\ngoal (adaptive >= {GOAL} x best static in every phase): "
              f"{'met' if min(judged) >= GOAL else 'NOT met'} (worst {min(judged):.3f})")
    print(f"\n(JSON {out}" + (f", chart {out.with_suffix('.png')}" if drawn else ", no chart: matplotlib missing")
          + f", {time.time() - started:.0f} s)")
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
