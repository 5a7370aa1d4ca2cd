"""Where the rows of a catalog being built go: SQLite in the builder's process, or, for a large build where a
second core is free, SQLite in a helper process fed batches of rows through a pipe, so that the walk's lstats and
the inserts run side by side (a million files: ~4 s of ``executemany`` beside ~6 s of walk, one after the other
on one core before).

The helper is a script of the standard library alone (never an import of liquidfs, whatever the interpreter's
path), run as ``scan``'s: it opens the file it is told, runs the statements it is sent in order and commits only
when told to. A helper that dies, or a builder that does, leaves a catalog in the making that is never renamed
into place (the next writer of the store removes it: ``build._abandoned``); the builder says why the helper failed.
"""

from __future__ import annotations

import fcntl
import marshal
import os
import sqlite3
import struct
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO, Protocol

#: Each message's length, before its ``marshal`` bytes: both ends are the same interpreter (``sys.executable``),
#: so its format is theirs; it only ever carries tuples of ``str``, ``bytes``, ``int`` and ``None``.
_LENGTH = struct.Struct("<Q")
#: The pipe's size asked for: the default most (``/proc/sys/fs/pipe-max-size``) an unprivileged process may set.
_PIPE_BYTES = 1 << 20
#: What the helper says once it has the catalog open.
_READY = b"."
#: Bytes of a helper's complaint read for the builder's error (its last line is the error).
_ERROR_BYTES = 4096


class HelperFailed(OSError):
    """The helper writing a catalog stopped before its commit."""


class Sink(Protocol):
    def execute(self, sql: str) -> None: ...
    def script(self, sql: str) -> None: ...
    def many(self, sql: str, rows: Sequence[tuple[object, ...]]) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class LocalSink:
    """SQLite in this process (``isolation_level=None``: the build says when its transaction begins)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)

    def execute(self, sql: str) -> None:
        self.db.execute(sql)

    def script(self, sql: str) -> None:
        self.db.executescript(sql)

    def many(self, sql: str, rows: Sequence[tuple[object, ...]]) -> None:
        self.db.executemany(sql, rows)

    def commit(self) -> None:
        self.db.execute("COMMIT")
        self.db.close()

    def abort(self) -> None:
        self.db.close()


class ProcessSink:
    """SQLite in a helper process; ``many`` returns once the batch is in the pipe, which holds about one: the
    builder runs at most a batch ahead of the inserts, so memory stays bounded whatever the tree."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from ..sysio.reexec import isolated_env  # here: run as the helper, this file imports nothing of the package

        # -I -S: no site, no environment, no current directory: the script imports only the standard library.
        self._process = subprocess.Popen([sys.executable, "-I", "-S", __file__, os.fsencode(os.path.abspath(path))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         close_fds=True, cwd="/", env=isolated_env())
        assert self._process.stdout is not None
        # Its word that it runs and has the file open: a helper that cannot start is an OSError here, where the
        # build writes in its own process instead, not a failure of the build later.
        ready = self._process.stdout.read(1)
        self._process.stdout.close()
        if ready != _READY:
            raise self._failure()
        assert self._process.stdin is not None
        try:
            # A batch in one write where the system allows it: each wake-up of the other side through a 64 KiB
            # pipe cost the build more than the inserts it moved off its core.
            fcntl.fcntl(self._process.stdin.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass

    def _send(self, message: tuple[Any, ...]) -> None:  # str, bytes, int, None and tuples of them
        data = marshal.dumps(message)
        stdin = self._process.stdin
        assert stdin is not None
        try:
            stdin.write(_LENGTH.pack(len(data)))
            stdin.write(data)
            stdin.flush()
        except BrokenPipeError:
            raise self._failure() from None

    def _failure(self) -> HelperFailed:
        self._close_stdin()
        self._process.wait()
        assert self._process.stderr is not None
        lines = self._process.stderr.read(_ERROR_BYTES).decode("utf-8", "replace").strip().splitlines()
        said = lines[-1].strip() if lines else ""  # one line: a traceback's last (the helper prints no other)
        self._process.stderr.close()
        return HelperFailed(f"the catalog's writer exited with {self._process.returncode}: {said or 'no reason given'}")

    def _close_stdin(self) -> None:
        try:
            if self._process.stdin is not None:
                self._process.stdin.close()
        except BrokenPipeError:
            pass

    def execute(self, sql: str) -> None:
        self._send(("execute", sql))

    def script(self, sql: str) -> None:
        self._send(("script", sql))

    def many(self, sql: str, rows: Sequence[tuple[object, ...]]) -> None:
        self._send(("many", sql, list(rows)))

    def commit(self) -> None:
        self._send(("commit",))
        self._close_stdin()
        if self._process.wait() != 0:
            raise self._failure()
        assert self._process.stderr is not None
        self._process.stderr.close()

    def abort(self) -> None:
        self._process.kill()  # nothing it has not committed is of use
        self._close_stdin()
        self._process.wait()
        if self._process.stderr is not None:
            self._process.stderr.close()


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError("the builder stopped before its commit")
    return data


def _serve(path: bytes, stream: BinaryIO, ready: BinaryIO) -> None:
    """The helper's loop: each statement as it comes, until the commit."""
    db = sqlite3.connect(path, isolation_level=None)
    ready.write(_READY)
    ready.close()
    while True:
        message = marshal.loads(_read(stream, _LENGTH.unpack(_read(stream, _LENGTH.size))[0]))
        kind = message[0]
        if kind == "many":
            db.executemany(message[1], message[2])
        elif kind == "execute":
            db.execute(message[1])
        elif kind == "script":
            db.executescript(message[1])
        elif kind == "commit":
            db.execute("COMMIT")
            db.close()
            return
        else:
            raise ValueError(f"unknown message {kind!r}")


if __name__ == "__main__":
    try:
        _serve(os.fsencode(sys.argv[1]), sys.stdin.buffer, sys.stdout.buffer)
    except Exception as exc:  # noqa: BLE001 -- the builder raises it with this line; a traceback repeats it
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
