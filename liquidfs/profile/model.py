"""The profile's cost model and the published search: a pipeline's pace at each share of raw images, from the
per-image costs measured of each representation (``Costs``), the share where it is fastest (``model_choice``),
the binary search over the 11 mixes (``paper_search``), and which stage holds a node (``node_kind``).

Every stage's time per image is linear in the raw share ``r``: storage ``L(r)``, the CPU ``D(r)`` and, where a
raw format is decoded on a GPU, the GPU ``G(r)``; the pipeline runs at ``1 / max`` of them (``choose`` says what
each measures).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..expand.rawformats import BMP

#: What the node is, at BMP's best share: the stage that holds it there.
STORAGE_BINDS, DECODE_BINDS, GPU_BUSY = "storage binds", "decode binds", "GPU has no time to spare"


@dataclass
class Costs:
    """What was measured, per image of each representation."""

    images: int
    original_bytes: float      # mean size
    raw_bytes: float
    load_original: float       # bytes/s of storage, whole files, random order, page cache bypassed
    load_raw: float
    decode_original: float     # images/s with the user's decoder and threads
    decode_raw: float          # on the CPU; with gpu_decode_raw: what the host pays per GPU-decoded image
    read_cpu_per_byte: float   # CPU seconds that reading a byte costs (kernel + copy), on the same cores
    threads: int
    decoder: str
    cache_share: float = 0.0
    raw_format: str = BMP.name
    gpu_decode_raw: float | None = None  # images/s of the raw format on the GPU (J2K), None: decoded on the CPU
    readers: int = 4           # readers at once in the storage measurements (the loader's)
    gpu_train: float = 0.0     # GPU seconds training takes per image (1 / --gpu-train-rate); 0: not counted

    def load_time(self, r: float) -> float:
        """Seconds of storage time per image at raw share ``r``, after the cache's share."""
        per = (1 - r) * self.original_bytes / self.load_original + r * self.raw_bytes / self.load_raw
        return (1 - self.cache_share) * per

    def cpu_time(self, r: float) -> float:
        """Wall seconds of CPU work per image (decode, plus the CPU that loading costs, spread on the threads)."""
        decode = (1 - r) / self.decode_original + r / self.decode_raw
        read = ((1 - r) * self.original_bytes + r * self.raw_bytes) * self.read_cpu_per_byte / self.threads
        return decode + read

    def gpu_time(self, r: float) -> float:
        """Seconds of the GPU per image: training's, and the decoder's for the share decoded there."""
        return self.gpu_train + (r / self.gpu_decode_raw if self.gpu_decode_raw else 0.0)

    def stage_times(self, r: float) -> dict[str, float]:
        """Per-image seconds of each stage the pipeline overlaps: the slowest sets the pace."""
        times = {"storage": self.load_time(r), "CPU": self.cpu_time(r)}
        if self.gpu_decode_raw or self.gpu_train:
            times["GPU"] = self.gpu_time(r)
        return times

    def throughput(self, r: float) -> float:
        return 1 / max(self.stage_times(r).values())


def model_choice(costs: Costs) -> tuple[float, str]:
    """The best share and which stage binds there. Every stage's time per image is linear in ``r``, so the
    pace, their maximum, is piecewise linear and convex: its minimum lies at an end or where two stages cross."""
    ends = {name: (t0, costs.stage_times(1)[name]) for name, t0 in costs.stage_times(0).items()}
    candidates = {0.0, 1.0}
    for a, (a0, a1) in ends.items():
        for b, (b0, b1) in ends.items():
            if a < b and (a1 - a0) != (b1 - b0):
                r = (b0 - a0) / ((a1 - a0) - (b1 - b0))  # where a0 + (a1-a0) r = b0 + (b1-b0) r
                if 0 < r < 1:
                    candidates.add(r)
    # The fastest; among equals the smaller share (less disk for the same rate).
    best = min(candidates, key=lambda r: (max(costs.stage_times(r).values()), r))
    times = costs.stage_times(best)
    pace = max(times.values())
    binding = sorted((name for name, t in times.items() if t >= pace * (1 - 1e-9)),
                     key=lambda name: ends[name][1] - ends[name][0])  # falling first: it binds below the point
    if best == 0.0:
        return 0.0, f"{binding[-1]}-bound even with every image original: serve originals (ratio 0)"
    if best == 1.0:
        return 1.0, f"{binding[0]}-bound even with every image raw: serve all raw (ratio 1)"
    below, above = binding[0], binding[-1]
    return best, f"{above} and {below} balance at {best:.2f} ({below}-bound below it, {above}-bound above)"


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


def model_or_search(costs: Costs, search_r: float) -> tuple[float, str]:
    """The model's share or the search's, whichever the model predicts faster, and why."""
    model_r, _ = model_choice(costs)
    model_r = round(model_r, 2)
    if costs.throughput(model_r) >= costs.throughput(search_r):
        return model_r, ("model: it uses every measurement and is not limited to the 11 mixes; "
                         f"predicted {costs.throughput(model_r):.1f} img/s vs "
                         f"{costs.throughput(search_r):.1f} at the search's {search_r:.1f}")
    return search_r, ("search: its measured mix beats the model's prediction "
                      f"({costs.throughput(search_r):.1f} vs {costs.throughput(model_r):.1f} img/s)")


def node_kind(bmp: Costs) -> tuple[str, str]:
    """Which kind of node this is, from the costs of originals and BMPs at the model's best share of BMPs, and
    its stages' rates there: ``GPU_BUSY`` where training alone holds the pace (no GPU time for decoding),
    ``STORAGE_BINDS`` where storage does (smaller raw objects would help), else ``DECODE_BINDS``."""
    r, _ = model_choice(bmp)
    times = bmp.stage_times(r)
    pace = max(times.values())
    rates = ", ".join(f"{name} {per_second(t):.1f}" for name, t in times.items())
    detail = f"at BMP's best share {r:.2f}, img/s: {rates}"
    if bmp.gpu_train:
        spare = max(0.0, 1 - bmp.gpu_train / pace)
        detail += f" (GPU: training alone); the GPU has {spare:.0%} of its time to spare there"
        if bmp.gpu_train >= pace * (1 - 1e-9):
            return GPU_BUSY, detail
    else:
        detail += "; training's GPU time not given (--gpu-train-rate)"
    return (STORAGE_BINDS if times["storage"] >= pace * (1 - 1e-9) else DECODE_BINDS), detail


def per_second(seconds_per_image: float) -> float:
    """Images per second at ``seconds_per_image`` (a stage that takes no time: unbounded)."""
    return 1 / seconds_per_image if seconds_per_image else math.inf
