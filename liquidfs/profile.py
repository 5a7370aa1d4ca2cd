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

import concurrent.futures as cf
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import asdict, dataclass, field

from .stores import Store, open_store
from .timedreads import ProfileError

__all__ = ["Costs", "Profile", "ProfileError", "choose_for_target", "model_choice", "paper_search", "profile_store",
           "render", "run_profile", "to_json"]

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



# -- measuring decode -----------------------------------------------------------------------------------


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

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, prefetch_queue_depth=1)  # type: ignore[untyped-decorator]
    def pipe() -> Any:
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
    target_rate: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def run_profile(source: str | os.PathLike[str], store: str | os.PathLike[str], **options: object) -> Profile:
    """``profile_store`` of ``open_store(source, store)``."""
    return profile_store(open_store(source, store), **options)  # type: ignore[arg-type]


def profile_store(store: Store, *, decoder: str | None = None, threads: int | None = None, cache_share: float = 0.0,
                  sample: int | None = None, quick: bool = False, target_rate: float | None = None,
                  seconds: float | None = None, progress: Callable[[str], None] = lambda s: None) -> Profile:
    started = time.monotonic()
    threads = threads or os.cpu_count() or 1
    decoder = decoder or ("dali" if dali_available() else "pil")
    step = seconds if seconds is not None else (0.6 if quick else 2.5)
    count = sample or (8 if quick else 24)
    progress("expanding a sample")
    smp = store.profile_sample(count, jobs=4)
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
                   search_steps=steps, chosen=chosen, chosen_by=chosen_by, target_rate=target_rate,
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

    def x(r: float) -> float:
        return left + r * (right - left)

    def y(v: float) -> float:
        return bottom - min(v, ymax) / ymax * (bottom - top)

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

