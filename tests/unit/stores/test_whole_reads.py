"""What a whole-file read of the local store reads (``stores.reader.read_settled``, ``StoreReader._read_raw``):
no more than the size checked, whatever a writer of the source or of the store does to the file meanwhile. A file
grown to 100 GB (sparse: it costs the writer nothing) must not be read into the daemon's memory; here it grows
to twice the whole-file limit, which a read of the code before would still have survived."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest

from liquidfs.catalog.catalog import CATALOG_NAME, Catalog
from liquidfs.catalog.nodes import Node
from liquidfs.expand.rawformats import MAX_OBJECT_BYTES
from liquidfs.prepare import prepare
from liquidfs.stores import reader as reader_module
from liquidfs.stores.local import reader as local_reader_module
from liquidfs.stores.local.reader import StoreReader
from liquidfs.stores.reader import WHOLE_FILE_LIMIT, read_settled
from liquidfs.sysio import directio
from sample import make_sample

GROWN = 2 * WHOLE_FILE_LIMIT


def _spans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths every whole-file read asks for (``directio.read_span``, wherever it was imported)."""
    asked: list[int] = []
    real = directio.read_span

    def recorded(fd: int, start: int, end: int, **kwargs: object) -> memoryview:
        asked.append(end - start)
        return real(fd, start, end, **kwargs)

    for module in (directio, reader_module, local_reader_module):
        monkeypatch.setattr(module, "read_span", recorded, raising=False)
    return asked


def _prepared(tmp_path: Path, seed: int) -> tuple[Path, Path, Node]:
    """A prepared sample, and one of its files served raw."""
    src = make_sample(tmp_path / "data", count=2, width=64, height=32, seed=seed)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    try:
        return src, store, next(n for n in catalog.files() if n.object)
    finally:
        catalog.close()


def _opened(store: Path, node_id: int) -> tuple[bool, str | None, bytes]:
    """What the store's reader serves for ``node_id`` (its row as the catalog says now): raw or not, why not,
    and the bytes."""
    catalog = Catalog.open(store, readonly=True)
    reader = StoreReader(catalog.source, store)
    try:
        node = catalog.get(node_id)
        assert node is not None
        content = reader.open(node)
        try:
            return content.raw, content.fallback, bytes(content.data or b"")
        finally:
            content.close()
    finally:
        reader.close()
        catalog.close()


def test_a_raw_object_grown_by_a_store_writer_is_refused_unread(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    src, store, node = _prepared(tmp_path, 3)
    os.truncate(store / str(node.object), GROWN)
    asked = _spans(monkeypatch)
    raw, fallback, data = _opened(store, node.id)
    assert not raw and "bytes, expected" in str(fallback)
    assert data == (src / os.fsdecode(node.path)).read_bytes()  # the original
    assert asked and max(asked) < WHOLE_FILE_LIMIT  # the original's read; none of the object


def test_a_source_grown_while_it_is_read_is_read_no_further(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "image.png"
    path.write_bytes(b"x" * 4096)
    real = directio.read_span
    asked: list[int] = []

    def grows_while_read(fd: int, start: int, end: int, **kwargs: object) -> memoryview:
        asked.append(end - start)
        data = real(fd, start, end, **kwargs)
        os.truncate(path, GROWN)  # its writer, during the read
        return data

    for module in (directio, reader_module):
        monkeypatch.setattr(module, "read_span", grows_while_read, raising=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as failed:
            read_settled(fd, os.fstat(fd), "image.png")
    finally:
        os.close(fd)
    assert failed.value.errno == errno.EIO and "grew past" in str(failed.value)
    assert asked == [4096]


def test_a_raw_object_larger_than_any_prepare_writes_is_never_read(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A store writer who claims that size in the catalog row too (and makes a sparse object of it)."""
    src, store, node = _prepared(tmp_path, 5)
    os.truncate(store / str(node.object), MAX_OBJECT_BYTES + 1)
    with sqlite3.connect(store / CATALOG_NAME) as db:
        db.execute("UPDATE nodes SET served_size = ? WHERE id = ?", (MAX_OBJECT_BYTES + 1, node.id))
    asked = _spans(monkeypatch)
    raw, fallback, data = _opened(store, node.id)
    assert not raw and "more than any prepare writes" in str(fallback)
    assert data == (src / os.fsdecode(node.path)).read_bytes()
    assert asked and max(asked) < WHOLE_FILE_LIMIT


@pytest.mark.parametrize(("code", "local"), [(errno.EIO, True), (errno.ENOMEM, True), (errno.ENOMEM, False)])
def test_a_raw_object_read_failing_for_want_of_memory_fails_the_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   code: int, local: bool) -> None:
    """A medium error (EIO) reading the object serves the original; one that says the daemon is short (ENOMEM,
    ``sysio.short``) says nothing about the object: the open fails with it, never a fallback for a sound file.
    Where the objects are on FUSE, its server may answer so itself: the original is served."""
    if not local:
        monkeypatch.setattr(local_reader_module, "filesystem_type_of", lambda fd: "fuse.sshfs")
    src, store, node = _prepared(tmp_path, 9)
    real = local_reader_module.read_span

    def failing(fd: int, start: int, end: int, **kwargs: object) -> memoryview:
        if end - start == node.served_size:  # the object's read
            raise OSError(code, os.strerror(code))
        return real(fd, start, end, **kwargs)

    monkeypatch.setattr(local_reader_module, "read_span", failing)
    if code == errno.EIO or not local:
        raw, fallback, data = _opened(store, node.id)
        assert not raw and "raw object unreadable" in str(fallback)
        assert data == (src / os.fsdecode(node.path)).read_bytes()
    else:
        with pytest.raises(OSError) as failed:
            _opened(store, node.id)
        assert failed.value.errno == code


@pytest.mark.parametrize("objects_on", [None, "nfs4", "fuse.sshfs", "virtiofs"])
def test_a_raw_object_open_failing_for_want_of_descriptors_fails_the_open(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        objects_on: str | None) -> None:
    """EMFILE at the object's open (the source's check found it unchanged): served as the original, it counted a
    fallback for a sound file and superseded every open still reading the object. The open fails with it, where
    the objects are local or on NFS (the client's shortage is this node's); on FUSE its server may answer so
    itself, and the original is served."""
    if objects_on is not None:  # (None: this machine's own filesystem)
        monkeypatch.setattr(local_reader_module, "filesystem_type_of", lambda fd: objects_on)
    src, store, node = _prepared(tmp_path, 10)
    real = local_reader_module.open_below_stat

    def short(dir_fd: int, rel: bytes, *args: object, **kwargs: object) -> tuple[int, os.stat_result]:
        if rel.endswith(b".bmp"):  # the object's open, not the source's
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(dir_fd, rel, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(local_reader_module, "open_below_stat", short)
    if objects_on in (None, "nfs4"):
        with pytest.raises(OSError) as failed:
            _opened(store, node.id)
        assert failed.value.errno == errno.EMFILE
    else:
        raw, fallback, data = _opened(store, node.id)
        assert not raw and "raw object unreadable" in str(fallback)
        assert data == (src / os.fsdecode(node.path)).read_bytes()


@pytest.mark.parametrize("column", ["object", "served_size"])
def test_a_raw_row_without_its_object_or_its_size_serves_the_original(tmp_path: Path, column: str) -> None:
    """A damaged or foreign row: an assertion made it an EIO (and a traceback in the log); the original is served."""
    src, store, node = _prepared(tmp_path, 7)
    with sqlite3.connect(store / CATALOG_NAME) as db:
        db.execute(f"UPDATE nodes SET {column} = NULL WHERE id = ?", (node.id,))
    raw, fallback, data = _opened(store, node.id)
    assert not raw and "no raw object recorded" in str(fallback)
    assert data == (src / os.fsdecode(node.path)).read_bytes()


@pytest.mark.parametrize("objects_on", ["ext4", "nfs4", "fuse.sshfs"])
def test_objects_are_opened_on_the_loop_only_where_their_filesystem_is_local_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, objects_on: str) -> None:
    """Whether the loop opens the raw objects itself was judged by the source's filesystem alone: an objects
    directory linked to an NFS or FUSE filesystem was opened on the loop, where a server that stops answering
    held every request (a cached lookup still asks the filesystem at the open)."""
    from liquidfs.stores.local.reader import StoreReader

    (tmp_path / "src").mkdir()
    (tmp_path / "store" / "objects").mkdir(parents=True)
    objects = (tmp_path / "store" / "objects").stat().st_ino
    monkeypatch.setattr(local_reader_module, "filesystem_type_of",
                        lambda fd: objects_on if os.fstat(fd).st_ino == objects else "ext4")
    # The directories held decide, never what their paths name by now (they may have been swapped since)
    monkeypatch.setattr(local_reader_module, "filesystem_type", lambda path: "ext4" if objects_on != "ext4" else "nfs")
    reader = StoreReader(os.fsencode(tmp_path / "src"), tmp_path / "store")
    try:
        assert reader.inline_check == (objects_on == "ext4") and reader.stamps_vouch == (objects_on == "ext4")
    finally:
        reader.close()


@pytest.mark.parametrize("objects", ["file", "unreadable"])
def test_a_reader_that_cannot_be_made_keeps_no_directory_open(tmp_path: Path, objects: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The source root was left open where the objects directory could not be opened (a file of that name) or
    judged."""
    (tmp_path / "src").mkdir()
    (tmp_path / "store").mkdir()
    if objects == "file":
        (tmp_path / "store" / "objects").write_bytes(b"")
    else:
        (tmp_path / "store" / "objects").mkdir()

        def unreadable(fd: int) -> str:
            raise OSError(errno.EIO, "no")

        monkeypatch.setattr(local_reader_module, "filesystem_type_of", unreadable)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        StoreReader(os.fsencode(tmp_path / "src"), tmp_path / "store")
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_streamed_file_that_grew_since_its_open_is_read_no_further_than_its_size(tmp_path: Path) -> None:
    """A file too large to read whole is streamed from its descriptor: its reads went past the size the open told
    the kernel once it grew (a direct_io open answers what the daemon gives), where a fetched or an in-memory
    one's stop there."""
    from liquidfs.stores.reader import Content

    path = tmp_path / "big"
    path.write_bytes(b"a" * 100)
    fd = os.open(path, os.O_RDONLY)
    content = Content(size=100, raw=False, fd=fd)
    try:
        with open(path, "ab") as grow:
            grow.write(b"b" * 50)
        assert bytes(content.read(90, 40)) == b"a" * 10
        assert bytes(content.read(100, 10)) == b"" and bytes(content.read(120, 10)) == b""
    finally:
        content.close()
