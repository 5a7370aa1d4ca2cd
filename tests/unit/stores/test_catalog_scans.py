"""A mount's scan of a local store's source and a prepare of the store, at once: one writer of the catalog at a
time (``LocalStore._catalog_ready``). Each catalog is renamed over the other's; run side by side, the later
rename drops what the other learnt: the prepare's expansions and choice, or the files the scan found."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from liquidfs.catalog.catalog import Catalog
from liquidfs.prepare import prepare
from liquidfs.stores.local import LocalStore
from liquidfs.sysio.locks import PREPARE_LOCK, exclusive_lock
from sample import make_sample


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


def test_a_stale_catalog_is_used_as_it_stands_while_a_prepare_runs(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
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
