"""``mount --loops N``: several processes answer one mount (clones of its FUSE device). Real mounts read by real
clients: the bytes are the single loop's, opens of one file in several loops at once share its backing, a RELEASE
reaching another loop than the OPEN frees it, the sizes told agree across loops, a loop killed leaves the others
serving, a fixed mix serves each file alike in every loop, and the options that would need one loop's memory
are refused."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from fusehelpers import PASSTHROUGH_NEEDS_ROOT, Mount, daemon_pid, wait_for
from liquidfs.catalog.catalog import Catalog
from liquidfs.prepare import prepare
from trees import dataset_tree

pytestmark = [pytest.mark.fuse, PASSTHROUGH_NEEDS_ROOT]

LOOPS = 4


def stats(mnt: Path) -> dict:
    return json.loads(run_cli("stats", str(mnt), "--json").stdout)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("loops")
    src = dataset_tree(root / "data", count=24, width=256, height=128)
    store = root / "store"
    prepare(src, store, 1.0, progress=False)
    return src, store


def expected_bytes(src: Path, store: Path) -> dict[str, bytes]:
    """What one loop serves of each file: its raw object where it has one, else the source."""
    catalog = Catalog.open(store, readonly=True)
    try:
        return {os.fsdecode(n.path): (store / n.object).read_bytes() if n.object
                else (src / os.fsdecode(n.path)).read_bytes() for n in catalog.files()}
    finally:
        catalog.close()


def mount_loops(mounter: Mount, src: Path, store: Path, loops: int = LOOPS) -> Path:
    mnt = mounter.mount(src, "--loops", str(loops), "--data-path", "passthrough", store=store)
    values = stats(mnt)
    assert values["data_path"] == "passthrough", values["data_path_why"]
    assert len(values["loops"]) == loops, values["loops"]  # every loop answered the control file's gathering
    return mnt


def every_file_open_at_once(mnt: Path, want: dict[str, bytes], readers: int = 16, rounds: int = 3) -> None:
    """``readers`` threads, each ``rounds`` times holding every file open at once in its own order, then reading
    each whole: each inode has opens in several loops together, which the kernel allows only if they share one
    backing (EBUSY otherwise). Every file's bytes must be ``want``'s; a reader that fails or hangs fails."""
    wrong: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(readers)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        names = sorted(want)
        try:
            start.wait()
            for _ in range(rounds):
                rng.shuffle(names)
                files = [open(mnt / name, "rb") for name in names]
                try:
                    wrong.extend(name for name, f in zip(names, files) if f.read() != want[name])
                finally:
                    for f in files:
                        f.close()
        except BaseException as exc:  # reported below, with the others'
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not errors, errors[:3]
    assert not wrong, sorted(set(wrong))[:5]


def test_many_readers_get_the_single_loops_bytes_and_every_release_frees(prepared, mounter: Mount) -> None:
    src, store = prepared
    want = expected_bytes(src, store)
    mnt = mount_loops(mounter, src, store)
    pids = {loop["pid"] for loop in stats(mnt)["loops"]}
    assert len(pids) == LOOPS and daemon_pid(mnt) in pids
    for _ in range(10):  # whichever loop answers the control file, it names the mount's daemon: the others' parent
        found = stats(mnt)
        children = [loop["pid"] for loop in found["loops"] if loop["loop"]]
        assert all(_parent(pid) == found["pid"] for pid in children) and found["loops"][0]["pid"] == found["pid"]
    every_file_open_at_once(mnt, want)
    # A decoder sees the source's pixels (the mount's contract), whichever loop served.
    png = next(name for name in sorted(want) if name.endswith(".png"))
    with Image.open(mnt / png) as served, Image.open(src / png) as source:
        assert np.array_equal(np.asarray(served.convert("RGB")), np.asarray(source.convert("RGB")))

    def settled() -> bool:  # releases forwarded to the loop that opened are answered there, after the close
        values = stats(mnt)
        return values["open_files"] == 0 and values["passthrough_open_inodes"] == 0
    wait_for(settled, 30, what="every open file released in the loop that opened it")
    values = stats(mnt)
    opened = len(want) * 16 * 3
    assert values["opens"] >= opened and values["errors"] == 0 and values["fallbacks"] == 0
    busy = [loop for loop in values["loops"] if loop["opens"]]
    assert len(busy) >= 2, values["loops"]  # more than one loop answered opens
    assert values["loop_requests_forwarded"] > 0  # releases reached other loops than their open's


def test_a_fixed_mix_serves_each_file_alike_in_every_loop(prepared, mounter: Mount) -> None:
    """``--mix 0.5`` with four loops: each file is served as one loop serves it at that share (its raw object or
    its source, by its rank), whichever loop opens it; with every file open in 16 readers at once, opens of one
    file in several loops share one backing, which two representations could not (EIO); the mix's counts sum
    every loop's and its share is the one asked."""
    src, store = prepared
    raw = expected_bytes(src, store)  # a raw object where the file has one (every image), else the source
    images = [name for name in raw if raw[name] != (src / name).read_bytes()]
    one = mounter.mount(src, "--loops", "1", "--mix", "0.5", "--data-path", "passthrough", store=store)
    want = {name: (one / name).read_bytes() for name in raw}
    served_raw = sum(want[name] == raw[name] for name in images)
    assert 0 < served_raw < len(images), served_raw  # both representations at 0.5
    mnt = mounter.mount(src, "--loops", str(LOOPS), "--mix", "0.5", "--data-path", "passthrough", store=store)
    assert len(stats(mnt)["loops"]) == LOOPS
    # each loop built its own mix, and its log line says which loop it is (the loops share the mount's log)
    logged = (store / "mount.log").read_text()
    assert all(f"liquidfs.daemon.build[loop {i}]: mix: fixed, raw share 0.500" in logged for i in range(1, LOOPS))
    every_file_open_at_once(mnt, want)
    values = stats(mnt)
    assert values["errors"] == 0 and values["fallbacks"] == 0
    assert len([loop for loop in values["loops"] if loop["opens"]]) >= 2, values["loops"]
    mix = values["mix"]
    assert (mix["mode"], mix["share"], mix["prepared"]) == ("fixed", 0.5, 1.0)
    # every open of an image is the mix's, in whichever loop it was (the other files have no raw object)
    assert values["opens"] == len(want) * 16 * 3
    assert mix["opens_raw"] == served_raw * 16 * 3 and mix["opens_original"] == (len(images) - served_raw) * 16 * 3


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_changed_source_is_served_at_its_new_size_by_every_loop(prepared, tmp_path: Path,
                                                                  mounter: Mount) -> None:
    """A fallback's size is told once, by the loop that opened it; a lookup answered by any other loop after the
    kernel forgot the inode must say the same (else a reader stops at the catalog's size: wrong bytes)."""
    src0, store0 = prepared
    src, store = tmp_path / "data", tmp_path / "store"
    subprocess.run(["cp", "-a", str(src0), str(src)], check=True)
    prepare(src, store, 1.0, progress=False)
    rel = next(name for name in sorted(expected_bytes(src, store)) if name.endswith(".png"))
    mnt = mount_loops(mounter, src, store)
    with Image.open(src / rel) as im:
        im.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(src / rel, compress_level=1)
    new = (src / rel).read_bytes()
    assert (mnt / rel).read_bytes() == new  # the original, as it is now
    wait_for(lambda: os.stat(mnt / rel).st_size == len(new), 10, what="the size to follow what is served")
    for _ in range(12):
        # The kernel forgets the inode; its next lookup reaches whichever loop reads first.
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        assert os.stat(mnt / rel).st_size == len(new)
        with open(mnt / rel, "rb") as f:
            assert f.read() == new
    assert stats(mnt)["fallbacks"] >= 1


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_loop_killed_leaves_the_others_serving(prepared, mounter: Mount, signum: int) -> None:
    """A loop killed, or ended by SIGTERM (as ``loops.stop`` ends them: the first loop's handler, which only
    notes a signal until its loop unmounts, is not theirs)."""
    src, store = prepared
    want = expected_bytes(src, store)
    mnt = mount_loops(mounter, src, store, loops=3)
    first = daemon_pid(mnt)
    found = stats(mnt)["loops"]
    assert found[0] == {"loop": 0, "pid": first, "opens": found[0]["opens"]}  # the mount's daemon, whoever answered
    victim = found[2]["pid"]
    os.kill(victim, signum)
    wait_for(lambda: len(stats(mnt)["loops"]) == 2, 30, what="the killed loop left out")
    for _ in range(3):
        for name, data in want.items():
            assert (mnt / name).read_bytes() == data, name
    log = (store / "mount.log").read_text()
    assert f"(pid {victim}) ended (status -{int(signum)})" in log
    assert stats(mnt)["errors"] == 0


def test_a_terminals_ctrl_c_or_hangup_is_the_first_loops_to_decide(prepared, mounter: Mount) -> None:
    """Ctrl-C and a hangup reach a terminal's whole process group: a loop other than the first died of it with a
    traceback ("loop N failed") while the first went on serving. They leave it to the first, which unmounts and
    stops them."""
    src, store = prepared
    want = expected_bytes(src, store)
    mnt = mount_loops(mounter, src, store, loops=3)
    child = stats(mnt)["loops"][1]["pid"]
    for signum in (signal.SIGINT, signal.SIGHUP):
        os.kill(child, signum)
    for name, data in want.items():  # (a signal's default action ends a process at once: long before these)
        assert (mnt / name).read_bytes() == data, name
    state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state != "Z" and [loop["pid"] for loop in stats(mnt)["loops"]][1] == child
    assert "failed" not in (store / "mount.log").read_text()


def test_metrics_count_every_loops_opens(prepared, mounter: Mount) -> None:
    src, store = prepared
    want = expected_bytes(src, store)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mnt = mounter.mount(src, "--loops", str(LOOPS), "--data-path", "passthrough", "--metrics-port", str(port),
                        store=store)
    threads = [threading.Thread(target=lambda: [(mnt / name).read_bytes() for name in want]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    opened = 8 * len(want)
    assert len([loop for loop in stats(mnt)["loops"] if loop["opens"]]) >= 2

    def scraped_opens() -> float:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
        line = next(x for x in reply.decode().splitlines() if x.startswith("liquidfs_opens_total "))
        return float(line.split()[1])

    # the first loop's own opens at once, the others' as gathered every 2 s
    wait_for(lambda: scraped_opens() >= opened, 30, what="/metrics to count the opens of every loop")


@pytest.mark.parametrize("flags", [["--cache-size", "10%"], ["--mix", "adaptive"], ["--data-path", "daemon"],
                                   ["--loops", "33"]])
def test_options_one_loop_needs_are_refused(prepared, tmp_path: Path, flags: list[str]) -> None:
    src, store = prepared
    (tmp_path / "mnt").mkdir()
    args = ["--loops", "2", *flags] if flags[0] != "--loops" else flags
    done = subprocess.run([sys.executable, "-m", "liquidfs", "mount", str(src), str(tmp_path / "mnt"), "--store",
                           str(store), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--loops" in done.stderr and (flags[0] in done.stderr), done.stderr
    assert not os.path.ismount(tmp_path / "mnt")


def test_no_other_loop_holds_the_mount_commands_ready_pipe(prepared, mounter: Mount) -> None:
    """A fork keeps every descriptor: each loop held the pipe on which the first tells the mount command it is
    ready, for as long as the mount lived (the command, waiting on it, saw no end where the daemon died)."""
    src, store = prepared
    mnt = mounter.mountpoint()
    read_end, write_end = os.pipe()
    pipe = os.fstat(read_end).st_ino
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "liquidfs", "mount", str(src), str(mnt), "--store", str(store), "--foreground",
             "--ready-fd", str(write_end), "--loops", str(LOOPS), "--data-path", "passthrough"],
            pass_fds=(write_end,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        mounter.mountpoints.append(mnt)
        mounter.procs.append(proc)
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end, "rb") as ready:
            read_end = -1
            assert ready.readline().startswith(b"ready")
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    wait_for(lambda: len(stats(mnt)["loops"]) == LOOPS, 30, what="every loop to answer")
    held = []
    for loop in stats(mnt)["loops"]:
        for fd in os.listdir(f"/proc/{loop['pid']}/fd"):
            try:
                if os.readlink(f"/proc/{loop['pid']}/fd/{fd}") == f"pipe:[{pipe}]":
                    held.append((loop["loop"], fd))
            except FileNotFoundError:
                continue
    assert held == []
