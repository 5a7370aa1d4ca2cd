"""Talking to an S3-compatible object store (AWS S3, Ceph RGW, MinIO, Swift's s3api): URLs, clients, listings.

Credentials, endpoint, region and profiles come from the AWS SDK's own chain (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``~/.aws/config`` and ``credentials``, instance roles...): liquidfs never
takes a secret on its command line, so none shows in ``ps``, and never logs one.

Retries are botocore's "standard" mode: 5xx answers, throttling and connection errors or timeouts are retried
with exponential backoff and jitter, up to ``max_attempts``; each attempt has its own connect and read timeout.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCHEME = "s3://"
#: Attempts per request (the first try included) before a read fails with EIO.
MAX_ATTEMPTS = 5
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 30.0
#: Objects above this are uploaded in parts (S3's single PUT takes up to 5 GB, but parts retry cheaply).
MULTIPART_THRESHOLD = 16 * 1024 * 1024


def is_url(text: str | os.PathLike[str]) -> bool:
    return isinstance(text, str) and text.startswith(SCHEME)


@dataclass(frozen=True, slots=True)
class S3Url:
    """``s3://bucket/prefix``: a bucket and a key prefix (no leading or trailing slash; '' for the whole bucket)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, text: str) -> S3Url:
        if not is_url(text):
            raise ValueError(f"not an s3:// URL: {text!r}")
        bucket, _, prefix = text[len(SCHEME):].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {text!r} (expected s3://BUCKET/PREFIX)")
        return cls(bucket, prefix.strip("/"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"

    def key(self, rel: str | bytes) -> str:
        """The key of ``rel`` below this prefix."""
        name = rel.decode("utf-8", "surrogateescape") if isinstance(rel, bytes) else rel
        return f"{self.prefix}/{name}" if self.prefix else name

    def rel(self, key: str) -> str:
        return key[len(self.prefix) + 1:] if self.prefix else key

    def __contains__(self, other: object) -> bool:
        """True when ``other`` (an S3Url) lies inside this prefix: a store inside its own source is refused."""
        if not isinstance(other, S3Url) or other.bucket != self.bucket:
            return False
        return not self.prefix or other.prefix == self.prefix or other.prefix.startswith(self.prefix + "/")


#: The retry modes botocore knows (``AWS_RETRY_MODE``).
RETRY_MODES = ("legacy", "standard", "adaptive")


def make_client(max_connections: int = 10, *, connect_timeout: float = CONNECT_TIMEOUT,
                read_timeout: float = READ_TIMEOUT) -> Any:
    """An S3 client configured from the standard AWS chain, with bounded retries and per-attempt timeouts.

    ``AWS_MAX_ATTEMPTS`` and ``AWS_RETRY_MODE`` are honoured as the SDKs do (a value given in code would
    otherwise override them); liquidfs's defaults are the standard mode with MAX_ATTEMPTS.
    """
    given = os.environ.get("AWS_MAX_ATTEMPTS") or str(MAX_ATTEMPTS)
    try:
        max_attempts = int(given)
    except ValueError:
        max_attempts = 0
    if max_attempts < 1:  # a typo in an environment: said, never a traceback out of every command and mount
        log.warning("AWS_MAX_ATTEMPTS=%r is no number of tries: %d used", given[:40], MAX_ATTEMPTS)
        max_attempts = MAX_ATTEMPTS
    mode = os.environ.get("AWS_RETRY_MODE") or "standard"
    if mode not in RETRY_MODES:  # botocore's InvalidRetryModeError, out of every command, else
        log.warning("AWS_RETRY_MODE=%r is none of %s: standard used", mode[:40], ", ".join(RETRY_MODES))
        mode = "standard"
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - boto3 is a dependency; a broken install says so clearly
        raise RuntimeError("s3:// sources need boto3 (pip install boto3)") from exc
    config = Config(
        # total_max_attempts: every try, the first included, as AWS_MAX_ATTEMPTS counts them (botocore's
        # max_attempts counts the retries after the first: one more try than asked).
        retries={"total_max_attempts": max_attempts, "mode": mode},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=max_connections,
        user_agent_extra="liquidfs",
    )
    return boto3.session.Session().client("s3", config=config)


def work_dir(store: S3Url, client: Any) -> Path:
    """This node's local directory for a store in a bucket (made if missing): the downloaded catalog and the
    mount's log.

    Keyed by the client's endpoint and the store, so two stores never share one; several mounts of one store on a
    node do (the catalog is replaced atomically and only read by mounts).
    """
    from ...catalog.schema import CatalogError
    from ...catalog.store_dir import check_store_dir, making_refusal
    from ...sysio.home import cache_home

    key = hashlib.sha256(f"{client.meta.endpoint_url}\0{store}".encode()).hexdigest()[:16]
    path = cache_home() / f"s3-{key}"
    # Its catalog is the bucket's whole listing (a private bucket's names), written under a umask's modes by
    # the SDK: the directory is this user's alone (one an older liquidfs made 0755 or 0775 too), and so is each
    # it makes above it (``mkdir -p`` makes them under the umask: 0775 under Debian's 002 for users, which the
    # check below refuses). And root writes there by name: refused where another user could make names in it
    # or above it (a HOME that sudo kept).
    missing = [p for p in (path, *path.parents) if not p.exists()]
    if os.geteuid() == 0 and missing:
        # Before anything is made: where the levels there are (a HOME that sudo kept, an XDG_CACHE_HOME) are
        # another user's to move or point elsewhere (~/.cache/liquidfs a link to /etc), root made its directories
        # where they chose, and narrowed the mode of the directory they pointed at, before the check refused.
        refused = making_refusal(path, "put it where only root and this user may write (XDG_CACHE_HOME)")
        if refused is not None:
            raise CatalogError(refused)
    for each in reversed(missing):
        each.mkdir(mode=0o700, exist_ok=True)
    for own in (path, path.parent):  # this store's directory, and liquidfs's (an older one's, the local store's)
        st = own.lstat()  # never a mode changed through a link: where it leads is not this directory
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            own.chmod(0o700)
    if os.geteuid() == 0:  # (a user's own cache under a group-writable ~/.cache is theirs to keep so)
        check_store_dir(path, writing=True)
    return path


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    mtime_ns: int


def list_objects(client: Any, url: S3Url) -> Iterator[ObjectInfo]:
    """Every object below ``url``, from paginated ListObjectsV2 (1,000 keys a page), in key order."""
    paginator = client.get_paginator("list_objects_v2")
    prefix = f"{url.prefix}/" if url.prefix else ""
    for page in paginator.paginate(Bucket=url.bucket, Prefix=prefix):
        for item in page.get("Contents", ()):
            if not str(item["Key"]).startswith(prefix):  # the answer is the endpoint's: not taken on its word
                log.warning("the listing of %s named %r, outside it; left out", url, item["Key"])
                continue
            info = _listed(item)
            if info is None:
                log.warning("the listing of %s named %r without an ETag, a size or a time an object has; left out",
                            url, item.get("Key"))
                continue
            yield info


def _listed(item: dict[str, Any]) -> ObjectInfo | None:
    """One entry of a listing as an object, or None where it lacks what one has: an ETag (an empty one turned
    off every check of the object's identity: no If-Match, no ETag compared), a size, a time. The answer is the
    endpoint's: a key missing was a KeyError out of prepare and mount."""
    try:
        key, size, etag, modified = item["Key"], item["Size"], item["ETag"], item["LastModified"]
        if not isinstance(key, str) or not isinstance(etag, str) or not bare_etag(etag):
            return None
        return ObjectInfo(key, int(size), etag,
                          int(modified.timestamp()) * 1_000_000_000 + modified.microsecond * 1000)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, OSError):
        return None


class AnswerMismatch(Exception):
    """An object store's answer to a GET that is not what was asked for: another ETag than the one ``If-Match``
    named (a proxy or cache that drops the header serves a changed object), another range or total size, or
    another number of bytes. Its bytes are never returned.

    It carries a botocore-like ``response``, so ``error_code`` and every caller treat it like the store's own
    refusal: a different object as a 412 (``PreconditionFailed``: the object changed), a wrong range or length as
    ``AnswerMismatch``; a read of the mount gets EIO for either (``as_oserror``).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.response = {"Error": {"Code": code, "Message": message}}


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def same_etag(one: object, other: object) -> bool:
    """Whether two ETags are the same: S3 quotes them, and a proxy or another store may quote one and not the
    other (compared as given, every raw object of such a store was served as its original). Never where either
    is none: a row without one and a HEAD whose answer lost it were the same, and the raw object was served with
    no check of its source."""
    bare = bare_etag(one)
    return bool(bare) and bare == bare_etag(other)


def bare_etag(etag: object) -> str:
    """An ETag without its quotes; '' for none (None, not text)."""
    return etag.strip().strip('"') if isinstance(etag, str) else ""


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", "")) or str(
        response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def as_oserror(exc: BaseException, where: str) -> OSError:
    """A botocore failure as the errno a reader of the mount gets."""
    if isinstance(exc, AnswerMismatch):
        return OSError(errno.EIO, str(exc), where)
    code = error_code(exc)
    if code in ("NoSuchKey", "404", "NotFound"):
        return FileNotFoundError(errno.ENOENT, "no such object", where)
    if code in ("AccessDenied", "403"):
        return PermissionError(errno.EACCES, "access denied by the object store", where)
    if code in ("PreconditionFailed", "412"):
        return OSError(errno.EIO, "object changed since the catalog was made (ETag differs)", where)
    return OSError(errno.EIO, f"object store: {type(exc).__name__}: {code or exc}", where)


def get(client: Any, bucket: str, key: str, *, if_match: str | None = None,
        start: int | None = None, length: int | None = None, size: int | None = None) -> bytes:
    """An object's bytes (or ``length`` bytes from ``start``); ``if_match`` makes a changed object fail (412).

    Every GET of liquidfs goes through here, and its answer is checked against the question before any byte is
    returned: the ETag against ``if_match``, the Content-Range against the range asked for and against ``size``
    (the object's size, when the caller knows it), and the body's length; ``AnswerMismatch`` otherwise.

    With ``size`` (or ``length``) known, the body is read no further than the bytes asked for and one more:
    whoever writes the bucket, or stands between it and the node, chooses how long a body is, and reading it
    whole before checking its length let them fill every node's memory. Every caller in liquidfs gives one.
    """
    args: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if if_match is not None:
        if not bare_etag(if_match):  # no ETag to match: every check of the object's identity would be off
            raise AnswerMismatch("PreconditionFailed", f"{key}: no ETag recorded to ask for")
        args["IfMatch"] = if_match
    if start is not None:
        end = "" if length is None else str(start + length - 1)
        args["Range"] = f"bytes={start}-{end}"
    answer = client.get_object(**args)
    body = answer["Body"]
    try:
        data = _read_body(body, _most_bytes(start, length, size), f"{bucket}/{key}")
    finally:
        body.close()
    if if_match is not None and not same_etag(answer.get("ETag", ""), if_match):
        raise AnswerMismatch("PreconditionFailed", "the object store answered with ETag "
                             f"{answer.get('ETag')}, not the {if_match} asked for (If-Match ignored on the way?)")
    if start is None:  # S3 sends no Content-Range for a whole GET; if anything does, it must be the whole
        first, last, total = (_content_range(answer["ContentRange"], size) if answer.get("ContentRange")
                              else (0, len(data) - 1, len(data)))
        asked = (0, (size if size is not None else total or 0) - 1)
    else:
        first, last, total = _content_range(answer.get("ContentRange"), size)
        asked = (start, start + length - 1 if length is not None else (total or 0) - 1)
    if (first, last) != asked or len(data) != last - first + 1:
        raise AnswerMismatch("AnswerMismatch", f"the object store answered {len(data)} bytes as bytes {first}-{last}/"
                             f"{'*' if total is None else total}, asked for bytes {asked[0]}-{asked[1]}")
    return data


def _most_bytes(start: int | None, length: int | None, size: int | None) -> int | None:
    """The most bytes an honest answer to a GET can have: what was asked for, where the object's size or the
    range's length says; None where neither is known (the body is then read whole)."""
    if length is not None:
        return length
    if size is not None:
        return max(0, size - (start or 0))
    return None


def _read_body(body: Any, most: int | None, where: str) -> bytes:
    """The body of an answer, read no further than ``most`` bytes and one more: one more says it is too long
    (``AnswerMismatch``), and nothing past it is ever taken from the connection."""
    if most is None:
        return body.read()  # type: ignore[no-any-return]
    parts: list[bytes] = []
    got = 0
    # One read asks for all of it (a single buffer of the size asked for, as a whole read had); more reads only
    # where the stream hands out less at once, and the last one (empty) lets botocore check Content-Length.
    while got <= most:
        chunk: bytes = body.read(most + 1 - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    if got > most:
        raise AnswerMismatch("AnswerMismatch", f"the object store answered more than the {most} bytes asked "
                             f"for of {where}; the rest was not read")
    return b"".join(parts)


def _content_range(text: object, size: int | None) -> tuple[int, int, int | None]:
    """``(first, last, total)`` of a Content-Range; the total must be ``size`` when the caller knows it."""
    found = _CONTENT_RANGE.fullmatch(str(text or "").strip())
    if found is None:
        raise AnswerMismatch("AnswerMismatch", f"the object store answered Content-Range {text!r}")
    total = None if found[3] == "*" else int(found[3])
    if size is not None and total != size:
        # The object has another size than the one asked about: it is not that object any more.
        raise AnswerMismatch("PreconditionFailed", f"the object store answered an object of {found[3]} "
                             f"bytes, not of {size}")
    return int(found[1]), int(found[2]), total


def head(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """The object's headers, or None if it does not exist."""
    try:
        return client.head_object(Bucket=bucket, Key=key)  # type: ignore[no-any-return]
    except Exception as exc:
        if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def put(client: Any, bucket: str, key: str, data: bytes | memoryview, metadata: dict[str, str] | None = None) -> None:
    """Upload ``data`` as one object; in parts above MULTIPART_THRESHOLD (boto3's transfer manager)."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD,
                            max_concurrency=4, use_threads=True)
    client.upload_fileobj(io.BytesIO(data), bucket, key, ExtraArgs={"Metadata": metadata or {}}, Config=config)


def upload_file(client: Any, path: Path, bucket: str, key: str, metadata: dict[str, str] | None = None) -> None:
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD)
    client.upload_file(str(path), bucket, key, ExtraArgs={"Metadata": metadata or {}}, Config=config)
