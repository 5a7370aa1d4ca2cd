"""Errors that say this process or this node is short of something, not that a file, a disk or a peer is unsound.

A call failing with one of these (out of descriptors, out of memory) says nothing about what it was reaching: the
same call succeeds once some are freed. Whoever meets one passes it on or waits it out; it is never a verdict on
the file (a raw object served as its original, a peer counted as failed).
"""

from __future__ import annotations

import errno

__all__ = ["SHORT_OF_RESOURCES", "short_of_resources"]

#: Descriptors of the process (EMFILE) or the system (ENFILE), memory (ENOMEM), socket buffers (ENOBUFS).
SHORT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def short_of_resources(exc: BaseException) -> bool:
    """Whether ``exc`` is an OSError that says this process or node is short (``SHORT_OF_RESOURCES``)."""
    return isinstance(exc, OSError) and exc.errno in SHORT_OF_RESOURCES
