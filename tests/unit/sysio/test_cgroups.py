"""What the cgroups above this process allow it (``liquidfs.sysio.cgroups``): the cores a CPU limit leaves, over
files written as any machine has them. The paths of /proc/self/cgroup: tests/unit/expand/test_workers.py, beside
the memory limits read from them."""

from __future__ import annotations

from pathlib import Path

from liquidfs.sysio.cgroups import cpu_count, parse_cpu_max, usable_cores


def test_usable_cores_follow_a_cgroup_cpu_limit(tmp_path: Path) -> None:
    assert parse_cpu_max("max 100000") is None and parse_cpu_max("250000 100000") == 2.5
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1\n")
    (cgroup / "kubepods" / "pod1").mkdir(parents=True)
    (cgroup / "kubepods" / "cpu.max").write_text("max 100000\n")
    (cgroup / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    assert usable_cores(str(cgroup), str(proc)) == min(cpu_count(), 2)
