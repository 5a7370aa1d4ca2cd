"""Files liquidfs writes for itself (the mount's log, ``profile.json``, a report a command is asked for): never
written through a link, created 0600; and log records that stay one line each, whatever names they carry.

liquidfs runs as root in directories other users may write (a store on a shared volume, /tmp). A name there
that is a link to a root-owned file (a shell or Python startup file) would have root append to that file, and a
dataset file named ``x\\nimport os; ...\\n.png`` logged verbatim would put a line of its owner's choosing in it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import sys
import threading
from io import TextIOWrapper
from pathlib import Path
from types import TracebackType

from .locks import unique

#: Characters a log line must never carry as they are: C0 controls (the line breaks among them), DEL, C1 controls
#: (NEL is a line break to some readers), the Unicode line and paragraph separators, and the lone surrogates that
#: undecodable bytes of a file name become (``surrogateescape``): written as they are, they fail the record.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if char in _NAMED:
        return _NAMED[char]
    if 0xDC80 <= code <= 0xDCFF:  # the byte a surrogateescape decode could not map
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character written as a visible escape (``\\n``, ``\\x1b``): one line."""
    return _UNPRINTABLE.sub(_escaped, text)


class EscapingFormatter(logging.Formatter):
    """A formatter whose every record is exactly one line: the whole formatted record (message, arguments,
    traceback) escaped, so no name a user chose can start a line of its own in a log."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(super().format(record))


#: The format of every log liquidfs writes.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def open_append(path: str | os.PathLike[str]) -> int:
    """``path`` opened for appending (and reading back), created 0600 if missing, never through a link.

    Refused with a message that names the path (``OSError``): a symbolic link at its end (ELOOP), anything but
    a regular file (EIO; O_NONBLOCK keeps a FIFO there from blocking the open), a file with other hard links
    (EMLINK: a link to a file of someone else's, where the kernel allows one), or one another user owns (EPERM:
    made there by a writer of the directory, who would read root's log). The directories on the way are the
    caller's choice; the last component is the one a writer of that directory controls.
    """
    name = os.fsdecode(path)
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    made = False
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            made = True  # this call's own, whoever the filesystem says owns it (a CIFS uid=, an NFS squash)
        except FileExistsError:
            fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link: refused (liquidfs never writes through a link; "
                          "remove it, or give another file)", name) from None
        raise OSError(exc.errno, exc.strerror, name) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EIO, "not a regular file: refused", name)
        if st.st_nlink > 1:
            raise OSError(errno.EMLINK, "has other hard links: refused (it may be someone else's file)", name)
        if not made and st.st_uid != os.geteuid():  # its owner reads what is written: root's log, say
            raise OSError(errno.EPERM, f"is uid {st.st_uid}'s file, not this user's: refused (remove it, or give "
                          "another file)", name)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LogFileHandler(logging.FileHandler):
    """A ``logging.FileHandler`` that opens its file with ``open_append`` (never through a link, 0600) and
    escapes every record to one line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, mode="a", encoding="utf-8", errors="backslashreplace")
        self.setFormatter(EscapingFormatter(LOG_FORMAT))

    def _open(self) -> TextIOWrapper:
        return open(open_append(self.baseFilename), "a", encoding=self.encoding, errors=self.errors)


def log_uncaught() -> None:
    """Uncaught exceptions (of the main thread and of others) go through logging too: written by the
    interpreter itself, a traceback would reach the log unescaped."""
    def main_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, value, tb)
            return
        logging.getLogger("liquidfs").critical("uncaught exception", exc_info=(kind, value, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is None:
            return
        logging.getLogger("liquidfs").critical("uncaught exception in thread %s",
                                               args.thread.name if args.thread else "?",
                                               exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    sys.excepthook = main_hook
    threading.excepthook = thread_hook


def replace_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Put ``data`` at ``path`` whole (0600): written to a new name beside it (created exclusively, never through
    a link) and renamed over it, so a link at ``path`` is replaced, never written through, and a reader sees the
    old file or the new one, never half of one."""
    target = Path(path)
    tmp = target.with_name(unique(f".{target.name}.tmp-"))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
