"""Lossless JPEG 2000 against PNG and BMP (issue 18): decode rate and bit-exactness, per decoder.

    python scripts/bench/bench_j2k.py [--images 32] [--size 2048x1024] [--threads 8] [--seconds 5]
        [--json out/j2k/j2k.json]
    python scripts/bench/bench_j2k.py --smoke     # 4 small images, short timings: that the script works

The images are photo mosaics (``scripts/sample.py``) saved as PNG, each expanded by liquidfs's own checked
expansion (``formats.expand``, as ``prepare --formats`` does) to BMP and to lossless J2K. Decoders: Pillow
(torchvision's PIL loader) on a pool of --threads threads, DALI ``cpu``, and where a CUDA device is visible DALI
``mixed``, which decodes J2K on the GPU (nvJPEG2000; PNG and BMP it decodes on the host). Per format and decoder:
images/s, the host's CPU milliseconds per image, and how many images decode to exactly the PNG's pixels under
Pillow (the reference: what the source decodes to). The GPU's line is the figure ``profile --formats
png,bmp,j2k`` weighs. Prints a markdown table, writes JSON to --json.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import _bench as bench  # noqa: E402  (the flags every benchmark takes)
from liquidfs.expand import formats  # noqa: E402
from liquidfs.profile.decoders import dali_available, find_gpu_decoder, measure_dali, measure_pil  # noqa: E402
from sample import _photos, mosaic  # noqa: E402

FORMATS = ("png", "bmp", "j2k")


def images(count: int, width: int, height: int) -> dict[str, list[bytes]]:
    """``count`` PNGs and their checked BMP and J2K expansions."""
    rng, photos = random.Random(18), _photos()
    out: dict[str, list[bytes]] = {f: [] for f in FORMATS}
    for _ in range(count):
        buf = io.BytesIO()
        mosaic(width, height, rng, photos).save(buf, "PNG")
        png = buf.getvalue()
        expanded = {to: formats.expand(png, to=to) for to in ("bmp", "j2k")}
        for to, result in expanded.items():
            if result.data is None:
                raise SystemExit(f"bench_j2k: liquidfs refused to expand an image to {to}: {result.reason}")
        out["png"].append(png)
        out["bmp"].append(expanded["bmp"].data)  # type: ignore[arg-type]
        out["j2k"].append(expanded["j2k"].data)  # type: ignore[arg-type]
    return out


def pil_pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def dali_pixels(encoded: list[bytes], device: str) -> list[np.ndarray]:
    """Each image decoded once by DALI (RGB), as host arrays."""
    from nvidia.dali import fn, pipeline_def, types

    arrays = [np.frombuffer(e, dtype=np.uint8) for e in encoded]

    @pipeline_def(batch_size=len(arrays), num_threads=2, device_id=0 if device == "mixed" else None)  # type: ignore[untyped-decorator]
    def pipe() -> Any:
        data = fn.external_source(source=lambda: arrays, dtype=types.UINT8)
        return fn.decoders.image(data, device=device, output_type=types.RGB)

    p = pipe()
    p.build()
    (out,) = p.run()
    if device == "mixed":
        out = out.as_cpu()
    return [np.array(out.at(i)) for i in range(len(arrays))]


def exact(decoded: list[np.ndarray], reference: list[np.ndarray]) -> int:
    return sum(a.shape == b.shape and bool(np.array_equal(a, b)) for a, b in zip(decoded, reference))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--size", default="2048x1024", help="WIDTHxHEIGHT")
    parser.add_argument("--threads", type=int, default=8, help="decoder threads (a GPU node's cores per GPU)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per timing")
    bench.add_run_arguments(parser, results="out/j2k/j2k.json", smoke="4 images of 256x128, 0.3 s timings")
    args = parser.parse_args(argv)
    if args.smoke:
        args.images, args.size, args.seconds = 4, "256x128", 0.3
    args.json = (args.json or bench.REPO / "out" / "j2k" / "j2k.json").absolute()
    width, height = map(int, args.size.lower().split("x"))
    started = time.time()
    print(f"making {args.images} {width}x{height} images and their BMP and J2K", file=sys.stderr)
    data = images(args.images, width, height)
    reference = [pil_pixels(png) for png in data["png"]]
    gpu, gpu_where = find_gpu_decoder()
    decoders = ["pil"] + (["dali-cpu"] if dali_available() else []) + (["dali-mixed"] if gpu else [])
    rows: list[dict[str, Any]] = []
    for fmt in FORMATS:
        for decoder in decoders:
            print(f"  {fmt} with {decoder}", file=sys.stderr)
            if decoder == "pil":
                rate = measure_pil(data[fmt], args.threads, args.seconds)
                pixels = [pil_pixels(d) for d in data[fmt]]
            else:
                device = decoder.removeprefix("dali-")
                rate = measure_dali(data[fmt], args.threads, args.seconds, device=device)
                pixels = dali_pixels(data[fmt], device)
            rows.append({"format": fmt, "decoder": decoder, "images_per_s": rate.images_per_s,
                         "host_cpu_ms_per_image": rate.host_cpu_per_image * 1000,
                         "mean_bytes": sum(map(len, data[fmt])) / len(data[fmt]),
                         "exact": exact(pixels, reference), "images": len(pixels)})
    png_cpu = max(r["images_per_s"] for r in rows if r["format"] == "png" and r["decoder"] != "dali-mixed")
    lines = ["| format | decoder | MB/image | images/s | x best CPU PNG | host CPU ms/image | exact pixels |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        r["x_png_cpu"] = r["images_per_s"] / png_cpu
        lines.append(f"| {r['format']} | {r['decoder']} | {r['mean_bytes'] / 1e6:.2f} | {r['images_per_s']:.1f} | "
                     f"{r['x_png_cpu']:.2f} | {r['host_cpu_ms_per_image']:.1f} | {r['exact']}/{r['images']} |")
    out = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"argv": sys.argv, "images": args.images, "size": args.size,
                                        "threads": args.threads, "seconds": args.seconds, "gpu": gpu_where if gpu
                                        else None, "no_gpu_because": None if gpu else gpu_where,
                                        "wall_s": time.time() - started},
                               "rows": rows}, indent=1))
    print("\n".join(lines))
    print(f"\nGPU: {gpu_where}" + ("" if gpu else " (no dali-mixed rows)") + f"\n(JSON {out})")
    inexact = [r for r in rows if r["exact"] != r["images"]]
    for r in inexact:
        print(f"NOT EXACT: {r['format']} with {r['decoder']}: {r['images'] - r['exact']} images differ",
              file=sys.stderr)
    return 1 if inexact else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
