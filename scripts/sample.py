"""A small, realistic sample dataset: Cityscapes-like PNG mosaics of the real photos that ship with scikit-image.

Synthetic noise or flat colours compress unlike real photos and would make every PNG/BMP figure meaningless, so
the tiles are real photographs, resized, flipped and placed at random (seeded, so a sample is reproducible).

Not part of the package (liquidfs serves datasets; it never makes one): the demo (scripts/demo.py), the
benchmarks (scripts/bench/) and the tests import it from here, with scikit-image from the ``sample`` extra.

    python scripts/sample.py DEST [--count 24] [--width 2048] [--height 1024] [--seed 0] [--jpeg-share 0]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

log = logging.getLogger(__name__)

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "color.png", "ihc.png", "motorcycle_left.png",
          "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "rocket.jpg")
CITIES = ("aachen", "bochum", "bremen", "cologne")


def photo_dir() -> Path:
    try:
        import skimage.data
    except ImportError as exc:  # pragma: no cover - the sample extra is installed by the README commands
        raise SystemExit("the sample needs scikit-image (pip install 'liquidfs[sample]')") from exc
    return Path(os.path.dirname(skimage.data.__file__))


def _photos() -> list[Image.Image]:
    base = photo_dir()
    return [Image.open(base / name).convert("RGB") for name in PHOTOS if (base / name).exists()]


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
    (root / "README.txt").write_text("liquidfs sample: mosaics of scikit-image's photos, Cityscapes layout\n")
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
