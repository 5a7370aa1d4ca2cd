#!/usr/bin/env python3
"""Soak: many reader processes read random files through one mount, every read checked.

    python scripts/attack/soak.py --seconds 60            # sample, prepare (half raw), mount, read, report
    python scripts/attack/soak.py --attacker --seconds 180 --json out/soak-attacker.json

Both run once per data path (``--data-path both``, the default: passthrough, then daemon), each on a new mount.

Without ``--attacker``, each reader picks random files and reads each whole in one of several ways (one read(),
small sequential reads of random sizes, preads in shuffled order, Pillow decode), and compares what it got with
what must be served: the raw object's bytes for a file served raw, the source's bytes otherwise, and for a
decode, the pixels Pillow decodes from the source. Midway one reader is killed with SIGKILL (its open files are
released by the kernel). At the end the mount must still answer, with no errors counted and no open files left.

With ``--attacker``, a process changes the source and the store under the running mount while the readers read, and
undoes each change 0.05-1.5 s later, at random: (1) an image swapped for a symlink to a "secret" PNG of the same
byte size and mtime (0600), then renamed back, the directory's mtime put back; (2) an image rewritten in place (one
write, not truncated first) with other pixels of the same size, mtime put back (cp -p), later the original put back
the same way; (3) a raw object of the store with one byte flipped, or truncated, later restored: by a store writer
who is not the mount's user (a damaged file of its own renamed over the object; ``--object-writer root``: root
damaging root's objects in place instead, which passthrough cannot check for a reader that already has it open); (4)
``liquidfs prepare`` at ratio 0, 0.5 or 1 on the mounted store; (5) the source root swapped for a symlink to a tree
of secrets, and back. Readers read whole (read(), small reads, shuffled preads, mmap, and opens or maps held up to
0.2 s before reading, as loaders do), decode with Pillow and compare the pixels with the two versions the file may
legitimately hold (original, rewritten). An I/O error (EIO, ENOENT, EACCES, ELOOP...; EFAULT for a map whose pages
could not be read, ENODEV for a map the mount refuses) is counted, not a failure; pixels of neither version,
undecodable bytes, or any byte of a secret are WRONG. Afterwards every change is undone and each file is read once
more (all must be right). The table and each wrong read explained (what it was served, which attacks touched that
file around it) are printed and, with ``--json``, written with the path of the attacker's log.

Two more attacks are those of a dataset writer (issue 26), both through renameat2(RENAME_EXCHANGE), so each name
is always either the real thing or the link: (6) ``dirflip``: a directory of the source exchanged with a symlink
into the mount itself (``MNT/nowhere``, ``MNT``, or the mount's view of that same directory: ``mv d d0; ln -s
MNT/nowhere d`` done atomically), and back; a daemon that walks a source path on its own loop sends itself a
LOOKUP it can never answer, and every process touching the mount hangs; (7) ``fifo``: an image exchanged with a
symlink to a FIFO, and back. The mounts run with ``--cache-size 100%`` by default, so the next-epoch cache holds
files and their re-opens take the cache's "has the source changed" check. All the while a watchdog asks the mount
``ls MNT`` and its stats (the control file ``liquidfs stats`` reads) from a child process every second; one that
gets no answer within ``--deadline`` seconds (10) is a HANG: the daemon's threads are noted (their wchan), the FUSE
connection is aborted (/sys/fs/fuse/connections/N/abort), the mount detached (``fusermount3 -u -z``) and the daemon
killed if it does not exit, so no process is left stuck, and the soak fails. (8) ``profile``: after the mounts,
``liquidfs profile --quick`` runs on the source while a thread exchanges PNGs (and whole directories) with links to
a FIFO (a tree of FIFOs), and back, again and again; it must finish or fail with a message within
``--profile-deadline`` seconds (120), else it is a HANG (its threads' wchan noted, e.g. ``wait_for_partner``, then
killed). ``--attacks`` picks the attacks (default all; ``--attacks dirflip`` alone, ``--attacks dirflip,fifo,profile``).

    python scripts/attack/soak.py --attacks dirflip,fifo,profile --seconds 20 --count 24 --readers 4 \
        --json out/soak-26.json

Three more are the node's other users against a mount's cluster level and its jobs (issue 38; ``neighbours.py``),
each run as ``nobody`` (the child drops root with setgid/setuid before it attacks): (9) ``cluster-writer``: the
mounts run with ``--cluster memcached://127.0.0.1:PORT --cluster-size 100% --cluster-key-file KEY`` against a real
memcached the soak starts (``--cluster-key none``: no key, values in the clear and checked by digest alone), and
nobody, over TCP, lists its keys (``lru_crawler metadump all``) and rewrites values: a byte flipped, another key's
value put in, a value cut short, random bytes of the same length; it then looks, without fetching, whether the
mount fetched each (``mg KEY c h u``) or replaced it with its own. (10) ``lying-peer``: a second "memcached" in the
``--cluster`` list, a socket server of the soak's on loopback that lies to every call (a 1 TiB value announced and
flooded, a value of the right length trickled a byte per 0.3 s, random bytes of the right length, a garbage line,
an endless line, silence). (11) ``job-hopper``: on an ``--allow-other`` mount, nobody starts short jobs one after
another (a ``cat`` of one image in a new session, a third of them with ``LIQUIDFS_JOB`` set to the readers' own
job name, which the readers run under), while a thread samples the mount's per-job counters: the readers' job must
keep its id, its epochs and reads may only count up, and nobody's opens under that name must be a job of nobody's.
With either cluster attack the mounts' ``--cache-size`` is 10% unless given, so most opens ask the cluster. Every
read (the readers' and the hopper's) must be right, no read may fail for a lie (a miss falls through to storage),
the watchdog must always get its answer, and the daemon's peak RSS (VmHWM) may not rise by more than 256 MiB;
the mount's ``cluster_*`` counters (``cluster_rejected``: values refused), the lies told, the hopper's jobs and
the readers' job's ids and epochs, and the daemon's RSS after the mount and at the end are in the JSON and a
table of their own:

    python scripts/attack/soak.py --attacks cluster-writer,lying-peer,job-hopper --seconds 60 --count 24 \
        --readers 4 --json out/soak-38.json

Exit status 0 when every read matched (and, without the attacker, nothing failed; with it, no unexpected errno,
no hang, and the watchdog always answered; the readers' job unmoved). tests/mount/test_faults.py runs the reader
part for ~10 s; tests/system/test_soak.py runs the dataset-writer attacks for a few seconds on each data path, and
the three of issue 38 together for a few seconds on passthrough.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402  (mounting, the mount table: one copy of each)
import neighbours  # noqa: E402  (the memcached writer, the lying peer, the job hopper)
from _bench import fuse_connection, is_mounted  # noqa: E402
from liquidfs.daemon.control import read_control  # noqa: E402
from sample import make_sample  # noqa: E402

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
    from liquidfs.catalog.catalog import Catalog

    catalog = Catalog.open(store, readonly=True)
    try:
        root = catalog.source
        files = []
        for node in catalog.files():
            source = os.path.join(root, node.path)
            raw = node.served_raw
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


# -- the attacker soak -----------------------------------------------------------------------------------
#
# Files of the work directory: data/ (the source, mounted), versions/{orig,alt,secret}/<i>.png (what each image
# may legitimately hold, and what must never be served), evil/ (a copy of the tree whose every image is a
# secret), stash/ (where the attacker parks what it swapped out), objects-<path>/ (copies of the raw objects the
# mount's catalog names, to restore damaged ones and to diff what a reader got).

MARKER = b"LIQUIDFS-SOAK-SECRET:"
#: madvise(MADV_POPULATE_READ), Linux >= 5.14: faults the whole map in and answers EFAULT where touching a page
#: would have raised SIGBUS (a read the daemon failed with EIO, or a file shrunk under the map).
MADV_POPULATE_READ = 22
#: Errors a reader may get while the attacker runs: the mount refusing what it cannot vouch for. ENODEV: mmap of
#: a daemon-path open served direct_io (its size changed at open); EFAULT: a map whose pages could not be read.
ALLOWED_ERRNOS = frozenset({errno.EIO, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENOTDIR,
                            errno.ESTALE, errno.EFAULT, errno.ENODEV})
#: What the attacker process does while the readers read (``Attacker``), and how often, relatively.
ATTACKS = ("symlink", "rewrite", "flip", "truncate", "prepare", "root", "dirflip", "fifo")
WEIGHTS = {"symlink": 4, "rewrite": 4, "flip": 3, "truncate": 2, "prepare": 1, "root": 1, "dirflip": 3, "fifo": 3}
#: Every attack ``--attacks`` may name: those during reads, those of the node's other users around the mount
#: (``neighbours``: its cluster and its jobs), and ``profile`` (links to a FIFO during a profile).
ALL_ATTACKS = (*ATTACKS, *neighbours.NEIGHBOURS, "profile")
READ_WAYS = ("whole", "small", "shuffled", "mmap", "late-read", "late-mmap")


def pixels_of(data: bytes) -> str:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return f"{im.mode}:{im.size}:{digest(im.tobytes())}"


def png_bytes(image: Any, text: bytes | None = None) -> bytes:
    import io

    from PIL import PngImagePlugin

    info = None
    if text is not None:
        info = PngImagePlugin.PngInfo()
        info.add_text("secret", text.decode())
    out = io.BytesIO()
    image.save(out, "PNG", optimize=True, pnginfo=info)
    return out.getvalue()


def padded(png: bytes, size: int, filler: bytes) -> bytes:
    """``png`` grown to exactly ``size`` bytes with ``filler`` after IEND (decoders stop at IEND)."""
    if len(png) > size:
        raise ValueError(f"{len(png)} bytes do not fit in {size}")
    pad = size - len(png)
    return png + (filler * (pad // len(filler) + 1))[:pad]


def alternative(original: bytes) -> bytes:
    """Other pixels in a PNG of the original's byte size: what a legitimate rewrite of the source puts there."""
    import io

    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(original)) as im:
        img = im.convert("RGB")
    for bits in (4, 3, 2, 1):
        candidate = png_bytes(ImageOps.invert(ImageOps.posterize(img, bits)).transpose(Image.Transpose.ROTATE_180))
        if len(candidate) <= len(original):
            return padded(candidate, len(original), b"\0")
    return padded(png_bytes(Image.new("RGB", img.size, (7, 77, 177))), len(original), b"\0")


def secret(size: int, image_size: tuple[int, int]) -> bytes:
    """A PNG of ``size`` bytes that no reader may ever see: decodable, MARKER in a text chunk and all its padding."""
    from PIL import Image

    img = Image.new("RGB", image_size, (255, 0, 255))
    for x in range(0, image_size[0], 8):
        img.putpixel((x, x % image_size[1]), (0, 255, 0))
    return padded(png_bytes(img, MARKER + b"do not serve"), size, MARKER)


def build_fixture(work: Path, source: Path) -> dict[str, Any]:
    """The versions of every image, the secrets (0600, each with its original's mtime), the evil tree."""
    images = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() == ".png")
    files = []
    secret_px = None
    for i, path in enumerate(images):
        rel = path.relative_to(source)
        original = path.read_bytes()
        st = path.stat()
        alt = alternative(original)
        with_secret = secret(len(original), _size_of(original))
        versions = {}
        for kind, data in (("orig", original), ("alt", alt), ("secret", with_secret)):
            dest = work / "versions" / kind / f"{i}.png"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            versions[kind] = str(dest)
        os.chmod(versions["secret"], 0o600)
        os.utime(versions["secret"], ns=(st.st_atime_ns, st.st_mtime_ns))
        evil = work / "evil" / rel
        evil.parent.mkdir(parents=True, exist_ok=True)
        os.link(versions["secret"], evil)
        secret_px = secret_px or pixels_of(with_secret)
        assert len(alt) == len(with_secret) == len(original) == st.st_size
        files.append({"path": str(rel), "versions": versions, "mtime_ns": st.st_mtime_ns,
                      "px": [pixels_of(original), pixels_of(alt)], "png_digests": [digest(original), digest(alt)]})
    for node in sorted(p for p in source.rglob("*") if p.is_dir()):  # the evil tree looks as old as the real one
        st = node.stat()
        os.utime(work / "evil" / node.relative_to(source), ns=(st.st_atime_ns, st.st_mtime_ns))
    (work / "stash").mkdir()
    # What the dataset-writer attacks flip: every directory holding images (below the root), and a FIFO that
    # links point to (opening it for reading waits for a writer that never comes).
    dirs = sorted({str(parent) for f in files for parent in Path(f["path"]).parents if str(parent) != "."})
    fifo = work / "fifo"
    os.mkfifo(fifo)
    return {"files": files, "secret_px": secret_px, "dirs": dirs, "fifo": str(fifo)}


def _size_of(png: bytes) -> tuple[int, int]:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        return im.size


def with_objects(fixture: dict[str, Any], store: Path, work: Path, tag: str) -> dict[str, Any]:
    """``fixture`` plus, for each image the store's catalog serves raw, its object and a copy of it."""
    from liquidfs.catalog.catalog import Catalog

    catalog = Catalog.open(store, readonly=True)
    try:
        objects = {os.fsdecode(n.path): n.object for n in catalog.files() if n.served_raw}
    finally:
        catalog.close()
    files = []
    for i, entry in enumerate(fixture["files"]):
        entry = dict(entry, object=None, object_copy=None)
        if entry["path"] in objects:
            copy = work / f"objects-{tag}" / f"{i}.bmp"
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes((store / objects[entry["path"]]).read_bytes())
            entry.update(object=objects[entry["path"]], object_copy=str(copy))
        files.append(entry)
    return dict(fixture, files=files)


# -- an attacked reader process ------------------------------------------------------------------------------


def read_attacked(path: str, how: str, rng: random.Random) -> bytes:
    if how in ("whole", "small", "shuffled"):
        got = read_one(path, how, rng)
        assert isinstance(got, bytes)
        return got
    fd = os.open(path, os.O_RDONLY)
    try:
        if how.startswith("late"):  # a loader that opens (or maps) ahead and reads later, as DALI does
            time.sleep(rng.uniform(0, 0.2))
        if how.endswith("read"):
            out = bytearray()
            while chunk := os.read(fd, 1 << 20):
                out += chunk
            return bytes(out)
        import mmap

        for _ in range(3):
            size = os.fstat(fd).st_size  # as DALI does: as many bytes as stat says
            if size == 0:
                return b""
            try:
                m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            except ValueError:  # mmap's own fstat saw another size: the attributes changed meanwhile
                continue
            with m:
                if how == "late-mmap":
                    time.sleep(rng.uniform(0, 0.2))
                m.madvise(MADV_POPULATE_READ)
                return bytes(m)
        raise OSError(errno.EBUSY, "st_size kept changing while the file was mapped", path)
    finally:
        os.close(fd)


def explain(got: bytes, entry: dict[str, Any], secret_px: str) -> dict[str, Any]:
    """What a wrong read looks like next to what it might have been, to reduce it to its cause."""
    out: dict[str, Any] = {"length": len(got), "head": got[:8].hex(), "secret_marker": MARKER in got}
    for name in ("orig", "alt", "secret"):
        out[f"same_as_{name}"] = digest(got) == digest(Path(entry["versions"][name]).read_bytes())
    refs = {"orig": entry["versions"]["orig"], "alt": entry["versions"]["alt"], "object": entry["object_copy"]}
    for name, ref in refs.items():
        if ref is None:
            continue
        want = Path(ref).read_bytes()
        n = min(len(want), len(got))
        diff = [i for i in range(n) if want[i] != got[i]]
        out[f"vs_{name}"] = {"length": len(want), "bytes_differing": len(diff) + abs(len(want) - len(got)),
                             "first_difference": diff[0] if diff else (n if len(want) != len(got) else None)}
    try:
        px = pixels_of(got)
        out["pixels"] = "secret" if px == secret_px else "neither"
    except Exception as exc:
        out["pixels"] = f"undecodable: {exc!r}"
    out["kind"] = kind_of(got, out, refs)
    return out


def kind_of(got: bytes, out: dict[str, Any], refs: dict[str, str | None]) -> str:
    """One line a table can count: which served thing a wrong read resembles."""
    if out["secret_marker"] or out["same_as_secret"] or out["pixels"] == "secret":
        return "secret"
    if not got:
        return "empty"
    for name, ref in refs.items():
        if ref is None:
            continue
        want = Path(ref).read_bytes()
        what = "raw object" if name == "object" else f"{name} PNG"
        if len(got) < len(want) and want.startswith(got):
            return f"{what} cut short"
        if len(got) == len(want) and out[f"vs_{name}"]["bytes_differing"] <= 16:
            return f"{what} with bytes changed"
    return "mix or other"


def judge(got: bytes, entry: dict[str, Any], secret_px: str) -> tuple[str | None, str | None]:
    """Why ``got`` is not what ``entry``'s file may hold (None where it is one of its versions), and its pixels."""
    if MARKER in got:
        return "secret bytes", None
    try:
        px = pixels_of(got)
    except Exception as exc:  # the decoder refusing what was served: wrong bytes, not an I/O error
        return f"undecodable ({exc!r})", None
    if px == secret_px:
        return "secret pixels", px
    if px not in entry["px"]:
        return "pixels of neither version", px
    return None, px


def attacked_reader(spec: dict[str, Any], seconds: float, seed: int) -> None:
    """Read random files through the mount until ``seconds`` pass; print JSON lines: each wrong read at once,
    the running counts every second (so a reader that dies leaves its counts behind)."""
    rng = random.Random(seed)
    mount = Path(spec["mount"])
    files = spec["files"]
    deadline = time.monotonic() + seconds
    counts: dict[str, Any] = {"reads": 0, "ok": 0, "raw": 0, "alt": 0, "errors": {}, "wrong": 0}
    next_report = time.monotonic() + 1

    def emit(line: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    while time.monotonic() < deadline:
        entry = rng.choice(files)
        how = rng.choice(READ_WAYS)
        started = time.time()
        try:
            got = read_attacked(str(mount / entry["path"]), how, rng)
        except OSError as exc:
            if exc.errno in DISCONNECTED:
                emit({"t": "disconnected", "errno": exc.errno})
                break
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            if exc.errno not in ALLOWED_ERRNOS:
                name = f"unexpected {name}"
                emit({"t": "unexpected", "path": entry["path"], "how": how, "error": repr(exc), "at": started})
            counts["errors"][name] = counts["errors"].get(name, 0) + 1
            continue
        finally:
            if time.monotonic() >= next_report:
                emit(dict(counts, t="counts"))
                next_report = time.monotonic() + 1
        counts["reads"] += 1
        verdict, px = judge(got, entry, spec["secret_px"])
        if verdict is None:
            counts["alt"] += px == entry["px"][1]
            counts["ok"] += 1
            counts["raw"] += got[:2] == b"BM"
        else:
            counts["wrong"] += 1
            emit({"t": "wrong", "path": entry["path"], "how": how, "verdict": verdict, "started": started,
                  "ended": time.time(), "raw_in_catalog": entry["object"] is not None,
                  **explain(got, entry, spec["secret_px"])})
    emit(dict(counts, t="counts"))


class AttackedReaders:
    """``count`` reader processes; one that dies (a signal) is replaced for the time left and the death noted."""

    def __init__(self, spec_path: Path, count: int, seconds: float, seed: int,
                 env: dict[str, str] | None = None) -> None:
        self.spec_path = spec_path
        self.env = dict(os.environ, **env) if env else None
        self.deadline = time.monotonic() + seconds
        self.seed = seed
        self.lock = threading.Lock()
        self.finished: list[dict[str, Any]] = []  # last counts of every reader process that ended
        self.wrong: list[dict[str, Any]] = []
        self.unexpected: list[dict[str, Any]] = []
        self.deaths: list[int] = []
        self.disconnected = 0
        self.procs: dict[int, subprocess.Popen[str]] = {}  # the running process of each slot
        self.stopped = False  # no more reader processes (the mount is gone)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, slot: int) -> None:
        generation = 0
        while (left := self.deadline - time.monotonic()) > 0.5 and not self.stopped:
            proc = subprocess.Popen([sys.executable, __file__, "attacked-reader", str(self.spec_path), "--seconds",
                                     f"{left:.1f}", "--seed", str(self.seed + 1000 * generation + slot)],
                                    stdout=subprocess.PIPE, text=True, env=self.env)
            with self.lock:
                self.procs[slot] = proc
            last = None
            assert proc.stdout is not None
            for text in proc.stdout:
                line = json.loads(text)
                kind = line.pop("t")
                with self.lock:
                    if kind == "counts":
                        last = line
                    elif kind == "wrong":
                        self.wrong.append(line)
                    elif kind == "unexpected":
                        self.unexpected.append(line)
                    elif kind == "disconnected":
                        self.disconnected += 1
            proc.wait()
            with self.lock:
                if last is not None:
                    self.finished.append(last)
                if proc.returncode != 0:
                    self.deaths.append(proc.returncode)
            if self.disconnected or proc.returncode == 0:
                return
            generation += 1

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(max(0.1, self.deadline + timeout - time.monotonic()))
            if t.is_alive():
                raise RuntimeError(f"a reader still runs {timeout:.0f} s after the soak should have ended")

    def kill(self) -> None:
        """SIGKILL every reader still running (after a hang: the mount was aborted first, so none stays stuck)."""
        with self.lock:
            self.stopped = True
            procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    def summary(self) -> dict[str, Any]:
        errors: dict[str, int] = {}
        for r in self.finished:
            for name, n in r["errors"].items():
                errors[name] = errors.get(name, 0) + n
        total = {k: sum(r[k] for r in self.finished) for k in ("reads", "ok", "raw", "alt")}
        return {**total, "errors": dict(sorted(errors.items())), "wrong": len(self.wrong),
                "wrong_reads": self.wrong, "unexpected": self.unexpected, "reader_deaths": self.deaths,
                "disconnected": self.disconnected}


# -- the attacker process ------------------------------------------------------------------------------------


class Attacker:
    """Changes the source and the store under the mount at random, and puts each change back a moment later.

    Every attack on one image holds that image until it is undone; the source root is swapped by one attack at a
    time. Paths inside the source are reached through a descriptor of the real root taken at start, so they keep
    naming the real tree while its root is swapped for a link to the evil one. A directory flipped into the mount
    holds every image below it (no other attack may then walk through the link into the mount, where the
    attacker itself would hang with the daemon), and is flipped only while none of them is held.
    """

    def __init__(self, spec: dict[str, Any], seed: int, log_path: Path) -> None:
        self.spec = spec
        self.rng = random.Random(seed)
        self.source = spec["source"]
        self.root_fd = os.open(self.source, os.O_PATH | os.O_DIRECTORY)
        self.real = f"/proc/self/fd/{self.root_fd}"
        self.store = Path(spec["store"])
        self.stash = Path(spec["work"]) / "stash"
        self.log = open(log_path, "a")
        self.busy: set[int] = set()
        self.pending: list[tuple[float, str, Any]] = []  # (due, what, how to undo)
        self.prepare: subprocess.Popen[bytes] | None = None
        self.prepare_log = open(Path(spec["work"]) / "attacker-prepare.log", "ab")
        self.root_swapped = False
        self.enabled = [a for a in ATTACKS if a in spec.get("attacks", ATTACKS)]
        self.mount = spec.get("mount", "")
        self.dirs: list[str] = spec.get("dirs", [])
        #: the images below each directory of ``dirs`` (what a flip of it holds)
        self.members = [[i for i, f in enumerate(spec["files"]) if f["path"].startswith(d + "/")] for d in self.dirs]
        self.flipped: set[int] = set()
        self.counts = {name: 0 for name in self.enabled} | {"prepare_failed": 0, "prepare_hung": 0, "skipped": 0,
                                                              "failed": 0}

    def note(self, action: str, **what: Any) -> None:
        self.log.write(json.dumps({"at": time.time(), "action": action, **what}) + "\n")

    def run(self, seconds: float, stop: Callable[[], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + seconds
        actions = {"symlink": self.swap_symlink, "rewrite": self.rewrite, "flip": self.damage_object,
                   "truncate": self.damage_object, "prepare": self.run_prepare, "root": self.swap_root,
                   "dirflip": self.flip_dir, "fifo": self.swap_fifo}
        weights = [WEIGHTS[a] for a in self.enabled]
        try:
            while time.monotonic() < deadline and not stop():
                self.undo_due(time.monotonic())
                if self.prepare is not None and self.prepare.poll() is not None:
                    self.counts["prepare_failed"] += self.prepare.returncode != 0
                    self.note("prepare-done", rc=self.prepare.returncode)
                    self.prepare = None
                if not self.enabled:
                    time.sleep(0.1)
                    continue
                name = self.rng.choices(self.enabled, weights)[0]
                try:
                    actions[name](name)
                except OSError as exc:  # e.g. a path gone while the root is swapped: noted, not fatal
                    self.counts["failed"] += 1
                    self.note(f"{name}-failed", error=repr(exc))
                time.sleep(self.rng.uniform(0.01, 0.1))
        finally:
            self.undo_due(float("inf"))
            if self.prepare is not None:
                try:  # bounded: a prepare that walked into a link to the mount or a FIFO must not hold the soak
                    self.prepare.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.counts["prepare_hung"] += 1
                    self.note("prepare-hung")
                    self.prepare.kill()
                    self.prepare.wait()
                self.counts["prepare_failed"] += self.prepare.returncode != 0
            self.note("stopped")
            self.log.close()
        return self.counts

    def later(self, what: str, undo: Callable[[], None], index: int | list[int] | None = None) -> None:
        self.pending.append((time.monotonic() + self.rng.uniform(0.05, 1.5), what, (undo, index)))

    def undo_due(self, now: float) -> None:
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, what, (undo, index) in due:
            try:
                undo()
            except OSError as exc:  # left as it is: restore_source puts the source back after the run
                self.counts["failed"] += 1
                self.note(f"undo-{what}-failed", error=repr(exc))
            single = isinstance(index, int)
            self.note(f"undo-{what}", file=self.spec["files"][index]["path"] if single else None)
            for i in [index] if single else index or []:
                self.busy.discard(i)

    def pick(self, raw_only: bool = False) -> int | None:
        free = [i for i, f in enumerate(self.spec["files"])
                if i not in self.busy and (f["object"] is not None or not raw_only)]
        if not free:
            self.counts["skipped"] += 1
            return None
        index = self.rng.choice(free)
        self.busy.add(index)
        return index

    def real_path(self, index: int) -> str:
        return os.path.join(self.real, self.spec["files"][index]["path"])

    # 1. the image swapped for a link to a secret of its size and mtime, then the original renamed back
    def swap_symlink(self, name: str) -> None:
        index = self.pick()
        if index is None:
            return
        entry = self.spec["files"][index]
        path = self.real_path(index)
        folder = os.path.dirname(path)
        dir_st = os.stat(folder)
        n = sum(self.counts.values())
        link, kept = self.stash / f"link-{index}-{n}", self.stash / f"orig-{index}-{n}"
        try:
            os.symlink(entry["versions"]["secret"], link)
            os.link(path, kept)
            os.rename(link, path)
        except OSError:
            self.busy.discard(index)
            raise
        os.utime(folder, ns=(dir_st.st_atime_ns, dir_st.st_mtime_ns))  # the catalog would be reused as is

        def undo() -> None:
            os.rename(kept, path)
            os.utime(folder, ns=(dir_st.st_atime_ns, dir_st.st_mtime_ns))

        self.counts[name] += 1
        self.note(name, file=entry["path"])
        self.later(name, undo, index)

    # 2. the image rewritten in place with other pixels of its size, its mtime put back (cp -p); later the
    #    original put back the same way. Legitimate: readers may see either version, never a mix.
    #    (``write_in_place``: one write, no truncation, so no empty or short state in between.)
    def rewrite(self, name: str) -> None:
        index = self.pick()
        if index is None:
            return
        entry = self.spec["files"][index]
        path = self.real_path(index)
        write_in_place(path, Path(entry["versions"]["alt"]).read_bytes(), entry["mtime_ns"])
        self.counts[name] += 1
        self.note(name, file=entry["path"])
        self.later(name, lambda: write_in_place(path, Path(entry["versions"]["orig"]).read_bytes(),
                                                entry["mtime_ns"]), index)

    # 3. a raw object with one byte flipped, or truncated; later restored. As a store writer who is not the
    #    mount's user (the default): the damaged copy is a new file of that user's, renamed over the object (its
    #    directory is writable, its 0600 root-owned files are not). As root (``--object-writer root``): the
    #    object itself is damaged in place, which passthrough cannot see once a reader has it open.
    def damage_object(self, name: str) -> None:
        index = self.pick(raw_only=True)
        if index is None:
            return
        entry = self.spec["files"][index]
        path = self.store / entry["object"]
        good = Path(entry["object_copy"]).read_bytes()
        at = self.rng.randrange(len(good))
        if name == "flip":
            bad, detail = good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1:], {"offset": at}
        else:
            bad, detail = good[:at], {"length": at}
        try:
            st = os.stat(path)
            if self.spec.get("object_writer", "store-writer") == "root":
                write_in_place(str(path), bad, st.st_mtime_ns)  # same inode, cut where shorter
                restore = lambda: write_in_place(str(path), good, st.st_mtime_ns)  # noqa: E731
            else:
                replace_as(path, bad, st.st_mtime_ns, STORE_WRITER_UID)
                restore = lambda: replace_as(path, good, st.st_mtime_ns, STORE_WRITER_UID)  # noqa: E731
        except OSError as exc:
            self.busy.discard(index)
            self.note(f"{name}-skipped", file=entry["path"], error=repr(exc))
            return
        self.counts[name] += 1
        self.note(name, file=entry["path"], object=entry["object"], **detail)
        self.later(name, restore, index)

    # 4. prepare with another ratio on the store of the running mount
    def run_prepare(self, name: str) -> None:
        if self.prepare is not None:
            return
        ratio = self.rng.choice((0.0, 0.5, 1.0))
        self.prepare = subprocess.Popen(
            [sys.executable, "-m", "liquidfs", "prepare", self.source, "--store", str(self.store), "--ratio",
             str(ratio), "--no-progress", "--jobs", "1"], stdout=self.prepare_log, stderr=subprocess.STDOUT)
        self.counts[name] += 1
        self.note(name, ratio=ratio)

    # 5. the source root swapped for a link to the evil tree, and back
    def swap_root(self, name: str) -> None:
        if self.root_swapped:
            return
        stashed = self.source + ".real"
        os.rename(self.source, stashed)
        os.symlink(self.spec["evil"], self.source)
        self.root_swapped = True

        def undo() -> None:
            if os.path.islink(self.source):
                os.unlink(self.source)
            os.rename(stashed, self.source)
            self.root_swapped = False

        self.counts[name] += 1
        self.note(name)
        self.later(name, undo)


    # 6. a directory exchanged with a link into the mount itself (renameat2 RENAME_EXCHANGE: `mv d d0; ln -s
    #    MNT/nowhere d` with no moment in between), then exchanged back. The parent's mtime is put back.
    def flip_dir(self, name: str) -> None:
        free = [k for k in range(len(self.dirs))
                if k not in self.flipped and self.members[k] and not self.busy.intersection(self.members[k])]
        if not free:
            self.counts["skipped"] += 1
            return
        k = self.rng.choice(free)
        rel = self.dirs[k]
        target = self.rng.choice((os.path.join(self.mount, "nowhere"), self.mount, os.path.join(self.mount, rel)))
        link = str(self.stash / f"dflip-{k}")
        parent = os.path.dirname(os.path.join(self.real, rel))
        pst = os.stat(parent)
        os.symlink(target, link)
        try:
            exchange(rel, link, self.root_fd)
        except OSError:
            os.unlink(link)
            raise
        self.busy.update(self.members[k])
        self.flipped.add(k)
        os.utime(parent, ns=(pst.st_atime_ns, pst.st_mtime_ns))

        def undo() -> None:
            exchange(rel, link, self.root_fd)
            os.unlink(link)
            os.utime(parent, ns=(pst.st_atime_ns, pst.st_mtime_ns))
            self.flipped.discard(k)

        self.counts[name] += 1
        self.note(name, dir=rel, target=target)
        self.later(name, undo, list(self.members[k]))

    # 7. an image exchanged with a link to a FIFO (an open that follows it waits for a writer forever), and back
    def swap_fifo(self, name: str) -> None:
        index = self.pick()
        if index is None:
            return
        entry = self.spec["files"][index]
        rel = entry["path"]
        link = str(self.stash / f"fifo-{index}")
        folder = os.path.dirname(self.real_path(index))
        try:
            dst = os.stat(folder)
            os.symlink(self.spec["fifo"], link)
            try:
                exchange(rel, link, self.root_fd)
            except OSError:
                os.unlink(link)
                raise
        except OSError:
            self.busy.discard(index)
            raise
        os.utime(folder, ns=(dst.st_atime_ns, dst.st_mtime_ns))

        def undo() -> None:
            exchange(rel, link, self.root_fd)
            os.unlink(link)
            os.utime(folder, ns=(dst.st_atime_ns, dst.st_mtime_ns))

        self.counts[name] += 1
        self.note(name, file=rel)
        self.later(name, undo, index)


def write_in_place(path: str, data: bytes, mtime_ns: int) -> None:
    """Rewrite ``path`` in place (same inode) with one write of all of ``data``, then put its mtime back as
    ``cp -p`` does. Not truncated first, unlike cp: a file truncated and then written is empty or short for a
    moment, a state of the source that a mount may faithfully serve, and then neither version could be required."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
        os.ftruncate(fd, len(data))  # a no-op for a rewrite of the same size; undoes an attacker's truncation
    finally:
        os.close(fd)
    os.utime(path, ns=(mtime_ns, mtime_ns))


#: Who the store-writer attacker is: not the mount's user (``nobody``), so the objects prepare wrote are not its own.
STORE_WRITER_UID = 65534


def replace_as(path: Path, data: bytes, mtime_ns: int, uid: int) -> None:
    """Put ``data`` at ``path`` as a store writer ``uid`` can: a new file of its own, renamed over the old one."""
    tmp = path.with_name(f".{path.name}.attack-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
        os.fchown(fd, uid, uid)
    finally:
        os.close(fd)
    os.utime(tmp, ns=(mtime_ns, mtime_ns))
    os.rename(tmp, path)


def run_attacker(spec_path: Path, seconds: float, seed: int) -> int:
    spec = json.loads(spec_path.read_text())
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    attacker = Attacker(spec, seed, Path(spec["work"]) / f"attacker-{spec['tag']}.jsonl")
    print(json.dumps(attacker.run(seconds, lambda: bool(stopping))))
    return 0


def run_as_nobody(attack: Callable[[Callable[[], bool]], dict[str, Any]]) -> int:
    """``attack(stop)`` as nobody (privileges dropped here, for good), its account printed as JSON; SIGTERM stops
    it early."""
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    neighbours.drop_to_nobody()
    print(json.dumps(attack(lambda: bool(stopping))))
    return 0


def run_job_hopper(spec_path: Path, mount_fd: int, job: str, seconds: float, seed: int) -> int:
    """The job hopper (``neighbours.job_hopper``) as nobody, each read judged as a reader's is."""
    import PIL.PngImagePlugin  # noqa: F401  (loaded as root: the decoder must not depend on nobody's access)

    spec = json.loads(spec_path.read_text())
    files = {f["path"]: f for f in spec["files"]}
    pixels_of(Path(files[next(iter(files))]["versions"]["orig"]).read_bytes())  # every import the check needs

    def check(rel: str, data: bytes) -> str | None:
        return judge(data, files[rel], spec["secret_px"])[0]

    return run_as_nobody(lambda stop: neighbours.job_hopper(mount_fd, sorted(files), job, seconds, seed, check,
                                                            stop))


# -- links flipped atomically, and the way out of a hung mount ------------------------------------------------

AT_FDCWD = -100
RENAME_EXCHANGE = 2
#: renameat2's number, for a libc without its wrapper (glibc < 2.28)
SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}


def exchange(a: str, b: str, a_dir: int = AT_FDCWD, b_dir: int = AT_FDCWD) -> None:
    """Swap two names at once: renameat2(RENAME_EXCHANGE), so whoever looks finds one or the other, never neither
    (a dataset owner can do this, without root). Where the filesystem cannot, three renames (not atomic)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_int(a_dir), os.fsencode(a), ctypes.c_int(b_dir), os.fsencode(b), ctypes.c_uint(RENAME_EXCHANGE))
    number = SYS_RENAMEAT2.get(os.uname().machine)
    rc = libc.syscall(ctypes.c_long(number), *args) if number else libc.renameat2(*args)
    if rc == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err), f"{a} <-> {b}")
    pa, pb = (name if d == AT_FDCWD or os.path.isabs(name) else f"/proc/self/fd/{d}/{name}"
              for d, name in ((a_dir, a), (b_dir, b)))
    tmp = f"{pb}.exchange-{os.getpid()}"
    os.rename(pb, tmp)
    os.rename(pa, pb)
    os.rename(tmp, pa)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def threads_of(pid: int) -> dict[str, str]:
    """``{tid: "name: where it waits in the kernel"}`` of every thread of ``pid`` (wchan; 0 for running)."""
    out: dict[str, str] = {}
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return out
    for tid in tids:
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text().strip()
        except OSError:
            continue
        out[tid] = f"{comm}: {wchan}"
    return out


def abort_mount(mountpoint: str, daemon_pid: int | None = None) -> dict[str, Any]:
    """Get the machine out of a hung mount without touching it: abort its FUSE connection (every waiting request
    fails with ENOTCONN, the daemon's own stuck one included), detach it (fusermount3 -u -z), then make sure the
    daemon is gone (SIGTERM, then SIGKILL). What was done, step by step."""
    done: dict[str, Any] = {"connection": fuse_connection(mountpoint)}
    if done["connection"] is not None:
        try:
            with open(f"/sys/fs/fuse/connections/{done['connection']}/abort", "w") as f:
                f.write("1")
            done["aborted"] = True
        except OSError as exc:  # no fusectl: killing the daemon below closes the connection too
            done["aborted"] = repr(exc)
        tool = [bench.FUSERMOUNT, "-u", "-z"] if shutil.which(bench.FUSERMOUNT) else ["umount", "-l"]
        try:
            done["detach_rc"] = subprocess.run([*tool, mountpoint], capture_output=True, timeout=20).returncode
        except subprocess.TimeoutExpired:
            done["detach_rc"] = "timed out"
    if daemon_pid:
        for sig, wait in ((None, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if sig is not None and pid_alive(daemon_pid):
                os.kill(daemon_pid, sig)
                done["daemon_signalled"] = sig.name
            deadline = time.monotonic() + wait
            while pid_alive(daemon_pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not pid_alive(daemon_pid):
                break
        done["daemon_alive"] = pid_alive(daemon_pid)
    if fuse_connection(mountpoint) is not None:  # the lazy detach failed: one more try, after the daemon is gone
        subprocess.run(["umount", "-l", mountpoint], capture_output=True, timeout=20)
    done["still_mounted"] = is_mounted(mountpoint)
    return done


#: The watchdog's question, in a child process (a thread stuck in a hung mount could not be given up on):
#: `ls MNT`, then the control file `liquidfs stats` reads; each step named on stderr before it starts.
PROBE = """
import json, os, sys, time
mnt, control = sys.argv[1], sys.argv[2]
took = {}
for step in ("ls", "stats"):
    sys.stderr.write(step + "\\n"); sys.stderr.flush()
    t = time.monotonic()
    if step == "ls":
        os.listdir(mnt)
    else:
        with open(os.path.join(mnt, control), "rb") as f:
            json.loads(f.read())
    took[step] = time.monotonic() - t
print(json.dumps(took))
"""


class MountGuard:
    """One mount under attack: its daemon, and whether (and why) it had to be aborted. ``abort`` is idempotent."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = str(mountpoint)
        self.daemon_pid: int | None = None
        self.lock = threading.Lock()
        self.hangs: list[dict[str, Any]] = []
        self.cleanup: dict[str, Any] | None = None
        #: called once the mount is aborted (the readers stopped: past the abort they would only count ENOENT)
        self.after_abort: list[Callable[[], None]] = []

    @property
    def aborted(self) -> bool:
        return self.cleanup is not None

    def hang(self, what: str, **details: Any) -> None:
        """Record a hang and get out of it: the daemon's threads as they wait, then the mount aborted."""
        record = {"what": what, "at": time.time(), **details}
        if self.daemon_pid:
            record["daemon_threads"] = threads_of(self.daemon_pid)
        with self.lock:
            self.hangs.append(record)
            if self.cleanup is None:
                t = time.monotonic()
                self.cleanup = abort_mount(self.mountpoint, self.daemon_pid)
                self.cleanup["took_s"] = round(time.monotonic() - t, 1)
                record["cleanup"] = self.cleanup
                for then in self.after_abort:
                    then()
        print(f"HANG on {self.mountpoint}: {what}; aborted: {json.dumps(self.cleanup)}", flush=True)


class Watchdog:
    """Every ``interval`` s, a child process asks the mount `ls` and its stats; no answer within ``deadline`` s is
    a hang (``MountGuard.hang``: recorded, the mount aborted, so the child and everyone else get ENOTCONN)."""

    def __init__(self, guard: MountGuard, control: str, deadline: float, interval: float = 1.0) -> None:
        self.guard = guard
        self.control = control
        self.deadline = deadline
        self.interval = interval
        self.probes = 0
        self.slowest: dict[str, float] = {"ls": 0.0, "stats": 0.0}
        self.failures: list[str] = []  # answers that were errors (not hangs)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def start(self) -> Watchdog:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(self.deadline + 30)

    def _run(self) -> None:
        while not self.stopping.is_set() and not self.guard.aborted:
            self.probe()
            self.stopping.wait(self.interval)

    def probe(self) -> None:
        proc = subprocess.Popen([sys.executable, "-S", "-c", PROBE, self.guard.mountpoint, self.control],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=self.deadline)
        except subprocess.TimeoutExpired:
            details: dict[str, Any] = {"after_s": round(time.monotonic() - self.started, 1)}
            self.guard.hang(f"`ls` and stats got no answer within {self.deadline:g} s", **details)
            try:
                out, err = proc.communicate(timeout=10)  # the abort answered it ENOTCONN
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            steps = [line for line in err.splitlines() if line in ("ls", "stats")]
            details["stuck_in"] = steps[-1] if steps else "?"
            self.guard.hangs[-1].update(details)
            return
        self.probes += 1
        if proc.returncode != 0:
            if not self.stopping.is_set():
                self.failures.append(err.strip().splitlines()[-1] if err.strip() else f"rc {proc.returncode}")
            return
        for step, took in json.loads(out).items():
            self.slowest[step] = max(self.slowest[step], round(took, 3))

    def summary(self) -> dict[str, Any]:
        return {"probes": self.probes, "slowest_s": self.slowest, "failures": self.failures,
                "deadline_s": self.deadline}


def put_back(real: str, stashed: str) -> bool:
    """``stashed`` holds what ``real`` was before it was exchanged with a link: exchange them back and drop the
    link. True when something had to be put back."""
    if not os.path.lexists(stashed):
        return False
    if os.path.islink(stashed):  # the exchange was undone, only the link is left
        os.unlink(stashed)
        return False
    if os.path.lexists(real):
        exchange(real, stashed)
        os.unlink(stashed)
    else:  # the non-atomic fallback stopped midway
        os.rename(stashed, real)
    return True


def restore_flips(source: Path, fixture: dict[str, Any], stash: Path) -> list[str]:
    """Directories and files still exchanged with links (``Attacker.flip_dir``/``swap_fifo``, ``FifoFlipper``),
    put back, directories first, outermost first, so no path walked here goes through a link into the mount."""
    fixed = []
    flips = []
    for name in os.listdir(stash):
        m = re.fullmatch(r"(dflip|pdir|fifo|pfifo)-(\d+)", name)
        if m is None:
            continue
        k = int(m.group(2))
        rel = fixture["dirs"][k] if m.group(1) in ("dflip", "pdir") else fixture["files"][k]["path"]
        flips.append((m.group(1) not in ("dflip", "pdir"), rel.count("/"), rel, name))
    for _, _, rel, name in sorted(flips):
        if put_back(str(source / rel), str(stash / name)):
            fixed.append(rel)
    return fixed


def restore_source(source: Path, fixture: dict[str, Any], stash: Path | None = None) -> list[str]:
    """Put back whatever the attacker left changed (nothing, when it undid everything); what was put back."""
    fixed = []
    if source.is_symlink() or not source.exists():
        if source.is_symlink():
            source.unlink()
        os.rename(str(source) + ".real", source)
        fixed.append("source root")
    if stash is not None:
        fixed += restore_flips(source, fixture, stash)
    for entry in fixture["files"]:
        path = source / entry["path"]
        want = Path(entry["versions"]["orig"]).read_bytes()
        if path.is_symlink() or not path.is_file() or path.read_bytes() != want:
            if path.is_symlink():
                path.unlink()
            if path.exists():
                write_in_place(str(path), want, entry["mtime_ns"])
            else:
                path.write_bytes(want)
                os.utime(path, ns=(entry["mtime_ns"], entry["mtime_ns"]))
            fixed.append(entry["path"])
    return fixed


def final_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """Every file read once more after the attacker stopped and undid its changes: all must be right now."""
    out: dict[str, Any] = {"ok": 0, "errors": {}, "wrong": []}
    for entry in spec["files"]:
        try:
            with open(Path(spec["mount"]) / entry["path"], "rb") as f:
                got = f.read()
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            out["errors"][name] = out["errors"].get(name, 0) + 1
            continue
        try:
            good = pixels_of(got) == entry["px"][0]
        except Exception:
            good = False
        if good:
            out["ok"] += 1
        else:
            out["wrong"].append(entry["path"])
    return out


#: How long after the end the readers may still be reading (one read may take the mount's --io-timeout, 60 s).
READER_GRACE = 75
DAEMON_KEYS = ("opens", "opens_raw", "errors", "fallbacks", "open_files", "passthrough_opens", "backing_object",
               "backing_source", "backing_memfd")


def attack_one_path(work: Path, source: Path, fixture: dict[str, Any], data_path: str, args: argparse.Namespace,
                    seed: int) -> dict[str, Any]:
    """A fresh store at ``args.ratio``, one mount with ``data_path``, readers, the attacker and the watchdog for
    ``args.seconds``; then everything undone, a last pass over every file, the mount's counters. A hang is
    recorded and got out of (``MountGuard``); the mount is never left behind, hung or not. With attacks of
    ``neighbours``, the memcached writer, the lying peer and the job hopper around it too (``Neighbours``)."""
    from liquidfs.prepare import prepare

    store = work / f"store-{data_path}"
    shutil.rmtree(store, ignore_errors=True)
    prepare(source, store, args.ratio, progress=False)
    mountpoint = work / f"mnt-{data_path}"
    mountpoint.mkdir(exist_ok=True)
    spec = with_objects(fixture, store, work, data_path)
    near = neighbours.Neighbours(args.attacks, work, data_path, __file__, seed, keyed=args.cluster_key == "file",
                                 store=store)
    spec.update(mount=str(mountpoint), source=str(source), store=str(store), work=str(work), tag=data_path,
                evil=str(work / "evil"), object_writer=args.object_writer, attacks=args.attacks)
    spec_path = work / f"spec-{data_path}.json"
    spec_path.write_text(json.dumps(spec))
    cache = ["--cache-size", args.cache_size] if args.cache_size not in ("", "0", "none") else []
    with near:
        return attack_mounted(spec, spec_path, fixture, near, [*cache, *near.mount_flags()], args, seed)


def attack_mounted(spec: dict[str, Any], spec_path: Path, fixture: dict[str, Any], near: neighbours.Neighbours,
                   flags: list[str], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """``attack_one_path`` from the mount on (``flags``: what the mount adds for the cache and ``near``)."""
    from liquidfs.catalog.nodes import CONTROL_NAME

    work, source, mountpoint, data_path = Path(spec["work"]), Path(spec["source"]), Path(spec["mount"]), spec["tag"]
    bench.liquidfs("mount", str(source), str(mountpoint), "--store", spec["store"], "--data-path", data_path,
                   "--log-level", "info", "--log-file", str(work / f"mount-{data_path}.log"), *flags,
                   *args.mount_option, timeout=300)
    guard = MountGuard(mountpoint)
    watchdog = Watchdog(guard, os.fsdecode(CONTROL_NAME), args.deadline)
    summary: dict[str, Any] = {}
    started = time.monotonic()
    try:
        control = read_control(mountpoint)
        guard.daemon_pid = int(control["pid"])  # type: ignore[call-overload]
        if control["data_path"] != data_path:
            raise RuntimeError(f"asked for --data-path {data_path}, the mount serves through {control['data_path']}")
        watchdog.start()
        readers = AttackedReaders(spec_path, args.readers, args.seconds, seed, env=near.reader_env())
        near.start(mountpoint, spec_path, args.seconds, guard.daemon_pid, lambda: read_control(mountpoint))
        guard.after_abort.append(readers.kill)
        attacker = subprocess.Popen([sys.executable, __file__, "attacker", str(spec_path), "--seconds",
                                     str(args.seconds), "--seed", str(seed)], stdout=subprocess.PIPE, text=True)
        try:
            try:
                readers.join(timeout=READER_GRACE)
            except RuntimeError as exc:  # readers stuck while `ls` and stats answered: a hang all the same
                guard.hang(str(exc), after_s=round(time.monotonic() - started, 1))
                readers.kill()
                readers.join(timeout=30)
        finally:
            # it stops by itself after --seconds (a prepare it started may run on a little): its counts
            attacks = neighbours.account(attacker, stop_now=guard.aborted) \
                or {"attacker_failed": attacker.returncode}
        put_back = restore_source(source, fixture, work / "stash")
        summary = readers.summary()
        summary.update(data_path=data_path, object_writer=args.object_writer, cache_size=args.cache_size,
                       mount_options=args.mount_option, attacks=attacks, put_back_after=put_back)
        summary["final"] = final_pass(spec) if not guard.aborted else {}
        if guard.aborted:  # before it or while it ran: what it read says nothing of the mount
            summary["final"] = {"ok": 0, "errors": {}, "wrong": [], "skipped": "the mount was aborted"}
        summary["daemon"] = None
        summary["neighbours"] = near.finish(guard.aborted)
        if not guard.aborted:
            try:
                stats = read_control(mountpoint)
                summary["daemon"] = {k: stats.get(k) for k in DAEMON_KEYS} | {
                    k: v for k, v in stats.items() if ("hit" in k or k.startswith("cluster_"))
                    and isinstance(v, (int, float))}
            except OSError as exc:  # the watchdog aborted it meanwhile
                summary["daemon"] = {"unreadable": repr(exc)}
    finally:
        if watchdog.thread.is_alive():
            watchdog.stop()
        if not guard.aborted:
            try:
                bench.liquidfs("umount", str(mountpoint), timeout=60)
            except bench.CommandFailed:
                pass  # still mounted is a hang, below
            except subprocess.TimeoutExpired:
                guard.hang("`liquidfs umount` did not return within 60 s")
        if is_mounted(str(mountpoint)):  # whatever happened above: no mount is left behind
            if guard.aborted:
                abort_mount(str(mountpoint), guard.daemon_pid)
            else:
                guard.hang("still mounted after `liquidfs umount`")
        restore_source(source, fixture, work / "stash")  # (when an exception cut the run short)
    summary["hangs"] = guard.hangs
    summary["watchdog"] = watchdog.summary()
    summary["seconds_taken"] = round(time.monotonic() - started, 1)
    summary["attack_log"] = str(work / f"attacker-{data_path}.jsonl")
    attach_nearby_attacks(summary, Path(summary["attack_log"]))
    return summary


# -- links to FIFOs during `liquidfs profile` -----------------------------------------------------------------


class FifoFlipper(neighbours.Background):
    """A dataset owner against ``liquidfs profile``: once ``ready()`` (the profile has read its sample and times
    reads of it), again and again, about half the images exchanged with links to a FIFO (or a whole directory with
    a link to a tree of FIFOs of the same names), held 0.05-0.4 s, and exchanged back. A read that follows one
    waits for a FIFO writer that never comes."""

    def __init__(self, source: Path, fixture: dict[str, Any], work: Path, seed: int,
                 ready: Callable[[], bool] = lambda: True) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.ready = ready
        self.created = time.monotonic()
        self.files = [f["path"] for f in fixture["files"]]
        self.dirs: list[str] = fixture["dirs"]
        self.fifo = fixture["fifo"]
        self.stash = work / "stash"
        self.tree = work / "fifo-tree"  # every image's name, as a FIFO
        for rel in self.files:
            (self.tree / rel).parent.mkdir(parents=True, exist_ok=True)
            if not (self.tree / rel).exists():
                os.mkfifo(self.tree / rel)
        self.root_fd = os.open(source, os.O_PATH | os.O_DIRECTORY)
        self.counts: dict[str, Any] = {"file_swaps": 0, "dir_swaps": 0, "rounds": 0, "failed": 0, "started_at_s": None}

    def _swap(self, rel: str, link: Path, target: str) -> bool:
        if not os.path.lexists(link):
            os.symlink(target, link)
        try:
            exchange(rel, str(link), self.root_fd)
            return True
        except OSError:
            self.counts["failed"] += 1
            return False

    def _run(self) -> None:
        try:
            while not self.ready():
                if self.stopping.wait(0.005):
                    return
            self.counts["started_at_s"] = round(time.monotonic() - self.created, 2)
            while not self.stopping.is_set():
                swapped: list[tuple[str, Path]] = []
                if self.rng.random() < 0.25 and self.dirs:  # a whole directory, its images all FIFOs
                    k = self.rng.randrange(len(self.dirs))
                    rel, link = self.dirs[k], self.stash / f"pdir-{k}"
                    if self._swap(rel, link, str(self.tree / self.dirs[k])):
                        swapped.append((rel, link))
                        self.counts["dir_swaps"] += 1
                else:
                    for i in self.rng.sample(range(len(self.files)), max(1, len(self.files) // 2)):
                        rel, link = self.files[i], self.stash / f"pfifo-{i}"
                        if self._swap(rel, link, self.fifo):
                            swapped.append((rel, link))
                            self.counts["file_swaps"] += 1
                self.stopping.wait(self.rng.uniform(0.05, 0.4))
                for rel, link in swapped:
                    exchange(rel, str(link), self.root_fd)
                    os.unlink(link)
                self.counts["rounds"] += 1
                self.stopping.wait(self.rng.uniform(0.0, 0.1))
        finally:
            os.close(self.root_fd)


def profile_attacked(work: Path, source: Path, fixture: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``liquidfs profile --quick`` on the source while ``FifoFlipper`` swaps images for links to FIFOs: it must
    finish, or fail with a message, within ``args.profile_deadline`` seconds; else a hang (its threads' wchan
    noted, then killed)."""
    store = work / "store-profile"
    log_path = work / "profile.log"
    cmd = [sys.executable, "-m", "liquidfs", "profile", str(source), "--store", str(store), "--quick",
           "--decoder", "pil", "--sample", str(min(8, len(fixture["files"]))), "--json", str(work / "profile.json")]
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "deadline_s": args.profile_deadline, "hung": False}
    started = time.monotonic()
    def timing_reads() -> bool:  # "right after root read it": the sample is read, its reads are being timed
        return b"measuring storage" in log_path.read_bytes()

    with open(log_path, "wb") as log, FifoFlipper(source, fixture, work, seed=7, ready=timing_reads) as flipper:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out["rc"] = proc.wait(timeout=args.profile_deadline)
        except subprocess.TimeoutExpired:
            out["hung"] = True
            out["threads"] = threads_of(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            out["rc"] = proc.wait(30)
            print(f"HANG: liquidfs profile still running after {args.profile_deadline:g} s; its threads: "
                  f"{json.dumps(out['threads'])}; killed", flush=True)
    out["seconds"] = round(time.monotonic() - started, 1)
    out["attacks"] = flipper.counts
    out["put_back_after"] = restore_source(source, fixture, work / "stash")
    text = log_path.read_text(errors="replace").strip().splitlines()
    out["last_lines"] = text[-3:]
    # Finished: rc 0 with a chosen ratio, or a failure that says why (a last line), never silence.
    out["outcome"] = ("hung" if out["hung"] else "finished" if out["rc"] == 0
                      else f"failed (rc {out['rc']}): {text[-1] if text else 'NO MESSAGE'}")
    return out


def attach_nearby_attacks(summary: dict[str, Any], log_path: Path) -> None:
    """Next to each wrong read, what the attacker did to that file (or the store, or the root) around it."""
    events = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
    for wrong in summary["wrong_reads"]:
        wrong["attacks_around"] = [
            e for e in events
            if wrong["started"] - 3 <= e["at"] <= wrong["ended"] + 0.5
            and (e.get("file") in (None, wrong["path"])) and e["action"] != "stopped"][-12:]


def table(rows: list[dict[str, Any]], attacks: list[str]) -> str:
    names = [a for a in ATTACKS if a in attacks]
    lines = ["| data path | reads | ok | served raw | alt version seen | allowed errors (by errno) | wrong | hangs | "
             f"attacks: {' / '.join(names)} | final pass ok / wrong / errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        errs = ", ".join(f"{k} {v:,}" for k, v in r["errors"].items()) or "0"
        a = r["attacks"]
        done = " / ".join(str(a.get(k, "?")) for k in names)
        final = r["final"]
        label = " ".join([r["data_path"], *r.get("mount_options", [])])
        if r.get("cache_size"):
            label += f" --cache-size {r['cache_size']}"
        label += f" (objects damaged by {r.get('object_writer', 'root')})"
        lines.append(f"| {label} | {r['reads']:,} | {r['ok']:,} | {r['raw']:,} | {r['alt']:,} | {errs} | "
                     f"**{r['wrong']}** | **{len(r['hangs'])}** | {done} | {final['ok']} / {len(final['wrong'])} / "
                     f"{sum(final['errors'].values())} |")
    return "\n".join(lines)


def writer_table(rows: list[dict[str, Any]], profile: dict[str, Any] | None) -> str:
    """The dataset-writer attacks of issue 26 at a glance: wrong bytes and hangs (both must be 0)."""
    lines = ["| run | wrong bytes | hangs | errors by errno | attacks performed | watchdog: probes, slowest ls / stats "
             "| took |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        errs = ", ".join(f"{k} {v:,}" for k, v in r["errors"].items()) or "0"
        done = ", ".join(f"{k} {v}" for k, v in r["attacks"].items() if v) or "none"
        w = r["watchdog"]
        hang = "; ".join(f"{h['what']} (at {h.get('after_s', '?')} s, stuck in {h.get('stuck_in', '?')})"
                         for h in r["hangs"])
        lines.append(f"| reads, {r['data_path']} --cache-size {r.get('cache_size') or 'none'} | **{r['wrong']}** | "
                     f"**{len(r['hangs'])}**{': ' + hang if hang else ''} | {errs} | {done} | {w['probes']}, "
                     f"{w['slowest_s']['ls']:.2f} / {w['slowest_s']['stats']:.2f} s"
                     f"{', ' + str(len(w['failures'])) + ' failed' if w['failures'] else ''} | "
                     f"{r['seconds_taken']:.0f} s |")
    if profile is not None:
        a = profile["attacks"]
        lines.append(f"| liquidfs profile --quick | - | **{int(profile['hung'])}** | - | {a['file_swaps']} image and "
                     f"{a['dir_swaps']} directory swaps for FIFO links, {a['rounds']} rounds, from "
                     f"{a['started_at_s']} s | "
                     f"{profile['outcome']} | {profile['seconds']:.0f} s |")
    return "\n".join(lines)


def neighbour_table(rows: list[dict[str, Any]]) -> str:
    """The node's other users at a glance (issue 38): what each did, what the mount counted of it."""
    lines = ["| run | wrong bytes | hangs | errors | memcached writer (as uid): rewrites flip / swap / truncate / "
             "garbage; fetched after / replaced after | mount: cluster hits / rejected / unanswered / skipped / "
             "stored | lying peer: calls; lies | job hopper (as uid): jobs, cat reads / errors / wrong; readers' job "
             "id, epochs, reads | daemon RSS after mount / at end, peak rise |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = r["neighbours"]
        d = r["daemon"] or {}
        errs = ", ".join(f"{k} {v:,}" for k, v in r["errors"].items()) or "0"
        w = n.get("cluster-writer")
        writer = "-" if w is None else (
            f"(uid {w.get('uid')}) {w.get('rewrites', 0)}: {' / '.join(str(w.get(t, 0)) for t in neighbours.TAMPERS)}"
            f"; {w.get('fetched_after', 0)} / {w.get('replaced_after', 0)}")
        cluster = "-" if "cluster_hits" not in d else (
            " / ".join(f"{d.get('cluster_' + k, 0):,}" for k in ("hits", "rejected", "unanswered", "skipped",
                                                                   "stored"))
            + (" (sealed)" if n.get("sealed") else " (no key)"))
        liar = n.get("lying-peer")
        lies = "-" if liar is None else (f"{liar['gets'] + liar['sets'] + liar['other']}; "
                                         + ", ".join(f"{k} {liar[k]}" for k in neighbours.LIES if liar[k]))
        h, job = n.get("job-hopper"), n.get("readers_job")
        hopper = "-" if h is None or job is None else (
            f"(uid {h.get('uid')}) {h.get('jobs', 0)}, {h.get('read', 0)} / {h.get('errors', 0)} / "
            f"{len(h.get('wrong', []))}; {job['readers_job_ids']}, {job['epochs']}, {job['reads']}"
            f"{'' if job['unmoved'] else ' **MOVED**'}")
        memory = n.get("daemon_memory")
        rss = "-" if not memory else (f"{(memory['after_mount']['rss_kib'] or 0) / 1024:.0f} / "
                                      f"{(memory['at_end']['rss_kib'] or 0) / 1024:.0f} MiB, "
                                      f"+{(neighbours.peak_rise_kib(n) or 0) / 1024:.0f} MiB")
        wrong = r["wrong"] + len((h or {}).get("wrong", []))
        lines.append(f"| {r['data_path']} --cache-size {r.get('cache_size') or 'none'} | **{wrong}** | "
                     f"**{len(r['hangs'])}** | {errs} | {writer} | {cluster} | {lies} | {hopper} | {rss} |")
    return "\n".join(lines)


def soak_attacked(args: argparse.Namespace, data_paths: list[str]) -> int:
    width, height = (int(v) for v in args.size.split("x"))
    rows: list[dict[str, Any]] = []
    profile = None
    reading = [a for a in args.attacks if a in ATTACKS or a in neighbours.NEIGHBOURS]
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp).resolve()
        source = make_sample(work / "data", count=args.count, width=width, height=height, seed=11)
        fixture = build_fixture(work, source)
        for n, data_path in enumerate(data_paths if reading else []):
            rows.append(attack_one_path(work, source, fixture, data_path, args, seed=100 * n))
            print(f"{data_path}: {rows[-1]['reads']:,} reads, {rows[-1]['wrong']} wrong, "
                  f"{len(rows[-1]['hangs'])} hangs", flush=True)
        if "profile" in args.attacks:
            profile = profile_attacked(work, source, fixture, args)
            print(f"profile: {profile['outcome']} in {profile['seconds']:.0f} s", flush=True)
        left = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
                if line.split()[1].startswith(str(work))]
        if left:  # never reached: each run unmounts its own, hung or not
            for mnt in left:
                abort_mount(mnt)
            print(f"mounts left behind, aborted: {left}")
    if rows:
        print(table(rows, reading))
    if rows or profile:
        print(writer_table(rows, profile))
    if any(r["neighbours"]["attacks"] for r in rows):
        print(neighbour_table(rows))
    for r in rows:
        kinds: dict[str, int] = {}
        for w in r["wrong_reads"]:
            key = f"{w['kind']} ({w['how']})"
            kinds[key] = kinds.get(key, 0) + 1
        if kinds:
            print(f"  wrong on {r['data_path']}, by kind (read way): "
                  + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    for r in rows:
        for w in r["wrong_reads"][:10]:
            print(f"  WRONG {r['data_path']}: {json.dumps(w)}")
        for u in r["unexpected"][:10]:
            print(f"  UNEXPECTED ERROR {r['data_path']}: {json.dumps(u)}")
        for h in r["hangs"]:
            print(f"  HANG {r['data_path']}: {json.dumps(h)}")
        if r["watchdog"]["failures"]:
            print(f"  WATCHDOG {r['data_path']}: `ls` or stats failed: {r['watchdog']['failures'][:5]}")
        for problem in neighbours.problems(r["neighbours"]):
            print(f"  NEIGHBOURS {r['data_path']}: {problem}")
        daemon = r["daemon"] or {}
        if r["reader_deaths"] or r["disconnected"] or r["put_back_after"] or r["final"]["wrong"] \
                or r["final"]["errors"] or daemon.get("open_files"):
            print(f"  {r['data_path']}: reader deaths {r['reader_deaths']}, disconnected {r['disconnected']}, put "
                  f"back after the attacker {r['put_back_after']}, final pass {r['final']}, daemon {r['daemon']}")
    if profile is not None:
        print(f"  profile: {json.dumps(profile)}")
    wrong = sum(r["wrong"] + len(r["final"]["wrong"]) + len(r["neighbours"].get("job-hopper", {}).get("wrong", []))
                for r in rows)
    hangs = sum(len(r["hangs"]) for r in rows) + int(bool(profile and profile["hung"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args), "rows": rows, "profile": profile, "wrong": wrong,
                                         "hangs": hangs}, indent=1, default=str))  # the paths among the args
    failed = wrong or hangs or any(r["unexpected"] or r["disconnected"] or r["watchdog"]["failures"]
                                   or neighbours.problems(r["neighbours"]) for r in rows)
    print(f"wrong bytes: {wrong} (must be 0), hangs: {hangs} (must be 0)")
    print("soak with attacker FAILED" if failed else "soak with attacker passed: 0 wrong reads, no hang")
    return 1 if failed else 0


# -- the whole soak ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", help=argparse.SUPPRESS)  # what the soak starts, not for users
    r = sub.add_parser("reader")
    r.add_argument("mountpoint")
    r.add_argument("manifest")
    for name in ("attacked-reader", "attacker"):
        a = sub.add_parser(name)
        a.add_argument("spec")
    sub.add_parser("cluster-writer").add_argument("port", type=int)
    h = sub.add_parser("job-hopper")
    h.add_argument("spec")
    h.add_argument("--mount-fd", type=int, required=True)
    h.add_argument("--job", required=True)
    for p in sub.choices.values():
        p.add_argument("--seconds", type=float, required=True)
        p.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="how long the readers read, per data path (default 60)")
    parser.add_argument("--readers", type=int, default=16, help="reader processes (default 16)")
    parser.add_argument("--attacker", action="store_true",
                        help="run the attacker beside the readers (default off: readers only, one killed -9)")
    parser.add_argument("--attacks", "--attack", metavar="LIST",
                        help="the attacker's attacks, comma-separated (implies --attacker; default all): "
                             f"{', '.join(ALL_ATTACKS)}. dirflip, fifo and profile are the dataset writer's; "
                             "cluster-writer, lying-peer and job-hopper the node's other users' (issue 38)")
    parser.add_argument("--cache-size",
                        help="with the attacker: the mounts' --cache-size, so the next-epoch cache holds files and "
                             "their re-opens check the source (default 100%%, or 10%% with cluster-writer or "
                             "lying-peer, so most opens miss the memory and ask the cluster; 'none': no cache)")
    parser.add_argument("--cluster-key", choices=("file", "none"), default="file",
                        help="cluster-writer and lying-peer: the mounts seal the cluster's values under a "
                             "--cluster-key-file made for the run (file, the default), or store them in the clear, "
                             "checked by digest alone (none)")
    parser.add_argument("--deadline", type=float, default=10.0,
                        help="with the attacker: seconds `ls MNT` and the mount's stats may take before the "
                             "watchdog calls it a hang and aborts the mount (default 10)")
    parser.add_argument("--profile-deadline", type=float, default=120.0,
                        help="the profile attack: seconds `liquidfs profile --quick` may take (default 120)")
    parser.add_argument("--data-path", choices=("both", "passthrough", "daemon", "auto"), default="both",
                        help="mount --data-path of each run; both: one run with passthrough, then one with the "
                             "daemon path (default both)")
    parser.add_argument("--count", type=int, default=200, help="images in the sample (default 200)")
    parser.add_argument("--size", default="256x128", help="image size WxH (default 256x128)")
    parser.add_argument("--ratio", type=float, default=0.5, help="share served raw (default 0.5)")
    bench.add_run_arguments(parser, results="not written: printed only; with --attacker every wrong read is "
                            "explained in it")
    parser.add_argument("--work", type=Path, metavar="DIR",
                        help="where the run's temporary work directory (sample, stores, mountpoints) is made and "
                        "removed after (default: the system's temporary directory)")
    parser.add_argument("--object-writer", choices=("store-writer", "root"), default="store-writer",
                        help="who damages raw objects: a store writer who is not the mount's user and replaces "
                             "them (default), or root writing root's own objects in place (what passthrough "
                             "cannot check once a reader has the file open; see docs/how-it-works.md, Data paths)")
    parser.add_argument("--mount-option", action="append", default=[], metavar="ARG",
                        help="one more argument for `liquidfs mount` (repeat it: --mount-option=--verify-reads)")
    args = parser.parse_args(argv)
    if args.command == "reader":
        manifest = json.loads(Path(args.manifest).read_text())
        print(json.dumps(reader(Path(args.mountpoint), manifest, args.seconds, args.seed)))
        return 0
    if args.command == "attacked-reader":
        attacked_reader(json.loads(Path(args.spec).read_text()), args.seconds, args.seed)
        return 0
    if args.command == "attacker":
        return run_attacker(Path(args.spec), args.seconds, args.seed)
    if args.command == "cluster-writer":
        return run_as_nobody(lambda stop: neighbours.cluster_writer(args.port, args.seconds, args.seed, stop))
    if args.command == "job-hopper":
        return run_job_hopper(Path(args.spec), args.mount_fd, args.job, args.seconds, args.seed)
    data_paths = ["passthrough", "daemon"] if args.data_path == "both" else [args.data_path]
    if args.attacks is not None:
        args.attacker = True
        args.attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
        unknown = sorted(set(args.attacks) - set(ALL_ATTACKS))
        if unknown or not args.attacks:
            parser.error(f"--attacks: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(ALL_ATTACKS)}")
    else:
        args.attacks = list(ALL_ATTACKS)
    if args.cache_size is None:
        cluster = {"cluster-writer", "lying-peer"} & set(args.attacks)
        args.cache_size = "10%" if cluster else "100%"
    if args.attacker:
        return soak_attacked(args, data_paths)
    return 0 if all(soak_plain(args, data_path) for data_path in data_paths) else 1


def soak_plain(args: argparse.Namespace, data_path: str) -> bool:
    from liquidfs.prepare import prepare

    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        source = make_sample(work / "data", count=args.count, width=width, height=height, seed=11, jpeg_share=0.25)
        store = work / "store"
        prepare(source, store, args.ratio, progress=False)
        manifest_path = work / "manifest.json"
        manifest_path.write_text(json.dumps(build_manifest(store)))
        mounted = bench.mount(source, store, work / "mnt", "--data-path", data_path, *args.mount_option)
        try:
            summary = soak(mounted.mnt, manifest_path, args.readers, args.seconds)
            stats = read_control(mounted.mnt)
            summary["daemon"] = {k: stats[k] for k in ("opens", "opens_raw", "errors", "fallbacks", "open_files",
                                                       "data_path")}
        finally:
            mounted.close(check=False)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("mismatches", "errors")}, indent=1))
    for line in summary["mismatches"][:20] + summary["errors"][:20]:
        print("  " + line)
    ok = not summary["mismatches"] and not summary["errors"] and not summary["disconnected"] \
        and summary["daemon"]["errors"] == 0
    print(f"soak ({data_path}) passed" if ok else f"soak ({data_path}) FAILED")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
    return ok


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    raise SystemExit(main())
