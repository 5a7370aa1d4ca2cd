"""A test-only HTTP proxy in front of the S3 server that injects faults: error answers, hangs and wrong answers,
per key.

The mount under test talks to the proxy (``AWS_ENDPOINT_URL`` pointed at it); the proxy forwards every request
unchanged (the Host header too, so SigV4 signatures still verify) and, for requests whose path contains a
rule's text, answers with an error status, stalls first, or rewrites the server's answer to a GET (a proxy or
cache that ignores ``If-Match`` or ``Range``, or cuts a body short). Only what a mount sends is supported (GET,
HEAD).
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

#: (status, headers, body) of the server's answer -> the answer the client gets instead.
Rewrite = Callable[[int, list[tuple[str, str]], bytes], tuple[int, list[tuple[str, str]], bytes]]

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


@dataclass
class Rule:
    match: str           # a substring of the request path (the URL-encoded key)
    status: int = 503    # the answer while ``times`` lasts (0: forward normally after ``delay``)
    times: int = 1 << 30
    delay: float = 0.0   # seconds to stall before answering
    hits: int = 0
    rewrite: Rewrite | None = None  # with status 0: what a GET's answer becomes (Content-Length follows the body)


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _serve(self) -> None:
                with proxy._lock:
                    proxy.requests.append((self.command, self.path))
                    rule = next((r for r in proxy.rules if r.match in self.path and r.hits < r.times), None)
                    if rule is not None:
                        rule.hits += 1
                if rule is not None and rule.delay:
                    time.sleep(rule.delay)
                if rule is not None and rule.status:
                    body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
                            b"<Message>injected</Message></Error>")
                    self.send_response(rule.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(body)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body_in = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in _HOP:
                            conn.putheader(name, value)
                    conn.endheaders(body_in)
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                status, reason, headers = answer.status, answer.reason, answer.getheaders()
                if rule is not None and rule.rewrite is not None and self.command == "GET":
                    status, headers, data = rule.rewrite(status, headers, data)
                    reason = None
                self.send_response(status, reason)
                for name, value in headers:
                    if name.lower() not in _HOP and name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data) if self.command != "HEAD"
                                                      else int(answer.getheader("Content-Length") or 0)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = _serve

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up on a stalled answer (a timeout under test) is expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
