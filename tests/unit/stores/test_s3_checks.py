"""Every answer to a GET is checked against the question (``stores.s3.client.get``): its ETag against the ``If-Match`` sent, its
Content-Range against the range asked for and the object's size, its body's length. A proxy or cache on the way
that ignores ``If-Match`` or ``Range``, or cuts a body short, makes the read fail as a changed object does (EIO in
a mount, a refusal in prepare and verify): its bytes are never returned.

A fake client that answers as S3 does, with hooks that spoil its answers the way a misbehaving proxy would;
tests/system/test_s3.py has the same through a real mount, a real server and a real proxy.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import xxhash
from botocore.exceptions import ClientError
from forge import xxh3_twins
from PIL import Image

from liquidfs.catalog.identity import checksum
from liquidfs.catalog.schema import CatalogError
from liquidfs.catalog.nodes import KIND_FILE, REPR_ORIGINAL, REPR_RAW, Node
from liquidfs.expand.expansion import Outcome, object_name
from liquidfs.stores.s3 import reader as s3reader
from liquidfs.stores.s3 import store as bucket_store
from liquidfs.stores.s3.client import AnswerMismatch, S3Url, as_oserror, error_code, get

BUCKET = "b"
Answer = dict[str, Any]


def _etag(data: bytes) -> str:
    return f'"{hashlib.md5(data).hexdigest()}"'


def _error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


class FakeS3:
    """GET and HEAD as S3 answers them (If-Match, clipped ranges, Content-Range); ``ignore_if_match`` and
    ``spoil`` make it a proxy that misbehaves. Uploads are recorded, not stored."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.ignore_if_match = False
        self.spoil: Callable[[Answer, bytes, int], Answer] | None = None  # (answer, object, first byte)
        self.uploads: list[str] = []
        self.metadata: dict[str, dict[str, str]] = {}
        self.heads = 0
        self.gets: list[str] = []  # the keys asked for, in order

    def get_object(self, *, Bucket: str, Key: str, IfMatch: str | None = None, Range: str | None = None) -> Answer:
        self.gets.append(Key)
        if Key not in self.objects:
            raise _error("NoSuchKey", 404)
        data = self.objects[Key]
        if IfMatch is not None and IfMatch.strip('"') != _etag(data).strip('"') and not self.ignore_if_match:
            raise _error("PreconditionFailed", 412)
        answer: Answer = {"ETag": _etag(data)}
        first = 0
        if Range is not None:
            first_text, _, last_text = Range.removeprefix("bytes=").partition("-")
            first, last = int(first_text), min(int(last_text or len(data) - 1), len(data) - 1)
            if first >= len(data):
                raise _error("InvalidRange", 416)
            answer["ContentRange"] = f"bytes {first}-{last}/{len(data)}"
            data = data[first:last + 1]
        answer["Body"], answer["ContentLength"] = io.BytesIO(data), len(data)
        return self.spoil(answer, self.objects[Key], first) if self.spoil else answer

    def head_object(self, *, Bucket: str, Key: str) -> Answer:
        self.heads += 1
        if Key not in self.objects:
            raise _error("404", 404)
        data = self.objects[Key]
        return {"ETag": _etag(data), "ContentLength": len(data), "Metadata": dict(self.metadata.get(Key, {}))}

    def upload_fileobj(self, fileobj: Any, bucket: str, key: str, **kwargs: Any) -> None:
        self.uploads.append(key)
        self.objects[key] = fileobj.read()
        self.metadata[key] = dict(kwargs.get("ExtraArgs", {}).get("Metadata", {}))


def _body(answer: Answer, data: bytes) -> Answer:
    answer["Body"], answer["ContentLength"] = io.BytesIO(data), len(data)
    return answer


# What a misbehaving proxy makes of an answer: each must fail the GET, whatever was asked.

def _shifted(answer: Answer, whole: bytes, first: int) -> Answer:
    """The range one byte further on (an off-by-one proxy): as long as asked, but other bytes."""
    last = first + answer["ContentLength"]
    answer["ContentRange"] = f"bytes {first + 1}-{last}/{len(whole)}"
    return _body(answer, whole[first + 1:last + 1])


def _other_total(answer: Answer, whole: bytes, first: int) -> Answer:
    """The range asked for, of an object of another size (a stale cache of an older version)."""
    first_text, _, rest = answer["ContentRange"].partition("/")
    answer["ContentRange"] = f"{first_text}/{len(whole) + 100}"
    return answer


def _whole_object(answer: Answer, whole: bytes, first: int) -> Answer:
    """200 with the whole object to a ranged GET (a proxy that drops Range)."""
    del answer["ContentRange"]
    return _body(answer, whole)


def _short(answer: Answer, whole: bytes, first: int) -> Answer:
    """The body cut short, with a Content-Length that agrees (a proxy that re-frames a truncated answer)."""
    data = answer["Body"].read()
    return _body(answer, data[:-1])


RANGE_SPOILERS = [_shifted, _other_total, _whole_object, _short]


@pytest.fixture
def s3() -> FakeS3:
    fake = FakeS3()
    fake.objects["k"] = bytes(range(256)) * 8
    return fake


def test_honest_answers_are_returned(s3: FakeS3) -> None:
    data = s3.objects["k"]
    assert get(s3, BUCKET, "k") == data
    assert get(s3, BUCKET, "k", if_match=_etag(data), size=len(data)) == data
    assert get(s3, BUCKET, "k", if_match=_etag(data).strip('"'), start=100, length=200, size=len(data)) == \
        data[100:300]
    assert get(s3, BUCKET, "k", start=len(data) - 5, length=5) == data[-5:]
    assert get(s3, BUCKET, "k", start=10) == data[10:]
    s3.objects["empty"] = b""
    assert get(s3, BUCKET, "empty", if_match=_etag(b""), size=0) == b""


@pytest.mark.parametrize("ranged", [False, True])
def test_a_changed_object_served_despite_if_match_is_refused(s3: FakeS3, ranged: bool) -> None:
    """A proxy that drops If-Match serves the object as it is now, of the same size: only the ETag tells."""
    old = s3.objects["k"]
    s3.objects["k"] = bytes(reversed(old))
    s3.ignore_if_match = True
    span: dict[str, int] = {"start": 8, "length": 16} if ranged else {}
    with pytest.raises(AnswerMismatch) as err:
        get(s3, BUCKET, "k", if_match=_etag(old), size=len(old), **span)
    assert error_code(err.value) == "PreconditionFailed"  # what S3's own 412 says: every caller treats it so
    assert as_oserror(err.value, "s3://b/k").errno == errno.EIO


def test_an_answer_without_an_etag_is_refused_when_one_was_asked_for(s3: FakeS3) -> None:
    def no_etag(answer: Answer, whole: bytes, first: int) -> Answer:
        del answer["ETag"]
        return answer

    s3.spoil = no_etag
    with pytest.raises(AnswerMismatch):
        get(s3, BUCKET, "k", if_match=_etag(s3.objects["k"]))


@pytest.mark.parametrize("spoil", RANGE_SPOILERS, ids=lambda f: f.__name__.strip("_"))
def test_a_wrong_range_or_length_is_refused(s3: FakeS3, spoil: Callable[[Answer, bytes, int], Answer]) -> None:
    data = s3.objects["k"]
    s3.spoil = spoil
    with pytest.raises(AnswerMismatch) as err:
        get(s3, BUCKET, "k", if_match=_etag(data), start=100, length=200, size=len(data))
    assert as_oserror(err.value, "s3://b/k").errno == errno.EIO


@pytest.mark.parametrize("text", [None, "", "bytes 100-299", "bytes */2048", "items 100-299/2048"])
def test_a_ranged_answer_needs_a_content_range_it_can_read(s3: FakeS3, text: str | None) -> None:
    def garbled(answer: Answer, whole: bytes, first: int) -> Answer:
        answer["ContentRange"] = text
        return answer

    s3.spoil = garbled
    with pytest.raises(AnswerMismatch):
        get(s3, BUCKET, "k", start=100, length=200)


def test_a_whole_object_cut_short_or_partial_is_refused(s3: FakeS3) -> None:
    data = s3.objects["k"]
    s3.spoil = lambda answer, whole, first: _body(answer, whole[:-1])
    with pytest.raises(AnswerMismatch):
        get(s3, BUCKET, "k", if_match=_etag(data), size=len(data))

    def partial(answer: Answer, whole: bytes, first: int) -> Answer:  # 206 with a part, to a GET of the whole
        answer["ContentRange"] = f"bytes 0-99/{len(whole)}"
        return _body(answer, whole[:100])

    s3.spoil = partial
    with pytest.raises(AnswerMismatch):
        get(s3, BUCKET, "k", if_match=_etag(data))
    with pytest.raises(AnswerMismatch):
        get(s3, BUCKET, "k", if_match=_etag(data), size=len(data))


# -- through the mount's reader: EIO, as for a changed object, never the bytes ----------------------------

SOURCE, STORE = S3Url(BUCKET, "src"), S3Url(BUCKET, "store")


def _node(rel: bytes, data: bytes, *, raw: bytes | None = None) -> Node:
    node = Node(id=7, parent=1, name=rel, path=rel, kind=KIND_FILE, mode=0o100444, size=len(data), mtime_ns=1,
                nsubdirs=0, target=None, representation=REPR_RAW if raw is not None else REPR_ORIGINAL,
                served_size=len(raw) if raw is not None else None, object=None,
                checksum=checksum(raw) if raw is not None else None, etag=_etag(data))
    return dataclasses.replace(node, object=object_name(node)) if raw is not None else node


def _reader(s3: FakeS3, data: bytes, raw: bytes | None = None) -> tuple[s3reader.S3Reader, Node]:
    s3.objects[SOURCE.key("f.bin")] = data
    node = _node(b"f.bin", data, raw=raw)
    if raw is not None:
        s3.objects[STORE.key(str(node.object))] = raw
    return s3reader.S3Reader(s3, SOURCE, STORE), node


def test_a_source_whose_etag_a_store_quotes_otherwise_is_no_changed_source(s3: FakeS3) -> None:
    """The catalog's ETag quoted, a HEAD's bare (or the other way): the same ETag, and the raw object served;
    compared as given, every raw object of such a store fell back to its original."""
    data = b"the original image " * 64
    raw = bytes(range(256)) * 8
    reader, node = _reader(s3, data, raw=raw)
    for etag in (node.etag.strip('"'), f'"{node.etag.strip(chr(34))}"', f' "{node.etag.strip(chr(34))}" '):
        listed = dataclasses.replace(node, etag=etag)  # as the catalog has it: its object named so at prepare
        listed = dataclasses.replace(listed, object=object_name(listed))
        s3.objects[STORE.key(str(listed.object))] = raw
        content = reader.open(listed)
        assert content.raw and bytes(content.data or b"") == raw, (etag, content.fallback)


def test_a_get_asked_to_match_no_etag_is_refused(s3: FakeS3) -> None:
    """An empty ETag to match (a row that records none) sent no If-Match and compared no ETag: every check of
    the object's identity off. Refused as a changed object is."""
    s3.objects[SOURCE.key("f.bin")] = b"data"
    with pytest.raises(AnswerMismatch) as refused:
        get(s3, BUCKET, SOURCE.key("f.bin"), if_match=' "" ', size=4)
    assert error_code(refused.value) == "PreconditionFailed"


@pytest.mark.parametrize("size", [500, "streamed"])
def test_a_row_without_its_sources_etag_is_never_read_unchecked(s3: FakeS3, monkeypatch: pytest.MonkeyPatch,
                                                               size: object) -> None:
    """A damaged or foreign row with no ETag: its source was read with no If-Match, only its size checked, so a
    source rewritten at the same size was served as the version the catalog describes. EIO, asked for nothing."""
    if size == "streamed":
        monkeypatch.setattr(s3reader, "WHOLE_FILE_LIMIT", 10)
    data = b"0123456789" * 50
    reader, node = _reader(s3, data)
    unmarked = dataclasses.replace(node, etag=None)
    with pytest.raises(OSError) as err:
        content = reader.open(unmarked)
        content.read(0, 100)
    assert err.value.errno == errno.EIO
    with pytest.raises(OSError):
        reader.read_span(unmarked, False, 0, 100)
    assert s3.gets == []  # never asked for


def test_reader_open_of_a_changed_object_is_eio(s3: FakeS3) -> None:
    data = b"0123456789" * 50
    reader, node = _reader(s3, data)
    assert bytes(reader.open(node).data) == data  # type: ignore[arg-type]
    s3.objects[SOURCE.key("f.bin")] = data.upper().replace(b"0", b"o")  # same size, other bytes
    s3.ignore_if_match = True
    with pytest.raises(OSError) as err:
        reader.open(node)
    assert err.value.errno == errno.EIO and "ETag" in str(err.value)


@pytest.mark.parametrize("spoil", [None, *RANGE_SPOILERS], ids=lambda f: f.__name__.strip("_") if f else "changed")
def test_reader_ranges_of_a_large_object_are_eio(s3: FakeS3, monkeypatch: pytest.MonkeyPatch,
                                                  spoil: Callable[[Answer, bytes, int], Answer] | None) -> None:
    """A large object is read in ranges as the reader asks (``Content.fetch``): each answer is checked too."""
    monkeypatch.setattr(s3reader, "WHOLE_FILE_LIMIT", 100)
    data = bytes(range(256)) * 4
    reader, node = _reader(s3, data)
    content = reader.open(node)
    assert content.fetch is not None and bytes(content.read(300, 50)) == data[300:350]
    if spoil is None:
        s3.objects[SOURCE.key("f.bin")] = bytes(reversed(data))
        s3.ignore_if_match = True
    s3.spoil = spoil
    with pytest.raises(OSError) as err:
        content.read(300, 50)
    assert err.value.errno == errno.EIO


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("spoil", RANGE_SPOILERS, ids=lambda f: f.__name__.strip("_"))
def test_reader_read_span_is_eio(s3: FakeS3, spoil: Callable[[Answer, bytes, int], Answer], raw: bool) -> None:
    """Pages read again after the kernel let them go (``read_span``), of the original or of the raw object."""
    data = bytes(range(256)) * 4
    reader, node = _reader(s3, data, raw=data[::-1] + b"!" if raw else None)
    whole = s3.objects[STORE.key(str(node.object))] if raw else data
    assert bytes(reader.read_span(node, raw, 256, 512)) == whole[256:512]
    s3.spoil = spoil
    with pytest.raises(OSError) as err:
        reader.read_span(node, raw, 256, 512)
    assert err.value.errno == errno.EIO


class EndlessBody:
    """A body far larger than any object the catalog names (a store writer's, or a proxy's, answer), counting the
    bytes taken from it: read whole, it is 64 MiB here, and any amount on a real connection."""

    def __init__(self) -> None:
        self.taken = 0
        self.closed = False

    def read(self, amt: int | None = None) -> bytes:
        n = 64 << 20 if amt is None else min(amt, 64 << 20)
        self.taken += n
        return b"\0" * n

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("raw", [True, False], ids=["raw-object", "original"])
def test_a_body_larger_than_the_object_is_read_no_further_than_its_size(s3: FakeS3, raw: bool) -> None:
    """A GET read the whole body before checking its length: whoever can write the store (or stands between it
    and the nodes) made every node that opened the file hold as much as they sent. The body is read up to the
    size the catalog records and one byte more: past it, the answer is refused as a wrong length is, and the
    raw object falls back to its original (EIO for an original, as for a changed one)."""
    data = bytes(range(256)) * 4
    reader, node = _reader(s3, data, raw=data[::-1] + b"!" if raw else None)
    expected = node.served_size if raw else node.size
    assert expected is not None
    bodies: list[EndlessBody] = []
    target = STORE.key(str(node.object)) if raw else SOURCE.key("f.bin")

    def huge(answer: Answer, whole: bytes, first: int) -> Answer:
        if whole != s3.objects[target]:
            return answer
        bodies.append(EndlessBody())
        answer["Body"] = bodies[-1]  # Content-Length as expected: only the body itself says it is more
        return answer

    s3.spoil = huge
    if raw:
        content = reader.open(node)
        assert not content.raw and bytes(content.data or b"") == data  # the original, as for a damaged object
        assert content.fallback is not None and "raw object" in content.fallback
    else:
        with pytest.raises(OSError) as err:
            reader.open(node)
        assert err.value.errno == errno.EIO
    assert len(bodies) == 1 and bodies[0].closed
    assert bodies[0].taken <= expected + 1, bodies[0].taken


# -- prepare and verify: a refusal, as for a changed object ------------------------------------------------

def _png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 16), colour).save(out, "PNG", compress_level=0)  # stored: the size follows the pixels
    return out.getvalue()


def test_prepare_and_verify_refuse_a_changed_object_served_despite_if_match(
        s3: FakeS3, monkeypatch: pytest.MonkeyPatch) -> None:
    before, after = _png((1, 2, 3)), _png((200, 100, 50))
    assert len(before) == len(after) and before != after
    s3.objects["src/a.png"] = after  # changed since the listing, which recorded ``before``'s ETag
    s3.ignore_if_match = True
    monkeypatch.setattr(bucket_store, "_worker_client", s3)
    outcome = bucket_store.expand_one_s3(BUCKET, "src/a.png", b"a.png", len(before), 1, _etag(before), BUCKET,
                                    "store/objects/ab/a.bmp", "objects/ab/a.bmp")
    assert outcome.reason == "changed-during-prepare" and outcome.object is None and s3.uploads == []
    s3.objects["store/objects/ab/a.bmp"] = b"raw"
    verdict = bucket_store.verify_one_s3(BUCKET, "src/a.png", _etag(before), len(before), BUCKET,
                                    "store/objects/ab/a.bmp", checksum(b"raw"))
    assert verdict is not None and verdict.startswith("source changed since prepare")


def test_a_source_object_larger_than_a_worker_can_hold_is_never_downloaded(
        s3: FakeS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A size the source bucket's writer chooses (a 60 GB "image"): refused for memory before its GET, as a local
    source is before its read; tried again by the next run."""
    from liquidfs.expand import expansion

    png = _png((1, 2, 3))
    s3.objects["src/a.png"] = png
    monkeypatch.setattr(bucket_store, "_worker_client", s3)
    monkeypatch.setattr(expansion, "_budget", len(png) // 2)
    outcome = bucket_store.expand_one_s3(BUCKET, "src/a.png", b"a.png", len(png), 1, _etag(png), BUCKET,
                                         "store/objects/ab/a.bmp", "objects/ab/a.bmp")
    assert outcome.reason == "no-memory" and outcome.object is None and s3.gets == [] and s3.uploads == []


@pytest.mark.parametrize("fault", [MemoryError, RuntimeError])
def test_a_fault_of_an_objects_expansion_is_its_refusal_never_the_end_of_the_prepare(
        s3: FakeS3, monkeypatch: pytest.MonkeyPatch, fault: type[Exception]) -> None:
    """The expansion's header walk ran outside the worker's catch-all: a MemoryError there reached the prepare
    (``future.result()``) and ended the run. It is this image's refusal, tried again by the next run."""
    from liquidfs.expand import formats

    png = _png((1, 2, 3))
    s3.objects["src/a.png"] = png
    monkeypatch.setattr(bucket_store, "_worker_client", s3)

    def failing(source: bytes) -> int:
        raise fault("the header walk failed")

    monkeypatch.setattr(formats, "pixel_count", failing)
    outcome = bucket_store.expand_one_s3(BUCKET, "src/a.png", b"a.png", len(png), 1, _etag(png), BUCKET,
                                         "store/objects/ab/a.bmp", "objects/ab/a.bmp")
    assert outcome.object is None and s3.uploads == []
    assert outcome.reason == ("no-memory" if fault is MemoryError else "worker-error:RuntimeError")


# -- a raw object is vouched for by its BLAKE2b digest, never by xxh3 (issue 38) ---------------------------

def test_a_raw_object_rewritten_to_the_same_xxh3_is_refused_and_the_original_served(s3: FakeS3) -> None:
    """Whoever writes the bucket rewrote a raw object with other bytes of its size and its xxh3_64 (a moment's
    work: ``forge.xxh3_twins``): the xxh3 checksum prepare recorded vouched for them, and a mount served them."""
    data = b"the original image " * 64
    recorded, forged = xxh3_twins(bytes(range(256)) * 8)
    reader, node = _reader(s3, data, raw=recorded)
    assert bytes(reader.open(node).data or b"") == recorded  # sound: served raw
    s3.objects[STORE.key(str(node.object))] = forged
    content = reader.open(node)
    assert not content.raw and bytes(content.data or b"") == data, "the forged object was served"
    assert content.fallback == "raw object fails its checksum"


def test_a_catalog_row_with_an_xxh3_digest_vouches_for_no_object(s3: FakeS3, caplog: pytest.LogCaptureFixture) -> None:
    """A catalog from before BLAKE2b records xxh3 digests: even of the very object, it vouches for nothing a
    bucket's writer could have chosen. The original is served (a fallback), and the log says once, for every
    such file, to run prepare again."""
    data = b"the original image " * 64
    raw = bytes(range(256)) * 8
    reader, node = _reader(s3, data, raw=raw)
    legacy = dataclasses.replace(node, checksum=xxhash.xxh3_64_hexdigest(raw))
    with caplog.at_level(logging.WARNING, logger=s3reader.__name__):
        for one in (legacy, dataclasses.replace(legacy, id=8), legacy):
            content = reader.open(one)
            assert not content.raw and bytes(content.data or b"") == data, "an xxh3 digest vouched for the object"
            assert content.fallback is not None and "liquidfs prepare" in content.fallback
    said = [r for r in caplog.records if "liquidfs prepare" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_a_row_naming_another_images_object_serves_the_original(s3: FakeS3) -> None:
    """A catalog row pointing at another image's object, its size and digest copied along: the S3 reader read
    any object a row named, and served image B as file A. Only the object named after this file's source is."""
    data = b"the original image " * 64
    other = b"another image's bytes " * 64
    reader, node = _reader(s3, data, raw=bytes(range(256)) * 8)
    theirs = _node(b"other.bin", other, raw=bytes(range(255, -1, -1)) * 8)
    s3.objects[STORE.key(str(theirs.object))] = bytes(range(255, -1, -1)) * 8
    pointed = dataclasses.replace(node, object=theirs.object, served_size=theirs.served_size,
                                  checksum=theirs.checksum)
    content = reader.open(pointed)
    assert not content.raw and bytes(content.data or b"") == data
    assert content.fallback is not None and "not the object of this file's source" in content.fallback
    assert STORE.key(str(theirs.object)) not in s3.gets


def test_a_row_of_the_wrong_types_serves_the_original(s3: FakeS3) -> None:
    """SQLite keeps a BLOB in a TEXT column: a row whose object or ETag is bytes (whoever writes the bucket wrote
    its catalog) raised out of the check of its object's name (EIO and a traceback), and out of verify."""
    from liquidfs.stores.reader import unfit_raw_row

    data = b"the original image " * 64
    reader, node = _reader(s3, data, raw=bytes(range(256)) * 8)
    content = reader.open(dataclasses.replace(node, object=str(node.object).encode()))
    assert not content.raw and content.fallback == "a catalog row of the wrong types"
    for field in ("etag", "checksum", "object_stamp"):
        assert unfit_raw_row(dataclasses.replace(node, **{field: b"bytes"})) == content.fallback, field


@pytest.mark.parametrize("column", ["object", "served_size"])
def test_a_raw_row_without_its_object_or_its_size_gets_no_get_and_serves_the_original(s3: FakeS3, column: str) -> None:
    """A GET without a size reads a body of any length: a row that names no size (whoever writes the store's
    catalog chooses) must not have a 20 GB object downloaded into the daemon's memory."""
    data = b"the original image " * 64
    raw = bytes(range(256)) * 8
    reader, node = _reader(s3, data, raw=raw)
    content = reader.open(dataclasses.replace(node, **{column: None}))
    assert not content.raw and bytes(content.data or b"") == data
    assert content.fallback is not None and "no raw object recorded" in content.fallback
    assert STORE.key(str(node.object)) not in s3.gets


@pytest.mark.parametrize("digest", ["xxh3", "none", "garbage"])
def test_prepare_reuses_no_object_whose_metadata_has_no_blake2b_digest(
        s3: FakeS3, monkeypatch: pytest.MonkeyPatch, digest: str) -> None:
    """A bucket prepared before BLAKE2b holds objects whose metadata says their xxh3: reused from it, that
    digest went into the catalog again and kept vouching. Such an object is made and put again."""
    png = _png((1, 2, 3))
    s3.objects["src/a.png"] = png
    monkeypatch.setattr(bucket_store, "_worker_client", s3)
    raw = bucket_store.expand_bytes(b"a.png", len(png), 1, png)[1]
    assert raw is not None
    s3.objects["store/objects/ab/a.bmp"] = raw
    meta = {"liquidfs-source-etag": _etag(png).strip('"'), "liquidfs-format": "png"}
    meta["liquidfs-checksum"] = {"xxh3": xxhash.xxh3_64_hexdigest(raw), "none": "", "garbage": "../" * 22}[digest]
    s3.metadata["store/objects/ab/a.bmp"] = meta
    outcome = bucket_store.expand_one_s3(BUCKET, "src/a.png", b"a.png", len(png), 1, _etag(png), BUCKET,
                                         "store/objects/ab/a.bmp", "objects/ab/a.bmp")
    blake = hashlib.blake2b(raw, digest_size=32).hexdigest()
    assert not outcome.reused and outcome.checksum == blake and s3.uploads == ["store/objects/ab/a.bmp"]
    assert s3.metadata["store/objects/ab/a.bmp"]["liquidfs-checksum"] == blake
    again = bucket_store.expand_one_s3(BUCKET, "src/a.png", b"a.png", len(png), 1, _etag(png), BUCKET,
                                       "store/objects/ab/a.bmp", "objects/ab/a.bmp")
    assert again.reused and again.checksum == blake and len(s3.uploads) == 1  # now it is reused


def test_prepare_never_takes_an_objects_metadata_for_its_digest(s3: FakeS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever may write the store's objects put other bytes at an image's object name, with metadata naming the
    source's ETag and those bytes' own BLAKE2b digest: reused on its metadata, that digest went into the catalog
    and the mount served those bytes as the image. The digest recorded is always of this run's own expansion:
    such an object is put again; one whose metadata claims the expansion's digest falsely is left (not put
    again) and fails that digest at the mount, which serves the original."""
    png = _png((1, 2, 3))
    s3.objects["src/a.png"] = png
    monkeypatch.setattr(bucket_store, "_worker_client", s3)
    raw = bucket_store.expand_bytes(b"a.png", len(png), 1, png)[1]
    assert raw is not None
    blake = hashlib.blake2b(raw, digest_size=32).hexdigest()
    planted = b"B" * len(raw)
    s3.objects["store/objects/ab/a.bmp"] = planted
    meta = {"liquidfs-source-etag": _etag(png).strip('"'), "liquidfs-format": "png",
            "liquidfs-checksum": hashlib.blake2b(planted, digest_size=32).hexdigest()}
    s3.metadata["store/objects/ab/a.bmp"] = meta

    def expanded() -> Outcome:
        return bucket_store.expand_one_s3(BUCKET, "src/a.png", b"a.png", len(png), 1, _etag(png), BUCKET,
                                          "store/objects/ab/a.bmp", "objects/ab/a.bmp")

    outcome = expanded()
    assert not outcome.reused and outcome.checksum == blake and s3.uploads == ["store/objects/ab/a.bmp"]
    # (uploads are recorded, not stored: the planted bytes stay, their metadata now claiming the expansion's)
    assert s3.metadata["store/objects/ab/a.bmp"]["liquidfs-checksum"] == blake
    again = expanded()
    assert again.reused and again.checksum == blake and len(s3.uploads) == 1


def test_verify_fails_an_object_whose_recorded_digest_is_xxh3(s3: FakeS3, monkeypatch: pytest.MonkeyPatch) -> None:
    png = _png((1, 2, 3))
    s3.objects["src/a.png"] = png
    raw = bucket_store.expand_bytes(b"a.png", len(png), 1, png)[1]
    assert raw is not None
    s3.objects["store/objects/ab/a.bmp"] = raw
    monkeypatch.setattr(bucket_store, "_worker_client", s3)

    def verdict(digest: str) -> str | None:
        return bucket_store.verify_one_s3(BUCKET, "src/a.png", _etag(png), len(png), BUCKET,
                                          "store/objects/ab/a.bmp", digest, len(raw))

    assert verdict(hashlib.blake2b(raw, digest_size=32).hexdigest()) is None
    legacy = verdict(xxhash.xxh3_64_hexdigest(raw))
    assert legacy is not None and "liquidfs prepare" in legacy


@pytest.mark.parametrize("disk", [False, True], ids=["over-the-bucket", "over-a-disk-level"])
def test_a_cluster_hit_of_a_bucket_asks_the_source_first(s3: FakeS3, tmp_path: Any, disk: bool) -> None:
    """A value any node stored is every node's hit, so no miss of this node's would ever check its source again:
    the cluster asks the bucket (a HEAD) before it serves one, through a --disk-cache level too. A source
    replaced since is never served its old image (the original's If-Match GET fails: EIO), a deleted one is
    ENOENT."""
    from clusterfakes import FakeMemcached

    from liquidfs.held.cluster import ClusterLevel
    from liquidfs.held.disk import DiskLevel
    from liquidfs.policy.next_epoch import NextEpochCache

    data = b"0123456789" * 50
    reader, node = _reader(s3, data, raw=data[::-1] + b"!")
    inner = DiskLevel(reader, tmp_path, NextEpochCache(0, 10**6, 10, max_id=100)) if disk else reader
    level = ClusterLevel(inner, FakeMemcached(), 1.0, public=lambda n: True)
    assert level.open(node).level == "storage"  # the miss: read from the store, stored to the cluster
    hit = level.open(node)
    assert hit.level == "cluster" and bytes(hit.data or b"") == data[::-1] + b"!"
    s3.objects[SOURCE.key("f.bin")] = data.upper().replace(b"0", b"o")  # same size, other bytes
    with pytest.raises(OSError) as err:
        level.open(node)
    assert err.value.errno == errno.EIO
    del s3.objects[SOURCE.key("f.bin")]
    with pytest.raises(FileNotFoundError):
        level.open(node)
    assert level.statistics().values()["cluster_hits"] == 1
    if isinstance(inner, DiskLevel):
        inner.close()


@pytest.mark.parametrize("disk", [False, True], ids=["over-the-bucket", "over-a-disk-level"])
def test_a_cluster_miss_asks_the_bucket_once(s3: FakeS3, tmp_path: Any, disk: bool) -> None:
    """The cluster's HEAD before its fetch stands for the raw read of its miss (a moment later, in the same open):
    one HEAD an open, hit or miss; a source changed since is still refused at the next open."""
    from clusterfakes import FakeMemcached

    from liquidfs.held.cluster import ClusterLevel
    from liquidfs.held.disk import DiskLevel
    from liquidfs.policy.next_epoch import NextEpochCache

    data = b"0123456789" * 50
    reader, node = _reader(s3, data, raw=data[::-1] + b"!")
    inner = DiskLevel(reader, tmp_path, NextEpochCache(0, 10**6, 10, max_id=100)) if disk else reader
    level = ClusterLevel(inner, FakeMemcached(), 1.0, public=lambda n: True)
    assert level.open(node).level == "storage" and s3.heads == 1
    assert level.open(node).level == "cluster" and s3.heads == 2
    assert reader.source_changed_now(node) is None and s3.heads == 3  # outside an open: asked
    s3.objects[SOURCE.key("f.bin")] = data.upper().replace(b"0", b"o")
    with pytest.raises(OSError):
        level.open(node)
    if isinstance(inner, DiskLevel):
        inner.close()


class _Publishing(FakeS3):
    """A store whose catalog is published anew during the first ``times`` downloads of it (a prepare finishing
    while a mount downloads): right after the first part of each is answered."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times
        self.downloads = 0

    def get_object(self, **kwargs: Any) -> Answer:
        answer = super().get_object(**kwargs)
        key = kwargs["Key"]
        if key.endswith("catalog.sqlite") and str(kwargs.get("Range", "")).startswith("bytes=0-"):
            self.downloads += 1
            if self.downloads <= self.times:
                self.objects[key] = bytes(reversed(self.objects[key]))  # published meanwhile
        return answer


@pytest.mark.parametrize("times", [0, 1, 3])
def test_a_catalog_published_during_its_download_is_downloaded_again(tmp_path: Path, times: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is kept only where every part of it is the catalog the HEAD named, and its ETag is the copy's;
    one that changed during every download is an error, not a torn copy taken for the store's."""
    monkeypatch.setattr(bucket_store, "CATALOG_PART", 64)  # 200 bytes: four parts
    s3 = _Publishing(times)
    store = S3Url.parse(f"s3://{BUCKET}/store")
    s3.objects[store.key("catalog.sqlite")] = bytes(range(200))
    dest = tmp_path / "catalog.sqlite"
    if times >= 3:
        with pytest.raises(CatalogError, match="changed during each of three downloads"):
            bucket_store.download_catalog(s3, store, dest)
        assert not dest.exists() and list(tmp_path.iterdir()) == []  # no part left behind
        return
    etag = bucket_store.download_catalog(s3, store, dest)
    now = s3.objects[store.key("catalog.sqlite")]
    assert dest.read_bytes() == now and etag == _etag(now) and s3.downloads == times + 1


@pytest.mark.parametrize(("attempts", "mode"), [("three", ""), ("0", ""), ("-3", ""), ("", "bogus")])
def test_a_retry_setting_botocore_refuses_is_said_and_the_default_used(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture,
                                                                       attempts: str, mode: str) -> None:
    """AWS_MAX_ATTEMPTS=three raised ValueError out of every command and mount of an object store, 0 or -3 and
    AWS_RETRY_MODE=bogus botocore's errors; and the tries are counted as AWS_MAX_ATTEMPTS counts them, the first
    included (botocore's max_attempts made one more)."""
    from liquidfs.stores.s3 import client as client_module

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", attempts)
    monkeypatch.setenv("AWS_RETRY_MODE", mode)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    made = client_module.make_client()
    retries = made.meta.config.retries
    assert retries["total_max_attempts"] == client_module.MAX_ATTEMPTS and retries["mode"] == "standard"
    said = f"AWS_MAX_ATTEMPTS={attempts!r} is no number of tries" if attempts else "AWS_RETRY_MODE='bogus' is none"
    assert said in caplog.text


def test_an_answer_that_is_not_what_was_asked_is_one_line_of_the_cli(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    restore_logging: None) -> None:
    """AnswerMismatch (an object store's answer of another ETag, range or length) is liquidfs's own class, not
    botocore's: it reached the user as a traceback."""
    from liquidfs import cli, prepare as prepare_module
    from liquidfs.stores.s3.client import AnswerMismatch

    def mismatched(*args: object, **kwargs: object) -> None:
        raise AnswerMismatch("AnswerMismatch", "an answer of 7 bytes where 9 were asked")

    monkeypatch.setattr(prepare_module, "verify", mismatched)
    assert cli.main(["verify", "--store", "/nonexistent", "--no-progress"]) == 1
    assert "object store: an answer of 7 bytes where 9 were asked" in capsys.readouterr().err


def test_a_catalog_larger_than_the_room_left_is_not_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store's catalog of any size its HEAD says (a broken or hostile store): downloaded, it filled the node's
    disk at every mount. Refused where it would not fit with room to spare; one that fits is downloaded."""
    s3 = _Publishing(0)
    store = S3Url.parse(f"s3://{BUCKET}/store")
    s3.objects[store.key("catalog.sqlite")] = bytes(range(200))
    dest = tmp_path / "catalog.sqlite"
    monkeypatch.setattr(bucket_store.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    monkeypatch.setattr(bucket_store, "CATALOG_SPARE_BYTES", 801)  # 200 bytes and that: one more than is free
    with pytest.raises(CatalogError, match="1000 bytes free: not downloaded"):
        bucket_store.download_catalog(s3, store, dest)
    assert s3.downloads == 0 and not dest.exists()
    monkeypatch.setattr(bucket_store, "CATALOG_SPARE_BYTES", 800)
    assert bucket_store.download_catalog(s3, store, dest) and dest.read_bytes() == bytes(range(200))


class _Lying(FakeS3):
    """A store (or a proxy before it) whose HEAD of the catalog says another size than its GETs do, or no ETag."""

    def __init__(self, said: int | None, etag: bool = True) -> None:
        super().__init__()
        self.said, self.etag = said, etag

    def head_object(self, **kwargs: Any) -> Answer:
        answer = super().head_object(**kwargs)
        if self.said is not None:
            answer["ContentLength"] = self.said
        if not self.etag:
            del answer["ETag"]
        return answer


def test_a_catalog_longer_than_its_head_said_or_without_an_etag_is_not_downloaded(tmp_path: Path) -> None:
    """The SDK's download wrote whatever body came (50 MB where the HEAD said 1,000 bytes filled the node's disk
    at every mount), and an answer without an ETag was a KeyError's traceback. Neither leaves a file behind."""
    store = S3Url.parse(f"s3://{BUCKET}/store")
    dest = tmp_path / "catalog.sqlite"
    longer = _Lying(None)
    longer.spoil = lambda answer, whole, first: _body(answer, answer["Body"].read() + b"x" * (50 << 20))
    weak = _Lying(None)  # a proxy that answers GETs with a weak ETag: If-Match fails, and its HEAD says unchanged
    weak.spoil = lambda answer, whole, first: {**answer, "ETag": "W/" + answer["ETag"]}
    for s3, error, said in ((longer, AnswerMismatch, "more than"), (_Lying(100), AnswerMismatch, "more than the 100"),
                            (weak, CatalogError, "disagree with its HEAD"),
                            (_Lying(None, etag=False), CatalogError, "answered no ETag")):
        s3.objects[store.key("catalog.sqlite")] = bytes(range(200))
        with pytest.raises(error, match=said):
            bucket_store.download_catalog(s3, store, dest)
        assert list(tmp_path.iterdir()) == []
    assert len(weak.gets) == 1  # said at once, not downloaded three times as a catalog being published
    honest = _Lying(None)
    honest.objects[store.key("catalog.sqlite")] = bytes(range(200))
    assert bucket_store.download_catalog(honest, store, dest) and dest.read_bytes() == bytes(range(200))
    assert dest.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("source", ["s3:///nobucket", "/data/local", None, "s3://b/store/inside"])
def test_a_url_or_a_catalog_source_that_is_no_bucket_is_a_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 source: str | None) -> None:
    """``s3:///x`` as the user's source, or a bucket catalog whose source is none or inside its store: a
    ValueError's traceback out of prepare, mount and verify."""
    if source == "s3:///nobucket":
        with pytest.raises(CatalogError, match="no bucket"):
            bucket_store.BucketStore.given(source, "s3://b/store")
        return
    from liquidfs.catalog.build import build_from_objects

    made = tmp_path / "made"
    build_from_objects(iter([("a.png", 3, '"e"', 0)]), made, str(source))
    monkeypatch.setattr(bucket_store.BucketStore, "_verify_copy", lambda self: made)
    with pytest.raises(CatalogError, match="names no s3:// source|must not contain each other"):
        bucket_store.BucketStore.prepared("s3://b/store")


def test_a_mount_whose_new_catalog_has_no_room_uses_the_copy_it_has(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The store published a catalog that no longer fits beside this node's copy: the mount that worked before
    goes on with the copy it has (said), rather than stop; with no copy at all it stops, naming the room."""
    from liquidfs.catalog.build import build_from_objects

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    s3 = _Publishing(0)
    s3.meta = SimpleNamespace(endpoint_url="http://s3.example")  # type: ignore[attr-defined]
    monkeypatch.setattr(bucket_store, "make_client", lambda *a, **kw: s3)
    made = tmp_path / "made"
    build_from_objects(iter([("a.png", 10, '"e1"', 1)]), made, f"s3://{BUCKET}/src")
    s3.objects[STORE.key("catalog.sqlite")] = (made / "catalog.sqlite").read_bytes()
    local = bucket_store.local_catalog(f"s3://{BUCKET}/src", f"s3://{BUCKET}/store", progress=False)
    kept = (local / "catalog.sqlite").read_bytes()
    s3.objects[STORE.key("catalog.sqlite")] = kept + b"\0" * 4096  # published anew: another ETag
    monkeypatch.setattr(bucket_store.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    assert bucket_store.local_catalog(f"s3://{BUCKET}/src", f"s3://{BUCKET}/store", progress=False) == local
    assert (local / "catalog.sqlite").read_bytes() == kept and "the copy this node has is used" in caplog.text
    (local / "catalog.sqlite").unlink()
    with pytest.raises(CatalogError, match="bytes free: not downloaded"):
        bucket_store.local_catalog(f"s3://{BUCKET}/src", f"s3://{BUCKET}/store", progress=False)


def test_no_etag_is_the_same_as_no_other(s3: FakeS3) -> None:
    """A row without an ETag and a HEAD whose answer lost it (a proxy) were the same ETag (None == None, '' ==
    ''): the source 'unchanged', its raw object served with no check of its identity."""
    from liquidfs.stores.s3.client import same_etag

    assert same_etag('"abc"', "abc") and same_etag(" abc ", '"abc"')
    assert not any(same_etag(a, b) for a, b in ((None, None), ("", ""), ('""', ""), (None, "None"), (3, 3)))
    data = b"0123456789" * 50
    reader, node = _reader(s3, data, raw=data[::-1])
    unmarked = dataclasses.replace(node, etag=None)
    s3.head_object = lambda **kwargs: {"ContentLength": len(data)}  # type: ignore[method-assign]
    assert reader.source_changed_now(unmarked) is not None
