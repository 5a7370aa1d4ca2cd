"""The metadata read-ahead's helper process (``fuse.warm_helper``): it warms what an open walks, refuses what it
was not handed, is checked for what it answers, ends with its input; and the read-ahead goes on in the daemon's
own threads when it fails (``lookahead.MetadataAhead``)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from liquidfs.catalog.build import build
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import KIND_FILE, ROOT_ID, Node
from liquidfs.fuse import lookahead, warm_helper
from liquidfs.fuse.lookahead import MetadataAhead
from liquidfs.fuse.warm_helper import HelperFailed, WarmHelper, parse, runs
from liquidfs.stores.local.reader import StoreReader


def _tree(tmp_path: Path, files: int = 5) -> tuple[Catalog, StoreReader]:
    src = tmp_path / "src"
    (src / "d0").mkdir(parents=True)
    for f in range(files):
        (src / "d0" / f"f{f}.bin").write_bytes(b"x" * 100)
    build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    return catalog, StoreReader(catalog.source, tmp_path / "store")


def _files(catalog: Catalog) -> list[Node]:
    d0 = catalog.lookup(ROOT_ID, b"d0")
    assert d0 is not None
    return [node for node in catalog.children(d0.id) if node.kind == KIND_FILE]


# One thread: the batch warmed in its order; more: each a run of neighbours (``warm_helper.runs``), at once.
@pytest.mark.needs_root("/proc/sys/vm/drop_caches")
@pytest.mark.parametrize("threads", [1, 4])
def test_the_helper_warms_what_an_open_on_the_loop_walks(tmp_path: Path, threads: int) -> None:
    catalog, reader = _tree(tmp_path, files=3)
    nodes = _files(catalog)
    helper = WarmHelper(reader.warm_descriptors, threads)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("2\n")  # dentries and inodes
        with pytest.raises(BlockingIOError):
            reader.open_source(nodes[0], cached_only=True)  # cold: the loop would hand this open to a thread
        assert helper.warm([reader.warm_walks(node) for node in nodes]) == len(nodes)
        for node in nodes:
            os.close(reader.open_source(node, cached_only=True))  # warm: answered on the loop
    finally:
        helper.close()
        reader.close()


@pytest.mark.needs_root("/proc/sys/vm/drop_caches")
def test_the_helper_warms_raw_objects_and_walks_no_object_an_open_would_refuse(tmp_path: Path) -> None:
    from dataclasses import replace

    from liquidfs.prepare import prepare
    from sample import make_sample

    src = make_sample(tmp_path / "src", count=3, width=256, height=128, seed=8)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    raw = [n for n in catalog.files() if n.served_raw]
    reader = StoreReader(catalog.source, store)
    assert len(raw) == 3 and len(reader.warm_descriptors) == 2
    # A row pointing at another image's object: an open refuses it, so the read-ahead walks only the source.
    assert raw[1].object is not None
    swapped = replace(raw[0], object=raw[1].object)
    assert reader.warm_walks(swapped) == [(reader.root_fd, raw[0].path)]
    helper = WarmHelper(reader.warm_descriptors, 4)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        with pytest.raises(BlockingIOError):
            reader.open_object(raw[0], cached_only=True)
        assert helper.warm([reader.warm_walks(node) for node in raw]) == 3
        for node in raw:  # the source and the object, both as an open on the loop walks them
            os.close(reader.open_source(node, cached_only=True))
            os.close(reader.open_object(node, cached_only=True))
    finally:
        helper.close()
        reader.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_helper_refuses_what_it_was_not_handed(tmp_path: Path, threads: int) -> None:
    catalog, reader = _tree(tmp_path, files=1)
    (tmp_path / "src" / "d0" / "link").symlink_to(tmp_path / "store")  # a link an open never follows
    (tmp_path / "outside.bin").write_bytes(b"y")
    other = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)  # a descriptor the helper was not handed
    helper = WarmHelper(reader.warm_descriptors, threads)
    try:
        good = reader.warm_walks(_files(catalog)[0])
        batch = [[(other, b"outside.bin")], [(reader.root_fd, b"d0/../../outside.bin")],
                 [(reader.root_fd, b"d0/link/catalog.sqlite")], good + [(other, b"outside.bin")], good]
        assert helper.warm(batch) == 1  # only the file whose every walk is below a root it was handed
        assert helper.warm([good, good]) == 2  # and it goes on
    finally:
        helper.close()
        os.close(other)
        reader.close()


def test_a_batch_is_cut_into_runs_of_neighbours_one_per_thread_at_most() -> None:
    # Each thread warms files that are neighbours in the directory's order (their inodes share blocks on disk),
    # not every n-th file: threads on the same blocks only contended for them.
    batch = [[(3, b"f%d" % i)] for i in range(10)]
    assert runs(batch, 1) == [batch]
    assert runs(batch, 4) == [batch[0:3], batch[3:6], batch[6:9], batch[9:]]
    assert runs(batch, 16) == [[walks] for walks in batch]
    assert runs([], 8) == []
    for count in (1, 3, 8):
        assert [walks for run in runs(batch, count) for walks in run] == batch


def test_a_line_is_read_as_no_more_than_it_says() -> None:
    allowed = frozenset({7, 9})
    assert parse(b"7:6130 9:622f63\n", allowed) == [(7, b"a0"), (9, b"b/c")]
    for line in (b"\n", b"7\n", b"7:zz\n", b"x:61\n", b"-7:61\n", b"8:61\n", b"7:61 8:61\n", b"7:\xff\n"):
        assert parse(line, allowed) is None, line


def test_an_answer_the_helper_cannot_have_meant_fails_it(tmp_path: Path) -> None:
    catalog, reader = _tree(tmp_path, files=2)
    walks = [reader.warm_walks(node) for node in _files(catalog)]
    for answer in (b"3\n", b"-1\n", b"two\n", b""):
        helper = WarmHelper(reader.warm_descriptors, 1)
        real = helper._from
        try:
            helper._from = io.BytesIO(answer)  # what a broken or impostor helper might say
            with pytest.raises(HelperFailed):
                helper.warm(walks)
        finally:
            helper._from = real
            helper.close()
    reader.close()


def test_the_helper_ends_with_its_input(tmp_path: Path) -> None:
    catalog, reader = _tree(tmp_path, files=1)
    ahead = MetadataAhead(catalog.path, reader.warm, walks=reader.warm_walks, descriptors=reader.warm_descriptors)
    ahead.start()
    helper = ahead._helper
    assert helper is not None and ahead.statistics().values()["lookahead_helper"] == 1
    ahead.stop()
    assert helper._process.poll() == 0  # it ended on the end of its input, and stop() waited for it
    assert ahead.statistics().values()["lookahead_helper"] == 0
    reader.close()


def test_a_helper_that_never_answers_holds_up_no_unmount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    catalog, reader = _tree(tmp_path, files=3)
    started: list[subprocess.Popen[bytes]] = []

    def mute(module: str, args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], **kwargs)  # type: ignore
        started.append(proc)
        return proc

    monkeypatch.setattr(warm_helper.reexec, "popen", mute)
    monkeypatch.setattr(lookahead, "STOP_WAIT", 0.5)
    ahead = MetadataAhead(catalog.path, reader.warm, walks=reader.warm_walks, descriptors=reader.warm_descriptors)
    ahead.start()
    d0 = catalog.lookup(ROOT_ID, b"d0")
    assert d0 is not None
    ahead.looked_up(d0.id)
    stopping = threading.Thread(target=ahead.stop)  # returns: the helper killed, its warm given up
    stopping.start()
    stopping.join(timeout=120)  # far past the 2 x 0.5 s stop() allows itself: a hang, not a slow machine
    assert not stopping.is_alive(), "stop() waits for a helper that never answers"
    assert started and started[0].poll() is not None
    assert ahead.statistics().values() == {"lookahead_directories": 1, "lookahead_files": 0,
                                          "lookahead_helper": 0, "lookahead_rows_hit": 0,
                                          "lookahead_left_to_others": 0}
    reader.close()


def _warm_d0_and_stop(ahead: MetadataAhead, catalog: Catalog, caplog: pytest.LogCaptureFixture) -> str:
    """d0 looked up and the read-ahead stopped (every queued directory warmed); what it logged meanwhile."""
    with caplog.at_level(logging.WARNING, logger="liquidfs.fuse.lookahead"):
        ahead.start()
        d0 = catalog.lookup(ROOT_ID, b"d0")
        assert d0 is not None
        ahead.looked_up(d0.id)
        ahead.stop()
    return caplog.text


def test_a_helper_gone_is_said_and_the_read_ahead_goes_on_in_threads(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    catalog, reader = _tree(tmp_path, files=5)
    ahead = MetadataAhead(catalog.path, reader.warm, walks=reader.warm_walks, descriptors=reader.warm_descriptors)
    ahead.start()
    assert ahead._helper is not None
    ahead._helper.kill()
    ahead._helper._process.wait()
    said = _warm_d0_and_stop(ahead, catalog, caplog)  # start() again: the helper is there, though dead
    assert ahead.statistics().values() == {"lookahead_directories": 1, "lookahead_files": 5,
                                          "lookahead_helper": 0, "lookahead_rows_hit": 0,
                                          "lookahead_left_to_others": 0}
    assert "the metadata read-ahead goes on in the daemon's own threads" in said
    reader.close()


def test_a_helper_that_cannot_start_leaves_the_warms_to_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    catalog, reader = _tree(tmp_path, files=3)
    monkeypatch.setattr(warm_helper.sys, "executable", str(tmp_path / "no-such-python"))
    ahead = MetadataAhead(catalog.path, reader.warm, walks=reader.warm_walks, descriptors=reader.warm_descriptors)
    said = _warm_d0_and_stop(ahead, catalog, caplog)
    assert ahead.statistics().values() == {"lookahead_directories": 1, "lookahead_files": 3,
                                          "lookahead_helper": 0, "lookahead_rows_hit": 0,
                                          "lookahead_left_to_others": 0}
    assert "could not start" in said
    reader.close()
