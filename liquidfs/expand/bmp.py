"""The BMP raw format: a BMP written with NumPy from Pillow's packed samples (the layout of each mode is in
``formats``'s docstring), accepted only if Pillow decodes it to the original's samples."""

from __future__ import annotations

import io
import logging
import struct
from typing import Final

import numpy as np
from PIL import BmpImagePlugin, ImageFile

from .checks import Refuse, same_image
from .rawformats import BMP

log = logging.getLogger(__name__)

#: What the BMP writer starts a file with (``rawformats.BMP``).
BMP_MAGIC: Final = BMP.magic[0]
# DIB header sizes Pillow understands; used to make 'BM' sniffing less naive.
BMP_HEADER_SIZES: Final = frozenset({12, 40, 52, 56, 64, 108, 124})

_FILE_HEADER: Final = struct.Struct("<2sIHHI")  # BITMAPFILEHEADER, 14 bytes
_INFO_HEADER: Final = struct.Struct("<IiiHHIIiiII")  # BITMAPINFOHEADER, 40 bytes
_BI_RGB: Final = 0
_BI_BITFIELDS: Final = 3
_LCS_SRGB: Final = 0x73524742  # 'sRGB'
# BITMAPV4HEADER tail: R, G, B, A masks (BGRA byte order in memory), colour
# space, 36 bytes of endpoints and 12 of gamma (unused for LCS_sRGB).
_V4_TAIL: Final = struct.pack("<5I", 0x00FF0000, 0x0000FF00, 0x000000FF, 0xFF000000, _LCS_SRGB) + bytes(48)
_GRAY_PALETTE: Final = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1)
_BW_PALETTE: Final = np.array([[0, 0, 0], [255, 255, 255]], np.uint8)


def _write_bmp(raw: bytes, mode: str, size: tuple[int, int], palette: np.ndarray | None = None) -> bytes:
    """Complete BMP file for an image given as Pillow's packed samples.

    raw: ``im.tobytes()`` of a mode 1/L/P/RGB/RGBA image: rows top-down,
    1 bit per pixel MSB-first with byte-padded rows for '1', else 1/3/4
    bytes per pixel in R, G, B(, A) order.  palette: (n, 3) uint8 RGB entries
    for P.  BMP rows are stored bottom-up and padded to 4 bytes, the form
    every BMP reader supports.
    """
    w, h = size
    bpp = {"1": 1, "L": 8, "P": 8, "RGB": 24, "RGBA": 32}[mode]
    row_bytes = (w * bpp + 7) // 8  # for '1' also Pillow's packed row length
    stride = (row_bytes + 3) & ~3
    pixels = np.frombuffer(raw, np.uint8).reshape(h, row_bytes)
    pal = {"1": _BW_PALETTE, "L": _GRAY_PALETTE, "P": palette}.get(mode)
    pal_bytes = b""
    if pal is not None:
        quad = np.zeros((len(pal), 4), np.uint8)  # RGBQUAD is B, G, R, reserved
        quad[:, :3] = pal[:, ::-1]
        pal_bytes = quad.tobytes()
    tail = _V4_TAIL if mode == "RGBA" else b""
    header_size = _INFO_HEADER.size + len(tail)
    offset = _FILE_HEADER.size + header_size + len(pal_bytes)
    file_size = offset + stride * h
    out = np.empty(file_size, np.uint8)
    out[:offset] = np.frombuffer(
        _FILE_HEADER.pack(BMP_MAGIC, file_size, 0, 0, offset)
        + _INFO_HEADER.pack(
            header_size,
            w,
            h,  # positive height: bottom-up rows
            1,
            bpp,
            _BI_BITFIELDS if mode == "RGBA" else _BI_RGB,
            stride * h,
            0,  # no resolution: Pillow would report it as info['dpi']
            0,
            0 if pal is None else len(pal),
            0,
        )
        + tail
        + pal_bytes,
        np.uint8,
    )
    rows = out[offset:].reshape(h, stride)
    if stride != row_bytes:
        rows[:, row_bytes:] = 0
    dst = rows[::-1, :row_bytes]  # BMP row 0 is the bottom image row
    if bpp <= 8:
        dst[...] = pixels  # Pillow's 1-bit packing (MSB = leftmost) is BMP's
    else:
        ch = bpp // 8
        samples = pixels.reshape(h, w, ch)
        # An explicit strided view (never a silent copy): pixel (y, x, c).
        px = np.ndarray(
            (h, w, ch),
            np.uint8,
            buffer=out,
            offset=offset + (h - 1) * stride,
            strides=(-stride, ch, 1),
        )
        # Channel by channel is ~2x faster than one reversed-axis copy.
        px[..., 0] = samples[..., 2]
        px[..., 1] = samples[..., 1]
        px[..., 2] = samples[..., 0]
        if ch == 4:
            px[..., 3] = samples[..., 3]
    return out.tobytes()


def to_bmp(im: ImageFile.ImageFile, mode: str, size: tuple[int, int], raw: bytes,
            palette: np.ndarray | None) -> bytes:
    bmp = _write_bmp(raw, mode, size, palette)
    check = BmpImagePlugin.BmpImageFile(io.BytesIO(bmp))
    check.load()
    if not same_image(im, check, raw):
        log.warning("BMP round trip differs for a %s %dx%d image", mode, *size)
        raise Refuse("round-trip-mismatch")
    return bmp
