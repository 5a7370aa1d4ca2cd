"""liquidfs.expand.formats: the BMP served in place of a PNG/JPEG must decode, under
every loader we know, to exactly what the original decodes to.

Decoders checked: Pillow (mode, samples, palette), DALI ``fn.decoders.image``
on the CPU (output_type RGB, ANY_DATA, and GRAY for gray sources) and OpenCV
``imdecode`` (IMREAD_UNCHANGED, IMREAD_COLOR, and IMREAD_GRAYSCALE for gray
sources; skipped only when cv2 is not importable, and never in CI).

For JPEG sources the BMP holds Pillow's decode; DALI and OpenCV decoding the
original may differ from it by at most ``JPEG_OTHER_DECODER_BOUND`` levels
(measured 0 with the DALI 2.4 and OpenCV 5.0 wheels).
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nvidia.dali import fn, pipeline_def, types
from PIL import Image, ImageCms, ImageFile

from liquidfs.expand import bmp, jpeg
from liquidfs.expand import png as png_format
from liquidfs.expand.bmp import BMP_MAGIC
from liquidfs.expand.checks import Refuse
from liquidfs.expand.formats import EXPANDABLE, Expansion, decode, expand, same_pixels, sniff

try:
    import cv2
except ImportError:  # the only allowed skip, outside CI: OpenCV is optional for the package
    if os.environ.get("CI"):
        raise  # the test extras install it: in CI the third decoder's checks must run, not skip
    cv2 = None

needs_cv2 = pytest.mark.skipif(cv2 is None, reason="cv2 (opencv) not importable")

JPEG_OTHER_DECODER_BOUND = 2
SKIMAGE_DATA = os.path.dirname(skimage.data.__file__)


# ------------------------------------------------------------------ helpers


def skimage_file(name: str) -> bytes:
    # Read the bundled files directly: the skimage.data functions may download.
    with open(os.path.join(SKIMAGE_DATA, name), "rb") as f:
        return f.read()


@cache
def photo(name: str) -> Image.Image:
    im = Image.open(io.BytesIO(skimage_file(name)))
    im.load()
    im.info.clear()  # drop ICC/XMP so re-encoded crops are plain
    return im


def save(im: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


def _chunk(name: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + name + body + struct.pack(">I", zlib.crc32(name + body))


_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def png(
    samples: np.ndarray,
    color_type: int,
    bit_depth: int = 8,
    *,
    interlace: bool = False,
    plte: np.ndarray | None = None,
    trns: bytes | None = None,
    before_idat: tuple[tuple[bytes, bytes], ...] = (),
    after_idat: tuple[tuple[bytes, bytes], ...] = (),
) -> bytes:
    """A hand-made PNG: Pillow cannot write Adam7 interlacing, 2/4-bit gray,
    16-bit colour or arbitrary chunks.  samples: (h, w[, c]) uint8 sample
    values (< 2**bit_depth); for 16 bits, big-endian byte pairs as uint8."""
    h, w = samples.shape[:2]
    a = samples.reshape(h, w, -1)

    def rows(sub: np.ndarray) -> bytes:
        if sub.size == 0:  # empty Adam7 pass
            return b""
        sh, sw, c = sub.shape
        if bit_depth < 8:
            per = 8 // bit_depth
            s = np.pad(sub[:, :, 0], ((0, 0), (0, (-sw) % per))).reshape(sh, -1, per).astype(np.uint16)
            shifts = np.array([8 - bit_depth * (i + 1) for i in range(per)], np.uint16)
            packed = (s << shifts).sum(axis=2).astype(np.uint8)
        else:
            packed = sub.reshape(sh, sw * c)
        return np.hstack([np.zeros((sh, 1), np.uint8), packed]).tobytes()  # filter 0

    raw = b"".join(rows(a[y::dy, x::dx]) for x, y, dx, dy in _ADAM7) if interlace else rows(a)
    out = b"\x89PNG\r\n\x1a\n" + _chunk(
        b"IHDR", struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, int(interlace))
    )
    for name, body in before_idat:
        out += _chunk(name, body)
    if plte is not None:
        out += _chunk(b"PLTE", np.asarray(plte, np.uint8).tobytes())
    if trns is not None:
        out += _chunk(b"tRNS", trns)
    out += _chunk(b"IDAT", zlib.compress(raw))
    for name, body in after_idat:
        out += _chunk(name, body)
    return out + _chunk(b"IEND", b"")


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def pillow_state(data: bytes) -> tuple[str, np.ndarray, list[int] | None]:
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return im.mode, np.array(im), im.getpalette() if im.mode == "P" else None


# -------------------------------------------------------------- DALI / cv2


class Dali:
    """One CPU pipeline per output type, fed encoded bytes by external_source
    (variable batch sizes).  A failed run leaves a DALI pipeline unusable, so
    it is rebuilt on the next call."""

    BATCH = 8

    def __init__(self) -> None:
        self._pipes: dict[types.DALIImageType, object] = {}

    def _pipe(self, output_type: types.DALIImageType) -> object:
        if output_type not in self._pipes:

            @pipeline_def(batch_size=self.BATCH, num_threads=1, device_id=None, prefetch_queue_depth=1)
            def pipe():  # type: ignore[no-untyped-def]
                enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
                return fn.decoders.image(enc, device="cpu", output_type=output_type)

            p = pipe()
            p.build()
            self._pipes[output_type] = p
        return self._pipes[output_type]

    def __call__(self, *blobs: bytes, output_type: types.DALIImageType = types.RGB) -> list[np.ndarray]:
        p = self._pipe(output_type)
        try:
            p.feed_input("enc", [np.frombuffer(b, np.uint8) for b in blobs])  # type: ignore[attr-defined]
            (out,) = p.run()  # type: ignore[attr-defined]
        except Exception:
            del self._pipes[output_type]
            raise
        return [np.array(out[i]) for i in range(len(blobs))]


@pytest.fixture(scope="module")
def dali() -> Dali:
    return Dali()


def cv2_decode(data: bytes, flag: int) -> np.ndarray:
    assert cv2 is not None
    out = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
    assert out is not None, "cv2 could not decode"
    return out


# ------------------------------------------------------------ case tables


def _gray_palette(n: int, step: int = 1) -> np.ndarray:
    return np.repeat((np.arange(n) * step).astype(np.uint8)[:, None], 3, axis=1)


def _p_image(idx: np.ndarray, palette: np.ndarray) -> Image.Image:
    idx = np.ascontiguousarray(idx, np.uint8)
    im = Image.frombytes("P", (idx.shape[1], idx.shape[0]), idx.tobytes())
    im.putpalette(palette.astype(np.uint8).tobytes())
    return im


def _photo_crop(name: str, box: tuple[int, int, int, int]) -> Image.Image:
    return photo(name).crop(box)


def _exif(orientation: int) -> Image.Exif:
    ex = Image.Exif()
    ex[0x0112] = orientation
    return ex


_G = rng(1).integers(0, 256, (23, 37), dtype=np.uint8)
_RGB = rng(2).integers(0, 256, (19, 29, 3), dtype=np.uint8)
_RGBA = rng(3).integers(0, 256, (21, 31, 4), dtype=np.uint8)
_IDX = rng(4).integers(0, 6, (17, 33), dtype=np.uint8)
_PAL6 = np.array([(255, 0, 0), (0, 255, 0), (0, 0, 255), (10, 20, 30), (200, 100, 50), (1, 2, 3)], np.uint8)
_BITS = rng(5).integers(0, 2, (13, 45)).astype(bool)
_SRGB_CHUNKS = (
    (b"sRGB", b"\x00"),
    (b"gAMA", struct.pack(">I", 45455)),
    (b"cHRM", struct.pack(">8I", 31270, 32900, 64000, 33000, 30000, 60000, 15000, 6000)),
)

# name -> PNG bytes that must be accepted
PNG_ACCEPTED: dict[str, Callable[[], bytes]] = {
    "L": lambda: save(Image.fromarray(_G)),
    "L-optimize": lambda: save(Image.fromarray(_G), optimize=True),
    "L-1x1": lambda: save(Image.fromarray(_G[:1, :1])),
    "L-2bit": lambda: png(_G % 4, 0, 2),
    "L-4bit": lambda: png(_G % 16, 0, 4),
    "1": lambda: save(Image.fromarray(_BITS)),
    "1-width-1": lambda: save(Image.fromarray(_BITS[:, :1])),
    "RGB": lambda: save(Image.fromarray(_RGB)),
    "RGB-optimize": lambda: save(Image.fromarray(_RGB), optimize=True),
    "RGBA": lambda: save(Image.fromarray(_RGBA)),
    "P-color": lambda: save(_p_image(_IDX, _PAL6)),
    "P-color-4bit": lambda: save(_p_image(_IDX, _PAL6), bits=4),
    "P-2bit": lambda: png(_IDX % 4, 3, 2, plte=_PAL6[:4]),
    "P-1bit": lambda: png(_IDX % 2, 3, 1, plte=_PAL6[:2]),
    "P-gray-palette": lambda: save(_p_image(_IDX, _gray_palette(6, 40))),  # needs the sentinel entry
    "P-identity-gray": lambda: save(_p_image(_IDX, _gray_palette(6))),  # Pillow would read L without it
    "P-256-colors": lambda: save(_photo_crop("coffee.png", (100, 50, 180, 110)).quantize(256)),
    "P-quantized-photo": lambda: save(_photo_crop("astronaut.png", (150, 60, 250, 140)).quantize(37)),
    "L-interlaced": lambda: png(_G, 0, interlace=True),
    "L-2bit-interlaced": lambda: png(_G % 4, 0, 2, interlace=True),
    "1-interlaced": lambda: png(_BITS.astype(np.uint8), 0, 1, interlace=True),
    "RGB-interlaced": lambda: png(_RGB, 2, interlace=True),
    "RGBA-interlaced": lambda: png(_RGBA, 6, interlace=True),
    "P-interlaced": lambda: png(_IDX, 3, plte=_PAL6, interlace=True),
    "RGB-sRGB-gAMA-cHRM": lambda: png(_RGB, 2, before_idat=_SRGB_CHUNKS),
    "RGB-exif-orientation-1": lambda: save(Image.fromarray(_RGB), exif=_exif(1)),
    "photo-astronaut-RGB": lambda: save(_photo_crop("astronaut.png", (100, 40, 228, 136))),
    "photo-coffee-RGB-odd": lambda: save(_photo_crop("coffee.png", (3, 7, 104, 82))),
    "photo-camera-L": lambda: save(_photo_crop("camera.png", (200, 100, 299, 181))),
    "photo-1bit": lambda: save(_photo_crop("camera.png", (0, 0, 77, 61)).convert("1")),
    "real-camera.png": lambda: skimage_file("camera.png"),
    "real-logo.png-RGBA": lambda: skimage_file("logo.png"),
    "real-horse.png-RGBA-xmp": lambda: skimage_file("horse.png"),
    "real-chessboard_GRAY.png-sRGB": lambda: skimage_file("chessboard_GRAY.png"),
}

# name -> JPEG bytes that must be accepted
JPEG_ACCEPTED: dict[str, Callable[[], bytes]] = {
    "q90-420": lambda: save(_photo_crop("astronaut.png", (100, 40, 228, 136)), "JPEG", quality=90),
    "q95-444": lambda: save(_photo_crop("coffee.png", (3, 7, 104, 82)), "JPEG", quality=95, subsampling=0),
    "q50-422": lambda: save(_photo_crop("coffee.png", (200, 100, 333, 211)), "JPEG", quality=50, subsampling=1),
    "progressive": lambda: save(_photo_crop("astronaut.png", (0, 0, 97, 65)), "JPEG", progressive=True),
    "optimize": lambda: save(_photo_crop("astronaut.png", (300, 300, 401, 377)), "JPEG", optimize=True),
    "gray": lambda: save(_photo_crop("camera.png", (200, 100, 299, 181)), "JPEG", quality=85),
    "tiny-odd": lambda: save(Image.fromarray(_RGB[:5, :7]), "JPEG"),
    "exif-orientation-1": lambda: save(Image.fromarray(_RGB), "JPEG", exif=_exif(1)),
    "real-retina.jpg": lambda: skimage_file("retina.jpg"),
}


def _icc_srgb() -> bytes:
    return ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()


def _apng() -> bytes:
    a, b = Image.fromarray(_RGB), Image.fromarray(_RGB[::-1].copy())
    return save(a, save_all=True, append_images=[b], duration=100)


def _mpo() -> bytes:
    a, b = Image.fromarray(_RGB), Image.fromarray(_RGB[::-1].copy())
    return save(a, "MPO", save_all=True, append_images=[b])


def _idat_bit_flip() -> bytes:
    data = bytearray(save(Image.fromarray(_RGB)))
    data[data.index(b"IDAT") + 20] ^= 0x10  # CRC now wrong: libpng rejects, Pillow would not notice
    return bytes(data)


def _bad_zlib_good_crc() -> bytes:
    return png(_G, 0)[:33] + _chunk(b"IDAT", b"\x78\x9c" + bytes(range(40))) + _chunk(b"IEND", b"")


def _png_bomb() -> bytes:
    # 100000 x 100000 gray declared in IHDR, a token IDAT: must be refused
    # from the header, before any decoder allocates 10 GB.
    return png(_G[:1, :1], 0)[:8] + _chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)) + (
        _chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + _chunk(b"IEND", b"")
    )


def _jpeg_bomb() -> bytes:
    real = save(Image.fromarray(_RGB), "JPEG")
    sof = real.index(b"\xff\xc0")
    return real[: sof + 5] + struct.pack(">HH", 60_000, 60_000) + real[sof + 9 :]


def _jpeg_with_xmp_orientation() -> bytes:
    xmp = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="3"/></x:xmpmeta>'
    return save(Image.fromarray(_RGB), "JPEG", xmp=xmp)


def _jpeg_with_orientation_in_an_app1_of_another_name() -> bytes:
    """A first APP1 named "Exif\\0\\1" holding a TIFF header with Orientation 6 at offset 6, where
    torchvision's apply_exif_orientation reads it (whatever the segment's name): it turns the original."""
    real = save(Image.fromarray(_RGB), "JPEG")
    tiff = _exif(6).tobytes()  # "Exif\0\0" + TIFF
    assert tiff[6:8] in (b"II", b"MM")
    body = b"Exif\0\1" + tiff[6:]
    return real[:2] + b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body + real[2:]


def _png_with_oob_palette_index() -> bytes:
    return png(_IDX, 3, plte=_PAL6[:2])


def _chunks_of(data: bytes) -> list[tuple[bytes, bytes]]:
    """A PNG's chunks: (name, body), each."""
    found, pos = [], 8
    while pos < len(data):
        length, name = struct.unpack_from(">I4s", data, pos)
        found.append((name, data[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return found


def _rebuilt(chunks: list[tuple[bytes, bytes]]) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(name, body) for name, body in chunks)


def _png_image_data(stream: Callable[[bytes], bytes], split: bool = False) -> bytes:
    """An RGB PNG whose IDAT stream is ``stream(the whole zlib stream)`` (in two IDATs with a tEXt between where
    ``split``): what Pillow decodes and libpng refuses."""
    chunks = _chunks_of(save(Image.fromarray(_RGB)))
    data = stream(b"".join(body for name, body in chunks if name == b"IDAT"))
    idat = [(b"IDAT", data[:20]), (b"tEXt", b"k\0v"), (b"IDAT", data[20:])] if split else [(b"IDAT", data)]
    head = [c for c in chunks if c[0] not in (b"IDAT", b"IEND")]
    return _rebuilt([*head, *idat, (b"IEND", b"")])


def _png_extra_image_data() -> bytes:
    """Image data past what the image holds (a row too many): libpng's "Too much image data"."""
    h, w = _RGB.shape[:2]
    rows = b"".join(b"\0" + _RGB[y].tobytes() for y in range(h)) + b"\0" + _RGB[0].tobytes()
    return _png_image_data(lambda stream: zlib.compress(rows))


def _png_plte(where: str) -> bytes:
    """A palette PNG with its PLTE twice, or an RGB one with a (suggested) PLTE after its IDAT."""
    if where == "twice":
        chunks = _chunks_of(png(_IDX, 3, plte=_PAL6))
        at = next(i for i, (name, _) in enumerate(chunks) if name == b"PLTE")
        return _rebuilt(chunks[: at + 1] + [chunks[at]] + chunks[at + 1 :])
    chunks = _chunks_of(save(Image.fromarray(_RGB)))
    return _rebuilt([*chunks[:-1], (b"PLTE", bytes(range(6))), chunks[-1]])


def _png_plte_of(extra: int) -> bytes:
    """A palette PNG whose PLTE holds ``extra`` bytes more than its six colours: not whole entries (libpng's
    "PLTE: invalid", fatal for a palette image, which Pillow trims), or past 256 entries."""
    chunks = _chunks_of(png(_IDX, 3, plte=_PAL6))
    return _rebuilt([(name, body + bytes(extra) if name == b"PLTE" else body) for name, body in chunks])


def _rgb_with_plte(plte: bytes) -> bytes:
    """An RGB PNG with a PLTE before its IDAT (a suggested palette: libpng and Pillow decode the image without
    it), of ``plte``'s bytes."""
    chunks = _chunks_of(save(Image.fromarray(_RGB)))
    at = next(i for i, (name, _) in enumerate(chunks) if name == b"IDAT")
    return _rebuilt([*chunks[:at], (b"PLTE", plte), *chunks[at:]])


def _png_past_libpngs_limit() -> bytes:
    """1,000,001 pixels in a row: one pixel past libpng's user limit (OpenCV and DALI refuse it), within
    max_pixels."""
    return png(np.zeros((1, 1_000_001), np.uint8), 0)


def _png_of_many_chunks(count: int) -> bytes:
    """An image whose data is cut into ``count`` IDATs and ``count`` text chunks: each a few bytes."""
    chunks = _chunks_of(save(Image.fromarray(_RGB)))
    data = b"".join(body for name, body in chunks if name == b"IDAT")
    pieces = [data[i * len(data) // count:(i + 1) * len(data) // count] for i in range(count)]
    head = [c for c in chunks if c[0] not in (b"IDAT", b"IEND")]
    text = [(b"tEXt", b"Comment\0x")] * count
    return _rebuilt([*head, *text, *[(b"IDAT", piece) for piece in pieces], (b"IEND", b"")])


def _jpeg_icc_behind_junk() -> bytes:
    """FF 00 (junk libjpeg and Pillow skip) after SOI, then the ICC profile, then a comment sized so that a walk
    reading FF 00 as a marker with a length lands on the next real marker, past the ICC profile unseen."""
    plain = save(Image.fromarray(_RGB), "JPEG")
    icc = _icc_srgb()[:4000]
    app2 = b"\xff\xe2" + struct.pack(">H", 2 + 12 + 2 + len(icc)) + b"ICC_PROFILE\0\x01\x01" + icc
    start = 4  # the bogus length is read at 4 (the APP2 marker's own bytes, FF E2), and leads to 4 + 0xFFE2
    comment_at = start + len(app2)
    comment_length = start + 0xFFE2 - comment_at - 2
    comment = b"\xff\xfe" + struct.pack(">H", comment_length) + bytes(comment_length - 2)
    return plain[:2] + b"\xff\x00" + app2 + comment + plain[2:]


def _jpeg_many_scans() -> bytes:
    """A progressive JPEG whose last scan is repeated 150 times: a few KB whose decode costs pixels times scans."""
    real = save(Image.fromarray(_RGB), "JPEG", progressive=True)
    last = real.rindex(b"\xff\xda")
    return real[:last] + real[last:-2] * 150 + b"\xff\xd9"


# name -> (original bytes, expected reason, expected source_format)
REFUSED: dict[str, tuple[Callable[[], bytes], str, str | None]] = {
    "empty": (lambda: b"", "empty", None),
    "text": (lambda: b"just some text, not an image\n" * 3, "not-an-image", None),
    "bmp-input": (lambda: save(Image.fromarray(_RGB), "BMP"), "not-expandable:bmp", None),
    "png-16bit-gray": (lambda: save(Image.fromarray(_G.astype(np.uint16) * 257)), "unsupported-mode:I;16", "png"),
    "png-16bit-rgb": (
        lambda: png(_RGB.astype(">u2").view(np.uint8).reshape(19, 29, 6), 2, 16),
        "unsupported-mode:RGB;16",
        "png",
    ),
    "png-real-chessboard_RGB-16bit": (lambda: skimage_file("chessboard_RGB.png"), "unsupported-mode:RGB;16", "png"),
    "png-LA": (lambda: save(Image.frombytes("LA", (31, 21), _RGBA[:, :, :2].tobytes())), "unsupported-mode:LA", "png"),
    "apng": (_apng, "animated", "png"),
    "png-tRNS-gray": (lambda: save(Image.fromarray(_G), transparency=7), "transparency", "png"),
    "png-tRNS-rgb": (lambda: save(Image.fromarray(_RGB), transparency=(1, 2, 3)), "transparency", "png"),
    "png-tRNS-palette": (lambda: png(_IDX, 3, plte=_PAL6, trns=b"\x00\x80"), "transparency", "png"),
    "png-icc": (lambda: save(Image.fromarray(_RGB), icc_profile=_icc_srgb()), "icc-profile", "png"),
    "png-real-astronaut-icc": (lambda: skimage_file("astronaut.png"), "icc-profile", "png"),
    "png-gamma-1.0": (lambda: png(_RGB, 2, before_idat=((b"gAMA", struct.pack(">I", 100000)),)), "gamma", "png"),
    "png-chrm-odd": (
        lambda: png(_RGB, 2, before_idat=((b"cHRM", struct.pack(">8I", 31270, 32900, 70000, 30000, 1, 2, 3, 4)),)),
        "chromaticity",
        "png",
    ),
    "png-cicp": (lambda: png(_RGB, 2, before_idat=((b"cICP", b"\x09\x10\x00\x01"),)), "color-space", "png"),
    "png-exif-orientation-6": (lambda: save(Image.fromarray(_RGB), exif=_exif(6)), "exif-orientation", "png"),
    "png-exif-after-idat": (
        lambda: png(_RGB, 2, after_idat=((b"eXIf", _exif(8).tobytes()),)),
        "exif-orientation",
        "png",
    ),
    "png-gray-256-palette": (lambda: save(_p_image(_IDX, _gray_palette(256))), "gray-palette", "png"),
    "png-palette-index-out-of-range": (_png_with_oob_palette_index, "corrupt", "png"),
    "png-truncated": (lambda: save(Image.fromarray(_RGB))[:300], "truncated", "png"),
    "png-no-iend": (lambda: save(Image.fromarray(_RGB))[:-12], "truncated", "png"),
    "png-idat-crc": (_idat_bit_flip, "corrupt", "png"),
    "png-bad-zlib": (_bad_zlib_good_crc, "corrupt", "png"),
    "png-garbage": (lambda: b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "corrupt", "png"),
    "png-bomb": (_png_bomb, "too-large", "png"),
    "png-zlib-no-adler": (lambda: _png_image_data(lambda stream: stream[:-4]), "corrupt", "png"),
    "png-zlib-cut": (lambda: _png_image_data(lambda stream: stream[:-30]), "corrupt", "png"),
    "png-zlib-then-more": (lambda: _png_image_data(lambda stream: stream + b"\0" * 8), "corrupt", "png"),
    "png-two-zlib-streams": (lambda: _png_image_data(lambda stream: stream + stream), "corrupt", "png"),
    "png-too-much-image-data": (_png_extra_image_data, "corrupt", "png"),
    "png-idat-split": (lambda: _png_image_data(lambda stream: stream, split=True), "corrupt", "png"),
    "png-plte-twice": (lambda: _png_plte("twice"), "corrupt", "png"),
    "png-plte-after-idat": (lambda: _png_plte("after"), "corrupt", "png"),
    "png-plte-not-whole-entries": (lambda: _png_plte_of(1), "corrupt", "png"),
    "png-plte-past-256-entries": (lambda: _png_plte_of(3 * 251), "corrupt", "png"),
    "png-plte-empty-in-rgb": (lambda: _rgb_with_plte(b""), "corrupt", "png"),  # libpng: "Invalid palette"
    "png-past-libpngs-width-limit": (_png_past_libpngs_limit, "too-large", "png"),
    "jpeg-exif-orientation-6": (lambda: save(Image.fromarray(_RGB), "JPEG", exif=_exif(6)), "exif-orientation", "jpeg"),
    "jpeg-xmp-orientation-3": (_jpeg_with_xmp_orientation, "exif-orientation", "jpeg"),
    "jpeg-orientation-in-an-app1-of-another-name": (_jpeg_with_orientation_in_an_app1_of_another_name,
                                                    "exif-orientation", "jpeg"),
    "jpeg-icc": (lambda: save(Image.fromarray(_RGB), "JPEG", icc_profile=_icc_srgb()), "icc-profile", "jpeg"),
    # (the junk alone refuses it now: DALI's parser fails it; the ICC profile behind is never read past)
    "jpeg-icc-behind-junk": (_jpeg_icc_behind_junk, "corrupt", "jpeg"),
    "jpeg-real-rocket-icc": (lambda: skimage_file("rocket.jpg"), "icc-profile", "jpeg"),
    "jpeg-cmyk": (lambda: save(Image.frombytes("CMYK", (31, 21), _RGBA.tobytes()), "JPEG"), "unsupported-mode:CMYK", "jpeg"),
    "jpeg-mpo": (_mpo, "multi-picture", "jpeg"),
    "jpeg-truncated": (lambda: save(Image.fromarray(_RGB), "JPEG")[:400], "truncated", "jpeg"),
    "jpeg-garbage": (lambda: b"\xff\xd8\xff" + bytes(range(7, 256)), "truncated", "jpeg"),
    "jpeg-bomb": (_jpeg_bomb, "too-large", "jpeg"),
    "jpeg-many-scans": (_jpeg_many_scans, "too-many-scans", "jpeg"),
}


@cache
def original(kind: str, name: str) -> bytes:
    table: dict[str, Callable[[], bytes]] = PNG_ACCEPTED if kind == "png" else JPEG_ACCEPTED
    return table[name]()


@cache
def expanded(kind: str, name: str) -> bytes:
    e = expand(original(kind, name))
    assert e.reason is None, f"{kind} {name} refused: {e.reason}"
    assert e.source_format == kind
    assert e.data is not None and e.data.startswith(BMP_MAGIC)
    return e.data


def _is_gray_source(kind: str, name: str) -> bool:
    return pillow_state(original(kind, name))[0] in ("L", "1")


# ------------------------------------------------------------------ sniff


def test_constants() -> None:
    assert BMP_MAGIC == b"BM"
    assert EXPANDABLE == ("png", "jpeg")


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "png"),
        (b"\xff\xd8\xff\xe0\0\x10JFIF\0\x01\x01\0\0\x01", "jpeg"),
        (b"BM" + bytes(12) + struct.pack("<I", 40), "bmp"),
        (b"BM" + bytes(12) + b"\x7c\x00", "bmp"),  # exactly 16 bytes, V5 header
        (b"BMW is a car maker, not a bitmap", None),
        (b"GIF89a" + bytes(10), None),
        (b"", None),
        (b"\x89PN", None),
    ],
)
def test_sniff(head: bytes, expected: str | None) -> None:
    assert sniff(head) == expected


def test_sniff_ignores_the_extension(tmp_path: Path) -> None:
    """A '.png' that really is a JPEG is handled as a JPEG."""
    path = tmp_path / "really_a_jpeg.png"
    path.write_bytes(original("jpeg", "q90-420"))
    data = path.read_bytes()
    assert sniff(data[:16]) == "jpeg"
    e = expand(data)
    assert e.source_format == "jpeg" and e.reason is None
    assert same_pixels(data, e.data)  # type: ignore[arg-type]


# ----------------------------------------------------------- PNG accepted


@pytest.mark.parametrize("name", list(PNG_ACCEPTED))
def test_png_pillow_identical(name: str) -> None:
    orig, bmp = original("png", name), expanded("png", name)
    om, oa, op = pillow_state(orig)
    bm, ba, bp = pillow_state(bmp)
    assert (bm, ba.shape, ba.dtype) == (om, oa.shape, oa.dtype)
    np.testing.assert_array_equal(ba, oa)
    if om == "P":
        assert op is not None and bp is not None and bp[: len(op)] == op
    # What a typical loader does next must agree as well.
    with Image.open(io.BytesIO(orig)) as a, Image.open(io.BytesIO(bmp)) as b:
        np.testing.assert_array_equal(np.asarray(b.convert("RGB")), np.asarray(a.convert("RGB")))
        np.testing.assert_array_equal(np.asarray(b.convert("RGBA")), np.asarray(a.convert("RGBA")))
    assert same_pixels(orig, bmp)
    np.testing.assert_array_equal(decode(bmp), decode(orig))


@pytest.mark.parametrize("name", list(PNG_ACCEPTED))
def test_png_dali_identical(name: str, dali: Dali) -> None:
    orig, bmp = original("png", name), expanded("png", name)
    output_types = [types.RGB]
    if pillow_state(orig)[0] != "RGBA":  # see test_dali_any_data_cannot_decode_32bpp_bmp
        output_types.append(types.ANY_DATA)
    if _is_gray_source("png", name):
        output_types.append(types.GRAY)
    for ot in output_types:
        a, b = dali(orig, bmp, output_type=ot)
        assert b.shape == a.shape, ot
        np.testing.assert_array_equal(b, a, err_msg=str(ot))


@needs_cv2
@pytest.mark.parametrize("name", list(PNG_ACCEPTED))
def test_png_cv2_identical(name: str) -> None:
    assert cv2 is not None
    orig, bmp = original("png", name), expanded("png", name)
    flags = [cv2.IMREAD_UNCHANGED, cv2.IMREAD_COLOR]
    if _is_gray_source("png", name):
        flags.append(cv2.IMREAD_GRAYSCALE)
    for flag in flags:
        a, b = cv2_decode(orig, flag), cv2_decode(bmp, flag)
        assert b.shape == a.shape, flag
        np.testing.assert_array_equal(b, a, err_msg=f"flag {flag}")


def test_dali_any_data_cannot_decode_32bpp_bmp() -> None:
    """Documented limitation: DALI ANY_DATA gives 4 channels for an RGBA PNG
    but fails on every 32 bpp BMP (BI_RGB, BITFIELDS, V4, V5 alike).  If a
    DALI release fixes this, the RGBA cases above should start checking it."""
    orig, bmp = original("png", "RGBA"), expanded("png", "RGBA")
    d = Dali()  # throwaway: a failed run poisons a pipeline
    assert d(orig, output_type=types.ANY_DATA)[0].shape == (21, 31, 4)
    with pytest.raises(RuntimeError):
        d(bmp, output_type=types.ANY_DATA)


# ---------------------------------------------------------- JPEG accepted


@pytest.mark.parametrize("name", list(JPEG_ACCEPTED))
def test_jpeg_pillow_identical(name: str) -> None:
    orig, bmp = original("jpeg", name), expanded("jpeg", name)
    om, oa, _ = pillow_state(orig)
    bm, ba, _ = pillow_state(bmp)
    assert om in ("L", "RGB") and bm == om
    np.testing.assert_array_equal(ba, oa)
    assert same_pixels(orig, bmp)


@pytest.mark.parametrize("name", list(JPEG_ACCEPTED))
def test_jpeg_dali_close(name: str, dali: Dali) -> None:
    orig, bmp = original("jpeg", name), expanded("jpeg", name)
    pil = np.array(Image.open(io.BytesIO(orig)).convert("RGB"))
    a, b = dali(orig, bmp)
    assert a.shape == b.shape == pil.shape
    np.testing.assert_array_equal(b, pil)  # the BMP carries Pillow's decode exactly
    diff = int(np.abs(a.astype(np.int16) - b).max())
    assert diff <= JPEG_OTHER_DECODER_BOUND, f"DALI JPEG decode differs from Pillow's by {diff}"
    if _is_gray_source("jpeg", name):
        a, b = dali(orig, bmp, output_type=types.ANY_DATA)
        assert a.shape == b.shape and a.shape[2] == 1


@needs_cv2
@pytest.mark.parametrize("name", list(JPEG_ACCEPTED))
def test_jpeg_cv2_close(name: str) -> None:
    assert cv2 is not None
    orig, bmp = original("jpeg", name), expanded("jpeg", name)
    for flag in (cv2.IMREAD_UNCHANGED, cv2.IMREAD_COLOR):
        a, b = cv2_decode(orig, flag), cv2_decode(bmp, flag)
        assert a.shape == b.shape, flag
        diff = int(np.abs(a.astype(np.int16) - b).max())
        assert diff <= JPEG_OTHER_DECODER_BOUND, f"cv2 flag {flag}: JPEG decode differs from Pillow's by {diff}"


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused(name: str) -> None:
    make, reason, source_format = REFUSED[name]
    e = expand(make())
    assert e == Expansion(None, source_format, reason)
    assert not e.accepted


def test_refusal_reasons_are_machine_friendly() -> None:
    for make, _, _ in REFUSED.values():
        reason = expand(make()).reason
        assert reason is not None and reason == reason.strip() and " " not in reason


def test_bomb_refused_from_header_without_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoder(*a: object, **k: object) -> None:
        raise AssertionError("a decoder was started for a bomb")

    monkeypatch.setattr(png_format.PngImagePlugin, "PngImageFile", no_decoder)
    monkeypatch.setattr(jpeg.JpegImagePlugin, "JpegImageFile", no_decoder)
    assert expand(_png_bomb()).reason == "too-large"
    assert expand(_jpeg_bomb()).reason == "too-large"


def test_max_pixels_is_honoured() -> None:
    data = save(Image.fromarray(_G[:20, :20]))
    assert expand(data, max_pixels=399).reason == "too-large"
    assert expand(data, max_pixels=400).reason is None
    jpg = save(Image.fromarray(_RGB[:10, :10]), "JPEG")
    assert expand(jpg, max_pixels=99).reason == "too-large"
    assert expand(jpg, max_pixels=100).reason is None


def test_pillow_bomb_limit_neither_warns_nor_overrides_max_pixels(monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest turns warnings into errors here, so a leaked
    # DecompressionBombWarning (or Pillow's DecompressionBombError at twice
    # the limit) would fail or refuse this 400-pixel image.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 150)
    for data in (save(Image.fromarray(_G[:20, :20])), save(Image.fromarray(_RGB[:10, :20]), "JPEG")):
        assert expand(data).reason is None


def test_load_truncated_images_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert expand(original("png", "RGB")).reason == "truncated-images-allowed"


def test_colour_chunks_do_not_change_decoded_pixels(dali: Dali) -> None:
    """The evidence behind the gAMA/cHRM/sRGB/iCCP policy: none of the
    decoders apply them when decoding to RGB/unchanged (we refuse the
    non-sRGB ones anyway, for colour-managing loaders)."""
    plain = png(_RGB, 2)
    variants = [
        png(_RGB, 2, before_idat=((b"gAMA", struct.pack(">I", 100000)),)),
        png(_RGB, 2, before_idat=((b"cHRM", struct.pack(">8I", 31270, 32900, 70000, 30000, 1, 2, 3, 4)),)),
        save(Image.fromarray(_RGB), icc_profile=_icc_srgb()),
    ]
    ref = dali(plain)[0]
    for v in variants:
        np.testing.assert_array_equal(dali(v)[0], ref)
        np.testing.assert_array_equal(decode(v), decode(plain))
        if cv2 is not None:
            np.testing.assert_array_equal(cv2_decode(v, cv2.IMREAD_UNCHANGED), cv2_decode(plain, cv2.IMREAD_UNCHANGED))


def test_exif_orientation_is_applied_by_dali_to_the_original(dali: Dali) -> None:
    """Why EXIF orientation != 1 is refused: DALI rotates the original."""
    data = save(Image.fromarray(_RGB), "JPEG", exif=_exif(6))
    assert decode(data).shape == (19, 29, 3)
    assert dali(data)[0].shape == (29, 19, 3)


@pytest.mark.parametrize(
    ("name", "header_size", "bpp", "compression", "colors"),
    [
        ("1", 40, 1, 0, 2),
        ("L", 40, 8, 0, 256),
        ("P-color", 40, 8, 0, 6),
        ("P-gray-palette", 40, 8, 0, 7),  # 6 gray entries + the non-gray sentinel
        ("RGB", 40, 24, 0, 0),
        ("RGBA", 108, 32, 3, 0),  # BITMAPV4HEADER, BI_BITFIELDS
    ],
)
def test_bmp_layout(name: str, header_size: int, bpp: int, compression: int, colors: int) -> None:
    bmp = expanded("png", name)
    magic, file_size, _, _, offset = struct.unpack_from("<2sIHHI", bmp, 0)
    hsize, w, h, planes, bits, comp, image_size, _, _, used, _ = struct.unpack_from("<IiiHHIIiiII", bmp, 14)
    assert (magic, file_size, planes) == (b"BM", len(bmp), 1)
    assert (hsize, bits, comp, used) == (header_size, bpp, compression, colors)
    assert h > 0, "rows must be bottom-up"
    stride = ((w * bpp + 31) // 32) * 4
    assert offset == 14 + hsize + 4 * colors and image_size == stride * h and file_size == offset + image_size
    if comp == 3:
        assert struct.unpack_from("<4I", bmp, 54) == (0x00FF0000, 0x0000FF00, 0x000000FF, 0xFF000000)
    # Row padding is zero.
    rows = np.frombuffer(bmp, np.uint8, offset=offset).reshape(h, stride)
    assert not rows[:, (w * bpp + 7) // 8 :].any()


def test_round_trip_check_catches_a_broken_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bmp._write_bmp

    def broken(*args: object, **kw: object) -> bytes:
        bmp = bytearray(real(*args, **kw))  # type: ignore[arg-type]
        bmp[struct.unpack_from("<I", bmp, 10)[0]] ^= 1  # first pixel byte
        return bytes(bmp)

    monkeypatch.setattr(bmp, "_write_bmp", broken)
    for name in ("1", "L", "P-color", "RGB", "RGBA"):
        assert expand(original("png", name)).reason == "round-trip-mismatch", name


def test_expansion_is_frozen() -> None:
    e = expand(b"")
    with pytest.raises(AttributeError):
        e.reason = "x"  # type: ignore[misc]


# ------------------------------------------------------- property tests

ACCEPTED_MODES = ("1", "L", "P", "RGB", "RGBA")
_PNG_TYPE = {"1": (0, 1), "L": (0, 8), "P": (3, 8), "RGB": (2, 8), "RGBA": (6, 8)}


@st.composite
def small_pngs(draw: st.DrawFn) -> bytes:
    mode = draw(st.sampled_from(ACCEPTED_MODES))
    w, h = draw(st.integers(1, 67)), draw(st.integers(1, 67))
    interlace = draw(st.booleans())
    r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    palette = None
    if mode == "1":
        samples = r.integers(0, 2, (h, w), dtype=np.uint8)
    elif mode == "L":
        samples = r.integers(0, 256, (h, w), dtype=np.uint8)
    elif mode == "P":
        n = draw(st.integers(1, 256))
        if draw(st.booleans()) and n < 256:
            palette = _gray_palette(n) if draw(st.booleans()) else np.repeat(r.integers(0, 256, (n, 1), np.uint8), 3, 1)
        else:
            palette = r.integers(0, 256, (n, 3), dtype=np.uint8)
        samples = r.integers(0, n, (h, w), dtype=np.uint8)
    else:
        samples = r.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    if interlace:  # Pillow cannot write Adam7
        ctype, depth = _PNG_TYPE[mode]
        return png(samples, ctype, depth, interlace=True, plte=palette)
    im = _p_image(samples, palette) if mode == "P" else Image.fromarray(samples.astype(bool) if mode == "1" else samples)
    return save(im)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_pngs())
def test_property_bmp_writer_round_trips_in_pillow(data: bytes) -> None:
    e = expand(data)
    assert e.reason is None and e.data is not None
    om, oa, op = pillow_state(data)
    bm, ba, bp = pillow_state(e.data)
    assert bm == om and ba.shape == oa.shape
    np.testing.assert_array_equal(ba, oa)
    if om == "P":
        assert bp is not None and op is not None and bp[: len(op)] == op


_PROPERTY_DALI = Dali()  # hypothesis re-runs the body; fixtures would be shared anyway


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_pngs())
def test_property_other_decoders_agree(data: bytes) -> None:
    dali = _PROPERTY_DALI
    e = expand(data)
    assert e.data is not None
    mode = pillow_state(data)[0]
    for ot in (types.RGB,) if mode == "RGBA" else (types.RGB, types.ANY_DATA):
        a, b = dali(data, e.data, output_type=ot)
        assert a.shape == b.shape
        np.testing.assert_array_equal(b, a)
    if cv2 is not None:
        for flag in (cv2.IMREAD_UNCHANGED, cv2.IMREAD_COLOR):
            a, b = cv2_decode(data, flag), cv2_decode(e.data, flag)
            assert a.shape == b.shape
            np.testing.assert_array_equal(b, a)


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    base = draw(st.sampled_from([original("png", "RGB"), original("png", "P-color"), original("jpeg", "tiny-odd")]))
    kind = draw(st.sampled_from(["flip", "cut", "signature+noise"]))
    if kind == "signature+noise":
        return base[:8] + draw(st.binary(max_size=200))
    if kind == "cut":
        return base[: draw(st.integers(0, len(base)))]
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=120, deadline=None)
@given(damaged())
def test_property_damaged_input_never_raises_and_never_lies(data: bytes) -> None:
    e = expand(data)
    assert isinstance(e, Expansion)
    assert (e.data is None) != (e.reason is None)
    if e.data is not None:  # a harmless mutation (e.g. in a JPEG's entropy data)
        assert same_pixels(data, e.data)


# ---------------------------------------------------------------- cost


@pytest.mark.parametrize("source_format", ["PNG", "JPEG"])
def test_expand_decodes_the_source_once_and_its_bmp_once(source_format: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """expand = one decode of the source + the BMP written + one decode of the BMP to verify it: counted, not
    timed (prepare's rates are in BENCHMARKS.md). A load with no tiles left decodes nothing."""
    decoded: list[str] = []
    load = ImageFile.ImageFile.load

    def counting_load(im: ImageFile.ImageFile) -> object:
        if im.tile:
            decoded.append(type(im).__name__)
        return load(im)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    data = save(photo("astronaut.png").convert("RGB"), source_format)
    decoded.clear()  # what saving the source may have loaded
    assert expand(data).reason is None
    assert sorted(decoded) == sorted([f"{source_format.title()}ImageFile", "BmpImageFile"]), decoded


def test_scans_are_counted_by_a_walk_of_the_markers_up_to_the_images_end() -> None:
    """What trails a JPEG's EOI (a motion photo's video) is no scan of it: its bytes may hold FF DA by chance. And a
    segment between two scans (a comment) may hold FF D9: the walk skips it by its length, so a comment cannot
    end the count early and let thousands of scans through."""
    real = save(Image.fromarray(_RGB), "JPEG", progressive=True)
    trailer = b"\xff\xda" * (jpeg.MAX_SCANS + 1)
    assert jpeg.scan_jpeg(real + trailer, 10**8)[:2] == (_RGB.shape[1], _RGB.shape[0])
    many = _jpeg_many_scans()
    second = many.index(b"\xff\xda", many.index(b"\xff\xda") + 2)
    hidden = many[:second] + b"\xff\xfe\x00\x04\xff\xd9" + many[second:]  # a comment holding an EOI's bytes
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(hidden))), np.asarray(Image.open(io.BytesIO(many))))
    with pytest.raises(Refuse, match="too-many-scans"):
        jpeg.scan_jpeg(hidden, 10**8)


@pytest.mark.parametrize("split", ["whole", "bytes", "empty-parts"])
def test_image_data_in_any_split_of_idat_chunks_is_expanded(split: str) -> None:
    """One stream in one IDAT larger than the check's step, in IDATs of a few bytes each, or with empty IDATs
    among them: all libpng reads, and all expanded to the same pixels."""
    pixels = rng(9).integers(0, 256, (300, 400, 3), dtype=np.uint8)  # a stream of ~360 KB: several steps
    chunks = _chunks_of(save(Image.fromarray(pixels)))
    stream = b"".join(body for name, body in chunks if name == b"IDAT")
    parts = {"whole": [stream], "bytes": [stream[i:i + 997] for i in range(0, len(stream), 997)],
             "empty-parts": [b"", stream[:1000], b"", stream[1000:], b""]}[split]
    head = [c for c in chunks if c[0] not in (b"IDAT", b"IEND")]
    data = _rebuilt([*head, *((b"IDAT", p) for p in parts), (b"IEND", b"")])
    e = expand(data)
    assert e.data is not None, e.reason
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(e.data))), pixels)


def test_a_png_of_many_small_chunks_is_walked_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """IDATs of a few bytes each, between text chunks: expanded as any other (each IDAT's span is kept, not a
    view of it), and past ``MAX_CHUNKS`` refused rather than walked into memory many times the file's size."""
    data = _png_of_many_chunks(60)
    e = expand(data)
    assert e.reason is None and e.data is not None
    assert same_pixels(data, e.data)
    monkeypatch.setattr(png_format, "MAX_CHUNKS", 100)
    assert expand(data).reason == "too-large"


@pytest.mark.parametrize("length", [4, 900])
def test_an_rgb_png_with_a_palette_of_odd_length_is_expanded(length: int) -> None:
    """A suggested palette in an RGB image that is no whole number of entries, or too long: libpng warns and
    decodes the image, as Pillow does, so it is expanded as any other (only a palette image's is refused)."""
    data = _rgb_with_plte(bytes(length))
    e = expand(data)
    assert e.reason is None and e.data is not None and same_pixels(data, e.data)


def test_comparing_an_image_past_pillows_bomb_warning_warns_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`verify` compares images expanded under our own limit (MAX_PIXELS, above Pillow's 89.5 Mpx warning): a
    warning per worker would have cluttered its progress."""
    import warnings

    data = save(Image.fromarray(_RGB))
    raw = expand(data).data
    assert raw is not None
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", _RGB.shape[0] * _RGB.shape[1] - 1)  # this one is past it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning given would fail the comparison
        assert same_pixels(data, raw)


@pytest.mark.parametrize("padding", ["fill", "stuffed", "restarts"])
def test_a_jpeg_padded_with_bytes_libjpeg_passes_over_is_walked_as_libjpeg_walks_it(padding: str) -> None:
    """Fill bytes, FF 00 pairs and restart markers between the scans and before the EOI are passed over as
    libjpeg passes them: the walk counts the scans, and the image is expanded to Pillow's pixels. Before the
    first scan only fill bytes are: DALI's parser fails the original at the others, so it is refused at once,
    its original served. (Stepped a byte at a time in Python, 5 MB of them held a worker for seconds.)"""
    real = save(Image.fromarray(_RGB), "JPEG", progressive=True)
    pad = {"fill": b"\xff" * 300_000, "stuffed": b"\xff\x00" * 150_000, "restarts": b"\xff\xd0" * 150_000}[padding]
    sos = real.index(b"\xff\xda")
    eoi = real.rindex(b"\xff\xd9")
    padded = real[:sos] + (pad if padding == "fill" else b"") + real[sos:eoi] + pad + real[eoi:]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(padded))), np.asarray(Image.open(io.BytesIO(real))))
    assert jpeg.scan_jpeg(padded, 10**8) == jpeg.scan_jpeg(real, 10**8)
    e = expand(padded)
    assert e.reason is None and e.data is not None and same_pixels(padded, e.data)
    if padding != "fill":
        with pytest.raises(Refuse) as before_the_scan:
            jpeg.scan_jpeg(real[:sos] + pad + real[sos:], 10**8)
        assert before_the_scan.value.reason == "corrupt"


def test_a_jpeg_of_more_segments_than_any_image_has_is_refused() -> None:
    """Millions of 4-byte comments would hold a worker for a Python step each: past ``MAX_SEGMENTS`` before the
    first scan, or between scans, the original is served."""
    real = save(Image.fromarray(_RGB), "JPEG")
    comments = b"\xff\xfe\x00\x02" * (jpeg.MAX_SEGMENTS + 1)
    sos = real.index(b"\xff\xda")
    with pytest.raises(Refuse) as before:
        jpeg.scan_jpeg(real[:2] + comments + real[2:], 10**8)
    assert before.value.reason == "corrupt" and "before the first scan" in before.value.detail
    eoi = real.rindex(b"\xff\xd9")
    with pytest.raises(Refuse) as between:
        jpeg.scan_jpeg(real[:eoi] + comments + real[eoi:], 10**8)
    assert between.value.reason == "corrupt" and "between its scans" in between.value.detail
    assert sos > 2


@pytest.mark.parametrize("name", [b"ab1d", b"abcd", b"a_cd", b"1bCd", b"ab\xc9d"])
def test_a_png_with_a_chunk_type_libpng_refuses_is_refused(name: bytes) -> None:
    """libpng (OpenCV's, DALI's) refuses the whole file at a chunk type that is not four ASCII letters, or whose
    reserved bit (the third letter's case) is set; Pillow reads past it. Expanded, the raw object handed them
    pixels where the original is an error."""
    import cv2

    chunks = _chunks_of(save(Image.fromarray(_RGB)))
    data = _rebuilt([*chunks[:-1], (name, b"x"), chunks[-1]])
    assert np.asarray(Image.open(io.BytesIO(data))).shape == _RGB.shape  # Pillow decodes it
    assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED) is None
    assert expand(data).reason == "corrupt"
    fine = _rebuilt([*chunks[:-1], (b"abCd", b"x"), chunks[-1]])  # an ancillary chunk libpng skips
    assert cv2.imdecode(np.frombuffer(fine, np.uint8), cv2.IMREAD_UNCHANGED) is not None
    assert expand(fine).reason is None


@pytest.mark.parametrize("chunks", ["one-large", "many-empty"])
def test_a_png_whose_ancillary_chunks_outweigh_its_image_is_refused(chunks: str) -> None:
    """Pillow keeps a copy of every chunk it does not know, and of an eXIf, beyond the source the worker's memory
    is planned for: a 1-pixel PNG of a 40 MB eXIf took five times its size, 200,000 empty chunks eight times.
    Past a bound (real ones hold a few KB), such a PNG is served as its original."""
    parts = _chunks_of(save(Image.fromarray(_RGB)))
    extra = [(b"abCd", b"x" * (png_format.MAX_ANCILLARY_BYTES + 1))] if chunks == "one-large" else \
        [(b"abCd", b"")] * (png_format.MAX_ANCILLARY_BYTES // 128 + 1)
    assert expand(_rebuilt([*parts[:-1], *extra, parts[-1]])).reason == "too-large"
    assert expand(_rebuilt([*parts[:-1], (b"abCd", b"x" * 4096), parts[-1]])).reason is None


def test_a_png_of_many_compressed_text_chunks_is_refused() -> None:
    """Pillow decompresses zTXt (and compressed iTXt) up to a megabyte each and 64 MB in all: a 63 KB PNG of 60
    of them took 61 MB of a worker's memory planned for its size. Each counts as what it may decompress to; a
    few (real files' text and XMP) are as before."""
    parts = _chunks_of(save(Image.fromarray(_RGB)))
    bomb = b"Comment\0\0" + zlib.compress(b" " * (1 << 20), 9)  # a megabyte of text in about a kilobyte
    many = [(b"zTXt", bomb)] * 60
    assert expand(_rebuilt([*parts[:-1], *many, parts[-1]])).reason == "too-large"
    assert expand(_rebuilt([*parts[:-1], *many[:4], parts[-1]])).reason is None
    compressed_itxt = [(b"iTXt", b"Comment\0\1\0en\0\0" + zlib.compress(b" " * (1 << 20), 9))] * 60
    assert expand(_rebuilt([*parts[:-1], *compressed_itxt, parts[-1]])).reason == "too-large"
    # Uncompressed ones (XMP, a tool's keys: an iTXt each) count as what they are.
    plain_itxt = [(b"iTXt", b"Key%d\0\0\0en\0\0" % i + b"v" * 50) for i in range(60)]
    assert expand(_rebuilt([*parts[:-1], *plain_itxt, parts[-1]])).reason is None


@pytest.mark.parametrize("chunk, refused", [
    ((b"prVt", bytes(png_format.OPENCV_CHUNK_LIMIT - 11)), True),  # a private chunk past OpenCV's limit
    ((b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + bytes(png_format.OPENCV_CHUNK_LIMIT)), True),
    ((b"prVt", bytes(png_format.OPENCV_CHUNK_LIMIT - 12)), False),  # at it
    ((b"bKGD", bytes(3)), True),  # of no colour type's length
    ((b"bKGD", bytes(6)), False),
], ids=["private-past", "xmp-past", "private-at", "bkgd-3", "bkgd-6"])
def test_a_png_chunk_before_its_image_data_that_opencv_refuses_is_refused(chunk: tuple[bytes, bytes],
                                                                          refused: bool) -> None:
    """OpenCV's PNG reader (and DALI's CPU decoder) walks the chunks before the first IDAT itself and refuses the
    whole file at one past 8,000,000 bytes (C2PA, XMP) or a bKGD of another length; Pillow decodes it, and its raw
    object handed those loaders pixels where the original is an error (found by review)."""
    import cv2

    parts = _chunks_of(save(Image.fromarray(_RGB)))
    idat = next(i for i, (name, _) in enumerate(parts) if name == b"IDAT")
    data = _rebuilt([*parts[:idat], chunk, *parts[idat:]])
    assert (cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED) is None) == refused
    assert expand(data).reason == ("corrupt" if refused else None)


@pytest.mark.parametrize("between, refused", [
    (b"\x00\x11\x22", True),  # junk libjpeg and Pillow skip
    (b"\xff\xd0", True),      # a restart marker before the first scan
    (b"\xff\xff\xff", False),  # fill bytes before a marker: every parser takes them
], ids=["junk", "rst0", "fill"])
def test_a_jpeg_with_junk_between_its_segments_is_refused(dali: Dali, between: bytes, refused: bool) -> None:
    """DALI's JPEG parser takes only fill bytes before a marker: junk or a restart marker between the segments,
    which libjpeg and Pillow skip, fails its decode of the original, while the raw object decoded (found by
    review)."""
    real = save(Image.fromarray(_RGB), "JPEG")
    dqt = real.find(b"\xff\xdb")
    data = real[:dqt] + between + real[dqt:]
    if refused:
        with pytest.raises(Exception):
            dali(data)
    else:
        assert dali(data)[0].shape[:2] == _RGB.shape[:2]
    assert expand(data).reason == ("corrupt" if refused else None)


def test_verify_finds_an_object_prepare_would_refuse_now_unsound() -> None:
    """``expansion.judge`` (verify's verdict) compared Pillow's decodes alone: an object a laxer liquidfs made
    (prepare reuses the objects of runs before it) passed where Pillow agrees with it and other decoders of the
    original do not: an unrotated BMP of a PNG with an EXIF orientation (OpenCV and torchvision turn the
    original), or the source itself named as its object."""
    from liquidfs.catalog.identity import checksum
    from liquidfs.expand.expansion import judge

    plain = save(Image.fromarray(_RGB))
    sound = expand(plain).data
    assert sound is not None and judge(plain, sound, checksum(sound)) is None
    turned = save(Image.fromarray(_RGB), exif=_exif(6))
    unrotated = save(Image.fromarray(_RGB), "BMP")
    assert same_pixels(turned, unrotated)  # Pillow's decodes agree: the old verdict, "sound"
    assert str(judge(turned, unrotated, checksum(unrotated))).startswith("prepare refuses its source now")
    assert str(judge(plain, plain, checksum(plain))).startswith("not a raw object (png)")
