"""What a writer of the store or of the dataset cannot make liquidfs, running as root, do (issue 26): delete or
write files outside the store, put lines of their own in a log, have a catalog choose the source root, or hang
a profile on a FIFO. Each test fails on the code before its fix."""

from __future__ import annotations

import errno
import logging
import os
import re
import sqlite3
import stat
import threading
from pathlib import Path

import pytest

from liquidfs import cli
from liquidfs.cli.main import _setup_logging
from liquidfs.catalog.catalog import CATALOG_NAME, Catalog
from liquidfs.catalog.nodes import Node
from liquidfs.catalog.schema import CatalogError
from liquidfs.prepare import PrepareError, prepare, verify
from liquidfs.stores.local import PROFILE_NAME, LocalStore
from liquidfs.stores.local.reader import StoreReader
from liquidfs.stores.reader import UNTRUSTED_REASON, Content
from liquidfs.stores.sample import ProfileError
from sample import make_sample

NOBODY = 65534


@pytest.fixture
def prepared(tmp_path: Path) -> tuple[Path, Path]:
    src = make_sample(tmp_path / "data", count=4, width=64, height=32, seed=3)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    return src, store


def _add_expansion(store: Path, path: bytes, obj: str) -> None:
    with sqlite3.connect(store / CATALOG_NAME) as db:
        db.execute("INSERT INTO expansions (path, src_size, src_mtime_ns, object) VALUES (?, 1, 1, ?)", (path, obj))


# -- deleting outside the store ----------------------------------------------------------------------------------


def test_prepare_deletes_nothing_outside_the_store_whatever_the_catalog_or_the_objects_directory_say(
        prepared: tuple[Path, Path], tmp_path: Path) -> None:
    src, store = prepared
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = outside / f"{'ab' * 16}.bmp"  # an object's name, reached through objects/zz -> outside
    linked.write_bytes(b"keep")
    os.symlink(outside, store / "objects" / "zz")
    absolute = outside / "precious.bmp"
    absolute.write_bytes(b"keep")
    dotdot = tmp_path / f"{'cd' * 16}.bmp"
    dotdot.write_bytes(b"keep")
    _add_expansion(store, b"ghost-absolute", str(absolute))
    _add_expansion(store, b"ghost-dotdot", f"objects/../../{dotdot.name}")
    _add_expansion(store, b"ghost-through-link", f"objects/zz/{linked.name}")
    some_sub = next(p for p in (store / "objects").iterdir() if not p.is_symlink())
    leftover = some_sub / f"{'ef' * 16}.bmp.tmp-{'0' * 16}"  # what a killed expansion leaves
    leftover.write_bytes(b"partial")
    notes = some_sub / "notes.txt"  # not a name prepare gives: not prepare's to delete
    notes.write_bytes(b"mine")

    report = prepare(src, store, 0.0, progress=False)  # every object is surplus now

    assert report.deleted >= 4
    assert linked.read_bytes() == b"keep" and absolute.read_bytes() == b"keep" and dotdot.read_bytes() == b"keep"
    assert (store / "objects" / "zz").is_symlink()
    assert not leftover.exists() and notes.exists()
    assert not [p for p in (store / "objects").rglob("*.bmp") if not p.is_relative_to(store / "objects" / "zz")]


# -- files liquidfs writes, and its log lines --------------------------------------------------------------------


def test_a_log_record_naming_a_file_with_newlines_is_one_line(tmp_path: Path, restore_logging: None) -> None:
    log_file = tmp_path / "mount.log"
    _setup_logging("info", str(log_file))
    name = "x\nimport os; os.system('id')\r\n\t.png\x1b[2J\x85"
    logging.getLogger("liquidfs.test").warning("skipping %s: unreadable", name)
    try:
        raise OSError(errno.EIO, f"cannot read {name}")
    except OSError:
        logging.getLogger("liquidfs.test").exception("failed on %s", name)
    for handler in logging.getLogger().handlers:
        handler.flush()
    lines = log_file.read_text().splitlines(keepends=True)
    assert len(lines) == 2, lines
    assert all(line.endswith("\n") and "\n" not in line[:-1] and "\r" not in line for line in lines)
    assert "x\\nimport os; os.system('id')\\r\\n\\t.png\\x1b[2J\\x85" in lines[0]
    assert not any(line.startswith("import") for line in lines)


def test_a_log_file_that_is_a_symlink_is_refused_and_its_target_left_as_it_was(
        tmp_path: Path, restore_logging: None) -> None:
    target = tmp_path / "bashrc"
    target.write_text("# root's startup file\n")
    link = tmp_path / "mount.log"
    os.symlink(target, link)
    with pytest.raises(OSError, match="symbolic link") as refused:
        _setup_logging("info", str(link))
    assert refused.value.errno == errno.ELOOP and str(link) in str(refused.value)
    logging.getLogger("liquidfs.test").warning("x\nimport os")
    assert target.read_text() == "# root's startup file\n"


def test_the_cli_says_why_it_cannot_log_to_a_link(tmp_path: Path, restore_logging: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "profile"
    target.write_text("unchanged\n")
    os.symlink(target, tmp_path / "log")
    umask = os.umask(0o022)
    try:
        status = cli.main(["verify", "--store", str(tmp_path / "store"), "--log-file", str(tmp_path / "log")])
    finally:
        os.umask(umask)
    assert status != 0
    assert "symbolic link" in capsys.readouterr().err
    assert target.read_text() == "unchanged\n"


def test_the_kept_profile_replaces_a_link_rather_than_writing_through_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "data", tmp_path / "store")
    store.store_dir.mkdir()
    target = tmp_path / "shadow"
    target.write_text("root:x:0:0\n")
    os.symlink(target, store.store_dir / PROFILE_NAME)
    store.keep_profile('{"chosen": 0.25}')
    assert target.read_text() == "root:x:0:0\n"
    kept = os.lstat(store.store_dir / PROFILE_NAME)
    assert stat.S_ISREG(kept.st_mode) and kept.st_mode & 0o077 == 0
    assert store.profile_choice() == 0.25


def test_a_kept_profile_that_is_a_fifo_does_not_hang_the_mount(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "data", tmp_path / "store")
    store.store_dir.mkdir()
    fifo = store.store_dir / PROFILE_NAME
    os.mkfifo(fifo)
    found: list[float | None] = []
    reader = threading.Thread(target=lambda: found.append(store.profile_choice()), daemon=True)
    reader.start()
    reader.join(20)
    try:
        assert not reader.is_alive(), "profile_choice blocked on a FIFO"
        assert found == [None]
    finally:
        _release(fifo, reader)


# -- the source root a catalog names -----------------------------------------------------------------------------


def _rewrite_source(store: Path, source: str) -> None:
    with sqlite3.connect(store / CATALOG_NAME) as db:
        db.execute("UPDATE meta SET value=? WHERE key='source'", (source,))


@pytest.mark.needs_root("a chown of the catalog to another user")
def test_verify_refuses_a_source_named_by_a_catalog_someone_else_owns(prepared: tuple[Path, Path]) -> None:
    _, store = prepared
    _rewrite_source(store, "/")
    os.chown(store / CATALOG_NAME, NOBODY, NOBODY)
    with pytest.raises(CatalogError, match="owned by uid 65534") as refused:
        verify(store, progress=False)
    assert str(store / CATALOG_NAME) in str(refused.value)


def test_verify_refuses_a_source_named_by_a_catalog_others_can_write(prepared: tuple[Path, Path]) -> None:
    _, store = prepared
    (store / CATALOG_NAME).chmod(0o666)
    with pytest.raises(CatalogError, match="writable by others"):
        verify(store, progress=False)
    (store / CATALOG_NAME).chmod(0o600)
    assert verify(store, progress=False) == []  # the owner's own catalog names the source


def test_a_mount_refuses_a_catalog_that_names_another_source(prepared: tuple[Path, Path]) -> None:
    """The daemon that ``liquidfs mount`` starts only finds the catalog: it is checked there too."""
    src, store = prepared
    _rewrite_source(store, "/")
    if os.geteuid() == 0:
        os.chown(store / CATALOG_NAME, NOBODY, NOBODY)
    with pytest.raises(CatalogError, match="not " + str(src)):
        LocalStore(src, store).found_catalog()
    with pytest.raises(CatalogError, match="not " + str(src)):
        LocalStore(src, store).verify_jobs()


# -- profile's timed reads ---------------------------------------------------------------------------------------


def _release(fifo: Path, thread: threading.Thread) -> None:
    """Unblock a reader stuck opening ``fifo`` (the code before the fix), so the test process can exit."""
    for _ in range(200):
        if not thread.is_alive():
            return
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(0.05)


def test_profile_reads_no_fifo_a_dataset_writer_swaps_in(tmp_path: Path) -> None:
    src = make_sample(tmp_path / "data", count=3, width=64, height=32, seed=3, jpeg_share=0.0)
    images = sorted(src.rglob("*.png"))
    store = LocalStore(src, tmp_path / "store")
    sample = store.profile_sample(len(images), 1)  # every image is in it
    assert len(sample.originals) == len(images) == 3
    try:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        # the dataset's owner swaps an image for a link to a FIFO right after profile read it
        images[0].unlink()
        os.symlink(fifo, images[0])
        results: list[object] = []

        def load() -> None:
            try:
                results.append(sample.load(sample.originals, 0.05))
            except ProfileError as exc:
                results.append(exc)

        some = threading.Thread(target=load, daemon=True)
        some.start()
        some.join(20)
        try:
            assert not some.is_alive(), "a timed read blocked on a FIFO"
        finally:
            _release(fifo, some)
        assert isinstance(results[0], tuple) and results[0][0] > 0, results[0]  # the others were read and timed

        for image in images[1:]:
            image.unlink()
            os.symlink("/dev/zero", image)  # a device, which root must not open either
        every = threading.Thread(target=load, daemon=True)
        every.start()
        every.join(20)
        try:
            assert not every.is_alive(), "a timed read blocked"
        finally:
            _release(fifo, every)
        assert isinstance(results[1], ProfileError), results[1]
    finally:
        sample.cleanup()


# -- objects moved to another image's name ------------------------------------------------------------------------


def _first_raw(store: Path) -> tuple[Catalog, Node]:
    catalog = Catalog.open(store, readonly=True)
    return catalog, next(n for n in catalog.files() if n.object)


def _served(src: Path, store: Path) -> Content:
    catalog, node = _first_raw(store)
    reader = StoreReader(catalog.source, store)
    try:
        return reader.open(node)
    finally:
        reader.close()
        catalog.close()


def test_an_object_in_a_directory_others_may_write_is_not_served(prepared: tuple[Path, Path]) -> None:
    """There, a store writer could rename the object of an image they cannot read (root's prepare wrote it) to
    the name of one they can: the mount serves the original instead."""
    src, store = prepared
    catalog, node = _first_raw(store)
    catalog.close()
    sub = store / str(node.object).rsplit("/", 1)[0]
    content = _served(src, store)
    assert content.raw
    content.close()
    sub.chmod(0o777)
    content = _served(src, store)
    try:
        assert not content.raw and content.fallback == UNTRUSTED_REASON
        assert bytes(content.data or b"") == (src / os.fsdecode(node.path)).read_bytes()
    finally:
        content.close()
    sub.chmod(0o700)
    (store / "objects").chmod(0o777)  # there the subdirectories themselves could be swapped
    content = _served(src, store)
    assert not content.raw and content.fallback == UNTRUSTED_REASON
    content.close()
    (store / "objects").chmod(0o1777)  # the sticky bit keeps each user to their own entries
    content = _served(src, store)
    assert content.raw
    content.close()


@pytest.mark.needs_root("a chown of the objects to another user")
def test_in_another_users_objects_directory_only_their_own_objects_are_served(prepared: tuple[Path, Path]) -> None:
    """A store prepared as another user, mounted by root: their objects are served; one of root's, moved in
    (the user may rename anything there), is not."""
    src, store = prepared
    catalog, node = _first_raw(store)
    catalog.close()
    obj = store / str(node.object)
    for path in (store / "objects", obj.parent):
        os.chown(path, NOBODY, NOBODY)
    content = _served(src, store)
    assert not content.raw and content.fallback == UNTRUSTED_REASON
    content.close()
    os.chown(obj, NOBODY, NOBODY)
    content = _served(src, store)
    assert content.raw and bytes(content.data or b"") == obj.read_bytes()
    content.close()


def test_verify_calls_no_object_sound_that_a_mount_would_not_serve_for_where_it_is(
        prepared: tuple[Path, Path]) -> None:
    """An object in a subdirectory others may rename in (or below an objects directory open to others) holds the
    right bytes, but a mount serves the original in its place: verify says so, naming the directory."""
    _, store = prepared
    assert verify(store, progress=False) == []
    catalog, node = _first_raw(store)
    catalog.close()
    sub = (store / str(node.object)).parent
    sub.chmod(0o777)
    failures = verify(store, progress=False)
    why = f"{sub}: group or others may write it and rename what is in it: a mount serves the original"
    assert failures == [(os.fsdecode(node.path), why)]
    sub.chmod(0o700)
    (store / "objects").chmod(0o777)
    failures = verify(store, progress=False)
    assert len(failures) == 4 and all("rename what is in it" in why for _, why in failures)
    (store / "objects").chmod(0o1777)  # the sticky bit keeps others to their own entries
    assert verify(store, progress=False) == []
    # Names the mount would not open are not opened by verify either (a row a catalog writer pointed elsewhere).
    with sqlite3.connect(store / CATALOG_NAME) as db:
        (first, _), (second, other) = db.execute(
            "SELECT path, object FROM nodes WHERE object IS NOT NULL ORDER BY path LIMIT 2").fetchall()
        db.execute("UPDATE nodes SET object = ? WHERE path = ?", (other, first))
        db.execute("UPDATE nodes SET object = 'objects/../../catalog.sqlite' WHERE path = ?", (second,))
    assert sorted(verify(store, progress=False)) == [
        (os.fsdecode(first), "not the object of this file's source: a mount serves the original"),
        (os.fsdecode(second), "not an object name prepare gives: a mount serves the original")]


def test_prepare_writes_no_object_where_another_user_may_rename_it(tmp_path: Path) -> None:
    src = make_sample(tmp_path / "data", count=2, width=64, height=32, seed=4)
    store = tmp_path / "store"
    for i in range(256):  # made by another user before the first prepare: every object lands in one of them
        sub = store / "objects" / f"{i:02x}"
        sub.mkdir(parents=True)
        sub.chmod(0o777)
    with pytest.raises(PrepareError, match="rename what is in it"):
        prepare(src, store, 1.0, progress=False)
    assert not list((store / "objects").rglob("*.bmp*"))
    for sub in (store / "objects").iterdir():
        sub.chmod(0o700)
    (store / "objects").chmod(0o777)
    with pytest.raises(OSError, match="rename what is in it"):  # before anything is reused or written
        prepare(src, store, 1.0, progress=False)
    assert not list((store / "objects").rglob("*.bmp*"))
    (store / "objects").chmod(0o700)
    prepare(src, store, 1.0, progress=False)
    made = next((store / "objects").rglob("*.bmp"))
    made.parent.chmod(0o777)  # after it was written: a run that would only reuse it says so too
    with pytest.raises(PrepareError, match=f"{made.parent}.*rename what is in it.*chmod go-w it"):
        prepare(src, store, 1.0, progress=False)


def test_a_store_made_through_another_users_link_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    """``--store ~bob/stores/new/ds`` as root, ``stores`` a link of bob's to a directory of root's: prepare made
    ``new/ds`` there, root's, then refused (a mount's scan made its lock there too); so did a mount's disk cache
    not there yet, in the daemon."""
    if os.geteuid() != 0:
        pytest.fail("root's checks are tested as root runs them") if os.environ.get("CI") else \
            pytest.skip("needs root to give a directory away")
    from liquidfs.held.disk import DiskLevel
    from liquidfs.policy.next_epoch import NextEpochCache

    src = make_sample(tmp_path / "data", count=2, width=64, height=32, seed=4)
    bob = tmp_path / "bob"
    bob.mkdir()
    os.chown(bob, 65534, 65534)
    target = tmp_path / "target"
    target.mkdir()
    (bob / "stores").symlink_to(target)
    os.lchown(bob / "stores", 65534, 65534)
    from liquidfs.stores import open_store

    with pytest.raises(CatalogError, match="uid 65534"):
        prepare(src, bob / "stores" / "new" / "ds", 1.0, progress=False)
    with pytest.raises(CatalogError, match="uid 65534"):  # a mount's scan, a profile's sample too
        open_store(src, bob / "stores" / "mount" / "ds").mount_catalog(rescan=False)
    with pytest.raises(OSError, match="uid 65534"):
        DiskLevel(StoreReader(os.fsencode(src), tmp_path / "none"), bob / "stores" / "cache",
                  NextEpochCache(0, 10**6, 10, max_id=10))
    assert list(target.iterdir()) == []


def test_a_store_directory_others_may_write_gets_no_catalog_and_gives_none(tmp_path: Path) -> None:
    """Whoever may make names in the store directory could put a link at the name of the catalog in the making
    (or of SQLite's journal) once they see it, and root would write where it pointed; and a catalog there is
    anyone's word. Prepare, a mount's scan and its reuse of a catalog, and verify all refuse such a store, naming
    the fix, the sticky bit included (it keeps others from renaming root's entries, not from making new ones)."""
    src = make_sample(tmp_path / "data", count=2, width=64, height=32, seed=4)
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o777)
    with pytest.raises(CatalogError, match=f"{re.escape(str(store))}: group or others may write it.*chmod go-w"):
        prepare(src, store, 1.0, progress=False)
    assert not list(store.iterdir())  # not even prepare's lock
    with pytest.raises(CatalogError, match="group or others may write it"):
        LocalStore.given(src, store).mount_catalog(rescan=False, progress=False)
    assert not list(store.iterdir())
    store.chmod(0o700)
    prepare(src, store, 1.0, progress=False)
    for mode in (0o775, 0o1777):  # a fresh catalog is not taken either: others may have put it there
        store.chmod(mode)
        with pytest.raises(CatalogError, match="group or others may write it"):
            LocalStore.given(src, store).mount_catalog(rescan=False, progress=False)
        with pytest.raises(CatalogError, match="group or others may write it"):
            verify(store, progress=False)
    store.chmod(0o700)
    assert LocalStore.given(src, store).mount_catalog(rescan=True, progress=False) == store


@pytest.mark.needs_root("a chown of the store to another user")
def test_a_store_another_user_owns_is_read_by_root_and_never_written(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Its owner may make names in it that root would write through: root's mount takes its fresh catalog, uses
    one only behind the source as it stands, and refuses to scan it (a --rescan, a catalog to scan again);
    root's prepare stops before its lock is made there. Its owner writes it."""
    src = make_sample(tmp_path / "data", count=2, width=64, height=32, seed=4)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    with sqlite3.connect(store / CATALOG_NAME) as db:  # its owner's choice: SQLite would make files beside it
        db.execute("PRAGMA journal_mode=WAL")
    os.chown(store, NOBODY, NOBODY)
    named = f"{re.escape(str(store))}: owned by uid {NOBODY}.*run this as that user"
    listed = sorted(p.name for p in store.iterdir())
    assert LocalStore.given(src, store).mount_catalog(rescan=False, progress=False) == store
    assert sorted(p.name for p in store.iterdir()) == listed  # read as it is: no WAL's files made there
    assert verify(store, progress=False) == [] and sorted(p.name for p in store.iterdir()) == listed
    journal = store / f"{CATALOG_NAME}-journal"  # a write of its owner's left beside it: rows never committed
    journal.write_bytes(b"\xd9\xd5\x05\xf9\x20\xa1\x63\xd7" + bytes(504))
    with pytest.raises(CatalogError, match="a write of its owner's is left beside it"):
        LocalStore.given(src, store).mount_catalog(rescan=False, progress=False)
    with pytest.raises(CatalogError, match="a write of its owner's is left beside it"):  # as the daemon opens it
        Catalog.open(store, readonly=True, immutable=True)
    journal.unlink()
    with pytest.raises(CatalogError, match=named):
        LocalStore.given(src, store).mount_catalog(rescan=True, progress=False)
    (src / "new.txt").write_bytes(b"x")  # the catalog behind the source
    with caplog.at_level(logging.WARNING):
        assert LocalStore.given(src, store).mount_catalog(rescan=False, progress=False) == store
    assert "behind the source and is used as it stands" in caplog.text
    catalog = Catalog.open(store, readonly=True)
    try:
        assert b"new.txt" not in [n.path for n in catalog.files()]
    finally:
        catalog.close()
    before = sorted(p.name for p in store.iterdir())
    with pytest.raises(CatalogError, match=named):
        prepare(src, store, 1.0, progress=False)
    assert sorted(p.name for p in store.iterdir()) == before
    os.chown(store, 0, 0)
    prepare(src, store, 1.0, progress=False)


def test_a_row_whose_version_a_catalog_writer_cleared_is_a_changed_file(prepared: tuple[Path, Path]) -> None:
    """Without the version (inode and ctime) only size and mtime would be compared, which ``touch -d`` puts back
    after a rewrite: the raw object of the old image would stay in service. Such a row serves the source."""
    src, store = prepared
    catalog, node = _first_raw(store)
    catalog.close()
    with sqlite3.connect(store / CATALOG_NAME) as db:
        db.execute("UPDATE nodes SET etag = NULL WHERE id = ?", (node.id,))
    content = _served(src, store)
    try:
        assert not content.raw and content.fallback == "source changed since prepare"
        assert bytes(content.data or b"") == (src / os.fsdecode(node.path)).read_bytes()
    finally:
        content.close()


def test_surplus_objects_are_deleted_only_once_the_catalog_in_place_names_none_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lowering the ratio deleted the objects no node serves any more before the catalog that drops them was put
    in place: a run killed between the two left mounts a catalog naming deleted objects. At each deletion, the
    catalog in place names none of the objects deleted."""
    src = make_sample(tmp_path / "src", count=8, width=64, height=32, seed=2)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    deleted: list[str] = []
    delete = LocalStore.delete

    def checked_delete(self: LocalStore, objs: list[str]) -> None:
        catalog = Catalog.open(store, readonly=True)
        try:
            named = {n.object for n in catalog.files() if n.served_raw}
        finally:
            catalog.close()
        assert not named & set(objs), "deleted while the catalog in place still names them"
        deleted.extend(objs)
        delete(self, objs)

    monkeypatch.setattr(LocalStore, "delete", checked_delete)
    report = prepare(src, store, 0.5, progress=False)
    assert report.deleted == 4 and len(deleted) == 4
    assert not any((store / obj).exists() for obj in deleted)


def test_the_catalog_copies_of_killed_prepares_are_removed_by_the_next(tmp_path: Path) -> None:
    """A prepare killed midway leaves its private copy of the catalog (as large as the catalog): only a scan's
    writer removed such copies, and the next prepare of an unchanged source scans nothing. A copy whose writer
    lives (its lock held) is left alone."""
    from liquidfs.sysio.locks import HeldLock

    src = make_sample(tmp_path / "src", count=4, width=64, height=32, seed=3)
    store = tmp_path / "store"
    prepare(src, store, 0.5, progress=False)
    dead = store / f"{CATALOG_NAME}.new-killed"
    dead.write_bytes(b"a copy" * 1000)
    (store / f"{CATALOG_NAME}.new-killed.lock").write_bytes(b"")
    live = store / f"{CATALOG_NAME}.new-running"
    live.write_bytes(b"a copy")
    held = HeldLock(Path(f"{live}.lock"))
    try:
        prepare(src, store, 1.0, progress=False)
        assert not dead.exists() and not (store / f"{CATALOG_NAME}.new-killed.lock").exists()
        assert live.exists()
    finally:
        held.release()


def _prepared_raw(tmp_path: Path, count: int, seed: int) -> tuple[Path, Path, Node, Path]:
    """A sample prepared whole: (source, store, one of its raw files' row, that file's source path)."""
    src = make_sample(tmp_path / "src", count=count, width=64, height=32, seed=seed)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    node = next(n for n in catalog.files() if n.served_raw)
    catalog.close()
    return src, store, node, src / os.fsdecode(node.path)


def test_an_image_rewritten_in_place_is_expanded_again_by_the_next_prepare(tmp_path: Path) -> None:
    """A write in place (its mtime put back, as `cp -p` or `rsync -t` does) changes nothing its directory shows:
    the catalog stayed fresh, the next prepare reused the row and the stale object of what the file held at the
    scan, and the mount served the original forever (its identity check refused the object). The next prepare
    refreshes the row and expands the image as it is now; the rest is reused."""
    import io

    from PIL import Image

    from liquidfs.expand import formats

    src, store, node, path = _prepared_raw(tmp_path, count=4, seed=4)
    folder = path.parent.stat().st_mtime_ns
    st = path.stat()
    other = io.BytesIO()
    Image.new("RGB", (64, 32), (200, 10, 30)).save(other, "PNG")
    with open(path, "r+b") as f:  # in place: the same inode
        f.truncate(0)
        f.write(other.getvalue())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.parent.stat().st_mtime_ns == folder  # nothing a scan's freshness check sees
    report = prepare(src, store, 1.0, progress=False)
    assert report.expanded == 1 and report.reused == 3
    catalog = Catalog.open(store, readonly=True)
    now = catalog.get(node.id)
    catalog.close()
    assert now is not None and now.served_raw and now.size == len(other.getvalue()) and now.etag != node.etag
    assert formats.same_pixels(path.read_bytes(), (store / str(now.object)).read_bytes())
    assert verify(store, progress=False) == []


@pytest.mark.parametrize("how", ["damaged", "copied"])
def test_an_object_changed_since_it_was_recorded_is_made_again_not_reused(tmp_path: Path, how: str) -> None:
    """Reuse asked only whether the name was there: an object with four bytes overwritten was reused by every
    later prepare (verify failing it, the mount falling back for good), and a store copied with `cp -a` (other
    inodes) kept stamps that vouch for none of its objects. Each is made again by a worker: the damaged one
    rewritten, the copy's adopted with a fresh stamp, so verify passes and a stat vouches again."""
    import shutil

    src = make_sample(tmp_path / "src", count=4, width=64, height=32, seed=6)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    if how == "copied":
        shutil.copytree(store, tmp_path / "copy", symlinks=True)
        shutil.rmtree(store)
        (tmp_path / "copy").rename(store)
    catalog = Catalog.open(store, readonly=True)
    node = next(n for n in catalog.files() if n.served_raw)
    catalog.close()
    if how == "damaged":
        with open(store / str(node.object), "r+b") as f:
            f.seek(200)
            f.write(b"\xff\x00\xff\x00")
        assert verify(store, progress=False) != []
    report = prepare(src, store, 1.0, progress=False)
    # (an object a worker finds holding exactly the expansion's bytes is adopted: counted reused, not written)
    assert (report.expanded, report.reused) == ((1, 3) if how == "damaged" else (0, 4))
    assert verify(store, progress=False) == []
    catalog = Catalog.open(store, readonly=True)
    reader = StoreReader(catalog.source, store)
    try:
        assert all(reader.object_sealed(n, os.stat(store / str(n.object))) for n in catalog.files() if n.served_raw)
    finally:
        reader.close()
        catalog.close()


def test_a_file_chmod_since_the_scan_has_its_mode_recorded_with_its_version(tmp_path: Path) -> None:
    """prepare refreshed a changed file's size, mtime and version, not its mode: after a chmod 600 the row's
    version matched the file as it is while it still showed the scan's 0644, and nothing said it changed."""
    src, store, node, path = _prepared_raw(tmp_path, count=3, seed=9)
    folder = path.parent.stat().st_mtime_ns
    path.chmod(0o600)
    assert path.parent.stat().st_mtime_ns == folder  # nothing a scan's freshness check sees
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    now = catalog.get(node.id)
    catalog.close()
    assert now is not None and stat.S_IMODE(now.mode) == 0o600


def test_verify_names_a_file_of_any_bytes_on_one_line_without_a_traceback(tmp_path: Path) -> None:
    """A name that is no UTF-8 made the line that names it raise UnicodeEncodeError on a strict stdout (the
    verify, or a mount made, ended in a traceback with status 1); control characters a writer put in a name
    reached the terminal as they are. Written on one line, its undecodable bytes and control characters as
    visible escapes."""
    import io
    import subprocess
    import sys

    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    name = b"bad\xff\x1b[31m.png"
    buffer = io.BytesIO()
    Image.new("RGB", (16, 8), (1, 2, 3)).save(buffer, "PNG")
    with open(os.fsencode(src) + b"/" + name, "wb") as f:
        f.write(buffer.getvalue())
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    obj = next((store / "objects").rglob("*.bmp"))
    data = bytearray(obj.read_bytes())
    data[-1] ^= 0xFF
    obj.write_bytes(bytes(data))
    result = subprocess.run([sys.executable, "-m", "liquidfs", "verify", "--store", str(store), "--no-progress"],
                            capture_output=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert result.returncode == 1, result.stderr
    assert b"Traceback" not in result.stderr and b"\x1b" not in result.stdout
    assert b"FAIL bad\\xff\\x1b[31m.png" in result.stdout, result.stdout  # both as visible escapes


def test_verify_decodes_only_the_formats_liquidfs_serves_and_rechecks_a_source_rewritten_while_read(
        prepared: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """verify (as root) read a source its writer may rewrite between the identity check and the read, then gave
    the bytes to Pillow with every plugin: an EPS reached Ghostscript. The source is checked again after its
    read, and only PNG, JPEG, BMP and JPEG 2000 are ever decoded."""
    from PIL import EpsImagePlugin

    from liquidfs.catalog.identity import checksum
    from liquidfs.expand import expansion
    from liquidfs.expand.expansion import judge, verify_one

    ran: list[object] = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ran.append(args))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\nshowpage\n"
    raw = (prepared[1] / str(_first_raw(prepared[1])[1].object)).read_bytes()
    assert str(judge(eps, raw, checksum(raw))).startswith("cannot decode") and ran == []

    src, store = prepared
    catalog, node = _first_raw(store)
    catalog.close()
    source = src / os.fsdecode(node.path)
    read_span = expansion.read_span

    def rewritten_meanwhile(fd: int, start: int, size: int) -> memoryview:
        data = read_span(fd, start, size)
        if os.fstat(fd).st_ino == os.stat(source).st_ino:
            with open(source, "r+b") as f:  # its writer, in place, the same size
                f.write(eps[:16])
        return data

    monkeypatch.setattr(expansion, "read_span", rewritten_meanwhile)
    why = verify_one(os.fsencode(src), node.path, str(store / str(node.object)), str(node.checksum), node.size,
                     node.mtime_ns, node.etag)
    assert why == "source changed since prepare (it is served as the original)"


def test_a_pool_that_broke_while_prepare_looked_elsewhere_is_recovered_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies while the main thread records or looks at a file breaks the pool before any of its
    futures says so: the next submit raised BrokenProcessPool out of prepare (and verify) with a traceback, the
    run's work unpublished. Taken as a lost job: run again alone, the run goes on."""
    import concurrent.futures as cf
    from concurrent.futures.process import BrokenProcessPool

    src = make_sample(tmp_path / "data", count=6, width=64, height=32, seed=5)
    submit = cf.ProcessPoolExecutor.submit
    calls = [0]

    def breaks_once(self: cf.ProcessPoolExecutor, *args: object, **kwargs: object) -> cf.Future[object]:
        calls[0] += 1
        if calls[0] == 3:
            raise BrokenProcessPool("A child process terminated abruptly, the process pool is not usable anymore")
        return submit(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cf.ProcessPoolExecutor, "submit", breaks_once)
    report = prepare(src, tmp_path / "store", 1.0, progress=False, jobs=2)
    assert report.expanded == 6 and not report.skipped
    calls[0] = 0
    assert verify(tmp_path / "store", progress=False) == []


def test_a_check_short_of_memory_is_its_verdict_never_verifys_traceback(prepared: tuple[Path, Path],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from liquidfs.expand import expansion
    from liquidfs.expand.expansion import verify_one

    src, store = prepared
    catalog, node = _first_raw(store)
    catalog.close()

    def no_memory(*args: object) -> memoryview:
        raise MemoryError

    monkeypatch.setattr(expansion, "read_span", no_memory)  # ulimit -v, no overcommit: a 400 MB object's copy
    why = verify_one(os.fsencode(src), node.path, str(store / str(node.object)), str(node.checksum), node.size,
                     node.mtime_ns, node.etag)
    assert why == "cannot check: not enough memory to read the source and the object"


def test_an_object_an_older_prepare_left_readable_by_all_is_adopted_as_this_run_writes_it(tmp_path: Path) -> None:
    """Objects were once written 0644: adopted byte for byte by a later run, they kept it, and a 0600 source's
    pixels stayed readable by anyone who may enter the store. Adopted, an object becomes 0600, another user's too
    (root's prepare of a store whose objects another user wrote: they kept their 0644)."""
    src = make_sample(tmp_path / "data", count=3, width=64, height=32, seed=6)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    objects = [p for p in (store / "objects").rglob("*") if p.is_file()]
    for obj in objects:
        obj.chmod(0o644)
    if os.geteuid() == 0:
        os.chown(objects[0], 65534, 65534)
    (store / CATALOG_NAME).unlink()  # what it learnt lost (a run killed before it recorded them)
    report = prepare(src, store, 1.0, progress=False)
    assert report.reused == len(objects) and report.expanded == 0  # adopted, not written again
    assert {oct(obj.stat().st_mode & 0o777) for obj in objects} == {"0o600"}
    assert verify(store, progress=False) == []


def test_an_interrupted_prepare_keeps_what_it_learnt_for_the_next_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C or SIGTERM (`timeout`, a Job's deadline): the expansions made so far are published with the
    selection unchanged; thrown away, the next run made every one of them again."""
    src = make_sample(tmp_path / "data", count=4, width=64, height=32, seed=4)
    store = tmp_path / "store"

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Catalog, "select_raw", interrupted)  # every image expanded, the selection not yet made
        with pytest.raises(KeyboardInterrupt):
            prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    assert not any(n.served_raw for n in catalog.files())  # the selection as it was: none raw
    catalog.close()
    jobs: list[object] = []
    job = LocalStore.expansion_job
    monkeypatch.setattr(LocalStore, "expansion_job", lambda self, *a: jobs.append(a) or job(self, *a))
    again = prepare(src, store, 1.0, progress=False)
    assert again.reused == 4 and jobs == []  # known: not one image decoded again (adopting one decodes it)
    assert not list(store.glob(f"{CATALOG_NAME}.new-*"))  # no copy left behind
    from liquidfs import prepare as prepare_module

    monkeypatch.setattr(prepare_module, "_delete_surplus", interrupted)  # after its publish: published once
    with pytest.raises(KeyboardInterrupt):
        prepare(src, store, 0.5, progress=False)
    catalog = Catalog.open(store, readonly=True)
    assert sum(n.served_raw for n in catalog.files()) == 2
    catalog.close()


def test_a_catalog_write_that_fails_keeps_what_was_committed_before_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under the catalog ("disk I/O error") at the selection's write: the run's record was thrown
    away with it (1473 objects on disk, none in the catalog), and the next run made every one again."""
    src = make_sample(tmp_path / "data", count=4, width=64, height=32, seed=4)
    store = tmp_path / "store"

    def disk_full(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    with monkeypatch.context() as patched:
        patched.setattr(Catalog, "select_raw", disk_full)
        with pytest.raises(sqlite3.OperationalError):
            prepare(src, store, 1.0, progress=False)
    jobs: list[object] = []
    job = LocalStore.expansion_job
    monkeypatch.setattr(LocalStore, "expansion_job", lambda self, *a: jobs.append(a) or job(self, *a))
    again = prepare(src, store, 1.0, progress=False)
    assert again.reused == 4 and jobs == []  # known: not one decoded again (adopting one decodes it)


def test_a_publish_that_failed_is_not_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The objects' sync failing (EIO: a writeback error) failed the publish, and the failure's handler published
    again, where a second fsync says 0: the catalog was published after its objects failed to reach the disk."""
    from liquidfs.stores.local import store as store_module

    src = make_sample(tmp_path / "data", count=3, width=64, height=32, seed=3)
    store = tmp_path / "store"
    synced: list[int] = []

    def writeback_error(self: object) -> None:
        synced.append(1)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store_module.LocalStore, "_objects_durable", writeback_error)
    with pytest.raises(OSError, match="Input/output error"):
        prepare(src, store, 1.0, progress=False)
    assert synced == [1]
    catalog = Catalog.open(store, readonly=True)
    assert not any(n.served_raw for n in catalog.files())  # the catalog in place is the one from before
    catalog.close()


def test_an_interrupt_records_the_results_it_had_not_recorded_yet(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Results are recorded once a second: an interrupt (Ctrl-C, SIGTERM) lost those of the last second, and
    those of the jobs the pool's shutdown let finish; the next run decoded and encoded them again."""
    from liquidfs import prepare as prepare_module

    src = make_sample(tmp_path / "data", count=6, width=64, height=32, seed=5)
    store = tmp_path / "store"
    settled = prepare_module._settled
    calls: list[int] = []

    def interrupted_at_the_second(in_flight: dict) -> tuple:  # type: ignore[type-arg]
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return settled(in_flight)

    with monkeypatch.context() as patched:
        patched.setattr(prepare_module, "_settled", interrupted_at_the_second)
        with pytest.raises(KeyboardInterrupt):
            prepare(src, store, 1.0, jobs=1, progress=False)
    jobs: list[object] = []
    job = LocalStore.expansion_job
    monkeypatch.setattr(LocalStore, "expansion_job", lambda self, *a: jobs.append(a) or job(self, *a))
    again = prepare(src, store, 1.0, progress=False)
    assert len(jobs) <= 6 - 2  # the first result and those in flight: not decoded again


def test_surplus_objects_are_deleted_in_batches_a_progress_bar_counts(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A lower ratio that drops a million objects took minutes (on NFS, from a bucket) with nothing shown after
    the expansion bar: the deletion is shown as it goes, batch by batch."""
    from liquidfs import prepare as prepare_module

    src = make_sample(tmp_path / "data", count=5, width=64, height=32, seed=7)
    store = tmp_path / "store"
    prepare(src, store, 1.0, progress=False)
    monkeypatch.setattr(prepare_module, "_DELETED_AT_ONCE", 2)
    shown: dict[str, list[int]] = {}
    real = prepare_module.Progress

    class Counted(real):  # type: ignore[misc, valid-type]
        def __init__(self, desc: str, *args: object, **kwargs: object) -> None:
            super().__init__(desc, *args, **kwargs)  # type: ignore[arg-type]
            self.counts = shown.setdefault(desc, [])

        def update(self, n: int) -> None:
            self.counts.append(n)
            super().update(n)

    monkeypatch.setattr(prepare_module, "Progress", Counted)
    report = prepare(src, store, 0.0, progress=True)
    assert report.deleted == 5 and not list((store / "objects").rglob("*.bmp"))
    assert shown["deleting surplus objects"] == [2, 2, 1]


def test_the_objects_directories_are_synced_before_the_catalog_naming_them_is_published(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each object was fsynced before its rename, never the rename itself (its directory's): after a power cut a
    published catalog could name an object that never reached the disk."""
    from liquidfs.stores.local import store as store_module

    src = make_sample(tmp_path / "data", count=6, width=64, height=32, seed=8)
    store = tmp_path / "store"
    synced: list[str] = []
    real_fsync = os.fsync

    def recorded(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(store_module.os, "fsync", recorded)
    prepare(src, store, 1.0, progress=False)
    subdirs = {str(sub) for sub in (store / "objects").iterdir()}
    assert subdirs and subdirs <= set(synced) and str(store / "objects") in synced


def test_a_terabyte_named_png_leaves_prepare_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse file of a terabyte named *.png (it costs whoever writes the dataset nothing): planned for as the
    largest image, it cut the run to one worker. Planned for are the images; it is refused, the rest expanded."""
    from liquidfs.expand import workers

    src = make_sample(tmp_path / "data", count=3, width=64, height=32, seed=8)
    with open(src / "huge.png", "wb") as f:
        f.truncate(1 << 40)
    planned: list[int] = []
    real = workers.plan_workers

    def seen(*args, **kwargs):  # type: ignore[no-untyped-def]
        planned.append(kwargs["largest_source"])
        return real(*args, **kwargs)

    monkeypatch.setattr(workers, "plan_workers", seen)
    report = prepare(src, tmp_path / "store", 1.0, progress=False, jobs=2)
    assert planned and max(planned) < 1 << 30
    assert report.expanded == 3 and sum(report.skipped.values()) == 1, report


def test_a_source_root_replaced_while_prepare_runs_stops_it(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare's workers reach the source's root by its path, for every image: a parent renamed meanwhile (by
    whoever may write it) and another tree put at the path had them read that tree's files as the catalog's (its
    owner may fake every identity the catalog checks through a FUSE mount of theirs), or refuse each image and
    publish a smaller selection. The root must be the directory the run holds open: the run stops, and says so."""
    import shutil

    parent = tmp_path / "datasets"
    src = make_sample(parent / "data", count=4, width=64, height=32, seed=8)
    store = tmp_path / "store"
    job = LocalStore.expansion_job
    swapped: list[bool] = []

    def swap_then_job(self: LocalStore, *args: object) -> object:
        if not swapped:
            parent.rename(tmp_path / "datasets-old")
            shutil.copytree(tmp_path / "datasets-old", parent)  # the same names, sizes and times: another tree
            swapped.append(True)
        return job(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalStore, "expansion_job", swap_then_job)
    with pytest.raises(PrepareError, match="not the directory this run began with"):
        prepare(src, store, 1.0, progress=False)
    assert swapped
