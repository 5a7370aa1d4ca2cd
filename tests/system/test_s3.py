"""s3:// datasets against a real object store (OpenStack Swift's S3 API on 127.0.0.1): prepare once into the
bucket, mount from several nodes, fall back or fail cleanly on every kind of doubt. Real mounts, real readers."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from fusehelpers import FUSERMOUNT, is_mounted
from sample import make_sample, mosaic, _photos
from s3faults import FaultProxy, Rule

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

SECRET_MARK = "SECRET"  # the server's secret key is checked never to reach a command line or a log


class Node:
    """One machine of a cluster: its own cache directory (its work dir), its mounts, the shared bucket."""

    def __init__(self, tmp: Path, env: dict[str, str], name: str) -> None:
        self.tmp = tmp / name
        self.tmp.mkdir()
        self.env = {**os.environ, **env, "XDG_CACHE_HOME": str(self.tmp / "cache")}
        self.mounts: list[Path] = []

    def cli(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "liquidfs", *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"liquidfs {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def mount(self, source: str, store: str, *args: str) -> Path:
        mnt = self.tmp / f"mnt{len(self.mounts)}"
        mnt.mkdir()
        self.mounts.append(mnt)
        self.cli("mount", source, str(mnt), "--store", store, "--log-level", "info", *args)
        assert is_mounted(mnt)
        return mnt

    def cleanup(self) -> None:
        for mnt in self.mounts:
            if is_mounted(mnt):
                subprocess.run([sys.executable, "-m", "liquidfs", "umount", str(mnt)], capture_output=True,
                               env=self.env, timeout=60)
            if is_mounted(mnt):
                subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True)


@pytest.fixture
def nodes(tmp_path: Path, s3_server: Any) -> Iterator[Any]:
    made: list[Node] = []

    def make(name: str, **env: str) -> Node:
        node = Node(tmp_path, {**s3_server.env(), **env}, name)
        made.append(node)
        return node

    yield make
    for node in made:
        node.cleanup()


def _upload_tree(client: Any, root: Path, bucket: str, prefix: str) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root).as_posix()}",
                              Body=path.read_bytes())


def _tree(tmp: Path) -> Path:
    """Cityscapes-like images (PNG and JPEG) and other files."""
    root = make_sample(tmp / "src", count=10, width=192, height=96, seed=3, jpeg_share=0.2)
    (root / "notes").mkdir()
    (root / "notes" / "ünïcødé name.txt").write_text("hello\n")
    (root / "notes" / "blob.bin").write_bytes(os.urandom(200_000))
    return root


@pytest.fixture
def dataset(tmp_path: Path, s3_server: Any) -> tuple[Path, str, str, Any]:
    """A local tree, uploaded as s3://<fresh bucket>/cs; the store is s3://<bucket>/cs.liquid."""
    client = s3_server.client()
    bucket = f"data-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    root = _tree(tmp_path)
    _upload_tree(client, root, bucket, "cs")
    return root, f"s3://{bucket}/cs", f"s3://{bucket}/cs.liquid", client


def _snapshot(client: Any, bucket: str) -> dict[str, tuple[str, Any]]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"]: (o["ETag"], o["LastModified"]) for page in pages for o in page.get("Contents", ())}


def _stats(node: Node, mnt: Path) -> dict[str, Any]:
    import json

    return json.loads(node.cli("stats", str(mnt), "--json").stdout)


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im)


def _sha256(root: Path) -> dict[str, str]:
    out = subprocess.run("find . -type f -print0 | sort -z | xargs -0 sha256sum", shell=True, cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return dict(reversed(line.split("  ", 1)) for line in out.splitlines())  # type: ignore[misc]


@pytest.mark.needs_root("the passthrough data path (CAP_SYS_ADMIN): node B must serve through it")
def test_prepare_once_then_two_nodes_read_identical_pixels_with_dali(dataset: Any, nodes: Any) -> None:
    from dali_helpers import dali_decode_all

    root, source, store, client = dataset
    bucket = source.split("/")[2]
    prep = nodes("prep")
    out = prep.cli("prepare", source, "--store", store, "--ratio", "0.5", "--no-progress").stdout
    assert "5 expanded now, 0 reused" in out, out  # 10 PNG/JPEG, half of them raw
    before = _snapshot(client, bucket)
    raw_objects = [k for k in before if k.startswith("cs.liquid/objects/")]
    assert len(raw_objects) == 5 and "cs.liquid/catalog.sqlite" in before

    node_a, node_b = nodes("a"), nodes("b")
    mnt_a = node_a.mount(source, store, "--cache-size", "30%")
    mnt_b = node_b.mount(source, store)
    images = Path("leftImg8bit/train")
    theirs = dali_decode_all(root / images)
    for mnt in (mnt_a, mnt_b):
        ours = dali_decode_all(mnt / images)
        assert ours.keys() == theirs.keys() and len(ours) == 10
        for name, pixels in theirs.items():
            assert np.array_equal(ours[name], pixels), name
    for path in (root / images).rglob("*.png"):  # and a second decoder
        assert np.array_equal(_pixels(mnt_a / path.relative_to(root)), _pixels(path))
    for rel in ("notes/ünïcødé name.txt", "notes/blob.bin", "README.txt", "meta.json"):
        assert (mnt_b / rel).read_bytes() == (root / rel).read_bytes()
    listing = subprocess.run(["find", ".", "-type", "f"], cwd=mnt_a, capture_output=True, text=True).stdout
    assert sorted(listing.split()) == sorted(subprocess.run(["find", ".", "-type", "f"], cwd=root,
                                                            capture_output=True, text=True).stdout.split())
    # pages the kernel lost after a whole read are read again from the bucket: the raw object's or the
    # original's range, checked against what was served
    kinds = set()
    for path in sorted((root / images).rglob("*.png"))[:6]:
        with open(mnt_b / path.relative_to(root), "rb", buffering=0) as f:
            whole = f.read()
            kinds.add(whole[:2] == b"BM")
            st0 = _stats(node_b, mnt_b)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(f.fileno(), 100, 60) == whole[60:160]
            st1 = _stats(node_b, mnt_b)
            if st1["data_path"] == "daemon":
                assert st1["refetches"] == st0["refetches"] + 1
            else:  # passthrough: the object was fetched whole into a checked memfd, which keeps its pages
                assert st1["refetches"] == st0["refetches"] and st1["read_requests"] == 0
    assert kinds == {True, False}
    assert _stats(node_b, mnt_b)["data_path"] == "passthrough"
    assert _stats(node_b, mnt_b)["backing_memfd"] >= 10
    for mnt in (mnt_a, mnt_b):
        stats = _stats(node_a, mnt)
        assert stats["opens_raw"] >= 5 and stats["fallbacks"] == 0 and stats["errors"] == 0
    # Mounts only read: the bucket is exactly as prepare left it, and prepare ran once.
    assert _snapshot(client, bucket) == before
    # No secret on a command line or in a log.
    secret = prep.env["AWS_SECRET_ACCESS_KEY"]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"liquidfs" in cmdline:
            assert secret.encode() not in cmdline
    logs = list((node_a.tmp / "cache").rglob("*.log"))
    assert logs, "the mount's log was not found where this test looks"
    for log in logs:
        assert secret not in log.read_text()


def test_doubt_falls_back_to_the_original_and_a_changed_source_is_eio(dataset: Any, nodes: Any) -> None:
    root, source, store, client = dataset
    bucket = source.split("/")[2]
    node = nodes("n")
    node.cli("prepare", source, "--store", store, "--ratio", "1", "--no-progress")
    assert "all raw objects sound" in node.cli("verify", "--store", store, "--no-progress").stdout
    import sqlite3

    published = node.tmp / "published.sqlite"  # the store's catalog, as prepare published it
    client.download_file(bucket, "cs.liquid/catalog.sqlite", str(published))
    db = sqlite3.connect(f"file:{published}?mode=ro", uri=True)
    raw = {p.decode(): o for p, o in db.execute("SELECT path, object FROM nodes WHERE repr=1 ORDER BY path")}
    db.close()
    names = sorted(raw)
    missing, corrupt, changed = names[0], names[1], names[2]
    client.delete_object(Bucket=bucket, Key=f"cs.liquid/{raw[missing]}")
    good = client.get_object(Bucket=bucket, Key=f"cs.liquid/{raw[corrupt]}")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"cs.liquid/{raw[corrupt]}", Body=good[:-1] + bytes([good[-1] ^ 1]))
    other = Image.new("RGB", (192, 96), (1, 2, 3))
    changed_local = node.tmp / "changed.png"
    other.save(changed_local)
    client.put_object(Bucket=bucket, Key=f"cs/{changed}", Body=changed_local.read_bytes())
    client.put_object(Bucket=bucket, Key="cs/notes/blob.bin", Body=b"rewritten")  # an original that changed

    done = node.cli("verify", "--store", store, "--no-progress", check=False)
    assert done.returncode == 1 and "3 problems" in done.stdout, done.stdout + done.stderr
    for name, why in ((missing, "NoSuchKey"), (corrupt, "checksum mismatch"), (changed, "source changed")):
        assert f"FAIL {name}: " in done.stdout and why in done.stdout.split(f"FAIL {name}: ")[1].split("\n")[0]
    mnt = node.mount(source, store)
    for name in (missing, corrupt):
        assert np.array_equal(_pixels(mnt / name), _pixels(root / name)), name
    with pytest.raises(OSError) as err:
        (mnt / changed).read_bytes()
    assert err.value.errno == 5  # EIO: neither the raw object nor the original can be trusted
    with pytest.raises(OSError) as err:
        (mnt / "notes/blob.bin").read_bytes()
    assert err.value.errno == 5
    for name in names[3:]:  # every other file is served as prepared
        assert np.array_equal(_pixels(mnt / name), _pixels(root / name)), name
    stats = _stats(node, mnt)
    assert stats["fallbacks"] == 2 and stats["errors"] >= 2  # the changed one failed: nothing was served
    log = next((node.tmp / "cache" / "liquidfs").glob("s3-*/mount.log")).read_text()
    assert "raw object missing" in log and "fails its checksum" in log and "source object changed" in log


def test_retries_timeouts_and_errors_stay_per_file(dataset: Any, nodes: Any) -> None:
    root, source, store, client = dataset
    node = nodes("prep")
    node.cli("prepare", source, "--store", store, "--ratio", "0", "--no-progress")
    with FaultProxy(node.env["AWS_ENDPOINT_URL"]) as proxy:
        reader = nodes("r", AWS_ENDPOINT_URL=proxy.endpoint)
        mnt = reader.mount(source, store, "--io-timeout", "6")
        flaky = proxy.add(Rule("notes/blob.bin", status=503, times=2))
        broken = proxy.add(Rule("meta.json", status=500))
        proxy.add(Rule("README.txt", status=0, delay=20))
        assert (mnt / "notes/blob.bin").read_bytes() == (root / "notes/blob.bin").read_bytes()
        assert flaky.hits == 2 and sum("notes/blob.bin" in path for _, path in proxy.requests) == 3, \
            "two 503 answers, then the retry that succeeded"
        for name in ("meta.json", "README.txt"):
            with pytest.raises(OSError) as err:
                (mnt / name).read_bytes()
            assert err.value.errno == 5, name
        assert broken.hits >= 3, "server errors are retried before giving up"
        for path in (root / "leftImg8bit").rglob("*.png"):  # the mount is alive and serves everything else
            assert np.array_equal(_pixels(mnt / path.relative_to(root)), _pixels(path))
        proxy.clear()
        assert (mnt / "meta.json").read_bytes() == (root / "meta.json").read_bytes()  # recovered


def test_a_proxy_that_ignores_if_match_never_serves_a_changed_object(dataset: Any, nodes: Any) -> None:
    """Between the mount and the store, a proxy (or cache) that drops If-Match serves an object as it is now: the
    answer's ETag, not the catalog's, says so, and the read fails with EIO as for a changed object."""
    root, source, store, client = dataset
    bucket = source.split("/")[2]
    node = nodes("prep")
    node.cli("prepare", source, "--store", store, "--ratio", "0", "--no-progress")  # every file its original
    original = (root / "notes/blob.bin").read_bytes()
    changed = bytes(b ^ 0xFF for b in original)  # the same size: only the ETag tells
    etag = client.put_object(Bucket=bucket, Key="cs/notes/blob.bin", Body=changed)["ETag"]

    def ignore_if_match(status: int, headers: list[tuple[str, str]], body: bytes) -> tuple[int, Any, bytes]:
        if status != 412:
            return status, headers, body
        return 200, [("ETag", etag), ("Content-Type", "application/octet-stream")], changed  # as if unasked

    with FaultProxy(node.env["AWS_ENDPOINT_URL"]) as proxy:
        rule = proxy.add(Rule("notes/blob.bin", status=0, rewrite=ignore_if_match))
        reader = nodes("r", AWS_ENDPOINT_URL=proxy.endpoint)
        mnt = reader.mount(source, store)
        with pytest.raises(OSError) as err:
            (mnt / "notes/blob.bin").read_bytes()
        assert err.value.errno == 5 and rule.hits >= 1
        assert (mnt / "README.txt").read_bytes() == (root / "README.txt").read_bytes()  # the rest is served
        log = next((reader.tmp / "cache" / "liquidfs").glob("s3-*/mount.log")).read_text()
        assert f"ETag {etag}" in log, log[-2000:]


def test_refresh_lists_again_and_keeps_prepared_images(dataset: Any, nodes: Any) -> None:
    root, source, store, client = dataset
    bucket = source.split("/")[2]
    node = nodes("n")
    node.cli("prepare", source, "--store", store, "--ratio", "1", "--no-progress")
    client.put_object(Bucket=bucket, Key="cs/notes/new.txt", Body=b"new object\n")
    mnt = node.mount(source, store)
    assert not (mnt / "notes/new.txt").exists()  # the store's catalog is used as it is
    node.cli("umount", str(mnt))
    # Another prepare (here: ratio 0 from another node) replaces the store's catalog: the next mount uses it.
    nodes("other").cli("prepare", source, "--store", store, "--ratio", "0", "--no-progress")
    mnt = node.mount(source, store)
    assert (mnt / "README.txt").read_bytes() and _stats(node, mnt)["opens_raw"] == 0
    _pixels(mnt / next(p for p in (root / "leftImg8bit").rglob("*.png")).relative_to(root))
    assert _stats(node, mnt)["opens_raw"] == 0
    node.cli("umount", str(mnt))
    nodes("again").cli("prepare", source, "--store", store, "--ratio", "1", "--no-progress")
    mnt = node.mount(source, store, "--refresh")
    assert (mnt / "notes/new.txt").read_bytes() == b"new object\n"
    images = [p for p in (root / "leftImg8bit").rglob("*") if p.is_file()]
    for path in images:
        assert np.array_equal(_pixels(mnt / path.relative_to(root)), _pixels(path))
    assert _stats(node, mnt)["opens_raw"] == len(images) == 10


def test_prepare_is_resumable_anywhere_and_lowering_the_ratio_deletes_surplus(dataset: Any, nodes: Any) -> None:
    root, source, store, client = dataset
    bucket = source.split("/")[2]
    big = root / "big.png"  # its BMP (18 MB) is over the multipart threshold: uploaded in parts
    mosaic(3000, 2000, random.Random(1), _photos()).save(big)
    client.put_object(Bucket=bucket, Key="cs/big.png", Body=big.read_bytes())
    first = nodes("first")
    first.cli("prepare", source, "--store", store, "--ratio", "1", "--no-progress")
    objects = {k: v for k, v in _snapshot(client, bucket).items() if "/objects/" in k}
    assert len(objects) == 11
    assert max(int(etag.strip('"').partition("-")[2] or 1) for etag, _ in objects.values()) >= 2, \
        "the large image's BMP should have been uploaded in parts (a multipart ETag ends in -<parts>)"
    # Another node, with nothing local, after the store's catalog was lost: every object is reused as is.
    client.delete_object(Bucket=bucket, Key="cs.liquid/catalog.sqlite")
    out = nodes("second").cli("prepare", source, "--store", store, "--ratio", "1", "--no-progress").stdout
    assert "0 expanded now, 11 reused" in out, out
    assert {k: v for k, v in _snapshot(client, bucket).items() if "/objects/" in k} == objects
    out = first.cli("prepare", source, "--store", store, "--ratio", "0.5", "--no-progress").stdout
    assert "surplus deleted    5" in out, out
    assert len([k for k in _snapshot(client, bucket) if "/objects/" in k]) == 6


def test_clear_errors_without_tracebacks(dataset: Any, nodes: Any, tmp_path: Path) -> None:
    _, source, store, _ = dataset
    node = nodes("n")
    mnt = tmp_path / "m"
    mnt.mkdir()
    done = node.cli("mount", source, str(mnt), check=False)
    assert done.returncode == 1 and "--store s3://" in done.stderr and "Traceback" not in done.stderr
    offline = nodes("offline", AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1")
    done = offline.cli("prepare", source, "--store", store, "--ratio", "1", check=False)
    assert done.returncode == 1 and "object store" in done.stderr and "Traceback" not in done.stderr
    done = offline.cli("mount", source, str(mnt), "--store", store, check=False)
    assert done.returncode == 1 and "object store" in done.stderr and "Traceback" not in done.stderr
    assert not is_mounted(mnt)


def test_ratio_auto_profiles_against_the_store(dataset: Any, nodes: Any) -> None:
    _, source, store, client = dataset
    bucket = source.split("/")[2]
    done = nodes("n").cli("prepare", source, "--store", store, "--ratio", "auto", "--quick", "--no-progress")
    assert "profile chose ratio" in done.stdout
    chosen = float(done.stdout.split("profile chose ratio")[1].split()[0])
    raw = [k for k in _snapshot(client, bucket) if "/objects/" in k]
    assert len(raw) == round(chosen * 10)
    assert not [k for k in _snapshot(client, bucket) if "profile-sample" in k], "the profile's sample is deleted"


def test_disk_cache_level_serves_what_memory_misses(dataset: Any, nodes: Any, tmp_path: Path) -> None:
    root, source, store, _ = dataset
    node = nodes("n")
    node.cli("prepare", source, "--store", store, "--ratio", "0.5", "--no-progress")
    disk = tmp_path / "nvme"
    mnt = node.mount(source, store, "--cache-size", "20%", "--disk-cache", str(disk), "--disk-cache-size", "40%")
    (own,) = [p for p in disk.iterdir() if p.is_dir()]  # this mount's own directory (beside its lock)
    images = sorted(p.relative_to(root) for p in (root / "leftImg8bit").rglob("*") if p.is_file())
    rng = random.Random(7)
    for _ in range(3):
        rng.shuffle(images)
        for rel in images:
            assert np.array_equal(_pixels(mnt / rel), _pixels(root / rel)), rel
    stats = _stats(node, mnt)
    assert stats["disk_hits"] >= 1 and stats["bytes_from_disk"] == stats["disk_hit_bytes"] > 0
    assert stats["cache_hits"] >= 1
    assert 0 < stats["disk_held_bytes"] <= stats["disk_budget"]
    block = min(max(4096, os.statvfs(own).f_frsize), 65536)  # each file charged the disk's whole blocks
    assert sum(-(-f.stat().st_size // block) * block for f in own.iterdir()) == stats["disk_held_bytes"]
    # Memory and disk hold disjoint sets: about 20 % + 40 % of epochs 2 and 3 is served locally.
    served = sum(v["bytes"] for e, v in stats["epochs"].items() if e != "1")
    local = (stats["bytes_from_disk"] + stats["bytes_from_memory"]) / served
    assert local >= 0.45, local
    node.cli("umount", str(mnt))
    assert not own.exists()


def test_prepare_changes_a_catalog_of_its_own_never_the_mounts_copy(dataset: Any, s3_server: Any, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's copy of the store's catalog is the mounts': they read it as a file nobody writes. A prepare on
    that node builds and changes its catalog in a directory of its own, and a prepare that fails (here: killed
    before it published) leaves the mounts' copy as it was, and nothing of its own behind."""
    from liquidfs.catalog.catalog import CATALOG_NAME
    from liquidfs.stores import open_store
    from liquidfs.stores.s3.store import local_catalog
    from liquidfs.sysio.locks import HeldLock

    _, source, store, _ = dataset
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    local = local_catalog(source, store, progress=False)  # what a mount on this node reads
    mounts_copy = local / CATALOG_NAME
    before = (mounts_copy.stat().st_ino, mounts_copy.read_bytes())
    with pytest.raises(RuntimeError, match="killed"):
        with open_store(source, store).preparing(progress=False) as preparation:
            assert preparation.catalog.path.parent != local
            preparation.catalog.db.execute("UPDATE meta SET value='changed' WHERE key='source'")
            raise RuntimeError("killed before publishing")
    assert (mounts_copy.stat().st_ino, mounts_copy.read_bytes()) == before
    assert sorted(p.name for p in local.iterdir() if p.name.startswith(("preparing-", "store-"))) == []
    # What a prepare killed outright leaves (no finally ran: its lock free, its catalog there), the next one sweeps;
    # one whose lock is held is another run's, left alone.
    killed, running = local / "preparing-killed", local / "preparing-running"
    for leftover in (killed, running):
        leftover.mkdir()
        (leftover / "catalog.sqlite").write_bytes(b"x" * 1000)
        (leftover / "lock").touch()
    held = HeldLock(running / "lock")
    try:
        with open_store(source, store).preparing(progress=False):
            pass
        assert not killed.exists() and (running / "catalog.sqlite").exists()
    finally:
        held.release()
