#!/usr/bin/env python3
"""Soak: many reader processes read random files through one mount, every read checked, one reader killed -9.

    python scripts/soak.py --seconds 60 --readers 16          # sample, prepare (half raw), mount, read, report

Each reader picks random files and reads each whole in one of several ways (one read(), small sequential reads
of random sizes, preads in shuffled order, Pillow decode), and compares what it got with what must be served:
the raw object's bytes for a file served raw, the source's bytes otherwise, and for a decode, the pixels Pillow
decodes from the source. Midway one reader is killed with SIGKILL (its open files are released by the kernel).
At the end the mount must still answer, with no errors counted and no open files left.

Exit status 0 when every read matched and nothing failed. tests/test_faults.py runs the same for ~10 s.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash

IMAGE_SUFFIXES = (b".png", b".jpg", b".jpeg")
DISCONNECTED = (errno.ENOTCONN, errno.ECONNABORTED)


def digest(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def pixel_digest(path: str | Path) -> str:
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return f"{im.mode}:{im.size}:{digest(im.tobytes())}"


def build_manifest(store: Path) -> dict[str, Any]:
    """What the mount of ``store``'s catalog must serve, per file: digests of bytes and of decoded pixels."""
    from liquidfs.catalog import REPR_RAW, Catalog

    catalog = Catalog.open(store, readonly=True)
    try:
        root = catalog.source
        files = []
        for node in catalog.files():
            source = os.path.join(root, node.path)
            raw = node.repr == REPR_RAW
            with open(store / str(node.object) if raw else source, "rb") as f:
                expected = digest(f.read())
            pixels = pixel_digest(os.fsdecode(source)) if node.path.lower().endswith(IMAGE_SUFFIXES) else None
            files.append({"path": os.fsdecode(node.path), "digest": expected, "pixels": pixels, "raw": raw})
    finally:
        catalog.close()
    return {"source": os.fsdecode(root), "files": files}


# -- one reader process ------------------------------------------------------------------------------------


def read_one(path: str, how: str, rng: random.Random) -> bytes | str:
    if how == "whole":
        with open(path, "rb") as f:
            return f.read()
    if how == "small":
        out = bytearray()
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(rng.choice((1, 517, 4096, 65536, 131072, 1 << 20))):
                out += chunk
        return bytes(out)
    if how == "shuffled":
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            step = rng.choice((4096, 65536, 100_000))
            offsets = list(range(0, size, step))
            rng.shuffle(offsets)
            out = bytearray(size)
            for off in offsets:
                chunk = os.pread(fd, step, off)
                out[off:off + len(chunk)] = chunk
            return bytes(out)
        finally:
            os.close(fd)
    assert how == "decode"
    return pixel_digest(path)


def reader(mountpoint: Path, manifest: dict[str, Any], seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    files = manifest["files"]
    deadline = time.monotonic() + seconds
    result: dict[str, Any] = {"reads": 0, "bytes": 0, "decodes": 0, "raw": 0, "mismatches": [], "errors": [],
                              "disconnected": None}
    while time.monotonic() < deadline:
        entry = rng.choice(files)
        path = str(mountpoint / entry["path"])
        how = "decode" if entry["pixels"] and rng.random() < 0.1 else rng.choice(("whole", "small", "shuffled"))
        try:
            got = read_one(path, how, rng)
        except OSError as exc:
            if exc.errno in DISCONNECTED:
                result["disconnected"] = exc.errno
                break
            result["errors"].append(f"{entry['path']} ({how}): {exc!r}")
            continue
        except Exception as exc:  # a decoder refusing what it got is a wrong-bytes failure, not an I/O error
            result["mismatches"].append(f"{entry['path']} ({how}): {exc!r}")
            continue
        result["reads"] += 1
        if isinstance(got, str):
            result["decodes"] += 1
            if got != entry["pixels"]:
                result["mismatches"].append(f"{entry['path']} (decode): pixels differ")
        else:
            result["bytes"] += len(got)
            result["raw"] += got[:2] == b"BM" and entry["raw"]
            if digest(got) != entry["digest"]:
                result["mismatches"].append(f"{entry['path']} ({how}): {len(got)} bytes, wrong digest")
    return result


def start_readers(mountpoint: Path, manifest_path: Path, count: int, seconds: float) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, __file__, "reader", str(mountpoint), str(manifest_path),
                              "--seconds", str(seconds), "--seed", str(i)], stdout=subprocess.PIPE, text=True)
            for i in range(count)]


def collect(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any] | None]:
    """Each reader's result; None for one that was killed. A reader still running after ``timeout`` is a hang."""
    deadline = time.monotonic() + timeout
    results: list[dict[str, Any] | None] = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise RuntimeError(f"reader {proc.pid} still running {timeout:.0f} s after the soak should have ended")
        results.append(json.loads(out) if proc.returncode == 0 and out.strip() else None)
    return results


def soak(mountpoint: Path, manifest_path: Path, readers: int, seconds: float,
         kill_one: bool = True) -> dict[str, Any]:
    """Run the readers, kill one -9 midway; the summary of what they saw."""
    procs = start_readers(mountpoint, manifest_path, readers, seconds)
    killed = None
    try:
        if kill_one:
            time.sleep(seconds / 2)
            killed = procs[0].pid
            procs[0].kill()
        results = collect(procs, seconds + 120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    done = [r for r in results if r is not None]
    return {
        "readers": readers, "killed": killed, "finished": len(done),
        "reads": sum(r["reads"] for r in done), "bytes": sum(r["bytes"] for r in done),
        "decodes": sum(r["decodes"] for r in done), "raw_reads": sum(r["raw"] for r in done),
        "mismatches": [m for r in done for m in r["mismatches"]],
        "errors": [e for r in done for e in r["errors"]],
        "disconnected": [r["disconnected"] for r in done if r["disconnected"]],
    }


# -- the whole soak ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    r = sub.add_parser("reader", help=argparse.SUPPRESS)
    r.add_argument("mountpoint")
    r.add_argument("manifest")
    r.add_argument("--seconds", type=float, required=True)
    r.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the readers read (default 60)")
    parser.add_argument("--readers", type=int, default=16, help="reader processes (default 16)")
    parser.add_argument("--count", type=int, default=64, help="images in the sample (default 64)")
    parser.add_argument("--size", default="256x128", help="image size WxH (default 256x128)")
    parser.add_argument("--ratio", type=float, default=0.5, help="share served raw (default 0.5)")
    parser.add_argument("--dir", help="work directory (default: a new temporary one, removed after)")
    args = parser.parse_args(argv)
    if args.command == "reader":
        manifest = json.loads(Path(args.manifest).read_text())
        print(json.dumps(reader(Path(args.mountpoint), manifest, args.seconds, args.seed)))
        return 0

    from liquidfs.prepare import prepare
    from liquidfs.sample import make_sample

    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        source = make_sample(work / "data", count=args.count, width=width, height=height, seed=11, jpeg_share=0.25)
        store = work / "store"
        prepare(source, store, args.ratio, progress=False)
        manifest_path = work / "manifest.json"
        manifest_path.write_text(json.dumps(build_manifest(store)))
        mountpoint = work / "mnt"
        mountpoint.mkdir()
        subprocess.run([sys.executable, "-m", "liquidfs", "mount", str(source), str(mountpoint), "--store",
                        str(store)], check=True)
        try:
            summary = soak(mountpoint, manifest_path, args.readers, args.seconds)
            with open(mountpoint / ".__liquidfs__", "rb") as f:
                stats = json.loads(f.read())
            summary["daemon"] = {k: stats[k] for k in ("opens", "opens_raw", "errors", "fallbacks", "open_files")}
        finally:
            subprocess.run([sys.executable, "-m", "liquidfs", "umount", str(mountpoint)], check=False)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("mismatches", "errors")}, indent=1))
    for line in summary["mismatches"][:20] + summary["errors"][:20]:
        print("  " + line)
    ok = not summary["mismatches"] and not summary["errors"] and not summary["disconnected"] \
        and summary["daemon"]["errors"] == 0
    print("soak passed" if ok else "soak FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    raise SystemExit(main())
