"""What each image format is, and how to expand PNG/JPEG losslessly to BMP (or to lossless JPEG 2000).

liquidfs serves a BMP under the original file name, so an unmodified loader
decodes it instead of the PNG/JPEG.  The promise is that it decodes *the same
pixels with the same channel count* as it would from the original.  Every BMP
is therefore checked before it is accepted: written with NumPy, decoded again
by Pillow and compared (mode, size, samples, palette) with Pillow's decode of
the original.  Anything we cannot make identical is refused with a short
machine-friendly reason and served as the original bytes.

BMP layout per source mode (chosen by experiment so that Pillow, DALI
``fn.decoders.image`` (CPU) and OpenCV ``imdecode`` agree with the original;
tests/unit/test_formats.py re-checks all of it):

=========  ==============================================================
source     BMP written
=========  ==============================================================
``1``      1 bpp, BITMAPINFOHEADER, palette black/white (Pillow: mode 1)
``L``      8 bpp, BITMAPINFOHEADER, identity gray palette (Pillow: L,
           OpenCV UNCHANGED: 1 channel, DALI ANY_DATA: 1 channel)
``P``      8 bpp, BITMAPINFOHEADER, the original palette.  If every entry
           is gray we append one non-gray sentinel entry: otherwise Pillow
           reads the BMP as ``L`` (identity palette) and OpenCV/DALI
           ANY_DATA return 1 channel where the PNG gives 3.
``RGB``    24 bpp BI_RGB, BITMAPINFOHEADER
``RGBA``   32 bpp BI_BITFIELDS with an alpha mask in a BITMAPV4HEADER
           (BI_RGB 32 bpp decodes to 3 channels in Pillow and OpenCV).
=========  ==============================================================

Refused (reason in brackets): 16-bit PNG [unsupported-mode:<mode>;16] since
Pillow reduces 16-bit samples to 8 bits while OpenCV IMREAD_UNCHANGED keeps
16; gray+alpha [unsupported-mode:LA] since no BMP decodes to 2 channels;
any tRNS chunk [transparency] (BMP cannot carry a colour key or palette
alpha; OpenCV UNCHANGED gives 4 channels for the PNG); APNG [animated]; MPO
/ Ultra HDR JPEG [multi-picture]; CMYK/YCCK JPEG [unsupported-mode:CMYK]; a JPEG of more than
``jpeg.MAX_SCANS`` scans [too-many-scans] (its decode costs pixels times scans); a PNG whose
image data is not one whole zlib stream of exactly the image's bytes, or whose PLTE is repeated or after IDAT,
or whose IDATs are not consecutive [corrupt] (Pillow decodes them; libpng, under OpenCV and DALI, refuses a
stream cut before its checksum and a PLTE repeated, and only warns about the rest);
embedded ICC profiles [icc-profile] -- Pillow, DALI and OpenCV all ignore
them (tested), but ICC-aware loaders (ImageCms) would see a profile in the
original and none in the BMP; gAMA not within libpng's 5 % "no correction"
threshold of 1/2.2 [gamma] and cHRM other than sRGB/Rec.709 [chromaticity]
-- again ignored by all three decoders when decoding to RGB/unchanged, but a
colour-managing decoder would apply them; cICP [color-space]; any EXIF (or
XMP) orientation other than 1 [exif-orientation] because DALI and OpenCV
IMREAD_COLOR rotate the original (PNG eXIf included) while the BMP has no
EXIF.

Known limits, not fixable by any BMP layout:

* JPEG: the BMP holds Pillow's (libjpeg-turbo) decode.  Other JPEG decoders
  (DALI's nvImageCodec, OpenCV) may differ from libjpeg-turbo by a level or so
  on the original, so for JPEG sources the guarantee is "identical to
  Pillow's decode" (with the DALI 2.4 CPU decoder and OpenCV 5.0 wheels here
  the difference measured 0).
* Decoding a *colour* original straight to gray (OpenCV IMREAD_GRAYSCALE,
  DALI output_type=GRAY) is not bit-exact: libpng converts RGB->gray with its
  own rounding (off by 1) and, with gAMA/sRGB chunks, in linear light (off by
  up to ~100), while the BMP path uses cvtColor-style weights.
* DALI output_type=ANY_DATA cannot decode any 32 bpp BMP (it raises), while
  it gives 4 channels for an RGBA PNG.  RGB output (DALI's default) is exact.
* A JPEG decoded at a reduced size (Pillow's ``draft``, which ``thumbnail``
  uses; OpenCV's IMREAD_REDUCED_*) is scaled in the DCT by libjpeg: its BMP is
  decoded at full size and scaled afterwards, tens of levels apart.
* TensorFlow's BMP decoder reads no palette: a palette image's BMP comes back
  as its indices (gray), its PNG as colours.  TensorFlow loaders read the
  source, or a mount with ``--mix 0``.
* A JPEG whose entropy data is damaged but ends in an EOI decodes under
  libjpeg with a warning (the damaged part filled in): its BMP holds that
  decode, where a strict decoder (nvJPEG) would refuse the original.
"""

from __future__ import annotations

import io
import logging
import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Final

import numpy as np
from PIL import Image, ImageFile

from .bmp import BMP_HEADER_SIZES
from .checks import Refuse, same_image
from .jpeg import JPEG_SOI, expand_jpeg, scan_jpeg
from .png import PNG_SIGNATURE, expand_png, png_header_size
from .rawformats import BMP, DEFAULT, by_magic, by_name
from .rawformats import MAX_PIXELS as _MAX_PIXELS

log = logging.getLogger(__name__)

__all__ = [
    "EXPANDABLE",
    "Expansion",
    "MAX_PIXELS",
    "decode",
    "expand",
    "pixel_count",
    "same_pixels",
    "sniff",
]

EXPANDABLE: Final = ("png", "jpeg")
# expand's default bound (larger images are refused from their header: too-large), defined with the raw formats.
MAX_PIXELS: Final = _MAX_PIXELS


@dataclass(frozen=True)
class Expansion:
    data: bytes | None  # the complete raw file (BMP or JP2) when accepted, else None
    source_format: str | None  # 'png' / 'jpeg' / None
    reason: str | None  # None when accepted, else a short machine-friendly reason
    raw_format: str = DEFAULT.name  # what data holds (``rawformats.RAW_FORMATS``)

    @property
    def accepted(self) -> bool:
        return self.data is not None


def sniff(head: bytes) -> str | None:
    """Real format from the first bytes: 'png', 'jpeg', a raw format's name (``rawformats``) or None. Never by
    extension."""
    if head.startswith(PNG_SIGNATURE):
        return "png"
    if head.startswith(JPEG_SOI):
        return "jpeg"
    raw = by_magic(head)
    if raw is BMP:
        # 'BM' alone is two ASCII letters; when the DIB header size is visible
        # require a known one (its low 16 bits if only 16 bytes were given).
        if len(head) >= 18:
            return raw.name if struct.unpack_from("<I", head, 14)[0] in BMP_HEADER_SIZES else None
        if len(head) >= 16:
            return raw.name if struct.unpack_from("<H", head, 14)[0] in BMP_HEADER_SIZES else None
    return None if raw is None else raw.name


#: The Pillow formats liquidfs ever decodes (``sniff``'s: the sources', the raw formats'): the bytes compared may be
#: whatever another user wrote (`verify` reads a source its writer may rewrite between its check and its read),
#: and Pillow's other plugins run other programs (EPS: Ghostscript, as root).
PILLOW_FORMATS = ("PNG", "JPEG", "BMP", "JPEG2000")


def decode(data: bytes) -> np.ndarray:
    """Pixels as Pillow decodes the bytes (Image.open + load), as an array.

    This is exactly what a Pillow loader sees, Pillow's own decompression-bomb
    limit (Image.MAX_IMAGE_PIXELS) included.  For mode P this is the palette
    indices; use same_pixels() to compare palettes too.
    """
    with Image.open(io.BytesIO(data), formats=PILLOW_FORMATS) as im:
        im.load()
        return np.array(im)


def same_pixels(a: bytes, b: bytes) -> bool:
    """True when Pillow decodes both byte strings to the same mode, size,
    samples and (for P) palette colours and transparency. Pillow's bomb warning is not given: what is compared
    was expanded under ``MAX_PIXELS``, our limit (its 89.5 Mpx one warned once per worker in `verify`'s output)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(a), formats=PILLOW_FORMATS) as ia, \
                Image.open(io.BytesIO(b), formats=PILLOW_FORMATS) as ib:
            ia.load()
            ib.load()
            return same_image(ia, ib)


def expand(data: bytes, *, max_pixels: int = MAX_PIXELS, to: str = DEFAULT.name) -> Expansion:
    """Decode the original (PNG or JPEG by content), write a BMP (``to``: another
    raw format, as ``rawformats`` names it), decode that again and accept it only
    if bit-exact with the original's decode.

    Never raises for bad input: every problem becomes a reason.  Images whose
    header declares more than max_pixels are refused from the header alone,
    before any pixel is decoded.  Only MemoryError propagates.
    """
    by_name(to)  # ValueError for no raw format's name
    if not data:
        return Expansion(None, None, "empty", to)
    data = bytes(data)  # a bytearray/memoryview would trip the parsers into 'corrupt'; no copy for bytes
    fmt = sniff(data[:32])
    if fmt not in EXPANDABLE:
        return Expansion(None, None, "not-an-image" if fmt is None else f"not-expandable:{fmt}", to)
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # With this process-wide Pillow switch on, a damaged file decodes to
        # made-up pixels instead of failing, so our decode would not be what
        # a default Pillow (or libpng) gives for the original.
        return Expansion(None, fmt, "truncated-images-allowed", to)
    try:
        raw = expand_png(data, max_pixels, to) if fmt == "png" else expand_jpeg(data, max_pixels, to)
    except MemoryError:
        raise
    except Refuse as r:
        log.debug("not expanding %s: %s %s", fmt, r.reason, r.detail)
        return Expansion(None, fmt, r.reason, to)
    except Exception as e:  # noqa: BLE001 - any decoder failure means "corrupt", never a crash
        if isinstance(e, OSError) and "out of memory" in str(e):
            # A codec's own allocation that failed (Pillow's "out of memory error", -9): not the file's fault,
            # and not remembered as corrupt for good; the next run tries it again.
            log.debug("not expanding %s: no memory (%s)", fmt, e)
            return Expansion(None, fmt, "no-memory", to)
        log.debug("not expanding %s: corrupt (%s: %s)", fmt, type(e).__name__, e)
        return Expansion(None, fmt, "corrupt", to)
    return Expansion(raw, fmt, None, to)


def pixel_count(data: bytes) -> int | None:
    """Width x height as the header declares it, read as expand reads it, before any pixel is decoded: None
    where expand would refuse the header itself (not a PNG/JPEG, truncated, a policy refusal before the frame)."""
    fmt = sniff(data[:32])
    try:
        if fmt == "png":
            w, h = png_header_size(data)
        elif fmt == "jpeg":
            w, h, _ = scan_jpeg(data, sys.maxsize)
        else:
            return None
    except Refuse:
        return None
    return w * h
