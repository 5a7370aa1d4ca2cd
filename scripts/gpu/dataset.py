"""A benchmark's Cityscapes-sized sample made on all cores (``scripts/sample.py`` makes it on one: 256 mosaics of
2048x1024 take minutes there, seconds here), where ``_bench.dataset`` finds and reuses it.

    python scripts/gpu/dataset.py WORK IMAGES [--width 2048 --height 1024]

Same layout, names and ``meta.json`` as ``sample.make_sample``; its images differ (each worker has its own seed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "bench"))

import _bench as bench  # noqa: E402
from sample import CITIES, _photos, mosaic  # noqa: E402


def _make(args: tuple[Path, int, int, int]) -> None:
    images, i, width, height = args
    city = CITIES[i % len(CITIES)]
    folder = images / city
    folder.mkdir(parents=True, exist_ok=True)
    mosaic(width, height, random.Random(i), _photos()).save(folder / f"{city}_{i:06d}_000019_leftImg8bit.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("images", type=int)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--height", type=int, default=1024)
    args = parser.parse_args()
    root = bench.dataset_dir(args.work, args.images, args.width, args.height) / "data"
    images = root / "leftImg8bit" / "train"
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(_make, [(images, i, args.width, args.height) for i in range(args.images)]))
    (root / "README.txt").write_text("liquidfs sample: mosaics of scikit-image's photos, Cityscapes layout\n")
    (root / "meta.json").write_text(json.dumps({"count": args.images, "width": args.width, "height": args.height}))
    print(f"{args.images} images in {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
