"""Locks that say whether their owner lives (``sysio.locks``): a lock file is held from the moment it has its
name, so a sweeper never takes a live writer's for a dead one's."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from liquidfs.sysio import locks
from liquidfs.sysio.locks import HeldLock, abandoned


def test_a_lock_has_its_name_only_once_it_is_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "catalog.sqlite.new-0123.lock"
    named: list[bool] = []
    rename = os.rename

    def watched(src: Path, dst: Path) -> None:
        # what a sweeper would see at the name, just before the lock has it: nothing
        named.append(not os.path.lexists(dst) and not abandoned(Path(src)))
        rename(src, dst)

    monkeypatch.setattr(locks.os, "rename", watched)
    lock = HeldLock(path)
    assert named == [True] and not abandoned(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing else left
    lock.release()
    assert not path.exists() and abandoned(path)


def test_a_lock_whose_owner_died_is_abandoned(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    code = (f"import os, pathlib; from liquidfs.sysio.locks import HeldLock; HeldLock(pathlib.Path({str(path)!r})); "
            "os._exit(0)")  # dies holding it: no release ran
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert path.exists() and abandoned(path)


def test_a_private_directory_is_swept_only_once_its_run_has_died(tmp_path: Path) -> None:
    private = locks.PrivateDir(tmp_path, "run-")
    live = private.path
    assert oct(live.stat().st_mode & 0o777) == "0o700" and (live / locks.DIR_LOCK).exists()
    code = (f"import os, pathlib; from liquidfs.sysio.locks import PrivateDir; "
            f"print(PrivateDir(pathlib.Path({str(tmp_path)!r}), 'run-').path); os._exit(0)")  # killed: no clean-up
    dead = Path(subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True,
                               text=True).stdout.strip())
    (tmp_path / "run-justmade").mkdir()  # another run's, its lock not made yet
    (tmp_path / "run-link").symlink_to(dead)  # a link at the pattern: never followed
    (tmp_path / "other-x").mkdir()
    (tmp_path / "other-x" / locks.DIR_LOCK).touch()  # another prefix's
    assert locks.abandoned_dirs(tmp_path, "run-") == [dead]
    private._alive.release(remove=False)  # its run has ended (killed before its removal)
    assert sorted(locks.abandoned_dirs(tmp_path, "run-")) == sorted([dead, live])
    after = locks.PrivateDir(tmp_path, "run-")  # the next run sweeps both, never what is not a dead run's
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([after.path.name, "run-justmade", "run-link",
                                                                  "other-x"])
    after.remove()
    assert not after.path.exists() and not locks.abandoned_dirs(tmp_path, "run-")


@pytest.mark.parametrize("take", ["shared", "exclusive", "shared, read-only"])
def test_a_fifo_at_a_locks_name_is_refused_never_waited_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          take: str) -> None:
    """Whoever writes the store may put a FIFO at ``mounts.lock``: a read-only open of it (a store on a read-only
    volume, where the lock cannot be made) waited for a writer for good, and the mount hung at its start."""
    import threading

    fifo = tmp_path / "mounts.lock"
    os.mkfifo(fifo, 0o600)
    if take == "shared, read-only":
        real_open = os.open

        def read_only_volume(path: object, flags: int, *args: object, **kwargs: object) -> int:
            if flags & os.O_CREAT:
                raise OSError(30, "Read-only file system")  # EROFS
            return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(locks.os, "open", read_only_volume)
    outcome: list[BaseException | int | None] = []

    def taking() -> None:
        try:
            outcome.append(locks.exclusive_lock(fifo) if take == "exclusive" else locks.shared_lock(fifo))
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=taking, daemon=True)
    thread.start()
    thread.join(10)  # (a bound on a hang, not a measure: it answers at once)
    assert not thread.is_alive(), "the lock waited on the FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], OSError) and "not a regular file" in str(outcome[0])


def test_a_lock_whose_name_cannot_be_removed_is_let_go_all_the_same(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fails the unlink (EIO, EROFS) at a release: the error is said, and the lock and its
    descriptor are let go all the same, never held for good."""
    held = HeldLock(tmp_path / "x.lock")
    fd = held.fd

    def failing(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(Path, "unlink", failing)
    with pytest.raises(OSError):
        held.release()
    assert held.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    monkeypatch.undo()
    assert abandoned(tmp_path / "x.lock")
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert abandoned("x.lock", dir_fd=directory)
    finally:
        os.close(directory)
