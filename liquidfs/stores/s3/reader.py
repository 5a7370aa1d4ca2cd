"""What the mount serves from an object store: the raw object when sound, else the original, never mixed bytes.

The interface is ``reader.Reader`` (``open`` and ``check_source``), so the FUSE layer, the cache and the
timeouts are the same for both kinds of storage. Every call blocks (HTTP) and runs in the mount's worker threads,
so ``mount --threads`` bounds the requests in flight; botocore retries 5xx, throttling and timeouts with
backoff (``client.make_client``), and a read that still fails is EIO for that file only.

Identity: the catalog records each source object's ETag. An original is fetched with ``If-Match`` on it, so a
changed object fails (412 -> EIO) instead of serving bytes the catalog does not describe; an answer with another
ETag, range, size or length than asked for (a proxy that drops ``If-Match``) fails the same way (``client.get``
checks every answer). A raw object is served only while its source still has the recorded ETag (one HEAD) and the
object has the recorded size and BLAKE2b-256 digest (no stat vouches for a bucket's object: one whose catalog row
holds an xxh3 digest, from a prepare before BLAKE2b, is never served); otherwise the original is served, or EIO
when the original changed too.
"""

from __future__ import annotations

import errno
import functools
import logging
from typing import Any

from ...catalog.nodes import Node
from ..reader import WHOLE_FILE_LIMIT, Content, FallbackLog, asked_already, check_raw, unfit_raw_row
from .client import AnswerMismatch, S3Url, as_oserror, error_code, get, head, same_etag

log = logging.getLogger(__name__)


def _source_etag(node: Node) -> str:
    """The ETag a GET of ``node``'s source asks for (If-Match): '' for a row with none (a damaged or foreign
    catalog's; a listing never makes one), which ``client.get`` refuses unasked. Asked for with none, a source
    rewritten at the same size was served as the version the catalog describes."""
    return node.etag if isinstance(node.etag, str) else ""


class S3Reader:
    def __init__(self, client: Any, source: S3Url, store: S3Url) -> None:
        self.client = client
        self.source = source
        self.store = store
        self._fallbacks = FallbackLog(log)
        self.inline_check = True  # check_source asks nothing of the store

    def close(self) -> None:
        """Nothing held: the client's connections go with the process."""

    def _where(self, node: Node) -> str:
        return f"{self.source}/{node.path.decode('utf-8', 'surrogateescape')}"

    def open(self, node: Node) -> Content:
        """What ``node`` serves, read whole (or, above WHOLE_FILE_LIMIT, in ranges as the reader asks)."""
        fallback = None
        if node.served_raw:
            fallback = self.source_changed_now(node)
            if fallback is None:
                fallback, data = self._open_raw(node)
                if data is not None:
                    return Content(size=len(data), raw=True, data=memoryview(data))
            self._warn_once(node, fallback)
        key = self.source.key(node.path)
        if node.size > WHOLE_FILE_LIMIT:
            fetch = functools.partial(self._range, key, _source_etag(node), node.size, self._where(node))
            return Content(size=node.size, raw=False, fetch=fetch, fallback=fallback)
        try:
            data = get(self.client, self.source.bucket, key, if_match=_source_etag(node), size=node.size)
        except Exception as exc:
            raise as_oserror(exc, self._where(node)) from exc
        return Content(size=len(data), raw=False, data=memoryview(data), fallback=fallback)

    def vouch(self, node: Node, *, cached_only: bool = False) -> bool | None:
        """None: what a node serves is not known without a request (a HEAD of the source, a GET of the raw
        object), which is the read itself."""
        return None

    def check_source(self, node: Node, st: object = None, *, cached_only: bool = False,
                     version: tuple[int, int, int, int] | None = None) -> str | None:
        """Bytes held in memory were checked when they were read; an object store is not asked again per hit
        of memory (a request per hit would cost more than the hit saves). A changed object is caught at the next
        miss. What outlives an epoch on a disk (``held.disk``) or what every node's misses may find in the
        cluster asks ``source_changed_now``. (``version`` is a local file's stamp: no object-store read makes
        one.)"""
        return None

    def source_changed_now(self, node: Node) -> str | None:
        """One HEAD of the source object: None while it has the ETag and size the catalog recorded (or where the
        cluster's miss asked it a moment ago in this open)."""
        if asked_already(node):
            return None
        try:
            found = head(self.client, self.source.bucket, self.source.key(node.path))
        except Exception as exc:
            raise as_oserror(exc, self._where(node)) from exc
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "source object deleted", self._where(node))
        if not same_etag(found.get("ETag"), node.etag) or int(found.get("ContentLength", -1)) != node.size:
            return "source object changed since prepare"
        return None

    def _open_raw(self, node: Node) -> tuple[str | None, bytes | None]:
        unfit = unfit_raw_row(node)
        if unfit is not None:
            return unfit, None
        assert node.object is not None  # a row without one is unfit
        try:
            # Its size as recorded: a longer body is refused before more than that is read (whoever writes the
            # store chooses how long it is); check_raw then checks the bytes.
            data = get(self.client, self.store.bucket, self.store.key(node.object), size=node.served_size)
        except Exception as exc:
            code = error_code(exc)
            if code in ("NoSuchKey", "404", "NotFound"):
                return "raw object missing", None
            if isinstance(exc, AnswerMismatch):
                return f"raw object: {exc}", None
            return f"raw object unreadable ({code or type(exc).__name__})", None
        problem = check_raw(node, data)
        return problem, None if problem else data

    def read_span(self, node: Node, raw: bool, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of what ``node`` served (its raw object, or its source object), for a read of
        part of a file whose bytes were let go; the caller checks them against the digests of what was served."""
        if raw:
            assert node.object is not None
            bucket, key, etag, size = self.store.bucket, self.store.key(node.object), None, node.served_size
            where = str(node.object)
        else:
            bucket, key, etag, size = self.source.bucket, self.source.key(node.path), _source_etag(node), node.size
            where = self._where(node)
        try:
            return memoryview(get(self.client, bucket, key, if_match=etag, start=start, length=end - start,
                                  size=size))
        except Exception as exc:
            raise as_oserror(exc, where) from exc

    def _range(self, key: str, etag: str | None, size: int, where: str, offset: int, length: int) -> bytes:
        try:
            return get(self.client, self.source.bucket, key, if_match=etag, start=offset, length=length, size=size)
        except Exception as exc:
            raise as_oserror(exc, where) from exc

    def _warn_once(self, node: Node, why: str | None) -> None:
        self._fallbacks.warn_once(node, self._where(node), why)
