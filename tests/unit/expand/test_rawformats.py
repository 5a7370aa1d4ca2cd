"""The raw formats are declared once (``liquidfs.expand.rawformats``): each record agrees with what the rest of the
package makes of it (object names, the files its encoder writes, the modes it holds, the memory it is budgeted),
and ``--formats`` says clearly what it does not take."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from liquidfs.expand import encoders, formats
from liquidfs.expand import rawformats
from liquidfs.expand import workers as resources
from liquidfs.catalog.nodes import KIND_FILE, REPR_ORIGINAL, Node
from liquidfs.expand.expansion import object_name
from liquidfs.expand.rawformats import BMP, DEFAULT, J2K, NAMES, RAW_FORMATS, RawFormat
from liquidfs.stores.reader import OBJECT_NAME
from liquidfs.stores.local import LocalStore
from liquidfs.stores.local.store import _object_entry
from liquidfs.stores.s3 import BucketStore

EACH = pytest.mark.parametrize("fmt", list(RAW_FORMATS.values()), ids=list(RAW_FORMATS))
#: Every mode an original may decode to that some raw format holds.
MODES = ("1", "L", "P", "RGB", "RGBA")


def _node() -> Node:
    return Node(id=7, parent=1, name=b"a.png", path=b"dir/a.png", kind=KIND_FILE, mode=0o100644, size=1234,
                mtime_ns=5, nsubdirs=0, target=None, representation=REPR_ORIGINAL, served_size=None, object=None,
                checksum=None)


def _png(mode: str) -> bytes:
    rng = np.random.default_rng(1)
    rgba = Image.fromarray(rng.integers(0, 256, (16, 32, 4), dtype=np.uint8), "RGBA")
    im = rgba.convert("RGB").quantize(16) if mode == "P" else rgba.convert(mode)
    out = io.BytesIO()
    im.save(out, "PNG")
    return out.getvalue()


def test_the_registry_names_each_format_once_with_a_suffix_of_its_own() -> None:
    assert set(RAW_FORMATS) == {BMP.name, J2K.name} and NAMES == tuple(RAW_FORMATS)
    assert all(name == f.name and isinstance(f, RawFormat) for name, f in RAW_FORMATS.items())
    suffixes = [f.suffix for f in RAW_FORMATS.values()]
    assert len(set(suffixes)) == len(suffixes) and all(s.startswith(".") and "/" not in s for s in suffixes)
    assert len({f.label for f in RAW_FORMATS.values()}) == len(RAW_FORMATS)
    assert DEFAULT in RAW_FORMATS.values() and rawformats.DEFAULT_FORMATS == (DEFAULT.name,)
    # BMP is tried last: it holds every mode the others may refuse.
    assert NAMES[-1] == BMP.name and all(f.modes <= BMP.modes for f in RAW_FORMATS.values())
    with pytest.raises(AttributeError):
        BMP.name = "other"  # type: ignore[misc]


@EACH
def test_object_names_of_each_format_are_the_names_a_mount_accepts(fmt: RawFormat) -> None:
    name = object_name(_node(), fmt.name)
    assert name.endswith(fmt.suffix)
    found = OBJECT_NAME.fullmatch(name)
    assert found is not None and name == f"objects/{found.group(1)}" and found.group(1).endswith(fmt.suffix)
    assert len(found.group(2)) == 32 and found.group(1).startswith(found.group(2)[:2] + "/")
    assert rawformats.of_object(name) is fmt
    # A killed run's leftover of one is found (and deleted) by a local store; other names are not objects.
    leftover = f"{name}.tmp-{'0' * 16}"
    assert _object_entry(leftover) is not None and OBJECT_NAME.fullmatch(leftover) is None
    for other in (name[: -len(fmt.suffix)] + ".png", name + ".x", "/" + name, name.replace("objects/", "x/")):
        assert OBJECT_NAME.fullmatch(other) is None and _object_entry(other) is None


def test_a_name_of_no_raw_format_is_none_of_them() -> None:
    assert rawformats.of_object("objects/ab/" + "0" * 32 + ".png") is None
    assert rawformats.by_magic(b"\x89PNG\r\n\x1a\n") is None and rawformats.by_magic(b"") is None


@EACH
def test_the_encoder_writes_a_file_the_magic_and_sniff_recognise(fmt: RawFormat) -> None:
    result = formats.expand(_png("RGB"), to=fmt.name)
    assert result.accepted and result.raw_format == fmt.name and result.data is not None
    assert result.data.startswith(fmt.magic[0])
    assert rawformats.by_magic(result.data[:32]) is fmt and formats.sniff(result.data[:32]) == fmt.name


def test_every_raw_format_has_its_encoder() -> None:
    assert encoders.ENCODERS.keys() == RAW_FORMATS.keys()


@EACH
@pytest.mark.parametrize("mode", MODES)
def test_each_format_holds_exactly_the_modes_its_record_names(fmt: RawFormat, mode: str) -> None:
    source = _png(mode)
    result = formats.expand(source, to=fmt.name)
    if mode in fmt.modes:
        assert result.accepted, result.reason
        assert result.data is not None and formats.same_pixels(source, result.data)
    else:
        # Refused as this format's own limit: another raw format may still hold the image.
        assert not result.accepted and fmt.owns(result.reason) and rawformats.own_refusal(result.reason)
        assert result.reason == fmt.refusal(f"unsupported-mode:{mode}")


def test_a_refusal_of_the_image_itself_is_no_formats_own() -> None:
    for reason in ("corrupt", "transparency", "unsupported-mode:LA", None):
        assert not rawformats.own_refusal(reason)


@EACH
def test_each_format_is_budgeted_at_its_own_memory_per_pixel(fmt: RawFormat) -> None:
    assert resources.bytes_per_pixel((fmt.name,)) == fmt.bytes_per_pixel > 0
    assert resources.bytes_per_pixel(NAMES) == max(f.bytes_per_pixel for f in RAW_FORMATS.values())


def test_decoders_named_exact_and_meant_for_are_known_loaders() -> None:
    loaders = {"pillow", "torchvision (PIL loader)", "opencv", "dali-cpu", "dali-mixed", "nvimgcodec-gpu"}
    for fmt in RAW_FORMATS.values():
        assert fmt.exact_for and set(fmt.exact_for) <= loaders
        assert fmt.gpu_decoder is None or fmt.gpu_decoder in loaders
    assert BMP.gpu_decoder is None and J2K.gpu_decoder == "dali-mixed"


def test_the_stores_hold_registered_formats() -> None:
    assert LocalStore.raw_formats == NAMES  # every one, in the order prepare tries them
    assert set(BucketStore.raw_formats) <= set(NAMES) and DEFAULT.name in BucketStore.raw_formats


def test_formats_parse_into_the_order_prepare_tries_them() -> None:
    assert rawformats.parse_formats("png,bmp") == (BMP.name,)
    assert rawformats.parse_formats("png,bmp,j2k") == rawformats.parse_formats(" J2K ,BMP,jpeg") == NAMES
    assert rawformats.parse_formats("j2k") == (J2K.name,)


@pytest.mark.parametrize("text, message", [
    ("png,webp", "unknown format webp: --formats takes png and any of bmp, j2k"),
    ("gif,tiff,bmp", "unknown format gif, tiff: --formats takes png and any of bmp, j2k"),
    ("png", "--formats needs a raw format to expand to: bmp, j2k or both"),
    ("", "--formats needs a raw format to expand to: bmp, j2k or both"),
    (" , ", "--formats needs a raw format to expand to: bmp, j2k or both"),
])
def test_formats_parsing_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        rawformats.parse_formats(text)
    assert str(raised.value) == message


def test_an_unknown_raw_format_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown raw format 'webp' \(known: bmp, j2k\)"):
        rawformats.by_name("webp")
    with pytest.raises(ValueError, match="unknown raw format"):
        formats.expand(_png("RGB"), to="webp")
    assert rawformats.by_name(J2K.name) is J2K
