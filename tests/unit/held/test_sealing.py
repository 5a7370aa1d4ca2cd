"""The cluster key (``--cluster-key-file``): a file that others could read or write, or that holds anything but
32 random bytes, is refused with a message naming the flag; what is sealed under the key opens only under it, for
the identity it was sealed for."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from liquidfs.held.sealing import KEY_BYTES, OVERHEAD, ClusterKey, KeyFileError, Sealer, read_key_file


def _key_file(tmp_path: Path, data: bytes | None = None, mode: int = 0o400, name: str = "key") -> Path:
    path = tmp_path / name
    path.write_bytes(os.urandom(KEY_BYTES) if data is None else data)
    path.chmod(mode)
    return path


def test_a_root_owned_0400_file_of_32_random_bytes_is_the_key(tmp_path: Path) -> None:
    secret = os.urandom(KEY_BYTES)
    for mode in (0o400, 0o600):
        path = _key_file(tmp_path, secret, mode, name=f"key{mode:o}")
        key = read_key_file(path)
        assert key.secret == secret and secret.hex() not in repr(key)
    # A Kubernetes Secret's file is a link into its ..data directory: the file it leads to is what is checked.
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "key400")
    assert read_key_file(link).secret == secret


@pytest.mark.parametrize("mode", [0o440, 0o404, 0o644, 0o420, 0o402, 0o660])
def test_a_key_others_may_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    path = _key_file(tmp_path, mode=mode)
    with pytest.raises(KeyFileError, match=rf"--cluster-key-file .*mode {mode:04o} lets group or others"):
        read_key_file(path)


def test_a_key_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = _key_file(tmp_path)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        euid = None
    else:  # a user cannot give a file away: the daemon's uid is said to be another
        euid = os.geteuid() + 1
    with pytest.raises(KeyFileError, match=r"--cluster-key-file .*owned by uid \d+; it must be root's"):
        read_key_file(path, euid=euid)


@pytest.mark.parametrize("data", [b"", os.urandom(31), os.urandom(33), os.urandom(32).hex().encode(),
                                  os.urandom(32).hex().encode() + b"\n", os.urandom(5000)],
                         ids=["empty", "31", "33", "hex", "hex-line", "5000"])
def test_a_key_of_another_length_is_refused_and_says_how_to_make_one(tmp_path: Path, data: bytes) -> None:
    with pytest.raises(KeyFileError, match=r"--cluster-key-file .*holds \d+\+? bytes; a key is exactly 32 raw random "
                                           r"bytes \(head -c 32 /dev/urandom > FILE\)"):
        read_key_file(_key_file(tmp_path, data))


@pytest.mark.parametrize("data", [bytes(32), b"password" * 4, bytes(range(8)) * 4], ids=["zeros", "word", "eight"])
def test_a_key_that_is_not_random_is_refused(tmp_path: Path, data: bytes) -> None:
    with pytest.raises(KeyFileError, match="not random"):
        read_key_file(_key_file(tmp_path, data))


def test_what_is_not_a_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"--cluster-key-file .*missing: No such file"):
        read_key_file(tmp_path / "missing")
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(tmp_path / "dir")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(KeyFileError, match="not a regular file"):  # never waits for a writer
        read_key_file(fifo)


def test_a_sealed_value_opens_only_under_its_key_for_its_identity() -> None:
    key = ClusterKey(random.Random(3).randbytes(KEY_BYTES))
    sealer = Sealer(key)
    data = os.urandom(1000)
    value = sealer.seal(b"liquidfs2s-x:abc:1000", data)
    assert len(value) == len(data) + OVERHEAD and data not in value
    assert sealer.seal(b"liquidfs2s-x:abc:1000", data) != value  # a nonce of its own each time
    assert sealer.open(b"liquidfs2s-x:abc:1000", value) == data
    assert sealer.open(b"liquidfs2s-x:abd:1000", value) is None  # another object's identity
    assert Sealer(ClusterKey(random.Random(4).randbytes(KEY_BYTES))).open(b"liquidfs2s-x:abc:1000", value) is None
    for at in (0, 11, 12, 500, len(value) - 1):  # nonce, ciphertext, tag
        changed = bytearray(value)
        changed[at] ^= 1
        assert sealer.open(b"liquidfs2s-x:abc:1000", changed) is None
    assert sealer.open(b"liquidfs2s-x:abc:1000", value[:OVERHEAD - 1]) is None
    assert key.id == ClusterKey(key.secret).id != ClusterKey(random.Random(4).randbytes(KEY_BYTES)).id
    assert key.secret.hex()[:8] not in key.id and len(key.id) == 8
