"""Training end to end (issues 18 and 40): an unmodified training loop reading PNGs directly, a BMP copy directly,
and liquidfs at a mix (with and without the next-epoch cache), through DALI or through torchvision's DataLoader.

    python scripts/bench/bench_train.py [--images 1000] [--size 2048x1024] [--models mobilenet,deeplab] [--cores 8,4]
        [--epochs 3] [--ratio auto] [--cache-size 30%] [--json out/train/train.json]
    python scripts/bench/bench_train.py --loader torch --cores 4,12,16 --ratio 1 [--images 1024 --epochs 3]
    python scripts/bench/bench_train.py [--loader torch] --smoke   # 24 tiny images, the CPU, a tiny model

The training script is what people write, untouched by liquidfs. ``--loader dali`` (the default):
``fn.readers.file`` (random shuffle) -> ``fn.decoders.image(device="mixed")`` -> random resized crop (--crop,
512), flip and normalize on the GPU (liquidfs.profile.loaders.dali_pipeline, the pipeline every DALI loop of the
project builds) -> DALI's PyTorch iterator -> a torchvision model, randomly initialised
(throughput, not accuracy, is measured), fp16 mixed precision, SGD, batch 32. Two models: MobileNetV3-small
(little compute per image: the loader binds) and DeepLabV3-ResNet50 (much: the GPU binds). ``--loader torch``
(torch_epoch.py): ``ImageFolder`` + ``DataLoader(num_workers=cores, shuffle=True, pin_memory=True,
persistent_workers=False)`` decoding with Pillow, RandomResizedCrop 224 + flip + ToTensor + Normalize, ResNet-50
in bf16 autocast and channels_last, SGD, batch 64: the loop of issue 40's GPU node; it needs PyTorch, torchvision,
Pillow and NumPy, and neither DALI, matplotlib nor scikit-image (the sample falls back as scripts/sample.py says).
Without a GPU (or with --device cpu) either loop runs on the CPU with a tiny convolutional model: only so that the
script can be tested anywhere, not a measurement.

Configurations, each over the same images:
    direct-png      the source tree read directly (all PNG)
    direct-bmp      a plain copy with every image as its BMP (what a mount at ratio 1 serves), read directly
    liquidfs        a mount of the store prepared at --ratio (default: what `liquidfs profile` chooses here); a
                    store prepared at R serves what a mount's --mix R serves (prepare keeps a seeded prefix), so
                    --ratio 1 and --ratio 0.5 are the GPU node's `--mix 1` and `--mix 0.5`
    liquidfs-cache  the same mount with --cache-size (the next-epoch cache)
    liquidfs-j2k    a mount of a store with every image as lossless JPEG 2000 (prepare --formats png,j2k,bmp
                    --ratio 1; BMP for the few J2K cannot hold): on a GPU, nvJPEG2000 decodes them, the CPU only
                    reads; without one, DALI's CPU decoder does (slowly: the smoke test only shows it works). Not
                    run by default with --loader torch (Pillow decodes J2K on the CPU, 10x slower than PNG)

Each (configuration, model, core count) is one training process, pinned to the first N cores (a GPU node gives
each GPU a few cores; the balance depends on it), its loader's threads or worker processes and the liquidfs
daemon pinned to the same ones. The page cache is dropped before epoch 1 (``--cold first``, DALI's default:
epochs 2.. follow without a drop) or before every epoch (``--cold every``, torch's default, as the GPU node was
measured). Per epoch: training images/s, the trainer's CPU seconds (DALI's threads and PyTorch's, or the
trainer's and its DataLoader workers'), the daemon's, and the GPU utilisation (NVML, sampled by nvidia-smi).
Output: a markdown table (epoch 1 and epochs 2.. separately, with liquidfs / direct-png), JSON at --json, and
beside it a PNG chart (where matplotlib is installed) and each run's log. Needs root on Linux (drop_caches).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402  (dataset, stores, profile, mount, page cache: one copy of each)
from sample import make_mosaics, photo_files  # noqa: E402
from torch_epoch import MODELS, GpuSampler, build_model, forward_loss  # noqa: E402

CONFIGS = ("direct-png", "direct-bmp", "liquidfs", "liquidfs-cache", "liquidfs-j2k")
J2K_FORMATS = ("j2k", "bmp")  # prepare --formats png,j2k,bmp: J2K first, BMP where J2K cannot hold an image
# What each loader runs unless told: DALI the two models of issue 18, torchvision the GPU node's loop (issue 40);
# liquidfs-j2k is for nvJPEG2000, which only DALI's decoder reaches
DEFAULTS = {"dali": {"configs": CONFIGS, "models": "mobilenet,deeplab", "batch": 32, "crop": 512, "cold": "first"},
            "torch": {"configs": CONFIGS[:4], "models": "resnet50", "batch": 64, "crop": 224, "cold": "every"}}


# -- the training process ---------------------------------------------------------------------------------


def train_main(argv: list[str]) -> int:
    """One configuration: train --epochs epochs over FILE_ROOT, a JSON line per epoch on stdout."""
    parser = argparse.ArgumentParser(prog="bench_train.py train")
    parser.add_argument("file_root")
    parser.add_argument("--device", choices=["gpu", "cpu"], required=True)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--crop", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import resource

    import torch
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from liquidfs.profile.loaders import READER, dali_pipeline

    gpu = args.device == "gpu"
    classes = len([d for d in Path(args.file_root).iterdir() if d.is_dir()]) or 1

    device = "cuda" if gpu else "cpu"
    torch.manual_seed(args.seed)
    model = build_model(args.model, classes, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=gpu)
    loss_fn = torch.nn.CrossEntropyLoss()
    sampler = GpuSampler()
    sampler.start()
    batches = None
    for epoch in range(1, args.epochs + 1):
        # The driver drops the page cache before epoch 1, then says go: epoch 1 is cold. The pipeline is built
        # only then, since DALI's iterator starts reading (its prefetch) as soon as it exists.
        sys.stdout.write(json.dumps({"ready": epoch}) + "\n")
        sys.stdout.flush()
        if sys.stdin.readline().strip() != "go":
            return 1
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        sampler.take()
        started = time.perf_counter()
        if batches is None:
            # The package's pipeline: decode on the GPU ("mixed"), then the model's input pipeline (random resized
            # crop, flip, normalize) on it too
            pipeline = dali_pipeline(file_root=args.file_root, batch=args.batch, threads=args.threads,
                                     device="mixed" if gpu else "cpu", seed=args.seed, crop=args.crop)
            batches = DALIGenericIterator(pipeline, ["images", "labels"], reader_name=READER,
                                          last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)
        images = 0
        for batch in batches:
            x = batch[0]["images"]
            y = batch[0]["labels"].reshape(-1).long()
            with torch.autocast(device_type=device, dtype=torch.float16, enabled=gpu):
                loss = forward_loss(model, loss_fn, x, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            images += x.shape[0]
        if gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
        sys.stdout.write(json.dumps({"epoch": epoch, "images": images, "seconds": seconds,
                                     "images_per_s": images / seconds, "trainer_cpu_s": cpu,
                                     "gpu_util": sampler.take(), "loss": float(loss)}) + "\n")
        sys.stdout.flush()
    sampler.stop()
    return 0


# -- the driver -------------------------------------------------------------------------------------------


def dataset(work: Path, images: int, width: int, height: int) -> Path:
    """``images`` Cityscapes-like PNG mosaics under ``work/data`` (kept for the next run), made by every core
    (``sample.make_mosaics``: bench_e2e's serial sample takes an hour on 2)."""
    src = work / "data"
    marker = src / "meta.json"
    # The photos' source is part of the key: a synthetic dataset is never taken for one of photos
    want = {"count": images, "width": width, "height": height, "generator": "bench_train",
            "photos": photo_files()[1]}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return src
    shutil.rmtree(src, ignore_errors=True)
    print(f"generating {images} {width}x{height} images of {want['photos']} in {src}", file=sys.stderr)
    make_mosaics(src / bench.SUBDIR, images, width, height)
    marker.write_text(json.dumps(want))
    return src


@dataclass
class Run:
    config: str
    model: str
    cores: int
    ratio: float | None
    epochs: list[dict[str, Any]] = field(default_factory=list)
    mount: dict[str, Any] | None = None   # the mount's statistics after the run (liquidfs configurations)
    error: str | None = None


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` and of its children, theirs too, onto ``cores``: a mount's other loops (``mount
    --loops``) and its read-ahead helper are processes of their own, and would run on the cores left free."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
            children = (task / "children").read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        for child in children:
            pin(int(child), cores)


def mount_on(cores: set[int], src: Path, store: Path, mnt: Path, *extra: str) -> bench.Mounted:
    """``bench.mount`` started on ``cores``: the daemon sizes itself by the cores it may use (``--loops auto``,
    one loop per 4), and every process it starts inherits them; pinned again after, should one have escaped."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        mounted = bench.mount(src, store, mnt, *extra)
    finally:
        os.sched_setaffinity(0, own)
    pin(mounted.pid, cores)
    return mounted


def trainer(root: Path, model: str, args: argparse.Namespace, cores: set[int]) -> list[str]:
    """The training process's command: DALI's loop below (``train``), or torch_epoch.py's with a worker process
    per core."""
    common = [str(root), "--device", args.device, "--epochs", str(args.epochs), "--batch", str(args.batch),
              "--crop", str(args.crop)]
    if args.loader == "torch":
        return [sys.executable, str(bench.TORCH_EPOCH), *common, "--train", model, "--workers", str(len(cores)),
                "--handshake"]
    return [sys.executable, str(Path(__file__).resolve()), "train", *common, "--model", model,
            "--threads", str(len(cores))]


def train(run: Run, root: Path, args: argparse.Namespace, cores: set[int], daemon: bench.Mounted | None) -> None:
    cmd = trainer(root, run.model, args, cores)
    log = (args.json.parent / f"train-{run.config}-{run.model}-{run.cores}.log").open("w")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))
    assert proc.stdin is not None and proc.stdout is not None
    daemon_cpu = None
    try:
        for line in proc.stdout:
            message = json.loads(line)
            if "ready" in message:
                if (message["ready"] == 1 or args.cold == "every") and args.drop_caches:
                    bench.drop_caches()
                daemon_cpu = bench.cpu_seconds(daemon.pid) if daemon else None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                continue
            if daemon is not None and daemon_cpu is not None:
                message["daemon_cpu_s"] = bench.cpu_seconds(daemon.pid) - daemon_cpu
            run.epochs.append(message)
            print(f"  {run.config:<15} {run.model:<9} {run.cores:>2} cores  epoch {message['epoch']}  "
                  f"{message['images_per_s']:8.1f} img/s  trainer CPU {message['trainer_cpu_s']:6.1f} s"
                  + (f"  GPU {message['gpu_util']:.0f} %" if message.get("gpu_util") is not None else ""),
                  file=sys.stderr)
        if proc.wait(timeout=args.timeout) != 0:
            raise RuntimeError(f"training failed (exit {proc.returncode}): {bench.tail(Path(log.name))}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def run_one(run: Run, roots: dict[str, Path], src: Path, stores: dict[str, Path], args: argparse.Namespace) -> None:
    cores = set(sorted(os.sched_getaffinity(0))[:run.cores])
    if not run.config.startswith("liquidfs"):
        train(run, roots[run.config], args, cores, None)
        return
    store = stores[run.config]
    mnt = args.work / "mnt"
    extra = ["--cache-size", args.cache_size] if run.config == "liquidfs-cache" else []
    extra += args.mount_options.split()
    mount = mount_on(cores, src, store, mnt, *extra)
    try:
        train(run, mnt / bench.SUBDIR, args, cores, mount)
        stats = bench.control(mnt)
        run.mount = {key: stats.get(key) for key in ("data_path", "opens", "opens_raw", "bytes_from_storage",
                                                      "bytes_from_memory", "fallbacks", "errors", "cache")}
    finally:
        mount.close()


def summary(runs: list[Run]) -> list[dict[str, Any]]:
    """Per (model, cores): each configuration's epoch-1 and later-epochs images/s, and x direct-png."""
    rows = []
    for key in sorted({(r.model, r.cores) for r in runs}, key=lambda k: (k[0], -k[1])):
        group = {r.config: r for r in runs if (r.model, r.cores) == key and r.epochs and not r.error}
        row: dict[str, Any] = {"model": key[0], "cores": key[1], "configs": {}}
        for config, run in group.items():
            later = [e["images_per_s"] for e in run.epochs[1:]]
            row["configs"][config] = {
                "cold": run.epochs[0]["images_per_s"], "later": statistics.median(later) if later else None,
                "trainer_cpu_s_per_image": sum(e["trainer_cpu_s"] for e in run.epochs)
                / max(1, sum(e["images"] for e in run.epochs)),
                "gpu_util": statistics.fmean([e["gpu_util"] for e in run.epochs if e.get("gpu_util") is not None])
                if any(e.get("gpu_util") is not None for e in run.epochs) else None}
        base = row["configs"].get("direct-png")
        for values in row["configs"].values():
            for when in ("cold", "later"):
                if base and base[when] and values[when]:
                    values[f"{when}_x_png"] = values[when] / base[when]
        rows.append(row)
    return rows


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "" if x is None else format(x, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | cores | configuration | epoch 1 (cold) img/s | x png | epochs 2.. img/s | x png | "
             "trainer CPU ms/img | GPU util % |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for config in CONFIGS:
            v = row["configs"].get(config)
            if v is None:
                continue
            lines.append(f"| {row['model']} | {row['cores']} | {config} | {_num(v['cold'])} | "
                         f"{_num(v.get('cold_x_png'), '.2f')} | {_num(v['later'])} | "
                         f"{_num(v.get('later_x_png'), '.2f')} | {v['trainer_cpu_s_per_image'] * 1000:.1f} | "
                         f"{_num(v['gpu_util'], '.0f')} |")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(rows)), 4))
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        xs, ys = [], []
        for x, row in enumerate(rows):
            v = row["configs"].get(config)
            if v and v["later"]:
                xs.append(x + (i - len(CONFIGS) / 2 + 0.5) * width)
                ys.append(v["later"])
        if xs:
            ax.bar(xs, ys, width, label=config)
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['cores']} cores" for r in rows])
    ax.set_ylabel("training images/s (epochs 2..)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def gpus() -> str | None:
    """The GPUs nvidia-smi lists (one line each), or None where it sees none."""
    if shutil.which("nvidia-smi") is None:
        return None
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return (listed.stdout.strip() or None) if listed.returncode == 0 else None


def _is_share(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--size", default="2048x1024", help="WIDTHxHEIGHT of the generated images")
    parser.add_argument("--loader", choices=list(DEFAULTS), default="dali",
                        help="the training loop: DALI's pipeline, or torchvision's ImageFolder + DataLoader")
    parser.add_argument("--configs", help=f"of {', '.join(CONFIGS)} (default: all; with --loader torch, all but "
                        "liquidfs-j2k)")
    parser.add_argument("--models", help=f"of {', '.join(MODELS)} (default mobilenet,deeplab; with --loader torch, "
                        "resnet50)")
    parser.add_argument("--cores", default="8,4", help="core counts to pin each run to (capped at this machine's)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, help="images a batch (default 32; with --loader torch, 64)")
    parser.add_argument("--crop", type=int, help="random resized crop, pixels a side (default 512; with --loader "
                        "torch, 224)")
    parser.add_argument("--cold", choices=["first", "every"],
                        help="drop the page cache before the first epoch or before every one (default first; with "
                        "--loader torch, every)")
    parser.add_argument("--ratio", default="auto", help="the liquidfs store's raw share in [0, 1], which its mount "
                        "serves as `mount --mix` at that share would (1: every image raw), or auto (liquidfs profile)")
    parser.add_argument("--cache-size", default="30%", help="liquidfs-cache's --cache-size")
    parser.add_argument("--mount-options", default="", metavar="OPTS",
                        help="more flags for every liquidfs mount, e.g. \"--loops 4\" (one string)")
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                        help="decode and train on the GPU (auto: when nvidia-smi sees one)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a training run may take")
    bench.add_run_arguments(parser, results="out/train/train.json", work=bench.REPO / "out" / "bench-train",
                            work_help="dataset, stores and the mountpoint (the dataset is kept per count and size)",
                            smoke="24 images of 256x128, CPU decode, the tiny model, batch 4, 2 epochs, ratio 0.5")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.loader].items():
        if getattr(args, name) is None:
            setattr(args, name, ",".join(value) if name == "configs" else value)
    if args.smoke:
        args.images, args.size, args.models, args.device, args.batch = 24, "256x128", "tiny", "cpu", 4
        args.epochs, args.crop, args.ratio = 2, 64, "0.5"
    args.gpus = gpus() if args.device != "cpu" else None
    if args.device == "auto":
        args.device = "gpu" if args.gpus else "cpu"
    if args.ratio != "auto" and not _is_share(args.ratio):
        parser.error(f"--ratio: 'auto' or a share in [0, 1], not {args.ratio!r}")  # now, not after the dataset
    args.width, args.height = map(int, args.size.lower().split("x"))
    args.configs = bench.split_choices(parser, args.configs, CONFIGS, "configuration")
    args.models = bench.split_choices(parser, args.models, MODELS, "model")
    if args.device == "cpu" and "tiny" not in args.models:
        print("bench_train: no GPU here; training the tiny model on the CPU (not a measurement)", file=sys.stderr)
        args.models = ["tiny"]
    available = len(os.sched_getaffinity(0))
    args.cores = sorted({min(int(c), available) for c in args.cores.split(",") if c}, reverse=True)
    args.drop_caches = os.geteuid() == 0 and Path("/proc/sys/vm/drop_caches").exists()
    args.json = (args.json or bench.REPO / "out" / "train" / "train.json").absolute()
    args.work = args.work.absolute()
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        return train_main(argv[1:])
    args = parse_args(argv)
    if sys.platform != "linux":
        print("bench_train: needs Linux", file=sys.stderr)
        return 2
    if not args.drop_caches:
        print("bench_train: not root: epoch 1 is not cold (the page cache cannot be dropped)", file=sys.stderr)
    started = time.time()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    data_work = bench.dataset_dir(args.work, args.images, args.width, args.height)
    src = dataset(data_work, args.images, args.width, args.height)
    ratio = None
    stores: dict[str, Path] = {}
    if any(c in ("liquidfs", "liquidfs-cache") for c in args.configs):
        ratio = bench.auto_ratio(data_work, src) if args.ratio == "auto" else float(args.ratio)
        stores["liquidfs"] = stores["liquidfs-cache"] = bench.store_for(data_work, src, ratio)
    if "liquidfs-j2k" in args.configs:
        stores["liquidfs-j2k"] = bench.store_for(data_work, src, 1.0, J2K_FORMATS)
    roots = {"direct-png": src / bench.SUBDIR}
    if "direct-bmp" in args.configs:
        roots["direct-bmp"] = bench.bmp_copy(data_work, src) / bench.SUBDIR
    meta = {"argv": sys.argv, "started": started, "images": args.images, "size": args.size, "epochs": args.epochs,
            "batch": args.batch, "crop": args.crop, "device": args.device, "ratio": ratio,
            "cache_size": args.cache_size, "loader": args.loader, "cold": args.cold,
            "cores_available": len(os.sched_getaffinity(0)), "gpu": args.gpus if args.device == "gpu" else None}
    print(f"{args.images} images {args.size}, {args.loader} on {args.device}, models {args.models}, "
          f"cores {args.cores}, liquidfs ratio {ratio}", file=sys.stderr)
    runs: list[Run] = []
    out = args.json
    for model in args.models:
        for cores in args.cores:
            for config in args.configs:
                run = Run(config, model, cores, {"liquidfs": ratio, "liquidfs-cache": ratio,
                                                 "liquidfs-j2k": 1.0}.get(config))
                runs.append(run)
                try:
                    run_one(run, roots, src, stores, args)
                except (subprocess.CalledProcessError, RuntimeError, OSError, ValueError) as exc:
                    run.error = str(exc)
                    print(f"  {config} {model} {cores}: FAILED: {exc}", file=sys.stderr)
                meta["seconds"] = time.time() - started
                out.write_text(json.dumps({"meta": meta, "summary": summary(runs),
                                           "runs": [asdict(r) for r in runs]}, indent=1))
    rows = summary(runs)
    drawn = chart(rows, out.with_suffix(".png"))
    print(markdown(rows))
    print(f"\n(JSON {out}" + (f", chart {out.with_suffix('.png')}" if drawn else ", no chart: matplotlib missing")
          + f", {time.time() - started:.0f} s)")
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
