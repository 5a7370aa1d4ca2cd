"""A mount's scan of a local store's source and a prepare of the store, at once: one writer of the catalog at a
time (``LocalStore._catalog_ready``). Each catalog is renamed over the other's; run side by side, the later
rename drops what the other learnt: the prepare's expansions and choice, or the files the scan found."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import sqlite3

import pytest

from liquidfs.catalog.build import open_or_build
from liquidfs.catalog.catalog import CATALOG_NAME, Catalog
from liquidfs.prepare import prepare
from liquidfs.stores.local import LocalStore
from liquidfs.stores.local import store as store_module
from liquidfs.sysio.locks import PREPARE_LOCK, exclusive_lock
from sample import make_sample


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "LOCK_POLL", 0.02)


def _catalog(store: Path) -> tuple[set[bytes], int]:
    """The files the store's catalog lists, and how many of them it serves raw."""
    catalog = Catalog.open(store, readonly=True)
    try:
        files = list(catalog.files())
    finally:
        catalog.close()
    return {n.path for n in files}, sum(n.served_raw for n in files)


def test_a_rescan_during_a_prepare_waits_for_it_and_keeps_what_it_chose(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_sample(tmp_path / "data", count=4, width=64, height=32, seed=3)
    store = tmp_path / "store"
    LocalStore(src, store).mount_catalog(rescan=False, progress=False)
    expanding, go_on = threading.Event(), threading.Event()
    job = LocalStore.expansion_job

    def held_job(self: LocalStore, *args: object) -> object:
        expanding.set()
        go_on.wait(30)
        return job(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalStore, "expansion_job", held_job)
    failures: list[BaseException] = []

    def run(work: object) -> threading.Thread:
        def target() -> None:
            try:
                work()  # type: ignore[operator]
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                failures.append(exc)

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    preparing = run(lambda: prepare(src, store, 1.0, progress=False))
    assert expanding.wait(30)
    (src / "added.bin").write_bytes(b"new")
    rescanning = run(lambda: LocalStore(src, store).mount_catalog(rescan=True, progress=False))
    rescanning.join(1.0)  # the scan before this fix was done by now, or renamed its catalog after the prepare's
    go_on.set()
    preparing.join(60)
    rescanning.join(60)
    assert not failures and not preparing.is_alive() and not rescanning.is_alive(), failures
    files, raw = _catalog(store)
    assert b"added.bin" in files, "the rescan was renamed over"
    assert raw == 4, "the prepare's choice was dropped"


def test_a_stale_catalog_is_used_as_it_stands_while_a_prepare_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(store_module, "AS_IT_STANDS_AFTER", 0.1)
    src = make_sample(tmp_path / "data", count=2, width=32, height=16, seed=4)
    store = tmp_path / "store"
    LocalStore(src, store).mount_catalog(rescan=False, progress=False)
    (src / "added.bin").write_bytes(b"new")
    held = exclusive_lock(store / PREPARE_LOCK)  # a prepare's, as another process holds it
    try:
        with caplog.at_level(logging.WARNING):
            LocalStore(src, store).mount_catalog(rescan=False, progress=False)
    finally:
        assert held is not None
        os.close(held)
    assert b"added.bin" not in _catalog(store)[0]
    assert "used as it stands" in caplog.text
    LocalStore(src, store).mount_catalog(rescan=False, progress=False)  # the prepare done: scanned
    assert b"added.bin" in _catalog(store)[0]


def test_a_fresh_catalog_is_used_without_the_lock(tmp_path: Path) -> None:
    """A mount of an unchanged source neither waits for a prepare nor needs to write to the store."""
    src = make_sample(tmp_path / "data", count=2, width=32, height=16, seed=5)
    store = tmp_path / "store"
    LocalStore(src, store).mount_catalog(rescan=False, progress=False)
    held = exclusive_lock(store / PREPARE_LOCK)
    try:
        mounting = threading.Thread(target=LocalStore(src, store).mount_catalog, kwargs={"rescan": False},
                                    daemon=True)
        mounting.start()
        mounting.join(30)
        assert not mounting.is_alive(), "the mount waited for the prepare's lock"
    finally:
        assert held is not None
        os.close(held)


def _while_locked(store: Path, work: object) -> tuple[threading.Thread, list[BaseException]]:
    """``work`` started in a thread while the test holds the store's prepare lock, as a prepare would."""
    failures: list[BaseException] = []

    def target() -> None:
        try:
            work()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failures.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, failures


def test_a_catalog_that_must_be_scanned_again_is_not_used_as_it_stands(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One whose scan could not list a directory (or an older liquidfs's) waits for the lock, however long."""
    monkeypatch.setattr(store_module, "AS_IT_STANDS_AFTER", 0.0)
    src = make_sample(tmp_path / "data", count=2, width=32, height=16, seed=6)
    store = tmp_path / "store"
    LocalStore(src, store).mount_catalog(rescan=False, progress=False)
    with sqlite3.connect(store / CATALOG_NAME) as db:
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('unlisted_directories', '1')")
    held = exclusive_lock(store / PREPARE_LOCK)
    assert held is not None
    thread, failures = _while_locked(store, lambda: LocalStore(src, store).mount_catalog(rescan=False,
                                                                                         progress=False))
    thread.join(0.5)
    still_waiting = thread.is_alive()
    os.close(held)
    thread.join(30)
    assert still_waiting and not thread.is_alive() and not failures, failures
    catalog = Catalog.open(store, readonly=True)
    try:
        assert catalog.is_fresh()  # scanned once the lock was free
    finally:
        catalog.close()


def test_a_mount_waiting_for_a_first_scan_takes_its_catalog_without_waiting_for_the_prepare(tmp_path: Path) -> None:
    """A store without a catalog, its first prepare scanning: the mount takes the catalog that scan renames in
    place, not the lock the prepare holds for hours after."""
    src = make_sample(tmp_path / "data", count=2, width=32, height=16, seed=7)
    store = tmp_path / "store"
    store.mkdir()
    held = exclusive_lock(store / PREPARE_LOCK)
    assert held is not None
    try:
        thread, failures = _while_locked(store, lambda: LocalStore(src, store).mount_catalog(rescan=False,
                                                                                             progress=False))
        thread.join(0.2)
        assert thread.is_alive()  # nothing to mount yet
        open_or_build(src, store).close()  # the prepare's own scan, under its lock
        thread.join(30)
        assert not thread.is_alive() and not failures, failures
    finally:
        os.close(held)


def test_a_lock_that_cannot_be_taken_scans_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A store on a filesystem without locks, or whose lock file another user owns: the scan runs, as before."""
    src = make_sample(tmp_path / "data", count=2, width=32, height=16, seed=8)
    store = tmp_path / "store"

    def no_locks(path: Path, *, wait: bool = True) -> int | None:
        raise OSError(37, "No locks available", str(path))

    monkeypatch.setattr(store_module, "exclusive_lock", no_locks)
    with caplog.at_level(logging.WARNING):
        LocalStore(src, store).mount_catalog(rescan=True, progress=False)
    assert (store / CATALOG_NAME).exists() and "scanning the source without it" in caplog.text
