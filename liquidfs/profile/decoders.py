"""Decode rates of the loaders' decoders: the decode side of ``profile``'s measurements.

On the CPU: Pillow (torchvision's PIL loader) or DALI's ``cpu`` decoder, on the user's thread count. On a GPU:
DALI's ``mixed`` decoder, which decodes JPEG 2000 with nvJPEG2000 (PNG and BMP it decodes on the host whatever
the device), for weighing the lossless J2K representation (``prepare --formats png,bmp,j2k``).
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DecodeRate", "GpuDecoder", "dali_available", "find_gpu_decoder", "measure_dali", "measure_decode",
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


def find_gpu_decoder() -> tuple[GpuDecoder | None, str]:
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


def measure_pil(encoded: Sequence[bytes], threads: int, seconds: float) -> DecodeRate:
    """Pillow (torchvision's PIL loader decodes with it) on a pool of ``threads`` threads."""
    from PIL import Image

    def one(data: bytes) -> None:
        with Image.open(io.BytesIO(data)) as im:
            im.load()

    done = 0
    cpu_started = time.process_time()
    started = time.monotonic()
    with cf.ThreadPoolExecutor(threads) as pool:
        while time.monotonic() - started < seconds or done == 0:
            list(pool.map(one, encoded))
            done += len(encoded)
    return DecodeRate(done / (time.monotonic() - started), (time.process_time() - cpu_started) / done)


def measure_dali(encoded: Sequence[bytes], threads: int, seconds: float, device: str) -> DecodeRate:
    """DALI's image decoder (``device``: "cpu", or "mixed" on CUDA device 0) fed from memory."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    batch = max(2, min(len(encoded), 2 * threads))
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
