"""Decode rates of the loaders' decoders: the decode side of ``profile``'s measurements.

On the CPU: Pillow (torchvision's PIL loader) or DALI's ``cpu`` decoder, on the user's thread count. On a GPU, for
weighing the lossless J2K representation (``prepare --formats png,bmp,j2k``): DALI's ``mixed`` decoder for a DALI
loader (JPEG 2000 with nvJPEG2000; PNG and BMP it decodes on the host whatever the device), and NVIDIA
nvImageCodec's GPU decoder (``nvidia.nvimgcodec``, what DALI 2.x decodes with) for any other loader, which hands
the J2K objects to it.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..expand import formats
from ..stores.sample import ProfileError

__all__ = ["DecodeRate", "GpuDecoder", "NVIMGCODEC_WHEELS", "dali_available", "decode_nvimgcodec", "find_dali_mixed",
           "find_gpu_decoder", "find_nvimgcodec", "measure_dali", "measure_decode", "measure_nvimgcodec",
           "measure_pil"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeRate:
    """What decoding costs: images/s, and this process's CPU seconds per image (for a GPU decoder: the parsing,
    copies and DALI's own threads that the host still pays)."""

    images_per_s: float
    host_cpu_per_image: float


#: Measures a GPU decoder over encoded images for some seconds.
GpuDecoder = Callable[[Sequence[bytes], int, float], DecodeRate]


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def measure_decode(encoded: Sequence[bytes], decoder: str, threads: int, seconds: float) -> float:
    """Images/s of ``decoder`` ("pil" or "dali") on ``threads`` threads over the encoded images, cycled for
    ``seconds``."""
    if decoder == "dali":
        return measure_dali(encoded, threads, seconds, device="cpu").images_per_s
    return measure_pil(encoded, threads, seconds).images_per_s


def find_gpu_decoder(decoder: str = "dali") -> tuple[GpuDecoder | None, str]:
    """What decodes J2K on a GPU for a loader whose CPU decoder is ``decoder``: DALI's ``mixed`` for a DALI
    loader, nvImageCodec for any other; or None and why there is none here."""
    return find_dali_mixed() if decoder == "dali" else find_nvimgcodec()


def find_dali_mixed() -> tuple[GpuDecoder | None, str]:
    """DALI's ``mixed`` decoder on CUDA device 0, or None and why there is none here."""
    if not dali_available():
        return None, "DALI is not installed (pip install nvidia-dali-cuda120)"
    try:
        from nvidia.dali import backend
        count = backend.GetCUDADeviceCount()  # type: ignore[attr-defined]
    except Exception as exc:  # a driver missing or broken: there is no GPU to weigh, whatever the cause
        return None, f"no usable CUDA driver ({exc.__class__.__name__}: {exc})"
    if count < 1:
        return None, "no CUDA device is visible"

    def measure(encoded: Sequence[bytes], threads: int, seconds: float) -> DecodeRate:
        return measure_dali(encoded, threads, seconds, device="mixed")

    return measure, f"DALI 'mixed' on CUDA device 0 of {count}"


#: What ``pip install`` takes for nvImageCodec's GPU decoder of JPEG 2000 (CUDA 13; -cu12 for CUDA 12).
NVIMGCODEC_WHEELS = "nvidia-nvimgcodec-cu13 nvidia-nvjpeg2k-cu13"


def find_nvimgcodec() -> tuple[GpuDecoder | None, str]:
    """nvImageCodec's GPU decoder (GPU_ONLY: never its CPU fallback, which would be timed as the GPU's), shown
    able to decode a small lossless J2K here; or None and why not."""
    try:
        from nvidia import nvimgcodec
    except ImportError:
        return None, f"nvImageCodec is not installed (pip install {NVIMGCODEC_WHEELS})"
    probe = _probe_j2k()
    try:
        (decoded,) = decode_nvimgcodec([probe])
    except Exception as exc:  # no driver, no device, no nvJPEG2000: whatever the cause, it cannot decode here
        return None, f"nvImageCodec cannot decode J2K on a GPU here ({exc.__class__.__name__}: {exc})"
    if decoded is None:
        return None, f"nvImageCodec's GPU decoder refused a lossless J2K (pip install {NVIMGCODEC_WHEELS})"
    name = " ".join(filter(None, ("nvImageCodec", getattr(nvimgcodec, "__version__", None))))

    def measure(encoded: Sequence[bytes], threads: int, seconds: float) -> DecodeRate:
        return measure_nvimgcodec(encoded, seconds)

    return measure, f"{name} GPU_ONLY (nvJPEG2000) on CUDA device 0"


def _probe_j2k() -> bytes:
    """A 64x32 RGB image as the lossless JPEG 2000 that ``prepare`` writes."""
    from PIL import Image

    png = io.BytesIO()
    Image.linear_gradient("L").resize((64, 32)).convert("RGB").save(png, "PNG")
    data = formats.expand(png.getvalue(), to="j2k").data
    assert data is not None  # an RGB gradient is held exactly
    return data


def _nvimgcodec_decoder() -> tuple[Any, Any]:
    """A GPU_ONLY nvImageCodec decoder and the parameters that keep the source's samples: its channels as stored
    (no conversion of grey to RGB, alpha kept), any bit depth."""
    from nvidia import nvimgcodec

    decoder = nvimgcodec.Decoder(backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY)])
    params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.UNCHANGED, allow_any_depth=True)
    return decoder, params


def decode_nvimgcodec(encoded: Sequence[bytes]) -> list[Any]:
    """Each image decoded on the GPU by nvImageCodec, as a NumPy array of height x width x channels on the host
    (None for one it could not decode)."""
    import numpy as np
    from nvidia import nvimgcodec

    decoder, params = _nvimgcodec_decoder()
    images = decoder.decode([nvimgcodec.CodeStream(e) for e in encoded], params=params)
    return [None if im is None else np.asarray(im.cpu()) for im in images]


def measure_nvimgcodec(encoded: Sequence[bytes], seconds: float) -> DecodeRate:
    """nvImageCodec's GPU decoder over the encoded images in batches, their output left on the GPU (as a loader
    feeding training leaves it)."""
    from nvidia import nvimgcodec

    decoder, params = _nvimgcodec_decoder()
    streams = [nvimgcodec.CodeStream(e) for e in encoded]
    images = decoder.decode(streams, params=params)  # warm-up: the GPU decoder's first use, its allocations
    if any(im is None for im in images):
        raise ProfileError(f"nvImageCodec's GPU decoder refused {sum(im is None for im in images)} of "
                           f"{len(images)} sampled J2K objects")
    done = 0
    cpu_started = time.process_time()
    started = time.monotonic()
    while time.monotonic() - started < seconds or done == 0:
        images = decoder.decode(streams, params=params)
        done += len(streams)
    images[-1].cpu()  # waits for the last batch's work on the GPU, should decode return before it ends
    elapsed = time.monotonic() - started
    return DecodeRate(done / elapsed, (time.process_time() - cpu_started) / done)


def measure_pil(encoded: Sequence[bytes], threads: int, seconds: float) -> DecodeRate:
    """Pillow (torchvision's PIL loader decodes with it) on a pool of ``threads`` threads."""
    from PIL import Image

    def one(data: bytes) -> None:
        with Image.open(io.BytesIO(data), formats=formats.PILLOW_FORMATS) as im:  # another user's bytes
            im.load()

    done = 0
    cpu_started = time.process_time()
    started = time.monotonic()
    # Every thread kept busy, the sample's images taken round and round: rounds of the sample waited for each
    # one's slowest image, and a sample of fewer images than threads (``--sample 16`` on 64 cores) decoded
    # that few at a time, timing decoding slower than the loader's threads make it (a choice with too much raw).
    images = itertools.cycle(encoded)
    pending: set[cf.Future[None]] = set()
    with cf.ThreadPoolExecutor(threads) as pool:
        while True:
            while len(pending) < 2 * threads and (time.monotonic() - started < seconds or done + len(pending) == 0):
                pending.add(pool.submit(one, next(images)))
            if not pending:
                break
            finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for future in finished:
                future.result()
            done += len(finished)
    return DecodeRate(done / (time.monotonic() - started), (time.process_time() - cpu_started) / done)


def measure_dali(encoded: Sequence[bytes], threads: int, seconds: float, device: str) -> DecodeRate:
    """DALI's image decoder (``device``: "cpu", or "mixed" on CUDA device 0) fed from memory."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    batch = max(2, 2 * threads)  # (the source takes the sample round and round: a batch may hold more than it)
    arrays = [np.frombuffer(e, dtype=np.uint8) for e in encoded]
    state = {"i": 0}

    def source() -> list[np.ndarray]:
        out = [arrays[(state["i"] + k) % len(arrays)] for k in range(batch)]
        state["i"] += batch
        return out

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0 if device == "mixed" else None,  # type: ignore[untyped-decorator]
                  prefetch_queue_depth=1)
    def pipe() -> Any:
        data = fn.external_source(source=source, dtype=types.UINT8)
        return fn.decoders.image(data, device=device)

    p = pipe()
    p.build()
    p.run()  # warm-up: allocations, thread start, the GPU decoder's first use
    done = 0
    cpu_started = time.process_time()
    started = time.monotonic()
    while time.monotonic() - started < seconds or done == 0:
        (out,) = p.run()
        done += batch
    if device == "mixed":
        # The prefetch queue of one keeps the GPU at most an iteration ahead of the loop; this waits for that one.
        out.as_cpu()
    elapsed = time.monotonic() - started
    return DecodeRate(done / elapsed, (time.process_time() - cpu_started) / done)
