"""A small, realistic sample dataset: Cityscapes-like PNG mosaics of the real photos that ship with scikit-image.

Pure noise or flat colours compress unlike real photos and would make every PNG/BMP figure meaningless, so the
tiles are real photographs, resized, flipped and placed at random (seeded, so a sample is reproducible).

Where the photos come from (``photos``), first found first:
    LIQUIDFS_PHOTOS=DIR  the .png/.jpg/.jpeg files in DIR (a host without scikit-image or network carries a few);
                         set but holding none is an error, not a silent change of dataset
    scikit-image         the photos in its wheel (the ``sample`` extra)
    synthetic            smooth gradients plus noise, tuned so that a mosaic's PNG is ~2.5x smaller than its BMP
                         as the photos' are; said on stderr, since decode figures on them are not a photo's

Not part of the package (liquidfs serves datasets; it never makes one): the demo (scripts/demo.py), the
benchmarks (scripts/bench/) and the tests import it from here.

    python scripts/sample.py DEST [--count 24] [--width 2048] [--height 1024] [--seed 0] [--jpeg-share 0]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "color.png", "ihc.png", "motorcycle_left.png",
          "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "rocket.jpg")
PHOTOS_ENV = "LIQUIDFS_PHOTOS"
PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg")
CITIES = ("aachen", "bochum", "bremen", "cologne")
SYNTHETIC_COUNT = 8
SYNTHETIC_SIZE = 512
# The noise's standard deviation, in 8-bit levels: 4 makes 2048x1024 mosaics compress 2.56x as PNG, where
# scikit-image's photos make 2.60x (measured); less noise compresses more, more less.
SYNTHETIC_NOISE = 4.0


def photo_files() -> tuple[list[Path], str]:
    """The photo files the mosaics are made of and where they came from, in words; no files: synthetic."""
    carried = os.environ.get(PHOTOS_ENV)
    if carried:
        folder = Path(carried)
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in PHOTO_SUFFIXES and p.is_file()) \
            if folder.is_dir() else []
        if not files:
            raise SystemExit(f"{PHOTOS_ENV}={carried}: no {'/'.join(PHOTO_SUFFIXES)} files there")
        return files, f"{len(files)} photos from {folder}"
    try:
        import skimage.data
    except ImportError:
        return [], "synthetic images (smooth gradients and noise)"
    base = Path(os.path.dirname(skimage.data.__file__))
    return [base / name for name in PHOTOS if (base / name).exists()], "scikit-image's photos"


@functools.cache
def _synthetic() -> tuple[Image.Image, ...]:
    """Photo stand-ins: a few low-frequency waves per channel (smooth regions and edges, as in a photo) plus
    Gaussian noise (the sensor's, which is what keeps a photo's PNG from shrinking like a drawing's)."""
    log.warning("no photos (neither %s nor scikit-image): the sample is synthetic, smooth gradients and noise",
                PHOTOS_ENV)
    y, x = np.mgrid[0:SYNTHETIC_SIZE, 0:SYNTHETIC_SIZE].astype(np.float32) / SYNTHETIC_SIZE
    made = []
    for i in range(SYNTHETIC_COUNT):
        rng = np.random.default_rng(i)
        channels = []
        for _ in range(3):
            value = np.full_like(x, rng.uniform(60, 190))
            for _ in range(4):
                fx, fy, phase = rng.uniform(0.5, 4), rng.uniform(0.5, 4), rng.uniform(0, 2 * np.pi)
                value += rng.uniform(20, 50) * np.sin(2 * np.pi * (fx * x + fy * y) + phase)
            channels.append(value)
        pixels = np.stack(channels, axis=-1) + rng.normal(0, SYNTHETIC_NOISE, (*x.shape, 3))
        made.append(Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)))
    return tuple(made)


def _photos() -> list[Image.Image]:
    files, _ = photo_files()
    if not files:
        return list(_synthetic())
    return [Image.open(path).convert("RGB") for path in files]


def mosaic(width: int, height: int, rng: random.Random, photos: Sequence[Image.Image]) -> Image.Image:
    """A width x height RGB image tiled with randomly scaled, flipped crops of the photos."""
    canvas = Image.new("RGB", (width, height))
    tile = max(32, min(width, height) // 2)
    for y in range(0, height, tile):
        for x in range(0, width, tile):
            photo = rng.choice(photos)
            scale = rng.uniform(0.6, 1.6)
            w, h = max(8, int(tile * scale)), max(8, int(tile * scale))
            piece = photo.resize((w, h), Image.Resampling.BILINEAR)
            if rng.random() < 0.5:
                piece = piece.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            left = rng.randint(0, max(0, w - tile))
            top = rng.randint(0, max(0, h - tile))
            canvas.paste(piece.crop((left, top, left + tile, top + tile)), (x, y))
    return canvas


def _one_mosaic(job: tuple[Path, int, int, int, int]) -> None:
    folder, index, width, height, seed = job
    city = CITIES[index % len(CITIES)]
    (folder / city).mkdir(parents=True, exist_ok=True)
    # A generator of its own per image: the same dataset whatever the number of processes
    mosaic(width, height, random.Random(1_000_003 * seed + index), _photos()).save(
        folder / city / f"{city}_{index:06d}_000019_leftImg8bit.png")


def make_mosaics(folder: Path, count: int, width: int, height: int, seed: int = 42) -> None:
    """``count`` Cityscapes-like PNG mosaics in city folders under ``folder``, made by every core: a GPU host's
    cores make 1,000 2048x1024 PNGs in minutes (``make_sample`` makes them on one). Seeded per image."""
    import concurrent.futures as cf

    _photos()  # made (or found missing) once here, not in every worker
    with cf.ProcessPoolExecutor() as pool:
        list(pool.map(_one_mosaic, [(folder, i, width, height, seed) for i in range(count)], chunksize=4))


def make_sample(dest: str | os.PathLike[str], count: int = 24, width: int = 2048, height: int = 1024,
                seed: int = 0, jpeg_share: float = 0.0) -> Path:
    """Write ``count`` images in a Cityscapes-like tree under ``dest`` (plus a few non-image files)."""
    root = Path(dest)
    rng = random.Random(seed)
    photos = _photos()
    images = root / "leftImg8bit" / "train"
    for i in range(count):
        city = CITIES[i % len(CITIES)]
        folder = images / city
        folder.mkdir(parents=True, exist_ok=True)
        img = mosaic(width, height, rng, photos)
        stem = f"{city}_{i:06d}_000019_leftImg8bit"
        if rng.random() < jpeg_share:
            img.save(folder / f"{stem}.jpg", quality=92)
        else:
            img.save(folder / f"{stem}.png")
    (root / "README.txt").write_text(f"liquidfs sample: mosaics of {photo_files()[1]}, Cityscapes layout\n")
    (root / "meta.json").write_text(json.dumps({"count": count, "width": width, "height": height, "seed": seed}))
    return root


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest")
    parser.add_argument("--count", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jpeg-share", type=float, default=0.0)
    args = parser.parse_args(argv)
    make_sample(args.dest, args.count, args.width, args.height, args.seed, args.jpeg_share)
    print(f"sample of {args.count} images written to {args.dest}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
