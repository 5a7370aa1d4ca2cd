"""A loader for profile --run tests whose pace is known: two overlapped stages, as a real pipeline's reading and
decoding are. Each image costs the "decoder" PNG_MS or BMP_MS (by its bytes' format) and the "storage" its size
over MB_PER_S; image i is opened once both stages are done with the images before it, so the run takes
max(sum of decode, sum of load) and its rate peaks where the two sums meet.

    python paced_loader.py ROOT --png-ms 30 --bmp-ms 3 --mb-per-s 20 --log RATES.jsonl

Appends its own count and rate (from its first open to its end) to --log, for comparison with the mount's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--png-ms", type=float, required=True)
    parser.add_argument("--bmp-ms", type=float, required=True)
    parser.add_argument("--mb-per-s", type=float, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--fail", type=int, default=0, help="exit with this status after the first image")
    args = parser.parse_args()
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(args.root) for f in names if f.endswith(".png"))
    random.Random(0).shuffle(files)
    decode = load = 0.0
    start = time.perf_counter()
    first = None
    kinds = {"bmp": 0, "png": 0}
    for path in files:
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
        load += len(data) / (args.mb_per_s * 1e6)
        if args.fail:
            print("paced_loader: failing as asked", flush=True)
            raise SystemExit(args.fail)
    delay = start + max(decode, load) - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    end = time.perf_counter()
    assert first is not None
    with open(args.log, "a") as log:
        log.write(json.dumps({"images": len(files), "images_per_s": len(files) / (end - first), **kinds}) + "\n")


if __name__ == "__main__":
    main()
