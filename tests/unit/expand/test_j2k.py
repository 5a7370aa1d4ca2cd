"""The lossless JPEG 2000 representation (issue 18, ``prepare --formats``): what it holds exactly, what it
refuses, and the ``--formats`` contract. A real mount serving J2K objects is in tests/mount/test_j2k_mount.py."""

from __future__ import annotations

import argparse
import io
import os
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from liquidfs.expand import formats
from liquidfs.expand import workers as resources
from liquidfs.cli import options
from liquidfs.expand.rawformats import BMP, J2K, of_object
from liquidfs.prepare import prepare
from sample import _photos, mosaic

parse_formats = options.argument(options.formats)  # --formats, as argparse calls it


def _photo(mode: str) -> Image.Image:
    base = mosaic(160, 96, random.Random(3), _photos())
    return base.quantize(64) if mode == "P" else base.convert(mode)


def _encoded(im: Image.Image, fmt: str = "PNG", **options: object) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **options)
    return out.getvalue()


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
@pytest.mark.parametrize("source_format", ["PNG", "JPEG"])
def test_j2k_holds_the_exact_pixels_of_png_and_jpeg(mode: str, source_format: str) -> None:
    if source_format == "JPEG" and mode == "RGBA":
        # JPEG has no alpha: there is no such source to expand. Should Pillow ever write one, this fails and the
        # case needs its expansion checked like the others.
        with pytest.raises(OSError):
            _encoded(_photo(mode), source_format)
        return
    source = _encoded(_photo(mode), source_format)
    result = formats.expand(source, to="j2k")
    assert result.accepted and result.raw_format == "j2k", result.reason
    assert result.data is not None and formats.sniff(result.data[:32]) == "j2k"
    assert result.data.startswith(J2K.magic[0])  # a JP2 file: the colour space travels with it
    assert formats.same_pixels(source, result.data)  # mode, size, samples under Pillow
    with Image.open(io.BytesIO(result.data)) as im:
        assert im.format == "JPEG2000" and im.mode == mode
    # J2K is compressed: far smaller than the BMP of the same image (a 160x96 photo mosaic)
    assert len(result.data) < 0.8 * len(formats.expand(source).data or b"")


@pytest.mark.parametrize("mode", ["P", "1"])
def test_modes_j2k_cannot_hold_are_refused_for_j2k_only(mode: str) -> None:
    source = _encoded(_photo("RGB").convert(mode) if mode == "1" else _photo(mode))
    assert formats.expand(source, to="j2k").reason == f"j2k-unsupported-mode:{mode}"
    assert formats.expand(source, to="bmp").accepted  # the BMP holds it


def test_an_openjpeg_failure_is_j2ks_own_refusal_and_a_bmp_holds_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenJPEG failing to encode (or to decode its own output) is no fault of the image: refused for J2K alone
    (``--formats j2k,bmp`` then makes a BMP), where it was "corrupt", for good, in every format."""
    from liquidfs.expand.expansion import expand_bytes

    source = _encoded(_photo("RGB"))

    def failing(self, fp, format=None, **params):  # type: ignore[no-untyped-def]
        raise OSError("encoder error -2 when writing image file")

    monkeypatch.setattr(Image.Image, "save", failing)
    assert formats.expand(source, to="j2k").reason == "j2k-encode-failed"
    refusal, raw, _ = expand_bytes(b"a.png", len(source), 1, source, raw_formats=("j2k", "bmp"))
    assert refusal is None and raw is not None and raw[:2] == b"BM"


def test_a_codec_out_of_memory_is_no_memory_not_corrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow's decoders say a failed allocation as an OSError ("out of memory error"): remembered as corrupt, the
    image was never tried again; as no-memory, the next run tries it (with more memory, maybe)."""
    def out_of_memory(data, max_pixels, to):  # type: ignore[no-untyped-def]
        raise OSError("out of memory error when reading image file")

    monkeypatch.setattr(formats, "expand_png", out_of_memory)
    assert formats.expand(_encoded(_photo("RGB"))).reason == "no-memory"  # (a PNG: its decoder failed)


def test_sources_refused_for_every_format_stay_refused() -> None:
    la = _encoded(_photo("RGB").convert("LA"))
    assert formats.expand(la, to="j2k").reason == formats.expand(la, to="bmp").reason == "unsupported-mode:LA"
    assert formats.expand(b"not an image", to="j2k").reason == "not-an-image"
    with pytest.raises(ValueError, match="unknown raw format"):
        formats.expand(la, to="webp")


def test_dali_cpu_decodes_a_j2k_object_to_the_pngs_pixels() -> None:
    from nvidia.dali import fn, pipeline_def, types

    sources = [_encoded(_photo(mode)) for mode in ("RGB", "L")]
    objects = [formats.expand(s, to="j2k").data for s in sources]

    @pipeline_def(batch_size=len(sources) * 2, num_threads=1, device_id=None)
    def pipe():  # type: ignore[no-untyped-def]
        data = fn.external_source(source=lambda: [np.frombuffer(b, np.uint8) for b in (*sources, *objects)],
                                  batch=True)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    p = pipe()
    p.build()
    (out,) = p.run()
    decoded = [np.array(out.at(i)) for i in range(len(out))]
    for png, j2k in zip(decoded[:len(sources)], decoded[len(sources):]):
        assert png.shape == j2k.shape and np.array_equal(png, j2k)


def test_nvimgcodec_decodes_a_j2k_object_to_the_sources_pixels_on_the_gpu() -> None:
    """``J2K.exact_for`` names nvImageCodec's GPU decoder: each mode J2K holds, from PNG and JPEG, decoded on the
    GPU (GPU_ONLY: never its CPU fallback) to the samples Pillow decodes from the source. Where no GPU or no
    nvImageCodec is visible (CI, a developer's machine) it is skipped, saying which; it runs on a GPU host, as
    does scripts/gpu/nvimgcodec_check.py at a real image size."""
    from liquidfs.profile.decoders import decode_nvimgcodec, find_nvimgcodec

    usable, why = find_nvimgcodec()
    if usable is None:
        pytest.skip(f"no GPU decoder to check: {why}")
    sources = [_encoded(_photo(mode), fmt) for mode in ("L", "RGB", "RGBA") for fmt in ("PNG", "JPEG")
               if not (fmt == "JPEG" and mode == "RGBA")]
    objects = [formats.expand(s, to="j2k").data for s in sources]
    assert all(o is not None for o in objects)
    for source, decoded in zip(sources, decode_nvimgcodec(objects)):  # type: ignore[arg-type]
        with Image.open(io.BytesIO(source)) as im:
            want = np.asarray(im)
        assert decoded is not None
        got = decoded[:, :, 0] if want.ndim == 2 else decoded
        assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)
    assert "nvimgcodec-gpu" in J2K.exact_for


def test_formats_option() -> None:
    assert parse_formats("png,bmp") == ("bmp",)
    assert parse_formats("png,j2k") == ("j2k",)
    assert parse_formats("png,bmp,j2k") == ("j2k", "bmp")  # J2K first, BMP for what J2K cannot hold
    assert parse_formats("J2K, bmp") == ("j2k", "bmp")
    for bad in ("png", "png,webp", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_formats(bad)
    assert of_object("objects/ab/" + "0" * 32 + ".jp2") is J2K
    assert of_object("objects/ab/" + "0" * 32 + ".bmp") is BMP
    assert of_object("objects/ab/x.png") is None


def test_prepare_refuses_j2k_alone_without_a_gpu_and_bad_formats(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "data").mkdir()
    # J2K alone, and no GPU to weigh it on (none visible to CUDA, whatever this machine has): refused before
    # anything is measured or written. DALI, the default decoder, is a test dependency.
    auto = run_cli("prepare", str(tmp_path / "data"), "--store", str(tmp_path / "store"), "--ratio", "auto",
                   "--formats", "png,j2k", check=False, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert auto.returncode == 1 and "J2K cannot be weighed: no GPU to decode it" in auto.stderr
    assert "add bmp to --formats (or give prepare a --ratio)" in auto.stderr and "Traceback" not in auto.stderr
    assert not (tmp_path / "store" / "objects").exists()
    bad = run_cli("prepare", str(tmp_path / "data"), "--store", str(tmp_path / "store"), "--ratio", "1",
                  "--formats", "png,webp", check=False)
    assert bad.returncode == 2 and "unknown format webp" in bad.stderr and "Traceback" not in bad.stderr


def test_each_format_is_budgeted_at_what_its_expansion_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare --formats ...j2k`` gave each worker the memory of a BMP expansion (24 B/px) while a lossless J2K
    encode peaks at 55-76 B/px: a container's limit OOM-killed the workers. Each format is budgeted at its own
    measured need: fewer workers fit for J2K, and an image whose J2K would not fit is refused for memory before
    any pixel is decoded, or made a BMP where --formats allows one."""
    src = tmp_path / "data"
    src.mkdir()
    noise = np.random.default_rng(5).integers(0, 256, (256, 512, 3), dtype=np.uint8)
    (src / "a.png").write_bytes(_encoded(Image.fromarray(noise, "RGB"), compress_level=1))
    size, pixels = (src / "a.png").stat().st_size, 512 * 256
    bmp, j2k = (resources.expansion_need(pixels, size, formats_) for formats_ in (("bmp",), ("j2k",)))
    assert j2k - bmp >= (70 - BMP.bytes_per_pixel) * pixels
    assert resources.expansion_need(pixels, size, ("j2k", "bmp")) == j2k  # a worker may try both in turn
    # A machine of 8 cores and 32 GiB: each J2K worker is given room for the largest image, so fewer fit.
    monkeypatch.setattr(resources, "usable_cores", lambda: 8)
    monkeypatch.setattr(resources, "available_memory", lambda *a, **k: 32 << 30)
    plans = {f: resources.plan_workers(None, max_pixels=formats.MAX_PIXELS, largest_source=size, raw_formats=(f,))
             for f in ("bmp", "j2k")}
    per_worker = resources.WORKER_BASE_BYTES + resources.expansion_need(formats.MAX_PIXELS, size, ("j2k",))
    assert plans["j2k"].workers == (32 << 30) // per_worker < plans["bmp"].workers
    assert plans["j2k"].budget is not None and plans["j2k"].budget >= per_worker - resources.WORKER_BASE_BYTES
    # Room for this image's BMP, not for its J2K: refused from its header (J2K alone), or made a BMP.
    budget = (bmp + j2k) // 2
    monkeypatch.setattr(resources, "available_memory", lambda *a, **k: resources.WORKER_BASE_BYTES + budget)
    report = prepare(src, tmp_path / "j2k", 1.0, progress=False, raw_formats=("j2k",))
    assert report.skipped == {"no-memory": 1} and report.raw_served == 0, report.lines()
    report = prepare(src, tmp_path / "both", 1.0, progress=False, raw_formats=("j2k", "bmp"))
    assert report.raw_served == 1, report.lines()
    assert [p.suffix for p in (tmp_path / "both" / "objects").rglob("*.*")] == [".bmp"]
