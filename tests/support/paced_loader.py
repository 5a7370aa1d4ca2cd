"""A loader for profile --run tests whose pace is known: two overlapped stages, as a real pipeline's reading and
decoding are. Each image costs the "decoder" PNG_MS or BMP_MS (by its bytes' format) and the "storage" its size
over MB_PER_S; image i is opened once both stages are done with the images before it, so the run takes
max(sum of decode, sum of load) and its rate peaks where the two sums meet.

    python paced_loader.py ROOT --png-ms 30 --bmp-ms 3 --mb-per-s 20 --log RATES.jsonl [--epochs 2]
                           [--storage-from-mount] [--read-ahead N]

Appends its own count and rate (from its first open to its end) to --log, for comparison with the mount's, and
each epoch's rate. With --storage-from-mount the "storage" costs only the bytes the mount read from storage for
the file (its control file's ``bytes_from_storage``, read after each file): a file its cache held costs none.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path


def _from_storage(root: str) -> int:
    from liquidfs.daemon.control import read_control  # imported before the first open: not in the loader's pace

    return int(str(read_control(Path(root))["bytes_from_storage"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--png-ms", type=float, required=True)
    parser.add_argument("--bmp-ms", type=float, required=True)
    parser.add_argument("--mb-per-s", type=float, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--fail", type=int, default=0, help="exit with this status after the first image")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--storage-from-mount", action="store_true")
    parser.add_argument("--read-ahead", type=int, default=0,
                        help="then open this many files of the next epoch, as DALI's reader reads on past the last")
    args = parser.parse_args()
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(args.root) for f in names if f.endswith(".png"))
    kinds = {"bmp": 0, "png": 0}
    spans = []  # each epoch's (first open, end)
    read_before = _from_storage(args.root) if args.storage_from_mount else 0
    for epoch in range(args.epochs):
        # each epoch its own two sums: idle time of one stage in an epoch is not banked for the next
        decode = load = 0.0
        start = time.perf_counter()
        order = files[:]
        random.Random(epoch).shuffle(order)
        first = None
        for path in order:
            delay = start + max(decode, load) - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with open(path, "rb") as f:
                data = f.read()
            if first is None:
                first = time.perf_counter()
            raw = data[:2] == b"BM"
            kinds["bmp" if raw else "png"] += 1
            decode += (args.bmp_ms if raw else args.png_ms) / 1000
            if args.storage_from_mount:
                read = _from_storage(args.root)
                load += (read - read_before) / (args.mb_per_s * 1e6)
                read_before = read
            else:
                load += len(data) / (args.mb_per_s * 1e6)
            if args.fail:
                print("paced_loader: failing as asked", flush=True)
                raise SystemExit(args.fail)
        delay = start + max(decode, load) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        assert first is not None
        spans.append((first, time.perf_counter()))
    ahead = files[:]
    random.Random(args.epochs).shuffle(ahead)
    for path in ahead[:args.read_ahead]:
        with open(path, "rb") as f:
            f.read()
    per_epoch = [len(files) / (end - first) for first, end in spans]
    with open(args.log, "a") as log:
        log.write(json.dumps({"images": len(files) * args.epochs, "images_per_s":
                              len(files) * args.epochs / (spans[-1][1] - spans[0][0]),
                              "epoch_images_per_s": per_epoch, **kinds}) + "\n")


if __name__ == "__main__":
    main()
