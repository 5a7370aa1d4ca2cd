"""What the adaptive mix reads of the machine (``mix.pressure``): pressure files of the node and of a cgroup, the
stalls over each interval, the CPU's busy share, and only regular files read (never a blocked open)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import TypeVar

import pytest

from liquidfs.mix.pressure import CpuBusy, Stalls, read_pressure
from liquidfs.sysio import cgroups
from liquidfs.sysio.cgroups import cpu_count

T = TypeVar("T")

#: No cgroup limits the test's process: the node's reading, whatever limits the machine running the suite.
_NO_LIMIT: Callable[[], tuple[str, float] | None] = lambda: None


def test_pressure_files_are_read_as_shares() -> None:
    text = "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=4\n"
    assert read_pressure(text) == (0.125, 123)
    with pytest.raises(ValueError):
        read_pressure("")


@pytest.mark.parametrize("fields", ["avg10=nan total=1", "avg10=inf total=1", "avg10=-5 total=1",
                                    "avg10=100.5 total=1", "avg10=1.00 total=-7", f"avg10=1.00 total=1{'0' * 400}"])
def test_a_pressure_file_out_of_range_is_no_reading(tmp_path: Path, fields: str) -> None:
    """A delegated --pressure-dir's files are its user's: a NaN read as a stall steered the mix to the bottom of
    its range. Out of range, it is no reading (the controller holds)."""
    with pytest.raises(ValueError, match="out of range"):
        read_pressure(f"some {fields}\n")
    (tmp_path / "cpu.pressure").write_text(f"some {fields}\n")
    assert Stalls(tmp_path)("cpu") is None


def test_pressure_never_there_is_said_once_as_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A kernel without PSI, or a --pressure-dir mistyped: the adaptive mix held its start share for the whole
    mount, said only at debug level, while the mount looked like one whose share fits."""
    stalls = Stalls(tmp_path / "no-such-group")
    with caplog.at_level("WARNING", logger="liquidfs.mix.pressure"):
        for _ in range(3):
            assert stalls("cpu") is None and stalls("io") is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("the adaptive mix holds its share" in m and "psi=1" in m for m in said), said


def test_pressure_files_of_the_node_and_of_a_cgroup(tmp_path: Path) -> None:
    line = "some avg10={} avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    (tmp_path / "cpu").write_text(line.format("42.00"))
    (tmp_path / "io.pressure").write_text(line.format("7.50"))
    stalls = Stalls(tmp_path)  # first readings: the kernel's avg10
    assert stalls("cpu") == pytest.approx(0.42)
    assert stalls("io") == pytest.approx(0.075)
    assert stalls("memory") is None


def test_stalls_are_measured_over_the_interval_not_the_kernels_10_s_average(tmp_path: Path) -> None:
    """The share of the time since the last reading that the ``total`` stall counter grew by: five seconds after
    a move, ``avg10`` still holds most of what came before it."""
    line = "some avg10={} avg60=0.00 avg300=0.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    now = [100.0]
    (tmp_path / "io").write_text(line.format("60.00", 10_000_000))
    stalls = Stalls(tmp_path, clock=lambda: now[0])
    assert stalls("io") == pytest.approx(0.6)  # nothing to compare with yet: the kernel's average
    now[0] += 5.0
    (tmp_path / "io").write_text(line.format("45.00", 10_500_000))  # 0.5 s stalled in 5 s
    assert stalls("io") == pytest.approx(0.1)
    now[0] += 5.0
    assert stalls("io") == 0.0  # nothing stalled since, whatever avg10 still says
    (tmp_path / "cpu.pressure").write_text(line.format("1.00", 4_000_000))  # a cgroup's file name
    assert stalls("cpu") == pytest.approx(0.01)
    now[0] += 2.0
    (tmp_path / "cpu.pressure").write_text(line.format("1.00", 1_000))  # a new group: the counter restarted
    assert stalls("cpu") == pytest.approx(0.01)
    assert stalls("memory") is None


def test_cpu_busy_from_the_node_and_from_a_cgroup(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3\n")
    busy = CpuBusy(tmp_path / "none", proc_stat=stat, own_limit=_NO_LIMIT)
    stat.write_text("cpu  250 0 150 800 100 0 0 0 0 0\n")  # +200 busy, +100 idle
    assert busy() == pytest.approx(200 / 300)
    group = tmp_path / "group"
    group.mkdir()
    (group / "cpu.stat").write_text("usage_usec 0\n")
    now = [100.0]
    busy = CpuBusy(group, clock=lambda: now[0])
    now[0] += 10.0
    (group / "cpu.stat").write_text(f"usage_usec {int(5e6 * busy.cores)}\n")  # half of every core's time
    assert busy() == pytest.approx(0.5)
    (group / "cpu.stat").unlink()
    assert CpuBusy(group, proc_stat=tmp_path / "missing")() is None


def test_cpu_busy_of_the_node_is_over_the_cpus_this_process_may_run_on(tmp_path: Path) -> None:
    """A loader saturating the 2 cores of its cpuset (the daemon's affinity too) on a node of 8 was 25 % busy over
    the node's ``cpu`` line, under the floor that says decoding binds: the affinity's own lines are summed."""
    def stat_of(ticks: int) -> str:  # ``ticks`` of each CPU's time: its two busy throughout, the other six idle
        lines = [f"cpu  {ticks * 2} 0 0 {ticks * 6} 0 0 0 0 0 0"]
        lines += [f"cpu{cpu} {ticks if cpu in (2, 5) else 0} 0 0 {0 if cpu in (2, 5) else ticks} 0 0 0 0 0 0"
                  for cpu in range(8)]
        return "\n".join(lines) + "\n"

    stat = tmp_path / "stat"
    stat.write_text(stat_of(100))
    mine = CpuBusy(tmp_path / "none", proc_stat=stat, own_limit=_NO_LIMIT, affinity=lambda: {2, 5})
    every = CpuBusy(tmp_path / "none", proc_stat=stat, own_limit=_NO_LIMIT, affinity=lambda: set(range(8)))
    stat.write_text(stat_of(1100))
    assert mine() == pytest.approx(1.0) and every() == pytest.approx(0.25)
    stat.write_text("cpu  1 2 3\n")  # a line short of its counters: no reading, never an IndexError
    assert CpuBusy(tmp_path / "none", proc_stat=stat, own_limit=_NO_LIMIT)() is None


def test_cpu_busy_of_a_group_is_over_the_cores_its_cpu_max_allows(tmp_path: Path) -> None:
    """A pod limited to half a core (its cpu.max, or its parent's) on a node of many: its usage over that much
    time, not over every core of the affinity (then it never passed 1/cores, and "decode binds" never showed)."""
    pod = tmp_path / "pod"
    container = pod / "container"
    container.mkdir(parents=True)
    for level in (pod, container):
        (level / "cgroup.controllers").write_text("cpu io memory\n")
    (pod / "cpu.max").write_text("50000 100000\n")  # half a core
    (container / "cpu.max").write_text("max 100000\n")
    (container / "cpu.stat").write_text("usage_usec 0\n")
    now = [100.0]
    busy = CpuBusy(container, clock=lambda: now[0])
    assert busy.cores == 0.5
    now[0] += 10.0
    (container / "cpu.stat").write_text("usage_usec 5000000\n")  # all it may use, throughout
    assert busy() == pytest.approx(1.0)


def test_cpu_busy_without_a_group_reads_the_cgroup_that_limits_this_process(tmp_path: Path) -> None:
    """A container limited to 2 of the node's 8 cores (``docker run --cpus 2``, cpu.max on its own cgroup) and
    no --pressure-dir: the node's busy time over 8 cores read 0.25 with the loader saturating its 2, under the
    floor that says decoding binds. The cgroup that limits it is read instead, over what it allows, in each
    interval where processes besides the daemon use it; where the daemon alone does (a sidecar given a limit of
    its own), and without a limit below the cores (or none at all), the node's as before."""
    root = tmp_path / "cgroup"
    container = root / "docker" / "abc"
    container.mkdir(parents=True)
    for level in (root, root / "docker", container):
        (level / "cgroup.controllers").write_text("cpu io memory\n")
    (container / "cpu.max").write_text("200000 100000\n")
    (container / "cpu.stat").write_text("usage_usec 0\n")
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/docker/abc\n")
    own_limit = functools.partial(cgroups.limiting_group, str(root), str(proc))
    assert own_limit() == (str(container), 2.0)
    stat = tmp_path / "stat"
    stat.write_text("cpu  0 0 0 800 0 0 0 0 0 0\n")
    now, mine = [100.0], [0.0]
    busy = CpuBusy(tmp_path / "none", proc_stat=stat, clock=lambda: now[0], affinity=lambda: set(range(8)),
                   own_limit=own_limit, own_cpu=lambda: mine[0])

    def interval(group_seconds: float, daemon_seconds: float, node_busy_ticks: int) -> float | None:
        """10 s in which the container used ``group_seconds`` of CPU, the daemon ``daemon_seconds`` of them."""
        now[0] += 10.0
        mine[0] += daemon_seconds
        used = int((container / "cpu.stat").read_text().split()[1]) + int(group_seconds * 1e6)
        (container / "cpu.stat").write_text(f"usage_usec {used}\n")
        busy_ticks, idle = map(int, stat.read_text().split()[1:5:3])
        stat.write_text(f"cpu  {busy_ticks + node_busy_ticks} 0 0 {idle + 8000 - node_busy_ticks} 0 0 0 0 0 0\n")
        return busy()

    assert interval(20.0, 2.0, 2000) == pytest.approx(1.0)  # a loader saturates both cores: the group's
    assert interval(3.0, 2.9, 2000) == pytest.approx(0.25)  # the daemon alone: the node's, a quarter busy
    node = CpuBusy(tmp_path / "none", proc_stat=stat, affinity=lambda: {0, 1}, own_limit=own_limit)
    assert node._limiting is None  # allowed all the cores it may run on: the node's
    assert CpuBusy(tmp_path / "none", proc_stat=stat, own_limit=_NO_LIMIT)._limiting is None
    (container / "cpu.max").write_text("max 100000\n")
    assert own_limit() is None


def test_counters_past_a_u64_are_no_reading(tmp_path: Path) -> None:
    """A delegated group's cpu.stat or cpu.max is its user's: a usage of 400 digits made the division after it
    raise OverflowError, which no caller caught (the mix's steering ended, and the mount with it)."""
    group = tmp_path / "group"
    group.mkdir()
    (group / "cgroup.controllers").write_text("cpu\n")
    (group / "cpu.max").write_text(f"1{'0' * 400} 100000\n")
    (group / "cpu.stat").write_text(f"usage_usec 1{'0' * 400}\n")
    busy = CpuBusy(group)
    assert busy.cores == cpu_count()  # the quota is no reading: the affinity's cores
    assert busy() is None
    stat = tmp_path / "stat"
    stat.write_text(f"cpu  1{'0' * 400} 0 100 700 100 0 0 0 0 0\n")
    assert CpuBusy(tmp_path / "none", proc_stat=stat, own_limit=_NO_LIMIT)() is None


def _in_thread_with_deadline(call: Callable[[], T], seconds: float = 30.0) -> T:
    """``call()`` in a thread of its own, failing (not hanging the suite) when it does not return in time."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(call)
        try:
            return future.result(timeout=seconds)
        except FuturesTimeout:
            for fifo in _fifos:  # let a reader blocked on a FIFO go, so the pool can end
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            raise AssertionError(f"no answer within {seconds} s: blocked") from None


_fifos: list[Path] = []


def test_only_regular_pressure_files_are_read(tmp_path: Path) -> None:
    """A delegated --pressure-dir (a cgroup) is its user's: a child group named ``cpu`` is a directory there, and
    the reader took it for the node's pressure file, failed, and the controller saw no CPU pressure again, ever;
    a FIFO named as a pressure file blocked its open for good. Only regular files count, the group's own
    ``cpu.pressure`` beside such a directory is read, and anything else is no reading, at once."""
    some = "some avg10=12.50 avg60=3.00 avg300=1.00 total=2000000\nfull avg10=0 avg60=0 avg300=0 total=0\n"
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu.pressure").write_text(some)
    os.mkfifo(tmp_path / "io.pressure")
    _fifos.append(tmp_path / "io.pressure")
    (tmp_path / "memory.pressure").write_text(some)
    (tmp_path / "elsewhere").write_text(some.replace("avg10=12.50", "avg10=90.00"))
    (tmp_path / "memory").symlink_to(tmp_path / "elsewhere")  # a link: never followed
    os.mkfifo(tmp_path / "cpu.stat")
    _fifos.append(tmp_path / "cpu.stat")
    clock = iter([10.0, 11.0, 12.0, 13.0, 14.0]).__next__
    stalls = Stalls(tmp_path, clock=clock)
    assert _in_thread_with_deadline(lambda: stalls("cpu")) == pytest.approx(0.125)  # avg10, the first time
    assert _in_thread_with_deadline(lambda: stalls("io")) is None
    assert _in_thread_with_deadline(lambda: stalls("memory")) == pytest.approx(0.125)
    (tmp_path / "cpu.pressure").write_text(some.replace("total=2000000", "total=2500000"))
    assert _in_thread_with_deadline(lambda: stalls("cpu")) == pytest.approx(0.5 / 2)  # 0.5 s stalled in 2 s
    # The group's cpu.stat, a FIFO here, is no reading either (never a blocked open): the node's /proc/stat is.
    busy = _in_thread_with_deadline(lambda: CpuBusy(tmp_path))
    assert busy._last is not None and busy._last[1] > 0


def test_cpu_busy_of_a_group_is_over_its_own_cpuset_and_read_anew(tmp_path: Path) -> None:
    """The daemon pinned to 2 cores watching a loader's pod of 8 (its cpuset): half the pod's CPU read as busy
    1.0 over the daemon's affinity, and the mix went to the top for good. Over the group's cpuset, read at each
    interval (a pod resized); a sample of the group's after one of the node's (its cpu.stat gone a while) is
    no reading."""
    group = tmp_path / "pod"
    group.mkdir()
    (group / "cgroup.controllers").write_text("cpu cpuset\n")
    (group / "cpuset.cpus.effective").write_text("0-3,8-11\n")
    (group / "cpu.stat").write_text("usage_usec 0\n")
    now = [100.0]
    busy = CpuBusy(group, proc_stat=tmp_path / "stat", clock=lambda: now[0])
    assert busy.cores == 8
    now[0] += 10.0
    (group / "cpu.stat").write_text("usage_usec 40000000\n")  # 40 s of CPU in 10 s: half of 8 cores
    assert busy() == pytest.approx(0.5)
    (group / "cpuset.cpus.effective").write_text("0-3\n")  # resized to 4
    now[0] += 10.0
    (group / "cpu.stat").write_text("usage_usec 80000000\n")
    assert busy() == pytest.approx(1.0) and busy.cores == 4
    (group / "cpu.stat").unlink()
    (tmp_path / "stat").write_text("cpu  100 0 100 700 100 0 0 0 0 0\n")
    assert busy() is None  # no group's reading
    (group / "cpu.stat").write_text("usage_usec 90000000\n")
    now[0] += 10.0
    assert busy() is None  # the group's again, after the node's: no pair of one source
    now[0] += 10.0
    (group / "cpu.stat").write_text("usage_usec 110000000\n")
    assert busy() == pytest.approx(0.5)


def test_a_pressure_file_that_goes_away_is_said_once_and_named_in_the_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The watched cgroup removed or moved: the mix held for good behind a debug line, its reason blaming a
    kernel without PSI. Said once as a warning, the reason naming the directory; read again once it is back."""
    from liquidfs.mix.controller import MixController
    from liquidfs.mix.share import Mix, _observe

    line = "some avg10=10.00 avg60=0.00 avg300=0.00 total=1\n"
    (tmp_path / "cpu.pressure").write_text(line)
    (tmp_path / "io.pressure").write_text(line)
    stalls = Stalls(tmp_path)
    assert stalls("cpu") == pytest.approx(0.1)
    (tmp_path / "cpu.pressure").unlink()
    with caplog.at_level("WARNING", logger="liquidfs.mix.pressure"):
        assert stalls("cpu") is None and stalls("cpu") is None
    assert sum("shows no cpu pressure any more" in r.getMessage() for r in caplog.records) == 1
    mix = Mix("adaptive", prepared=1.0)
    _observe(mix, MixController(0.0, 1.0, 0.5), stalls, lambda: 0.5, 100.0, 1e6)
    assert mix.reason == f"hold: no pressure stall information in {tmp_path}"
    (tmp_path / "cpu.pressure").write_text(line)
    assert stalls("cpu") is not None


def test_the_daemons_own_cpu_counts_its_loops_and_helpers(tmp_path: Path) -> None:
    """In a cgroup limiting a sidecar apart from its loader, the daemon's --loops and their warm helpers were
    counted as processes besides the daemon (time.process_time is the first loop's alone): the sidecar's own use
    read as the loader's. Its process and every descendant count."""
    from liquidfs.mix.pressure import _tree_cpu

    tick = os.sysconf("SC_CLK_TCK")

    def process(pid: int, ticks: int, children: list[int]) -> None:
        (tmp_path / str(pid) / "task" / str(pid)).mkdir(parents=True)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (liquid fs) S 1 1 1 0 -1 0 0 0 0 0 {ticks} {ticks} 0 0\n")
        (tmp_path / str(pid) / "task" / str(pid) / "children").write_text(" ".join(map(str, children)))

    process(10, 100, [11, 12])  # the daemon: two loops more
    process(11, 50, [13])       # a loop and its helper
    process(12, 50, [])
    process(13, 25, [])
    assert _tree_cpu(10, tmp_path)() == pytest.approx(2 * (100 + 50 + 50 + 25) / tick)
    (tmp_path / "13" / "stat").unlink()  # a helper gone meanwhile: the rest still count
    assert _tree_cpu(10, tmp_path)() == pytest.approx(2 * (100 + 50 + 50) / tick)
