"""Lossless J2K on this GPU with NVIDIA nvImageCodec (issue 41): exact, how fast, and what ``profile`` makes of it.

    python scripts/gpu/nvimgcodec_check.py [--images 48] [--size 2048x1024] [--source DIR] [--work DIR]
        [--gpu-train-rate IMG_PER_S] [--json out/gpu/nvimgcodec.json]

No liquidfs daemon, mount or FUSE is needed: Python 3.11+, NumPy, Pillow, this checkout importable (it puts its
own root on the path), nvImageCodec (pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg2k-cu13) and a CUDA device.
Without either it exits 2 with one line saying which.

1. N PNGs (``--source``'s, else N Cityscapes-like mosaics of scripts/sample.py, seeded) are expanded to lossless
   JPEG 2000 by the package's own expansion (``formats.expand(png, to="j2k")``, what ``prepare --formats
   png,bmp,j2k`` writes), and each is checked by Pillow as prepare checks it.
2. nvImageCodec decodes them on the GPU (GPU_ONLY, the source's channels kept), and each is compared with the
   PNG's pixels under Pillow: every one must be exact. Its rate: the whole batch decoded again and again for
   ``--seconds``, alone on the GPU, the output left there; beside it Pillow's PNG decode on every core.
3. ``liquidfs profile`` weighs J2K against BMP over the same PNGs by the model alone (``--model-only``, a Pillow
   loader that hands its J2K objects to nvImageCodec, storage timed with one reader per core), with training's
   GPU time where ``--gpu-train-rate`` gives it.

Prints a summary and writes JSON (default WORK/nvimgcodec.json); exits 1 when any object was not exact.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from liquidfs.expand import formats  # noqa: E402
from liquidfs.profile.decoders import NVIMGCODEC_WHEELS, decode_nvimgcodec, find_nvimgcodec, measure_nvimgcodec, \
    measure_pil  # noqa: E402


def fail(message: str) -> None:
    print(f"nvimgcodec_check: {message}", file=sys.stderr)
    raise SystemExit(2)


def pngs(args: argparse.Namespace, work: Path) -> list[bytes]:
    """The PNGs checked: ``--source``'s (sorted, the first N), else N mosaics made here."""
    if args.source is not None:
        files = sorted(p for p in args.source.rglob("*.png") if p.is_file())[:args.images]
        if not files:
            fail(f"no PNG under {args.source}")
        return [p.read_bytes() for p in files]
    width, height = args.size
    try:
        from sample import make_sample  # real photos (scikit-image): they compress as datasets do
    except ImportError:
        make_sample = None
    if make_sample is not None:
        src = make_sample(work / "data", count=args.images, width=width, height=height, seed=41)
        return [p.read_bytes() for p in sorted(src.rglob("*.png"))][:args.images]
    rng = np.random.default_rng(41)  # no scikit-image: smooth gradients with noise, less like photos
    out = []
    for _ in range(args.images):
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([(x * rng.uniform(0.05, 0.2) + y * rng.uniform(0.05, 0.2)) % 256] * 3, axis=-1)
        img = (base + rng.integers(0, 24, (height, width, 3))).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def exactness(sources: list[bytes], objects: list[bytes]) -> dict[str, Any]:
    """Each object decoded by nvImageCodec on the GPU against its PNG decoded by Pillow."""
    exact, wrong = 0, []
    decoded = decode_nvimgcodec(objects)
    for i, (source, got) in enumerate(zip(sources, decoded)):
        with Image.open(io.BytesIO(source)) as im:
            want = np.asarray(im)
        if got is not None and want.ndim == 2 and got.ndim == 3 and got.shape[2] == 1:
            got = got[:, :, 0]
        if got is not None and got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want):
            exact += 1
        else:
            wrong.append({"index": i, "want": [list(want.shape), str(want.dtype)],
                          "got": None if got is None else [list(got.shape), str(got.dtype)],
                          "differing_samples": None if got is None or got.shape != want.shape
                          else int(np.count_nonzero(got != want))})
    return {"checked": len(objects), "exact": exact, "not_exact": wrong}


def pillow_png_rate(sources: list[bytes], seconds: float) -> float:
    """Pillow's PNG decode on every core (processes: Pillow's PNG decode holds the GIL for part of its work)."""
    cores = os.cpu_count() or 1
    with cf.ProcessPoolExecutor(cores) as pool:
        rates = list(pool.map(_pil_rate, [sources[i::cores] or sources for i in range(cores)], [seconds] * cores))
    return sum(rates)


def _pil_rate(sources: list[bytes], seconds: float) -> float:
    return measure_pil(sources, 1, seconds).images_per_s


def weigh(src_pngs: list[bytes], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``liquidfs profile --model-only --formats png,bmp,j2k --decoder pil`` over the PNGs, in-process."""
    from liquidfs.profile.choose import profile_store, render, to_json
    from liquidfs.stores import open_store

    data = work / "profile-source" / "train"
    data.mkdir(parents=True, exist_ok=True)
    for i, png in enumerate(src_pngs):
        (data / f"{i:05d}.png").write_bytes(png)
    profile = profile_store(open_store(work / "profile-source", work / "profile-store"), decoder="pil",
                            threads=os.cpu_count(), formats=("j2k", "bmp"), measured=False,
                            gpu_train_rate=args.gpu_train_rate, progress=lambda s: print(f"profile: {s}",
                                                                                        file=sys.stderr))
    text = render(profile)
    print(text)
    return {"rendered": text, "profile": to_json(profile)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--size", type=lambda t: tuple(int(v) for v in t.split("x")), default=(2048, 1024),
                        metavar="WxH")
    parser.add_argument("--source", type=Path, help="a directory of PNGs to check instead of generated ones")
    parser.add_argument("--seconds", type=float, default=5.0, help="each rate's measuring time (default 5)")
    parser.add_argument("--gpu-train-rate", type=float, metavar="IMG_PER_S",
                        help="images/s training alone runs at on this GPU, for the profile's weighing")
    parser.add_argument("--no-profile", action="store_true", help="skip step 3")
    parser.add_argument("--work", type=Path, help="scratch (default: a new directory in the system's temp)")
    parser.add_argument("--json", type=Path, help="default WORK/nvimgcodec.json")
    args = parser.parse_args(argv)
    decoder, why = find_nvimgcodec()  # nvImageCodec importable, a CUDA device, and a J2K decoded on it
    if decoder is None:
        fail(f"{why} (this check needs a CUDA device and {NVIMGCODEC_WHEELS})")
    work = args.work or Path(tempfile.mkdtemp(prefix="nvimgcodec-check-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    sources = pngs(args, work)
    objects: list[bytes] = []
    for png in sources:
        result = formats.expand(png, to="j2k")
        if result.data is None:
            fail(f"the expansion refused an image ({result.reason}): give PNGs J2K holds (L, RGB, RGBA)")
        objects.append(result.data)
    report: dict[str, Any] = {
        "meta": {"argv": sys.argv, "host": platform.node(), "cores": os.cpu_count(), "gpu_decoder": why,
                 "images": len(sources), "png_mb": sum(map(len, sources)) / len(sources) / 1e6,
                 "j2k_mb": sum(map(len, objects)) / len(objects) / 1e6},
        "exactness": exactness(sources, objects),
    }
    gpu = measure_nvimgcodec(objects, args.seconds)
    report["rates"] = {"nvimgcodec_gpu_j2k_images_per_s": gpu.images_per_s,
                       "nvimgcodec_gpu_j2k_host_cpu_s_per_image": gpu.host_cpu_per_image,
                       "pillow_png_images_per_s_all_cores": pillow_png_rate(sources, args.seconds)}
    if not args.no_profile:
        report["weighing"] = weigh(sources, work, args)
    report["meta"]["seconds"] = time.time() - started
    out = args.json or work / "nvimgcodec.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    ex, rates = report["exactness"], report["rates"]
    print(f"{why}: {ex['exact']} of {ex['checked']} J2K objects exact to their PNG; "
          f"GPU {rates['nvimgcodec_gpu_j2k_images_per_s']:.1f} img/s alone, Pillow PNG "
          f"{rates['pillow_png_images_per_s_all_cores']:.1f} img/s on {os.cpu_count()} cores "
          f"(PNG {report['meta']['png_mb']:.2f} MB, J2K {report['meta']['j2k_mb']:.2f} MB); JSON {out}")
    return 0 if ex["exact"] == ex["checked"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
