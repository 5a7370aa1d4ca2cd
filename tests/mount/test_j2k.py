"""A store prepared with ``--formats png,bmp,j2k`` through a real mount: Pillow (and torchvision's PIL loader)
read every image with the source's exact pixels, J2K objects where J2K holds the image, BMP where only a BMP
does; verify checks both; switching the formats replaces the objects."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from fusehelpers import Mount
from liquidfs.catalog.catalog import Catalog
from liquidfs.prepare import prepare, verify
from sample import _photos, mosaic


def _tree(root: Path) -> Path:
    rng = random.Random(11)
    photos = _photos()
    for i in range(6):
        base = mosaic(192, 96, rng, photos)
        (root / "rgb").mkdir(parents=True, exist_ok=True)
        base.save(root / "rgb" / f"{i}.png")
    (root / "other").mkdir()
    base.convert("L").save(root / "other" / "gray.png")
    base.quantize(32).save(root / "other" / "palette.png")  # J2K cannot hold a palette: a BMP does
    (root / "other" / "notes.txt").write_text("not an image\n")
    return root


def _objects(store: Path) -> dict[str, str]:
    catalog = Catalog.open(store, readonly=True)
    try:
        return {os.fsdecode(n.path): str(n.object) for n in catalog.files() if n.served_raw}
    finally:
        catalog.close()


@pytest.mark.fuse
def test_a_j2k_store_serves_exact_pixels_through_the_mount(tmp_path: Path, mounter: Mount) -> None:
    src = _tree(tmp_path / "data")
    store = tmp_path / "store"
    cli = run_cli("prepare", str(src), "--store", str(store), "--ratio", "1", "--formats", "png,bmp,j2k",
                  "--no-progress")
    assert "j2k objects decode to the source's pixels under: pillow" in cli.stdout
    objects = _objects(store)
    assert objects["other/palette.png"].endswith(".bmp")
    assert all(objects[name].endswith(".jp2") for name in objects if name != "other/palette.png"), objects
    assert len(objects) == 8
    assert verify(store, progress=False) == []

    mnt = mounter.mount(src, store=store)
    for source in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = source.relative_to(src)
        through = mnt / rel
        if source.suffix != ".png":
            assert through.read_bytes() == source.read_bytes()
            continue
        head = through.read_bytes()[:12]
        assert head[:2] == b"BM" if rel.name == "palette.png" else head == b"\0\0\0\x0cjP  \r\n\x87\n", rel
        assert through.stat().st_size == (store / objects[str(rel)]).stat().st_size
        with Image.open(through) as a, Image.open(source) as b:
            assert a.mode == b.mode and a.size == b.size, rel
            assert np.array_equal(np.asarray(a), np.asarray(b)), rel

    from torchvision import datasets  # the PIL loader torchvision's ImageFolder uses by default

    ours = datasets.ImageFolder(str(mnt))
    theirs = datasets.ImageFolder(str(src))
    assert len(ours) == len(theirs) == 8
    for (a, la), (b, lb) in zip(ours, theirs):
        assert la == lb and np.array_equal(np.asarray(a), np.asarray(b))


def test_changing_the_formats_replaces_the_objects(tmp_path: Path) -> None:
    src = _tree(tmp_path / "data")
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    bmps = _objects(store)
    assert len(bmps) == 8 and all(obj.endswith(".bmp") for obj in bmps.values())
    prepare(src, store, 1.0, progress=False, raw_formats=("j2k", "bmp"))
    j2ks = _objects(store)
    assert j2ks["other/palette.png"] == bmps["other/palette.png"]  # reused: J2K cannot hold it
    assert sum(obj.endswith(".jp2") for obj in j2ks.values()) == 7
    left = {str(p.relative_to(store)) for p in (store / "objects").rglob("*") if p.is_file()}
    assert left == set(j2ks.values())  # the BMPs no longer named are deleted
    assert verify(store, progress=False) == []
    prepare(src, store, 1.0, progress=False)  # back to BMP only
    again = _objects(store)
    assert len(again) == 8 and all(obj.endswith(".bmp") for obj in again.values())
