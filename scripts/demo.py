"""The README's demo: sample -> prepare -> mount -> read with DALI and Pillow -> report -> unmount.

Run through ``bash scripts/demo.sh`` (which installs first). Everything is written under ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from sample import make_sample  # scripts/sample.py, beside this script


def liquidfs(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "liquidfs", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"liquidfs {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def dali_read(root: Path, threads: int = 2) -> tuple[int, float]:
    from liquidfs.profile.loaders import dali_pipeline, dali_run, reader_epoch_size

    p = dali_pipeline(file_root=root, batch=4, threads=threads)
    total = reader_epoch_size(p)
    dali_run(p, total)  # epoch 1: warms the page cache, or liquidfs's memory cache
    timed = dali_run(p, 2 * total)  # epochs 2 and 3 are timed
    return timed.images, timed.seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default="out/demo")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--ratio", default="0.5")
    args = parser.parse_args()
    work = Path(args.workdir).absolute()
    src, store, mnt = work / "cityscapes", work / "store", work / "mnt"
    if not src.exists():
        print(f"1. making a sample of {args.count} 2048x1024 PNG mosaics of real photos in {src}")
        make_sample(src, count=args.count)
    else:
        print(f"1. reusing the sample in {src}")
    print(f"2. liquidfs prepare {src} --store {store} --ratio {args.ratio}")
    print("   " + liquidfs("prepare", str(src), "--store", str(store), "--ratio", args.ratio,
                           "--no-progress").replace("\n", "\n   ").rstrip())
    mnt.mkdir(parents=True, exist_ok=True)
    print(f"3. liquidfs mount {src} {mnt} --store {store} --cache-size 100%")
    liquidfs("mount", str(src), str(mnt), "--store", str(store), "--cache-size", "100%")
    try:
        root = mnt / "leftImg8bit" / "train"
        images = sorted(p for p in root.rglob("*.png"))
        raw = sum(1 for p in images if p.open("rb").read(2) == b"BM")
        print(f"   {len(images)} images under the original names, {raw} of them served as BMP bytes")
        same = all(np.array_equal(np.asarray(Image.open(p)), np.asarray(Image.open(src / p.relative_to(mnt))))
                   for p in images)
        print(f"4. Pillow: every image decodes to the source's exact pixels: {same}")
        n, secs = dali_read(root)
        m, secs_direct = dali_read(src / "leftImg8bit" / "train")
        print(f"5. unmodified DALI CPU pipeline, epochs 2-3 (after one warming epoch): {n / secs:.1f} img/s "
              f"through the mount (ratio {args.ratio}), {m / secs_direct:.1f} img/s from the all-PNG source "
              f"directly ({n / secs / (m / secs_direct):.2f}x)")
        stats = json.loads(liquidfs("stats", str(mnt), "--json"))
        served = (stats["bytes_from_storage"] + stats["bytes_from_memory"]) / 1e6
        how = ("passthrough: the kernel served every read from the backing files, "
               f"{stats['read_requests']} reads reached the daemon" if stats["data_path"] == "passthrough"
               else f"daemon path ({stats['data_path_why']})")
        print(f"6. liquidfs stats: {stats['opens']} opens ({stats['opens_raw']} raw), {served:.0f} MB opened "
              f"({stats['bytes_from_memory'] / 1e6:.0f} MB from the cache), {stats['fallbacks']} fallbacks, "
              f"{stats['errors']} errors; data path {how}")
        if not same:
            return 1
    finally:
        liquidfs("umount", str(mnt))
        print(f"7. liquidfs umount {mnt}: done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
