"""A memcached in a dict, for unit tests of the cluster level (``clustertier``); the system tests run real ones."""

from __future__ import annotations

from typing import Any


class FakeMemcached:
    """``get``/``set``/``close`` as pymemcache's ``HashClient`` answers them with ``ignore_exc``: None for a miss
    or a server that does not answer (``down``)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.down = False
        self.gets = 0
        self.sets = 0
        self.closed = False

    def get(self, key: str) -> Any:
        self.gets += 1
        return None if self.down else self.values.get(key)

    def set(self, key: str, value: bytes, expire: int = 0, noreply: bool | None = None) -> Any:
        self.sets += 1
        if self.down:
            return False
        self.values[key] = bytes(value)
        return True

    def close(self) -> None:
        self.closed = True
