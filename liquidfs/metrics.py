"""A minimal Prometheus text endpoint (``--metrics-port``), served by the mount's own trio loop.

A full HTTP stack would be a dependency for one GET; this answers any request on the port with the current
values and closes the connection, which is all a Prometheus scraper needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from .stats import prometheus_text

log = logging.getLogger(__name__)


async def serve_metrics(port: int, values: Callable[[], dict[str, object]], host: str = "127.0.0.1",
                        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async def answer(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(5):
                request = b""
                while b"\r\n\r\n" not in request and len(request) < 8192:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return
                    request += chunk
                path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/"
                if path.split(b"?")[0] not in (b"/", b"/metrics"):
                    await stream.send_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    return
                body = prometheus_text(values()).encode()
                head = (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
                await stream.send_all(head + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("metrics client: %s", exc)
        finally:
            await stream.aclose()

    listeners = await trio.open_tcp_listeners(port, host=host)
    log.info("metrics on http://%s:%d/metrics", host, port)
    task_status.started()
    await trio.serve_listeners(answer, listeners)
