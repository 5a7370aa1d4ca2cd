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
/ Ultra HDR JPEG [multi-picture]; CMYK/YCCK JPEG [unsupported-mode:CMYK];
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
"""

from __future__ import annotations

import io
import logging
import re
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
from PIL import BmpImagePlugin, Image, ImageFile, Jpeg2KImagePlugin, JpegImagePlugin, PngImagePlugin

from .rawformats import BMP, DEFAULT, J2K, by_magic, by_name

log = logging.getLogger(__name__)

__all__ = [
    "BMP_MAGIC",
    "EXPANDABLE",
    "Expansion",
    "MAX_PIXELS",
    "decode",
    "expand",
    "pixel_count",
    "same_pixels",
    "sniff",
]

#: What the BMP writer starts a file with (``rawformats.BMP``).
BMP_MAGIC: Final = BMP.magic[0]
EXPANDABLE: Final = ("png", "jpeg")
#: expand's default bound: larger images are refused from their header (too-large).
MAX_PIXELS: Final = 100_000_000

PNG_SIGNATURE: Final = b"\x89PNG\r\n\x1a\n"
JPEG_SOI: Final = b"\xff\xd8\xff"
# DIB header sizes Pillow understands; used to make 'BM' sniffing less naive.
_BMP_HEADER_SIZES: Final = frozenset({12, 40, 52, 56, 64, 108, 124})


class _Refuse(Exception):
    """Internal: stop expanding with this reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


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
            return raw.name if struct.unpack_from("<I", head, 14)[0] in _BMP_HEADER_SIZES else None
        if len(head) >= 16:
            return raw.name if struct.unpack_from("<H", head, 14)[0] in _BMP_HEADER_SIZES else None
    return None if raw is None else raw.name


def decode(data: bytes) -> np.ndarray:
    """Pixels as Pillow decodes the bytes (Image.open + load), as an array.

    This is exactly what a Pillow loader sees, Pillow's own decompression-bomb
    limit (Image.MAX_IMAGE_PIXELS) included.  For mode P this is the palette
    indices; use same_pixels() to compare palettes too.
    """
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return np.array(im)


def same_pixels(a: bytes, b: bytes) -> bool:
    """True when Pillow decodes both byte strings to the same mode, size,
    samples and (for P) palette colours and transparency."""
    with Image.open(io.BytesIO(a)) as ia, Image.open(io.BytesIO(b)) as ib:
        ia.load()
        ib.load()
        return _same_image(ia, ib)


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
        raw = _expand_png(data, max_pixels, to) if fmt == "png" else _expand_jpeg(data, max_pixels, to)
    except MemoryError:
        raise
    except _Refuse as r:
        log.debug("not expanding %s: %s %s", fmt, r.reason, r.detail)
        return Expansion(None, fmt, r.reason, to)
    except Exception as e:  # noqa: BLE001 - any decoder failure means "corrupt", never a crash
        log.debug("not expanding %s: corrupt (%s: %s)", fmt, type(e).__name__, e)
        return Expansion(None, fmt, "corrupt", to)
    return Expansion(raw, fmt, None, to)


def pixel_count(data: bytes) -> int | None:
    """Width x height as the header declares it, read as expand reads it, before any pixel is decoded: None
    where expand would refuse the header itself (not a PNG/JPEG, truncated, a policy refusal before the frame)."""
    fmt = sniff(data[:32])
    try:
        if fmt == "png":
            w, h = _png_header_size(data)
        elif fmt == "jpeg":
            w, h, _ = _scan_jpeg(data, sys.maxsize)
        else:
            return None
    except _Refuse:
        return None
    return w * h


# --------------------------------------------------------------------- PNG

# (colour type, bit depth) -> Pillow mode we can write as BMP.
_PNG_MODES: Final[dict[tuple[int, int], str]] = {
    (0, 1): "1",
    (0, 2): "L",
    (0, 4): "L",
    (0, 8): "L",
    (2, 8): "RGB",
    (3, 1): "P",
    (3, 2): "P",
    (3, 4): "P",
    (3, 8): "P",
    (6, 8): "RGBA",
}
_PNG_16BIT_NAMES: Final = {0: "I;16", 2: "RGB;16", 4: "LA;16", 6: "RGBA;16"}
_PNG_VALID_DEPTHS: Final = {0: {1, 2, 4, 8, 16}, 2: {8, 16}, 3: {1, 2, 4, 8}, 4: {8, 16}, 6: {8, 16}}
# sRGB / Rec.709 white point and primaries in cHRM units (1e-5).
_SRGB_CHRM: Final = (31270, 32900, 64000, 33000, 30000, 60000, 15000, 6000)
_SRGB_GAMMA: Final = 45455  # 1/2.2 in gAMA units
_XMP_ORIENTATION: Final = re.compile(rb'tiff:Orientation(="|>)([0-9])')
_EXIF_TEXT_KEYS: Final = (b"Raw profile type exif", b"Raw profile type APP1")
_TEXT_CHUNKS: Final = frozenset({b"tEXt", b"zTXt", b"iTXt"})
# Chunks whose content the policy reads; of all others only presence counts.
_POLICY_CHUNKS: Final = frozenset({b"IHDR", b"gAMA", b"cHRM", b"eXIf"})


def _png_header_size(data: bytes) -> tuple[int, int]:
    if len(data) < 33:
        raise _Refuse("truncated", "no complete IHDR")
    length, ctype = struct.unpack_from(">I4s", data, 8)
    if ctype != b"IHDR" or length != 13:
        raise _Refuse("corrupt", "first chunk is not IHDR")
    w, h = struct.unpack_from(">II", data, 16)
    return w, h


def _scan_png(data: bytes) -> tuple[int, int, int, int, dict[bytes, list[bytes]]]:
    """Walk the chunks: structure, CRCs (libpng rejects bad ones even in IDAT,
    which Pillow does not read), IEND present.  Returns IHDR fields and the
    small chunks the policy looks at."""
    w, h, depth, ctype, comp, filt, interlace = struct.unpack_from(">IIBBBBB", data, 16)
    if w == 0 or h == 0 or comp != 0 or filt != 0 or interlace > 1:
        raise _Refuse("corrupt", "bad IHDR")
    if depth not in _PNG_VALID_DEPTHS.get(ctype, ()):
        raise _Refuse("corrupt", f"bad colour type/depth {ctype}/{depth}")
    view = memoryview(data)
    chunks: dict[bytes, list[bytes]] = {}
    pos, n = 8, len(data)
    while True:
        if pos + 12 > n:
            raise _Refuse("truncated", "chunk header past end of file")
        length, name = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if end > n:
            raise _Refuse("truncated", f"{name!r} past end of file")
        if zlib.crc32(view[pos + 4 : end - 4]) != struct.unpack_from(">I", data, end - 4)[0]:
            raise _Refuse("corrupt", f"CRC mismatch in {name!r}")
        bodies = chunks.setdefault(name, [])
        if name in _TEXT_CHUNKS:
            bodies.append(bytes(view[pos + 8 : min(end - 4, pos + 8 + 80)]))  # keyword only
        elif name in _POLICY_CHUNKS:
            bodies.append(bytes(view[pos + 8 : end - 4]))
        if name == b"IEND":
            break
        if name[:1].isupper() and name not in (b"IHDR", b"PLTE", b"IDAT"):
            # An unknown critical chunk is a hard error for libpng.
            raise _Refuse("corrupt", f"unknown critical chunk {name!r}")
        pos = end
    if b"IDAT" not in chunks or len(chunks[b"IHDR"]) != 1:
        raise _Refuse("corrupt", "no IDAT or repeated IHDR")
    # libpng: PLTE is required for palette images and forbidden for gray ones.
    has_plte = b"PLTE" in chunks
    if (ctype == 3 and not has_plte) or (ctype in (0, 4) and has_plte):
        raise _Refuse("corrupt", "PLTE missing or not allowed")
    return w, h, depth, ctype, chunks


def _check_png_policy(depth: int, ctype: int, chunks: dict[bytes, list[bytes]]) -> str:
    """Chunk-level refusals; returns the Pillow mode we expect."""
    if depth == 16:
        raise _Refuse(f"unsupported-mode:{_PNG_16BIT_NAMES[ctype]}")
    if ctype == 4:
        raise _Refuse("unsupported-mode:LA")
    if b"acTL" in chunks or b"fcTL" in chunks or b"fdAT" in chunks:
        raise _Refuse("animated")
    if b"tRNS" in chunks:
        raise _Refuse("transparency")
    if b"iCCP" in chunks:
        raise _Refuse("icc-profile")
    if b"cICP" in chunks:
        raise _Refuse("color-space")
    for g in chunks.get(b"gAMA", []):
        # libpng skips gamma correction when within 5 % of the screen gamma
        # (PNG_GAMMA_THRESHOLD), so ~1/2.2 is a no-op even for a decoder
        # that does correct for a 2.2 display.
        if len(g) != 4 or abs(struct.unpack(">I", g)[0] / _SRGB_GAMMA - 1) >= 0.05:
            raise _Refuse("gamma")
    for c in chunks.get(b"cHRM", []):
        if len(c) != 32 or any(abs(v - s) > 1000 for v, s in zip(struct.unpack(">8I", c), _SRGB_CHRM)):
            raise _Refuse("chromaticity")
    for e in chunks.get(b"eXIf", []):
        # Some writers wrongly keep the JPEG "Exif\0\0" prefix; lenient
        # readers skip it, so look past it too.
        _check_exif(e[6:] if e.startswith(b"Exif\0\0") else e)
    for name in _TEXT_CHUNKS:
        for t in chunks.get(name, []):
            key = t.split(b"\0", 1)[0]
            if key in _EXIF_TEXT_KEYS:
                # ImageMagick-style EXIF; Pillow's getexif() reads it.
                raise _Refuse("exif-orientation", "EXIF in a text chunk")
    return _PNG_MODES[(ctype, depth)]


def _expand_png(data: bytes, max_pixels: int, to: str) -> bytes:
    w, h = _png_header_size(data)
    if w * h > max_pixels:
        raise _Refuse("too-large", f"{w}x{h}")
    _, _, depth, ctype, chunks = _scan_png(data)
    mode = _check_png_policy(depth, ctype, chunks)
    # The plugin class directly, not Image.open: our max_pixels check above
    # replaces Pillow's process-wide MAX_IMAGE_PIXELS check, which would warn
    # (or raise) on legitimately large images.
    im = PngImagePlugin.PngImageFile(io.BytesIO(data))
    return _to_raw(im, mode, (w, h), to)


# -------------------------------------------------------------------- JPEG

_SOF_MARKERS: Final = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE_MARKERS: Final = frozenset({0x01, 0xD8, *range(0xD0, 0xD8)})


def _scan_jpeg(data: bytes, max_pixels: int) -> tuple[int, int, int]:
    """Walk the marker segments up to the first SOS: frame size and precision
    from SOF (refused at once if too large), and the metadata refusals.
    Mirrors Pillow/libjpeg in skipping junk bytes between segments."""
    n = len(data)
    pos = 2
    sof: tuple[int, int, int] | None = None
    while True:
        pos = data.find(b"\xff", pos)  # skip junk (C speed: junk may be long)
        if pos < 0:
            raise _Refuse("truncated", "no SOS")
        while pos < n and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= n:
            raise _Refuse("truncated", "no SOS")
        marker = data[pos]
        pos += 1
        if marker in _STANDALONE_MARKERS:
            continue
        if marker == 0xD9:
            raise _Refuse("corrupt", "EOI before SOS")
        if pos + 2 > n:
            raise _Refuse("truncated", "segment length past end")
        length = struct.unpack_from(">H", data, pos)[0]
        if length < 2:
            raise _Refuse("corrupt", "bad segment length")
        if pos + length > n:
            raise _Refuse("truncated", "segment past end")
        seg = data[pos + 2 : pos + length]
        if marker in _SOF_MARKERS:
            if len(seg) < 6:
                raise _Refuse("corrupt", "short SOF")
            precision, height, width = struct.unpack_from(">BHH", seg)
            if width * height > max_pixels:
                raise _Refuse("too-large", f"{width}x{height}")
            sof = (width, height, precision)
        elif marker == 0xE1 and seg.startswith(b"Exif\0\0"):
            _check_exif(seg[6:])
        elif marker == 0xE1 and seg.startswith(b"http://ns.adobe.com/xap/1.0/\0"):
            _check_xmp(seg)
        elif marker == 0xE2 and seg.startswith(b"ICC_PROFILE\0"):
            raise _Refuse("icc-profile")
        elif marker == 0xE2 and seg.startswith(b"MPF\0"):
            # MPO / Ultra HDR gain maps: more than one picture in the file.
            raise _Refuse("multi-picture")
        elif marker == 0xDA:
            if sof is None:
                raise _Refuse("corrupt", "SOS before SOF")
            # libjpeg fills a cut-off scan with gray and only warns; Pillow
            # raises.  Requiring EOI after the scan keeps us off such files.
            if data.rfind(b"\xff\xd9") < pos + length:
                raise _Refuse("truncated", "no EOI after scan")
            return sof
        pos += length


def _expand_jpeg(data: bytes, max_pixels: int, to: str) -> bytes:
    width, height, precision = _scan_jpeg(data, max_pixels)
    if width == 0 or height == 0:
        raise _Refuse("corrupt", "zero size (DNL) frame")
    if precision != 8:
        raise _Refuse(f"unsupported-mode:jpeg-{precision}bit")
    im = JpegImagePlugin.JpegImageFile(io.BytesIO(data))  # see _expand_png for why not Image.open
    if im.mode not in ("L", "RGB"):
        raise _Refuse(f"unsupported-mode:{im.mode}")
    return _to_raw(im, im.mode, (width, height), to)


# ------------------------------------------------------------ EXIF / XMP


def _check_exif(tiff: bytes) -> None:
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
                raise _Refuse("exif-orientation", f"orientation {value}")
    except (KeyError, ValueError, struct.error) as e:
        raise _Refuse("exif-unreadable", str(e)) from None


def _check_xmp(xmp: bytes) -> None:
    # Pillow's getexif() (and so ImageOps.exif_transpose) takes the
    # orientation from XMP when EXIF has none; same pattern as Pillow.
    m = _XMP_ORIENTATION.search(xmp)
    if m and m[2] != b"1":
        raise _Refuse("exif-orientation", "XMP orientation")


# ------------------------------------------------------------- BMP writer

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
_SENTINEL: Final = np.array([[255, 0, 0]], np.uint8)  # any non-gray colour


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


# ------------------------------------------------- decode, write, verify


def _to_raw(im: ImageFile.ImageFile, mode: str, size: tuple[int, int], to: str) -> bytes:
    """Load the opened original, write its raw file (``to``: a raw format's name), and prove the round trip."""
    raw, palette = _checked_samples(im, mode, size)
    return _ENCODERS[to](im, mode, size, raw, palette)


def _checked_samples(im: ImageFile.ImageFile, mode: str, size: tuple[int, int]) -> tuple[bytes, np.ndarray | None]:
    """Load the opened original and refuse what no raw file can carry: its packed samples and, for P, the
    palette to write (with the gray sentinel where needed)."""
    if im.size != size:
        raise _Refuse("corrupt", f"Pillow size {im.size} != header {size}")
    im.load()
    if im.mode != mode:
        raise _Refuse(f"unsupported-mode:{im.mode}", f"expected {mode}")
    # Pillow's own view of orientation (EXIF, XMP, raw-profile text) is what
    # ImageOps.exif_transpose would act on.
    orientation = im.getexif().get(0x0112)
    if orientation not in (None, 1):
        raise _Refuse("exif-orientation", f"Pillow sees orientation {orientation}")
    if im.info.get("transparency") is not None:
        raise _Refuse("transparency")
    # Pillow's packed samples: what np.asarray(im) would wrap, without the
    # extra copies (a 6 MB buffer costs ms here), and a cheap memcmp later.
    raw = im.tobytes()
    palette = None
    if mode == "P":
        flat = im.getpalette()
        if not flat:
            raise _Refuse("corrupt", "P image without palette")
        palette = np.asarray(flat, np.uint8).reshape(-1, 3)
        if int(np.frombuffer(raw, np.uint8).max()) >= len(palette):
            raise _Refuse("corrupt", "palette index out of range")
        if (palette == palette[:, :1]).all():
            # All-gray palette: Pillow would read an identity one as L, and
            # OpenCV/DALI any gray one as 1 channel (3 for the PNG).
            if len(palette) >= 256:
                raise _Refuse("gray-palette")
            palette = np.concatenate([palette, _SENTINEL])
    return raw, palette


def _to_bmp(im: ImageFile.ImageFile, mode: str, size: tuple[int, int], raw: bytes,
            palette: np.ndarray | None) -> bytes:
    bmp = _write_bmp(raw, mode, size, palette)
    check = BmpImagePlugin.BmpImageFile(io.BytesIO(bmp))
    check.load()
    if not _same_image(im, check, raw):
        log.warning("BMP round trip differs for a %s %dx%d image", mode, *size)
        raise _Refuse("round-trip-mismatch")
    return bmp


def _to_j2k(im: ImageFile.ImageFile, mode: str, size: tuple[int, int], raw: bytes,
            palette: np.ndarray | None) -> bytes:
    """A JP2 file, reversible 5/3 wavelet and no quality layers (lossless), the reversible colour transform for
    colour images (smaller; nvJPEG2000 and OpenJPEG undo it exactly); accepted only if Pillow decodes it to the
    same samples. One component per channel: the modes ``J2K.modes`` names (no palette)."""
    if mode not in J2K.modes:
        raise _Refuse(J2K.refusal(f"unsupported-mode:{mode}"))
    out = io.BytesIO()
    # A copy detached from the source file: saving the opened plugin object would re-read the source
    Image.frombytes(mode, size, raw).save(out, "JPEG2000", irreversible=False, mct=1 if mode != "L" else 0,
                                          no_jp2=False)
    j2k = out.getvalue()
    check = Jpeg2KImagePlugin.Jpeg2KImageFile(io.BytesIO(j2k))
    check.load()
    if not _same_image(im, check, raw):
        log.warning("JPEG 2000 round trip differs for a %s %dx%d image", mode, *size)
        raise _Refuse(J2K.refusal("round-trip-mismatch"))  # its own: a BMP may still hold it
    return j2k


#: An encoder: the original opened, its mode and size, its packed samples and, for P, the palette to write; the
#: complete raw file, checked to decode to the same samples (``_Refuse`` otherwise).
_Encoder = Callable[[ImageFile.ImageFile, str, tuple[int, int], bytes, np.ndarray | None], bytes]
#: The encoder of each raw format (``rawformats.RAW_FORMATS``; tests/unit/test_rawformats.py checks that each has
#: one).
_ENCODERS: Final[dict[str, _Encoder]] = {BMP.name: _to_bmp, J2K.name: _to_j2k}


def _same_image(a: Image.Image, b: Image.Image, a_raw: bytes | None = None) -> bool:
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
