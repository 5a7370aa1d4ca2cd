"""One run of an unmodified DALI CPU pipeline over a directory: prints a JSON line with what it measured.

Run as its own process by the benchmarks, so that its CPU time and its cgroup are its own:
    python scripts/bench/dali_epoch.py FILE_ROOT --images N --batch 16 --threads 2 [--seed S]
"""

from __future__ import annotations

import argparse
import json
import resource
import time


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

    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=args.batch, num_threads=args.threads, device_id=None, seed=args.seed)
    def pipe():
        encoded, labels = fn.readers.file(file_root=args.file_root, random_shuffle=True,
                                          initial_fill=args.shuffle_buffer, name="reader")
        return fn.decoders.image(encoded, device="cpu"), labels

    p = pipe()
    p.build()
    # Timed from the first run: the reader prefetches batches ahead, so timing after a warm-up batch would
    # credit loading done before the clock started. One epoch is read, each file once.
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    done = 0
    pixels = 0
    while done < args.images:
        images, _ = p.run()
        done += len(images)
        pixels += sum(images.at(i).size for i in range(len(images)))
    elapsed = time.perf_counter() - started
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    print(json.dumps({"images": done, "seconds": elapsed, "images_per_s": done / elapsed,
                      "loader_cpu_s": cpu, "bytes_decoded": pixels}))


if __name__ == "__main__":
    main()
