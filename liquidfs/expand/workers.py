"""How much memory this process may still use, and how many prepare workers fit in it.

The memory is the smaller of the host's MemAvailable and what this process's memory cgroup (v1 or v2, at every
level from its own up to the top one that can be seen) still allows. A cgroup's usage counts page cache too,
which the kernel reclaims before it kills anything: its inactive file pages are left out, as the kubelet does
for a pod's working set. The parsers take the files' text, so tests feed them any machine's.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from ..sysio.cgroups import CGROUP_ROOT, levels, parse_cgroup_paths, read_text, usable_cores
from .rawformats import DEFAULT_FORMATS, MAX_PIXELS, RAW_FORMATS

log = logging.getLogger(__name__)

# One expansion's peak bytes: SOURCE_COPIES times the source's size, and per pixel its raw format's own
# figure (``rawformats.RawFormat.bytes_per_pixel``: a J2K encode takes three times a BMP's).

#: The source is read into a buffer and copied into bytes (measured: 2.0 x the size of a 200 MB non-image).
SOURCE_COPIES: Final = 2
#: A worker process before its first image: ~37 MB RSS measured after importing prepare, Pillow and NumPy.
WORKER_BASE_BYTES: Final = 64 << 20
#: cgroup v1 says "no limit" with 2**63 - 1 rounded down to a page (9223372036854771712); no real limit is this
#: large.
UNLIMITED: Final = 1 << 60

# -- parsers: the text of one file in, a number out -------------------------------------------------------


def parse_limit(text: str) -> int | None:
    """memory.max (v2) or memory.limit_in_bytes (v1): bytes, or None for no limit ("max", or a huge v1 value)."""
    text = text.strip()
    if text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def parse_stat(text: str, key: str) -> int:
    """One counter of memory.stat (``inactive_file`` in v2, ``total_inactive_file`` in v1); 0 when absent."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def parse_meminfo(text: str) -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where the kernel does not give it (before 3.14)."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            value, *unit = rest.split()
            return int(value) * (1024 if unit == ["kB"] else 1)
    return None


def headroom(limit_text: str, usage_text: str, stat_text: str = "", inactive_key: str = "inactive_file") -> int | None:
    """Bytes a cgroup still allows: its limit less its usage without inactive page cache; None for no limit."""
    limit = parse_limit(limit_text)
    if limit is None:
        return None
    used = int(usage_text.strip()) - parse_stat(stat_text, inactive_key)
    return max(0, limit - max(0, used))


# -- this machine ---------------------------------------------------------------------------------------


def _cgroup_headroom(mount: str, path: str, limit: str, usage: str, inactive_key: str) -> list[int]:
    found = []
    for level in levels(mount, path):
        limit_text = read_text(posixpath.join(level, limit))
        usage_text = read_text(posixpath.join(level, usage))
        if limit_text is None or usage_text is None:
            continue
        try:
            room = headroom(limit_text, usage_text, read_text(posixpath.join(level, "memory.stat")) or "", inactive_key)
        except ValueError:
            log.debug("unreadable memory limit in %s", level)
            continue
        if room is not None:
            found.append(room)
    return found


def available_memory(cgroup_root: str = CGROUP_ROOT, proc: str = "/proc") -> int | None:
    """Bytes this process may still use: the least of MemAvailable and every limiting cgroup's headroom; None
    when none of them can be read."""
    found = []
    meminfo = read_text(posixpath.join(proc, "meminfo"))
    if meminfo is not None and (free := parse_meminfo(meminfo)) is not None:
        found.append(free)
    v2, v1 = parse_cgroup_paths(read_text(posixpath.join(proc, "self/cgroup")) or "")
    if v2 is not None:
        found += _cgroup_headroom(cgroup_root, v2, "memory.max", "memory.current", "inactive_file")
    if v1 is not None:
        found += _cgroup_headroom(posixpath.join(cgroup_root, "memory"), v1, "memory.limit_in_bytes",
                                  "memory.usage_in_bytes", "total_inactive_file")
    return min(found, default=None)


# -- the worker count -----------------------------------------------------------------------------------


def bytes_per_pixel(raw_formats: Iterable[str]) -> int:
    """The most any of ``raw_formats`` takes per pixel: a worker tries them in turn, each after the last let go."""
    return max(RAW_FORMATS[f].bytes_per_pixel for f in raw_formats)


def expansion_need(pixels: int, source_size: int, raw_formats: Iterable[str] = DEFAULT_FORMATS) -> int:
    """Peak bytes that expanding one image of ``pixels`` and ``source_size`` bytes to ``raw_formats`` takes in a
    worker."""
    return SOURCE_COPIES * source_size + bytes_per_pixel(raw_formats) * pixels


#: The largest source the workers' memory is planned for: no image expand accepts (``MAX_PIXELS``) is held in more
#: bytes than its pixels at 8 bytes each (16-bit RGBA, stored). A larger one (a sparse file of a terabyte, which
#: costs whoever writes the dataset nothing) is refused by its worker as too large for its memory, never planned
#: for: one such file cut a whole prepare to a single worker.
MAX_PLANNED_SOURCE: Final = 8 * MAX_PIXELS


def largest_planned(sizes: Iterable[int]) -> int:
    """The largest of the sources' ``sizes`` the workers are planned for (``plan_workers``' ``largest_source``)."""
    return max((size for size in sizes if size <= MAX_PLANNED_SOURCE), default=0)


@dataclass(frozen=True)
class WorkerPlan:
    workers: int
    #: Bytes one worker may spend on one image (``expansion_need``); None where no memory figure is known.
    budget: int | None
    available: int | None


def plan_workers(requested: int | None, *, max_pixels: int, largest_source: int, refusing: bool = True,
                 raw_formats: tuple[str, ...] = DEFAULT_FORMATS) -> WorkerPlan:
    """How many workers to start, and the memory each may use for one image.

    Each worker is given room for the largest image expand accepts (``max_pixels``, from a source as large as
    the largest candidate): the size of an image is known only once its header is read, and the largest the
    catalog holds may be any of them. So the default never refuses an image that one worker alone could expand.
    ``requested`` (--jobs) is honoured up to what fits and lowered beyond, with a warning: more workers would
    split the same memory into shares too small for the images they may meet. ``refusing``: the workers refuse
    an image over their budget (prepare's do; verify's do not, so no warning about it). ``raw_formats``: what
    the workers make (``--formats``), each at its own need (``RawFormat.bytes_per_pixel``).
    """
    available = available_memory()
    cpus = usable_cores()  # (a container's CPU limit too: 64 workers in a pod of 4 cores took 64 images' memory)
    per_worker = WORKER_BASE_BYTES + expansion_need(max_pixels, largest_source, raw_formats)
    fits = None if available is None else max(1, available // per_worker)
    workers = max(1, requested or cpus)
    if available is not None and fits is not None and workers > fits:
        (log.warning if requested else log.info)(
            "%s: %d workers lowered to %d, as %.1f GB of memory is available (cgroup limit, MemAvailable) and "
            "each worker may need %.1f GB for an image of %d Mpx", "--jobs" if requested else "the cores",
            workers, fits, available / 1e9, per_worker / 1e9, max_pixels // 1_000_000)
        workers = fits
    budget = None if available is None else available // workers - WORKER_BASE_BYTES
    # Refused only when not even the cheapest of the formats fits (a worker skips those that do not).
    cheapest = min((RAW_FORMATS[f] for f in raw_formats), key=lambda f: f.bytes_per_pixel)
    if refusing and available is not None and budget is not None \
            and budget < expansion_need(max_pixels, largest_source, (cheapest.name,)):
        log.warning("%.1f GB of memory is available: images of more than about %.0f Mpx are served as their "
                    "originals (skipped as no-memory)", available / 1e9,
                    max(0, budget - SOURCE_COPIES * largest_source) / cheapest.bytes_per_pixel / 1e6)
    log.info("%d workers, %s", workers,
             "memory unknown" if available is None else f"{available / 1e9:.1f} GB of memory available")
    return WorkerPlan(workers, budget, available)
