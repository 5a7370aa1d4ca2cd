"""What the benchmarks share: the sample dataset and its stores, mounting, dropping the page cache, a process's
CPU seconds, the DALI (or torchvision) epoch in a loader process, and running the ``liquidfs`` command.

Imported by the ``scripts/bench_*.py`` scripts (``import _bench as bench``); not a benchmark itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from liquidfs import _throttle  # noqa: E402
from liquidfs.catalog import Catalog  # noqa: E402
from liquidfs.mount import read_control  # noqa: E402
from liquidfs.prepare import prepare  # noqa: E402
from liquidfs.sample import make_sample  # noqa: E402

DALI_EPOCH = REPO / "scripts" / "dali_epoch.py"
TORCH_EPOCH = REPO / "scripts" / "torch_epoch.py"
LOADER: dict[str, object] = {"name": "dali", "shuffle_buffer": 1024}  # set from --loader, --shuffle-buffer
SUBDIR = Path("leftImg8bit") / "train"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def liquidfs(*args: str) -> str:
    return sh(sys.executable, "-m", "liquidfs", *args)


def add_run_arguments(parser: argparse.ArgumentParser, name: str, smoke: str) -> None:
    """--out, --work and --smoke, as every benchmark that keeps a dataset under out/ takes them."""
    parser.add_argument("--out", type=Path, default=REPO / "out" / name)
    parser.add_argument("--work", type=Path, default=REPO / "out" / f"bench-{name}",
                        help="dataset, stores and the mountpoint (the dataset is cached per count and size)")
    parser.add_argument("--smoke", action="store_true", help=f"{smoke}: for tests of the script, not a measurement")


def split_choices(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated option (--configs, --scenarios, ...) as a list, every item one of ``known``."""
    given = [item for item in text.split(",") if item]
    if bad := [item for item in given if item not in known]:
        parser.error(f"unknown {what} {', '.join(bad)} (known: {', '.join(known)})")
    return given


def tail(path: Path, chars: int = 2000) -> str:
    """The end of a log, for an error message ("" where it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_all(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 22):
                    pass


def tree_bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def control(mnt: Path) -> dict[str, Any]:
    return read_control(mnt)  # the mount's statistics, as `liquidfs stats` reads them


# -- dataset and stores ---------------------------------------------------------------------------------


def dataset(work: Path, images: int, width: int, height: int) -> Path:
    src = work / "data"
    marker = src / "meta.json"
    if marker.exists() and json.loads(marker.read_text()).get("count") == images:
        return src
    shutil.rmtree(src, ignore_errors=True)
    print(f"generating {images} {width}x{height} images in {src}", file=sys.stderr)
    make_sample(src, count=images, width=width, height=height, seed=42)
    return src


def store_for(work: Path, src: Path, ratio: float, raw_formats: tuple[str, ...] = ("bmp",)) -> Path:
    """The store prepared at ``ratio`` (``raw_formats`` as prepare's --formats), kept for the next run."""
    store = work / ("store-" + "".join(f"{f}-" for f in raw_formats if f != "bmp") + f"{ratio:.2f}")
    prepare(src, store, ratio, progress=False, raw_formats=raw_formats)
    return store


def bmp_copy(work: Path, src: Path) -> Path:
    """The all-BMP baseline: the same tree with every image's raw bytes under its original name."""
    return served_copy(work, src, 1.0)


def served_copy(work: Path, src: Path, ratio: float) -> Path:
    """A plain directory holding exactly what a mount of the ratio-``ratio`` store serves (raw bytes for the
    images prepare expanded, the originals for the rest): the "same files read directly" baseline of a mix."""
    out = work / ("bmp" if ratio == 1.0 else f"copy-{ratio:.2f}")
    if ratio == 1.0 and (out / ".done").exists():  # a mix is copied anew: which images are raw may change
        return out
    shutil.rmtree(out, ignore_errors=True)
    store = store_for(work, src, ratio)
    catalog = Catalog.open(store)
    for node in catalog.files():
        dest = out / os.fsdecode(node.path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if node.served_raw:
            shutil.copyfile(store / str(node.object), dest)
        else:
            shutil.copyfile(src / os.fsdecode(node.path), dest)
    catalog.close()
    (out / ".done").write_text("")
    return out


def auto_ratio(work: Path, src: Path, cache_share: float = 0.0, cap_mb: int = 0) -> float:
    args = [sys.executable, "-m", "liquidfs", "profile", str(src), "--store", str(work / "store-profile"),
            "--json", str(work / "profile.json"), "--cache-size", f"{cache_share * 100:.0f}%"]
    if cap_mb:
        with _throttle.throttled(src, cap_mb * 1_000_000) as group:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                    preexec_fn=lambda: group.add(os.getpid()))
            proc.communicate()
    else:
        subprocess.run(args, check=True, capture_output=True)
    return float(json.loads((work / "profile.json").read_text())["chosen"])


# -- one measured run -----------------------------------------------------------------------------------


def run_loader(root: Path, images: int, seed: int, group: _throttle.ReadThrottle | None,
               threads: int, batch: int) -> dict:
    if LOADER["name"] == "torch":
        cmd = [sys.executable, str(TORCH_EPOCH), str(root / SUBDIR), "--images", str(images), "--seed", str(seed),
               "--workers", str(threads), "--batch", str(batch)]
    else:
        cmd = [sys.executable, str(DALI_EPOCH), str(root / SUBDIR), "--images", str(images), "--seed",
               str(seed), "--threads", str(threads), "--batch", str(batch), "--shuffle-buffer",
               str(LOADER["shuffle_buffer"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: group.add(os.getpid())) if group else None)
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"loader failed: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


class Mounted:
    def __init__(self, src: Path, store: Path, mnt: Path, *extra: str) -> None:
        self.mnt = mnt
        mnt.mkdir(parents=True, exist_ok=True)
        liquidfs("mount", str(src), str(mnt), "--store", str(store), *extra)
        self.pid = int(control(mnt)["pid"])

    def close(self) -> None:
        liquidfs("umount", str(self.mnt))
