"""Building a catalog (``catalog.build``): from a local tree and from an object store's listing, what it keeps of expansions across
rebuilds, and the writers of a catalog in the making."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from catalogs import written

from liquidfs.catalog import build as build_module
from liquidfs.catalog.build import (OBJECT_FILE_MODE, WorkingCopy, _Writer, build, build_from_objects,
                                    open_or_build)
from liquidfs.catalog.catalog import CATALOG_NAME, Catalog, CatalogError
from liquidfs.catalog.identity import file_version, same_version
from liquidfs.catalog.nodes import KIND_DIR, KIND_FILE, KIND_SYMLINK, REPR_ORIGINAL, ROOT_ID
from liquidfs.catalog.scan import Warmer
from liquidfs.catalog.sink import ProcessSink


def _tree(cat: Catalog) -> dict[bytes, tuple[int, int, int | None]]:
    rows = cat.db.execute("SELECT path, kind, size, nsubdirs, etag FROM nodes").fetchall()
    return {path: (kind, size, nsubdirs, etag) for path, kind, size, nsubdirs, etag in rows}


def test_catalog_from_a_listing(tmp_path: Path) -> None:
    listing = [
        ("train/aachen/a.png", 10, '"e1"', 1_000),
        ("train/aachen/b.png", 20, '"e2"', 3_000),
        ("train/bochum/c.png", 30, '"e3"', 2_000),
        ("empty-folder/", 0, '"d"', 500),          # a console's folder marker: an empty directory
        ("README.txt", 5, '"e4"', 100),
        ("bad//double-slash", 1, '"x"', 1),          # an empty component: cannot be a path
        ("bad/../escape", 1, '"x"', 1),
        ("README.txt/child", 1, '"x"', 1),           # below a file of the same name
        ("train", 1, '"x"', 1),                      # a file named like a directory
        ("negative.png", -5, '"x"', 1),              # a size no file has (an endpoint's answer, not taken as is)
        ("x" * 256 + "/", 0, '"d"', 1),              # a marker whose name no directory entry can have
        (".__liquidfs__", 3, '"x"', 1),              # the mount's control file's name: it answers that itself
        (".__liquidfs__/stats", 3, '"x"', 1),
        (".__liquidfs__/", 0, '"d"', 1),
        ("train/.__liquidfs__", 6, '"e5"', 1),       # below the root, a name like any other
    ]
    report = build_from_objects(iter(listing), tmp_path, "s3://b/cs")
    assert (report.files, report.ignored) == (5, 9)
    cat = Catalog.open(tmp_path)
    try:
        tree = _tree(cat)
        assert tree[b""][0] == KIND_DIR and tree[b""][2] == 2  # train and empty-folder; nothing made for bad keys
        assert tree[b"train"][:3] == (KIND_DIR, 0, 2)
        assert tree[b"train/aachen/b.png"] == (KIND_FILE, 20, 0, '"e2"')
        assert tree[b"empty-folder"][0] == KIND_DIR
        assert b"bad/../escape" not in tree and b"README.txt/child" not in tree
        assert b"negative.png" not in tree and b"x" * 256 not in tree
        assert not [p for p in tree if p.startswith(b".__liquidfs__")] and b"train/.__liquidfs__" in tree
        aachen = cat.lookup(cat.lookup(ROOT_ID, b"train").id, b"aachen")  # type: ignore[union-attr]
        assert aachen is not None and aachen.mtime_ns == 3_000  # a directory is as new as its newest object
        assert cat.meta("source") == "s3://b/cs" and cat.meta("source_kind") == "s3"
        assert cat.lookup(aachen.id, b"a.png").mode == OBJECT_FILE_MODE  # type: ignore[union-attr]
    finally:
        cat.close()


def test_expansions_follow_the_etag(tmp_path: Path) -> None:
    """A rebuilt listing keeps an image raw only while its object has the ETag prepare expanded."""
    build_from_objects(iter([("a.png", 10, '"e1"', 1), ("b.png", 10, '"e2"', 1)]), tmp_path, "s3://b/x")
    cat = Catalog.open(tmp_path)
    cat.db.execute("INSERT INTO expansions VALUES (?,?,?,?,?,?,?,?,?,?)", (b"a.png", 10, 1, "png", "o/a", 99, "c", None, '"e1"', None))
    cat.db.execute("INSERT INTO expansions VALUES (?,?,?,?,?,?,?,?,?,?)", (b"b.png", 10, 1, "png", "o/b", 99, "c", None, '"e2"', None))
    cat.db.execute("UPDATE nodes SET repr=1, served_size=99, object='o/'||substr(name,1,1), checksum='c' WHERE kind=0")
    cat.close()
    # b.png was overwritten with content of the same size (and the same second): only its ETag tells.
    build_from_objects(iter([("a.png", 10, '"e1"', 1), ("b.png", 10, '"e9"', 1)]), tmp_path, "s3://b/x")
    cat = Catalog.open(tmp_path)
    try:
        served = dict(cat.db.execute("SELECT name, repr FROM nodes WHERE kind=0").fetchall())
        assert served == {b"a.png": 1, b"b.png": 0}
    finally:
        cat.close()


def test_two_catalog_writers_on_one_store_in_one_pid_never_swap_each_others_work(tmp_path: Path) -> None:
    """Two prepares in different PID namespaces can have the same PID: their catalogs in the making used to be
    one file (``catalog.sqlite.new-<pid>``), so the second deleted the first's and the first renamed the
    second's half-written catalog into place."""
    store = tmp_path / "store"
    first, second = _Writer(store), _Writer(store)
    assert first.tmp != second.tmp
    first.finish({"writer": "first"})
    assert Catalog.open(store, readonly=True).meta("writer") == "first"
    second.finish({"writer": "second"})
    catalog = Catalog.open(store, readonly=True)
    assert catalog.meta("writer") == "second"
    catalog.close()
    assert sorted(p.name for p in store.iterdir()) == ["catalog.sqlite"]  # no lock or work file left


def test_an_abandoned_catalog_in_the_making_is_removed_a_live_one_is_not(tmp_path: Path) -> None:
    store = tmp_path / "store"
    alive = _Writer(store)
    alive.flush(last=True)  # its catalog file is made at the first flush
    dead = _Writer(store)
    dead.flush(last=True)
    assert dead.sink is not None
    dead.sink.abort()
    dead.lock.release(remove=False)  # as if its process died: the lock file stays, nobody holds it
    _Writer(store).finish({})
    names = {p.name for p in store.iterdir()}
    assert alive.tmp.name in names and dead.tmp.name not in names
    alive.finish({})


def test_what_a_prepare_that_died_learnt_is_taken_over_by_the_next_writer(tmp_path: Path) -> None:
    """A prepare killed outright (SIGKILL, the OOM killer, a power cut) recorded what it learnt in its working
    copy alone, which the next writer deleted: every image it expanded was decoded again to adopt its object.
    The next working copy, and the next scan's catalog, take over its expansions before the copy goes."""
    from liquidfs.catalog.nodes import ExpansionRow

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(b"x")
    store = tmp_path / "store"
    open_or_build(src, store).close()
    learnt = ExpansionRow(1, 1, "png", "objects/ab/" + "a" * 32 + ".bmp", 9, "c" * 64, None, "v", "s")

    def a_prepare_dies() -> None:
        dying = WorkingCopy(store)
        dying.catalog.record_expansions([(b"a.png", learnt)])
        dying.catalog.close()
        dying.lock.release(remove=False)  # killed: its copy and lock file stay, nobody holds the lock

    def dead_copies(*mine: Path) -> list[Path]:
        return [p for p in store.iterdir() if p.name.startswith("catalog.sqlite.new-")
                and not any(p.name.startswith(m.name) for m in mine)]

    a_prepare_dies()
    copy = WorkingCopy(store)
    assert copy.catalog.expansions()[b"a.png"] == learnt
    copy.discard()  # a prepare that fails before it publishes: the dead copy stays for the next
    assert dead_copies()
    copy = WorkingCopy(store)
    assert copy.catalog.expansions()[b"a.png"] == learnt and dead_copies(copy.path)
    copy.publish()
    assert not dead_copies() and Catalog.open(store, readonly=True).expansions()[b"a.png"] == learnt
    a_prepare_dies()
    build(src, store)  # a mount's rescan before the next prepare
    catalog = Catalog.open(store, readonly=True)
    assert catalog.expansions()[b"a.png"] == learnt
    catalog.close()
    assert sorted(p.name for p in store.iterdir()) == ["catalog.sqlite"]


def test_a_dead_runs_copy_that_cannot_be_taken_over_for_want_of_room_is_kept(tmp_path: Path) -> None:
    """A copy whose rows cannot be merged for want of room (a full disk) is kept for the next writer, the
    failure raised: it is the only record of what that run learnt. One that is no database is passed over."""
    from liquidfs.catalog.build import _rescue_expansions
    from liquidfs.catalog.nodes import ExpansionRow

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(b"x")
    store = tmp_path / "store"
    open_or_build(src, store).close()
    dying = WorkingCopy(store)
    dying.catalog.record_expansions([(b"%d.png" % i, ExpansionRow(1, 1, "png", "o/%d" % i + "x" * 3000, 9,
                                                                  "c" * 64, None, "v", "s")) for i in range(400)])
    dying.catalog.close()
    dying.lock.release(remove=False)
    garbage = store / "catalog.sqlite.new-garbage"
    garbage.write_bytes(b"not a database" * 100)
    db = sqlite3.connect(store / CATALOG_NAME, isolation_level=None)
    try:
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count={pages}")  # full: no page more
        with pytest.raises(sqlite3.OperationalError, match="full"):
            _rescue_expansions(db, [dying.path])
        assert _rescue_expansions(db, [garbage]) == [garbage]  # passed over, to be removed
    finally:
        db.close()
    assert dying.path.exists()


@pytest.mark.needs_root("a chown of the store to another user")
def test_a_working_copy_touches_nothing_in_a_store_it_may_not_write(tmp_path: Path) -> None:
    """Another user's store (theirs to make names in): refused before any of its lock files is opened or any
    leftover unlinked, as a build refuses it."""
    store = tmp_path / "store"
    dead = _Writer(store)
    dead.finish({})  # a catalog to copy
    dead = _Writer(store)
    dead.flush(last=True)
    assert dead.sink is not None
    dead.sink.abort()
    dead.lock.release(remove=False)  # a killed writer's leftovers
    before = sorted(p.name for p in store.iterdir())
    os.chown(store, 65534, 65534)
    with pytest.raises(CatalogError, match="owned by uid 65534"):
        WorkingCopy(store)
    assert sorted(p.name for p in store.iterdir()) == before


def _walked(root: Path) -> list[tuple[object, ...]]:
    """The rows a local tree's catalog holds, by the walk every build so far has made: ids depth first, the last
    directory pushed listed first, each directory's entries by name; one lstat per entry (a symlink's target read
    after it), entries that fail it or are neither file, directory nor symlink left out without an id."""
    top = os.stat(root)
    rows: list[tuple[object, ...]] = []
    directories = {ROOT_ID: [ROOT_ID, ROOT_ID, b"", b"", KIND_DIR, top.st_mode, top.st_size, top.st_mtime_ns, 0,
                             file_version(top)]}
    stack, next_id = [(ROOT_ID, os.fsencode(root), b"")], ROOT_ID + 1
    while stack:
        parent, path, rel_dir = stack.pop()
        try:
            names = sorted(entry.name for entry in os.scandir(path))
        except OSError:
            names = []
        for name in names:
            rel, full = (rel_dir + b"/" + name if rel_dir else name), os.path.join(path, name)
            try:
                st = os.lstat(full)
                target = os.readlink(full) if stat.S_ISLNK(st.st_mode) else None
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                directories[parent][8] += 1
                directories[next_id] = [next_id, parent, name, rel, KIND_DIR, st.st_mode, st.st_size, st.st_mtime_ns, 0,
                                        file_version(st)]
                stack.append((next_id, full, rel))
            elif stat.S_ISREG(st.st_mode):
                rows.append((next_id, parent, name, rel, KIND_FILE, st.st_mode, st.st_size, st.st_mtime_ns, 0, None,
                             REPR_ORIGINAL, None, None, None, file_version(st), None))
            elif target is not None:
                rows.append((next_id, parent, name, rel, KIND_SYMLINK, st.st_mode, len(target), st.st_mtime_ns, 0,
                             target, REPR_ORIGINAL, None, None, None, None, None))
            else:
                continue
            next_id += 1
    rows += [(*row[:9], None, REPR_ORIGINAL, None, None, None, row[9], None) for row in directories.values()]
    return sorted(rows, key=lambda row: row[0])  # type: ignore[arg-type, return-value]


def _odd_tree(src: Path) -> None:
    """Files, nested directories, symlinks, names no UTF-8 decodes or holding a newline, a fifo, sizes and modes
    of every kind; enough entries for the helper that reads ahead to start (``START_AFTER`` lowered)."""
    src.mkdir()
    (src / "a.png").write_bytes(b"x" * 10)
    os.chmod(src / "a.png", 0o640)
    for d in ("train/aachen", "train/bochum/deep/er", "val", "empty"):
        (src / d).mkdir(parents=True)
    for i in range(40):
        (src / "train" / "aachen" / f"{i:03d}.png").write_bytes(b"y" * i)
    (src / "train" / "bochum" / "deep" / "er" / "z").write_bytes(b"")
    os.utime(src / "train" / "bochum" / "deep" / "er" / "z", ns=(1, 123_456_789_012))
    os.symlink("../a.png", src / "val" / "link")
    os.symlink("/nowhere/at/all", src / "val" / "dangling")
    os.mkfifo(src / "val" / "fifo")
    (src / os.fsdecode(b"not-utf8-\xff\xfe")).write_bytes(b"odd")
    (src / "new\nline").write_bytes(b"nl")
    os.mkdir(src / os.fsdecode(b"dir-\xe9"))
    (src / os.fsdecode(b"dir-\xe9") / "inner").write_bytes(b"in")


@pytest.mark.parametrize("ahead", [True, False], ids=["read-ahead", "alone"])
@pytest.mark.parametrize("writer", ["small", "helper", "one-core"])
def test_a_local_tree_is_recorded_as_the_walk_always_recorded_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 ahead: bool, writer: str,
                                                                 helpers: list[ProcessSink]) -> None:
    """Every row (ids, kinds, sizes, modes, mtimes, targets, file versions) as the plain walk gives it, whether the
    helper reading inodes ahead runs (its threshold lowered to nothing) or not, and wherever the rows are written:
    a small build in its own process, a large one (batches lowered to 8 rows) in a helper process where two cores
    are the build's, in its own process where one is."""
    src = tmp_path / "src"
    _odd_tree(src)
    monkeypatch.setattr(build_module, "START_AFTER", 0 if ahead else 10**9)
    if writer != "small":
        monkeypatch.setattr(build_module, "_BATCH", 8)
        monkeypatch.setattr(build_module, "usable_cores", lambda: 2 if writer == "helper" else 1)
    report = build(src, tmp_path / "store")
    assert len(helpers) == (writer == "helper")
    assert all(h._process.returncode == 0 for h in helpers)
    rows = written(tmp_path / "store").nodes
    if writer != "small":  # the listings and meta as a small build writes them, chunk for chunk
        monkeypatch.undo()
        monkeypatch.setattr(build_module, "START_AFTER", 10**9)
        build(src, tmp_path / "small")
        assert written(tmp_path / "store")[1:] == written(tmp_path / "small")[1:]
    assert rows == _walked(src)
    paths = {row[3] for row in rows}
    assert {b"not-utf8-\xff\xfe", b"new\nline", b"dir-\xe9/inner", b"train/bochum/deep/er/z", b"val/link"} <= paths
    assert b"val/fifo" not in paths
    assert (report.files, report.symlinks, report.directories, report.ignored) == (45, 2, 8, 1)


def test_what_changes_during_the_scan_is_recorded_as_the_lstat_saw_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry deleted between the listing and its lstat is left out (no id spent on it), one replaced is recorded
    as what replaced it, a directory that cannot be listed is shown empty: as the plain walk records them."""
    src = tmp_path / "src"
    _odd_tree(src)
    listing = os.scandir
    changed: list[bytes] = []

    class _Changing:
        """A listing after which the tree changes, before any entry of it is stat-ed."""

        def __init__(self, where: int | bytes | str) -> None:
            # The build lists the directory it opened, the plain walk (``_walked``) by path
            path = os.readlink(f"/proc/self/fd/{where}".encode()) if isinstance(where, int) else where
            if not isinstance(path, bytes):  # neither's (the store's own files)
                self.entries = list(listing(where))
                return
            if path.endswith(b"/val"):
                raise PermissionError(13, "Permission denied", path)
            self.entries = list(listing(where))
            if path.endswith(b"/aachen") and not changed:
                changed.append(path)
                os.unlink(os.path.join(path, b"001.png"))
                replacement = os.path.join(path, b"new")
                Path(os.fsdecode(replacement)).write_bytes(b"replaced, longer")
                os.replace(replacement, os.path.join(path, b"002.png"))

        def __enter__(self) -> _Changing:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def __iter__(self) -> Iterator[os.DirEntry[str] | os.DirEntry[bytes]]:
            return iter(self.entries)

    monkeypatch.setattr(build_module, "START_AFTER", 10**9)
    monkeypatch.setattr(os, "scandir", _Changing)
    build(src, tmp_path / "store")
    rows = {row[3]: row for row in written(tmp_path / "store").nodes}
    assert b"train/aachen/001.png" not in rows
    assert rows[b"train/aachen/002.png"][6] == len(b"replaced, longer")
    assert rows[b"val"][8] == 0 and not any(path.startswith(b"val/") for path in rows)
    # The plain walk of the changed tree, val unlisted; aachen's mtime is the one it had when it was stat-ed, before
    # the change.
    assert changed and rows[b"train/aachen"][7] < os.stat(src / "train" / "aachen").st_mtime_ns
    masked = {b"train/aachen"}
    assert [row for row in sorted(rows.values()) if row[3] not in masked] == \
        [row for row in _walked(src) if row[3] not in masked]


@pytest.mark.parametrize("swap", ["link", "directory"])
def test_a_directory_swapped_while_the_source_is_scanned_is_never_listed_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str) -> None:
    """The source's owner swaps a directory, once its parent was listed, for a link to a directory of root's (or
    for such a directory itself, moved in): the scan, as root, shows it empty and lists nothing of root's."""
    src, secret = tmp_path / "src", tmp_path / "root-only"
    (src / "train" / "x").mkdir(parents=True)
    (src / "train" / "x" / "img.png").write_bytes(b"png")
    secret.mkdir(mode=0o700)
    (secret / "id_rsa").write_bytes(b"key")
    opening = build_module.open_dir_below
    swapped: list[bytes] = []

    def swapped_first(dir_fd: int, rel: bytes, where: bytes) -> int:
        """``train/x`` swapped after its parent's listing and lstat, before the walk opens it."""
        if rel == b"train/x":
            swapped.append(rel)
            os.rename(src / "train" / "x", tmp_path / "x-away")
            if swap == "link":
                os.symlink(secret, src / "train" / "x")
            else:
                os.rename(secret, src / "train" / "x")
        return opening(dir_fd, rel, where)

    monkeypatch.setattr(build_module, "START_AFTER", 10**9)
    monkeypatch.setattr(build_module, "open_dir_below", swapped_first)
    build(src, tmp_path / "store")
    paths = {row[3]: row for row in written(tmp_path / "store").nodes}
    assert swapped  # the walk opened it, as it opens every directory
    assert not any(b"id_rsa" in path for path in paths), sorted(paths)
    assert b"train/x/img.png" not in paths and paths[b"train/x"][8] == 0  # shown empty


def test_the_helper_that_reads_ahead_is_gone_when_the_build_is_done(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Warmer(root) as warmer:
            warmer.start()
            warmer.expect([b"d", b"no/such/directory", b"../.."])
            process = warmer._process
            assert process is not None
    finally:
        os.close(root)
    assert process.poll() is not None


def test_the_helper_lists_directories_below_the_root_never_through_a_link(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory the build will list next, swapped for a link (to /root, or into a FUSE mount of its owner's that
    never answers) since its parent was listed: the helper, root, reaches it as the build does, a component at a
    time, and lists nothing through the link."""
    from liquidfs.catalog import scan

    (tmp_path / "src" / "a" / "b").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "src" / "a" / "c").symlink_to(tmp_path / "outside")
    listed: list[int] = []
    scandir = os.scandir

    def recording(fd):  # type: ignore[no-untyped-def]
        listed.append(os.fstat(fd).st_ino)
        return scandir(fd)

    monkeypatch.setattr(scan.os, "scandir", recording)
    root = os.open(tmp_path / "src", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel in (b"a/b", b"a/c", b"a/c/..", b"../outside"):
            scan._warm(root, os.fstat(root).st_dev, rel)
    finally:
        os.close(root)
    assert listed == [os.stat(tmp_path / "src" / "a" / "b").st_ino]


def test_a_source_that_is_no_directory_is_named_in_the_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match=f"^{tmp_path / 'file'} is not a directory$"):
        build(tmp_path / "file", tmp_path / "store")
    with pytest.raises(FileNotFoundError):
        build(tmp_path / "missing", tmp_path / "store")


@pytest.mark.parametrize("progress", [True, False])
def test_a_long_walk_shows_the_entries_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str], progress: bool) -> None:
    """A bar on stderr once the walk is long (both thresholds lowered to nothing here), counting every entry listed;
    none where the caller asks for none, nor for a tree walked before the threshold."""
    src = tmp_path / "src"
    _odd_tree(src)
    monkeypatch.setattr(build_module, "PROGRESS_DELAY", 0)
    build(src, tmp_path / "small", progress=progress)  # below START_AFTER: done before a bar would help
    assert "scanning" not in capsys.readouterr().err
    monkeypatch.setattr(build_module, "START_AFTER", 0)
    build(src, tmp_path / "store", progress=progress)
    said = capsys.readouterr().err
    listed = sum(len(os.listdir(d)) for d, _, _ in os.walk(src))  # every directory's entries, the fifo's too
    assert (f"scanning {src}: {listed} entries" in said) == progress, said


def test_a_directory_that_could_not_be_listed_is_listed_again_at_the_next_use(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing that failed (EIO, EMFILE: maybe passing) shows the directory empty, and its mtime did not change:
    the catalog says so, and its next use scans again rather than showing it empty for good."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.png").write_bytes(b"png")
    opening = build_module.open_dir_below

    def failing(dir_fd: int, rel: bytes, where: bytes) -> int:
        if rel == b"d":
            raise OSError(errno.EIO, "Input/output error", os.fsdecode(where) + "/d")
        return opening(dir_fd, rel, where)

    with monkeypatch.context() as patched:
        patched.setattr(build_module, "open_dir_below", failing)
        open_or_build(src, tmp_path / "store").close()
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    assert b"d/a.png" not in {row[3] for row in written(tmp_path / "store").nodes}
    assert catalog.meta("unlisted_directories") == "1" and not catalog.is_fresh()
    catalog.close()
    catalog = open_or_build(src, tmp_path / "store")  # no --rescan: the failure is reason enough
    assert catalog.is_fresh() and b"d/a.png" in {row[3] for row in written(tmp_path / "store").nodes}
    catalog.close()


def test_a_directory_that_can_never_be_listed_does_not_make_every_use_a_rescan(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Another filesystem mounted inside the source (EXDEV: the mount could not open its files), a directory
    root may not read (EACCES on a root-squashed NFS export): shown empty, and the catalog stays fresh; a scan of
    ten million files at every mount would be the cost of saying so again."""
    src = tmp_path / "src"
    for name in ("other-fs", "squashed"):
        (src / name).mkdir(parents=True)
        (src / name / "a.png").write_bytes(b"png")
    opening = build_module.open_dir_below
    refusals = {b"other-fs": errno.EXDEV, b"squashed": errno.EACCES}

    def refusing(dir_fd: int, rel: bytes, where: bytes) -> int:
        if rel in refusals:
            raise OSError(refusals[rel], os.strerror(refusals[rel]), os.fsdecode(where) + "/" + os.fsdecode(rel))
        return opening(dir_fd, rel, where)

    monkeypatch.setattr(build_module, "open_dir_below", refusing)
    catalog = open_or_build(src, tmp_path / "store")
    assert catalog.meta("unlisted_directories") == "0" and catalog.is_fresh()
    assert not any(row[3].endswith(b"a.png") for row in written(tmp_path / "store").nodes)
    catalog.close()


def test_a_catalog_holding_what_prepare_learnt_is_on_disk_before_its_rename(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash after the rename must not leave the catalog's name on pages never written: where it holds what
    prepare learnt (prepare's own, a rescan that carried it over), the file and then its directory are synced;
    a catalog of the tree alone is not waited for (scanned again in seconds)."""
    from liquidfs.prepare import prepare
    from sample import make_sample

    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    src, store = tmp_path / "data", tmp_path / "store"
    make_sample(src, count=2, width=32, height=16, seed=9)
    open_or_build(src, store).close()
    assert synced == []  # the tree alone
    prepare(src, store, 1.0, progress=False)
    assert ".new-" in synced[-2] and synced[-1] == str(store)  # the catalog in the making, then the rename
    synced.clear()
    open_or_build(src, store, rescan=True).close()  # carries prepare's state over
    assert len(synced) == 2 and ".new-" in synced[0] and synced[1] == str(store)


def _fresh_catalog(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "a.png").write_bytes(b"png")
    open_or_build(src, tmp_path / "store").close()
    return src, tmp_path / "store"


def test_a_directory_swapped_for_a_link_since_the_scan_is_a_change_never_followed(tmp_path: Path) -> None:
    """The freshness check stats the catalog's directories as the scan walked them: a link put in place of one (its
    target's mtime and the parent's put back as they were) is a change, never stat-ed through (a link into a FUSE
    mount that never answers would hang root's mount or prepare for good)."""
    src, store = _fresh_catalog(tmp_path)
    recorded = os.stat(src / "d" / "e").st_mtime_ns
    parent = os.stat(src / "d").st_mtime_ns
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (src / "d" / "e" / "a.png").unlink()
    (src / "d" / "e").rmdir()
    (src / "d" / "e").symlink_to(elsewhere)
    os.utime(elsewhere, ns=(recorded, recorded))
    os.utime(src / "d", ns=(parent, parent))
    catalog = Catalog.open(store, readonly=True)
    assert catalog.staleness() == "changed"
    catalog.close()


@pytest.mark.parametrize("path", [b"../src/d", b"/etc", b"d/../d", b"d\0x", "d"], ids=repr)
def test_a_directory_row_no_walk_below_the_root_takes_is_a_change(tmp_path: Path, path: object) -> None:
    """Whoever writes the store writes the rows: a directory's path that leaves the source root, holds a NUL or is
    no bytes is a change (a rescan), never a stat outside the source or a traceback. The row's mtime is the one
    a stat that followed the path would find: only a check that never goes there says "changed"."""
    from liquidfs.catalog.identity import file_version, stored_ns

    src, store = _fresh_catalog(tmp_path)
    catalog = Catalog.open(store)
    reached = os.path.join(os.fsencode(src), path) if isinstance(path, bytes) and b"\0" not in path else \
        os.path.join(src, path) if isinstance(path, str) else None
    st = os.stat(reached) if reached is not None else None
    mtime, version = (stored_ns(st.st_mtime_ns), file_version(st)) if st is not None else (None, None)
    with catalog.transaction():
        catalog.db.execute("UPDATE nodes SET path=?, mtime_ns=coalesce(?, mtime_ns), etag=coalesce(?, etag) "
                           "WHERE path=?", (path, mtime, version, b"d/e"))
    assert catalog.staleness() == "changed"
    catalog.close()


def test_a_catalog_that_names_no_source_is_refused_with_a_message(tmp_path: Path) -> None:
    src, store = _fresh_catalog(tmp_path)
    catalog = Catalog.open(store)
    with catalog.transaction():
        catalog.db.execute("DELETE FROM meta WHERE key='source'")
    catalog.close()
    with pytest.raises(CatalogError, match="names no source"):
        open_or_build(src, store)


@pytest.mark.parametrize("new_id", [1 << 40, 0, -5, (1 << 62) + 1], ids=str)
def test_a_row_whose_id_no_build_gives_is_refused_with_a_message(tmp_path: Path, new_id: int) -> None:
    """Ids index the mount's per-file arrays: one far past the rows' count (an array of terabytes to map), below the
    root's or at the control file's is a catalog no build wrote, refused at mount with a message."""
    _, store = _fresh_catalog(tmp_path)
    catalog = Catalog.open(store)
    with catalog.transaction():
        catalog.db.execute("UPDATE nodes SET id=? WHERE path=?", (new_id, b"d/e/a.png"))
    with pytest.raises(CatalogError, match="not numbered as a build numbers them"):
        catalog.file_totals()
    catalog.close()


@pytest.mark.parametrize("change", ["size='abc'", "size=2.5", "size=1<<62, id=id", "id='x'"])
def test_a_row_whose_size_or_id_no_build_writes_is_refused_with_a_message(tmp_path: Path, change: str) -> None:
    """A catalog someone else wrote: a text id, or a size that is text, a float or past any sum, made the mount's
    start a TypeError or an "integer overflow" traceback."""
    _, store = _fresh_catalog(tmp_path)
    catalog = Catalog.open(store)
    with catalog.transaction():
        if change == "id='x'":  # a table whose id takes any type, as someone else may define it
            catalog.db.execute("ALTER TABLE nodes RENAME TO typed")
            catalog.db.execute("CREATE TABLE nodes AS SELECT * FROM typed")
            catalog.db.execute("UPDATE nodes SET id='x' WHERE path=?", (b"d/e/a.png",))
        elif change == "size=1<<62, id=id":  # two of them: their sum overflows
            catalog.db.execute("UPDATE nodes SET size=1<<62 WHERE kind=0")
            catalog.db.execute("INSERT INTO nodes SELECT id + 1, parent, name || 'x', path || 'x', kind, mode, size,"
                               " mtime_ns, nsubdirs, target, repr, served_size, object, checksum, etag, object_stamp"
                               " FROM nodes WHERE kind=0")
        else:
            catalog.db.execute(f"UPDATE nodes SET {change} WHERE path=?", (b"d/e/a.png",))
    with pytest.raises(CatalogError, match="a damaged or foreign catalog"):
        catalog.file_totals()
    catalog.close()


def test_a_rescan_never_puts_one_sources_catalog_in_place_of_anothers(tmp_path: Path) -> None:
    """`mount B --store A's --rescan` is refused as a mount without it is: B's catalog in A's store would make a
    later prepare of B take A's objects for surplus and remove them. A catalog no one can read is scanned anew."""
    a, store = _fresh_catalog(tmp_path)
    b = tmp_path / "other"
    b.mkdir()
    with pytest.raises(CatalogError, match="describes"):
        open_or_build(b, store, rescan=True)
    catalog = Catalog.open(store)
    assert catalog.source == os.fsencode(a)
    with catalog.transaction():  # a newer liquidfs's catalog is not a damaged one: still A's
        catalog.db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    catalog.close()
    with pytest.raises(CatalogError, match="describes"):
        open_or_build(b, store, rescan=True)
    (store / "catalog.sqlite").write_bytes(b"")  # torn by a crash
    with pytest.raises(CatalogError, match="made again by `liquidfs mount --rescan`"):
        open_or_build(a, store)
    open_or_build(b, store, rescan=True).close()
    catalog = Catalog.open(store, readonly=True)
    assert catalog.source == os.fsencode(b)
    catalog.close()


@pytest.mark.parametrize("change", ["entry-added-mtime-put-back", "modes-changed"])
def test_a_directory_changed_with_its_mtime_put_back_is_a_change(tmp_path: Path, change: str) -> None:
    """A directory's version is its inode and ctime, as a file's: an entry added and the mtime put back (`touch
    -d`, a restore tool) or its modes changed (one the scan could not list, made readable since) is a change."""
    src, store = _fresh_catalog(tmp_path)
    directory = src / "d" / "e"
    st = os.stat(directory)
    if change == "modes-changed":
        os.chmod(directory, 0o700)
    else:
        (directory / "b.png").write_bytes(b"png")
    os.utime(directory, ns=(st.st_atime_ns, st.st_mtime_ns))
    catalog = Catalog.open(store, readonly=True)
    assert catalog.staleness() == "changed"
    catalog.close()


@contextlib.contextmanager
def _mounted(source: Path, store: Path, before: list[list[str]], since: list[str]) -> Iterator[set[bytes]]:
    """Each mount(8) argument list of ``before`` made, the catalog of ``source`` built into ``store``, its
    freshness checked (fresh), ``since`` mounted, and its freshness checked again (a change); the paths the
    catalog shows; every mount undone at the end, the last first."""
    made: list[str] = []
    try:
        for args in before:
            subprocess.run(["mount", *args], check=True)
            made.append(args[-1])
        open_or_build(source, store).close()
        catalog = Catalog.open(store, readonly=True)
        try:
            assert catalog.staleness() is None
            subprocess.run(["mount", *since], check=True)
            made.append(since[-1])
            assert catalog.staleness() == "changed"
        finally:
            catalog.close()
        yield {row[3] for row in written(store).nodes}
    finally:
        for point in reversed(made):
            subprocess.run(["umount", point], check=True)


TMPFS = ["-t", "tmpfs", "-o", "size=1m", "liquidfs-test"]


@pytest.mark.needs_root("mount(2) of a tmpfs inside the source")
def test_a_directory_another_filesystem_is_mounted_on_is_never_stat_ed(tmp_path: Path) -> None:
    """A user's FUSE mount on a directory of theirs in the source may never answer: neither the scan nor the
    freshness check stats it (nor anything below it). The scan leaves it out, and the catalog stays fresh while it
    is mounted; one mounted since the scan on a directory of the catalog is a change (scanned again: left out)."""
    src = tmp_path / "src"
    for name in ("inner", "later"):
        (src / name).mkdir(parents=True)
    (src / "a.png").write_bytes(b"png")
    with _mounted(src, tmp_path / "store", [[*TMPFS, str(src / "inner")]], [*TMPFS, str(src / "later")]) as shown:
        assert b"inner" not in shown and b"later" in shown and b"a.png" in shown


@pytest.mark.needs_root("mount(2) of a file over a file inside the source")
def test_a_file_another_file_is_mounted_on_is_left_out_and_one_mounted_since_is_a_change(tmp_path: Path) -> None:
    """A bind mount of a file over a file of the source (a mount point need not be a directory): a stat of it is
    the mounted file's, whatever filesystem serves it. Left out by the scan as a directory one is; one mounted
    on a file of the catalog since is a change."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (src / name).write_bytes(name.encode())
    other = str(tmp_path / "other")
    Path(other).write_bytes(b"another file")
    with _mounted(src, tmp_path / "store", [["--bind", other, str(src / "b.png")]],
                  ["--bind", other, str(src / "c.png")]) as shown:
        assert b"b.png" not in shown and {b"a.png", b"c.png"} <= shown, shown


def test_a_catalog_damaged_past_the_pages_its_open_reads_is_a_clear_error(tmp_path: Path) -> None:
    """A crash while a catalog was written can leave pages past the few its open reads damaged: the freshness
    check's query met them, and the mount or prepare ended in sqlite3's traceback. The same error as a damaged
    catalog's open, which says what makes it again."""
    src = tmp_path / "src"
    for d in range(30):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(30):
            (src / f"d{d}" / f"f{i}.bin").write_bytes(b"x")
    build(src, tmp_path / "store")
    path = tmp_path / "store" / "catalog.sqlite"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        for offset in range(size // 2, size, 4096):  # the later half's pages (the meta row is in the first)
            f.seek(offset + 100)
            f.write(b"\xa5" * 2000)
    with pytest.raises(CatalogError, match="damaged.*--rescan"):
        open_or_build(src, tmp_path / "store")


def test_a_source_whose_path_is_not_utf8_is_refused_before_the_walk_and_a_link_to_it_serves(tmp_path: Path) -> None:
    """The catalog names its source as text: a path of other bytes failed in sqlite3 (UnicodeEncodeError) after
    the whole walk. Refused at once, saying what works; names below the source may be any bytes."""
    source = os.fsencode(tmp_path) + b"/caf\xe9"
    os.makedirs(source + b"/d\xff")
    with open(source + b"/d\xff/a.bin", "wb") as f:
        f.write(b"x")
    with pytest.raises(CatalogError, match="not UTF-8"):
        build(os.fsdecode(source), tmp_path / "store")
    (tmp_path / "link").symlink_to(os.fsdecode(source))
    report = build(tmp_path / "link", tmp_path / "store")
    assert report.files == 1


def test_a_file_dated_past_2262_is_recorded_and_stays_fresh(tmp_path: Path) -> None:
    """Past SQLite's 64-bit integers (ext4 keeps dates to 2446; anyone who may write one file of the dataset can
    `touch -d 2400-01-01` it): every scan failed with an OverflowError. Recorded at the range's end, and every
    comparison takes the file's mtime so, so the catalog stays fresh and the file the same version."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.png").write_bytes(b"png")
    far = (1 << 63) + 10**18
    for path in (src / "d" / "a.png", src / "d"):
        os.utime(path, ns=(far, far))
    catalog = open_or_build(src, tmp_path / "store")
    try:
        node = catalog.lookup(catalog.lookup(ROOT_ID, b"d").id, b"a.png")  # type: ignore[union-attr]
        assert node is not None and node.mtime_ns == (1 << 63) - 1
        assert same_version(os.stat(src / "d" / "a.png"), node.size, node.mtime_ns, node.etag)
        assert catalog.is_fresh()
    finally:
        catalog.close()


def test_keys_no_entry_can_be_named_or_too_deep_for_recursion_are_left_out_or_built(tmp_path: Path) -> None:
    listing = [
        ("a/x\0y.png", 1, '"x"', 1),                  # libfuse cuts a name at a NUL: another entry's alias
        ("huge.png", 1 << 63, '"x"', 1),               # a size no file has
        ("deep/" * 1200 + "x.png", 3, '"d"', 1),       # a store that takes long keys: 1,200 directories
        ("late.png", 4, '"l"', (1 << 63) + 5),         # a LastModified past 2262
    ]
    report = build_from_objects(iter(listing), tmp_path, "s3://b/cs")
    assert (report.files, report.ignored, report.directories) == (2, 2, 1200)
    tree = _tree(catalog := Catalog.open(tmp_path))
    try:
        assert ("deep/" * 1200 + "x.png").encode() in tree and b"a/x\0y.png" not in tree and b"a" not in tree
        assert catalog.lookup(ROOT_ID, b"late.png").mtime_ns == (1 << 63) - 1  # type: ignore[union-attr]
    finally:
        catalog.close()


class _Listed:
    """``os.scandir`` of a directory as a listing that changed meanwhile returns it: ``a.png`` twice, and a name
    longer than NAME_MAX (a FUSE source may list one)."""

    def __init__(self, real: os.DirEntry[str], fake_name: str) -> None:
        self.real, self.name = real, fake_name

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        return self.real.stat(follow_symlinks=follow_symlinks)


def test_a_name_listed_twice_is_shown_once_and_scanned_again_as_is_an_entry_that_failed_for_now(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.png").write_bytes(b"png")
    (src / "e").mkdir()
    (src / "e" / "link").symlink_to("target")
    scandir = os.scandir

    @contextlib.contextmanager
    def changing(fd: int) -> Iterator[list[object]]:
        with scandir(fd) as found:
            entries: list[object] = list(found)
        for real in list(entries):
            if real.name == "a.png":  # type: ignore[attr-defined]
                entries += [real, _Listed(real, "n" * 256)]
        yield entries

    def failing(name: bytes, *, dir_fd: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")  # a flaky disk: may pass

    with monkeypatch.context() as patched:
        patched.setattr(build_module.os, "scandir", changing)
        patched.setattr(build_module.os, "readlink", failing)
        open_or_build(src, tmp_path / "store").close()
    rows = [row[3] for row in written(tmp_path / "store").nodes]
    assert rows.count(b"d/a.png") == 1 and b"e/link" not in rows and not any(len(r) > 255 for r in rows)
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    assert catalog.meta("unlisted_directories") == "2" and not catalog.is_fresh()
    catalog.close()
    catalog = open_or_build(src, tmp_path / "store")  # scanned again, as it stands now
    assert catalog.is_fresh() and b"e/link" in {row[3] for row in written(tmp_path / "store").nodes}
    catalog.close()


def test_a_full_disk_while_carrying_over_what_prepare_learnt_keeps_the_catalog_that_holds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a previous catalog that cannot be read is done without: a new one with no room for the expansions
    (SQLITE_FULL) put in place would drop what every prepare learnt, and the next prepare redo it all."""
    listing = [("a.png", 10, '"e1"', 1), ("b.png", 10, '"e2"', 1)]
    build_from_objects(iter(listing), tmp_path, "s3://b/x")
    cat = Catalog.open(tmp_path)
    cat.db.executemany("INSERT INTO expansions VALUES (?,?,?,?,?,?,?,?,?,?)",
                       [(f"{i}.png".encode(), 10, 1, "png", f"o/{i}" + "x" * 3000, 99, "c", None, f'"e{i}"', None)
                        for i in range(400)])
    cat.close()
    carry = build_module._carry_over_expansions

    def full(db: sqlite3.Connection, previous: Path) -> bool:
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count={pages}")  # the disk is full: no page more
        return carry(db, previous)

    monkeypatch.setattr(build_module, "_carry_over_expansions", full)
    with pytest.raises(CatalogError, match="full"):
        build_from_objects(iter(listing), tmp_path, "s3://b/x")
    cat = Catalog.open(tmp_path, readonly=True)
    assert cat.db.execute("SELECT count(*) FROM expansions").fetchone()[0] == 400
    cat.close()


def test_an_interrupt_while_carrying_over_what_prepare_learnt_stays_an_interrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or a stop signal's exception) inside the carry-over's transaction: the DETACH after it failed
    ("database old is locked"), and that error replaced the interrupt, reported as a catalog write failure."""
    listing = [("a.png", 10, '"e1"', 1)]
    build_from_objects(iter(listing), tmp_path, "s3://b/x")
    carry = build_module._carry_over_expansions

    class Interrupted:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        @property
        def in_transaction(self) -> bool:
            return self.db.in_transaction

        def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
            if sql.lstrip().startswith("UPDATE nodes"):
                raise KeyboardInterrupt
            return self.db.execute(sql, *args)

    monkeypatch.setattr(build_module, "_carry_over_expansions",
                        lambda db, previous: carry(Interrupted(db), previous))  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):
        build_from_objects(iter(listing), tmp_path, "s3://b/x")


def test_a_directory_past_path_max_is_shown_empty_and_does_not_make_every_use_a_rescan(tmp_path: Path) -> None:
    """A path of the source longer than PATH_MAX (4,096 bytes: 17 directories of 250-byte names) cannot be opened
    below the root in one call: shown empty, and the catalog stays fresh (each use scanned it again, in vain)."""
    src = tmp_path / "src"
    deep = src
    for level in range(17):
        deep = deep / (chr(ord("a") + level) * 250)
    fd = os.open(tmp_path, os.O_RDONLY)  # made one level at a time (each mkdir's path stays short)
    try:
        for part in (src.relative_to(tmp_path), *deep.relative_to(src).parts):
            os.mkdir(part, dir_fd=fd)
            next_fd = os.open(part, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        os.close(os.open("a.png", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    catalog = open_or_build(src, tmp_path / "store")
    try:
        assert catalog.is_fresh()
        assert not any(row[3].endswith(b"a.png") for row in written(tmp_path / "store").nodes)
    finally:
        catalog.close()


def test_a_working_copy_interrupted_in_its_publish_is_not_published_again(tmp_path: Path) -> None:
    """Ctrl-C after the rename, before the copy knew it was published: the publish prepare calls on the way
    out found no copy to rename and failed with FileNotFoundError in the interrupt's place."""
    _, store = _fresh_catalog(tmp_path)
    copy = WorkingCopy(store)
    copy.publish()
    copy.published = False  # as if interrupted right after the rename
    copy.publish()
    catalog = Catalog.open(store, readonly=True)
    assert catalog.is_fresh()
    catalog.close()


def test_an_entry_named_as_the_control_file_is_shown_only_below_the_root(tmp_path: Path) -> None:
    """The mount answers ``.__liquidfs__`` at its root itself: an entry of the source's root of that name (made by
    whoever writes the dataset) could never be reached, and listed with its attributes it took the control file's
    name in the kernel's dentries (``stats --probe`` failed, ``umount`` read its bytes). Left out; one below the
    root is an entry like any other."""
    src = tmp_path / "src"
    (src / ".__liquidfs__").mkdir(parents=True)
    (src / ".__liquidfs__" / "x.png").write_bytes(b"png")
    (src / "d").mkdir()
    (src / "d" / ".__liquidfs__").write_bytes(b"png")
    report = build(src, tmp_path / "store")
    catalog = Catalog.open(tmp_path / "store", readonly=True)
    try:
        assert catalog.lookup(ROOT_ID, b".__liquidfs__") is None and report.ignored == 1
        assert {node.path for node in catalog.files()} == {b"d/.__liquidfs__"}
    finally:
        catalog.close()
