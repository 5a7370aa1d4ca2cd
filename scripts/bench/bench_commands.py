"""What a ``liquidfs`` command costs before it does anything: the wall time and the CPU (its own and its children's)
of ``liquidfs --help``, ``liquidfs stats MNT --json``, ``liquidfs mount`` (until the mount answers) and
``liquidfs umount`` (until the daemon has gone), for one checkout or several side by side in one run; and what the
mount's daemon has cost once the mount answers: its CPU seconds (imports, the catalog, the FUSE session) and its
resident memory.

    python scripts/bench/bench_commands.py [--checkouts PATH,PATH] [--repeats 5] [--json out/bench/commands.json]
    python scripts/bench/bench_commands.py --smoke     # this checkout, one repeat: the script works

Each checkout's liquidfs is the one its directory holds (``PYTHONPATH``), run by this interpreter; an older commit
is a ``git worktree add /tmp/old COMMIT``. The repeats alternate between the checkouts, and the table has the
medians. The mount is of a source of 20 small files, one loop (``--loops 1``), on the machine's disk; the daemon
it starts is not its child, and its CPU is not in the mount's column (it runs ``python -I``: the installed
liquidfs, whichever checkout started it; its own columns are read from ``/proc`` once the mount answers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as bench  # noqa: E402  (the flags, the work directory, unmounting what a failed run left)

COMMANDS = ("help", "stats", "mount", "umount")


def timed(argv: list[str], checkout: Path) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, of the command and the children it waited for) of ``argv``,
    run in ``checkout`` (``python -m`` looks in the working directory first) with it on ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=checkout, capture_output=True, text=True, timeout=120, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:  # what the command said, not only its status
        raise bench.CommandFailed(done.returncode, argv, done.stdout, done.stderr)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def daemon_started(mnt: Path) -> tuple[float, float]:
    """(CPU seconds, resident MB) of the daemon serving ``mnt``, from ``/proc``: what starting it cost."""
    pid = int(bench.control(mnt)["pid"])
    # its own utime + stime: bench.cpu_seconds would add the children it runs (the read-ahead's helper)
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu, bench.memory_mb(pid)["rss_mb"]


def one_round(checkout: Path, src: Path, work: Path) -> dict[str, tuple[float, float]]:
    cli = [sys.executable, "-m", "liquidfs"]
    # each checkout its own store, by its path: a catalog is only ever opened by the version that made it
    mnt, store = work / "mnt", work / f"store-{hashlib.sha256(str(checkout).encode()).hexdigest()[:12]}"
    mnt.mkdir(exist_ok=True)
    if bench.is_mounted(mnt):
        bench.unmount(mnt, check=False)
    times = {"help": timed([*cli, "--help"], checkout)}
    try:
        times["mount"] = timed([*cli, "mount", str(src), str(mnt), "--store", str(store), "--loops", "1"], checkout)
        times["daemon"] = daemon_started(mnt)
        times["stats"] = timed([*cli, "stats", str(mnt), "--json"], checkout)
        times["umount"] = timed([*cli, "umount", str(mnt)], checkout)
    finally:
        if bench.is_mounted(mnt):  # a command failed or timed out: no mount is left behind
            bench.unmount(mnt, check=False)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkouts", default=str(bench.REPO),
                        help="comma-separated checkouts whose liquidfs to time (default: this one)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every command per checkout (default 5)")
    bench.add_run_arguments(parser, results="out/bench/commands.json", work=bench.REPO / "out" / "bench-commands",
                            work_help="the 20-file source, its stores and the mountpoint",
                            smoke="this checkout, one round")
    args = parser.parse_args()
    checkouts = [Path(c).resolve() for c in args.checkouts.split(",")]
    repeats = 1 if args.smoke else args.repeats
    work = bench.work_dir(args.work)
    src = work / "src" / "a"
    src.mkdir(parents=True, exist_ok=True)
    for i in range(20):
        path = src / f"f{i:02d}.bin"
        if not path.exists():
            path.write_bytes(os.urandom(4096))
    rounds: dict[str, list[dict[str, tuple[float, float]]]] = {str(c): [] for c in checkouts}
    for _ in range(repeats):
        for checkout in checkouts:  # alternated: a slower minute of the machine falls on each alike
            rounds[str(checkout)].append(one_round(checkout, src.parent, work))
    results = []
    for checkout, done in rounds.items():
        row: dict[str, object] = {"checkout": checkout, "repeats": len(done)}
        for command in COMMANDS:
            row[f"{command}_wall_s"] = statistics.median(r[command][0] for r in done)
            row[f"{command}_cpu_s"] = statistics.median(r[command][1] for r in done)
        row["daemon_start_cpu_s"] = statistics.median(r["daemon"][0] for r in done)
        row["daemon_rss_mb"] = statistics.median(r["daemon"][1] for r in done)
        results.append(row)
    # the daemon is the installed liquidfs's whichever checkout started it: the same code in every row
    print("| checkout | " + " | ".join(f"{c} wall / CPU s" for c in COMMANDS)
          + " | daemon (installed liquidfs) at answer: CPU s / RSS MB |")
    print("|---|" + "---|" * (len(COMMANDS) + 1))
    for row in results:
        print(f"| {row['checkout']} | " + " | ".join(f"{row[f'{c}_wall_s']:.2f} / {row[f'{c}_cpu_s']:.2f}"
                                                    for c in COMMANDS)
              + f" | {row['daemon_start_cpu_s']:.2f} / {row['daemon_rss_mb']:.0f} |")
    out = args.json or bench.REPO / "out" / "bench" / "commands.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"repeats": repeats, "results": results}, indent=1))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
