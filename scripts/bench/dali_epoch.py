"""One run of an unmodified DALI CPU pipeline over a directory: prints a JSON line with what it measured.
The pipeline and its loop are the package's (liquidfs.profile.loaders.dali_pipeline, dali_run).

Run as its own process by the benchmarks, so that its CPU time and its cgroup are its own:
    python scripts/bench/dali_epoch.py FILE_ROOT --images N --batch 16 --threads 2 [--seed S]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file_root")
    parser.add_argument("--images", type=int, required=True, help="images to decode (one epoch: the number of files)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shuffle-buffer", type=int, default=1024,
                        help="DALI's initial_fill: how many files the reader opens ahead and picks from at random")
    args = parser.parse_args()

    from liquidfs.profile.loaders import dali_pipeline, dali_run

    p = dali_pipeline(file_root=args.file_root, batch=args.batch, threads=args.threads, seed=args.seed,
                      shuffle_buffer=args.shuffle_buffer)
    # Timed from the first run (dali_run: the reader prefetches batches ahead). One epoch is read, each file once.
    run = dali_run(p, args.images, count_bytes=True)
    print(json.dumps({"images": run.images, "seconds": run.seconds, "images_per_s": run.images / run.seconds,
                      "loader_cpu_s": run.cpu_seconds, "bytes_decoded": run.decoded_bytes}))


if __name__ == "__main__":
    main()
