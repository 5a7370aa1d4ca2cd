"""profile --run's pure parts: the binary search over the shares on simulated pipelines, the pace from the
mount's counters, the command's {mount}."""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import time
from pathlib import Path

import pytest

from liquidfs.profile.measured import SHARES, command_for, pace, search, within_noise
from liquidfs.stores.sample import ProfileError


def _pipeline(peak: float, noise: float = 0.0, seed: int = 0):  # type: ignore[no-untyped-def]
    """A pipeline whose rate rises to ``peak`` (decode-bound below it) and falls after (storage-bound): the pace
    of two overlapped stages, 1 / max(decode, load) per image."""
    rng = random.Random(seed)
    calls: list[float] = []

    def measure(share: float) -> float:
        calls.append(share)
        decode = 30 - 27 * share             # ms per image: PNG 30, BMP 3
        load = 10 + 12 * share               # ms per image: BMP's bytes take longer to read
        rate = 1000 / max(decode, load)
        return rate * (1 + rng.gauss(0, noise))

    return measure, calls


@pytest.mark.parametrize("first", [None, 0.0, 0.3, 0.9, 1.0])
def test_search_finds_the_peak_from_any_first_guess(first: float | None) -> None:
    measure, calls = _pipeline(peak=0.51)
    result = search(measure, first=first)
    best = max(SHARES, key=lambda s: 1000 / max(30 - 27 * s, 10 + 12 * s))
    assert result.chosen == best == 0.5
    assert len(set(calls)) <= 7, calls  # a binary search, not the 11


def test_search_ends_at_the_ends() -> None:
    rising = search(lambda s: 50 + 40 * s)
    falling = search(lambda s: 90 - 40 * s, first=0.5)
    assert rising.chosen == 1.0 and falling.chosen == 0.0


def test_a_close_pair_is_measured_again_and_the_smaller_share_taken_on_a_plateau() -> None:
    calls: list[float] = []

    def flat(share: float) -> float:
        calls.append(share)
        return 80.0 + (0.5 if len(calls) % 2 else -0.5)

    result = search(flat, repeats=3, first=0.5)
    assert calls.count(0.5) == 3 and calls.count(0.6) == 3  # within noise: repeated up to 3 runs each
    # still within noise: the pair's outer neighbours once each, no faster either, so the search ends here
    assert calls.count(0.4) == 1 and calls.count(0.7) == 1 and len(calls) == 8
    assert result.chosen == 0.4 and result.within_noise == [0.5, 0.6, 0.7]


def _storage_bound_tail(share: float) -> float:
    """The paced loader of tests/mount/test_profile_run.py: decode-bound to its peak at 0.6, then storage-bound
    with a BMP 1.4x a PNG's bytes, so each step past the peak loses only ~3 %: 0.9 and 1.0 within noise."""
    return min(1000 / (30 - 27 * share), 6290 / ((1 - share) * 70 + share * 98))


@pytest.mark.parametrize("first", [None, 0.0, 0.5, 0.8, 0.9, 1.0])
def test_a_gentle_slope_within_noise_is_not_taken_for_the_peak(first: float | None) -> None:
    assert within_noise([_storage_bound_tail(0.9)], [_storage_bound_tail(1.0)])
    calls: list[float] = []

    def measure(share: float) -> float:
        calls.append(share)
        return _storage_bound_tail(share)

    result = search(measure, first=first)
    assert result.chosen == 0.6, (result.steps, result.rates)
    assert len(set(calls)) <= 7, calls  # a binary search with two runs more, not the 11 (at most 10 could be)


def test_the_outer_neighbour_on_the_faster_side_is_run_first_and_spares_the_other() -> None:
    calls: list[float] = []

    def measure(share: float) -> float:
        calls.append(share)
        return _storage_bound_tail(share)

    result = search(measure, first=0.8)
    assert result.steps[0] == (0.8, 0.9) and result.chosen == 0.6  # 0.8 and 0.9 within noise, 0.8 the faster
    assert 0.7 in calls and 1.0 not in calls  # 0.7 told the slope: no run of 1.0


def test_on_a_gentle_rise_the_search_goes_on_to_the_right() -> None:
    def rising(share: float) -> float:  # 2 % a step to a peak at 0.8, falling fast after it
        return 100 * 1.02 ** (share * 10) if share <= 0.8 else 60.0

    result = search(rising, first=0.2)
    assert result.steps[0] == (0.2, 0.3) and 0.8 in result.rates  # it went on from the first pair to the peak
    assert result.chosen == 0.7 and result.within_noise == [0.8]  # the smallest share within 3 % of the fastest


def test_noisy_pipeline_lands_within_three_percent_of_the_best() -> None:
    worst = 1.0
    for seed in range(20):
        measure, _ = _pipeline(peak=0.51, noise=0.02, seed=seed)
        chosen = search(measure, repeats=3).chosen
        true = 1000 / max(30 - 27 * chosen, 10 + 12 * chosen)
        worst = min(worst, true / (1000 / max(30 - 27 * 0.5, 10 + 12 * 0.5)))
    assert worst >= 0.9, worst  # a 2 % noise can cost a step (0.1) at most: ~6 % here


def test_within_noise() -> None:
    assert within_noise([100.0], [102.0]) and not within_noise([100.0], [110.0])
    assert within_noise([100.0, 120.0], [110.0, 112.0])  # the runs' own spread is larger than the gap


def test_pace_runs_from_the_first_open_to_the_exit_or_the_last_file_closed() -> None:
    # counters read every 0.5 s: nothing for 2 s (start-up), then 10 opens/s with a file open, exit at 7.0
    samples = [(t / 2, max(0, round((t / 2 - 2) * 10)), 0, 1) for t in range(0, 14)]
    images_per_s, _, opens = pace(samples, end=7.0)
    assert opens == 45 and images_per_s == pytest.approx(45 / (7.0 - 2.25), rel=0.01)
    # the last file closed at 6.5, a second before the command exits (its workers' teardown): the span ends there
    closed = samples[:-1] + [(6.5, 45, 0, 0)]
    assert pace(closed, end=7.5)[0] == pytest.approx(45 / (6.5 - 2.25), rel=0.01)
    assert pace([(0.0, 5, 0, 0), (1.0, 5, 0, 0)], end=2.0) == (0.0, 0.0, 0)


def test_with_a_cache_the_pace_runs_from_the_second_epochs_first_open() -> None:
    from liquidfs.profile.measured import from_epoch

    # 10 opens/s from 2.0 s; the cache's epoch 2 begins between the readings at 4.5 and 5.0 (after 25 opens)
    samples = [(t / 2, max(0, round((t / 2 - 2) * 10)), 0, 1) for t in range(0, 14)]
    epochs = [0 if s[1] == 0 else 1 if s[0] < 5.0 else 2 for s in samples]
    timed, reached = from_epoch(samples, epochs, 2)
    assert reached and timed[0] == (4.5, 25, 0, 1)
    images_per_s, _, opens = pace(timed, end=7.0)
    assert opens == 45 - 25 and images_per_s == pytest.approx(20 / (7.0 - 4.75), rel=0.01)
    # one epoch only: the whole run, and said
    assert from_epoch(samples, [1] * len(samples), 2) == (samples, False)
    # an epoch begun with fewer opens to come than asked (a read-ahead past the last epoch): the whole run
    assert from_epoch(samples, epochs, 2, min_opens=20) == (timed, True)
    assert from_epoch(samples, epochs, 2, min_opens=21) == (samples, False)
    assert from_epoch(samples, epochs, 1) == (samples, True)


def test_command_for_replaces_the_mount_and_needs_it() -> None:
    words = command_for("python 'my loader.py' --data {mount}/train --steps 40", Path("/tmp/m"))
    assert words == ["python", "my loader.py", "--data", "/tmp/m/train", "--steps", "40"]
    with pytest.raises(ProfileError, match=r"must name the mount point as \{mount\}"):
        command_for("python train.py --data /data", Path("/tmp/m"))
    with pytest.raises(ProfileError, match="--run: No closing quotation"):  # shlex's ValueError was a traceback
        command_for("python train.py --data {mount} --name 'x", Path("/tmp/m"))


@pytest.mark.parametrize("augment", [True, False])
def test_the_builtin_pipelines_read_every_image_once_per_epoch(tmp_path: Path, augment: bool) -> None:
    import json
    import subprocess
    import sys

    from sample import make_sample

    src = make_sample(tmp_path / "data", count=6, width=320, height=160, seed=3)
    done = subprocess.run([sys.executable, "-m", "liquidfs.profile.loaders", "pil", str(src), "--threads", "2",
                           "--epochs", "2", "--batch", "4", "--report-epochs", *([] if augment else ["--no-augment"])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    *epochs, said = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert said["images"] == 12 and said["augment"] is augment and said["images_per_s"] > 0
    assert [(e["epoch"], e["images"]) for e in epochs] == [(1, 6), (2, 6)], epochs
    if augment:  # DALI's reader runs on across epochs: a batch of 4 crosses the first's end (6 images)
        dali = subprocess.run([sys.executable, "-m", "liquidfs.profile.loaders", "dali", str(src), "--threads", "1",
                               "--epochs", "2", "--batch", "4", "--shuffle-buffer", "2", "--report-epochs"],
                              capture_output=True, text=True, timeout=120)
        assert dali.returncode == 0, dali.stderr
        *epochs, said = [json.loads(line) for line in dali.stdout.strip().splitlines()]
        # a line per epoch; the crossing batch's last 2 images count in the second
        assert said["images"] == 12 and [(e["epoch"], e["images"]) for e in epochs] == [(1, 6), (2, 6)], epochs
    empty = subprocess.run([sys.executable, "-m", "liquidfs.profile.loaders", "pil", str(tmp_path / "nothing")],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "no images under" in empty.stderr


def test_the_sample_holds_only_regular_images_and_is_seeded(tmp_path: Path) -> None:
    import os

    from liquidfs.profile.measured import sample_paths

    root = tmp_path / "data"
    (root / "a" / "b").mkdir(parents=True)
    for i in range(30):
        (root / "a" / "b" / f"{i:02d}.png").write_bytes(b"x")
    (root / "a" / "notes.txt").write_text("not an image")
    (root / "a" / "link.png").symlink_to("/etc/passwd")
    os.mkfifo(root / "a" / "fifo.png")
    (root / "elsewhere").symlink_to(tmp_path, target_is_directory=True)  # a linked directory is not walked
    every = sample_paths(root, 100)
    assert len(every) == 30 and all(p.parts[:2] == ("a", "b") for p in every)
    some = sample_paths(root, 8, seed=1)
    assert len(some) == 8 and some == sample_paths(root, 8, seed=1) and set(some) <= set(every)


def test_the_builtin_dali_command_shuffles_among_fewer_files_than_the_sample() -> None:
    from liquidfs.profile.measured import builtin_command

    words = shlex.split(builtin_command("dali", 2, 256))
    assert words[-2:] == ["--shuffle-buffer", "32"] and "{mount}" in words
    assert "--no-augment" in builtin_command("pil", 2, 64, augment=False)
    assert "--epochs" not in words and shlex.split(builtin_command("pil", 2, 64, epochs=2))[-2:] == ["--epochs", "2"]


def test_the_sample_walk_never_lists_a_folder_swapped_for_a_link(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk listed each folder by path: a folder a dataset writer swapped for a link between the listing of
    its parent and its own was followed (it listed a 0700 directory of root's). Each folder is reached below
    the root's descriptor, without links: the swapped one is left out."""
    from liquidfs.profile.measured import sample_paths

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "secret.png").write_bytes(b"x")
    src = tmp_path / "src"
    for folder in ("a", "b"):
        (src / folder).mkdir(parents=True)
        (src / folder / f"{folder}1.png").write_bytes(b"x")
    real_scandir = os.scandir
    listings = 0

    def swapping_scandir(path):  # type: ignore[no-untyped-def]
        nonlocal listings
        with real_scandir(path) as listing:
            entries = list(listing)
        listings += 1
        if listings == 1:  # the root listed (b a folder by its d_type): b swapped for a link before it is
            (src / "b").rename(tmp_path / "b-was")
            (src / "b").symlink_to(private)
        return contextlib.nullcontext(entries)

    monkeypatch.setattr(os, "scandir", swapping_scandir)
    chosen = sample_paths(src, 10)
    assert listings >= 1 and (src / "b").is_symlink()
    assert chosen == [Path("a/a1.png")]


def test_a_run_ends_at_the_commands_exit_not_when_a_worker_it_left_lets_go_of_its_output(tmp_path: Path) -> None:
    """A loader's worker left running after its exit (orphaned, in the command's session) holds the output's pipe:
    the run waited for the pipe's end, to the timeout, and failed as a command that never finished. Its exit ends
    it; the session's leftovers are stopped."""
    from liquidfs.profile.measured import ScratchMounts

    pidfile = tmp_path / "worker.pid"
    words = ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; echo done; echo '{{\"steps\": 3}}'"]
    status, output, said = ScratchMounts._run(object(), words, 0.5, timeout=20)  # type: ignore[arg-type]
    assert status == 0 and output.splitlines()[0] == "done" and said == {"steps": 3}
    worker = int(pidfile.read_text())
    for _ in range(100):  # SIGKILL'd with its session: gone within moments
        if not _running(worker):
            break
        time.sleep(0.05)
    assert not _running(worker)


def test_a_run_keeps_only_the_tail_of_a_commands_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """A training script logging every step for the run's minutes: the profile kept all of its output, three
    times over (300 MB of it: 1.5 GB of the profile's memory). Its tail is kept, as much as its last lines and
    its last JSON line need."""
    from liquidfs.profile import measured
    from liquidfs.profile.measured import ScratchMounts

    monkeypatch.setattr(measured, "OUTPUT_KEPT", 4096)
    words = ["sh", "-c", "i=0; while [ $i -lt 20000 ]; do echo line $i; i=$((i+1)); done; echo '{\"steps\": 7}'"]
    status, output, said = ScratchMounts._run(object(), words, 0.5, timeout=60)  # type: ignore[arg-type]
    assert status == 0 and said == {"steps": 7} and len(output) <= 4096
    assert output.splitlines()[-2] == "line 19999"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that no init reaped, in a container, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_the_pil_loader_opens_the_formats_liquidfs_decodes_and_lists_only_their_files() -> None:
    """Its own copy of the list (it imports nothing of the package): kept the same, and every suffix it lists is a
    format it opens (a .webp listed and refused ended the loader with a traceback)."""
    from liquidfs.expand.formats import PILLOW_FORMATS
    from liquidfs.profile import loaders

    assert loaders.PIL_FORMATS == PILLOW_FORMATS
    assert set(loaders.SUFFIXES) == {".png", ".jpg", ".jpeg", ".bmp", ".jp2"}


@pytest.mark.parametrize("users", [None, ""])
def test_a_users_run_command_gets_the_users_python_path_rules(monkeypatch: pytest.MonkeyPatch,
                                                               users: str | None) -> None:
    """The commands keep their multiprocessing helpers off the working directory with PYTHONSAFEPATH, which a
    `--run 'python train.py'` inherited: the script's own directory left its import path (`import model`
    failed). The user's command runs with the user's value, or none."""
    from liquidfs.profile.measured import ScratchMounts
    from liquidfs.sysio import reexec

    reexec._USERS_SAFEPATH = None  # (put back by conftest's restore_python_safepath, as the variable is)
    if users is None:
        monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONSAFEPATH", users)
    reexec.helpers_off_cwd()
    assert os.environ["PYTHONSAFEPATH"] == "1"
    words = ["sh", "-c", "echo \"${PYTHONSAFEPATH-unset}\""]
    status, output, _ = ScratchMounts._run(object(), words, 0.5, timeout=20)  # type: ignore[arg-type]
    assert status == 0 and output.splitlines()[0] == ("unset" if users is None else users)


def test_a_mount_of_the_sample_that_never_ends_is_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """``liquidfs mount`` of the profile's sample past its time: subprocess's TimeoutExpired came out of the
    command as a traceback (and, at the clean-up's unmount, hid the run's own failure)."""
    import subprocess

    from liquidfs.profile import measured
    from liquidfs.profile.measured import ScratchMounts
    from liquidfs.stores.sample import ProfileError

    def never_ends(*args: object, **kwargs: object) -> None:
        raise subprocess.TimeoutExpired("liquidfs", 300)

    monkeypatch.setattr(measured.reexec, "run", never_ends)
    with pytest.raises(ProfileError, match="did not end within"):
        ScratchMounts._liquidfs(object(), "umount", "/x")  # type: ignore[arg-type]


def test_the_measured_searchs_copy_stops_past_its_bytes_and_says_a_full_disk(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """256 images of 100 megapixels had the measured search copy (and prepare raw) ~100 GB on the store's device:
    the copy stops past ``COPY_BYTES`` of originals once it holds ``COPY_FLOOR`` images (``--run-images N``: N).
    A full disk was one image left out after another ("only N images could be read"): said as it is."""
    import errno
    import shutil

    from liquidfs.profile import measured
    from liquidfs.stores.sample import ProfileError

    source = tmp_path / "data"
    for i in range(60):
        (source / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (source / f"d{i % 3}" / f"{i}.png").write_bytes(bytes(1000))

    def scratch(name: str, max_bytes: int | None) -> measured.ScratchMounts:
        made = object.__new__(measured.ScratchMounts)
        made.source, made.root, made.progress, made.max_bytes = source, tmp_path / name, lambda s: None, max_bytes
        made.src = made.root / "data"
        return made

    assert scratch("bounded", 10_000)._copy(60, 0) == measured.COPY_FLOOR
    assert scratch("asked", None)._copy(60, 0) == 60

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfileobj", full)
    with pytest.raises(ProfileError, match="no room under"):
        scratch("full", None)._copy(60, 0)
