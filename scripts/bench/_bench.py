"""What the benchmarks share: their flags, the work directory, the sample dataset and its stores, running the
``liquidfs`` command, mounting and unmounting, dropping the page cache, a process's CPU seconds, and the DALI (or
torchvision) epoch in a loader process.

Imported by the scripts beside it (``import _bench as bench``); not a benchmark itself. Every benchmark names its
flags alike (``add_run_arguments``): ``--json PATH`` for its results (a chart, a table or logs go beside that
file), ``--work DIR`` for what it keeps between runs (dataset, stores, mountpoint; soak's is where its temporary
one goes), and where it has a smoke mode, ``--smoke``: a few small images and short timings, to show the script
works (what its test runs), never a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # this checkout's liquidfs
sys.path.insert(0, str(REPO / "scripts"))  # sample.py, which the demo and the tests use too

import _throttle  # noqa: E402
from liquidfs.catalog.catalog import Catalog  # noqa: E402
from liquidfs.daemon.control import read_control  # noqa: E402
from liquidfs.prepare import prepare  # noqa: E402
from sample import make_sample  # noqa: E402

DALI_EPOCH = HERE / "dali_epoch.py"
TORCH_EPOCH = HERE / "torch_epoch.py"
LOADER: dict[str, object] = {"name": "dali", "shuffle_buffer": 1024}  # set from --loader, --shuffle-buffer
SUBDIR = Path("leftImg8bit") / "train"
FUSERMOUNT = "fusermount3"


# -- the flags every benchmark takes ----------------------------------------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser, *, results: str, work: Path | None = None,
                      work_help: str = "dataset, stores and the mountpoint, kept for the next run",
                      smoke: str | None = None) -> None:
    """``--json PATH`` (``results``: its default, in words), ``--work DIR`` where the benchmark keeps one
    (``work``: its default; None: none), ``--smoke`` where it has a smoke mode (``smoke``: what that mode runs)."""
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help=f"write the results here as JSON (default {results})")
    if work is not None:
        parser.add_argument("--work", type=Path, metavar="DIR", default=work,
                            help=f"{work_help} (default {display(work)})")
    if smoke is not None:
        parser.add_argument("--smoke", action="store_true", help=f"{smoke}: for tests of the script, not a measurement")


def write_results(path: Path | None, results: object) -> None:
    """``--json PATH``: ``results`` written there as JSON (its directory made); nothing where none was given."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")


def display(path: Path) -> str:
    """``path`` as the help shows it: relative to the checkout when inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def work_dir(path: Path) -> Path:
    """The work directory, absolute and made."""
    path = path.absolute()
    path.mkdir(parents=True, exist_ok=True)
    return path


def dataset_dir(work: Path, images: int, width: int, height: int) -> Path:
    """The work directory of one dataset shape under ``work``: a smoke run never replaces the dataset of a full
    one (``dataset`` checks only the count). Links resolved: it may be a link to a dataset another benchmark made."""
    return work_dir(work / f"{images}-{width}x{height}").resolve()


# -- commands, mounts, the machine ------------------------------------------------------------------------


class CommandFailed(subprocess.CalledProcessError):
    """A command that exited non-zero; its message holds what it printed."""

    def __str__(self) -> str:
        said = f"{self.stdout or ''}{self.stderr or ''}".strip()
        return f"{super().__str__()}" + (f"\n{said[-3000:]}" if said else "")


def liquidfs(*args: str, env: dict[str, str] | None = None, timeout: float | None = None) -> str:
    """``liquidfs ARGS`` (this checkout's): its standard output; CommandFailed when it fails."""
    done = subprocess.run([sys.executable, "-m", "liquidfs", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise CommandFailed(done.returncode, done.args, done.stdout, done.stderr)
    return done.stdout


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


def drop_caches(what: int = 3) -> None:
    """Empty the page cache (3: and dentries and inodes; 2: only those) after writing back what is dirty. Root."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text(f"{what}\n")


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
    """utime + stime of one process and its children now running (a mount's other loops, ``mount --loops``;
    its watchdog), their threads included, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            try:
                total += cpu_seconds(int(child))
            except (OSError, ValueError):
                pass  # ended meanwhile
    return total


def io_read_bytes(pid: int) -> int:
    """Bytes the process made the block layer read (all its threads): storage traffic, whatever the data path."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def root_problem(drops: str) -> str | None:
    """Why this machine cannot run a benchmark that drops the page cache (``drops``: when, in words) and caps
    storage with a blkio cgroup, as far as Linux and root go; None if it can."""
    if sys.platform != "linux":
        return "needs Linux (drop_caches, cgroup v1 blkio)"
    if os.geteuid() != 0:
        return f"needs root: it drops the page cache {drops} and caps storage with a blkio cgroup"
    return None


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of a process, in MB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return {"rss_mb": values["VmRSS"], "hwm_mb": values["VmHWM"]}


def control(mnt: Path) -> dict[str, Any]:
    return read_control(mnt)  # the mount's statistics, as `liquidfs stats` reads them


def fuse_connection(mountpoint: str | Path) -> int | None:
    """The FUSE connection number of the mount on ``mountpoint`` (/sys/fs/fuse/connections/N), from
    /proc/self/mountinfo: nothing is asked of the mount itself, which may be hung."""
    path = os.path.abspath(mountpoint)  # a string's work: the mount is never asked
    escaped = path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[4] == escaped and fields[sep + 1].split(".")[0] in ("fuse", "fuseblk"):
                found = int(fields[2].split(":")[1])  # the last (uppermost) mount there
    return found


def is_mounted(mountpoint: str | Path) -> bool:
    """A FUSE mount is on ``mountpoint`` (asked of the mount table, never of the mount)."""
    return fuse_connection(mountpoint) is not None


@dataclass
class Mounted:
    """A liquidfs mount this benchmark made: where, its daemon, the environment its commands need."""

    mnt: Path
    pid: int
    env: dict[str, str] | None = None
    ready_s: float = 0.0  # how long `liquidfs mount` took (it returns once the mount answers)

    def close(self, check: bool = True, timeout: float = 120) -> None:
        unmount(self.mnt, env=self.env, check=check, timeout=timeout)


def mount(src: Path | str, store: Path | str, mnt: Path, *extra: str, env: dict[str, str] | None = None,
          timeout: float = 300) -> Mounted:
    """``liquidfs mount SRC MNT --store STORE EXTRA...``, once it answers. A mount an interrupted run left on
    ``mnt`` is unmounted first: its daemon would hold the mountpoint."""
    mnt.mkdir(parents=True, exist_ok=True)
    if is_mounted(mnt):
        unmount(mnt, env=env, check=False)
    started = time.monotonic()
    liquidfs("mount", str(src), str(mnt), "--store", str(store), *extra, env=env, timeout=timeout)
    ready = time.monotonic() - started
    try:
        pid = int(control(mnt)["pid"])
    except BaseException:
        unmount(mnt, env=env, check=False)
        raise
    return Mounted(mnt, pid, env, ready)


@contextlib.contextmanager
def mounted(src: Path | str, store: Path | str, mnt: Path, *extra: str, env: dict[str, str] | None = None,
            timeout: float = 300) -> Iterator[Mounted]:
    """``mount``, unmounted on the way out (``unmount``, checked)."""
    m = mount(src, store, mnt, *extra, env=env, timeout=timeout)
    try:
        yield m
    finally:
        m.close()


def unmount(mnt: Path, env: dict[str, str] | None = None, check: bool = True, timeout: float = 120) -> None:
    """``liquidfs umount MNT``, which waits for the daemon to exit. Should it fail, the mount is detached lazily
    (fusermount3 -u -z), so that none is left behind, and the failure raised (``check``) or printed."""
    try:
        liquidfs("umount", str(mnt), env=env, timeout=timeout)
        return
    except (CommandFailed, subprocess.TimeoutExpired) as exc:
        error = exc
    if is_mounted(mnt):
        subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True, check=False, timeout=30)
    if check:
        raise error
    print(f"liquidfs umount {mnt}: {error}", file=sys.stderr)


# -- dataset and stores ---------------------------------------------------------------------------------


def dataset(work: Path, images: int, width: int, height: int) -> Path:
    src = work / "data"
    marker = src / "meta.json"
    if marker.exists() and json.loads(marker.read_text()).get("count") == images:
        print(f"reusing {images} images in {src}", file=sys.stderr)
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
