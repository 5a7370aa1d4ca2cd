"""Directory listings (``fuse.listing``) driven through ``Operations.readdir`` and ``lookup`` in-process, over a
real catalog: regular files listed bare (name, inode, type: no lookup) until lookups of a directory's names follow
a listing, then with their attributes (each a lookup the kernel will forget); directories always with theirs;
plain READDIR pages all bare; every reply resumed from the offset of the last entry it took. The kernel's reply
buffer is a fake that takes a set number of entries; the real one is driven by ``tests/mount/test_listing.py``."""

from __future__ import annotations

import sqlite3
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyfuse3
import pytest
import trio
from operations import daemon_operations

from liquidfs.catalog import listings
from liquidfs.catalog.build import build
from liquidfs.catalog.catalog import Catalog
from liquidfs.catalog.nodes import CONTROL_ID, CONTROL_NAME, ROOT_ID
from liquidfs.fuse import listing
from liquidfs.fuse.operations import Operations
from liquidfs.stores.local.reader import StoreReader

CTX = pyfuse3.RequestContext()
FILES = 300  # entries at the root: 299 files and a directory


@dataclass
class Reply:
    """A reply buffer that takes ``room`` entries, then refuses (as pyfuse3.readdir_reply does when full)."""

    plus: bool
    room: int
    entries: list[tuple[bytes, int, int, int, bool]] = field(default_factory=list)  # name, ino, mode, offset, lookup

    def add(self, name: bytes, attr: pyfuse3.EntryAttributes, offset: int, lookup: bool) -> bool:
        if len(self.entries) == self.room:
            return False
        self.entries.append((bytes(name), attr.st_ino, attr.st_mode, offset, lookup))
        return True


def packed_reply(token: Reply, chunk: bytes, pos: int, after: int, stop: bool) -> tuple[int, int, int, int]:
    """``pyfuse3.readdir_reply_packed`` (our patch's C) over the fake reply, from its reference reader."""
    listed, last = 0, after
    try:
        for ident, mode, name, start, _ in listings.read(chunk, pos, after):
            if stop and not stat.S_ISREG(mode):
                return listed, start, last, 2
            entry = pyfuse3.EntryAttributes()
            entry.st_ino, entry.st_mode = ident, mode
            if not token.add(name, entry, ident, False):
                return listed, start, last, 1
            listed, last = listed + 1, ident
    except listings.MalformedRecord as exc:
        return listed, exc.pos, last, -1
    return listed, len(chunk), last, 0


@pytest.fixture(params=["packed", "rows"])
def ops(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Operations:
    """Every test twice: bare entries from the catalog's packed listings, and from its rows."""
    # As our patched pyfuse3 (whichever this test runs with): bare entries, and a token that says its kind.
    monkeypatch.setattr(listing, "SUPPORTED", True)
    monkeypatch.setattr(listing, "PACKED", request.param == "packed")
    monkeypatch.setattr(pyfuse3, "readdir_reply",
                        lambda token, name, attr, offset, lookup=True: token.add(name, attr, offset, lookup))
    monkeypatch.setattr(pyfuse3, "readdir_reply_packed", packed_reply, raising=False)
    monkeypatch.setattr(listing, "_WARNED", set())
    monkeypatch.setattr(listings, "CHUNK", 7)  # replies that end amid a chunk, at its end, across several
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)  # a directory among the files: listed with its attributes
    (src / "sub" / "inner.bin").write_bytes(b"y")  # the first id after the root's entries
    for i in range(FILES - 1):
        (src / f"f{i:04d}.bin").write_bytes(b"x" * (1 + i % 7))
    build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    return daemon_operations(catalog, StoreReader(catalog.source, tmp_path / "store"))


def listed(ops: Operations, plus: bool, room: int) -> list[tuple[bytes, int, int, int, bool]]:
    """Every entry of the root, in replies of ``room`` entries each resumed at the last offset."""
    entries, offset = [], 0
    while True:
        reply = Reply(plus, room)
        trio.run(ops.readdir, ROOT_ID, offset, reply)
        if not reply.entries:
            return entries
        assert len(reply.entries) == min(room, FILES - len(entries))
        entries += reply.entries
        offset = reply.entries[-1][3]


def same_as_lookups(ops: Operations, entries: list[tuple[bytes, int, int, int, bool]]) -> None:
    names = [e[0] for e in entries]
    assert len(names) == FILES and len(set(names)) == FILES
    assert [e[3] for e in entries] == sorted(e[3] for e in entries)
    for name, ino, mode, offset, _ in entries:
        attr = trio.run(ops.lookup, ROOT_ID, name, CTX)  # the inode and type a lookup gives
        assert (ino, stat.S_IFMT(mode)) == (attr.st_ino, stat.S_IFMT(attr.st_mode)) and offset == ino
    assert {stat.S_IFMT(e[2]) for e in entries} == {stat.S_IFREG, stat.S_IFDIR}


@pytest.mark.parametrize("room", [1, 25, 100, 5000])
def test_files_listed_bare_until_lookups_follow_then_with_attributes(ops: Operations, room: int) -> None:
    known = ops.inodes.known
    entries = listed(ops, plus=True, room=room)
    with_lookup = [e for e in entries if e[4]]
    assert [stat.S_IFMT(e[2]) for e in with_lookup] == [stat.S_IFDIR]  # the directory alone
    assert ops.inodes.known == known + 1
    assert (ops.stats.listed_bare, ops.stats.listed_with_attributes) == (FILES - 1, 1)
    assert ops.stats.listed_packed == (FILES - 1 if listing.PACKED else 0)
    same_as_lookups(ops, entries)  # lookups of every name: the directory wants attributes now
    again = listed(ops, plus=True, room=room)
    assert all(e[4] for e in again)
    assert [(n, i, stat.S_IFMT(m), o) for n, i, m, o, _ in again] == [(n, i, stat.S_IFMT(m), o)
                                                                      for n, i, m, o, _ in entries]
    assert ops.stats.listed_with_attributes == 1 + FILES
    for name, ino, mode, _, _ in again:
        # the test's lookup and the listing's (and the first listing's, for the directory)
        assert ops.inodes.lookups(ino) == (3 if stat.S_ISDIR(mode) else 2), name


def test_a_plain_readdir_is_bare_whatever_the_directory_wants(ops: Operations) -> None:
    ops.listings._wanting.add(ROOT_ID)
    known = ops.inodes.known
    entries = listed(ops, plus=False, room=100)
    assert not any(e[4] for e in entries) and ops.inodes.known == known
    assert ops.stats.listed_bare == FILES and ops.stats.listed_with_attributes == 0
    same_as_lookups(ops, entries)


@pytest.mark.parametrize("room", [1, 25, 5000])
def test_a_few_lookups_do_not_make_a_large_directory_want_attributes(ops: Operations, room: int) -> None:
    """However many replies the listing took (one entry each: the bare entries of a listing add up), and the
    lookup of a directory does not count."""
    listed(ops, plus=True, room=room)
    trio.run(ops.lookup, ROOT_ID, b"sub", CTX)
    for i in range(listing.LOOKUPS_TO_WANT - 1):
        trio.run(ops.lookup, ROOT_ID, f"f{i:04d}.bin".encode(), CTX)
    assert not ops.listings.with_attributes(ROOT_ID)
    trio.run(ops.lookup, ROOT_ID, b"f0100.bin", CTX)
    assert ops.listings.with_attributes(ROOT_ID)


def test_listings_remember_a_bounded_number_of_directories(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listing, "SUPPORTED", True)
    listings = listing.Listings(lookups_to_want=2, remembered=3)
    for directory in range(10):  # listed, never looked up in
        listings.listed_bare(directory, entries=100)
        assert 1 <= len(listings._after) <= 3
    for directory in range(10, 20):  # listed, then looked up in
        listings.listed_bare(directory, entries=100)
        listings.looked_up(directory)
        listings.looked_up(directory)
        assert 1 <= len(listings._wanting) <= 3
    assert listings.with_attributes(19) and not listings.with_attributes(10)
    listings.listed_bare(20, entries=2)  # a small directory: half its bare entries' lookups
    listings.looked_up(20)
    assert listings.with_attributes(20)


def test_a_stock_pyfuse3_lists_every_entry_with_its_attributes(ops: Operations,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without our patch: no ``lookup`` argument, a token without ``plus``, never a bare entry."""
    monkeypatch.setattr(listing, "SUPPORTED", False)
    monkeypatch.setattr(pyfuse3, "readdir_reply", lambda token, name, attr, offset: token.add(name, attr, offset, True))

    class StockToken(Reply):
        def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
            if name == "plus":
                raise AttributeError(name)
            return super().__getattribute__(name)

    token = StockToken(True, 5000)
    trio.run(ops.readdir, ROOT_ID, 0, token)
    assert len(token.entries) == FILES and ops.stats.listed_with_attributes == FILES
    assert ops.stats.listed_bare == 0


def test_a_reply_reads_rows_as_it_needs_them(ops: Operations, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small reply reads a first page of rows, a large one pages doubling up to MAX_ROWS, and a short page ends
    it."""
    asked: list[int] = []
    entries = ops.catalog.child_entries

    def counting(parent: int, after_id: int = 0, limit: int = 128) -> list[tuple[int, bytes, int]]:
        asked.append(limit)
        return entries(parent, after_id, limit)

    monkeypatch.setattr(ops.catalog, "child_entries", counting)
    monkeypatch.setattr(ops.catalog, "has_listings", False)
    trio.run(ops.readdir, ROOT_ID, 0, Reply(True, 10))
    assert asked == [listing.FIRST_ROWS_PLUS]
    asked.clear()
    trio.run(ops.readdir, ROOT_ID, 0, Reply(True, 5000))
    assert asked == [32, 64, 128, 256]  # 300 rows: the fourth page is the last (short)
    asked.clear()
    trio.run(ops.readdir, ROOT_ID, 0, Reply(False, 5000))
    assert asked == [128, 256]


def tamper(ops: Operations, change: Callable[[bytes], bytes | str], nth: int = -1) -> None:
    """The ``nth`` of the root's packed chunks rewritten by ``change``, as whoever can write the store could."""
    db = sqlite3.connect(ops.catalog.path)
    with db:
        last, chunk = db.execute("SELECT last, entries FROM listings WHERE parent=? ORDER BY last",
                                 (ROOT_ID,)).fetchall()[nth]
        db.execute("UPDATE listings SET entries=? WHERE parent=? AND last=?", (change(chunk), ROOT_ID, last))
    db.close()


@pytest.mark.parametrize("plus", [True, False])
@pytest.mark.parametrize("change", ["head", "name", "ascending", "long", "text", "last"])
def test_a_malformed_packed_listing_goes_on_from_the_rows(ops: Operations, caplog: pytest.LogCaptureFixture,
                                                          plus: bool, change: str) -> None:
    """A chunk amid the listing cut short (in a record's head, in its name, or after a whole record, before the
    id it is keyed by: those entries were in no listing), with a record twice (its id not ascending), longer
    than a build writes, or not a blob: every entry is still listed once, in order."""
    assert ops.catalog.has_listings

    def changed(chunk: bytes) -> bytes | str:
        first = listings.RECORD.size + listings.RECORD.unpack_from(chunk)[2]
        last_start = list(listings.read(chunk))[-1][3]
        return {"head": chunk[:first + 5], "name": chunk[:-3], "ascending": chunk[:first] + chunk,
                "long": chunk + b"x" * listings.longest_chunk(), "text": "not a blob",
                "last": chunk[:last_start]}[change]

    tamper(ops, changed, nth=3)
    entries = listed(ops, plus=plus, room=40)
    assert [e[0] for e in entries] == sorted(e[0] for e in entries)
    same_as_lookups(ops, entries)
    assert not listing.PACKED or "malformed" in caplog.text


def test_a_packed_record_never_names_another_node(ops: Operations) -> None:
    """The directory's record given the id of a file elsewhere (ascending, as a check of the bytes alone would
    pass): listed from its rows with its own attributes, never as an alias of that file."""
    inner = ops.catalog.lookup(ops.catalog.lookup(ROOT_ID, b"sub").id, b"inner.bin")
    assert inner is not None

    def point_sub_at_inner(chunk: bytes) -> bytes:
        *_, start, _ = next(r for r in listings.read(chunk) if r[2] == b"sub")
        _, mode, length = listings.RECORD.unpack_from(chunk, start)
        return chunk[:start] + listings.RECORD.pack(inner.id, mode, length) + chunk[start + listings.RECORD.size:]

    tamper(ops, point_sub_at_inner)  # the last chunk: sub's name sorts after the files'
    entries = listed(ops, plus=True, room=5000)
    same_as_lookups(ops, entries)
    assert inner.id not in {e[1] for e in entries}


def _root_names(ops: Operations, plus: bool) -> list[bytes]:
    """The names a whole listing of the root gives, in replies of 40 entries."""
    entries, offset = [], 0
    while True:
        reply = Reply(plus, 40)
        trio.run(ops.readdir, ROOT_ID, offset, reply)
        if not reply.entries:
            return [e[0] for e in entries]
        entries += reply.entries
        offset = reply.entries[-1][3]


@pytest.mark.parametrize("plus", [True, False])
def test_a_row_named_as_no_file_can_be_is_left_out_of_the_listing(ops: Operations, plus: bool,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The catalog may be written by whoever can write the store: a row's name with a '/' made the kernel fail
    the whole listing with EIO, one with a NUL was cut there by libfuse (an alias of another entry), '..' named
    the parent. Listed from the rows (a catalog without packed listings), such rows are left out, the rest listed."""
    monkeypatch.setattr(listing, "PACKED", False)
    bad = {b"f0001.bin": b"a/b", b"f0002.bin": b"f0003.bin\0", b"f0004.bin": b"..", b"f0005.bin": b"x" * 256}
    db = sqlite3.connect(ops.catalog.path)
    with db:
        for name, to in bad.items():
            db.execute("UPDATE nodes SET name=? WHERE parent=? AND name=?", (to, ROOT_ID, name))
    db.close()
    names = _root_names(ops, plus)
    assert len(names) == FILES - len(bad) and not set(bad.values()) & set(names)
    assert all(listings.fit_name(n) for n in names) and b"f0003.bin" in names
    assert "which no file can be named" in caplog.text


@pytest.mark.parametrize("plus", [True, False])
def test_a_root_row_named_as_the_control_file_is_never_listed(ops: Operations, plus: bool) -> None:
    """A catalog from before scans left it out may have a root entry named ``.__liquidfs__``: the mount answers
    that name itself (its control file), and a READDIRPLUS that listed the row with its attributes had the kernel
    take the row's node for the control file. Left out of every listing, packed or from the rows."""
    db = sqlite3.connect(ops.catalog.path)
    with db:
        db.execute("UPDATE nodes SET name=? WHERE parent=? AND name=?", (CONTROL_NAME, ROOT_ID, b"f0001.bin"))
    db.close()
    names = _root_names(ops, plus)
    assert len(names) == FILES - 1 and CONTROL_NAME not in names and b"f0001.bin" not in names
    assert trio.run(ops.lookup, ROOT_ID, CONTROL_NAME, CTX).st_ino == CONTROL_ID


@pytest.mark.parametrize("plus", [True, False])
def test_a_row_that_cannot_be_answered_is_left_out_and_counts_no_lookup(ops: Operations, plus: bool,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A row whose attributes fail (a kind no build writes: whoever writes the store wrote it) failed the whole
    READDIRPLUS reply with EIO, after the entries before it were counted as lookups the kernel never got, and
    every listing of the directory at it. Left out: the rest listed, and each lookup counted is one the kernel has.
    (A plain READDIR lists it bare, by its mode: no attributes, no lookup.)"""
    sub = ops.catalog.lookup(ROOT_ID, b"sub")
    assert sub is not None
    db = sqlite3.connect(ops.catalog.path)
    with db:
        db.execute("UPDATE nodes SET kind=7 WHERE id=?", (sub.id,))  # the only directory of the root
    db.close()
    names = _root_names(ops, plus)
    assert len(names) == FILES - plus and (b"sub" in names) is not plus
    looked_up = {node.name for node in ops.catalog.children(ROOT_ID, 0, FILES + 1) if ops.inodes.lookups(node.id)}
    assert b"sub" not in looked_up and looked_up <= set(names)
    assert ("cannot be answered" in caplog.text) is plus


@pytest.mark.parametrize("plus", [True, False])
@pytest.mark.parametrize("wanted", [False, True], ids=["bare", "with-attributes"])
def test_a_row_of_a_text_name_or_a_mode_no_file_has_is_left_out(ops: Operations, plus: bool, wanted: bool,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The name column takes any type and the mode any integer: a TEXT name raised TypeError, a mode of -1 or
    2**32 OverflowError, at that row of every listing of the directory (EIO, the entries after it never
    listed); a device's mode showed a device. Left out, the rest listed (a row whose kind says a file is
    listed with its attributes by its kind)."""
    monkeypatch.setattr(listing, "PACKED", False)
    db = sqlite3.connect(ops.catalog.path)
    with db:
        db.execute("UPDATE nodes SET name=? WHERE parent=? AND name=?", ("text.bin", ROOT_ID, b"f0001.bin"))
        for name, mode in ((b"f0002.bin", -1), (b"f0003.bin", 1 << 32), (b"f0004.bin", stat.S_IFCHR | 0o644)):
            db.execute("UPDATE nodes SET mode=? WHERE parent=? AND name=?", (mode, ROOT_ID, name))
    db.close()
    if wanted:
        ops.listings._wanting.add(ROOT_ID)
    names = _root_names(ops, plus)
    left_out = {b"f0001.bin", b"text.bin"} | (set() if wanted and plus else {b"f0002.bin", b"f0003.bin", b"f0004.bin"})
    assert set(names) == {n.name for n in ops.catalog.children(ROOT_ID, 0, FILES + 1)
                          if isinstance(n.name, bytes)} - left_out
    assert len(names) == len(set(names))


def test_a_reply_that_fails_on_the_way_counts_no_lookup(ops: Operations, monkeypatch: pytest.MonkeyPatch) -> None:
    """A catalog page that cannot be read amid a READDIRPLUS reply with attributes: the reply is never sent, and
    the lookups of the entries it had taken were counted all the same (never forgotten by the kernel)."""
    ops.listings._wanting.add(ROOT_ID)
    pages = ops.catalog.children
    calls: list[int] = []

    def failing(*args: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise sqlite3.OperationalError("disk I/O error")
        return pages(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ops.catalog, "children", failing)
    known = ops.inodes.known
    with pytest.raises(pyfuse3.FUSEError):
        trio.run(ops.readdir, ROOT_ID, 0, Reply(True, 5000))
    assert len(calls) == 2 and ops.inodes.known == known
