"""The cluster key (``mount --cluster-key-file FILE``) and the sealing of what the cluster level stores with it.

memcached answers anyone who reaches it: anyone can read what it holds and store anything under any key. What
the mounts of one job store there is therefore sealed with authenticated encryption (AES-256-GCM, from
``cryptography``) under a key that only they hold: a value that does not open under the key, for the identity it
was fetched for, was not sealed by one of them for that object, and is never served. Being encrypted, it is also
readable only by them, whatever the modes of its source.

The key file holds exactly ``KEY_BYTES`` raw random bytes (``head -c 32 /dev/urandom > FILE``), is a regular file
owned by root (or the daemon's user) and readable by nobody else: a key that others can read or write vouches for
nothing. It is read once, at mount start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

log = logging.getLogger(__name__)

#: Bytes of a cluster key: AES-256.
KEY_BYTES = 32
#: A random nonce per value sealed, stored before it. 96 bits drawn at random stay unique with overwhelming odds
#: for up to 2**32 values sealed under one key (NIST SP 800-38D): far more than a dataset's objects are stored.
NONCE_BYTES = 12
TAG_BYTES = 16
#: What sealing adds to a value: its nonce and its tag.
OVERHEAD = NONCE_BYTES + TAG_BYTES
#: A key file is read no further than this: a key file that is not one says so instead of filling memory.
_READ_AT_MOST = 4096
#: Distinct byte values below which 32 bytes are not random (a file of zeros, a word repeated): 32 random bytes
#: have about 30; fewer than 12 happens with odds far below 1e-9.
_FEWEST_DISTINCT = 12


class KeyFileError(ValueError):
    """A --cluster-key-file that must not be used; the message is for the user."""


class ClusterKey:
    """The secret of ``--cluster-key-file``; never printed (a config's repr, a log line)."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) != KEY_BYTES:
            raise KeyFileError(f"a cluster key is {KEY_BYTES} bytes, not {len(secret)}")
        self._secret = bytes(secret)

    def __repr__(self) -> str:
        return "ClusterKey(<secret>)"

    @property
    def secret(self) -> bytes:
        return self._secret

    @property
    def id(self) -> str:
        """A short public name of the key (a MAC under it of a fixed text): in the memcached keys of what is
        sealed under it, so jobs of different keys on one memcached keep apart. Says nothing of the key."""
        return hashlib.blake2b(b"liquidfs cluster key id", key=self._secret, digest_size=4).hexdigest()


def read_key_file(path: str | os.PathLike[str], *, euid: int | None = None) -> ClusterKey:
    """The key of ``--cluster-key-file path``, checked on the file opened (never on its name, which could be
    swapped between a check and the read): a regular file, owned by root or ``euid`` (the daemon's), with no
    permission for group or others, of exactly ``KEY_BYTES`` bytes that look random."""
    flag = "--cluster-key-file"
    owner_ok = {0, os.geteuid() if euid is None else euid}
    try:
        # Symbolic links are followed: a Kubernetes Secret's file is one (key -> ..data/key); what matters is the
        # file they lead to, checked below. O_NONBLOCK: a FIFO put there does not hang the mount.
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"{flag} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{flag} {path}: not a regular file")
        if st.st_uid not in owner_ok:
            raise KeyFileError(f"{flag} {path}: owned by uid {st.st_uid}; it must be root's (chown root {path})")
        if st.st_mode & 0o077:
            raise KeyFileError(f"{flag} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others read or "
                               f"write the key; it must be 0400 or 0600 (chmod 0400 {path})")
        data = os.read(fd, _READ_AT_MOST)
    except OSError as exc:
        raise KeyFileError(f"{flag} {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise KeyFileError(f"{flag} {path}: holds {len(data)}{'+' if len(data) == _READ_AT_MOST else ''} bytes; "
                           f"a key is exactly {KEY_BYTES} raw random bytes (head -c {KEY_BYTES} /dev/urandom > FILE)")
    if len(set(data)) < _FEWEST_DISTINCT:
        raise KeyFileError(f"{flag} {path}: its {KEY_BYTES} bytes are not random (make one with head -c {KEY_BYTES} "
                           "/dev/urandom > FILE)")
    return ClusterKey(data)


class Sealer:
    """Seals and opens values under a cluster key, each bound to the identity it is stored under (associated
    data: the memcached key, which names the object's digest, its size and the format's version)."""

    def __init__(self, key: ClusterKey) -> None:
        self._aead = AESGCM(key.secret)
        # Names are MACs under a key of their own, derived from the cluster key: one key, one use.
        self._names = hashlib.blake2b(b"liquidfs object names", key=key.secret).digest()

    def name(self, identity: bytes) -> str:
        """A short name of ``identity`` that only holders of the key can make or recognise: what binds a value to
        the file it was stored for without putting anything of that file's path in a memcached key."""
        return hashlib.blake2b(identity, key=self._names, digest_size=12).hexdigest()

    def seal(self, identity: bytes, data: bytes | memoryview) -> bytearray:
        """``data`` sealed: a fresh random nonce, then the ciphertext and its tag."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = bytearray(NONCE_BYTES + len(data) + TAG_BYTES)  # sealed in place: no copy of a large value
        sealed[:NONCE_BYTES] = nonce
        self._aead.encrypt_into(nonce, data, identity, memoryview(sealed)[NONCE_BYTES:])
        return sealed

    def open(self, identity: bytes, value: bytes | bytearray | memoryview) -> bytearray | None:
        """The bytes sealed in ``value`` for ``identity``, or None where it was not sealed under this key for
        that identity (or was changed since): one allocation, the plaintext's size."""
        view = memoryview(value)
        if len(view) < OVERHEAD:
            return None
        out = bytearray(len(view) - OVERHEAD)
        try:
            self._aead.decrypt_into(view[:NONCE_BYTES], view[NONCE_BYTES:], identity, out)
        except InvalidTag:
            return None
        return out
