"""JPEG originals: the marker walk up to the first scan (frame size, precision, the metadata refusals), and a
JPEG's expansion to a raw file of Pillow's decode."""

from __future__ import annotations

import io
import re
import struct
from typing import Final

from PIL import JpegImagePlugin

from .checks import Refuse, check_exif, check_xmp
from .encoders import to_raw

JPEG_SOI: Final = b"\xff\xd8\xff"
_SOF_MARKERS: Final = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: The most scans a JPEG expanded may have. A decode costs its pixels times its scans: libjpeg's progressive
#: scripts write 10 or fewer, and a file of a few KB repeating one scan thousands of times held a prepare worker
#: for minutes (a 4000x4000 with 1,000: 12.8 s here). Past it the original is served.
MAX_SCANS: Final = 100
#: The most marker segments walked before the first scan, and between scans: a real JPEG has tens. A file of
#: millions of 4-byte comments would hold a worker for a Python step each.
MAX_SEGMENTS: Final = 10_000
#: The next marker that starts a segment or ends the image: 0xFF, then a byte that is none of a stuffed zero, a
#: fill byte or a standalone marker (RSTn, TEM, SOI). Found in C: the walk libjpeg makes (skip to 0xFF, skip the
#: fill bytes, a zero after them is junk) stepped a Python loop per byte of fill, stuffing or restart markers,
#: and a few KB of image padded with 5 MB of them held a worker for seconds (1 GB: minutes). Two bytes, no
#: quantifier: a linear search whatever the input.
_SEGMENT_MARKER: Final = re.compile(rb"\xff[^\x00\x01\xd0-\xd8\xff]")


def scan_jpeg(data: bytes, max_pixels: int) -> tuple[int, int, int]:
    """Walk the marker segments up to the first SOS: frame size and precision
    from SOF (refused at once if too large), and the metadata refusals.
    Junk between segments, which Pillow and libjpeg skip, is refused: DALI's parser is stricter."""
    n = len(data)
    pos = 2
    sof: tuple[int, int, int] | None = None
    first_app1 = True
    for _ in range(MAX_SEGMENTS):
        # Junk, fill bytes, FF 00 (junk libjpeg and Pillow skip: a length read there steered past ICC) and
        # standalone markers passed over as libjpeg passes them.
        found = _SEGMENT_MARKER.search(data, pos)
        if found is None:
            raise Refuse("truncated", "no SOS")
        if data[pos:found.start()].strip(b"\xff"):
            # DALI's parser (nvImageCodec's) takes only fill bytes before a marker: junk, or a standalone marker
            # (RSTn), fails its decode ("nvImageCodec failure '#3'") where libjpeg and Pillow skip them. The raw
            # object of such a file would hand DALI pixels where the original is an error.
            raise Refuse("corrupt", "bytes other than fill between segments before the first scan")
        marker = data[found.start() + 1]
        pos = found.end()
        if marker == 0xD9:
            raise Refuse("corrupt", "EOI before SOS")
        if pos + 2 > n:
            raise Refuse("truncated", "segment length past end")
        length = struct.unpack_from(">H", data, pos)[0]
        if length < 2:
            raise Refuse("corrupt", "bad segment length")
        if pos + length > n:
            raise Refuse("truncated", "segment past end")
        seg = data[pos + 2 : pos + length]
        if marker in _SOF_MARKERS:
            if len(seg) < 6:
                raise Refuse("corrupt", "short SOF")
            precision, height, width = struct.unpack_from(">BHH", seg)
            if width * height > max_pixels:
                raise Refuse("too-large", f"{width}x{height}")
            sof = (width, height, precision)
        elif marker == 0xE1 and (seg.startswith(b"Exif\0\0") or (first_app1 and seg[6:8] in (b"II", b"MM"))):
            # (torchvision's apply_exif_orientation reads the first APP1 at offset 6 whatever it says it is: one
            # of another name holding a TIFF header there would turn the original, and never its raw object)
            check_exif(seg[6:])
        elif marker == 0xE1 and seg.startswith(b"http://ns.adobe.com/xap/1.0/\0"):
            check_xmp(seg)
        elif marker == 0xE2 and seg.startswith(b"ICC_PROFILE\0"):
            raise Refuse("icc-profile")
        elif marker == 0xE2 and seg.startswith(b"MPF\0"):
            # MPO / Ultra HDR gain maps: more than one picture in the file.
            raise Refuse("multi-picture")
        elif marker == 0xDA:
            if sof is None:
                raise Refuse("corrupt", "SOS before SOF")
            # A file cut off in its scan (no EOI after it): libjpeg fills the rest with gray and only warns, Pillow
            # raises. Refused. (A scan damaged inside, with its EOI, decodes under both with that warning: its BMP
            # holds that decode, a known limit of ``formats``.)
            if data.rfind(b"\xff\xd9") < pos + length:
                raise Refuse("truncated", "no EOI after scan")
            scans = _scans(data, pos + length)
            if scans > MAX_SCANS:
                raise Refuse("too-many-scans", f"{scans} scans")
            return sof
        first_app1 = first_app1 and marker != 0xE1
        pos += length
    raise Refuse("corrupt", f"more than {MAX_SEGMENTS} segments before the first scan")


def _scans(data: bytes, pos: int) -> int:
    """The scans of a JPEG whose first scan's header ends at ``pos``, up to its EOI, by a walk of its markers:
    entropy-coded bytes hold no marker (each 0xFF is stuffed with a 0x00), but a segment between two scans (a
    comment, a table) may hold any bytes, FF DA and FF D9 too, so each is skipped by its length; what trails
    the EOI (a motion photo's video) is not walked. Past ``MAX_SCANS`` it stops counting."""
    scans, n = 1, len(data)
    for _ in range(MAX_SEGMENTS):
        # In C through the entropy-coded data, its stuffed bytes, fill bytes and restart markers.
        found = _SEGMENT_MARKER.search(data, pos)
        if found is None:
            raise Refuse("truncated", "no EOI after the scans")
        pos = found.start()
        marker = data[pos + 1]
        if marker == 0xD9:
            return scans
        if pos + 4 > n:
            raise Refuse("truncated", "segment length past end")
        length = struct.unpack_from(">H", data, pos + 2)[0]
        if length < 2:
            raise Refuse("corrupt", "bad segment length")
        scans += marker == 0xDA
        if scans > MAX_SCANS:
            return scans
        pos += 2 + length
    raise Refuse("corrupt", f"more than {MAX_SEGMENTS} segments between its scans")


def expand_jpeg(data: bytes, max_pixels: int, to: str) -> bytes:
    width, height, precision = scan_jpeg(data, max_pixels)
    if width == 0 or height == 0:
        raise Refuse("corrupt", "zero size (DNL) frame")
    if precision != 8:
        raise Refuse(f"unsupported-mode:jpeg-{precision}bit")
    im = JpegImagePlugin.JpegImageFile(io.BytesIO(data))  # see expand_png for why not Image.open
    if im.mode not in ("L", "RGB"):
        raise Refuse(f"unsupported-mode:{im.mode}")
    return to_raw(im, im.mode, (width, height), to)
