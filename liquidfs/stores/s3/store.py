"""A dataset in an object store (``Store``): its catalog built from listings and kept in the store, raw objects
put there by prepare's workers.

Layout of a store ``s3://bucket/name.liquid``::

    name.liquid/catalog.sqlite          the catalog every node mounts from (uploaded by prepare)
    name.liquid/objects/ab/<hash>.bmp   raw objects, with the source's ETag and their BLAKE2b digest as metadata

Only ``prepare`` writes to the store. A node's ``mount`` downloads the catalog into a local work directory
(``client.work_dir``) when the store's copy changed (its ETag), and lists the source bucket itself only when asked
(``--refresh``) or when the store has no catalog yet.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...catalog.build import build_from_objects
from ...catalog.catalog import CATALOG_NAME, Catalog
from ...catalog.identity import checksum
from ...catalog.nodes import Node
from ...catalog.schema import CatalogError
from ...expand.expansion import IMAGE_SUFFIXES, OBJECTS, Outcome, expand_bytes, judge, never_raising, source_fits
from ...expand.rawformats import BMP, DEFAULT, RAW_FORMATS
from ...sysio.locks import PrivateDir, unique
from ...sysio.progress import Progress
from ..base import Job, Preparation, refused_unread
from ..reader import Reader, unfit_raw_row
from ..sample import ProfileError, Sample, measure_get
from .client import (
    READ_TIMEOUT,
    S3Url,
    bare_etag,
    error_code,
    get,
    head,
    is_url,
    list_objects,
    make_client,
    put,
    same_etag,
    upload_file,
    work_dir,
)
from .reader import S3Reader

log = logging.getLogger(__name__)

#: The file in the work directory that names the ETag of the store's catalog the local copy came from.
CATALOG_ETAG = "catalog.etag"
#: Bytes a catalog's download leaves free on the work directory's filesystem (its journal, the mount's log).
CATALOG_SPARE_BYTES = 64 << 20
_META_ETAG = "liquidfs-source-etag"
_META_CHECKSUM = "liquidfs-checksum"
_META_FORMAT = "liquidfs-format"


def bucket_pair(source: str, store: str | None) -> tuple[S3Url, S3Url]:
    """The source and store URLs of a dataset in an object store, or a message saying what is wrong."""
    if not is_url(source):
        raise CatalogError(f"a store in an object store needs its source there too, not {source}")
    if not store or not is_url(store):
        raise CatalogError(f"an s3:// source needs --store s3://BUCKET/PREFIX for its catalog and raw objects "
                           f"(got {store or 'none'})")
    src, dst = _parsed(source), _parsed(store)
    if dst in src or src in dst:
        raise CatalogError(f"the store {dst} and the source {src} must not contain each other "
                           "(a store's objects would show in the source's listing)")
    return src, dst


def _parsed(text: str) -> S3Url:
    """``text`` as an s3:// URL; CatalogError (a message, not a traceback) where it is none (``s3:///x``)."""
    try:
        return S3Url.parse(text)
    except ValueError as exc:
        raise CatalogError(str(exc)) from None


#: The private directory of a prepare under the node's work directory (``BucketStore.preparing``).
_PREPARING = "preparing-"


def _listing(client: Any, source: S3Url, progress: bool) -> Iterator[tuple[str, int, str, int]]:
    with Progress(f"listing {source}", "objects", shown=progress) as bar:
        for info in list_objects(client, source):
            bar.update(1)
            yield source.rel(info.key), info.size, info.etag, info.mtime_ns


def download_catalog(client: Any, store: S3Url, dest: Path) -> str | None:
    """The store's catalog into ``dest`` (atomically); its ETag, or None when the store has none yet."""
    found = head(client, store.bucket, store.key(CATALOG_NAME))
    if found is None:
        return None
    return _fetch_catalog(client, store, dest, found)


class NoRoomForCatalog(CatalogError):
    """The store's catalog would not fit where this node keeps its copy."""


def _room_for(store: S3Url, answer: dict[str, Any], where: Path) -> int:
    """The size of the catalog a HEAD describes (``answer``); CatalogError where it would not fit in ``where``'s
    filesystem with room to spare: whatever size a store's object says (a broken or hostile store's), never a
    download that fills the node's disk, at every mount."""
    size = answer.get("ContentLength")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CatalogError(f"the catalog of {store} has no size an object can have ({size!r})")
    free = shutil.disk_usage(where).free
    if size + CATALOG_SPARE_BYTES > free:
        raise NoRoomForCatalog(f"the catalog of {store} is {size} bytes, and {where} has {free} bytes free: not "
                           "downloaded (free some space there, or check the store)")
    return size


def _catalog_etag(store: S3Url, answer: dict[str, Any]) -> str:
    """The ETag of the store's catalog as a HEAD answered it; CatalogError where it has none (an endpoint or a
    proxy that drops the header: a KeyError's traceback, at every mount). Without one, nothing tells a copy of
    this catalog from one of the next."""
    etag = answer.get("ETag")
    if not isinstance(etag, str) or not bare_etag(etag):
        raise CatalogError(f"the object store answered no ETag for the catalog of {store} ({etag!r}): its copy "
                           "cannot be told from another (check the endpoint, or a proxy before it)")
    return etag


#: The catalog is downloaded in ranged GETs of this many bytes, one in memory at a time.
CATALOG_PART = 32 << 20


def _download(client: Any, bucket: str, key: str, etag: str, size: int, dest: Path) -> None:
    """The object ``key`` of ``size`` bytes and ETag ``etag`` into the new file ``dest`` (this user's alone), in
    parts (``CATALOG_PART``), each checked against its question: the ETag (If-Match: 412 where the object
    changed), the range, the total and the body's length (``client.get``). No byte past ``size`` is written:
    the SDK's download wrote whatever body came (a store or a proxy that sends more than its HEAD said filled
    the node's disk), and its ranged GETs went without If-Match."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        if size <= CATALOG_PART:  # one GET, no Range: as the SDK asked (some endpoints answer a range whole)
            out.write(get(client, bucket, key, if_match=etag, size=size))
            return
        for start in range(0, size, CATALOG_PART):
            out.write(get(client, bucket, key, if_match=etag, start=start, length=min(CATALOG_PART, size - start),
                          size=size))


def _fetch_catalog(client: Any, store: S3Url, dest: Path, found: dict[str, Any]) -> str:
    """The store's catalog, which a HEAD described (``found``: its ETag and size), into ``dest``; the ETag of
    what was downloaded. Every part of it is asked for with that ETag: one published meanwhile fails the part
    (a copy of old and new pages would be taken for the first's), and is downloaded again (twice at most)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    key = store.key(CATALOG_NAME)
    for _ in range(3):
        etag = _catalog_etag(store, found)
        size = _room_for(store, found, dest.parent)
        tmp = dest.with_name(f"{dest.name}.{unique('part-')}")
        try:
            _download(client, store.bucket, key, etag, size, tmp)
            os.replace(tmp, dest)
            return etag
        except Exception as exc:
            if error_code(exc) not in ("PreconditionFailed", "412"):
                raise
        finally:
            tmp.unlink(missing_ok=True)
        after = head(client, store.bucket, key)
        if after is None:
            break  # deleted meanwhile: no catalog to download
        if same_etag(after.get("ETag"), etag) and after.get("ContentLength") == size:
            # Unchanged, by its HEAD: its GETs answered another object (a weak or rewritten ETag, another size),
            # which no download again mends.
            raise CatalogError(f"the object store's answers to GETs of the catalog of {store} disagree with its "
                               "HEAD (ETag or size): check the endpoint, or a proxy before it")
        log.info("the catalog of %s changed while it was downloaded: again", store)
        found = after
    raise CatalogError(f"the catalog of {store} changed during each of three downloads (prepare publishing?): "
                       "mount again once it is published")


def local_catalog(source: str, store: str | None, *, refresh: bool = False, progress: bool = True) -> Path:
    """This node's copy of the catalog for a mount: the store's (downloaded when it changed), or built from a
    listing of the source when asked (``refresh``) or when the store has none. Never writes to the store."""
    src, dst = bucket_pair(source, store)
    client = make_client()
    local = work_dir(dst, client)
    have = (local / CATALOG_ETAG).read_text().strip() if (local / CATALOG_ETAG).exists() else None
    found = head(client, dst.bucket, dst.key(CATALOG_NAME))
    current = _catalog_etag(dst, found) if found else "none"
    if refresh or current != have or not (local / CATALOG_NAME).exists():
        if found is not None:
            log.info("downloading the catalog of %s", dst)
            try:
                current = _fetch_catalog(client, dst, local / CATALOG_NAME, found)
            except NoRoomForCatalog as exc:
                if refresh or not (local / CATALOG_NAME).exists():
                    raise
                # The copy this node has serves as it stands (behind the store's: a new selection is not seen):
                # a mount that worked before does not stop for a disk that filled since.
                log.warning("%s; the copy this node has is used as it stands", exc)
                current = have or "none"
        if refresh or found is None:
            if found is None:
                log.warning("%s has no catalog (prepare has not run): every image is served as stored", dst)
            build_from_objects(_listing(client, src, progress), local, str(src),
                               previous=local / CATALOG_NAME if found is not None else None)
        (local / CATALOG_ETAG).write_text(current + "\n")
    catalog = Catalog.open(local, readonly=True)
    try:
        if catalog.meta("source") != str(src):
            raise CatalogError(f"the catalog in {dst} describes {catalog.meta('source')}, not {src}")
    finally:
        catalog.close()
    return local


def publish_catalog(client: Any, store: S3Url, local: Path) -> None:
    """Upload the local catalog as the store's: the moment every node's next mount sees the new selection."""
    upload_file(client, local / CATALOG_NAME, store.bucket, store.key(CATALOG_NAME))
    found = head(client, store.bucket, store.key(CATALOG_NAME))
    (local / CATALOG_ETAG).write_text(f"{_catalog_etag(store, found) if found else 'none'}\n")


# -- prepare into a bucket ---------------------------------------------------------------------------------

_worker_client: Any = None


def _worker() -> Any:
    """The S3 client of this worker process, made on its first job (a client cannot cross a fork)."""
    global _worker_client
    if _worker_client is None:
        _worker_client = make_client(4)
    return _worker_client


def expand_one_s3(src_bucket: str, src_key: str, rel: bytes, size: int, mtime_ns: int, etag: str,
                  store_bucket: str, store_key: str, obj: str) -> Outcome:
    """Runs in a worker process: expand one source object into the store, or say why not. Never raises (a
    MemoryError of the expansion's header walk ended the whole prepare).

    An object already in the store whose metadata says it holds this expansion (the source's ETag, the digest of
    the bytes this run made) is not put again (a previous run, maybe on another node, put it): prepare resumes
    anywhere, at the cost of the decode, never taking an object's metadata for its digest. One with an xxh3
    digest (a prepare before BLAKE2b) is put again: that digest is never carried forward.
    """
    return never_raising(lambda: _expand_one_s3(src_bucket, src_key, rel, size, mtime_ns, etag, store_bucket,
                                                store_key, obj), rel, size, mtime_ns, etag)


def _expand_one_s3(src_bucket: str, src_key: str, rel: bytes, size: int, mtime_ns: int, etag: str,
                   store_bucket: str, store_key: str, obj: str) -> Outcome:
    """``expand_one_s3``'s work."""
    client = _worker()

    def refused(reason: str) -> Outcome:
        return Outcome(rel, size, mtime_ns, None, None, None, None, reason, src_etag=etag)

    try:
        if not source_fits(size):  # as a local source: never downloaded into a worker it cannot fit
            return refused("no-memory")
        found = head(client, store_bucket, store_key)
        source = get(client, src_bucket, src_key, if_match=etag, size=size)
    except Exception as exc:
        code = error_code(exc)
        if code in ("PreconditionFailed", "412"):
            return refused("changed-during-prepare")
        return refused(f"unreadable: {code or exc}")
    refusal, raw, fmt = expand_bytes(rel, size, mtime_ns, source, etag)
    if raw is None:
        assert refusal is not None
        return refusal
    digest = checksum(raw)
    meta = (found or {}).get("Metadata", {})
    if found and meta.get(_META_ETAG) == etag.strip('"') and meta.get(_META_CHECKSUM) == digest \
            and found.get("ContentLength") == len(raw):
        # The object there says it holds these very bytes (a run before, maybe on another node, put them): not
        # put again. Its word is all that is: the digest recorded is this run's, of its own expansion, and an
        # object that is not what its metadata says fails it at the mount (the original is served). Reused on
        # its metadata alone, its writer's digest went into the catalog, and its bytes were served as the image.
        return Outcome(rel, size, mtime_ns, fmt, obj, len(raw), digest, None, reused=True, src_etag=etag)
    try:
        put(client, store_bucket, store_key, raw,
            {_META_ETAG: etag.strip('"'), _META_CHECKSUM: digest, _META_FORMAT: str(fmt)})
    except Exception as exc:
        return Outcome(rel, size, mtime_ns, fmt, None, None, None, "write-failed",
                       fatal=f"cannot upload {store_key}: {error_code(exc) or exc}", src_etag=etag)
    return Outcome(rel, size, mtime_ns, fmt, obj, len(raw), digest, None, src_etag=etag)


def delete_keys(client: Any, bucket: str, keys: list[str]) -> None:
    """Delete ``keys``: 1,000 per DeleteObjects request, or one by one where the store refuses that call
    (Swift's s3api wants a Content-MD5 header that newer SDKs replace with a CRC checksum)."""
    for start in range(0, len(keys), 1000):
        batch = keys[start:start + 1000]
        try:
            answer = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch],
                                                                  "Quiet": True})
            # Answered 200 all the same where some keys could not be deleted (AccessDenied): said, not dropped.
            failed = answer.get("Errors") if isinstance(answer, dict) else None
            if failed:
                first = failed[0] if isinstance(failed[0], dict) else {}
                log.warning("%d of %d objects in %s were not deleted (the first, %r: %s)", len(failed), len(batch),
                            bucket, first.get("Key"), first.get("Code") or first.get("Message"))
        except Exception as exc:
            if error_code(exc) not in ("InvalidRequest", "NotImplemented", "MissingContentMD5", "InvalidDigest"):
                raise
            log.debug("DeleteObjects refused (%s): deleting one by one", error_code(exc))
            for key in batch:
                client.delete_object(Bucket=bucket, Key=key)


class BucketStore:
    """Raw objects under ``STORE/objects/`` in a bucket, the catalog at ``STORE/catalog.sqlite`` and a copy of it
    in this node's work directory (``client.work_dir``)."""

    default_threads = 16  # GETs wait on the network, not the CPU: more in flight
    raw_formats: tuple[str, ...] = (BMP.name,)  # the others: local stores only for now
    stamps_objects = False  # every GET is checked (ETag, size, digest): no stat vouches for anything
    shares_by_modes = False

    def __init__(self, source: S3Url, store: S3Url) -> None:
        self.source = source
        self.store = store
        self.label = str(store)
        self._client: Any = None
        self._listed: set[str] | None = None
        self._verify_dir: Path | None = None

    @classmethod
    def given(cls, source: str | os.PathLike[str], store: str | os.PathLike[str] | None) -> BucketStore:
        """An s3:// source and store as the user gave them; CatalogError for a pair that is not both s3:// or
        where one contains the other."""
        return cls(*bucket_pair(str(source), None if store is None else str(store)))

    @classmethod
    def prepared(cls, store: str | os.PathLike[str]) -> BucketStore:
        """The store at ``store``, its source read from the catalog prepare left there."""
        given = _parsed(str(store))
        found = cls(given, given)
        verify_dir = found._verify_copy()
        catalog = Catalog.open(verify_dir, readonly=True)
        try:
            source = catalog.meta("source")
        finally:
            catalog.close()
        # Whoever may write the store wrote what its catalog says the source is: checked as the user's would be.
        if not isinstance(source, str) or not is_url(source):
            raise CatalogError(f"the catalog of {given} names no s3:// source ({str(source)[:200]!r})")
        found.source = bucket_pair(source, str(given))[0]
        found._verify_dir = verify_dir
        return found

    @property
    def source_label(self) -> str:
        return str(self.source)

    def __repr__(self) -> str:
        return f"BucketStore({str(self.source)!r}, {str(self.store)!r})"

    @property
    def client(self) -> Any:
        """This process's client, made on first use (no credentials are looked for before they are needed)."""
        if self._client is None:
            self._client = make_client()
        return self._client

    # -- prepare ---------------------------------------------------------------------------------------

    @contextmanager
    def preparing(self, progress: bool) -> Iterator[Preparation]:
        """A catalog from a fresh listing, with what the store's catalog learnt; publishing uploads it, the
        moment every node's next mount sees the new selection.

        It is made and changed in a directory of this run's own: the node's copy of the store's catalog beside
        it is the mounts' (``local_catalog``), read by them as a file nobody writes, and stays the store's as
        published (a failed run leaves it so)."""
        local = work_dir(self.store, self.client)
        # What prepares killed on this node left, a whole catalog each, is swept here; this one's is at the end.
        work = PrivateDir(local, _PREPARING)
        private = work.path
        catalog: Catalog | None = None
        try:
            stored = private / f"store-{CATALOG_NAME}"
            previous = stored if download_catalog(self.client, self.store, stored) else None
            build_from_objects(_listing(self.client, self.source, progress), private, str(self.source),
                               previous=previous)
            catalog = Catalog.open(private)
            opened = catalog

            def publish() -> None:
                opened.close()
                publish_catalog(self.client, self.store, private)

            # After a failure nothing is uploaded (the store's catalog stays the last one published): the next run
            # finds what this one put by the objects' metadata (``expand_one_s3``), and the upload that failed
            # would be tried again in vain.
            yield Preparation(catalog, publish, keep_after_failure=lambda: None)
        finally:
            if catalog is not None:
                catalog.close()
            work.remove()

    def expansion_job(self, root: bytes, node: Node, obj: str, raw_formats: tuple[str, ...]) -> Job:
        assert node.etag is not None and raw_formats == self.raw_formats
        return expand_one_s3, (self.source.bucket, self.source.key(node.path), node.path, node.size,
                               node.mtime_ns, node.etag, self.store.bucket, self.store.key(obj), obj)

    def _objects(self) -> set[str]:
        """Names of the raw objects in the store, listed once per run (one request per 1,000, not one each)."""
        if self._listed is None:
            objects = S3Url(self.store.bucket, self.store.key(OBJECTS))
            self._listed = {f"{OBJECTS}/{objects.rel(info.key)}" for info in list_objects(self.client, objects)}
        return self._listed

    def exists(self, obj: str, size: int | None = None, stamp: str | None = None) -> bool:
        # (a listing's names: its objects are checked by their digest at every mount's read)
        return obj in self._objects()

    def since_scan(self, node: Node) -> Node | None:
        """None: a HEAD per image would cost what the listing saves; an object rewritten since is caught by the
        listing of the next prepare (``--refresh``) and by every mount's read (its ETag)."""
        return None

    def delete(self, objs: list[str]) -> None:
        delete_keys(self.client, self.store.bucket, [self.store.key(obj) for obj in objs])
        if self._listed is not None:
            self._listed.difference_update(objs)

    @contextmanager
    def deleting(self) -> Iterator[bool]:
        # No lock spans the nodes whose mounts read a bucket: the surplus is deleted as ever, and a mount whose
        # catalog still names a deleted object serves the original instead (its size corrected).
        yield True

    def stray(self, kept: set[str]) -> list[str]:
        self._listed = None  # objects written by this run are in the store now
        self._abort_uploads()
        return sorted(self._objects() - kept)

    def _abort_uploads(self) -> None:
        """Multipart uploads a killed run left open hold storage until aborted."""
        prefix = self.store.key(OBJECTS) + "/"
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.store.bucket,
                                                                                  Prefix=prefix)
            for page in pages:
                for upload in page.get("Uploads", ()):
                    self.client.abort_multipart_upload(Bucket=self.store.bucket, Key=upload["Key"],
                                                       UploadId=upload["UploadId"])
        except Exception as exc:  # a store without the call: the leftovers cost space, not correctness
            log.info("cannot list unfinished uploads in %s: %s", self.store, error_code(exc) or exc)

    # -- verify ----------------------------------------------------------------------------------------

    def _verify_copy(self) -> Path:
        """A copy of the store's catalog for verify, apart from the one this node's mounts use."""
        local = work_dir(self.store, self.client)
        copy = local / f"verify-{CATALOG_NAME}"
        if download_catalog(self.client, self.store, copy) is None:
            raise CatalogError(f"{self.store} has no catalog: run prepare first")
        verify_dir = local / "verify"
        verify_dir.mkdir(exist_ok=True)
        os.replace(copy, verify_dir / CATALOG_NAME)
        return verify_dir

    def verify_jobs(self) -> tuple[list[Node], Callable[[Node], Job]]:
        catalog = Catalog.open(self._verify_dir or self._verify_copy(), readonly=True)
        try:
            nodes = [n for n in catalog.files() if n.served_raw]
        finally:
            catalog.close()
        src, dst = self.source, self.store

        def job(n: Node) -> Job:
            # The rows a mount would read the object of (``unfit_raw_row``): a row without its object's size had
            # a GET of any length read into the worker, one naming another image's object checked that one.
            unfit = unfit_raw_row(n)
            if unfit is not None:
                return refused_unread, (f"{unfit}: a mount serves the original",)
            return verify_one_s3, (src.bucket, src.key(n.path), str(n.etag), n.size, dst.bucket,
                                   dst.key(str(n.object)), str(n.checksum), n.served_size)

        return nodes, job

    # -- profile ---------------------------------------------------------------------------------------

    def profile_sample(self, count: int, jobs: int, seed: int = 0, raw_format: str = DEFAULT.name,
                       max_bytes: int | None = None) -> Sample:
        """``count`` random images, expanded and put under STORE/profile-sample-<unique>/ (deleted after), so
        storage is measured as the mount will read it: whole-object GETs, ``jobs`` at once."""
        from ...expand import formats  # NumPy and Pillow: the profile's, not every mount's that opens a store

        if raw_format not in self.raw_formats:
            raise ProfileError(f"{self.label} holds only {', '.join(self.raw_formats)} objects")
        src, dst = self.source, self.store
        client = make_client(jobs + 2)
        # Every GET is read no further than the size the listing (or the upload) gave: see ``client.get``.
        sizes = {(src.bucket, o.key): o.size for o in list_objects(client, src)
                 if o.key.lower().endswith(IMAGE_SUFFIXES)}
        keys = [key for _, key in sizes]
        if not keys:
            raise ProfileError("no PNG/JPEG images in the source")
        random.Random(seed).shuffle(keys)
        sample = Sample([], [], work_dir(dst, client),
                        load=lambda items, seconds: measure_get(lambda obj: get(client, *obj, size=sizes[obj]),
                                                                items, seconds, jobs))
        written: list[str] = []
        prefix = unique("profile-sample-")  # profiles run at once on one store (a Job's pods) keep apart

        def cleanup() -> None:
            delete_keys(client, dst.bucket, written)

        sample.cleanup = cleanup
        try:
            for key in keys:
                if sample.full(count, jobs, max_bytes):
                    break
                data = get(client, src.bucket, key, size=sizes[(src.bucket, key)])
                result = formats.expand(data, to=raw_format)
                if result.data is None:
                    continue
                raw_key = dst.key(f"{prefix}/{len(written)}{RAW_FORMATS[raw_format].suffix}")
                written.append(raw_key)  # before the PUT: one that fails after the object landed leaves none
                put(client, dst.bucket, raw_key, result.data)
                sizes[(dst.bucket, raw_key)] = len(result.data)
                sample.originals.append((src.bucket, key))
                sample.raws.append((dst.bucket, raw_key))
                sample.original_data.append(data)
                sample.raw_data.append(result.data)
            if not sample.raws:
                raise ProfileError("none of the sampled images can be expanded losslessly")
        except BaseException:
            # A GET or PUT that failed, Ctrl-C: the objects put so far are deleted, as the profile's end would.
            try:
                cleanup()
            except Exception as exc:  # the failure that ended the sample is the one said
                log.warning("deleting the profile's sample objects under %s: %s", dst.key(prefix), exc)
            raise
        return sample

    def keep_profile(self, text: str) -> None:
        # The adaptive mix of a bucket store starts mid-range: a profile of one node is not every node's.
        log.info("the profile is not kept in %s (a bucket store): --mix adaptive starts mid-range", self.store)

    def local_dirs(self) -> tuple[Path, Path] | None:
        return None  # a bucket's images: the measured search mounts a local sample only

    def profile_choice(self) -> float | None:
        return None  # none is kept (``keep_profile``)

    # -- mount -----------------------------------------------------------------------------------------

    def mount_catalog(self, *, rescan: bool, progress: bool = True) -> Path:
        return local_catalog(str(self.source), str(self.store), refresh=rescan, progress=progress)

    def found_catalog(self) -> Path:
        return work_dir(self.store, self.client)

    def hold_for_mount(self, catalog_dir: Path) -> None:
        pass  # no lock spans nodes: see ``deleting``

    def reader(self, catalog: Catalog, threads: int, io_timeout: float) -> Reader:
        # Checked again where it is served: this node's mounts of one store share its copy of the catalog, which
        # another source's `mount --refresh` may have rewritten since the command checked it.
        if catalog.meta("source") != str(self.source):
            raise CatalogError(f"the catalog in {self.store} describes {catalog.meta('source')}, not "
                               f"{self.source}: another mount of this store rewrote this node's copy; mount again")
        # A connection kept for each request that may be in flight (``threads``: the reads of open files and the
        # opens' own, each a HEAD and a GET): a pool of --threads + 2 made 110 connections for 128 requests of 64
        # opens at once (a new TLS handshake each, and urllib3's "pool is full" warning each). No single HTTP wait
        # longer than --io-timeout.
        client = make_client(threads + 2, read_timeout=min(READ_TIMEOUT, io_timeout))
        return S3Reader(client, self.source, self.store)

# -- verify ------------------------------------------------------------------------------------------------


def verify_one_s3(src_bucket: str, src_key: str, etag: str, size: int, store_bucket: str, store_key: str,
                  want_checksum: str, raw_size: int | None = None) -> str | None:
    """Runs in a worker process: None when the raw object is sound and decodes to its source's pixels."""
    client = _worker()
    try:
        original = get(client, src_bucket, src_key, if_match=etag, size=size)
        # Read no further than its recorded size (a longer body is refused unread); judge: its digest.
        raw = get(client, store_bucket, store_key, size=raw_size)
    except Exception as exc:
        if error_code(exc) in ("PreconditionFailed", "412"):
            return "source changed since prepare (a mount fails it with EIO until prepare runs again)"
        return f"cannot read: {error_code(exc) or exc}"
    return judge(original, raw, want_checksum)
