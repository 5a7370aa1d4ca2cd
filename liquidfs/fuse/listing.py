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

A bare entry is read from the catalog's packed listing of the directory where it has one (every build writes
them, ``catalog.listings``): a chunk of 1,024 entries is one SQLite row, whose regular files
``pyfuse3.readdir_reply_packed`` adds to the reply in C (~1.2 us an entry from rows, in Python).

All this needs our pyfuse3 patch (scripts/passthrough/pyfuse3-readdir.patch: ``readdir_reply(...,
lookup=False)``, ``readdir_reply_packed``, ``ReaddirToken.plus``); a stock pyfuse3 lists every entry with its
attributes, as before (``SUPPORTED``).

The offset handed to the kernel is the entry's id: stable across calls, so a listing interrupted by a full reply
buffer resumes exactly after the last entry the kernel accepted.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import pyfuse3

from ..catalog import listings
from ..catalog.catalog import Catalog
from ..catalog.nodes import CONTROL_NAME, ROOT_ID, Node

log = logging.getLogger(__name__)

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
#: Bare entries straight from a catalog's packed listings (``catalog.listings``), added to the reply in C.
PACKED = SUPPORTED and hasattr(pyfuse3, "readdir_reply_packed")
#: Why ``pyfuse3.readdir_reply_packed`` stopped.
_END_OF_CHUNK, _REPLY_FULL, _WANTS_ATTRIBUTES = 0, 1, 2
#: What was logged of which directory (its malformed packed listing, a row of an unfit name, a row that cannot be
#: answered): once each, for so many.
_WARNED: set[tuple[str, int]] = set()
_WARNED_AT_MOST = 100

Row = TypeVar("Row")
#: The types a row's entry may be listed as (a mode naming a device would show one in a plain listing), and the
#: modes a ``mode_t`` holds.
_LISTED_TYPES = frozenset({stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK})
_MODE_LIMIT = 1 << 32


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
        if not _listable(catalog, parent, node.name) or (entry := _attributes(catalog, parent, node, attrs)) is None:
            continue
        if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(node.name), entry, node.id):
            break
        looked_up(node)
        listed += 1
    return listed


def list_bare(catalog: Catalog, parent: int, after: int, token: pyfuse3.ReaddirToken,
              attrs: Callable[[Node], pyfuse3.EntryAttributes], looked_up: Callable[[Node], None]
              ) -> tuple[int, int, int]:
    """Entries of ``parent`` after the id ``after``, as many as the reply holds: regular files as name, inode
    number and type only (no lookup taken), the others with their attributes where the reply can carry them
    (READDIRPLUS). From the catalog's packed listing where it has one, else (or from a malformed record on)
    from its rows. How many were listed with attributes, how many without, and how many of those from the
    packed listing."""
    if not (PACKED and catalog.has_listings) or (parent == ROOT_ID and catalog.lookup(ROOT_ID, CONTROL_NAME)):
        # (the root of a catalog from before scans left out an entry named as the control file: its rows, which
        # leave it out here)
        return (*_bare_from_rows(catalog, parent, after, token, attrs, looked_up), 0)
    with_attrs, packed, rest_after = _bare_from_packed(catalog, parent, after, token, attrs, looked_up)
    if rest_after is None:
        return with_attrs, packed, packed
    more = _bare_from_rows(catalog, parent, rest_after, token, attrs, looked_up)
    return with_attrs + more[0], packed + more[1], packed


def _bare_from_packed(catalog: Catalog, parent: int, after: int, token: pyfuse3.ReaddirToken,
                      attrs: Callable[[Node], pyfuse3.EntryAttributes], looked_up: Callable[[Node], None]
                      ) -> tuple[int, int, int | None]:
    """``list_bare`` from the packed chunks: the records of regular files (of every entry in a plain READDIR)
    added by ``pyfuse3.readdir_reply_packed`` in C, a directory's or link's with its attributes here. The
    third item is None once done (the directory's end, or a full reply), else the id after which the rows must
    go on: the record there is malformed, or names a node that is not this directory's entry of that name."""
    plus = token.plus  # type: ignore[attr-defined]  # our patch's (PACKED)
    reply = pyfuse3.readdir_reply_packed  # type: ignore[attr-defined]
    with_attrs = bare = 0
    for last, chunk in catalog.listing_chunks(parent, after):
        if chunk is None:
            _malformed(catalog, parent, 0)
            return with_attrs, bare, after
        pos = 0
        while True:
            listed, pos, after, why = reply(token, chunk, pos, after, plus)
            bare += listed
            if why == _END_OF_CHUNK:
                if after != last:
                    # A chunk that ends before the id it is keyed by: the entries up to it would be in no
                    # listing (the next chunk holds those after it). The rows have them.
                    _malformed(catalog, parent, pos)
                    return with_attrs, bare, after
                break
            if why == _REPLY_FULL:
                return with_attrs, bare, None
            node = None
            if why == _WANTS_ATTRIBUTES:
                ident, _, name, _, end = next(listings.read(chunk, pos))
                node = catalog.get(ident)
                if node is not None and (node.parent, node.name) != (parent, name):
                    node = None  # never an alias of another node under this name: the kernel would keep it
            if node is None:
                _malformed(catalog, parent, pos)
                return with_attrs, bare, after
            entry = _attributes(catalog, parent, node, attrs)
            if entry is not None:
                if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(node.name), entry, node.id):
                    return with_attrs, bare, None
                looked_up(node)
                with_attrs += 1
            after, pos = node.id, end
    return with_attrs, bare, None


def _malformed(catalog: Catalog, parent: int, pos: int) -> None:
    if _first_time("malformed", parent):
        log.warning("the packed listing of directory %d in %s is malformed at byte %d of a chunk; listing it "
                    "from its rows", parent, catalog.path, pos)


def _listable(catalog: Catalog, parent: int, name: bytes) -> bool:
    """Whether a row of ``parent`` named ``name`` is listed: never one whose name no directory entry can have
    (``listings.fit_name``), nor an entry of the root named as the mount's control file, which a lookup never
    reaches (a READDIRPLUS that carried its attributes would have the kernel take it for the control file)."""
    if not isinstance(name, bytes) or not listings.fit_name(name):  # (a TEXT name: the column takes any type)
        _unfit(catalog, parent, name)
        return False
    return not (parent == ROOT_ID and name == CONTROL_NAME)


def _first_time(what: str, parent: int) -> bool:
    """Whether ``what`` of directory ``parent`` is logged now: the first time, for so many directories."""
    if len(_WARNED) >= _WARNED_AT_MOST or (what, parent) in _WARNED:
        return False
    _WARNED.add((what, parent))
    return True


def _attributes(catalog: Catalog, parent: int, node: Node, attrs: Callable[[Node], pyfuse3.EntryAttributes]
                ) -> pyfuse3.EntryAttributes | None:
    """``attrs(node)``; None where its row cannot be answered (a kind or mode no row of a build has: whoever
    writes the store wrote it), left out of the listing and said once a directory. Raised, it failed the whole
    reply after the entries before it were counted as lookups the kernel never got (forgotten never), and every
    later listing of the directory at that row."""
    try:
        return attrs(node)
    except Exception as exc:
        _unanswerable(catalog, parent, node.name, repr(exc))
        return None


def _unanswerable(catalog: Catalog, parent: int, name: bytes, why: str) -> None:
    if _first_time("unanswerable", parent):
        log.warning("directory %d in %s has an entry (%r) whose row cannot be answered (%s); it is left out of "
                    "the listing", parent, catalog.path, name[:300], why)


def _unfit(catalog: Catalog, parent: int, name: object) -> None:
    """A row whose name no directory entry can have (``listings.fit_name``): left out of the listing, said once a
    directory (for so many)."""
    if _first_time("unfit", parent):
        log.warning("directory %d in %s has an entry named %r, which no file can be named; it is left out of the "
                    "listing", parent, catalog.path, name[:300] if isinstance(name, (bytes, str)) else name)


def _bare_from_rows(catalog: Catalog, parent: int, after: int, token: pyfuse3.ReaddirToken,
                    attrs: Callable[[Node], pyfuse3.EntryAttributes], looked_up: Callable[[Node], None]
                    ) -> tuple[int, int]:
    plus = token.plus  # type: ignore[attr-defined]  # our patch's (SUPPORTED)
    entry = pyfuse3.EntryAttributes()  # one for every bare entry: the reply copies what it needs at once
    reply = pyfuse3.readdir_reply
    with_attrs = bare = 0
    first = FIRST_ROWS_PLUS if plus else FIRST_ROWS_PLAIN
    for ident, name, mode in child_rows(catalog.child_entries, parent, after, first, lambda row: row[0]):
        if not _listable(catalog, parent, name):
            continue
        if not isinstance(mode, int) or not 0 <= mode < _MODE_LIMIT or stat.S_IFMT(mode) not in _LISTED_TYPES:
            # (whoever writes the store wrote it: -1 or 2**32 raised OverflowError at this row of every listing)
            _unanswerable(catalog, parent, name, f"mode {mode!r}")
            continue
        node = None if not plus or stat.S_ISREG(mode) else catalog.get(ident)
        if node is None:
            entry.st_ino = ident
            entry.st_mode = mode
            if not reply(token, pyfuse3.FileNameT(name), entry, ident, lookup=False):  # type: ignore[call-arg]
                break
            bare += 1
        elif (attributes := _attributes(catalog, parent, node, attrs)) is not None:
            if not reply(token, pyfuse3.FileNameT(name), attributes, ident):
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
