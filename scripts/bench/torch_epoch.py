"""An unmodified torchvision ImageFolder + DataLoader over a directory, read or trained on: JSON lines on stdout.

    python scripts/bench/torch_epoch.py FILE_ROOT [--images N] [--epochs 1] --batch 16 --workers 2 [--seed S]
                                        [--report-epochs]
    python scripts/bench/torch_epoch.py FILE_ROOT --train resnet50 --device gpu --epochs 3 --batch 64 --workers 12
                                        [--crop 224] [--handshake]

Reading (the counterpart of dali_epoch.py for bench_e2e.py's `--loader torch`): decoding is torchvision's default
loader (Pillow, converted to RGB) in the DataLoader's worker processes, to a tensor and no further; CPU time
includes the workers.

Training (``--train MODEL``: bench_train.py's `--loader torch`): the loop people write, untouched by liquidfs:
``ImageFolder`` with RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize, ``DataLoader(num_workers=
--workers, shuffle=True, pin_memory=True, persistent_workers=False)``, the model randomly initialised
(throughput, not accuracy, is measured) in channels_last under bf16 autocast, SGD. On the CPU (``--device cpu``:
for tests of the script, not a measurement) the same loop without autocast or pinned memory. A JSON line per
epoch: images, images/s, the trainer's CPU seconds (its own and its reaped workers'), the GPU's mean utilisation.
With ``--handshake`` each epoch starts only once stdin says ``go`` after a ``{"ready": N}`` line, so that the
driver can drop the page cache first; the workers are started only then (not persistent), as nothing may read
before the drop.

Also what bench_train.py's DALI trainer takes from here: the models (``build_model``) and ``GpuSampler``. No
import of liquidfs, DALI or matplotlib: a GPU host without them runs this.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

MODELS = ("mobilenet", "deeplab", "resnet50", "tiny")
# ImageNet's mean and std, as the torchvision recipes normalize (of pixels scaled to [0, 1])
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class GpuSampler(threading.Thread):
    """GPU utilisation (%) sampled every half second with nvidia-smi (NVML underneath); empty without a GPU."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[float] = []
        # not ``_stop``: that is Thread's own method, which a fork (a DataLoader's worker) calls on every thread
        self._stopping = threading.Event()
        self._proc: subprocess.Popen[str] | None = None

    def run(self) -> None:
        if shutil.which("nvidia-smi") is None:
            return
        self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                       "-lms", "500", "-i", "0"], stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if self._stopping.is_set():
                break
            try:
                self.samples.append(float(line.strip()))
            except ValueError:
                pass

    def take(self) -> float | None:
        """The mean since the last take, and start again."""
        samples, self.samples = self.samples, []
        return statistics.fmean(samples) if samples else None

    def stop(self) -> None:
        self._stopping.set()
        if self._proc is not None:
            self._proc.terminate()


def build_model(name: str, classes: int, device: str) -> Any:
    import torch
    import torchvision

    if name == "mobilenet":
        model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=classes)
    elif name == "deeplab":
        model = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None,
                                                                   num_classes=classes)
    elif name == "resnet50":
        model = torchvision.models.resnet50(weights=None, num_classes=classes)
    else:  # tiny: the CPU mode's stand-in, so a test of the script costs seconds
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4), torch.nn.ReLU(),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, classes))
    return model.to(device).train()


def forward_loss(model: Any, loss_fn: Any, x: Any, y: Any) -> Any:
    """The batch's loss: a classifier's logits against the labels, or a segmentation model's (a dict) per pixel
    against each image's label over all of its pixels."""
    out = model(x)
    if isinstance(out, dict):
        out = out["out"]
        y = y.view(-1, 1, 1).expand(-1, out.shape[2], out.shape[3])
    return loss_fn(out, y)


def cpu_seconds() -> float:
    """This process's CPU seconds and those of its children waited for (a DataLoader's workers, once an epoch's
    iterator has joined them)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file_root")
    parser.add_argument("--images", type=int, help="reading: stop after this many images (default: whole epochs)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-epochs", action="store_true", help="reading: a JSON line per epoch too")
    parser.add_argument("--train", choices=MODELS, metavar="MODEL", help=f"train this model ({', '.join(MODELS)})")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="cpu", help="training: where (default cpu)")
    parser.add_argument("--crop", type=int, default=224, help="training: random resized crop, pixels a side")
    parser.add_argument("--handshake", action="store_true",
                        help='training: print {"ready": N} and wait for "go" on stdin before each epoch')
    return parser.parse_args(argv)


def read(args: argparse.Namespace) -> None:
    import torch
    from torchvision import datasets, transforms

    torch.manual_seed(args.seed)
    dataset = datasets.ImageFolder(args.file_root, transform=transforms.PILToTensor())
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers)
    started = epoch_started = time.perf_counter()
    done = 0
    epoch = 0
    limit = args.images if args.images is not None else float("inf")
    while epoch < args.epochs and done < limit:
        epoch_done = 0
        for images, _ in loader:
            done += len(images)
            epoch_done += len(images)
            if done >= limit:
                break
        epoch += 1
        if args.report_epochs:
            now = time.perf_counter()
            print(json.dumps({"epoch": epoch, "images": epoch_done, "seconds": now - epoch_started,
                              "images_per_s": epoch_done / (now - epoch_started)}), flush=True)
            epoch_started = now
        if epoch_done == 0:
            break
    elapsed = time.perf_counter() - started
    print(json.dumps({"images": done, "seconds": elapsed, "images_per_s": done / elapsed,
                      "loader_cpu_s": cpu_seconds()}))


def train(args: argparse.Namespace) -> int:
    import torch
    from torchvision import datasets, transforms

    gpu = args.device == "gpu"
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(args.seed)
    transform = transforms.Compose([transforms.RandomResizedCrop(args.crop), transforms.RandomHorizontalFlip(),
                                    transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    dataset = datasets.ImageFolder(args.file_root, transform=transform)
    # pin_memory only with a GPU: without one torch warns that it does nothing
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                         pin_memory=gpu, persistent_workers=False)
    model = build_model(args.train, len(dataset.classes), device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    sampler = GpuSampler()
    sampler.start()
    for epoch in range(1, args.epochs + 1):
        if args.handshake:
            print(json.dumps({"ready": epoch}), flush=True)
            if sys.stdin.readline().strip() != "go":
                return 1
        cpu0 = cpu_seconds()
        sampler.take()
        started = time.perf_counter()
        images = 0
        for x, y in loader:
            x = x.to(device, non_blocking=gpu, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=gpu)
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=gpu):
                loss = forward_loss(model, loss_fn, x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            images += x.shape[0]
        if gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        print(json.dumps({"epoch": epoch, "images": images, "seconds": seconds, "images_per_s": images / seconds,
                          "trainer_cpu_s": cpu_seconds() - cpu0, "gpu_util": sampler.take(),
                          "loss": float(loss.detach()) if images else None}), flush=True)
    sampler.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.train:
        return train(args)
    read(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
