"""One epoch of an unmodified torchvision ImageFolder + DataLoader over a directory: prints a JSON line.

    python scripts/bench/torch_epoch.py FILE_ROOT [--images N] [--epochs 1] --batch 16 --workers 2 [--seed S]
                                        [--report-epochs]

The counterpart of dali_epoch.py for bench_e2e.py's `--loader torch`. Decoding is torchvision's default loader
(Pillow, converted to RGB) in the DataLoader's worker processes; CPU time includes the workers.
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file_root")
    parser.add_argument("--images", type=int, help="stop after this many images (default: every epoch whole)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-epochs", action="store_true", help="a JSON line per epoch too")
    args = parser.parse_args()

    import torch
    from torchvision import datasets, transforms

    torch.manual_seed(args.seed)
    dataset = datasets.ImageFolder(args.file_root, transform=transforms.PILToTensor())
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers)
    started = epoch_started = time.perf_counter()
    done = 0
    epoch = 0
    limit = args.images if args.images is not None else float("inf")
    while epoch < args.epochs and done < limit:
        epoch_done = 0
        for images, _ in loader:
            done += len(images)
            epoch_done += len(images)
            if done >= limit:
                break
        epoch += 1
        if args.report_epochs:
            now = time.perf_counter()
            print(json.dumps({"epoch": epoch, "images": epoch_done, "seconds": now - epoch_started,
                              "images_per_s": epoch_done / (now - epoch_started)}), flush=True)
            epoch_started = now
        if epoch_done == 0:
            break
    elapsed = time.perf_counter() - started
    own = resource.getrusage(resource.RUSAGE_SELF)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime
    print(json.dumps({"images": done, "seconds": elapsed, "images_per_s": done / elapsed, "loader_cpu_s": cpu}))


if __name__ == "__main__":
    main()
