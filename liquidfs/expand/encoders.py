"""An opened original to its raw file: its samples checked, written by the encoder of the raw format asked for,
the round trip proven."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
from PIL import ImageFile

from .bmp import to_bmp
from .checks import checked_samples
from .j2k import to_j2k
from .rawformats import BMP, J2K


def to_raw(im: ImageFile.ImageFile, mode: str, size: tuple[int, int], to: str) -> bytes:
    """Load the opened original, write its raw file (``to``: a raw format's name), and prove the round trip."""
    raw, palette = checked_samples(im, mode, size)
    return ENCODERS[to](im, mode, size, raw, palette)


#: An encoder: the original opened, its mode and size, its packed samples and, for P, the palette to write; the
#: complete raw file, checked to decode to the same samples (``Refuse`` otherwise).
Encoder = Callable[[ImageFile.ImageFile, str, tuple[int, int], bytes, np.ndarray | None], bytes]
#: The encoder of each raw format (``rawformats.RAW_FORMATS``; tests/unit/test_rawformats.py checks that each has
#: one).
ENCODERS: Final[dict[str, Encoder]] = {BMP.name: to_bmp, J2K.name: to_j2k}
