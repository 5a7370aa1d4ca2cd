"""Listings through a real mount (issue 40's ``find``, ``fuse.listing``): a directory's regular files are listed
without attributes (name, inode number, type) until lookups of its names follow a listing, so a ``find`` costs no
inode per entry in the kernel or the daemon; then its listings carry them, as ``ls -l`` wants. Names, inode
numbers and types are the same either way, and files listed bare open and read exactly."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
import subprocess
from pathlib import Path

import pytest

from fusehelpers import Mount
from liquidfs.catalog import listings
from liquidfs.catalog.build import build
from liquidfs.daemon.control import read_control
from liquidfs.fuse import listing

# Bare entries need our patched pyfuse3, which scripts/install.sh builds as root (as CI runs).
pytestmark = [pytest.mark.fuse, pytest.mark.needs_root("liquidfs's patched pyfuse3 (scripts/install.sh)")]

BIG = 3000  # entries of the big directory: a few pages of 4 KiB replies hold a fraction of them


def tree(src: Path) -> None:
    big = src / "big"
    big.mkdir(parents=True)
    for i in range(BIG - 2):
        (big / f"image_{i:05d}_of_a_longer_name.png").write_bytes(i.to_bytes(4, "little") * (i % 5))
    (big / "sub").mkdir()
    (big / "sub" / "inner.txt").write_bytes(b"inner\n")
    os.symlink("image_00001_of_a_longer_name.png", big / "link")
    (src / "small").mkdir()
    for name in ("a", "b", "c"):
        (src / "small" / name).write_bytes(name.encode() * 100)


def test_find_lists_files_bare_and_ls_after_lookups_gets_attributes(tmp_path: Path, mounter: Mount) -> None:
    assert listing.SUPPORTED and listing.PACKED, \
        "this pyfuse3 lacks pyfuse3-readdir.patch: run scripts/install.sh as root"
    src, store = tmp_path / "src", tmp_path / "store"
    tree(src)
    build(src, store)
    mnt = mounter.mount(src, store=store)
    before = read_control(mnt)

    found = subprocess.run(["find", ".", "-print0"], cwd=mnt, capture_output=True, check=True).stdout
    expected = subprocess.run(["find", ".", "-print0"], cwd=src, capture_output=True, check=True).stdout
    assert sorted(found.split(b"\0")) == sorted(expected.split(b"\0"))
    after = read_control(mnt)
    bare = after["listed_bare"] - before["listed_bare"]
    plus = after["listed_with_attributes"] - before["listed_with_attributes"]
    # Every regular file came bare (big/image_*, big/sub/inner.txt, small/{a,b,c}), and the kernel holds no inode
    # of them. The directories and the link came with their attributes where a READDIRPLUS reply held them (a
    # plain READDIR page of a kernel with 4 KiB replies holds none).
    assert bare + plus == 2 + BIG + 1 + 3, (bare, plus)  # /, big/, big/sub/, small/
    assert BIG - 2 + 1 + 3 <= bare, (bare, plus)
    assert after["listed_packed"] - before["listed_packed"] == bare  # in C, from the build's packed listings
    assert after["known_inodes"] <= 5, after["known_inodes"]

    # The same names, inodes and types as a lookup of each gives (the stat after the whole listing: a lookup
    # during it would have the kernel ask for attributes again).
    entries = list(os.scandir(mnt / "big"))
    assert sorted(e.name for e in entries) == sorted(os.listdir(src / "big"))
    for entry in entries:
        st = os.lstat(entry.path)
        assert entry.inode() == st.st_ino, entry.name
        assert entry.is_dir(follow_symlinks=False) == stat.S_ISDIR(st.st_mode), entry.name
        assert entry.is_symlink() == stat.S_ISLNK(st.st_mode), entry.name
        assert entry.is_file(follow_symlinks=False) == stat.S_ISREG(st.st_mode), entry.name
        source = os.lstat(src / "big" / entry.name)
        assert (st.st_size, st.st_mtime_ns) == (source.st_size, source.st_mtime_ns), entry.name
    # Files listed bare open and read exactly (a lookup of each first), sha256sum as the client.
    names = sorted(e.name for e in entries if e.is_file(follow_symlinks=False))[::97]
    summed = subprocess.run(["sha256sum", *names], cwd=mnt / "big", capture_output=True, text=True, check=True)
    for line in summed.stdout.splitlines():
        digest, name = line.split(maxsplit=1)
        assert digest == hashlib.sha256((src / "big" / name).read_bytes()).hexdigest(), name
    assert os.readlink(mnt / "big" / "link") == "image_00001_of_a_longer_name.png"
    # Lookups followed the listing: the next one carries every entry's attributes (as ls -l wants them) in its
    # READDIRPLUS replies: all of it where one reply holds the directory (kernels from 6.16), else the first.
    before = read_control(mnt)
    assert sorted(os.listdir(mnt / "big")) == sorted(os.listdir(src / "big"))
    after = read_control(mnt)
    plus = after["listed_with_attributes"] - before["listed_with_attributes"]
    bare = after["listed_bare"] - before["listed_bare"]
    assert plus + bare == BIG
    one_reply = tuple(int(part) for part in os.uname().release.split(".")[:2]) >= (6, 16)
    assert plus == BIG if one_reply else plus >= 16, (plus, bare)
    assert after["errors"] == 0


def test_a_malformed_packed_listing_lists_from_the_rows(tmp_path: Path, mounter: Mount) -> None:
    """The store's writer rewrites the packed listings (``catalog.listings``, read in C by our pyfuse3 patch):
    cut short in a record's head, cut in a name, a name with a '/' (the kernel would fail the whole reply), '..',
    a name with a NUL, a chunk longer than a build writes, a record twice, a directory's record naming a file of
    another directory. Every directory still lists exactly as the source, and the daemon
    answers no error."""
    assert listing.PACKED, "this pyfuse3 lacks pyfuse3-readdir.patch: run scripts/install.sh as root"
    src, store = tmp_path / "src", tmp_path / "store"
    tree(src)
    for name in ("cut_head", "cut_name", "slash", "dotdot", "nul", "long", "twice", "zalias"):
        (src / name).mkdir()
        for i in range(40):
            (src / name / f"file_{i:03d}.png").write_bytes(bytes([i]))
    build(src, store)
    db = sqlite3.connect(store / "catalog.sqlite")
    with db:
        def chunk_of(name: str) -> tuple[int, bytes]:
            (parent,) = db.execute("SELECT id FROM nodes WHERE parent=1 AND name=?", (name.encode(),)).fetchone()
            (chunk,) = db.execute("SELECT entries FROM listings WHERE parent=?", (parent,)).fetchone()
            return parent, chunk

        def rewrite(name: str, change: bytes) -> None:
            db.execute("UPDATE listings SET entries=? WHERE parent=?", (change, chunk_of(name)[0]))

        rewrite("cut_head", chunk_of("cut_head")[1][:listings.RECORD.size * 10 + 5])
        rewrite("cut_name", chunk_of("cut_name")[1][:-3])
        rewrite("slash", chunk_of("slash")[1].replace(b"file_020.png", b"file/020.png"))
        for name, renamed in (("dotdot", b".."), ("nul", b"file_\x0020.png")):
            rewrite(name, b"".join(listings.record(ident, mode, renamed if i == 20 else entry)
                                   for i, (ident, mode, entry, _, _) in enumerate(listings.read(chunk_of(name)[1]))))
        rewrite("long", chunk_of("long")[1] + b"x" * listings.longest_chunk())
        twice = list(listings.read(chunk_of("twice")[1]))
        rewrite("twice", b"".join(listings.record(ident, mode, name) for ident, mode, name, _, _ in
                                  twice[:21] + twice[20:]))  # the 21st record twice: its id does not ascend
        # zalias is listed first by the walk: small/'s files come after it, so the record still ascends
        (other,) = db.execute("SELECT max(id) FROM nodes WHERE name=?", (b"a",)).fetchone()
        records = list(listings.read(chunk_of("zalias")[1]))
        assert other > records[-1][0]
        rewrite("zalias", b"".join(listings.record(other, 0o40755, name) if i == len(records) - 1
                                   else listings.record(ident, mode, name)
                                   for i, (ident, mode, name, _, _) in enumerate(records)))
    db.close()
    mnt = mounter.mount(src, store=store)
    found = subprocess.run(["find", ".", "-print0"], cwd=mnt, capture_output=True, check=True).stdout
    expected = subprocess.run(["find", ".", "-print0"], cwd=src, capture_output=True, check=True).stdout
    assert sorted(found.split(b"\0")) == sorted(expected.split(b"\0"))
    for name in ("cut_head", "cut_name", "slash", "dotdot", "nul", "long", "twice", "zalias"):
        entries = {e.name: (e.inode(), e.is_file(follow_symlinks=False)) for e in os.scandir(mnt / name)}
        assert sorted(entries) == sorted(os.listdir(src / name)), name
        for entry_name, (ino, is_file) in entries.items():
            assert is_file and os.lstat(mnt / name / entry_name).st_ino == ino, (name, entry_name)
    control = read_control(mnt)
    assert control["errors"] == 0 and control["listed_packed"] < control["listed_bare"]
