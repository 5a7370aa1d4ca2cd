"""The S3 server the s3:// tests run against (tests/support/s3server.py) behaves like S3 for everything liquidfs uses."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from s3server import S3ServerError, SwiftS3Server

MiB = 1 << 20


@pytest.fixture
def bucket(s3_server: SwiftS3Server) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


def _status(exc: ClientError) -> int:
    return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])


def test_started(s3_server: SwiftS3Server) -> None:
    assert s3_server.endpoint.startswith("http://127.0.0.1:")
    assert s3_server.startup_seconds is not None  # printed, not judged: the fixture fails a start that hangs
    print(f"Swift S3 server started in {s3_server.startup_seconds:.1f} s")
    assert isinstance(s3_server.client().list_buckets()["Buckets"], list)
    for name, proc in s3_server.procs.items():
        assert proc.poll() is None, f"{name} server exited"


def test_wrong_secret_is_refused(s3_server: SwiftS3Server) -> None:
    import boto3
    client = boto3.session.Session().client("s3", endpoint_url=s3_server.endpoint, region_name=s3_server.region,
                                            aws_access_key_id=s3_server.access_key, aws_secret_access_key="wrong")
    with pytest.raises(ClientError) as info:
        client.list_buckets()
    assert _status(info.value) == 403


def test_env_for_subprocesses(s3_server: SwiftS3Server, bucket: str) -> None:
    """A default boto3 client built from the environment alone (as liquidfs builds its own) reaches the server."""
    code = ("import boto3, sys; c = boto3.client('s3'); c.put_object(Bucket=sys.argv[1], Key='env', Body=b'x'); "
            "print(c.get_object(Bucket=sys.argv[1], Key='env')['Body'].read().decode())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    done = subprocess.run([sys.executable, "-c", code, bucket], env={**env, **s3_server.env()},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "x"


def test_put_head_get_metadata_delete(s3_server: SwiftS3Server, bucket: str) -> None:
    client = s3_server.client()
    body = os.urandom(1000)
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    put = client.put_object(Bucket=bucket, Key="dir/obj.bin", Body=body,
                            Metadata={"liquidfs-checksum": "abc123", "Mixed-Case": "Value with spaces"})
    assert put["ETag"] == f'"{hashlib.md5(body).hexdigest()}"'

    head = client.head_object(Bucket=bucket, Key="dir/obj.bin")
    assert head["ETag"] == put["ETag"]
    assert head["ContentLength"] == len(body)
    # Last-Modified is an HTTP date (whole seconds; Swift rounds the timestamp up to the next second)
    assert isinstance(head["LastModified"], dt.datetime) and head["LastModified"].tzinfo is not None
    assert before <= head["LastModified"] <= dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    assert head["Metadata"] == {"liquidfs-checksum": "abc123", "mixed-case": "Value with spaces"}

    got = client.get_object(Bucket=bucket, Key="dir/obj.bin")
    assert got["Body"].read() == body
    assert got["ETag"] == put["ETag"] and got["Metadata"] == head["Metadata"]

    client.delete_object(Bucket=bucket, Key="dir/obj.bin")
    with pytest.raises(ClientError) as info:
        client.head_object(Bucket=bucket, Key="dir/obj.bin")
    assert _status(info.value) == 404
    with pytest.raises(ClientError) as info:
        client.get_object(Bucket=bucket, Key="dir/obj.bin")
    assert info.value.response["Error"]["Code"] == "NoSuchKey"
    client.delete_object(Bucket=bucket, Key="dir/obj.bin")  # deleting what is gone succeeds, as on S3


def test_ranged_get_and_if_match(s3_server: SwiftS3Server, bucket: str) -> None:
    client = s3_server.client()
    body = bytes(range(256)) * 40
    etag = client.put_object(Bucket=bucket, Key="r", Body=body)["ETag"]

    part = client.get_object(Bucket=bucket, Key="r", Range="bytes=100-299")
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert part["ContentRange"] == f"bytes 100-299/{len(body)}"
    assert part["ContentLength"] == 200 and part["Body"].read() == body[100:300]
    assert client.get_object(Bucket=bucket, Key="r", Range="bytes=-10")["Body"].read() == body[-10:]
    tail = client.get_object(Bucket=bucket, Key="r", Range=f"bytes={len(body) - 5}-{len(body) + 100}")
    assert tail["Body"].read() == body[-5:]  # a range running past the end is clipped

    matched = client.get_object(Bucket=bucket, Key="r", Range="bytes=0-9", IfMatch=etag)
    assert matched["Body"].read() == body[:10]
    assert client.get_object(Bucket=bucket, Key="r", IfMatch=etag)["Body"].read() == body
    for kwargs in ({}, {"Range": "bytes=0-9"}):
        with pytest.raises(ClientError) as info:
            client.get_object(Bucket=bucket, Key="r", IfMatch='"0123456789abcdef0123456789abcdef"', **kwargs)
        assert _status(info.value) == 412
        assert info.value.response["Error"]["Code"] == "PreconditionFailed"

    with pytest.raises(ClientError) as info:
        client.get_object(Bucket=bucket, Key="r", Range=f"bytes={len(body)}-")
    assert _status(info.value) == 416


def test_multipart_upload(s3_server: SwiftS3Server, bucket: str) -> None:
    client = s3_server.client()
    body = os.urandom(12 * MiB)
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    client.upload_fileobj(io.BytesIO(body), bucket, "big", Config=config)

    head = client.head_object(Bucket=bucket, Key="big")
    assert head["ContentLength"] == len(body)
    # S3's multipart ETag: MD5 of the parts' binary MD5s, "-" and the number of parts
    parts = [body[i:i + 5 * MiB] for i in range(0, len(body), 5 * MiB)]
    expected = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    assert head["ETag"] == f'"{expected}-3"'

    got = client.get_object(Bucket=bucket, Key="big")
    assert got["ETag"] == head["ETag"] and got["Body"].read() == body
    span = client.get_object(Bucket=bucket, Key="big", Range=f"bytes={5 * MiB - 10}-{5 * MiB + 9}",
                             IfMatch=head["ETag"])  # across the first part boundary, conditional on the ETag
    assert span["Body"].read() == body[5 * MiB - 10:5 * MiB + 10]
    with pytest.raises(ClientError) as info:
        client.get_object(Bucket=bucket, Key="big", Range="bytes=0-9", IfMatch=f'"{expected}-4"')
    assert _status(info.value) == 412

    listed = client.list_objects_v2(Bucket=bucket)["Contents"]
    assert [(o["Key"], o["Size"], o["ETag"]) for o in listed] == [("big", len(body), head["ETag"])]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_list_objects_v2_pagination(s3_server: SwiftS3Server, bucket: str) -> None:
    client = s3_server.client()
    keys = ["a/1", "a/2", "b", "c/x/y", "d"]
    etags = {key: client.put_object(Bucket=bucket, Key=key, Body=key.encode())["ETag"] for key in keys}

    pages: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "MaxKeys": 2}
    while True:
        page = client.list_objects_v2(**kwargs)
        pages.append(page)
        if not page["IsTruncated"]:
            break
        kwargs["ContinuationToken"] = page["NextContinuationToken"]
    assert [[o["Key"] for o in p["Contents"]] for p in pages] == [keys[0:2], keys[2:4], keys[4:5]]
    assert [p["KeyCount"] for p in pages] == [2, 2, 1]
    for page in pages:
        for obj in page["Contents"]:
            assert obj["ETag"] == etags[obj["Key"]] and obj["Size"] == len(obj["Key"])
            assert isinstance(obj["LastModified"], dt.datetime)

    paginated = [o["Key"] for p in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, PaginationConfig={"PageSize": 2}) for o in p["Contents"]]
    assert paginated == keys
    prefixed = client.list_objects_v2(Bucket=bucket, Prefix="a/")
    assert [o["Key"] for o in prefixed["Contents"]] == ["a/1", "a/2"]
    delimited = client.list_objects_v2(Bucket=bucket, Delimiter="/")
    assert [o["Key"] for o in delimited["Contents"]] == ["b", "d"]
    assert [p["Prefix"] for p in delimited["CommonPrefixes"]] == ["a/", "c/"]
    assert client.list_objects_v2(Bucket=bucket, StartAfter="c/x/y")["Contents"][0]["Key"] == "d"


def test_missing_swift_fails_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(S3ServerError, match="apt-get install .*swift-proxy"):
        SwiftS3Server(tmp_path).start()
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing started
