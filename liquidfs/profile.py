"""``liquidfs profile``: measure this machine and choose the share of images to serve raw.

Two estimates of the best mix, both from measurements on a sample of the real dataset (only the sample is
expanded, into a scratch directory inside the store, on the store's device):

* **model**: per-image costs measured per representation (bytes/s of storage for whole-file random reads with the
  page cache bypassed, decode images/s with the user's decoder and thread count, and the CPU that reading costs)
  give, for a raw share ``r``, load time ``L(r)`` and CPU time ``D(r)`` per image, both linear in ``r``. The
  pipeline runs at ``1 / max(L, D)``: the best ``r`` is where the two lines cross (closed form), or an end.
* **search**: the published method: a binary search over the 11 mixes 0:10 ... 10:0 that measures load and
  decode throughput of a sample mixed at the midpoint and discards the half on the side of the slower stage.

The cache (``--cache-size``) serves a constant share of every epoch from memory, so only ``1 - c`` of the bytes
reach storage: the load line is scaled by it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import math
import mmap
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from pathlib import Path

from . import formats
from .catalog import Catalog, open_or_build
from .locks import unique
from .prepare import IMAGE_SUFFIXES
from .reader import open_below, open_dir, same_file
from .s3 import is_url

log = logging.getLogger(__name__)

RATIOS = [i / 10 for i in range(11)]


@dataclass
class Costs:
    """What was measured, per image of each representation."""

    images: int
    original_bytes: float      # mean size
    raw_bytes: float
    load_original: float       # bytes/s of storage, whole files, random order, page cache bypassed
    load_raw: float
    decode_original: float     # images/s with the user's decoder and threads
    decode_raw: float
    read_cpu_per_byte: float   # CPU seconds that reading a byte costs (kernel + copy), on the same cores
    threads: int
    decoder: str
    cache_share: float = 0.0

    def load_time(self, r: float) -> float:
        """Seconds of storage time per image at raw share ``r``, after the cache's share."""
        per = (1 - r) * self.original_bytes / self.load_original + r * self.raw_bytes / self.load_raw
        return (1 - self.cache_share) * per

    def cpu_time(self, r: float) -> float:
        """Wall seconds of CPU work per image (decode, plus the CPU that loading costs, spread on the threads)."""
        decode = (1 - r) / self.decode_original + r / self.decode_raw
        read = ((1 - r) * self.original_bytes + r * self.raw_bytes) * self.read_cpu_per_byte / self.threads
        return decode + read

    def throughput(self, r: float) -> float:
        return 1 / max(self.load_time(r), self.cpu_time(r))


def model_choice(costs: Costs) -> tuple[float, str]:
    """The closed-form best share, and which resource binds there."""
    l0, l1 = costs.load_time(0), costs.load_time(1)
    d0, d1 = costs.cpu_time(0), costs.cpu_time(1)
    # L grows with r (raw images are larger) and D shrinks (they decode for almost nothing).
    if l0 >= d0:
        return 0.0, "storage-bound even with every image original: serve originals (ratio 0)"
    if d1 >= l1:
        return 1.0, "CPU-bound even with every image raw: serve all raw (ratio 1)"
    # L(r) and D(r) are linear: they cross where (l1-l0 - d1+d0) r = d0 - l0
    r = (d0 - l0) / ((l1 - l0) - (d1 - d0))
    r = min(1.0, max(0.0, r))
    return r, f"load and decode balance at {r:.2f} (CPU-bound below it, storage-bound above)"


def paper_search(measure: Callable[[float], tuple[float, float]]) -> tuple[float, list[dict[str, float]]]:
    """Binary search over the 11 mixes; ``measure(r)`` gives (load images/s, decode images/s) at share r."""
    lo, hi = 0, 10
    steps = []
    best = (0.0, -1.0)
    while lo <= hi:
        mid = (lo + hi) // 2
        r = mid / 10
        load, decode = measure(r)
        steps.append({"ratio": r, "load_images_per_s": load, "decode_images_per_s": decode})
        rate = min(load, decode)
        if rate > best[1]:
            best = (r, rate)
        if load < decode:      # storage is the slower stage: fewer raw images
            hi = mid - 1
        elif decode < load:    # decoding is the slower stage: more raw images
            lo = mid + 1
        else:
            break
    return best[0], steps


def choose_for_target(costs: Costs, target: float) -> float | None:
    """The smallest share (in steps of 0.01) whose predicted rate reaches ``target`` images/s."""
    for i in range(101):
        if costs.throughput(i / 100) >= target:
            return i / 100
    return None


# -- measuring ------------------------------------------------------------------------------------------


@dataclass
class Sample:
    originals: list[Any]  # what ``load`` reads: local paths, or (bucket, key) of objects
    raws: list[Any]
    scratch: Path
    load: Callable[[Sequence[Any], float], tuple[float, float]] = field(default=lambda items, s: measure_load(items, s))
    cleanup: Callable[[], None] = lambda: None
    original_data: list[bytes] = field(default_factory=list)
    raw_data: list[bytes] = field(default_factory=list)


def make_sample(catalog: Catalog, store: Path, count: int, seed: int = 0) -> Sample:
    """Pick ``count`` images at random and expand them into a ``store/profile-sample-*`` directory of this run's own."""
    root = catalog.source
    nodes = [n for n in catalog.files() if n.name.lower().endswith(tuple(s.encode() for s in IMAGE_SUFFIXES))]
    if not nodes:
        raise SystemExit("profile: no PNG/JPEG images in the source")
    rng = random.Random(seed)
    rng.shuffle(nodes)
    # A directory of this run's own: profiles run at once on one store (a Job's pods) must not share or delete
    # each other's sample.
    store.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="profile-sample-", dir=store))
    originals: list[Path] = []
    raws: list[Path] = []
    original_data: list[bytes] = []
    raw_data: list[bytes] = []
    root_fd = open_dir(root)
    try:
        for node in nodes:
            if len(raws) >= count:
                break
            try:  # read as the mount reads: below the root, no link followed, the file the catalog recorded
                fd = open_below(root_fd, node.path, root)
                try:
                    if not same_file(node, os.fstat(fd)):
                        continue
                    with open(fd, "rb", closefd=False) as f:
                        data = f.read()
                finally:
                    os.close(fd)
            except OSError as exc:
                log.warning("profile: skipping %r: %s", node.path, exc)
                continue
            result = formats.expand(data)
            if result.data is None:
                continue
            out = scratch / f"{node.id}.bmp"
            out.write_bytes(result.data)
            # Timed where the mount will read it.  The timing reads discard what they read, so a path swapped
            # for a link since cannot carry anyone's bytes anywhere.
            originals.append(Path(os.fsdecode(os.path.join(root, node.path))))
            raws.append(out)
            original_data.append(data)
            raw_data.append(result.data)
    finally:
        os.close(root_fd)
    if not raws:
        shutil.rmtree(scratch, ignore_errors=True)
        raise SystemExit("profile: none of the sampled images can be expanded losslessly")
    return Sample(originals, raws, scratch, cleanup=lambda: shutil.rmtree(scratch, ignore_errors=True),
                  original_data=original_data, raw_data=raw_data)


def make_bucket_sample(source: str, store: str, count: int, jobs: int, seed: int = 0) -> Sample:
    """The sample of an s3:// dataset: ``count`` random images, expanded and put under STORE/profile-sample-<unique>/
    (deleted after), so storage is measured as the mount will read it: whole-object GETs, ``jobs`` at once."""
    from .s3 import get, list_objects, make_client, put, work_dir
    from .s3store import bucket_pair, delete_keys

    src, dst = bucket_pair(source, store)
    client = make_client(jobs + 2)
    keys = [o.key for o in list_objects(client, src) if o.key.lower().endswith(IMAGE_SUFFIXES)]
    if not keys:
        raise SystemExit("profile: no PNG/JPEG images in the source")
    random.Random(seed).shuffle(keys)
    sample = Sample([], [], work_dir(dst, client),
                    load=lambda items, seconds: measure_get(client, items, seconds, jobs))
    written: list[str] = []
    prefix = unique("profile-sample-")  # profiles run at once on one store (a Job's pods) keep apart

    def cleanup() -> None:
        delete_keys(client, dst.bucket, written)

    sample.cleanup = cleanup
    for key in keys:
        if len(sample.raws) >= count:
            break
        data = get(client, src.bucket, key)
        result = formats.expand(data)
        if result.data is None:
            continue
        raw_key = dst.key(f"{prefix}/{len(written)}.bmp")
        put(client, dst.bucket, raw_key, result.data)
        written.append(raw_key)
        sample.originals.append((src.bucket, key))
        sample.raws.append((dst.bucket, raw_key))
        sample.original_data.append(data)
        sample.raw_data.append(result.data)
    if not sample.raws:
        cleanup()
        raise SystemExit("profile: none of the sampled images can be expanded losslessly")
    return sample


def _read_direct(path: Path, buf: mmap.mmap) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            n = len(os.pread(fd, 1 << 30, 0))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return n
        finally:
            os.close(fd)
    try:
        total = 0
        while True:
            got = os.preadv(fd, [memoryview(buf)], total)
            total += got
            if got < len(buf):
                return total
    finally:
        os.close(fd)


def measure_load(paths: Sequence[Path], seconds: float, jobs: int = 4) -> tuple[float, float]:
    """(bytes/s, CPU seconds per byte) of whole-file reads in random order with the page cache bypassed."""
    local = threading.local()

    def read_one(path: Path) -> int:
        # one aligned buffer per thread, allocated once: faulting in fresh pages per file would be measured
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return _read_direct(path, buf)

    return _timed_reads(read_one, paths, seconds, jobs)


def measure_get(client: Any, objects: Sequence[tuple[str, str]], seconds: float, jobs: int) -> tuple[float, float]:
    """(bytes/s, CPU seconds per byte) of whole-object GETs in random order, ``jobs`` in flight."""
    from .s3 import get

    return _timed_reads(lambda obj: len(get(client, *obj)), objects, seconds, jobs)


def _timed_reads(read_one: Callable[[Any], int], items: Sequence[Any], seconds: float,
                 jobs: int) -> tuple[float, float]:
    """Read every item (``read_one`` returns its bytes), ``jobs`` at a time in a fresh random order per round,
    rounds repeated for ``seconds`` (at least one): (bytes/s, this process's CPU seconds per byte)."""
    rng = random.Random(1)
    order = list(items)
    deadline = time.monotonic() + seconds
    total = 0
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()

    def worker(share: list[Any]) -> int:
        done = 0
        for item in share:
            done += read_one(item)
            if time.monotonic() > deadline:
                break
        return done

    with cf.ThreadPoolExecutor(jobs) as pool:
        while time.monotonic() < deadline or total == 0:
            rng.shuffle(order)
            total += sum(pool.map(worker, [order[i::jobs] for i in range(jobs)]))
    elapsed = time.monotonic() - started
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return total / elapsed, cpu / max(1, total)


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def measure_decode(encoded: Sequence[bytes], decoder: str, threads: int, seconds: float) -> float:
    """Images/s of ``decoder`` on ``threads`` threads over the encoded images, cycled for ``seconds``."""
    if decoder == "dali":
        return _decode_dali(encoded, threads, seconds)
    return _decode_pil(encoded, threads, seconds)


def _decode_pil(encoded: Sequence[bytes], threads: int, seconds: float) -> float:
    import io

    from PIL import Image

    def one(data: bytes) -> None:
        with Image.open(io.BytesIO(data)) as im:
            im.load()

    done = 0
    started = time.monotonic()
    with cf.ThreadPoolExecutor(threads) as pool:
        while time.monotonic() - started < seconds or done == 0:
            list(pool.map(one, encoded))
            done += len(encoded)
    return done / (time.monotonic() - started)


def _decode_dali(encoded: Sequence[bytes], threads: int, seconds: float) -> float:
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    batch = max(2, min(len(encoded), 2 * threads))
    arrays = [np.frombuffer(e, dtype=np.uint8) for e in encoded]
    state = {"i": 0}

    def source() -> list[np.ndarray]:
        out = [arrays[(state["i"] + k) % len(arrays)] for k in range(batch)]
        state["i"] += batch
        return out

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, prefetch_queue_depth=1)
    def pipe():
        data = fn.external_source(source=source, dtype=types.UINT8)
        return fn.decoders.image(data, device="cpu")

    p = pipe()
    p.build()
    p.run()  # warm-up: allocations and thread start
    done = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds or done == 0:
        p.run()
        done += batch
    return done / (time.monotonic() - started)


@dataclass
class Profile:
    costs: Costs
    table: list[dict[str, float]]
    model_ratio: float
    model_reason: str
    search_ratio: float
    search_steps: list[dict[str, float]]
    chosen: float
    chosen_by: str
    verdict: str
    target_rate: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def run_profile(source: str | os.PathLike[str], store: str | os.PathLike[str], *, decoder: str | None = None,
                threads: int | None = None, cache_share: float = 0.0, sample: int | None = None,
                quick: bool = False, target_rate: float | None = None, seconds: float | None = None,
                progress: Callable[[str], None] = lambda s: None) -> Profile:
    started = time.monotonic()
    threads = threads or os.cpu_count() or 1
    decoder = decoder or ("dali" if dali_available() else "pil")
    step = seconds if seconds is not None else (0.6 if quick else 2.5)
    count = sample or (8 if quick else 24)
    progress("expanding a sample")
    if is_url(str(source)):
        smp = make_bucket_sample(str(source), str(store), count, jobs=4)
    else:
        store_dir = Path(store).absolute()
        open_or_build(source, store_dir).close()
        catalog = Catalog.open(store_dir, readonly=True)
        try:
            smp = make_sample(catalog, store_dir, count)
        finally:
            catalog.close()
    try:
        originals = smp.original_data
        raws = smp.raw_data
        progress("measuring storage")
        load_o, cpu_o = smp.load(smp.originals, step)
        load_r, cpu_r = smp.load(smp.raws, step)
        progress(f"measuring {decoder} decoding on {threads} threads")
        dec_o = measure_decode(originals, decoder, threads, step)
        dec_r = measure_decode(raws, decoder, threads, step)
        costs = Costs(
            images=len(raws), original_bytes=statistics.fmean(map(len, originals)),
            raw_bytes=statistics.fmean(map(len, raws)), load_original=load_o, load_raw=load_r,
            decode_original=dec_o, decode_raw=dec_r,
            read_cpu_per_byte=(cpu_o + cpu_r) / 2, threads=threads, decoder=decoder, cache_share=cache_share,
        )
        model_r, reason = model_choice(costs)

        def measure_mix(r: float) -> tuple[float, float]:
            k = round(r * len(raws))
            paths = smp.raws[:k] + smp.originals[k:]
            data = raws[:k] + originals[k:]
            bps, _ = smp.load(paths, step / 2)
            mean = statistics.fmean(map(len, data))
            load_rate = bps / mean / max(1e-9, 1 - cache_share)
            return load_rate, measure_decode(data, decoder, threads, step / 2)

        progress("binary search over the 11 mixes")
        search_r, steps = paper_search(measure_mix)
    finally:
        smp.cleanup()
    table = [{"ratio": r, "load_images_per_s": 1 / costs.load_time(r) if costs.load_time(r) else math.inf,
              "decode_images_per_s": 1 / costs.cpu_time(r), "predicted_images_per_s": costs.throughput(r)}
             for r in RATIOS]
    model_r = round(model_r, 2)
    if costs.throughput(model_r) >= costs.throughput(search_r):
        chosen, chosen_by = model_r, ("model: it uses every measurement and is not limited to the 11 mixes; "
                                      f"predicted {costs.throughput(model_r):.1f} img/s vs "
                                      f"{costs.throughput(search_r):.1f} at the search's {search_r:.1f}")
    else:
        chosen, chosen_by = search_r, ("search: its measured mix beats the model's prediction "
                                       f"({costs.throughput(search_r):.1f} vs {costs.throughput(model_r):.1f} img/s)")
    notes = []
    if target_rate is not None:
        smallest = choose_for_target(costs, target_rate)
        if smallest is None:
            notes.append(f"no mix reaches {target_rate:g} img/s (best predicted "
                         f"{max(t['predicted_images_per_s'] for t in table):.1f}); keeping {chosen:.2f}")
        else:
            chosen, chosen_by = smallest, f"smallest raw share predicted to reach {target_rate:g} img/s"
    return Profile(costs=costs, table=table, model_ratio=model_r, model_reason=reason, search_ratio=search_r,
                   search_steps=steps, chosen=chosen, chosen_by=chosen_by, verdict=reason, target_rate=target_rate,
                   seconds=time.monotonic() - started, notes=notes)


# -- output ---------------------------------------------------------------------------------------------


def render(profile: Profile) -> str:
    c = profile.costs
    lines = [
        f"sample: {c.images} images, original {c.original_bytes / 1e6:.2f} MB, raw {c.raw_bytes / 1e6:.2f} MB; "
        f"decoder {c.decoder} x{c.threads} threads; cache share {c.cache_share:.0%}",
        f"storage: originals {c.load_original / 1e6:.0f} MB/s, raw {c.load_raw / 1e6:.0f} MB/s "
        f"(page cache bypassed); decode: originals {c.decode_original:.1f} img/s, raw {c.decode_raw:.1f} img/s",
        "",
        "ratio  load img/s  decode img/s  predicted img/s",
    ]
    for row in profile.table:
        mark = "  <- chosen" if abs(row["ratio"] - profile.chosen) < 0.05 else ""
        lines.append(f"{row['ratio']:5.1f}  {row['load_images_per_s']:10.1f}  {row['decode_images_per_s']:12.1f}"
                     f"  {row['predicted_images_per_s']:15.1f}{mark}")
    lines += [
        "",
        "binary search (measured): " + ", ".join(
            f"{s['ratio']:.1f}: load {s['load_images_per_s']:.0f} / decode {s['decode_images_per_s']:.0f}"
            for s in profile.search_steps) + f" -> {profile.search_ratio:.1f}",
        f"model: {profile.model_ratio:.2f} ({profile.model_reason})",
        f"chosen ratio {profile.chosen:.2f} by the {profile.chosen_by}",
        *profile.notes,
        f"({profile.seconds:.1f} s)",
    ]
    return "\n".join(lines)


def to_json(profile: Profile) -> dict[str, object]:
    out = asdict(profile)
    out["costs"] = asdict(profile.costs)
    return out


def plot(profile: Profile, path: str | os.PathLike[str], width: int = 720, height: int = 420) -> None:
    """A PNG of the load and decode curves (images/s against raw share) with the chosen point."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    left, right, top, bottom = 60, width - 20, 30, height - 50
    ymax = max(max(r["load_images_per_s"], r["decode_images_per_s"]) for r in profile.table
               if math.isfinite(r["load_images_per_s"])) * 1.1
    x = lambda r: left + r * (right - left)  # noqa: E731
    y = lambda v: bottom - min(v, ymax) / ymax * (bottom - top)  # noqa: E731
    draw.rectangle((left, top, right, bottom), outline="black")
    for i in range(11):
        draw.line((x(i / 10), bottom, x(i / 10), bottom + 5), fill="black")
        draw.text((x(i / 10) - 8, bottom + 8), f"{i / 10:.1f}", fill="black")
    for k in range(5):
        v = ymax * k / 4
        draw.text((5, y(v) - 6), f"{v:.0f}", fill="black")
    for key, colour in (("load_images_per_s", "blue"), ("decode_images_per_s", "red"),
                        ("predicted_images_per_s", "green")):
        pts = [(x(r["ratio"]), y(r[key])) for r in profile.table]
        draw.line(pts, fill=colour, width=3 if key == "predicted_images_per_s" else 2)
    cx, cy = x(profile.chosen), y(profile.costs.throughput(profile.chosen))
    draw.ellipse((cx - 6, cy - 6, cx + 6, cy + 6), outline="black", width=3)
    draw.text((left + 5, 5), "images/s vs raw share: load (blue), decode (red), predicted (green), chosen (o)",
              fill="black")
    draw.text((left + (right - left) // 2 - 40, height - 22), "raw share", fill="black")
    img.save(path, format="PNG")


def auto_ratio(source: str, store: str, *, quick: bool = False) -> float:
    """``prepare --ratio auto``: profile, and keep the result in a local store (``mount --mix adaptive`` starts
    at its choice)."""
    profile = run_profile(source, store, quick=quick,
                          progress=lambda s: print(f"profile: {s}", file=sys.stderr))
    print(render(profile))
    if not is_url(store):
        from .mix import PROFILE_NAME

        kept = Path(store) / PROFILE_NAME
        try:
            kept.write_text(json.dumps(to_json(profile), indent=1))
        except OSError as exc:
            print(f"profile: cannot keep the result in {kept}: {exc.strerror}", file=sys.stderr)
    return profile.chosen


def add_arguments(sub: argparse._SubParsersAction, add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "profile", help="measure this machine and choose the share of images to serve raw",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source")
    p.add_argument("--store", required=True, help="the store (the sample is expanded on its device)")
    p.add_argument("--decoder", choices=["dali", "pil"], help="the loader's decoder (default: dali if installed)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="decoder threads (default: all cores)")
    p.add_argument("--cache-size", default="0%", help="the mount's --cache-size, as a percentage (default 0%%)")
    p.add_argument("--sample", type=int, help="images in the sample (default 24, --quick 8)")
    p.add_argument("--quick", action="store_true", help="a smaller sample and shorter measurements (< 30 s)")
    p.add_argument("--target-rate", type=float, metavar="IMG_PER_S",
                   help="choose the smallest raw share that reaches this rate (saves disk space)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot of the curves")
    add_common(p)
    p.set_defaults(func=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    text = args.cache_size.strip()
    if not text.endswith("%"):
        print("liquidfs profile: --cache-size takes a percentage here (e.g. 30%)", file=sys.stderr)
        return 2
    share = float(text[:-1]) / 100
    profile = run_profile(args.source, args.store, decoder=args.decoder, threads=args.threads,
                          cache_share=min(1.0, share), sample=args.sample, quick=args.quick,
                          target_rate=args.target_rate,
                          progress=lambda s: print(f"profile: {s}", file=sys.stderr))
    print(render(profile))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(profile), indent=1))
    if args.plot:
        plot(profile, args.plot)
    return 0
