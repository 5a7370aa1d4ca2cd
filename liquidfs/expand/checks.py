"""What every format's expansion shares: the refusal that stops it (``Refuse``), the checks of an opened
original's samples (orientation, transparency, palette) and of EXIF/XMP orientation, and the comparison that
proves a raw file's round trip."""

from __future__ import annotations

import re
import struct
from typing import Final

import numpy as np
from PIL import Image, ImageFile

_XMP_ORIENTATION: Final = re.compile(rb'tiff:Orientation(="|>)([0-9])')
_SENTINEL: Final = np.array([[255, 0, 0]], np.uint8)  # any non-gray colour


class Refuse(Exception):
    """Internal: stop expanding with this reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def check_exif(tiff: bytes) -> None:
    """Refuse unless the TIFF-structured EXIF block has no Orientation tag or
    Orientation 1.  Unparseable EXIF is refused too: we cannot tell what a
    lenient reader would make of it."""
    try:
        order = {b"II": "<", b"MM": ">"}[tiff[:2]]
        magic, ifd = struct.unpack_from(order + "HI", tiff, 2)
        if magic != 42:
            raise ValueError("bad TIFF magic")
        (count,) = struct.unpack_from(order + "H", tiff, ifd)
        for i in range(count):
            tag, typ = struct.unpack_from(order + "HH", tiff, ifd + 2 + 12 * i)
            if tag != 0x0112:
                continue
            fmt = {3: "H", 4: "I"}[typ]
            (value,) = struct.unpack_from(order + fmt, tiff, ifd + 2 + 12 * i + 8)
            if value != 1:
                raise Refuse("exif-orientation", f"orientation {value}")
    except (KeyError, ValueError, struct.error) as e:
        raise Refuse("exif-unreadable", str(e)) from None


def check_xmp(xmp: bytes) -> None:
    # Pillow's getexif() (and so ImageOps.exif_transpose) takes the
    # orientation from XMP when EXIF has none; same pattern as Pillow.
    m = _XMP_ORIENTATION.search(xmp)
    if m and m[2] != b"1":
        raise Refuse("exif-orientation", "XMP orientation")


def checked_samples(im: ImageFile.ImageFile, mode: str, size: tuple[int, int]) -> tuple[bytes, np.ndarray | None]:
    """Load the opened original and refuse what no raw file can carry: its packed samples and, for P, the
    palette to write (with the gray sentinel where needed)."""
    if im.size != size:
        raise Refuse("corrupt", f"Pillow size {im.size} != header {size}")
    im.load()
    if im.mode != mode:
        raise Refuse(f"unsupported-mode:{im.mode}", f"expected {mode}")
    # Pillow's own view of orientation (EXIF, XMP, raw-profile text) is what
    # ImageOps.exif_transpose would act on.
    orientation = im.getexif().get(0x0112)
    if orientation not in (None, 1):
        raise Refuse("exif-orientation", f"Pillow sees orientation {orientation}")
    if im.info.get("transparency") is not None:
        raise Refuse("transparency")
    # What the walk of each format refuses, as Pillow sees it too: a walk steered past a segment (junk bytes a
    # lenient reader skips) must not be the only check of what decoders act on.
    if im.info.get("icc_profile"):
        raise Refuse("icc-profile", "Pillow sees one")
    if "mp" in im.info or getattr(im, "n_frames", 1) != 1:
        raise Refuse("multi-picture", "Pillow sees more than one picture")
    # Pillow's packed samples: what np.asarray(im) would wrap, without the
    # extra copies (a 6 MB buffer costs ms here), and a cheap memcmp later.
    raw = im.tobytes()
    palette = None
    if mode == "P":
        flat = im.getpalette()
        if not flat:
            raise Refuse("corrupt", "P image without palette")
        palette = np.asarray(flat, np.uint8).reshape(-1, 3)
        if int(np.frombuffer(raw, np.uint8).max()) >= len(palette):
            raise Refuse("corrupt", "palette index out of range")
        if (palette == palette[:, :1]).all():
            # All-gray palette: Pillow would read an identity one as L, and
            # OpenCV/DALI any gray one as 1 channel (3 for the PNG).
            if len(palette) >= 256:
                raise Refuse("gray-palette")
            palette = np.concatenate([palette, _SENTINEL])
    return raw, palette


def same_image(a: Image.Image, b: Image.Image, a_raw: bytes | None = None) -> bool:
    """Same mode, size, transparency info, palette colours and samples.
    Comparing Pillow's packed bytes of two same-mode images is the same as
    comparing np.asarray() of them."""
    if a.mode != b.mode or a.size != b.size:
        return False
    if a.info.get("transparency") != b.info.get("transparency"):
        return False
    if a.mode == "P":
        pa, pb = a.getpalette() or [], b.getpalette() or []
        # b may have extra trailing entries (the gray-palette sentinel);
        # every index used by a must map to the same colour in b.
        if len(pb) < len(pa) or pb[: len(pa)] != pa:
            return False
    return (a.tobytes() if a_raw is None else a_raw) == b.tobytes()
