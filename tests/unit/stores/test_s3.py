"""Unit tests of the S3 backend's pieces that need no server: URLs, and the pair of a source and a store (the
catalog it builds from listings: tests/unit/test_catalog.py)."""

from __future__ import annotations

import datetime
import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from liquidfs.catalog.schema import CatalogError
from liquidfs.stores.s3.client import S3Url
from liquidfs.stores.s3.store import bucket_pair


def test_urls_parse_and_join() -> None:
    url = S3Url.parse("s3://datasets/cityscapes/")
    assert (url.bucket, url.prefix) == ("datasets", "cityscapes")
    assert str(url) == "s3://datasets/cityscapes"
    assert url.key(b"train/a.png") == "cityscapes/train/a.png"
    assert url.rel("cityscapes/train/a.png") == "train/a.png"
    whole = S3Url.parse("s3://datasets")
    assert whole.key("a.png") == "a.png" and str(whole) == "s3://datasets"
    with pytest.raises(ValueError):
        S3Url.parse("s3:///nobucket")
    with pytest.raises(ValueError):
        S3Url.parse("/local/dir")


def test_store_and_source_must_not_nest() -> None:
    assert bucket_pair("s3://b/cs", "s3://b/cs.liquid")[1].prefix == "cs.liquid"  # a sibling prefix is fine
    for store in ("s3://b/cs/liquid", "s3://b", "s3://b/cs"):
        with pytest.raises(CatalogError, match="contain"):
            bucket_pair("s3://b/cs", store)
    with pytest.raises(CatalogError, match="--store s3://"):
        bucket_pair("s3://b/cs", "/local/store")
    with pytest.raises(CatalogError, match="--store s3://"):
        bucket_pair("s3://b/cs", None)


def test_a_listing_that_names_keys_outside_its_prefix_is_not_taken_on_its_word() -> None:
    """The endpoint's answer to a listing of ``cs/`` that holds another prefix's key (a buggy or hostile
    S3-compatible server): that key is left out, never cut into a wrong path."""
    import datetime

    from liquidfs.stores.s3.client import list_objects

    when = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    page = {"Contents": [{"Key": key, "Size": 3, "ETag": '"e"', "LastModified": when}
                         for key in ("cs/a.png", "other/secret.png", "cs.liquid/catalog.sqlite", "cs/d/b.png")]}
    # and entries without what an object has: an empty ETag turned off every identity check of the object, a
    # missing key was a KeyError out of prepare and mount
    page["Contents"] += [{"Key": "cs/noetag.png", "Size": 3, "ETag": '""', "LastModified": when},
                         {"Key": "cs/nosize.png", "ETag": '"e"', "LastModified": when},
                         {"Key": "cs/notime.png", "Size": 3, "ETag": '"e"'},
                         {"Key": "cs/badsize.png", "Size": "x", "ETag": '"e"', "LastModified": when}]

    class _Client:
        def get_paginator(self, name: str) -> _Client:
            return self

        def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, object]]:
            assert (Bucket, Prefix) == ("b", "cs/")
            return [page]

    source = S3Url.parse("s3://b/cs")
    assert [source.rel(info.key) for info in list_objects(_Client(), source)] == ["a.png", "d/b.png"]


def test_a_mount_serves_no_catalog_of_another_source() -> None:
    """This node's copy of a store's catalog is shared by its mounts of that store: one rewritten by a mount of
    another source (`--refresh`) between the command's check and the daemon's start is refused, not served as
    this source's tree."""
    from types import SimpleNamespace
    from typing import cast

    from liquidfs.catalog.catalog import Catalog
    from liquidfs.stores.s3.store import BucketStore

    rewritten = cast(Catalog, SimpleNamespace(meta={"source": "s3://b/B"}.get))
    store = BucketStore(S3Url.parse("s3://b/A"), S3Url.parse("s3://b/st"))
    with pytest.raises(CatalogError, match="describes s3://b/B, not s3://b/A"):
        store.reader(rewritten, 4, 30.0)


class _Bucket:
    """Enough of a boto3 client for ``BucketStore.profile_sample``: a listing, GETs, uploads (the ``fail_at``-th
    fails after its object landed, as a dropped answer does) and deletes."""

    def __init__(self, objects: dict[str, bytes], fail_at: int) -> None:
        self.objects = dict(objects)
        self.uploads = 0
        self.fail_at = fail_at
        self.meta = type("Meta", (), {"endpoint_url": "http://127.0.0.1:1"})()

    def get_paginator(self, name: str) -> Any:
        listing = [{"Key": k, "Size": len(v), "ETag": '"e"', "LastModified": datetime.datetime(2026, 1, 1)}
                   for k, v in sorted(self.objects.items())]
        return type("Pages", (), {"paginate": lambda _, **kw: [{"Contents": listing}]})()

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        return {"Body": io.BytesIO(self.objects[Key]), "ETag": '"e"'}

    def upload_fileobj(self, data: io.BytesIO, bucket: str, key: str, **kwargs: Any) -> None:
        self.objects[key] = data.read()
        self.uploads += 1
        if self.uploads == self.fail_at:
            raise OSError(errno.ECONNRESET, "connection reset")

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> None:
        for each in Delete["Objects"]:
            self.objects.pop(each["Key"], None)


def test_a_profile_sample_that_fails_midway_deletes_the_objects_it_put(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from liquidfs.stores.s3 import store as s3store

    def png(seed: int) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (16, 8), (seed, 2 * seed, 3)).save(out, format="PNG")
        return out.getvalue()

    images = {f"data/{i}.png": png(i) for i in range(6)}
    bucket = _Bucket(images, fail_at=3)
    monkeypatch.setattr(s3store, "make_client", lambda *a, **kw: bucket)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = s3store.BucketStore.given("s3://b/data", "s3://b/store")
    with pytest.raises(OSError, match="connection reset"):
        store.profile_sample(6, jobs=1)
    assert bucket.uploads == 3 and bucket.objects == images  # the three it put are gone, the dataset is not


def test_a_stores_work_directory_is_this_users_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """It holds the bucket's whole listing (the catalog, written by the SDK under a umask's modes): made 0700 with
    the levels it makes above it, one an older liquidfs made 0775 narrowed, and one below a directory another
    user may make names in refused (root writes there by name)."""
    from types import SimpleNamespace

    from liquidfs.catalog.schema import CatalogError
    from liquidfs.stores.s3.client import S3Url, work_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    client = SimpleNamespace(meta=SimpleNamespace(endpoint_url="http://s3.example"))
    previous = os.umask(0o002)  # Debian's for users: mkdir -p made the levels above 0775, and refused them
    try:
        made = work_dir(S3Url("b", "store"), client)
        assert {oct(p.stat().st_mode & 0o777) for p in (made, made.parent, made.parent.parent)} == {"0o700"}
        made.chmod(0o775)
        made.parent.chmod(0o775)  # liquidfs's, as a local store's mkdir -p made it
        assert work_dir(S3Url("b", "store"), client) == made
        assert {oct(p.stat().st_mode & 0o777) for p in (made, made.parent)} == {"0o700"}
        if os.geteuid() == 0:  # root writes by name: not below a directory another user may make names in
            made.parent.parent.chmod(0o777)
            with pytest.raises(CatalogError, match=str(made.parent.parent)):
                work_dir(S3Url("b", "store"), client)
    finally:
        os.umask(previous)


def test_root_makes_and_changes_nothing_through_another_users_link(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """A HOME that sudo kept, whose ~/.cache/liquidfs its user made a link to a directory of root's (/etc):
    root narrowed that directory to 0700 (every other user locked out of it) and made s3-* in it before its
    check refused. Now refused before anything is made; a cache below a sticky directory is still root's."""
    if os.geteuid() != 0:
        pytest.fail("root's checks are tested as root runs them") if os.environ.get("CI") else \
            pytest.skip("needs root to give a directory away")
    from types import SimpleNamespace

    from liquidfs.catalog.schema import CatalogError
    from liquidfs.stores.s3.client import S3Url, work_dir

    client = SimpleNamespace(meta=SimpleNamespace(endpoint_url="http://s3.example"))
    victim = tmp_path / "etc"
    victim.mkdir()
    victim.chmod(0o755)
    cache = tmp_path / "home" / ".cache"
    cache.mkdir(parents=True)
    os.chown(cache, 1000, 1000)
    (cache / "liquidfs").symlink_to(victim)
    os.lchown(cache / "liquidfs", 1000, 1000)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    with pytest.raises(CatalogError, match="uid 1000"):
        work_dir(S3Url("b", "store"), client)
    assert victim.stat().st_mode & 0o777 == 0o755 and list(victim.iterdir()) == []
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(sticky / "cache"))
    assert work_dir(S3Url("b", "store"), client).parent == sticky / "cache" / "liquidfs"


def test_verify_checks_only_rows_a_mount_would_read_the_object_of(tmp_path: Path) -> None:
    """A row without its object's size had a GET of any length read into a verify worker; one naming another
    image's object had that object checked. Each is its verdict unread: a mount serves the original."""
    import sqlite3

    from liquidfs.catalog.build import build_from_objects
    from liquidfs.catalog.catalog import CATALOG_NAME, Catalog
    from liquidfs.catalog.nodes import REPR_RAW
    from liquidfs.expand.expansion import object_name
    from liquidfs.stores.base import refused_unread
    from liquidfs.stores.s3 import store as s3store

    build_from_objects(iter([("a.png", 10, '"e1"', 1), ("b.png", 10, '"e2"', 1), ("c.png", 10, '"e3"', 1)]),
                       tmp_path, "s3://b/data")
    catalog = Catalog.open(tmp_path, readonly=True)
    nodes = {n.path: n for n in catalog.files()}
    catalog.close()
    rows = {b"a.png": (object_name(nodes[b"a.png"]), 100), b"b.png": (object_name(nodes[b"b.png"]), None),
            b"c.png": (object_name(nodes[b"a.png"]), 100)}  # c's row names a's object
    db = sqlite3.connect(tmp_path / CATALOG_NAME)
    with db:
        for path, (obj, size) in rows.items():
            db.execute("UPDATE nodes SET repr=?, object=?, served_size=?, checksum=? WHERE path=?",
                       (REPR_RAW, obj, size, "0" * 64, path))
    db.close()
    store = s3store.BucketStore.given("s3://b/data", "s3://b/store")
    store._verify_dir = tmp_path
    found, job = store.verify_jobs()
    verdicts = {n.path: job(n) for n in found}
    assert verdicts[b"a.png"][0] is s3store.verify_one_s3
    assert verdicts[b"b.png"] == (refused_unread, ("no raw object recorded in the catalog's row: a mount serves "
                                                  "the original",))
    assert verdicts[b"c.png"] == (refused_unread, ("not the object of this file's source: a mount serves the "
                                                  "original",))


def test_keys_a_store_would_not_delete_are_said(caplog: pytest.LogCaptureFixture) -> None:
    """DeleteObjects answers 200 where some keys could not be deleted, and lists them: dropped, a profile's
    sample or a prepare's surplus stayed in the bucket unsaid."""
    from liquidfs.stores.s3.store import delete_keys

    class _Refusing:
        def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:
            return {"Errors": [{"Key": each["Key"], "Code": "AccessDenied"} for each in Delete["Objects"]]}

    delete_keys(_Refusing(), "b", ["s/one", "s/two"])
    assert "2 of 2 objects in b were not deleted (the first, 's/one': AccessDenied)" in caplog.text
