"""The built-in loaders ``liquidfs profile`` times through a mount when no ``--run`` command is given.

    python -m liquidfs.profile.loaders {dali,pil} DIR [--threads T] [--batch 16] [--epochs 1] [--no-augment]
                                 [--shuffle-buffer 1024] [--report-epochs]

Each reads every image under DIR (any layout) once per epoch in a seeded random order and does the per-image work
a training loader does on the CPU: decode, then (unless ``--no-augment``) a random resized crop to 224 x 224, a
random horizontal flip, and normalisation to float. ``dali``: DALI's CPU pipeline (``fn.readers.file`` over the
list of files, ``fn.decoders.image``, ``fn.random_resized_crop``, ``fn.crop_mirror_normalize``), as
``scripts/bench/dali_epoch.py`` runs it; ``pil``: Pillow on a pool of threads, as torchvision's default loader
decodes. It prints one JSON line: the images it delivered and its own rate (from the first batch asked for, its
set-up left out), which tests compare with the rate the mount saw.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

CROP = 224
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
#: What the loaders open: the suffixes ``prepare`` expands and serves raw under their own names.
SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".tif", ".tiff", ".webp")


def image_files(root: Path) -> list[str]:
    """Every image under ``root``, sorted (the loader shuffles them by its seed)."""
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        found.extend(os.path.join(folder, f) for f in sorted(files) if f.lower().endswith(SUFFIXES))
    return found


def _pil_one(path: str, rng: random.Random, augment: bool) -> int:
    import numpy as np
    from PIL import Image

    with Image.open(path) as opened:
        im = opened.convert("RGB")
        if not augment:
            return im.width * im.height
        # torchvision's RandomResizedCrop: a random area (8-100 %) and aspect ratio (3/4-4/3), resized to CROP.
        w, h = im.size
        area = w * h * rng.uniform(0.08, 1.0)
        aspect = rng.uniform(3 / 4, 4 / 3)
        cw, ch = min(w, max(1, round((area * aspect) ** 0.5))), min(h, max(1, round((area / aspect) ** 0.5)))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        crop = im.resize((CROP, CROP), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        array = (np.asarray(crop, dtype=np.float32) - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
        return int(array.size)


def run_pil(files: Sequence[str], *, threads: int, batch: int, epochs: int, seed: int, augment: bool,
            shuffle_buffer: int = 0) -> Iterator[int]:
    """0 once set up, then the images delivered, a batch at a time."""
    order = random.Random(seed)
    with cf.ThreadPoolExecutor(threads) as pool:
        yield 0
        for epoch in range(epochs):
            shuffled = list(files)
            order.shuffle(shuffled)
            rngs = [random.Random(seed * 1_000_003 + epoch * len(files) + i) for i in range(len(shuffled))]
            # Up to two batches in flight, as a DataLoader's prefetch keeps its workers busy.
            window = max(1, 2 * batch)
            pending: list[cf.Future[int]] = []
            for path, rng in zip(shuffled, rngs):
                pending.append(pool.submit(_pil_one, path, rng, augment))
                if len(pending) >= window:
                    done, pending = pending[:batch], pending[batch:]
                    for future in done:
                        future.result()
                    yield len(done)
            while pending:
                done, pending = pending[:batch], pending[batch:]
                for future in done:
                    future.result()
                yield len(done)


def run_dali(files: Sequence[str], *, threads: int, batch: int, epochs: int, seed: int, augment: bool,
             shuffle_buffer: int = 1024) -> Iterator[int]:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=seed)
    def pipe():  # type: ignore[no-untyped-def]
        encoded, labels = fn.readers.file(files=list(files), random_shuffle=True, initial_fill=shuffle_buffer,
                                          name="reader")
        images = fn.decoders.image(encoded, device="cpu")
        if augment:
            images = fn.random_resized_crop(images, size=[CROP, CROP])
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=list(MEAN),
                                              std=list(STD), mirror=fn.random.coin_flip())
        return images, labels

    p = pipe()
    p.build()
    yield 0  # built: the clock starts at the first batch asked for, as a training loop's does
    total = 0
    # DALI's reader wraps its last batch into the next epoch: counting to epochs x files keeps the total exact.
    while total < epochs * len(files):
        images, _ = p.run()
        n = min(len(images), epochs * len(files) - total)
        total += n
        yield n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m liquidfs.profile.loaders", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("loader", choices=["dali", "pil"])
    parser.add_argument("root", type=Path, help="the directory to read (a liquidfs mount)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-augment", dest="augment", action="store_false",
                        help="decode only (no random resized crop, flip, normalisation)")
    parser.add_argument("--shuffle-buffer", type=int, default=1024,
                        help="dali: the reader's initial_fill, the files it opens ahead to shuffle among (default "
                        "1024, DALI's own). With fewer images than this, an epoch's files are all opened before "
                        "its first batch, and reading and decoding no longer overlap")
    parser.add_argument("--report-epochs", action="store_true", help="a JSON line per epoch too")
    args = parser.parse_args(argv)
    files = image_files(args.root)
    if not files:
        print(f"{parser.prog}: no images under {args.root}", file=sys.stderr)
        return 2
    run = run_dali if args.loader == "dali" else run_pil
    batches = run(files, threads=args.threads, batch=args.batch, epochs=args.epochs, seed=args.seed,
                  augment=args.augment, shuffle_buffer=args.shuffle_buffer)
    next(batches)  # set up (DALI builds its pipeline): not the loader's pace
    started = epoch_started = time.perf_counter()
    done = epoch_done = reported = 0
    for n in batches:
        done += n
        epoch_done += n
        while args.report_epochs and epoch_done >= len(files):
            # A batch that crosses an epoch's end: its images past it count towards the next epoch.
            now = time.perf_counter()
            reported += 1
            print(json.dumps({"epoch": reported, "images": len(files), "seconds": now - epoch_started,
                              "images_per_s": len(files) / (now - epoch_started)}), flush=True)
            epoch_started, epoch_done = now, epoch_done - len(files)
    elapsed = time.perf_counter() - started
    print(json.dumps({"loader": args.loader, "augment": args.augment, "images": done, "seconds": elapsed,
                      "images_per_s": done / elapsed if elapsed else 0.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
