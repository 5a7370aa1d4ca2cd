"""What the adaptive mix reads of the machine: the kernel's pressure stall information for CPU and IO over each
interval (``Stalls``: ``/proc/pressure/*`` or a cgroup v2 group's), and the share of CPU time that was busy
(``CpuBusy``), each from regular files only (a delegated --pressure-dir is its user's)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..sysio.cgroups import cpu_count, least_cpu_max, limiting_group, parse_counter
from ..sysio.paths import open_regular

log = logging.getLogger(__name__)


#: Of the cores' worth of CPU time a cgroup limiting the daemon allows, what processes besides the daemon must
#: use of it over an interval for its reading to stand for the loader's (``CpuBusy``).
OTHERS_SHARE = 0.1


class CpuBusy:
    """The share of CPU time that was busy since the previous call: a cgroup v2 group's (its ``cpu.stat``
    ``usage_usec`` over the cores it may use) when ``where`` holds one, else the node's CPUs this process may
    run on (``/proc/stat``, ``_node_sample``). None where it cannot be read, or where the two samples are not of
    one source (the group's file gone since: a group's seconds over the node's ticks mean nothing).

    Where ``where`` holds no group (the node's /proc/pressure) but a cgroup above this process allows it fewer
    cores than it may run on (``own_limit``: a container's CPU limit), that group's reading is taken over the
    node's in each interval where processes besides the daemon (``own_cpu``: the CPU seconds of its process and
    its descendants, its loops and their helpers: ``_tree_cpu``) used at least
    ``OTHERS_SHARE`` of what the group allows: a container of loader and daemon (``docker run --cpus 4``), where
    the node's busy time over its 64 cores never showed the loader saturating its 4 ("decode binds",
    ``controller.BUSY_FLOOR``). A sidecar limited apart from its loader finds its group holds only itself,
    and reads the node's, as before."""

    def __init__(self, where: Path = Path("/proc/pressure"), proc_stat: Path = Path("/proc/stat"),
                 clock: Callable[[], float] = time.monotonic,
                 affinity: Callable[[], set[int]] = lambda: os.sched_getaffinity(0),
                 own_limit: Callable[[], tuple[str, float] | None] = limiting_group,
                 own_cpu: Callable[[], float] | None = None) -> None:
        self.where = where
        self.group_stat = where / "cpu.stat"
        self.proc_stat = proc_stat
        self.clock = clock
        self.affinity = affinity
        self.cores = _cores_of(where)
        self._last = self._sample()
        self._limiting: _LimitingGroup | None = None
        cores = len(affinity()) or cpu_count()
        if self._last is not None and self._last[0] != "group" and (limit := own_limit()) is not None \
                and limit[1] < cores:
            self._limiting = _LimitingGroup(Path(limit[0]), clock, own_cpu or _tree_cpu(os.getpid()))
            log.info("mix: this process's cgroup %s allows %.2g of its %d cores: its CPU use is read where processes "
                     "besides the daemon use it (a container of loader and daemon), else the node's; a daemon "
                     "limited apart from its loader wants --pressure-dir naming the loader's cgroup", limit[0],
                     limit[1], cores)

    def _sample(self) -> tuple[str, float, float] | None:
        """(source, busy, total) so far, as counters: the group's seconds of CPU and of the clock, or the
        node's ticks."""
        try:
            # Read as the pressure files are: only a regular file is the group's (--pressure-dir may be its user's).
            group = _read_regular(self.group_stat)
            if group is not None:
                return "group", _usage_seconds(group), self.clock()
            return _node_sample(self.proc_stat.read_text(), self.affinity())
        except (OSError, ValueError, KeyError) as exc:
            log.debug("cpu busy: %s", exc)
            return None

    def __call__(self) -> float | None:
        limited = self._limiting() if self._limiting is not None else None
        now, last = self._sample(), self._last
        self._last = now
        if limited is not None:
            return limited
        if now is None or last is None or now[0] != last[0] or now[2] <= last[2]:
            return None
        span = now[2] - last[2]
        if now[0] == "group":
            self.cores = _cores_of(self.where)
            span *= self.cores
        return min(1.0, max(0.0, (now[1] - last[1]) / span))


class _LimitingGroup:
    """``CpuBusy``'s reading of the cgroup that limits the daemon: its busy share over an interval, where
    processes besides the daemon used ``OTHERS_SHARE`` of what it allows; else None."""

    def __init__(self, group: Path, clock: Callable[[], float], own_cpu: Callable[[], float]) -> None:
        self.group = group
        self.clock = clock
        self.own_cpu = own_cpu
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        """(the group's CPU seconds, the daemon's, the clock) so far."""
        text = _read_regular(self.group / "cpu.stat")
        try:
            return None if text is None else (_usage_seconds(text), self.own_cpu(), self.clock())
        except (ValueError, KeyError) as exc:
            log.debug("cpu busy of %s: %s", self.group, exc)
            return None

    def __call__(self) -> float | None:
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[2] <= last[2]:
            return None
        span = (now[2] - last[2]) * _cores_of(self.group)
        used, mine = now[0] - last[0], now[1] - last[1]
        if used - mine < OTHERS_SHARE * span:
            return None  # the daemon's own use, or nearly all of it: the node's says more of the loader
        return min(1.0, max(0.0, used / span))


#: Processes of the daemon's tree looked at (``_tree_cpu``): its loops and their helpers, a few dozen at most.
_MOST_PROCESSES = 256


def _tree_cpu(root: int, proc: Path = Path("/proc")) -> Callable[[], float]:
    """The CPU seconds of process ``root`` and its descendants so far (its ``--loops`` and each loop's warm
    helper: in its cgroup too, and no process besides the daemon), from /proc's stat and children lists; of
    ``root`` alone where the kernel keeps no children lists."""
    tick = os.sysconf("SC_CLK_TCK")

    def seconds() -> float:
        total, todo, seen = 0.0, [root], 0
        while todo and seen < _MOST_PROCESSES:
            pid = todo.pop()
            seen += 1
            try:
                fields = (proc / str(pid) / "stat").read_text().rpartition(")")[2].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (stat's 14th and 15th)
                for task in os.listdir(proc / str(pid) / "task"):
                    todo += map(int, (proc / str(pid) / "task" / task / "children").read_text().split())
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile, or no children lists: what was read counts
        return total

    return seconds


def _usage_seconds(text: str) -> float:
    """A ``cpu.stat``'s ``usage_usec``, in seconds (ValueError, KeyError where it has none that is a number)."""
    fields = dict(line.split() for line in text.splitlines() if line.strip())
    return parse_counter(fields["usage_usec"]) / 1e6


def _cores_of(group: Path) -> float:
    """The cores' worth of time the cgroup ``group`` may use: the CPUs its cpuset gives it
    (``cpuset.cpus.effective``; where it has none, this process's affinity), within the least ``cpu.max`` of it
    and the groups above. Asked at each interval: a pod resized, or moved to another cpuset, is seen at the
    next."""
    cpus = _cpuset_size(_read_regular(group / "cpuset.cpus.effective")) or cpu_count()
    allowed = _group_allowance(group)
    # A group's usage over the cores' worth of time it may use: in a pod limited to 4 of 64 cores, over the
    # affinity's 64 it could never pass 0.06, and "decode binds" (``controller.BUSY_FLOOR``) never showed;
    # over the daemon's own affinity (pinned to 2 cores), a loader of 8 busy at half was "saturated".
    return min(cpus, allowed) if allowed is not None and allowed > 0 else cpus


def _node_sample(text: str, cpus: set[int]) -> tuple[str, float, float]:
    """``CpuBusy``'s sample of the node from ``/proc/stat``'s ``text``: the CPUs of ``cpus`` (this process's
    affinity) where they are some of the node's, else every CPU (the ``cpu`` line). They stand for the loader's
    where the two share them (a container's cpuset, a daemon pinned with its loader): a loader saturating the 8
    cores of its cpuset on a 64-core node was 12 % busy over the node's, under the floor that says decoding binds
    (``controller.BUSY_FLOOR``). A daemon given cores of its own (a sidecar's exclusive CPUs) measures those:
    there ``--pressure-dir`` names the loader's group. Time waiting for IO counts as idle."""
    lines = {fields[0]: fields[1:9] for fields in map(str.split, text.splitlines()) if fields and
             fields[0].startswith("cpu")}
    listed = {int(name[3:]) for name in lines if name[3:].isascii() and name[3:].isdigit()}
    mine = sorted(cpus) if cpus and cpus < listed else None
    rows = [lines[f"cpu{cpu}"] for cpu in mine] if mine else [lines["cpu"]]
    busy = total = 0
    for row in rows:
        ticks = [parse_counter(v) for v in row]
        if len(ticks) < 5:
            raise ValueError(f"a /proc/stat line of {len(ticks)} counters")
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    return ("cpus " + ",".join(map(str, mine)) if mine else "node"), float(busy), float(total)


def _cpuset_size(text: str | None) -> int:
    """The CPUs a cpuset list names ("0-3,8,10-11": 7); 0 for none, or for text that is no such list."""
    count = 0
    for part in (text or "").strip().split(","):
        first, _, last = part.partition("-")
        if not (first.isascii() and first.isdigit() and (not last or (last.isascii() and last.isdigit()))):
            return 0
        span = int(last or first) - int(first) + 1
        if not 0 < span <= 1 << 16:
            return 0
        count += span
    return count


def _group_allowance(group: Path, levels: int = 16) -> float | None:
    """The cores' worth of CPU time the cgroup v2 group ``group`` and the groups above it allow (the least of
    their ``cpu.max``, read as the pressure files are: the directory may be its user's); None where none limits
    it (or ``group`` is no cgroup)."""
    groups = itertools.takewhile(lambda level: _read_regular(level / "cgroup.controllers") is not None,
                                 [group, *group.parents][:levels])  # (up to the hierarchy's root)
    return least_cpu_max((str(level) for level in groups), lambda path: _read_regular(Path(path)))


def read_pressure(text: str) -> tuple[float, int]:
    """A pressure file's (``/proc/pressure/cpu``, a cgroup's ``cpu.pressure``) ``some`` line: its ``avg10`` as
    0..1, and its ``total``, the microseconds some task stalled since boot (or the group's birth)."""
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            # A delegated directory's file is its user's: "nan" or "-1e9" would steer the mix (a NaN gap reads as
            # "decode binds" at every look, and took the share to the bottom of the prepared range), and a total
            # of a thousand digits made the next interval's arithmetic raise OverflowError (``parse_counter``).
            avg10, total = float(fields.get("avg10", 0.0)) / 100, parse_counter(fields.get("total", "0"))
            if not 0.0 <= avg10 <= 1.0:
                raise ValueError(f"a pressure file's 'some' line out of range: avg10={avg10 * 100}, total={total}")
            return avg10, total
    raise ValueError("no 'some' line in a pressure file")


#: More than any pressure or cpu.stat file holds: a regular file planted in a delegated directory is read no further.
_MAX_READ = 1 << 16


def _read_regular(path: Path) -> str | None:
    """The text of ``path`` when it is a regular file; None for anything else (missing, a directory, a FIFO, a
    device, a symbolic link), at once. A delegated --pressure-dir (a cgroup) is its user's: a child group named
    ``cpu`` is a directory there, and a FIFO's open would block the controller for good. O_NONBLOCK keeps that
    open from waiting for a writer, O_NOFOLLOW keeps a link from leading anywhere, fstat judges what was opened
    (``paths.open_regular``)."""
    try:
        fd = open_regular(path)
    except OSError as exc:
        log.debug("%s: %s", path, exc)
        return None
    try:
        data = b""
        while len(data) < _MAX_READ and (chunk := os.read(fd, _MAX_READ - len(data))):
            data += chunk
        return data.decode("ascii", "replace")
    except OSError as exc:
        log.debug("%s: %s", path, exc)
        return None
    finally:
        os.close(fd)


def _pressure_text(kind: str, root: Path) -> str | None:
    """The node's ``/proc/pressure/cpu``, or a cgroup v2 group's ``/sys/fs/cgroup/GROUP/cpu.pressure``: the first
    of the two names that is a regular file (a group's child named ``cpu`` must not hide its ``cpu.pressure``)."""
    for path in (root / kind, root / f"{kind}.pressure"):
        text = _read_regular(path)
        if text is not None:
            return text
    return None


class Stalls:
    """The pressure for a kind (cpu, io) over the time since the previous call for it: how much the pressure
    file's ``some total`` grew, over the seconds that passed (0..1). The first call, with nothing to compare,
    answers the kernel's ``avg10``; None where the kernel has no PSI."""

    def __init__(self, root: Path = Path("/proc/pressure"), clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.clock = clock
        self._last: dict[str, tuple[int, float]] = {}
        self._lost: set[str] = set()  # kinds whose file was read, then was gone (said once)

    def __call__(self, kind: str) -> float | None:
        text = _pressure_text(kind, self.root)
        if text is None:
            if kind not in self._lost:  # said once, whether it was there (a group removed, or moved) or never was
                self._lost.add(kind)
                if kind in self._last:
                    log.warning("mix: %s shows no %s pressure any more (its cgroup removed or moved?): the share "
                                "holds until it does", self.root, kind)
                else:  # never there: a mount that decides nothing must not look like one whose share fits
                    log.warning("mix: %s shows no %s pressure (a kernel without PSI: psi=1 on its command line; or a "
                                "--pressure-dir that is no cgroup v2 directory): the adaptive mix holds its share "
                                "until it does", self.root, kind)
            log.debug("no %s pressure file in %s", kind, self.root)
            return None
        self._lost.discard(kind)
        try:
            avg10, total = read_pressure(text)
        except ValueError as exc:
            log.debug("no %s pressure in %s: %s", kind, self.root, exc)
            return None
        now = self.clock()
        last = self._last.get(kind)
        self._last[kind] = (total, now)
        if last is None or now <= last[1] or total < last[0]:
            return avg10  # nothing to compare with (or a counter that went back: a new group)
        return min(1.0, (total - last[0]) / 1e6 / (now - last[1]))
