"""Directory listings for the kernel: which entries carry their attributes, and the replies themselves.

An entry listed with its attributes (READDIRPLUS) has the kernel make an inode and a dentry of it and hold a
lookup the daemon counts until a FORGET: ~12 us per entry of the daemon's Python alone, where a ``find`` over the
source takes 0.6 us (BENCHMARKS "Ten million files"). It pays only where something looks at the entries
afterwards (``ls -l``, ``du``, ``tar``); a reader that opens a file later asks for its LOOKUP anyway. So
``Listings`` lists a directory's regular files bare (name, inode number and type, what ``getdents`` returns: a
``find``, a loader's ``scandir``): in a READDIRPLUS reply as an entry of node id 0, of which the kernel makes no
inode. Once lookups of its files follow a listing, the directory's next READDIRPLUS replies carry every entry's
attributes. Directories and links carry theirs in every READDIRPLUS reply: few, and a walk looks each up to
descend.

The kernel asks for plain READDIR pages too: with ``READDIRPLUS_AUTO`` (``Operations.readdirplus_auto``) every
page after a listing's first one unless lookups came in between. Those carry no attributes at all, whatever the
directory wants. A kernel whose reply follows the reader's buffer (6.16 on: a 3,000-entry directory in one reply
here) seldom asks; one of 4 KiB replies asks for most pages of a large directory.

Both need our pyfuse3 patch (scripts/passthrough/pyfuse3-readdir.patch: ``readdir_reply(..., lookup=False)``,
``ReaddirToken.plus``); a stock pyfuse3 lists every entry with its attributes, as before (``SUPPORTED``).

The offset handed to the kernel is the entry's id: stable across calls, so a listing interrupted by a full reply
buffer resumes exactly after the last entry the kernel accepted.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import pyfuse3

from ..catalog.catalog import Catalog
from ..catalog.nodes import Node

#: Rows of the catalog read by the first query of a reply: about what a one-page (4 KiB) reply holds, ~22
#: READDIRPLUS entries (a bare one takes as much room as one with attributes) or ~100 plain READDIR ones. Each
#: further query of the same reply reads twice as many, up to ``MAX_ROWS``: a large reply takes a few queries,
#: and a small one reads few rows it cannot send (256 rows a query made 10 ``Node``s for each entry a page of
#: READDIRPLUS took).
FIRST_ROWS_PLUS = 32
FIRST_ROWS_PLAIN = 128
MAX_ROWS = 1024

#: Lookups of a directory's files after a bare listing that make its next listings carry attributes (fewer for a
#: directory of fewer files listed bare: half of them).
LOOKUPS_TO_WANT = 32
#: Directories remembered either way; past it the memory starts afresh (a directory then lists without
#: attributes again until lookups follow).
REMEMBERED = 65_536

SUPPORTED = bool(getattr(pyfuse3, "plain_readdir", False))

Row = TypeVar("Row")


class Listings:
    """Which directories' listings carry every entry's attributes: those whose files were looked up after a bare
    listing. Plain Python: ``Operations`` tells it of listings and lookups."""

    def __init__(self, lookups_to_want: int = LOOKUPS_TO_WANT, remembered: int = REMEMBERED) -> None:
        self.lookups_to_want = lookups_to_want
        self.remembered = remembered
        # directory listed bare -> (lookups of its files since, entries listed bare so far): the replies of one
        # listing add up, so a short first or last page does not decide for the whole directory
        self._after: dict[int, tuple[int, int]] = {}
        self._wanting: set[int] = set()

    def with_attributes(self, directory: int) -> bool:
        return not SUPPORTED or directory in self._wanting

    def listed_bare(self, directory: int, entries: int) -> None:
        """``entries`` of ``directory`` went without attributes in one reply."""
        if not entries or directory in self._wanting:
            return
        lookups, bare = self._after.get(directory, (0, 0))
        if not bare and len(self._after) >= self.remembered:
            self._after.clear()
        self._after[directory] = (lookups, bare + entries)

    def looked_up(self, directory: int) -> None:
        """A LOOKUP of a regular file in ``directory`` (the kernel had no dentry of it)."""
        seen = self._after.get(directory)
        if seen is None:
            return
        lookups, bare = seen[0] + 1, seen[1]
        if lookups < min(self.lookups_to_want, max(1, bare // 2)):
            self._after[directory] = (lookups, bare)
            return
        del self._after[directory]
        if len(self._wanting) >= self.remembered:
            self._wanting.clear()
        self._wanting.add(directory)


def list_plus(catalog: Catalog, parent: int, after: int, token: pyfuse3.ReaddirToken,
              attrs: Callable[[Node], pyfuse3.EntryAttributes], looked_up: Callable[[Node], None]) -> int:
    """Entries of ``parent`` after the id ``after`` with their attributes, as many as the reply holds; each
    accepted one counts as a lookup the kernel will forget. For READDIRPLUS replies only (a plain one would take
    the entries without the lookups). How many were listed."""
    listed = 0
    for node in child_rows(catalog.children, parent, after, FIRST_ROWS_PLUS, lambda node: node.id):
        if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(node.name), attrs(node), node.id):
            break
        looked_up(node)
        listed += 1
    return listed


def list_bare(catalog: Catalog, parent: int, after: int, token: pyfuse3.ReaddirToken,
              attrs: Callable[[Node], pyfuse3.EntryAttributes], looked_up: Callable[[Node], None]
              ) -> tuple[int, int]:
    """Entries of ``parent`` after the id ``after``, as many as the reply holds: regular files as name, inode
    number and type only (no lookup taken), the others with their attributes where the reply can carry them
    (READDIRPLUS). How many were listed with attributes, and how many without."""
    plus = token.plus  # type: ignore[attr-defined]  # our patch's (SUPPORTED)
    entry = pyfuse3.EntryAttributes()  # one for every bare entry: the reply copies what it needs at once
    reply = pyfuse3.readdir_reply
    with_attrs = bare = 0
    first = FIRST_ROWS_PLUS if plus else FIRST_ROWS_PLAIN
    for ident, name, mode in child_rows(catalog.child_entries, parent, after, first, lambda row: row[0]):
        node = None if not plus or stat.S_ISREG(mode) else catalog.get(ident)
        if node is None:
            entry.st_ino = ident
            entry.st_mode = mode
            if not reply(token, pyfuse3.FileNameT(name), entry, ident, lookup=False):  # type: ignore[call-arg]
                break
            bare += 1
        else:
            if not reply(token, pyfuse3.FileNameT(name), attrs(node), ident):
                break
            looked_up(node)
            with_attrs += 1
    return with_attrs, bare


def child_rows(fetch: Callable[[int, int, int], Sequence[Row]], parent: int, after: int, first: int,
               ident: Callable[[Row], int]) -> Iterator[Row]:
    """The rows of ``parent`` after the id ``after``, read as a reply takes them: ``first`` rows, then pages twice
    as large up to ``MAX_ROWS``; a short page is the directory's end (no query to find nothing). A reply that is
    full stops taking them, and no further page is read."""
    rows = first
    while True:
        page = fetch(parent, after, rows)
        yield from page
        if len(page) < rows:
            return
        after = ident(page[-1])
        rows = min(2 * rows, MAX_ROWS)
