"""The daemon's threads named for the system: what ``top -H`` and ``bench_opens.py``'s split of the CPU see."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from liquidfs.datapath.backing import Closer
from liquidfs.fuse.warm_helper import WarmHelper
from liquidfs.sysio.thread_names import CLOSER, NAME_MAX, WARMER, name_this_thread


def _comm(pid: int, tid: int | None = None) -> str:
    return Path(f"/proc/{pid}/task/{tid or pid}/comm").read_text().rstrip("\n")


def test_a_thread_named_is_named_for_the_system_cut_to_what_the_kernel_keeps() -> None:
    seen: dict[str, str] = {}

    def named(name: str) -> None:
        name_this_thread(name)
        seen[name] = _comm(os.getpid(), threading.get_native_id())

    for name in ("liquidfs-close", "liquidfs-a-name-too-long-to-keep"):
        thread = threading.Thread(target=named, args=(name,))
        thread.start()
        thread.join()
    assert seen == {"liquidfs-close": "liquidfs-close", "liquidfs-a-name-too-long-to-keep": "liquidfs-a-name"}
    assert len(seen["liquidfs-a-name-too-long-to-keep"]) == NAME_MAX
    assert _comm(os.getpid(), threading.get_native_id()) != "liquidfs-close"  # this thread's own name unchanged


def test_the_closer_and_the_read_aheads_helper_carry_their_names(tmp_path: Path) -> None:
    closer = Closer()
    closer.close(os.open(tmp_path, os.O_RDONLY), drop=False)  # at once: its thread names itself before it closes
    try:
        deadline = time.monotonic() + 30
        while closer.closed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closer._thread is not None and closer._thread.native_id is not None and closer.closed == 1
        assert _comm(os.getpid(), closer._thread.native_id) == CLOSER
    finally:
        closer.stop()
    (tmp_path / "file").write_bytes(b"x")
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    helper = WarmHelper([root], 2)
    try:
        assert helper.warm([[(root, b"file")], [(root, b"gone")]]) == 1  # answered: its main ran, its pool started
        tasks = sorted(Path(f"/proc/{helper.pid}/task").iterdir())
        assert len(tasks) >= 2 and {_comm(helper.pid, int(t.name)) for t in tasks} == {WARMER}
    finally:
        helper.close()
        os.close(root)
