"""A free TCP port on loopback for a server a test starts (memcached, Prometheus, the S3 server)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (bound once and let go: the server the test starts takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
