"""The project's one DALI read-and-decode pipeline and its loop, and the built-in loaders ``liquidfs profile`` times.

The built-in loaders are what ``liquidfs profile`` times through a mount when no ``--run`` command is given:

    python -m liquidfs.profile.loaders {dali,pil} DIR [--threads T] [--batch 16] [--epochs 1] [--no-augment]
                                 [--shuffle-buffer 1024] [--report-epochs]

Each reads every image under DIR (any layout) once per epoch in a seeded random order and does the per-image work
a training loader does on the CPU: decode, then (unless ``--no-augment``) a random resized crop to 224 x 224, a
random horizontal flip, and normalisation to float. ``dali``: DALI's CPU pipeline (``fn.readers.file`` over the
list of files, ``fn.decoders.image``, ``fn.random_resized_crop``, ``fn.crop_mirror_normalize``); ``pil``: Pillow on
a pool of threads, as torchvision's default loader decodes. It prints one JSON line: the images it delivered and
its own rate (from the first batch asked for, its set-up left out), which tests compare with the rate the mount
saw.

The DALI pipeline here (:func:`dali_pipeline`) and its loop (:func:`dali_batches`, :func:`dali_run`) are the one
DALI read-and-decode loop of the project: the benchmarks (``scripts/bench/``), the demo and the tests' DALI helper
build theirs with it, so that a figure or a check always reads the way the profile's loader does.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import resource
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CROP = 224
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
#: What the loaders open: the suffixes ``prepare`` expands and serves raw under their own names, and the raw
#: formats' (the formats the PIL loader decodes, ``PIL_FORMATS``: another suffix's file would be refused there).
SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".jp2")
#: The Pillow formats the PIL loader opens (``expand.formats.PILLOW_FORMATS``): a file of the dataset another
#: user wrote is never handed to Pillow's other plugins (EPS runs Ghostscript) by a profile run as root.
PIL_FORMATS = ("PNG", "JPEG", "BMP", "JPEG2000")
#: DALI's own default for the reader's ``initial_fill``: the files it opens ahead to shuffle among.
DALI_SHUFFLE_BUFFER = 1024
#: The name of a DALI pipeline's file reader (DALI's iterators and ``reader_meta`` ask for it by name).
READER = "reader"


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

    with Image.open(path, formats=PIL_FORMATS) as opened:
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


def dali_pipeline(*, file_root: str | Path | None = None, files: Sequence[str] | None = None,
                  source: Iterable[list[Any]] | None = None, batch: int, threads: int,
                  device: Literal["cpu", "mixed"] = "cpu", shuffle: bool = True,
                  shuffle_buffer: int = DALI_SHUFFLE_BUFFER, crop: int | None = None, seed: int | None = None,
                  source_info: bool = False) -> Any:
    """A built DALI read-and-decode pipeline, the one every liquidfs loader, benchmark, demo and test runs.

    What it reads, exactly one of: ``file_root`` (class sub-directories) or ``files``, through
    ``fn.readers.file`` named ``reader`` (``random_shuffle`` when ``shuffle``, picking among ``shuffle_buffer``
    files opened ahead), or ``source``, batches of encoded bytes fed through ``fn.external_source`` (a download
    loop: it ends when the iterable does). ``fn.decoders.image`` decodes on ``device`` ("mixed": CUDA device 0).
    With ``crop``, a training loader's augmentation follows: a random resized crop to ``crop`` x ``crop``, a
    random horizontal flip and normalisation to float CHW with ImageNet's mean and deviation. ``seed`` None is
    DALI's own (a random one). Outputs: images and labels (on the GPU too with "mixed"), then each image's path
    (``source_info``) where asked; images only from ``source``.
    """
    if sum(x is not None for x in (file_root, files, source)) != 1:
        raise ValueError("a DALI pipeline reads exactly one of file_root, files or source")
    if device not in ("cpu", "mixed"):
        raise ValueError(f"DALI decodes on 'cpu' or 'mixed', not {device!r}")
    if batch < 1 or threads < 1 or shuffle_buffer < 1 or (crop is not None and crop < 1):
        raise ValueError("batch, threads, shuffle_buffer and crop must be positive")
    # Imported here: DALI is optional, and the package and the Pillow loader work without it.
    from nvidia.dali import fn, pipeline_def, types

    gpu = device == "mixed"
    options: dict[str, Any] = {"batch_size": batch, "num_threads": threads, "device_id": 0 if gpu else None}
    if seed is not None:
        options["seed"] = seed

    @pipeline_def(**options)  # type: ignore[untyped-decorator]
    def pipe() -> Any:
        if source is not None:
            encoded = fn.external_source(source=source, batch=True, cycle=False, dtype=types.UINT8, ndim=1,
                                         name="encoded")
        else:
            where = {"file_root": str(file_root)} if file_root is not None else {"files": list(files or ())}
            encoded, labels = fn.readers.file(**where, random_shuffle=shuffle, initial_fill=shuffle_buffer,
                                              name=READER)
        images = fn.decoders.image(encoded, device=device)
        if crop is not None:
            images = fn.random_resized_crop(images, size=[crop, crop])
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=list(MEAN),
                                              std=list(STD), mirror=fn.random.coin_flip())
        if source is not None:
            return images
        outputs = [images, labels.gpu() if gpu else labels]
        if source_info:
            outputs.append(fn.get_property(encoded, key="source_info"))
        return tuple(outputs)

    built = pipe()
    built.build()
    return built


def reader_epoch_size(pipe: Any) -> int:
    """The images in one epoch of a :func:`dali_pipeline` that reads files."""
    return int(pipe.reader_meta(READER)["epoch_size"])


def dali_batches(pipe: Any, images: int | None = None) -> Iterator[tuple[Any, ...]]:
    """Each batch's outputs, until ``images`` images have come (the last batch whole) or the source ends.

    DALI's reader wraps its last batch into the next epoch, so a caller counting epochs counts images, not batches.
    """
    done = 0
    while images is None or done < images:
        try:
            outputs = pipe.run()
        except StopIteration:  # an external source ran out
            return
        done += len(outputs[0])
        yield outputs


@dataclass(frozen=True)
class DaliRun:
    """What one :func:`dali_run` measured, from the first batch asked for (the reader prefetches batches ahead,
    so a clock started after a warm-up batch would credit loading done before it started)."""

    images: int  # delivered: the last batch whole, so it may pass the count asked for
    seconds: float
    cpu_seconds: float  # this process's, user and system: DALI's threads are in it
    decoded_bytes: int  # of the first output (the images), where counted
    marks: tuple[tuple[float, int], ...]  # (seconds so far, images so far) after each batch

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0


def dali_run(pipe: Any, images: int | None = None, *, count_bytes: bool = False) -> DaliRun:
    """Run ``pipe`` for ``images`` images (or until its source ends), timed; ``count_bytes`` adds up what the
    images decoded to (CPU outputs only)."""
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    done = decoded = 0
    marks: list[tuple[float, int]] = []
    for outputs in dali_batches(pipe, images):
        done += len(outputs[0])
        if count_bytes:
            decoded += sum(outputs[0].at(i).nbytes for i in range(len(outputs[0])))
        marks.append((time.perf_counter() - started, done))
    elapsed = time.perf_counter() - started
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return DaliRun(done, elapsed, cpu, decoded, tuple(marks))


def run_dali(files: Sequence[str], *, threads: int, batch: int, epochs: int, seed: int, augment: bool,
             shuffle_buffer: int = DALI_SHUFFLE_BUFFER) -> Iterator[int]:
    """0 once built (the clock starts at the first batch asked for, as a training loop's does), then the images
    delivered, a batch at a time, to exactly ``epochs`` x ``files``."""
    p = dali_pipeline(files=files, batch=batch, threads=threads, seed=seed, shuffle_buffer=shuffle_buffer,
                      crop=CROP if augment else None)
    yield 0
    total = 0
    for outputs in dali_batches(p, epochs * len(files)):
        n = min(len(outputs[0]), epochs * len(files) - total)
        total += n
        yield n


def _positive(text: str) -> int:
    """A whole number of at least one (a batch of 0 waited for good, 0 threads raised ValueError)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m liquidfs.profile.loaders", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("loader", choices=["dali", "pil"])
    parser.add_argument("root", type=Path, help="the directory to read (a liquidfs mount)")
    parser.add_argument("--threads", type=_positive, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=_positive, default=16)
    parser.add_argument("--epochs", type=_positive, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-augment", dest="augment", action="store_false",
                        help="decode only (no random resized crop, flip, normalisation)")
    parser.add_argument("--shuffle-buffer", type=_positive, default=1024,
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
