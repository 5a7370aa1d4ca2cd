"""A memcached in a dict, for unit tests of the cluster level (``held.cluster``); the system tests run real ones,
and ``test_memcachedwire`` fake peers on real sockets."""

from __future__ import annotations

from typing import Any

from liquidfs.held.memcached import PeerError


class FakeMemcached:
    """``get``/``set``/``close`` as ``memcachedwire.MemcachedWire`` answers them: None for a miss, ``PeerError``
    for a server that does not answer (``down``). Values are given back as stored, whatever their length: the level
    checks them."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.down = False
        self.largest: int | None = None  # values past it refused as a memcached refuses one past its -I
        self.full = False  # every value refused for now, as a memcached out of memory does
        self.gets = 0
        self.sets = 0
        self.closed = False

    def get(self, key: str, length: int) -> Any:
        self.gets += 1
        if self.down:
            raise PeerError("down")
        return self.values.get(key)

    def set(self, key: str, value: bytes | bytearray | memoryview) -> bool | None:
        self.sets += 1
        if self.down:
            raise PeerError("down")
        if self.largest is not None and len(value) > self.largest:
            return None  # "SERVER_ERROR object too large for cache"
        if self.full:
            return False  # "SERVER_ERROR out of memory storing object": for now
        self.values[key] = bytes(value)
        return True

    def close(self) -> None:
        self.closed = True
