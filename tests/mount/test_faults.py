"""Faults: concurrent readers, broken and hung storage, a killed daemon, hostile trees, other users.

Storage faults come from tests/support/faultfs.py, a FUSE passthrough under the source and the raw objects that answers
reads with EIO or never answers them, so liquidfs meets them through the kernel as it would meet a failing disk or
a hung NFS server.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from benchscripts import BENCH, load_script
from conftest import run_cli
from fusehelpers import DATA_PATHS, FUSERMOUNT, Mount, as_nobody, daemon_pid, is_mounted, wait_for
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import REPR_RAW, Node
from liquidfs.prepare import prepare
from sample import make_sample

pytestmark = pytest.mark.fuse

soak = load_script("soak", BENCH.parent / "attack")
FAULTFS = Path(__file__).parents[1] / "support" / "faultfs.py"
T = TypeVar("T")


def stats(mnt: Path) -> dict[str, object]:
    return json.loads((mnt / ".__liquidfs__").read_bytes())


def nodes(store: Path) -> tuple[list[Node], list[Node]]:
    """(files served raw, images served as originals) of a prepared store."""
    catalog = Catalog.open(store, readonly=True)
    try:
        files = [n for n in catalog.files() if n.path.endswith((b".png", b".jpg"))]
    finally:
        catalog.close()
    return [n for n in files if n.served_raw], [n for n in files if n.representation != REPR_RAW]


def log_lines(store: Path, *words: str) -> list[str]:
    return [line for line in (store / "mount.log").read_text(errors="replace").splitlines()
            if all(w in line for w in words)]


# -- many readers --------------------------------------------------------------------------------------------


def _prepared_mount(tmp_path: Path, mounter: Mount, count: int, seed: int,
                    jpeg_share: float = 0.0) -> tuple[Path, Path, Path, Path]:
    """A sample prepared at 0.5, mounted; (source, store, manifest of expected bytes, mount point)."""
    src = make_sample(tmp_path / "data", count=count, width=256, height=128, seed=seed, jpeg_share=jpeg_share)
    store = tmp_path / "store"
    prepare(src, store, 0.5, progress=False)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(soak.build_manifest(store)))
    return src, store, manifest, mounter.mount(src, store=store)


def test_sixteen_readers_and_one_killed(tmp_path: Path, mounter: Mount) -> None:
    src, _, manifest, mnt = _prepared_mount(tmp_path, mounter, count=32, seed=11, jpeg_share=0.25)
    pid = daemon_pid(mnt)
    summary = soak.soak(mnt, manifest, readers=16, seconds=10)
    assert summary["finished"] == 15, summary  # all but the one killed
    assert summary["mismatches"] == [] and summary["errors"] == [] and summary["disconnected"] == []
    assert summary["raw_reads"] > 0 and summary["decodes"] > 0
    assert summary["reads"] > summary["raw_reads"]  # originals were read too
    # the daemon kept serving: same process, nothing left open (the killed reader's files were released)
    assert daemon_pid(mnt) == pid
    wait_for(lambda: stats(mnt)["open_files"] == 0, 20, what="the killed reader's files to be released")
    assert stats(mnt)["errors"] == 0
    readme = (src / "README.txt").read_bytes()
    assert (mnt / "README.txt").read_bytes() == readme
    print(f"\nsoak: {summary['reads']} reads ({summary['raw_reads']} raw, {summary['decodes']} decodes), "
          f"{summary['bytes'] / 1e6:.0f} MB by 16 readers in 10 s")


# -- storage faults ------------------------------------------------------------------------------------------


@dataclass
class Faulty:
    real: Path   # what faultfs serves
    mnt: Path    # where it serves it
    rules: Path

    def set(self, **rules: object) -> None:
        tmp = self.rules.with_suffix(".tmp")
        tmp.write_text(json.dumps(rules))
        tmp.replace(self.rules)


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[Faulty]:
    real = tmp_path / "real"
    real.mkdir()
    mnt = tmp_path / "faulty"
    mnt.mkdir()
    fault = Faulty(real, mnt, tmp_path / "rules.json")
    fault.set()
    with open(tmp_path / "faultfs.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(FAULTFS), str(real), str(mnt), str(fault.rules)],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: is_mounted(mnt) or proc.poll() is not None, 30, what="faultfs to mount")
        assert proc.poll() is None, (tmp_path / "faultfs.log").read_text()
        yield fault
    finally:
        fault.set()  # hung reads finish
        subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Served:
    src: Path        # the source as liquidfs sees it (through faultfs)
    real_src: Path   # the same files, directly
    store: Path
    objects: Path    # the raw objects, directly
    mnt: Path
    raw: list[Node]
    originals: list[Node]

    def expected(self, node: Node) -> tuple[bytes, bytes | None]:
        """(the original's bytes, the raw object's bytes or None)."""
        original = (self.real_src / os.fsdecode(node.path)).read_bytes()
        raw = (self.objects.parent / str(node.object)).read_bytes() if node.served_raw else None
        return original, raw


def serve_through(faulty: Faulty, tmp_path: Path, mounter: Mount, *args: str) -> Served:
    """A prepared sample whose source and raw objects are both read through faultfs."""
    make_sample(faulty.real / "data", count=10, width=256, height=128, seed=5)
    src = faulty.mnt / "data"
    store = tmp_path / "store"
    prepare(src, store, 0.5, progress=False)
    (store / "objects").rename(faulty.real / "objects")
    (store / "objects").symlink_to(faulty.mnt / "objects")
    raw, originals = nodes(store)
    assert len(raw) >= 3 and len(originals) >= 3
    mnt = mounter.mount(src, "--io-timeout", "1", "--threads", "2", *args, store=store)
    return Served(src, faulty.real / "data", store, faulty.real / "objects", mnt, raw, originals)


def test_raw_object_eio_midway_serves_the_original(faulty: Faulty, tmp_path: Path, mounter: Mount) -> None:
    s = serve_through(faulty, tmp_path, mounter)
    pid = daemon_pid(s.mnt)
    broken, fine = s.raw[0], s.raw[1]
    original, raw = s.expected(broken)
    assert raw is not None and len(raw) > 64 * 1024
    # the object's first 32 KiB read fine, the rest fails: the checksum never sees a whole object
    faulty.set(eio=[os.fsdecode(broken.object)], eio_after=32 * 1024)
    rel = os.fsdecode(broken.path)
    for _ in range(3):
        assert (s.mnt / rel).read_bytes() == original
    assert (s.mnt / os.fsdecode(fine.path)).read_bytes() == s.expected(fine)[1]
    values = stats(s.mnt)
    assert values["fallbacks"] == 1 and values["errors"] == 0 and values["pid"] == pid
    assert len(log_lines(s.store, rel, "raw object unreadable", "serving the original")) == 1
    # the storage heals: the raw object is served again
    faulty.set()
    assert (s.mnt / rel).read_bytes() == raw


def test_raw_object_vanishes_or_shrinks_after_being_served(faulty: Faulty, tmp_path: Path,
                                                           mounter: Mount) -> None:
    s = serve_through(faulty, tmp_path, mounter)
    gone, shrunk = s.raw[0], s.raw[1]
    for node in (gone, shrunk):
        assert (s.mnt / os.fsdecode(node.path)).read_bytes() == s.expected(node)[1]
    originals = {n.id: s.expected(n)[0] for n in (gone, shrunk)}
    (s.objects.parent / str(gone.object)).unlink()
    obj = s.objects.parent / str(shrunk.object)
    os.truncate(obj, obj.stat().st_size // 2)
    for _ in range(2):
        for node in (gone, shrunk):
            rel = os.fsdecode(node.path)
            assert (s.mnt / rel).read_bytes() == originals[node.id], rel
            wait_for(lambda: os.stat(s.mnt / rel).st_size == len(originals[node.id]), 10,
                     what="the size to follow what is served")
    values = stats(s.mnt)
    assert values["fallbacks"] == 2 and values["errors"] == 0
    assert len(log_lines(s.store, os.fsdecode(gone.path), "raw object missing")) == 1
    assert len(log_lines(s.store, os.fsdecode(shrunk.path), "serving the original")) == 1


@pytest.mark.parametrize("data_path", ["passthrough", "daemon"])
def test_raw_object_open_out_of_descriptors_fails_that_open_only(tmp_path: Path, mounter: Mount,
                                                                 data_path: str) -> None:
    """The daemon out of descriptors (EMFILE) at an open says nothing about the file: that open fails with the
    errno, the file is not served as its original (no fallback counted, no warning), and an open still reading
    the raw object goes on reading it (served as the original, the failed open would supersede it: its further
    reads failing). Which of the open's descriptors is refused (the source's check, the object's) is the unit
    tests' (``test_whole_reads``): here the daemon has none at all."""
    src = make_sample(tmp_path / "data", count=6, width=256, height=128, seed=8)
    store = tmp_path / "store"
    prepare(src, store, 0.5, progress=False)
    mnt = mounter.mount(src, "--data-path", data_path, store=store)
    assert stats(mnt)["data_path"] == data_path
    raw, _ = nodes(store)
    held, cold = raw[0], raw[1]
    raws = {n.id: (store / str(n.object)).read_bytes() for n in (held, cold)}
    pid = daemon_pid(mnt)
    fd = os.open(mnt / os.fsdecode(held.path), os.O_RDONLY)
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        head = os.pread(fd, 1000, 0)
        # No descriptor left to open (a limit bounds the numbers, and the lowest free one is taken: none now)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (0, limits[1]))
        # (passthrough: the open file's backing serves its inode's further opens, the object is not opened again)
        failing = [cold, cold] + ([held] if data_path == "daemon" else [])
        for node in failing:
            with pytest.raises(OSError) as info:
                (mnt / os.fsdecode(node.path)).read_bytes()
            assert info.value.errno == errno.EMFILE, node.path
        rest = b""
        while chunk := os.pread(fd, 1 << 16, len(head) + len(rest)):
            rest += chunk
        assert head + rest == raws[held.id]
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
        os.close(fd)
    for node in (held, cold):
        assert (mnt / os.fsdecode(node.path)).read_bytes() == raws[node.id]
    values = stats(mnt)
    assert values["fallbacks"] == 0 and values["errors"] >= len(failing) and values["pid"] == pid
    for node in (held, cold):
        assert not log_lines(store, os.fsdecode(node.path), "serving the original")


def test_raw_object_on_fuse_out_of_files_serves_the_original(faulty: Faulty, tmp_path: Path, mounter: Mount) -> None:
    """Where the objects are not local (here on a FUSE filesystem), ENFILE may be its server's own answer, not this
    daemon's want: the original is served, as for any object that cannot be read."""
    s = serve_through(faulty, tmp_path, mounter)
    node = s.raw[0]
    original, raw = s.expected(node)
    rel = os.fsdecode(node.path)
    faulty.set(fail_open=[os.fsdecode(node.object)], open_errno="ENFILE")
    assert (s.mnt / rel).read_bytes() == original
    assert stats(s.mnt)["fallbacks"] == 1
    assert len(log_lines(s.store, rel, "raw object unreadable", "serving the original")) == 1
    faulty.set()
    wait_for(lambda: (s.mnt / rel).read_bytes() == raw, 10, what="the raw object served again")


def test_source_eio_or_deleted_fails_that_file_only(faulty: Faulty, tmp_path: Path, mounter: Mount) -> None:
    s = serve_through(faulty, tmp_path, mounter)
    pid = daemon_pid(s.mnt)
    bad, deleted = s.originals[0], s.raw[0]
    faulty.set(eio=[os.fsdecode(bad.path)], eio_after=16 * 1024)
    (s.real_src / os.fsdecode(deleted.path)).unlink()
    for _ in range(2):
        with pytest.raises(OSError) as info:
            (s.mnt / os.fsdecode(bad.path)).read_bytes()
        assert info.value.errno == errno.EIO
        with pytest.raises(OSError) as info:
            (s.mnt / os.fsdecode(deleted.path)).read_bytes()
        assert info.value.errno in (errno.ENOENT, errno.EIO)
    for node in s.raw[1:] + s.originals[1:]:
        original, raw = s.expected(node)
        assert (s.mnt / os.fsdecode(node.path)).read_bytes() == (raw if raw is not None else original)
    values = stats(s.mnt)
    assert values["pid"] == pid
    if values["data_path"] == "daemon":
        assert values["errors"] == 4
        assert len(log_lines(s.store, os.fsdecode(bad.path), "Input/output error")) == 1
    else:  # the kernel reads the source itself: its EIO goes to the reader, the daemon never sees it
        assert values["errors"] == 2 and values["read_requests"] == 0
    assert len(log_lines(s.store, os.fsdecode(deleted.path), "No such file")) == 1


def _answered(fn: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """``fn()``, called in a thread of its own, so that a mount that stopped answering fails the test instead of
    hanging it. The timeout is only that guard: an answering mount replies in milliseconds."""
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert result, f"{what}: no answer within {timeout:g} s"
    return result[0]


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_opens_stuck_in_storage_never_take_every_worker(faulty: Faulty, tmp_path: Path, mounter: Mount,
                                                        data_path: str) -> None:
    """With 120 opens waiting for a hung storage, every pyfuse3 worker waited with them and an `ls` of another
    directory timed out. Opens in flight are bounded well below the workers: listings, stats and the control
    file are still answered."""
    # --io-timeout: nothing times out meanwhile
    s = serve_through(faulty, tmp_path, mounter, "--io-timeout", "120", "--data-path", data_path)
    files = [s.mnt / os.fsdecode(n.path) for n in s.raw + s.originals]
    for path in files:  # looked up now: the openers below wait for storage only, not for a lookup
        os.stat(path)
    faulty.set(hang_open=["data/", "objects/"], hang=["data/", "objects/"])
    failed: list[int] = []

    def open_one(path: Path) -> None:
        try:
            os.close(os.open(path, os.O_RDONLY))
        except OSError as exc:
            failed.append(exc.errno or 0)

    openers = [threading.Thread(target=open_one, args=(files[i % len(files)],), daemon=True) for i in range(120)]
    try:
        for thread in openers:
            thread.start()
        wait_for(lambda: _answered(lambda: stats(s.mnt), "the control file")["opens_in_flight"] >= 110, 60,
                 what="the opens to wait for storage in the daemon")
        # a directory not listed before (no listing of it cached) and files not looked up before
        assert _answered(lambda: os.listdir(s.mnt / "leftImg8bit"), "a listing") == ["train"]
        assert _answered(lambda: os.stat(s.mnt / "README.txt").st_size, "a stat") > 0
        assert _answered(lambda: os.stat(s.mnt / "meta.json").st_size, "a stat") > 0
        values = _answered(lambda: stats(s.mnt), "the control file")
        assert values["opens_in_flight"] >= 110 and values["opens_refused"] == 0 and values["errors"] == 0
    finally:
        faulty.set()  # the storage answers again: every open is served
        for thread in openers:
            thread.join(60)
    assert not failed and not any(t.is_alive() for t in openers)
    wait_for(lambda: stats(s.mnt)["opens_in_flight"] == 0, 30, what="the opens to be answered")


def test_hung_storage_answers_eio_and_the_mount_goes_on(faulty: Faulty, tmp_path: Path, mounter: Mount) -> None:
    s = serve_through(faulty, tmp_path, mounter)  # --io-timeout 1 --threads 2
    hung = s.raw[:3]
    faulty.set(hang=[os.fsdecode(n.object) for n in hung])
    # three hung files, more than the two threads: each gives its thread back when it times out
    for node in hung:
        with pytest.raises(OSError) as info:
            (s.mnt / os.fsdecode(node.path)).read_bytes()
        assert info.value.errno == errno.EIO
    assert stats(s.mnt)["stuck_reads"] == 3
    for node in s.originals + s.raw[3:]:
        original, raw = s.expected(node)
        assert (s.mnt / os.fsdecode(node.path)).read_bytes() == (raw if raw is not None else original)
    # a retry of a file whose read is still stuck fails at once instead of parking another thread
    with pytest.raises(OSError) as info:
        (s.mnt / os.fsdecode(hung[0].path)).read_bytes()
    assert info.value.errno == errno.EIO
    assert len(log_lines(s.store, os.fsdecode(hung[0].path), "did not answer within 1 s")) == 1
    # the storage answers again: the stuck threads finish and the files are served
    faulty.set()
    wait_for(lambda: stats(s.mnt)["stuck_reads"] == 0, 20, what="the stuck reads to finish")
    for node in hung:
        assert (s.mnt / os.fsdecode(node.path)).read_bytes() == s.expected(node)[1]
    assert stats(s.mnt)["errors"] == 4


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_an_open_waiting_on_storage_holds_up_nothing_else(faulty: Faulty, tmp_path: Path, mounter: Mount,
                                                          data_path: str) -> None:
    """A cold open walks and opens the source in a worker thread (on the loop only what the kernel's caches
    answer): one whose storage does not answer must leave every other request answered -- ``ls``, ``stat``, the
    other files' bytes, the stats. Were that open done on the loop (issue 28's levers move work onto it), all
    of them would wait with it."""
    s = serve_through(faulty, tmp_path, mounter, "--io-timeout", "60", "--data-path", data_path)
    hung = s.originals[0]
    faulty.set(hang_open=[os.fsdecode(hung.path)])
    control = ["cat", str(s.mnt / ".__liquidfs__")]
    opens_before = json.loads(_within(control))["requests"]["open"]["count"]
    waiting = subprocess.Popen(["cat", str(s.mnt / os.fsdecode(hung.path))], stdout=subprocess.PIPE)
    try:
        wait_for(lambda: json.loads(_within(control))["requests"]["open"]["count"] > opens_before, 10,
                 what="the open to reach the daemon")
        listing = _within(["ls", "-R", str(s.mnt)])
        assert os.path.basename(os.fsdecode(hung.path)).encode() in listing
        for node in s.raw + s.originals[1:]:
            path = s.mnt / os.fsdecode(node.path)
            _within(["stat", str(path)])
            original, raw = s.expected(node)
            assert _within(["cat", str(path)]) == (raw if raw is not None else original), node.path
        _within(control)
        # the open waited all along: what was checked above ran beside it, not after it
        assert waiting.poll() is None, "the hung open finished early: nothing was checked beside it"
    finally:
        faulty.set()
    out, _ = waiting.communicate(timeout=60)
    assert waiting.returncode == 0 and out == s.expected(hung)[0]


def _within(cmd: list[str], seconds: float = 20) -> bytes:
    """``cmd``'s output; a failure if it does not finish within ``seconds`` (the mount is held up)."""
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)} did not answer within {seconds:g} s: the mount is held up")
    assert done.returncode == 0, (cmd, done.stderr)
    return done.stdout


# -- the daemon killed during reads --------------------------------------------------------------------------


def test_daemon_killed_during_reads(tmp_path: Path, mounter: Mount) -> None:
    src, store, manifest, mnt = _prepared_mount(tmp_path, mounter, count=12, seed=2)
    pid = daemon_pid(mnt)
    # a process that only holds a file open on the mount, as a stuck loader worker would
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'rb'); "
                               "print('open', flush=True); time.sleep(120)", str(mnt / "README.txt")],
                              stdout=subprocess.PIPE, text=True)
    readers = soak.start_readers(mnt, manifest, 4, seconds=120)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        wait_for(lambda: stats(mnt)["opens"] >= 50, 60, what="the readers to be reading")
        os.kill(pid, signal.SIGKILL)
        # every reader stops with ENOTCONN / ECONNABORTED: none hangs, none reads wrong bytes
        results = soak.collect(readers, timeout=60)
    finally:
        for proc in readers + [holder]:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for r in results:
        assert r is not None and r["disconnected"] in soak.DISCONNECTED, r
        assert r["mismatches"] == [] and r["errors"] == [], r
    assert sum(r["reads"] for r in results if r) >= 40
    # mounting again recovers the mount point, though a process still held a file on the dead mount
    mounter.mount(src, mountpoint=mnt, store=store)
    assert daemon_pid(mnt) != pid
    assert (mnt / "README.txt").read_bytes() == (src / "README.txt").read_bytes()


def _watchdogs(pid: int) -> list[int]:
    found = []
    for proc in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{proc}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"liquidfs.daemon.watchdog" in cmd and cmd[cmd.index(b"liquidfs.daemon.watchdog") + 1] == str(pid).encode():
            found.append(int(proc))
    return found


def test_a_dying_daemon_is_recognised() -> None:
    from liquidfs.daemon.watchdog import dying

    alive = "Name:\tpython\nState:\tS (sleeping)\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n"
    killed = alive.replace("ShdPnd:\t0000000000000000", "ShdPnd:\t0000000000000100")  # SIGKILL is bit 9
    thread_killed = alive.replace("SigPnd:\t0000000000000000", "SigPnd:\t0000000000000100")
    leader_gone = alive.replace("S (sleeping)", "Z (zombie)")
    assert not dying([alive, alive])
    assert dying([killed, alive]) and dying([alive, thread_killed]) and dying([leader_gone, alive])
    assert not dying([alive, leader_gone])  # only the main thread's state says the process is exiting
    assert not dying([alive.replace("ShdPnd:\t0000000000000000", "ShdPnd:\t0000000000004000")])  # SIGTERM


@pytest.mark.needs_root("the watchdog (fusectl's abort files are root's)")
def test_the_watchdog_aborts_the_connection_and_leaves_with_the_daemon(tmp_path: Path, mounter: Mount) -> None:
    """A killed daemon with a thread stuck in the kernel never closes /dev/fuse (readers would hang): a watchdog
    process beside it aborts the connection. Its abort on a live mount shows what readers then get; it leaves
    when the daemon does."""
    from liquidfs.daemon.watchdog import abort, connection_of, kernel_device

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(100_000))
    # the daemon path: a passthrough file's reads never need the daemon, so an abort does not fail them
    mnt = mounter.mount(src, "--data-path", "daemon")
    pid = daemon_pid(mnt)
    wait_for(lambda: len(_watchdogs(pid)) == 1, 10, what="the watchdog to start")
    [watchdog] = _watchdogs(pid)
    assert Path(f"/proc/{watchdog}/cwd").resolve() == Path("/")  # it keeps nothing of the mount busy
    connection = connection_of(mnt)
    device = os.stat(mnt).st_dev  # glibc's numbering: fusectl names the kernel's
    assert connection is not None and connection == kernel_device(os.major(device), os.minor(device))
    fd = os.open(mnt / "a.bin", os.O_RDONLY)
    try:
        assert abort(connection)
        with pytest.raises(OSError) as info:
            os.read(fd, 4096)
        assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    finally:
        try:
            os.close(fd)
        except OSError:  # its flush fails the same way
            pass
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or _state(pid) == "Z", 10, what="the daemon to exit")
    wait_for(lambda: not _watchdogs(pid), 10, what="the watchdog to leave with it")
    mounter.mount(src, mountpoint=mnt)  # the mount point is recovered
    assert (mnt / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
    new = daemon_pid(mnt)
    wait_for(lambda: len(_watchdogs(new)) == 1, 10, what="the new daemon's watchdog")
    run_cli("umount", str(mnt))
    wait_for(lambda: not _watchdogs(new), 10, what="the watchdog to leave at unmount")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# -- hostile trees -------------------------------------------------------------------------------------------


HOSTILE = [b"..foo", b"...", b".. ", b"\xff\xfe.png", b"ctl\x01\x1b[31m\x7f.txt", b"tab\there", b"nl\nname",
           b"\xc3\x28 bad-utf8", b" leading space", b"-rf", b"*?[x]"]


def test_hostile_names_and_symlinks(tmp_path: Path, mounter: Mount) -> None:
    src = tmp_path / "data"
    src.mkdir()
    root = os.fsencode(src)
    for i, name in enumerate(HOSTILE):
        fd = os.open(os.path.join(root, name), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"%d:" % i + name * 50)
        os.close(fd)
    odd_dir = os.path.join(root, b"dir\xff\x01")
    os.mkdir(odd_dir)
    with open(os.path.join(odd_dir, b"..."), "wb") as f:
        f.write(b"inside an odd directory\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("never through liquidfs\n")
    os.symlink(outside / "secret.txt", src / "abs-out")
    os.symlink("../outside/secret.txt", src / "rel-out")
    os.symlink("../outside", src / "dir-out")
    (src / "swap-me.txt").write_text("a plain file at scan time\n")
    (src / "swap-dir").mkdir()
    (src / "swap-dir" / "secret.txt").write_text("a plain file at scan time too\n")

    mnt = mounter.mount(src)
    mroot = os.fsencode(mnt)
    assert sorted(os.listdir(mroot)) == sorted(os.listdir(root))
    for name in HOSTILE + [b"dir\xff\x01/..."]:
        ours, theirs = os.path.join(mroot, name), os.path.join(root, name)
        st = os.stat(ours)
        assert (st.st_size, st.st_mtime_ns) == (os.stat(theirs).st_size, os.stat(theirs).st_mtime_ns), name
        with open(ours, "rb") as a, open(theirs, "rb") as b:
            assert a.read() == b.read(), name
    # a real client on the odd names too: find lists them all, exactly
    listing = subprocess.run(["find", ".", "-print0"], cwd=mnt, capture_output=True, check=True).stdout
    expected = subprocess.run(["find", ".", "-print0"], cwd=src, capture_output=True, check=True).stdout
    assert sorted(listing.split(b"\0")) == sorted(expected.split(b"\0"))
    # symlinks out of the tree are shown as symlinks, with their targets verbatim
    for link in ("abs-out", "rel-out", "dir-out"):
        assert (mnt / link).is_symlink() and os.readlink(mnt / link) == os.readlink(src / link)
    assert not any(p.name == "secret.txt" for p in Path(mnt).rglob("*") if "swap-dir" not in str(p))
    # a file, and a directory, swapped for symlinks out of the tree after the scan: liquidfs never follows them
    (src / "swap-me.txt").unlink()
    os.symlink(outside / "secret.txt", src / "swap-me.txt")
    shutil.rmtree(src / "swap-dir")
    os.symlink(outside, src / "swap-dir")
    for rel in ("swap-me.txt", "swap-dir/secret.txt"):
        with pytest.raises(OSError) as info:
            (mnt / rel).read_bytes()
        assert info.value.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.EIO), rel
    assert stats(mnt)["pid"] == daemon_pid(mnt)


# -- other users ---------------------------------------------------------------------------------------------


def test_other_users(public_dir: Path, tmp_path: Path, mounter: Mount) -> None:
    src = tmp_path / "data"
    src.mkdir()
    (src / "public.txt").write_text("for everyone\n")
    (src / "private.txt").write_text("for the owner only\n")
    src.chmod(0o755)
    (src / "public.txt").chmod(0o644)
    (src / "private.txt").chmod(0o600)
    assert as_nobody("stat", str(public_dir)).returncode == 0  # the path to the mount points is open to nobody

    private_mount = public_dir / "private"
    private_mount.mkdir()
    mounter.mount(src, mountpoint=private_mount)
    denied = as_nobody("cat", str(private_mount / "public.txt"))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    assert (private_mount / "public.txt").read_text() == "for everyone\n"  # the owner (root) reads

    shared = public_dir / "shared"
    shared.mkdir()
    mounter.mount(src, "--allow-other", mountpoint=shared)
    ok = as_nobody("cat", str(shared / "public.txt"))
    assert ok.returncode == 0 and ok.stdout == "for everyone\n", ok
    private = as_nobody("cat", str(shared / "private.txt"))
    assert private.returncode != 0 and "Permission denied" in private.stderr, private
    listing = as_nobody("ls", str(shared))
    assert listing.returncode == 0 and listing.stdout.split() == ["private.txt", "public.txt"]
    assert run_cli("stats", str(shared), "--probe").returncode == 0


def test_warmup_runs_after_the_mount_answers(faulty: Faulty, tmp_path: Path, mounter: Mount) -> None:
    """--warmup used to run before the mount reported ready, and `liquidfs mount` gives up on a daemon after
    120 s: a dataset slow to warm made a dead mount. The warm-up now starts once the mount answers, with its
    progress in stats; here it meets hung storage (each read waits --io-timeout) and the mount answers anyway."""
    s = serve_through(faulty, tmp_path, mounter)
    faulty.set(hang=[os.fsdecode(n.object) for n in s.raw])
    mnt = mounter.mount(s.src, "--cache-size", "100%", "--warmup", "--io-timeout", "2", "--threads", "2",
                        store=s.store)
    assert stats(mnt)["warmup"] == "running"  # answered while the warm-up waits for the storage
    node = s.originals[0]
    assert (mnt / os.fsdecode(node.path)).read_bytes() == s.expected(node)[0]
    faulty.set()
    wait_for(lambda: stats(mnt)["warmup"] == "done", 120, what="the warm-up to finish")
    assert stats(mnt)["warmup_files"] >= len(s.originals) - 1
