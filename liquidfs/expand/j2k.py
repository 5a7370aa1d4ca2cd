"""The lossless JPEG 2000 raw format (``prepare --formats``): a JP2 file accepted only if Pillow decodes it to the
original's samples."""

from __future__ import annotations

import io
import logging

import numpy as np
from PIL import Image, ImageFile, Jpeg2KImagePlugin

from .checks import Refuse, same_image
from .rawformats import J2K

log = logging.getLogger(__name__)


def to_j2k(im: ImageFile.ImageFile, mode: str, size: tuple[int, int], raw: bytes,
            palette: np.ndarray | None) -> bytes:
    """A JP2 file, reversible 5/3 wavelet and no quality layers (lossless), the reversible colour transform for
    colour images (smaller; nvJPEG2000 and OpenJPEG undo it exactly); accepted only if Pillow decodes it to the
    same samples. One component per channel: the modes ``J2K.modes`` names (no palette)."""
    if mode not in J2K.modes:
        raise Refuse(J2K.refusal(f"unsupported-mode:{mode}"))
    out = io.BytesIO()
    try:
        # A copy detached from the source file: saving the opened plugin object would re-read the source
        Image.frombytes(mode, size, raw).save(out, "JPEG2000", irreversible=False, mct=1 if mode != "L" else 0,
                                              no_jp2=False)
        j2k = out.getvalue()
        check = Jpeg2KImagePlugin.Jpeg2KImageFile(io.BytesIO(j2k))
        check.load()
    except (OSError, ValueError) as exc:  # OpenJPEG's failure, not the image's: a BMP may still hold it
        log.debug("JPEG 2000 encode or its check failed: %s", exc)
        raise Refuse(J2K.refusal("encode-failed")) from None
    if not same_image(im, check, raw):
        log.warning("JPEG 2000 round trip differs for a %s %dx%d image", mode, *size)
        raise Refuse(J2K.refusal("round-trip-mismatch"))  # its own: a BMP may still hold it
    return j2k
