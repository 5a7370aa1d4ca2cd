"""One Store interface: ``open_store`` picks the implementation from what the user typed, and the code that
uses a store (prepare, verify, profile, mount) never asks which kind it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from liquidfs.catalog.schema import CatalogError
from liquidfs.stores import BACKENDS, open_prepared, open_store, scheme
from liquidfs.stores.local import LocalStore
from liquidfs.stores.s3 import BucketStore


def test_a_directory_pair_is_a_local_store(tmp_path: Path) -> None:
    store = open_store(tmp_path / "data", tmp_path / "store")
    assert isinstance(store, LocalStore)
    assert store.label == str(tmp_path / "store") and store.source_label == str(tmp_path / "data")
    assert "j2k" in store.raw_formats


def test_a_local_store_defaults_to_this_users_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = open_store(tmp_path / "data", None)
    assert store.label.startswith(str(tmp_path / "cache" / "liquidfs"))


def test_an_s3_pair_is_a_bucket_store_and_holds_bmp_only() -> None:
    store = open_store("s3://src/data", "s3://dst/data.liquid")
    assert isinstance(store, BucketStore)
    assert store.label == "s3://dst/data.liquid" and store.source_label == "s3://src/data"
    assert store.raw_formats == ("bmp",)


@pytest.mark.parametrize("source, store", [("s3://b/data", None), ("s3://b/data", "/local/store"),
                                           ("/local/data", "s3://b/store"), ("s3://b/data", "s3://b/data/store")])
def test_a_mixed_or_nested_pair_is_refused(source: str, store: str | None) -> None:
    with pytest.raises(CatalogError):
        open_store(source, store)


def test_a_prepared_local_store_is_found_by_its_directory_alone(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="no catalog"):
        open_prepared(tmp_path / "empty")


def test_one_map_names_the_store_class_of_each_scheme() -> None:
    assert BACKENDS[""]() is LocalStore and BACKENDS["s3"]() is BucketStore
    for backend in BACKENDS.values():
        assert backend().__module__.startswith("liquidfs.stores.")  # each backend whole in its folder
    assert scheme("s3://b/data") == "s3" and scheme("s3://b") == "s3"
    # Anything else is a local path, as before the map: a path object, a relative name, an unknown scheme.
    for local in ("/data", "data", "s3:/b/data", "S3://b", "gs://b/data", Path("s3://b")):
        assert scheme(local) == ""


def test_the_adaptive_mix_starts_at_the_share_the_kept_profile_chose(tmp_path: Path) -> None:
    store = open_store(tmp_path / "data", tmp_path / "store")
    (tmp_path / "store").mkdir()
    assert store.profile_choice() is None  # none kept: the mix starts mid-range
    store.keep_profile('{"chosen": 0.93, "table": []}')
    assert store.profile_choice() == 0.93
    # Whoever owns the store writes it: JSON nested past the interpreter's stack, or a bool (an int to Python),
    # starts the mix mid-range too, never fails the mount with a traceback.
    for bad in ('{"chosen": 1.5}', '{"chosen": "0.9"}', '{"other": 1}', "not json", '{"chosen": true}',
                '{"chosen": ' + "[" * 100_000 + "]" * 100_000 + "}"):
        store.keep_profile(bad)
        assert store.profile_choice() is None, bad
    assert open_store("s3://src/data", "s3://dst/data.liquid").profile_choice() is None


def test_each_reader_of_a_mount_serves_the_directories_the_first_opened(tmp_path: Path) -> None:
    """mount --loops: each loop after the first makes its reader in a process forked after the mount. Its source
    root and objects directory are the first reader's, not the paths resolved again (a root renamed, or another put
    at its name, since the mount would have one loop serve another tree)."""
    import os

    from liquidfs.catalog.build import build
    from liquidfs.catalog.catalog import Catalog

    src, store_dir = tmp_path / "src", tmp_path / "store"
    (src / "d").mkdir(parents=True)
    (store_dir / "objects").mkdir(parents=True)
    build(src, store_dir)
    store = LocalStore(src, store_dir)
    catalog = Catalog.open(store_dir, readonly=True)
    first = store.reader(catalog, 4, 30.0)
    src.rename(tmp_path / "moved")
    src.mkdir()
    (store_dir / "objects").rename(store_dir / "objects.old")
    (store_dir / "objects").mkdir()
    second = store.reader(catalog, 4, 30.0)
    try:
        for a, b in ((first.root_fd, second.root_fd), (first.objects_fd, second.objects_fd)):  # type: ignore[attr-defined]
            assert a != b and os.fstat(a).st_ino == os.fstat(b).st_ino
    finally:
        first.close()
        second.close()
        catalog.close()
