"""``bench_loops.thread_times`` and ``parts_between``, which ``bench_opens.py`` splits a daemon's CPU with: a thread
is counted in the part its name says (one without a name of its own in the worker threads'), a process whose main
thread is so named (the read-ahead's helper, a session of its own) whole, a thread that ended between the two
looks not at all, the main thread (a mount's loop) in the part ``main`` names, every thread in ``whole``; and
``cpu_split`` counts none but the main thread as the loop's. Measured on this test's own threads and children,
never on the machine's counters."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import bench_loops
from bench_opens import LOOP, OTHERS, PARTS, UNNAMED, WHOLE

from liquidfs.sysio.thread_names import CLOSER, NOTIFIER, WARMER, name_this_thread


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _look() -> tuple[dict[str, float], dict]:
    return (bench_loops.cpu_split([os.getpid()], children=True),
            bench_loops.thread_times([os.getpid()], PARTS, unnamed=UNNAMED, others=OTHERS, main=LOOP))


def test_threads_and_a_helper_process_are_counted_in_the_parts_their_names_say() -> None:
    ready, spun, renamed_spun, notified, done = (threading.Event() for _ in range(5))

    def closer() -> None:
        name_this_thread(CLOSER)
        _spin(0.3)
        ready.set()
        done.wait(30)

    def worker() -> None:  # a thread with no name of its own (trio's worker threads, for bench_opens)
        _spin(0.3)
        spun.set()
        done.wait(30)

    def renamed() -> None:  # one trio names after the call it runs ("fn from task"): a worker too
        name_this_thread("memfd_copy from")
        _spin(0.3)
        renamed_spun.set()
        done.wait(30)

    def notifier() -> None:  # one of the daemon's own threads in no part: not a worker
        name_this_thread(NOTIFIER)
        _spin(0.3)
        notified.set()
        done.wait(30)

    ended = threading.Thread(target=lambda: (name_this_thread(CLOSER), _spin(0.3), done.wait(30)))
    ended.start()  # a thread alive at the first look that ends before the second: it must not make a part < 0
    time.sleep(0.5)
    before_split, before = _look()
    done.set()
    ended.join()
    done.clear()
    # The read-ahead's helper names itself, in a session of its own (as the daemon starts it): counted whole.
    code = ("import sys, time\n"
            "from liquidfs.sysio.thread_names import WARMER, name_this_thread\n"
            "name_this_thread(WARMER); end = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\n"
            "print('spun', flush=True); sys.stdin.read()")
    helper = subprocess.Popen([sys.executable, "-c", code],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    threads = [threading.Thread(target=fn) for fn in (closer, worker, renamed, notifier)]
    try:
        for thread in threads:
            thread.start()
        _spin(0.2)  # this process's main thread: the part of ``main``, as a mount's loop is
        assert helper.stdout is not None and helper.stdout.readline() == "spun\n"
        assert all(event.wait(30) for event in (ready, spun, renamed_spun, notified))
        assert Path(f"/proc/{helper.pid}/comm").read_text().strip() == WARMER
        after_split, after = _look()
    finally:
        done.set()
        for thread in threads:
            thread.join()
        helper.communicate("")
    parts = bench_loops.parts_between(before, after, PARTS, whole=WHOLE)
    assert 0.2 <= parts["closer"] < 0.5, parts  # the new closer's 0.3 s, not less the ended one's 0.3 s
    assert parts["read_ahead"] >= 0.2, parts    # the helper's whole: its start (an interpreter's) and its spin
    assert 0.5 <= parts["workers"] < 0.8, parts  # the unnamed thread's 0.3 s and the renamed one's, no notifier's
    assert 0.2 <= parts[LOOP] < 0.5, parts      # the main thread's spin, in nanoseconds
    # every thread together: the parts, the notifier's 0.3 s (in none), not the ended thread's
    named = sum(parts[kind] for kind in (*PARTS, LOOP))
    assert named + 0.25 <= parts[WHOLE] < named + 0.5, parts
    spent = {kind: after_split[kind] - before_split[kind] for kind in after_split}
    # This process's main thread is the only "loop" (its spin); the parts are in "other", not there.
    assert 0.15 <= spent["loop_user"] + spent["loop_sys"] < 0.5, spent
    assert spent["other_user"] + spent["other_sys"] >= sum(parts[kind] for kind in PARTS) - 0.05, (spent, parts)
