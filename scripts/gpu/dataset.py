"""A benchmark's Cityscapes-sized sample made on all cores (``sample.make_mosaics``; ``sample.make_sample`` makes
it on one: 256 mosaics of 2048x1024 take minutes there, seconds here), where ``_bench.dataset`` finds and reuses it.

    python scripts/gpu/dataset.py WORK IMAGES [--width 2048 --height 1024]

Same layout, names and ``meta.json`` count as ``sample.make_sample``; its images differ (seeded per image).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "bench"))

import _bench as bench  # noqa: E402
from sample import make_mosaics  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("images", type=int)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--height", type=int, default=1024)
    args = parser.parse_args()
    root = bench.dataset_dir(args.work, args.images, args.width, args.height) / "data"
    make_mosaics(root / "leftImg8bit" / "train", args.images, args.width, args.height)
    (root / "README.txt").write_text("liquidfs sample: mosaics of scikit-image's photos, Cityscapes layout\n")
    (root / "meta.json").write_text(json.dumps({"count": args.images, "width": args.width, "height": args.height}))
    print(f"{args.images} images in {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
