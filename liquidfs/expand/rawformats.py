"""Each raw format an image may be expanded to, declared once: one ``RawFormat`` record and the registry of them.

Object names (the suffix, ``reader.OBJECT_NAME``), ``--formats`` parsing, the stores' ``raw_formats``, a
worker's memory budget (``expand.workers``), the profile's choice and the messages that name a format all derive
from these records. Adding a raw format is one record here and its encoder in ``encoders`` (``encoders.ENCODERS``);
``tests/unit/test_rawformats.py`` checks that the two agree. The profile measures BMP (its baseline: the
originals are timed with it) and weighs any format decoded on a GPU on top of it.

This module imports nothing from the package: every other module may import it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

#: ``expand``'s bound on an image's pixels: larger images are refused from their header (too-large).
MAX_PIXELS: Final = 100_000_000
#: The largest raw object ``prepare`` can write (every format: at most 8 bytes a pixel, and its headers): what a
#: reader allocates for one is bounded by it, whatever size a catalog row claims.
MAX_OBJECT_BYTES: Final = MAX_PIXELS * 8 + (1 << 20)

__all__ = ["BMP", "DEFAULT", "DEFAULT_FORMATS", "J2K", "NAMES", "ORIGINAL_NAMES", "RAW_FORMATS", "SUFFIX_PATTERN",
           "RawFormat", "by_magic", "by_name", "known", "of_object", "own_refusal", "parse_formats"]


@dataclass(frozen=True)
class RawFormat:
    """One raw format: how its objects are named and recognised, what it holds, who decodes it exactly, and
    what expanding an image to it costs."""

    #: As ``--formats``, catalogs, ``profile.json`` and the format's own refusal reasons (``<name>-...``) say.
    name: str
    #: As messages say.
    label: str
    #: Of its objects' names (``expansion.object_name``).
    suffix: str
    #: A file of it starts with one of these (``formats.sniff``); the first is what the encoder writes.
    magic: tuple[bytes, ...]
    #: The Pillow modes (8 bits a sample) it holds with the source's exact mode and samples: the encoder
    #: refuses the others (``<name>-unsupported-mode``, where another format may hold the image).
    modes: frozenset[str]
    #: The loaders' decoders shown to decode it to the source's exact pixels (tests/unit/expand/test_formats.py,
    #: tests/unit/expand/test_j2k.py; the GPU's where a GPU is visible).
    exact_for: tuple[str, ...]
    #: Peak bytes one expansion to it takes per pixel, on top of ``expand.workers.SOURCE_COPIES`` times the source's
    #: size: what prepare sizes its workers by. Measured as the peak RSS (VmHWM, reset before the call) of an
    #: expansion, less the RSS before it: a new format is measured before prepare can use it.
    bytes_per_pixel: int
    #: What ``--formats`` help says of it.
    about: str
    #: The loader's decoder it is meant for where it decodes on a GPU (a name ``exact_for`` uses); None: decoded
    #: on the CPU. The profile weighs such a format only where a GPU decoder (this one for a DALI loader,
    #: nvImageCodec's for others: ``profile.decoders.find_gpu_decoder``) decodes it here, and prepare warns while
    #: this one is not in ``exact_for``.
    gpu_decoder: str | None = None

    def refusal(self, why: str) -> str:
        """A refusal reason of this format's own: it cannot hold the image, another raw format may."""
        return f"{self.name}-{why}"

    def owns(self, reason: str | None) -> bool:
        """Whether ``reason`` is a refusal of this format's own (``refusal``)."""
        return reason is not None and reason.startswith(f"{self.name}-")


BMP: Final = RawFormat(
    name="bmp", label="BMP", suffix=".bmp", magic=(b"BM",),
    modes=frozenset({"1", "L", "P", "RGB", "RGBA"}),
    exact_for=("pillow", "torchvision (PIL loader)", "opencv", "dali-cpu", "dali-mixed"),
    # 28 B/px for RGBA (4 of them the source), 23 for RGB PNG, 22 for JPEG, 7 for L and P, 20 for a flat RGB PNG
    # of a few kB, on noise PNGs and JPEGs of 1, 4 and 16 Mpx. RGBA is the worst mode expand accepts: Pillow's
    # decode and the check's decode take 4 B/px each, and so do its four packed copies (tobytes, the BMP array,
    # its bytes, the check's tobytes). 16-bit and CMYK images are refused from their header, before any of that.
    bytes_per_pixel=24,
    about="no decode work, for CPU decoders",
)

J2K: Final = RawFormat(
    # Lossless JPEG 2000 (reversible 5/3 wavelet, a JP2 file; a bare codestream is recognised too): small, but
    # decoded on a GPU (DALI "mixed", nvJPEG2000); on a CPU it is slower than PNG. A palette (P) or 1-bit image
    # would come back as L or RGB, another mode than the original's under Pillow.
    name="j2k", label="J2K", suffix=".jp2", magic=(b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xff\x4f\xff\x51"),
    modes=frozenset({"L", "RGB", "RGBA"}),
    # "dali-mixed" is to be shown on a GPU (scripts/bench/bench_j2k.py). nvImageCodec's GPU decoder (GPU_ONLY,
    # the source's channels kept) gave 48 of 48 2048x1024 objects exact on an H100 (MEASUREMENTS.md, "A GPU node"),
    # and test_j2k checks it wherever a GPU and nvImageCodec are visible (scripts/gpu/nvimgcodec_check.py on many).
    exact_for=("pillow", "torchvision (PIL loader)", "dali-cpu", "nvimgcodec-gpu"),
    # Pillow's OpenJPEG encode, then the check's decode, the source already in memory: 76, 75 and 70 B/px for
    # RGBA, 57, 56 and 56 for RGB, 53-55 for JPEG, 45-50 for a flat RGB PNG, 19-20 for L (noise PNGs of 1, 4
    # and 16 Mpx). Budgeted at BMP's 24, a 4 GiB container was OOM-killed.
    bytes_per_pixel=76,
    about="lossless JPEG 2000: about the PNG's size, decoded on a GPU by DALI's 'mixed' decoder or nvImageCodec; "
          "on a CPU slower than PNG",
    gpu_decoder="dali-mixed",
)

#: Every raw format by name, in the order prepare tries them for an image: J2K, the smaller, first; BMP last, as
#: it holds every mode the others may refuse.
RAW_FORMATS: Final[Mapping[str, RawFormat]] = MappingProxyType({f.name: f for f in (J2K, BMP)})
#: Their names, in that order: what a store that can hold every raw format holds.
NAMES: Final = tuple(RAW_FORMATS)
#: What ``--formats`` defaults to, and what an object whose name says no format is taken to hold.
DEFAULT: Final = BMP
DEFAULT_FORMATS: Final = (DEFAULT.name,)
#: The originals' names ``--formats`` accepts: they are always served for the images not expanded.
ORIGINAL_NAMES: Final = ("png", "jpeg", "jpg")
#: A regular expression matching any raw format's suffix (object names: ``reader.OBJECT_NAME``).
SUFFIX_PATTERN: Final = "(?:" + "|".join(re.escape(f.suffix) for f in RAW_FORMATS.values()) + ")"


def known() -> str:
    """The raw formats' names, as messages list them."""
    return ", ".join(sorted(RAW_FORMATS))


def by_name(name: str) -> RawFormat:
    """The raw format called ``name``; ValueError naming the known ones otherwise."""
    try:
        return RAW_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown raw format {name!r} (known: {known()})") from None


def of_object(obj: str) -> RawFormat | None:
    """The raw format a raw object's name says it holds (its suffix); None for no raw format's."""
    return next((f for f in RAW_FORMATS.values() if obj.endswith(f.suffix)), None)


def by_magic(head: bytes) -> RawFormat | None:
    """The raw format whose magic ``head`` starts with; None for none (the content alone decides, never a name)."""
    return next((f for f in RAW_FORMATS.values() if head.startswith(f.magic)), None)


def own_refusal(reason: str | None) -> bool:
    """Whether ``reason`` is one raw format's own refusal: another raw format may still hold the image."""
    return any(f.owns(reason) for f in RAW_FORMATS.values())


def parse_formats(text: str) -> tuple[str, ...]:
    """``--formats png,bmp,j2k``: the raw formats named, in the order prepare tries them (``RAW_FORMATS``); the
    originals' names are accepted and implied. ValueError says what is wrong."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [n for n in names if n not in RAW_FORMATS and n not in ORIGINAL_NAMES]
    if unknown:
        raise ValueError(f"unknown format {', '.join(unknown)}: --formats takes png and any of {known()}")
    raw = tuple(f for f in RAW_FORMATS if f in names)
    if not raw:
        each = sorted(RAW_FORMATS)
        either = each[0] if len(each) == 1 else \
            f"{', '.join(each)} or {'both' if len(each) == 2 else 'several'}"
        raise ValueError(f"--formats needs a raw format to expand to: {either}")
    return raw
