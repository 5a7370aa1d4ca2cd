"""PNG originals: the chunk walk and the policy of what a raw file can carry exactly (the module docstring of
``formats`` says why each refusal), and a PNG's expansion."""

from __future__ import annotations

import io
import struct
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from PIL import PngImagePlugin

from .checks import Refuse, check_exif
from .encoders import to_raw

PNG_SIGNATURE: Final = b"\x89PNG\r\n\x1a\n"

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
_EXIF_TEXT_KEYS: Final = (b"Raw profile type exif", b"Raw profile type APP1")
_TEXT_CHUNKS: Final = frozenset({b"tEXt", b"zTXt", b"iTXt"})
# Chunks whose content the policy reads; of all others only presence counts.
_POLICY_CHUNKS: Final = frozenset({b"IHDR", b"gAMA", b"cHRM", b"eXIf"})
#: libpng's default limit on a width or a height (PNG_USER_WIDTH_MAX, PNG_USER_HEIGHT_MAX): past it OpenCV and
#: DALI refuse the PNG ("exceeds user limit in IHDR"), which a raw file must not turn into pixels.
PNG_USER_LIMIT: Final = 1_000_000
#: The most chunks a PNG is walked for: a file of 12-byte chunks held ~17 times its size in the walk's lists
#: (a 1 GB one would take 17 GB). A million is 60 times the IDATs of a 100 Mpx image in libpng's 8 KB chunks.
MAX_CHUNKS: Final = 1 << 20
#: Bytes of ancillary chunks (each counted with ``_CHUNK_KEPT`` besides its body) past which a PNG is refused
#: as too large: Pillow keeps a copy of every one it does not know (``private_chunks``) and of an eXIf, on top
#: of the source the worker's memory is planned for (twice its size), and a 1-pixel PNG of a 40 MB eXIf took
#: five times its size. Real ones hold a few KB of text, EXIF and XMP.
MAX_ANCILLARY_BYTES: Final = 16 << 20
_CHUNK_KEPT: Final = 128  # what Pillow keeps of a chunk besides its body (a tuple, a bytes object)
#: A compressed text chunk (zTXt, or an iTXt whose compression flag is set) counted as what Pillow may keep of it
#: decompressed: a 63 KB PNG of 60 compressed text chunks took 61 MB of a worker's memory planned for 127 KB.
#: Uncompressed ones (XMP, a tool's keys: one iTXt each) count as what they are.
_TEXT_KEPT: Final = PngImagePlugin.MAX_TEXT_CHUNK
#: OpenCV's limit on a chunk before the image data (``PngDecoder::read_chunk``: its length and 12), and the chunks
#: it lets past it.
OPENCV_CHUNK_LIMIT: Final = 8_000_000
_OPENCV_LARGE_CHUNKS: Final = frozenset({b"IDAT", b"IEND", b"PLTE", b"tEXt", b"tRNS", b"fdAT"})


def png_header_size(data: bytes) -> tuple[int, int]:
    if len(data) < 33:
        raise Refuse("truncated", "no complete IHDR")
    length, ctype = struct.unpack_from(">I4s", data, 8)
    if ctype != b"IHDR" or length != 13:
        raise Refuse("corrupt", "first chunk is not IHDR")
    w, h = struct.unpack_from(">II", data, 16)
    return w, h


#: The largest chunk length libpng takes (``png_get_uint_31``).
_PNG_UINT_MAX = 0x7FFFFFFF


def _compressed_text(name: bytes, body: memoryview) -> bool:
    """Whether the chunk ``name`` of ``body`` holds compressed text: a zTXt, or an iTXt whose compression flag
    (the byte after its keyword's NUL) is set."""
    if name == b"zTXt":
        return True
    if name != b"iTXt":
        return False
    end = bytes(body[:81]).find(b"\0")  # a keyword is 1-79 bytes
    return 0 <= end < len(body) - 1 and body[end + 1] != 0


def _chunk_name_valid(name: bytes) -> bool:
    """Whether libpng takes a chunk of this type: four ASCII letters, the third (the reserved bit) upper case."""
    return len(name) == 4 and name.isalpha() and name.isascii() and name[2:3].isupper()


def _scan_png(data: bytes) -> tuple[int, int, int, int, dict[bytes, list[bytes]], _ImageData]:
    """Walk the chunks: structure, CRCs (libpng rejects bad ones even in IDAT,
    which Pillow does not read), IEND present.  Returns IHDR fields, the
    small chunks the policy looks at, and the image data's parts with the
    size they must inflate to (``_check_image_data``: after the policy's
    cheap refusals)."""
    w, h, depth, ctype, comp, filt, interlace = struct.unpack_from(">IIBBBBB", data, 16)
    if w == 0 or h == 0 or comp != 0 or filt != 0 or interlace > 1:
        raise Refuse("corrupt", "bad IHDR")
    if depth not in _PNG_VALID_DEPTHS.get(ctype, ()):
        raise Refuse("corrupt", f"bad colour type/depth {ctype}/{depth}")
    if w > PNG_USER_LIMIT or h > PNG_USER_LIMIT:
        raise Refuse("too-large", f"{w}x{h}: past libpng's limit of {PNG_USER_LIMIT} a side")
    view = memoryview(data)
    chunks: dict[bytes, list[bytes]] = {}
    idat = _ImageData(view, array("q"), 0)  # the IDATs' spans: 16 bytes each, not a memoryview's 180
    last, seen_plte = b"", False
    ancillary = 0
    pos, n = 8, len(data)
    for _ in range(MAX_CHUNKS):
        if pos + 12 > n:
            raise Refuse("truncated", "chunk header past end of file")
        length, name = struct.unpack_from(">I4s", data, pos)
        if length > _PNG_UINT_MAX:  # libpng: "PNG unsigned integer out of range"
            raise Refuse("corrupt", f"chunk length {length} past 2**31 - 1")
        if not _chunk_name_valid(name):
            # libpng refuses the whole file ("invalid chunk type"); Pillow reads past it: a raw object of a PNG
            # that OpenCV and DALI cannot decode would hand them pixels where the original is an error.
            raise Refuse("corrupt", f"invalid chunk type {name!r}")
        end = pos + 12 + length
        if end > n:
            raise Refuse("truncated", f"{name!r} past end of file")
        if zlib.crc32(view[pos + 4 : end - 4]) != struct.unpack_from(">I", data, end - 4)[0]:
            raise Refuse("corrupt", f"CRC mismatch in {name!r}")
        bodies = chunks.setdefault(name, [])
        if name in _TEXT_CHUNKS:
            keyword = bytes(view[pos + 8 : min(end - 4, pos + 8 + 80)]).split(b"\0", 1)[0]
            if keyword in _EXIF_TEXT_KEYS:  # the only keywords the policy looks for: no list of every one
                bodies.append(keyword)
        elif name in _POLICY_CHUNKS:
            bodies.append(bytes(view[pos + 8 : end - 4]))
        if name == b"IEND":
            break
        if name[:1].isupper() and name not in (b"IHDR", b"PLTE", b"IDAT"):
            # An unknown critical chunk is a hard error for libpng.
            raise Refuse("corrupt", f"unknown critical chunk {name!r}")
        if not idat.spans:
            # OpenCV's PNG reader (DALI's CPU decoder fails alike) walks the chunks before the first IDAT itself,
            # and refuses the whole file for a chunk past 8,000,000 bytes (C2PA, XMP, a private one) but a few,
            # or a bKGD of another length than its colour types': Pillow decodes them, and their raw object
            # would hand those loaders pixels where the original is an error.
            if length + 12 > OPENCV_CHUNK_LIMIT and name not in _OPENCV_LARGE_CHUNKS:
                raise Refuse("corrupt", f"{name!r} of {length} bytes before the image data: past OpenCV's limit")
            if name == b"bKGD" and length not in (1, 2, 6):
                raise Refuse("corrupt", f"bKGD of {length} bytes")
        if name[:1].islower():
            ancillary += length + (_TEXT_KEPT if _compressed_text(name, view[pos + 8 : end - 4]) else _CHUNK_KEPT)
            if ancillary > MAX_ANCILLARY_BYTES:
                raise Refuse("too-large", f"more than {MAX_ANCILLARY_BYTES} bytes of ancillary chunks")
        if name == b"IDAT":
            if idat.spans and last != b"IDAT":  # libpng reads one run of IDATs
                raise Refuse("corrupt", "IDAT chunks not consecutive")
            idat.spans.extend((pos + 8, end - 4))
        elif name == b"PLTE":
            if seen_plte or idat.spans:  # libpng: "duplicate" (an error), "out of place" (a warning)
                raise Refuse("corrupt", "PLTE repeated or after IDAT")
            # libpng: an empty one is an error for any image; one of no whole number of entries, or past 256,
            # ("PLTE: invalid") for a palette image (elsewhere a warning, and the palette unused)
            if length == 0 or (ctype == 3 and (length % 3 or length > 3 * 256)):
                raise Refuse("corrupt", f"PLTE of {length} bytes")
        seen_plte = seen_plte or name == b"PLTE"
        last = name
        pos = end
    else:
        raise Refuse("too-large", f"more than {MAX_CHUNKS} chunks")
    if b"IDAT" not in chunks or len(chunks[b"IHDR"]) != 1:
        raise Refuse("corrupt", "no IDAT or repeated IHDR")
    # libpng: PLTE is required for palette images and forbidden for gray ones.
    has_plte = b"PLTE" in chunks
    if (ctype == 3 and not has_plte) or (ctype in (0, 4) and has_plte):
        raise Refuse("corrupt", "PLTE missing or not allowed")
    return w, h, depth, ctype, chunks, _ImageData(view, idat.spans, _image_data_size(w, h, depth, ctype, interlace))


@dataclass(frozen=True)
class _ImageData:
    """A PNG's IDAT bodies, in order (``spans``: start, end of each in ``data``), and the bytes they must inflate
    to."""

    data: memoryview
    spans: array[int]
    size: int

    def parts(self) -> Iterator[memoryview]:
        spans = iter(self.spans)
        for start, end in zip(spans, spans):
            yield self.data[start:end]


#: Samples per pixel of each colour type.
_CHANNELS: Final = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
#: Adam7's passes: (first column, first row, column step, row step).
_ADAM7: Final = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
#: Bytes of image data fed, and of inflated data asked for, at a time: the check holds no more than this of it.
_INFLATE_STEP: Final = 1 << 16


def _image_data_size(w: int, h: int, depth: int, ctype: int, interlace: int) -> int:
    """The bytes a PNG's IDAT stream inflates to: each row of each pass, its filter byte and its samples."""
    bits = depth * _CHANNELS[ctype]

    def rows(width: int, height: int) -> int:
        return 0 if width == 0 or height == 0 else height * (1 + (width * bits + 7) // 8)

    if not interlace:
        return rows(w, h)
    return sum(rows((w - x + dx - 1) // dx, (h - y + dy - 1) // dy) for x, y, dx, dy in _ADAM7)


def _check_image_data(image_data: _ImageData) -> None:
    """The IDAT stream is one whole zlib stream (its Adler-32 checked) of exactly the image's bytes, and nothing
    after it. Pillow stops reading once the image is full, so it decodes a stream cut before its checksum, which
    libpng (under OpenCV and DALI) refuses, and one with more data than the image holds or more after it, which
    libpng only warns about: when in doubt, the original. Inflated a step at a time and never past the image's
    size: a small file of a long stream costs no memory."""
    expected = image_data.size
    inflate = zlib.decompressobj()
    total = after = 0
    try:
        for part in image_data.parts():
            for start in range(0, len(part), _INFLATE_STEP):
                if inflate.eof:
                    after += len(part) - start
                    break
                # A step of input at a time: each output step copies what input is left (unconsumed_tail),
                # and one IDAT of 64 MB fed whole cost seconds in those copies.
                pending = bytes(part[start : start + _INFLATE_STEP])
                while pending and not inflate.eof:
                    total += len(inflate.decompress(pending, _INFLATE_STEP))
                    if total > expected:
                        raise Refuse("corrupt", "more image data than the image holds")
                    pending = inflate.unconsumed_tail
        while not inflate.eof:  # output the last input left inside the inflater
            out = inflate.decompress(b"", _INFLATE_STEP)
            if not out:
                break
            total += len(out)
            if total > expected:
                raise Refuse("corrupt", "more image data than the image holds")
    except zlib.error as exc:
        raise Refuse("corrupt", f"image data: {exc}") from None
    if not inflate.eof or inflate.unused_data or after or total != expected:
        raise Refuse("corrupt", "image data cut short, or more than one zlib stream")


def _check_png_policy(depth: int, ctype: int, chunks: dict[bytes, list[bytes]]) -> str:
    """Chunk-level refusals; returns the Pillow mode we expect."""
    if depth == 16:
        raise Refuse(f"unsupported-mode:{_PNG_16BIT_NAMES[ctype]}")
    if ctype == 4:
        raise Refuse("unsupported-mode:LA")
    if b"acTL" in chunks or b"fcTL" in chunks or b"fdAT" in chunks:
        raise Refuse("animated")
    if b"tRNS" in chunks:
        raise Refuse("transparency")
    if b"iCCP" in chunks:
        raise Refuse("icc-profile")
    if b"cICP" in chunks:
        raise Refuse("color-space")
    for g in chunks.get(b"gAMA", []):
        # libpng skips gamma correction when within 5 % of the screen gamma
        # (PNG_GAMMA_THRESHOLD), so ~1/2.2 is a no-op even for a decoder
        # that does correct for a 2.2 display.
        if len(g) != 4 or abs(struct.unpack(">I", g)[0] / _SRGB_GAMMA - 1) >= 0.05:
            raise Refuse("gamma")
    for c in chunks.get(b"cHRM", []):
        if len(c) != 32 or any(abs(v - s) > 1000 for v, s in zip(struct.unpack(">8I", c), _SRGB_CHRM)):
            raise Refuse("chromaticity")
    for e in chunks.get(b"eXIf", []):
        # Some writers wrongly keep the JPEG "Exif\0\0" prefix; lenient
        # readers skip it, so look past it too.
        check_exif(e[6:] if e.startswith(b"Exif\0\0") else e)
    if any(chunks.get(name) for name in _TEXT_CHUNKS):  # the walk keeps only the keywords of EXIF in text
        # ImageMagick-style EXIF; Pillow's getexif() reads it.
        raise Refuse("exif-orientation", "EXIF in a text chunk")
    return _PNG_MODES[(ctype, depth)]


def expand_png(data: bytes, max_pixels: int, to: str) -> bytes:
    w, h = png_header_size(data)
    if w * h > max_pixels:
        raise Refuse("too-large", f"{w}x{h}")
    _, _, depth, ctype, chunks, image_data = _scan_png(data)
    mode = _check_png_policy(depth, ctype, chunks)
    _check_image_data(image_data)
    # The plugin class directly, not Image.open: our max_pixels check above
    # replaces Pillow's process-wide MAX_IMAGE_PIXELS check, which would warn
    # (or raise) on legitimately large images.
    im = PngImagePlugin.PngImageFile(io.BytesIO(data))
    return to_raw(im, mode, (w, h), to)
