"""The best mix, side by side (issue 30): each shape of the machine at the 11 static shares, at what ``profile --run``
chose, at the cost model's choice, and under ``--mix adaptive``.

    python scripts/bench/bench_mix.py                       # every shape, 256 images of 2048x1024, 3 repeats
    python scripts/bench/bench_mix.py --shapes uncapped,torch --repeats 5
    python scripts/bench/bench_mix.py --parts continuous --reuse out/mix/mix.json --json out/mix/mix-final.json
    python scripts/bench/bench_mix.py --smoke               # 24 tiny images, two shapes, 1 repeat: the script works
    python scripts/bench/bench_mix.py --shapes wide8 --parts static,model --repeats 1   # issue 41's comparison

Shapes (each a loader and a machine state, held for all its runs):
  uncapped   DALI CPU pipeline with augmentation (decode, random resized crop, flip, normalise), storage uncapped
  cap200     the same, storage capped at 200 MB/s (a blkio cgroup holding the loader, its mount and the profile)
  hog        the same, uncapped, with a busy-looping process taking a share of the cores
  noaug      DALI CPU pipeline, decode only
  torch      torchvision ImageFolder + DataLoader, 2 workers (scripts/bench/torch_epoch.py)
  cache50    cap200 with the mounts' next-epoch cache at 50 % (--cache-size 50%): each run reads two epochs and the
             second, which hits the cache, is its rate; profile --run gets --cache-size 50% and the two-epoch
             command, and once more the one-epoch command (timed whole: no hits); no adaptive part
  wide8      uncapped with 8 loader threads whatever --threads says (a many-core node's loader: its threads block
             in I/O, so a 2-core machine runs it); the profile gets --threads 8 and so times storage with 8 readers
  wide16     the same with 16

Parts: static (the 11 shares), profile (``profile --run`` and the model's ``--model-only``, each then run at its
choice), model (the model alone, as profile's second half), adaptive, continuous.

Every run reads one epoch cold (page cache dropped before it) through a mount of one store prepared with every
image raw, served at the share by ``--mix SHARE``; a run's rate is the loader's own images/s. ``profile --run``
times the same loader command (``{mount}`` for the mount point) on the whole dataset in the same state, and its
choice is then run like a static share; so is the model's (``--model-only``). The adaptive mix (``--mix adaptive``,
decisions every ``--mix-interval`` s, starting at the middle) runs the loader epoch after epoch for
``--adaptive-seconds`` in one process (the page cache dropped at each epoch's end); its rate is that of the epochs
that ended in the second half, against the best static share run the same way (``continuous``: no start-up per
epoch, so not comparable with the one-epoch runs). DALI's shuffle buffer is 32 files (below the dataset's count,
as DALI's default 1,024 is below Cityscapes' 2,975 images). Medians of repeats; a share whose
runs are within noise of the best (3 %, or their spread) is marked.
Results: a markdown table on stdout, JSON at --json (default WORK/mix.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402
import _throttle  # noqa: E402
from _bench import REPO, SUBDIR  # noqa: E402

from liquidfs.profile.measured import within_noise  # noqa: E402

SHAPES = ("uncapped", "cap200", "hog", "noaug", "torch", "cache50", "wide8", "wide16")
SHARES = [i / 10 for i in range(11)]
GOAL = 0.97
PARTS = ("static", "profile", "model", "adaptive", "continuous")
PART_OF = {"static": "static", "profile --run": "profile", "profile --run, one epoch": "profile", "model": "model",
           "adaptive": "adaptive", "best static, continuous": "continuous"}
TORCH_EPOCH = Path(__file__).resolve().parent / "torch_epoch.py"
SHUFFLE_BUFFER = 32


@dataclass
class Shape:
    name: str
    loader: str          # "dali" or "torch"
    augment: bool = True
    cap_mb: int = 0
    hogs: int = 0
    cache: str = ""      # the mounts' --cache-size: each run then reads two epochs and the second is its rate
    threads: int = 0     # the loader's threads (and the profile's --threads), 0: --threads

    def threads_of(self, args: argparse.Namespace) -> int:
        return self.threads or args.threads

    @property
    def mount_args(self) -> list[str]:
        return ["--cache-size", self.cache] if self.cache else []

    @property
    def epochs(self) -> int:
        """Epochs of a static run (and of the profile's command): the second is timed where a cache hits."""
        return 2 if self.cache else 1

    def command(self, threads: int, *, epochs: int = 1) -> str:
        """The loader as a ``profile --run`` command: ``{mount}`` for the mount point. ``epochs`` > 1: a line per
        epoch too, for the adaptive mix's runs and a cache shape's second epoch."""
        more = ["--report-epochs"] if epochs > 1 else []
        if self.loader == "torch":
            return shlex.join([sys.executable, str(TORCH_EPOCH), "{mount}/" + str(SUBDIR), "--epochs", str(epochs),
                               "--workers", str(threads), "--batch", "16", *more])
        # A shuffle buffer below the dataset's count, as DALI's 1,024 is below Cityscapes' 2,975 training images:
        # with one larger than the dataset, DALI opens a whole epoch before its first batch and reading and
        # decoding no longer overlap (and, held open, files are not reopened from one epoch to the next).
        words = [sys.executable, "-m", "liquidfs.profile.loaders", "dali", "{mount}", "--threads", str(threads),
                 "--shuffle-buffer", str(SHUFFLE_BUFFER), "--epochs", str(epochs), *more]
        return shlex.join(words + ([] if self.augment else ["--no-augment"]))


def shape(name: str) -> Shape:
    return {"uncapped": Shape(name, "dali"), "cap200": Shape(name, "dali", cap_mb=200),
            "hog": Shape(name, "dali", hogs=1), "noaug": Shape(name, "dali", augment=False),
            "torch": Shape(name, "torch"), "cache50": Shape(name, "dali", cap_mb=200, cache="50%"),
            "wide8": Shape(name, "dali", threads=8), "wide16": Shape(name, "dali", threads=16)}[name]


class Machine:
    """A shape's machine state: the storage cap (a blkio group the loader, the daemon and the profile join) and
    the CPU hogs, held while the shape runs."""

    def __init__(self, s: Shape, work: Path) -> None:
        self.group = _throttle.ReadThrottle(work, s.cap_mb * 1_000_000) if s.cap_mb else None
        self.hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(s.hogs)]

    def join(self, pid: int) -> None:
        if self.group is not None:
            self.group.add(pid)

    def preexec(self):  # type: ignore[no-untyped-def]
        return (lambda: self.join(os.getpid())) if self.group is not None else None

    def close(self) -> None:
        for p in self.hogs:
            p.kill()
            p.wait()
        if self.group is not None:
            self.group.close()


def run_loader(command: str, mnt: Path, machine: Machine, timeout: float = 900) -> list[dict[str, Any]]:
    """One cold run of the loader through ``mnt``: its own JSON lines (one per epoch with --report-epochs, then
    the run's)."""
    bench.drop_caches()
    words = [w.replace("{mount}", str(mnt)) for w in shlex.split(command)]
    proc = subprocess.Popen(words, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=machine.preexec())
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"loader did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"loader failed ({proc.returncode}): {err[-2000:]}")
    return [json.loads(line) for line in out.strip().splitlines() if line.startswith("{")]


def rate_of(said: list[dict[str, Any]], s: Shape) -> float:
    """The run's images/s: the whole run's, or with a cache its second epoch's."""
    if s.cache:
        return float(next(e for e in said if e.get("epoch") == 2)["images_per_s"])
    return float(said[-1]["images_per_s"])


def static_row(label: str, share: float, s: Shape, src: Path, store: Path, args: argparse.Namespace,
               machine: Machine) -> dict[str, Any]:
    # A cache's state carries from one run to the next: with one, each run has a mount of its own (its first epoch
    # without hits, its second with), as profile --run's runs have.
    mounts, per_mount = (args.repeats, 1) if s.cache else (1, args.repeats)
    runs: list[float] = []
    for _ in range(mounts):
        m = bench.mount(src, store, args.work / "mnt", "--mix", f"{share:g}", *s.mount_args)
        try:
            machine.join(m.pid)
            runs += [rate_of(run_loader(s.command(s.threads_of(args), epochs=s.epochs), m.mnt, machine), s)
                     for _ in range(per_mount)]
        finally:
            m.close()
    row = {"shape": s.name, "config": label, "share": share, "images_per_s": statistics.median(runs),
           "runs": [round(r, 2) for r in runs]}
    print(f"  {s.name:<9} {label:<16} share {share:4.2f}  {row['images_per_s']:7.1f} img/s  runs {row['runs']}",
          file=sys.stderr)
    return row


def profile(s: Shape, src: Path, args: argparse.Namespace, machine: Machine, *extra: str,
            epochs: int | None = None, label: str = "") -> dict[str, Any]:
    """``liquidfs profile SRC --run CMD`` (or with ``extra``; the command reading ``epochs``, by default the
    shape's) in the shape's state: its JSON."""
    out = args.work / f"profile-{s.name}{label}.json"
    searched = "--model-only" not in extra  # (the search's flags: profile refuses them beside --model-only)
    cmd = [sys.executable, "-m", "liquidfs", "profile", str(src), "--store", str(args.work / "store-profile"),
           "--decoder", "dali", "--threads", str(s.threads_of(args)), "--json", str(out), *s.mount_args,
           *(["--run", s.command(s.threads_of(args), epochs=epochs or s.epochs), "--run-images", str(args.images)]
             if searched else []),
           *extra]
    if args.smoke:
        cmd += ["--quick", *(["--repeats", "1"] if searched else [])]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, preexec_fn=machine.preexec())
    if proc.returncode != 0:
        raise RuntimeError(f"profile failed: {proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.monotonic() - started
    print(f"  {s.name:<9} profile{label}: {result['chosen']:.2f} in {result['wall_s']:.0f} s "
          f"({result['chosen_by'][:80]})", file=sys.stderr)
    return result


def adaptive_row(s: Shape, src: Path, store: Path, args: argparse.Namespace, machine: Machine,
                 rate_guess: float, mix: str = "adaptive") -> dict[str, Any]:
    """``--mix adaptive`` (or ``mix``, a fixed share: the same run at the best static share, for a like-for-like
    comparison) under one loader process reading epoch after epoch for about ``--adaptive-seconds``
    (``rate_guess`` images/s sets the epochs), the page cache dropped at each epoch's end; the mix's share read
    every second. Its rate: the images over the seconds of the epochs that ended in the second half."""
    epochs = max(4, math.ceil(args.adaptive_seconds * rate_guess / args.images))
    config = "adaptive" if mix == "adaptive" else "best static, continuous"
    m = bench.mount(src, store, args.work / "mnt", "--mix", mix, "--mix-interval", str(args.mix_interval))
    shares: list[tuple[float, float]] = []
    stop = threading.Event()
    started = time.monotonic()

    def watch() -> None:
        while not stop.wait(1.0):
            try:
                mix = bench.control(m.mnt).get("mix") or {}
                shares.append((round(time.monotonic() - started, 1), mix.get("share")))
            except (OSError, ValueError):
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    done: list[dict[str, Any]] = []
    try:
        machine.join(m.pid)
        bench.drop_caches()
        words = [w.replace("{mount}", str(m.mnt))
                 for w in shlex.split(s.command(s.threads_of(args), epochs=epochs))]
        proc = subprocess.Popen(words, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=machine.preexec())
        watcher.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            said = json.loads(line)
            if "epoch" in said:
                bench.drop_caches()  # the next epoch reads storage, as the static runs' do
                said["t"] = round(time.monotonic() - started, 1)
                said["share"] = shares[-1][1] if shares else None
                done.append(said)
        err = proc.stderr.read() if proc.stderr else ""
        if proc.wait() != 0:
            raise RuntimeError(f"loader failed ({proc.returncode}): {err[-2000:]}")
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        reason = str((bench.control(m.mnt).get("mix") or {}).get("reason", ""))
        m.close()
    total = done[-1]["t"]
    second_half = [e for e in done if e["t"] >= total / 2] or done[-1:]
    rate = sum(e["images"] for e in second_half) / sum(e["seconds"] for e in second_half)
    row = {"shape": s.name, "config": config, "share": second_half[-1]["share"], "images_per_s": rate,
           "runs": [round(e["images_per_s"], 2) for e in second_half], "epochs": done, "shares": shares,
           "last_reason": reason[:300]}
    print(f"  {s.name:<9} {config:<16} settled {row['share']}  {rate:7.1f} img/s  epoch shares "
          f"{[e['share'] for e in done]}", file=sys.stderr)
    return row


def run_shape(s: Shape, src: Path, store: Path, args: argparse.Namespace,
              earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shape's rows: the parts asked for run now, the others taken from ``earlier`` (``--reuse``)."""
    print(f"shape {s.name}: `{s.command(s.threads_of(args), epochs=s.epochs)}`", file=sys.stderr)
    machine = Machine(s, args.work)
    # The profile part runs the model too, as it did before the model was a part of its own
    parts = {*args.parts, *(["model"] if "profile" in args.parts else [])}
    kept = [r for r in earlier if r["shape"] == s.name and PART_OF[r["config"]] not in parts]
    rows: list[dict[str, Any]] = []
    try:
        if "static" in args.parts:
            for share in (SHARES if not args.smoke else [0.0, 0.5, 1.0]):
                rows.append(static_row("static", share, s, src, store, args, machine))
        if "profile" in args.parts:
            measured = profile(s, src, args, machine)
            rows.append({**static_row("profile --run", measured["chosen"], s, src, store, args, machine),
                         "profile": {k: measured.get(k) for k in ("chosen", "chosen_by", "measured",
                                                                  "within_noise", "model_ratio", "search_ratio",
                                                                  "wall_s")}})
            if s.cache:  # the same loader reading one epoch: the profile times it whole, without the cache's hits
                once = profile(s, src, args, machine, epochs=1, label="-one-epoch")
                rows.append({**static_row("profile --run, one epoch", once["chosen"], s, src, store, args, machine),
                             "profile": {k: once.get(k) for k in ("chosen", "chosen_by", "measured", "notes",
                                                                  "wall_s")}})
        if "model" in parts:
            model = profile(s, src, args, machine, "--model-only", label="-model")
            rows.append({**static_row("model", model["chosen"], s, src, store, args, machine),
                         "profile": {k: model.get(k) for k in ("chosen", "chosen_by", "wall_s", "costs", "node",
                                                              "node_detail")}})
        statics = [r for r in kept + rows if r["config"] == "static"]
        guess = max((r["images_per_s"] for r in statics), default=50.0)
        # (the adaptive mix's runs have no cache: a cache shape has the static and profile parts only)
        if "adaptive" in args.parts and not s.cache:
            rows.append(adaptive_row(s, src, store, args, machine, guess))
        if "continuous" in args.parts and statics and not s.cache:
            best = max(statics, key=lambda r: r["images_per_s"])
            rows.append(adaptive_row(s, src, store, args, machine, guess, mix=f"{best['share']:g}"))
    finally:
        machine.close()
    rows = sorted(kept + rows, key=lambda r: list(PART_OF).index(r["config"]))
    statics = [r for r in rows if r["config"] == "static"]
    if statics:
        best = max(statics, key=lambda r: r["images_per_s"])
        for r in rows:
            r["vs_best"] = r["images_per_s"] / best["images_per_s"]
            r["within_noise_of_best"] = within_noise(r["runs"], best["runs"])
    # The adaptive mix runs one loader for minutes, without a start-up per epoch: against the best static share
    # run the same way.
    same_way = next((r for r in rows if r["config"] == "best static, continuous"), None)
    adaptive = next((r for r in rows if r["config"] == "adaptive"), None)
    if same_way and adaptive:
        adaptive["vs_best"] = adaptive["images_per_s"] / same_way["images_per_s"]
        adaptive["within_noise_of_best"] = within_noise(adaptive["runs"], same_way["runs"])
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = []
    for name in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == name]
        statics = [r for r in mine if r["config"] == "static"]
        if not statics:
            continue
        best = max(statics, key=lambda r: r["images_per_s"])
        lines += [f"**{name}** (best static: {best['share']:.1f}, {best['images_per_s']:.1f} img/s)", "",
                  "| share | " + " | ".join(f"{r['share']:.1f}" for r in statics) + " |",
                  "|---|" + "---|" * len(statics),
                  "| img/s | " + " | ".join(f"{r['images_per_s']:.1f}" + ("*" if r["within_noise_of_best"] else "")
                                           for r in statics) + " |", ""]
        lines += ["| chooser | share | img/s (its runs) | vs best static | the 11's run at that share | goal |",
                  "|---|---|---|---|---|---|"]
        grid = {round(r["share"], 2): r for r in statics}
        for r in mine:
            if r["config"] == "static":
                continue
            share = f"{r['share']:.2f}" if isinstance(r["share"], (int, float)) else "-"
            # A chooser that picked one of the 11 shares: that share's own static runs count too (a share's rate
            # drifts by a few percent between two runs of it minutes apart, more under the CPU hog).
            same = grid.get(round(r["share"], 2)) if r["config"] in ("profile --run", "profile --run, one epoch",
                                                                     "model") else None
            at_grid = f"{same['images_per_s'] / best['images_per_s']:.3f}" if same else "-"
            ok = ("-" if r["config"] == "best static, continuous"  # the yardstick, not a chooser
                  else "met" if r["vs_best"] >= GOAL or r["within_noise_of_best"]
                  or (same is not None and same["images_per_s"] >= GOAL * best["images_per_s"]) else "not met")
            lines.append(f"| {r['config']} | {share} | {r['images_per_s']:.1f} | {r['vs_best']:.3f} | {at_grid} "
                         f"| {ok} |")
        lines.append("")
    lines.append("(* within noise of the best static: 3 %, or the runs' spread. The adaptive row is against the best "
                 "static share run the same way, one loader for minutes: the 'best static, continuous' row)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="DALI threads / DataLoader workers (default 2)")
    parser.add_argument("--adaptive-seconds", type=float, default=240.0)
    parser.add_argument("--mix-interval", type=float, default=2.0)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="which to run: static (the 11 shares), profile (profile --run and the model, then "
                        "their choices), model (the model alone), adaptive, continuous; the others are taken from "
                        "--reuse")
    parser.add_argument("--reuse", type=Path, metavar="JSON", help="an earlier run's JSON: its rows of the parts not "
                        "run now")
    bench.add_run_arguments(parser, results="WORK/mix.json", work=REPO / "out" / "mix",
                            smoke="24 images of 512x256, shapes uncapped and cap200, shares 0/0.5/1, 1 repeat")
    args = parser.parse_args()
    shapes = bench.split_choices(parser, args.shapes, SHAPES, "shape")
    args.parts = bench.split_choices(parser, args.parts, PARTS, "part")
    earlier: list[dict[str, Any]] = json.loads(args.reuse.read_text())["rows"] if args.reuse else []
    if args.smoke:
        args.images, args.width, args.height, args.repeats = 24, 512, 256, 1
        args.adaptive_seconds = 20.0
        if args.shapes == ",".join(SHAPES):
            shapes = ["uncapped", "cap200"]
    problem = bench.root_problem("before every run")
    if problem is None and any(shape(n).cap_mb for n in shapes):
        problem = _throttle.available()
    if problem:
        print(f"bench_mix: {problem}", file=sys.stderr)
        return 2
    args.work = bench.work_dir(args.work)
    started = time.time()
    src = bench.dataset(bench.dataset_dir(args.work, args.images, args.width, args.height), args.images,
                        args.width, args.height)
    store = bench.store_for(src.parent, src, 1.0)
    rows: list[dict[str, Any]] = []
    for name in shapes:
        rows += run_shape(shape(name), src, store, args, earlier)
    out = (args.json or args.work / "mix.json").absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv, "started": started, "seconds": time.time() - started, "images": args.images,
            "size": f"{args.width}x{args.height}", "repeats": args.repeats, "threads": args.threads,
            "shape_threads": {n: shape(n).threads_of(args) for n in shapes},
            "adaptive_seconds": args.adaptive_seconds, "mix_interval": args.mix_interval, "smoke": args.smoke,
            "parts": args.parts, "reused": str(args.reuse) if args.reuse else None}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(markdown(rows))
    print(f"\n(JSON {out}, {time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
