"""What the cgroups above this process allow it: the files' paths (``/proc/self/cgroup``) and levels, and the
cores it can keep busy (``cpu.max``). The memory they allow is ``expand.workers``'s. The parsers take the files'
text, so tests feed them any machine's."""

from __future__ import annotations

import logging
import math
import os
import posixpath
from collections.abc import Callable, Iterable
from typing import Final

log = logging.getLogger(__name__)

CGROUP_ROOT: Final = "/sys/fs/cgroup"


def parse_cgroup_paths(text: str) -> tuple[str | None, str | None]:
    """From /proc/self/cgroup: (the cgroup v2 path, the cgroup v1 memory controller's path), None where absent."""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def levels(mount: str, path: str) -> list[str]:
    """The directories of ``path`` and of each of its ancestors under ``mount``, deepest first. In a cgroup
    namespace the path is "/" and the mount is the process's own cgroup; without one the path is the full one,
    and a container may still see only its own part of the tree mounted: the levels that exist are the ones
    that can be read."""
    parts = [p for p in posixpath.normpath("/" + path).split("/") if p]
    if ".." in parts:  # a cgroup outside this namespace: only the mount's root is known
        parts = []
    return [posixpath.join(mount, *parts[:n]) for n in range(len(parts), -1, -1)]


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask, which taskset and cpusets narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Past any counter or quota the kernel writes (a u64): a larger number in a file is no reading.
COUNTER_LIMIT: Final = 1 << 64


def parse_counter(text: str) -> int:
    """A non-negative kernel counter or quota in a file another user may write (a delegated cgroup's): ValueError
    past a u64, where a number of a thousand digits would make the float arithmetic after it raise
    OverflowError, which no caller expects (it ended the mix's steering, and the mount with it)."""
    value = int(text)
    if not 0 <= value < COUNTER_LIMIT:
        raise ValueError(f"a counter out of range: {text[:40]}")
    return value


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2's cpu.max ("QUOTA PERIOD"): the cores' worth it allows, or None for no limit ("max ...")."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    period = parse_counter(fields[1]) if len(fields) > 1 else 100_000
    return parse_counter(fields[0]) / period if period > 0 else None


def least_cpu_max(groups: Iterable[str], read: Callable[[str], str | None] = read_text) -> float | None:
    """The least cores' worth the ``cpu.max`` of ``groups`` (cgroup v2 directories) allow, each read by ``read``;
    None where none limits (or none can be read)."""
    least: float | None = None
    for group in groups:
        text = read(posixpath.join(group, "cpu.max"))
        try:
            allowed = parse_cpu_max(text) if text is not None else None
        except ValueError:
            log.debug("unreadable cpu.max in %s", group)
            continue
        if allowed is not None:
            least = allowed if least is None else min(least, allowed)
    return least


def limiting_group(cgroup_root: str = CGROUP_ROOT, proc: str = "/proc") -> tuple[str, float] | None:
    """The cgroup v2 directory above this process (its own or an ancestor) whose ``cpu.max`` allows the fewest
    cores' worth of CPU time, and that many; None where none limits it (or no v2 hierarchy can be read)."""
    v2, _ = parse_cgroup_paths(read_text(posixpath.join(proc, "self/cgroup")) or "")
    least: tuple[str, float] | None = None
    for group in levels(cgroup_root, v2) if v2 is not None else ():
        allowed = least_cpu_max([group])
        if allowed is not None and (least is None or allowed < least[1]):
            least = (group, allowed)
    return least


def usable_cores(cgroup_root: str = CGROUP_ROOT, proc: str = "/proc") -> int:
    """The cores this process can keep busy: its affinity, or fewer where a cgroup (v2) above it allows less CPU
    time (``cpu.max``, what a container's CPU limit sets; affinity alone shows the host's cores there)."""
    cores = cpu_count()
    limit = limiting_group(cgroup_root, proc)
    return cores if limit is None else min(cores, max(1, math.ceil(limit[1])))
