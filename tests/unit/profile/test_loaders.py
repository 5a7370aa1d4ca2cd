"""The one DALI read-and-decode pipeline (``dali_pipeline``) and its loop (``dali_batches``, ``dali_run``): each
parameter seen in what a real CPU pipeline delivers, over small PNGs the tests write; and the package without DALI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from liquidfs.profile.loaders import (
    CROP,
    READER,
    dali_batches,
    dali_pipeline,
    dali_run,
    reader_epoch_size,
    run_dali,
)


def _tree(root: Path, count: int = 6) -> dict[str, np.ndarray]:
    """``count`` PNGs of different sizes in two class folders, and the pixels each holds by relative path."""
    rng = np.random.default_rng(7)
    pixels: dict[str, np.ndarray] = {}
    for i in range(count):
        name = f"{'ab'[i % 2]}/{i:02d}.png"
        array = rng.integers(0, 256, (20 + 2 * i, 30 + i, 3), dtype=np.uint8)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(array).save(root / name)
        pixels[name] = array
    return pixels


def _relative(infos: object, i: int, root: Path) -> str:
    """Image ``i``'s path under ``root``: DALI gives it as it listed it, relative to the file root or absolute."""
    info = bytes(infos.at(i)).decode()  # type: ignore[attr-defined]
    return os.path.relpath(info, root) if os.path.isabs(info) else os.path.normpath(info)


def _names(pipe: object, root: Path, images: int) -> list[str]:
    """The relative paths of the next ``images`` images, in the order the pipeline delivered them."""
    return [_relative(infos, i, root) for _, _, infos in dali_batches(pipe, images) for i in range(len(infos))]


def test_a_file_root_without_shuffle_decodes_every_image_in_order_to_its_exact_pixels(tmp_path: Path) -> None:
    pixels = _tree(tmp_path)
    pipe = dali_pipeline(file_root=tmp_path, batch=4, threads=1, shuffle=False, source_info=True)
    assert reader_epoch_size(pipe) == 6
    seen: dict[str, np.ndarray] = {}
    labels: dict[str, int] = {}
    for images, batch_labels, infos in dali_batches(pipe, 6):
        for i in range(len(images)):
            name = _relative(infos, i, tmp_path)
            seen[name], labels[name] = np.array(images.at(i)), int(np.array(batch_labels.at(i)).reshape(-1)[0])
    assert sorted(seen) == sorted(pixels)
    assert all(np.array_equal(seen[name], pixels[name]) for name in pixels)
    # the class folders are the labels, a before b
    assert {name: label for name, label in labels.items()} == {name: "ab".index(name[0]) for name in pixels}
    fresh = dali_pipeline(file_root=tmp_path, batch=4, threads=1, shuffle=False, source_info=True)
    # in the listing's order; the last batch of 4 whole, wrapping into the next epoch's first two
    assert _names(fresh, tmp_path, 6) == sorted(pixels) + sorted(pixels)[:2]


def test_a_list_of_files_reads_those_files_only(tmp_path: Path) -> None:
    pixels = _tree(tmp_path)
    chosen = sorted(pixels)[1:4]
    pipe = dali_pipeline(files=[str(tmp_path / name) for name in chosen], batch=3, threads=1, shuffle=False,
                         source_info=True)
    assert reader_epoch_size(pipe) == 3
    assert _names(pipe, tmp_path, 3) == chosen


def test_shuffle_is_seeded_and_draws_from_its_buffer(tmp_path: Path) -> None:
    pixels = _tree(tmp_path, count=12)

    def order(seed: int, buffer: int) -> list[str]:
        pipe = dali_pipeline(file_root=tmp_path, batch=4, threads=1, seed=seed, shuffle_buffer=buffer,
                             source_info=True)
        return _names(pipe, tmp_path, 12)

    shuffled = order(1, 1024)
    assert sorted(shuffled) == sorted(pixels) and shuffled != sorted(pixels)  # each image once, not in order
    assert order(1, 1024) == shuffled  # the seed decides the order
    assert order(2, 1024) != shuffled
    # a buffer of one file leaves nothing to draw among: the seed no longer changes the order
    assert order(1, 1) == order(2, 1)


def test_a_crop_ends_in_normalised_float_chw_of_that_size(tmp_path: Path) -> None:
    _tree(tmp_path)
    for crop in (CROP, 32):
        pipe = dali_pipeline(file_root=tmp_path, batch=3, threads=2, seed=0, crop=crop)
        images, _ = pipe.run()
        arrays = [np.array(images.at(i)) for i in range(len(images))]
        assert len(arrays) == 3 and all(a.shape == (3, crop, crop) and a.dtype == np.float32 for a in arrays)
        # normalised: ImageNet's mean taken off, so values go below zero, which uint8 pixels never do
        assert min(float(a.min()) for a in arrays) < 0
    plain, _ = dali_pipeline(file_root=tmp_path, batch=3, threads=1, seed=0).run()
    assert all(np.array(plain.at(i)).dtype == np.uint8 and np.array(plain.at(i)).shape[2] == 3 for i in range(3))


def test_a_source_of_encoded_bytes_is_decoded_until_it_ends(tmp_path: Path) -> None:
    pixels = _tree(tmp_path, count=5)
    encoded = [np.frombuffer((tmp_path / name).read_bytes(), dtype=np.uint8) for name in sorted(pixels)]
    batches = iter([encoded[:2], encoded[2:4], encoded[4:]])
    pipe = dali_pipeline(source=batches, batch=2, threads=1, seed=0)
    decoded = [np.array(out[0].at(i)) for out in dali_batches(pipe, 100) for i in range(len(out[0]))]
    assert len(decoded) == 5  # asked for 100: the source's end ends the loop
    assert all(np.array_equal(d, pixels[name]) for d, name in zip(decoded, sorted(pixels)))


def test_dali_run_counts_whole_batches_and_their_decoded_bytes(tmp_path: Path) -> None:
    pixels = _tree(tmp_path)
    pipe = dali_pipeline(file_root=tmp_path, batch=4, threads=1, shuffle=False)
    run = dali_run(pipe, 6, count_bytes=True)
    # two batches of 4: the last batch whole, its 2 images past the 6 asked for from the next epoch (sorted, so
    # the first two files again)
    assert run.images == 8 and [n for _, n in run.marks] == [4, 8]
    first_two = sorted(pixels)[:2]
    assert run.decoded_bytes == sum(a.nbytes for a in pixels.values()) + sum(pixels[n].nbytes for n in first_two)
    assert run.seconds > 0 and run.cpu_seconds >= 0 and run.images_per_s == run.images / run.seconds
    assert [t for t, _ in run.marks] == sorted(t for t, _ in run.marks) and run.marks[-1][0] <= run.seconds
    assert dali_run(pipe, 4).decoded_bytes == 0  # not counted unless asked


def test_run_dali_delivers_exactly_epochs_times_files(tmp_path: Path) -> None:
    pixels = _tree(tmp_path)
    files = [str(tmp_path / name) for name in sorted(pixels)]
    counts = list(run_dali(files, threads=1, batch=4, epochs=2, seed=0, augment=False, shuffle_buffer=2))
    assert counts[0] == 0 and sum(counts) == 12 and counts[1:] == [4, 4, 4]


def test_the_pipeline_refuses_what_it_cannot_read_or_decode_on() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        dali_pipeline(batch=2, threads=1)
    with pytest.raises(ValueError, match="exactly one of"):
        dali_pipeline(file_root="/x", files=["/x/a.png"], batch=2, threads=1)
    with pytest.raises(ValueError, match="'cpu' or 'mixed'"):
        dali_pipeline(file_root="/x", batch=2, threads=1, device="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        dali_pipeline(file_root="/x", batch=0, threads=1)
    with pytest.raises(ValueError, match="positive"):
        dali_pipeline(file_root="/x", batch=2, threads=1, crop=0)
    assert READER == "reader"  # DALI's iterators find the reader by this name (bench_train's trainer)


def test_the_loaders_import_and_run_without_dali(tmp_path: Path) -> None:
    _tree(tmp_path)
    # DALI refused as a missing package is: the module, its Pillow loader and its refusals still work
    code = """import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "nvidia":
            raise ImportError(f"{name} is not installed")
        return None

sys.meta_path.insert(0, Absent())
from liquidfs.profile import loaders
print(sum(loaders.run_pil(loaders.image_files(sys.argv[1]), threads=1, batch=2, epochs=1, seed=0, augment=True)))
try:
    loaders.dali_pipeline(file_root=sys.argv[1], batch=2, threads=1)
except ImportError as e:
    print("no dali:", e)
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["6", "no dali: nvidia is not installed"], done.stdout


@pytest.mark.parametrize("flag", ["--batch=0", "--batch=-3", "--threads=0", "--epochs=0", "--shuffle-buffer=-1"])
def test_a_count_below_one_is_refused_at_once(tmp_path: Path, flag: str) -> None:
    """``--batch 0`` waited for good (no batch ever fills), ``--threads 0`` raised ValueError's traceback."""
    from liquidfs.profile import loaders

    with pytest.raises(SystemExit) as refused:
        loaders.main(["pil", str(tmp_path), flag])
    assert refused.value.code == 2
