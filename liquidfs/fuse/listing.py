"""Directory listings for the kernel: which entries carry their attributes, and the replies themselves.

An entry listed with its attributes (READDIRPLUS) has the kernel make an inode and a dentry of it and hold a
lookup the daemon counts until a FORGET: ~12 us per entry of the daemon's Python alone, where a ``find`` over the
source takes 0.6 us (BENCHMARKS "Ten million files"). It pays only where something looks at the entries
afterwards (``ls -l``, ``du``, ``tar``): otherwise a reader that opens a file later asks for its LOOKUP anyway.
So ``Listings`` lists a directory's regular files without attributes (name, inode number and type, what
``getdents`` returns: a ``find``, a loader's ``scandir``) until lookups of its names follow a listing; from then
on its listings carry every entry's attributes, as the kernel's own READDIRPLUS_AUTO does for NFS-like use.
Directories and links always carry theirs: few, and a walk looks each up to descend.

The kernel's own READDIRPLUS_AUTO (``Operations.readdirplus_auto``) asks for plain pages (``list_plain``) after
the first one of a listing; a kernel with a large readdir buffer (this one's takes a 3,000-entry directory in one
reply) seldom does, hence the choice per entry. Both need our pyfuse3 patch (scripts/passthrough/pyfuse3-readdir
.patch: ``readdir_reply(..., lookup=False)``, ``ReaddirToken.plus``); a stock pyfuse3 lists every entry with its
attributes, as before.

The offset handed to the kernel is the entry's id: stable across calls, so a listing interrupted by a full reply
buffer resumes exactly after the last entry the kernel accepted.
"""

from __future__ import annotations

import stat
from collections.abc import Callable

import pyfuse3

from ..catalog.catalog import Catalog
from ..catalog.nodes import Node

#: Rows of the catalog read by the first query of a reply: about what a one-page (4 KiB) reply holds, ~25
#: entries with attributes or ~100 without. Each further query of the same reply reads twice as many, up to
#: ``MAX_ROWS``: a large reply takes a few queries, and a small one reads few rows it cannot send (256 rows a
#: query made 10 ``Node``s for each entry a page of READDIRPLUS took).
FIRST_ROWS_PLUS = 32
FIRST_ROWS_PLAIN = 128
MAX_ROWS = 1024

#: Lookups of a directory's names after a listing without their attributes that make its next listings carry
#: them (fewer for a directory of fewer files: half of them).
LOOKUPS_TO_WANT = 32
#: Directories remembered either way; past it the memory starts afresh (a directory then lists without
#: attributes again until lookups follow).
REMEMBERED = 65_536

SUPPORTED = bool(getattr(pyfuse3, "plain_readdir", False))


class Listings:
    """Which directories' listings carry every entry's attributes: those whose names were looked up after a
    listing without them. Plain Python: ``Operations`` tells it of listings and lookups."""

    def __init__(self, lookups_to_want: int = LOOKUPS_TO_WANT, remembered: int = REMEMBERED) -> None:
        self.lookups_to_want = lookups_to_want
        self.remembered = remembered
        self._after: dict[int, tuple[int, int]] = {}  # directory listed bare -> (lookups since, lookups to want)
        self._wanting: set[int] = set()

    def with_attributes(self, directory: int) -> bool:
        return not SUPPORTED or directory in self._wanting

    def listed_bare(self, directory: int, files: int) -> None:
        """``files`` regular files of ``directory`` went without attributes."""
        if files and directory not in self._after:
            if len(self._after) >= self.remembered:
                self._after.clear()
            self._after[directory] = (0, max(1, min(self.lookups_to_want, files // 2)))

    def looked_up(self, directory: int) -> None:
        """A LOOKUP of a name in ``directory`` (the kernel had no dentry of it)."""
        seen = self._after.get(directory)
        if seen is None:
            return
        count, wanted = seen
        if count + 1 < wanted:
            self._after[directory] = (count + 1, wanted)
            return
        del self._after[directory]
        if len(self._wanting) >= self.remembered:
            self._wanting.clear()
        self._wanting.add(directory)


def list_plus(catalog: Catalog, parent: int, after: int, token: pyfuse3.ReaddirToken,
              attrs: Callable[[Node], pyfuse3.EntryAttributes], looked_up: Callable[[Node], None]) -> int:
    """Entries of ``parent`` after the id ``after`` with their attributes, as many as the reply holds; each
    accepted one counts as a lookup the kernel will forget. How many were listed."""
    listed, rows = 0, FIRST_ROWS_PLUS
    while True:
        page = catalog.children(parent, after_id=after, limit=rows)
        for node in page:
            if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(node.name), attrs(node), node.id):
                return listed
            looked_up(node)
            listed += 1
            after = node.id
        if len(page) < rows:
            return listed  # the directory's end: no query to find nothing
        rows = min(2 * rows, MAX_ROWS)


def list_bare(catalog: Catalog, parent: int, after: int, token: pyfuse3.ReaddirToken,
              attrs: Callable[[Node], pyfuse3.EntryAttributes], looked_up: Callable[[Node], None]
              ) -> tuple[int, int]:
    """Entries of ``parent`` after the id ``after``, as many as the reply holds: regular files as name, inode
    number and type only (no lookup taken), the others with their attributes where the reply can carry them
    (READDIRPLUS). How many were listed with attributes, and how many without."""
    plus = token.plus
    entry = pyfuse3.EntryAttributes()  # one for every bare entry: the reply copies what it needs at once
    reply = pyfuse3.readdir_reply
    with_attrs = bare = 0
    rows = FIRST_ROWS_PLAIN
    while True:
        page = catalog.child_entries(parent, after_id=after, limit=rows)
        for ident, name, mode in page:
            node = None if not plus or stat.S_ISREG(mode) else catalog.get(ident)
            if node is None:
                entry.st_ino = ident
                entry.st_mode = mode
                if not reply(token, pyfuse3.FileNameT(name), entry, ident, lookup=False):
                    return with_attrs, bare
                bare += 1
            else:
                if not reply(token, pyfuse3.FileNameT(name), attrs(node), ident):
                    return with_attrs, bare
                looked_up(node)
                with_attrs += 1
            after = ident
        if len(page) < rows:
            return with_attrs, bare
        rows = min(2 * rows, MAX_ROWS)
