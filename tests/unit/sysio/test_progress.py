"""The progress of long work (``sysio.progress``): tqdm's bar on a terminal, a plain line now and then on a log,
which a bar's carriage-return redraws would flood."""

from __future__ import annotations

import fcntl
import io
import os
import select
import struct
import termios
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from liquidfs import cli
from liquidfs.sysio import progress as progress_module
from liquidfs.sysio.progress import LINE_EVERY, Progress
from sample import make_sample


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", fake)
    return fake


def test_a_log_gets_a_line_every_interval_and_one_at_the_end(clock: _Clock) -> None:
    log = io.StringIO()
    progress = Progress("scanning /data", "entries", stream=log)
    for _ in range(3):
        clock.now += LINE_EVERY / 3
        progress.update(10)  # the third one is LINE_EVERY after the start
    clock.now += 1
    progress.update(5)  # one second after a line: none
    clock.now += LINE_EVERY
    progress.update(5)
    clock.now += 2
    progress.close()
    progress.close()  # said once
    assert log.getvalue() == ("scanning /data: 30 entries, 30 s\n"
                              "scanning /data: 40 entries, 61 s\n"
                              "scanning /data: 40 entries, 63 s\n")
    assert "\r" not in log.getvalue()


def test_work_done_within_the_delay_says_nothing_and_a_total_is_shown(clock: _Clock) -> None:
    log = io.StringIO()
    with Progress("scanning /data", "entries", delay=2, stream=log) as progress:
        clock.now += 1.5
        progress.update(7)
    assert log.getvalue() == ""
    with Progress("expanding", "images", total=9, initial=2, delay=2, stream=log) as progress:
        clock.now += 2.5
        progress.update(7)
    assert log.getvalue() == "expanding: 9 of 9 images, 2 s\n"


def test_work_not_to_be_shown_is_counted_and_says_nothing(clock: _Clock) -> None:
    log = io.StringIO()
    with Progress("expanding", "images", total=3, shown=False, stream=log) as progress:
        for _ in range(3):
            clock.now += LINE_EVERY
            progress.update(1)
    assert progress.done == 3 and log.getvalue() == ""


def test_a_terminal_gets_a_redrawn_bar() -> None:
    """A pseudo-terminal, as an interactive shell's stderr: tqdm's bar, which redraws its line."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's width, not 0
    try:
        with open(slave, "w", encoding="utf-8", closefd=True) as terminal:
            assert terminal.isatty()
            with Progress("expanding", "images", total=3, stream=terminal) as progress:
                progress.update(1)
                progress.update(2)
        drawn = _read_all(master)
    finally:
        os.close(master)
    assert "\r" in drawn and "expanding" in drawn and "3/3" in drawn, drawn


def _read_all(master: int) -> str:
    """All the terminal was given: the kernel hands a pty's output to its master in pieces, pushed by a worker,
    so one read right after the writes may see only the first redraw (it did, in CI). With the slave closed, a
    read past the last piece is EIO; a bound on the wait keeps a lost piece a failure, not a hang."""
    pieces: list[bytes] = []
    for _ in range(100):
        ready, _, _ = select.select([master], [], [], 0.1)
        if not ready:
            continue
        try:
            piece = os.read(master, 65536)
        except OSError:  # EIO: the slave is closed and everything was read
            break
        if not piece:
            break
        pieces.append(piece)
    return b"".join(pieces).decode()


def test_prepare_on_a_log_says_where_it_stands_in_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command as a sidecar or a batch job runs it, its stderr a file: lines, no bar."""
    make_sample(tmp_path / "data", count=4, width=64, height=32, seed=3)
    status = cli.main(["prepare", str(tmp_path / "data"), "--store", str(tmp_path / "store"), "--ratio", "1"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "expanding: 4 of 4 images" in err and "\r" not in err, err


def test_prepare_ends_its_progress_at_its_end_when_images_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A refused image lowers how many are expanded (a share of those that can be): the progress ends at what
    was reached, not short of a total set before any was refused (it looked like a stop at 80 %)."""
    make_sample(tmp_path / "data", count=4, width=64, height=32, seed=3)
    Image.fromarray(np.arange(64 * 32, dtype=np.uint16).reshape(32, 64) * 31).save(tmp_path / "data" / "deep.png")
    status = cli.main(["prepare", str(tmp_path / "data"), "--store", str(tmp_path / "store"), "--ratio", "1"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "expanding: 4 of 4 images" in err, err


def test_a_log_whose_reader_has_gone_stops_the_lines_not_the_work(clock: _Clock) -> None:
    read, write = os.pipe()
    os.close(read)
    with open(write, "w", encoding="utf-8") as gone:
        progress = Progress("scanning /data", "entries", stream=gone)
        clock.now += LINE_EVERY
        progress.update(1)  # EPIPE (SIGPIPE is ignored by Python): caught
        clock.now += LINE_EVERY
        progress.update(1)
        progress.close()
        assert progress.done == 2
        try:
            gone.close()
        except BrokenPipeError:  # what print left in the buffer
            pass
