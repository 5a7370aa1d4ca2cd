"""``bench_loops.cpu_split``, which ``bench_opens.py`` splits a daemon's CPU with: a thread is counted in the part
its name says (one without a name of its own in the worker threads'), a process whose main thread is so named (the
read-ahead's helper) whole, and no part's time is counted as the loop's. Measured on this test's own threads and children, never on the machine's counters."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import bench_loops
from bench_opens import PARTS, UNNAMED

from liquidfs.sysio.thread_names import CLOSER, WARMER, name_this_thread


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_threads_and_a_helper_process_are_counted_in_the_parts_their_names_say() -> None:
    ready, spun, done = threading.Event(), threading.Event(), threading.Event()

    def closer() -> None:
        name_this_thread(CLOSER)
        _spin(0.3)
        ready.set()
        done.wait(30)

    def worker() -> None:  # a thread with no name of its own (trio's worker threads, for bench_opens)
        _spin(0.3)
        spun.set()
        done.wait(30)

    # A child of this process named as the read-ahead's helper names itself: counted whole, never as a loop.
    helper = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from liquidfs.sysio.thread_names import WARMER, name_this_thread\n"
                               "name_this_thread(WARMER); end = time.process_time() + 0.3\n"
                               "while time.process_time() < end: pass\n"
                               "print('spun', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    threads = [threading.Thread(target=closer), threading.Thread(target=worker)]
    try:
        before = bench_loops.cpu_split([os.getpid()], children=True, parts=PARTS, unnamed=UNNAMED)
        for thread in threads:
            thread.start()
        assert helper.stdout is not None and helper.stdout.readline() == "spun\n"
        assert ready.wait(30) and spun.wait(30)
        assert Path(f"/proc/{helper.pid}/comm").read_text().strip() == WARMER
        after = bench_loops.cpu_split([os.getpid()], children=True, parts=PARTS, unnamed=UNNAMED)
    finally:
        done.set()
        for thread in threads:
            thread.join()
        helper.communicate("")
    spent = {kind: after[kind] - before[kind] for kind in after}
    assert spent["closer"] >= 0.2, spent
    assert spent["read_ahead"] >= 0.2, spent  # the helper's whole: its start (an interpreter's) and its spin
    assert spent["workers"] >= 0.2, spent
    # This process's main thread is the only "loop": it waited meanwhile; the parts are in "other", not there.
    assert spent["loop_user"] + spent["loop_sys"] < 0.2, spent
    assert spent["other_user"] + spent["other_sys"] >= spent["closer"] + spent["read_ahead"] + spent["workers"] - 0.05, \
        spent
