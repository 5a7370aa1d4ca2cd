"""The per-caller read check of an --allow-other mount (``access.may_read``) and the no-link walk it and every
source check use (``paths.stat_below``), without a mount."""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

import pytest

from liquidfs.sysio import access
from liquidfs.sysio.paths import open_dir, stat_below

NOBODY = 65534
#: The credential checks take another user's credentials (and the tree's file is root's, in group 4242).
NEEDS_ROOT = pytest.mark.needs_root("only root can take another user's credentials")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "group.txt").write_text("for one group\n")
    os.chown(root / "d" / "group.txt", 0, 4242)
    (root / "d" / "group.txt").chmod(0o640)
    (root / "d" / "all.txt").write_text("for all\n")
    (root / "d" / "all.txt").chmod(0o644)
    root.chmod(0o755)
    (root / "d").chmod(0o755)
    return root


@NEEDS_ROOT
@pytest.mark.parametrize("switch", [True, False], ids=["kernel", "modes"])
def test_supplementary_groups_grant_what_they_grant(tree: Path, switch: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if not switch:  # a daemon that cannot take a user's credentials compares the modes itself
        monkeypatch.setattr(access, "can_switch", lambda: False)
    root_fd = open_dir(tree)
    try:
        assert access.may_read(root_fd, b"d/group.txt", NOBODY, NOBODY, [4242])
        assert not access.may_read(root_fd, b"d/group.txt", NOBODY, NOBODY, [])
        assert not access.may_read(root_fd, b"d/group.txt", NOBODY, NOBODY, None)
        assert access.may_read(root_fd, b"d/all.txt", NOBODY, NOBODY, None)
        (tree / "d").chmod(0o700)  # a directory on the way no longer searchable
        assert not access.may_read(root_fd, b"d/all.txt", NOBODY, NOBODY, None)
    finally:
        os.close(root_fd)
    # the thread that checked has its own credentials back
    assert os.open(tree / "d" / "group.txt", os.O_RDONLY) >= 0


@NEEDS_ROOT
def test_the_check_never_walks_through_a_link(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "all.txt").write_text("elsewhere\n")
    (outside / "all.txt").chmod(0o644)
    (tree / "d").rename(tree / "d0")
    (tree / "d").symlink_to(outside)
    root_fd = open_dir(tree)
    try:
        assert not access.may_read(root_fd, b"d/all.txt", NOBODY, NOBODY, None)
        with pytest.raises(OSError) as info:
            stat_below(root_fd, b"d/all.txt")
        assert info.value.errno in (errno.ELOOP, errno.ENOTDIR)
        # a link at the end is stat-ed as the link, never followed
        (tree / "d0" / "link").symlink_to(outside / "all.txt")
        assert stat.S_ISLNK(stat_below(root_fd, b"d0/link").st_mode)
    finally:
        os.close(root_fd)


def _readable_by_all(tmp_path: Path) -> tuple[Path, Path]:
    """A source whose ``d/f.png`` every user may read by its modes."""
    source = tmp_path / "source"
    (source / "d").mkdir(parents=True)
    for directory in (source, source / "d"):
        directory.chmod(0o755)
    file = source / "d" / "f.png"
    file.write_bytes(b"x")
    file.chmod(0o644)
    return source, file


def _set_acl(path: Path, entries: list[tuple[int, int, int]]) -> None:
    """An extended access ACL in the kernel's format (what ``setfacl`` writes): (tag, bits, id) sorted by tag."""
    any_id = 0xFFFFFFFF
    value = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, bits, any_id if who is None else who)
                                            for tag, bits, who in entries)
    os.setxattr(path, "system.posix_acl_access", value)


@pytest.mark.needs_root("a check as nobody")
def test_everyone_may_read_reads_an_acl_that_shuts_one_user_out(tmp_path: Path) -> None:
    """``setfacl -m u:nobody:---`` on a file others may read: its bits say everyone, nobody is shut out (the
    kernel says so: ``may_read`` as nobody), so it is not everyone's. A named group without search on a
    directory on the way the same; an ACL whose named entries all grant is everyone's."""
    user_obj, user, group_obj, group, mask, other = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
    source, file = _readable_by_all(tmp_path)
    root = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert access.everyone_may_read(root, b"d/f.png")
        _set_acl(file, [(user_obj, 6, None), (user, 0, NOBODY), (group_obj, 4, None), (mask, 4, None),
                        (other, 4, None)])
        assert not access.may_read(root, b"d/f.png", NOBODY, NOBODY, [])  # the kernel's word
        assert not access.everyone_may_read(root, b"d/f.png")
        _set_acl(file, [(user_obj, 6, None), (user, 4, NOBODY), (group_obj, 4, None), (group, 4, NOBODY),
                        (mask, 4, None), (other, 4, None)])
        assert access.everyone_may_read(root, b"d/f.png")
        _set_acl(source / "d", [(user_obj, 7, None), (group_obj, 5, None), (group, 4, NOBODY), (mask, 5, None),
                                (other, 5, None)])
        assert not access.may_read(root, b"d/f.png", NOBODY, NOBODY, [])
        assert not access.everyone_may_read(root, b"d/f.png")
        os.removexattr(source / "d", "system.posix_acl_access")
        assert access.everyone_may_read(root, b"d/f.png")
    finally:
        os.close(root)


def test_an_acl_that_cannot_be_read_or_parsed_shuts_someone_out(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """What a filesystem's xattr says is its word: a value not in the kernel's format, or not an ACL the kernel
    would make, counts as one that shuts someone out. A file without one (ENODATA) is judged by its bits; so is
    one whose filesystem supports no POSIX ACL (EOPNOTSUPP) only where it has no ACLs of another kind (an NFSv4
    mount's are not read). The check of a caller whose groups are unknown reads ACLs alike."""
    file = tmp_path / "f.png"
    file.write_bytes(b"x")
    file.chmod(0o644)
    tmp_path.chmod(0o755)
    answers: list[bytes | OSError] = []

    def getxattr(path: str, name: str) -> bytes:
        answer = answers[0]
        if isinstance(answer, OSError):
            raise answer
        return answer

    def acl(*entries: tuple[int, int, int], version: int = 2) -> bytes:
        return struct.pack("<I", version) + b"".join(struct.pack("<HHI", *entry) for entry in entries)

    # r-x: read for the file, search for the directory the answer is given for too
    owner, group, other, user, named_group, mask = (0x01, 7, 0), (0x04, 5, 0), (0x20, 5, 0), (0x02, 5, 7), \
        (0x08, 5, 7), (0x10, 5, 0)
    monkeypatch.setattr(access.os, "getxattr", getxattr)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for answer, everyone, posix_only in (
                (OSError(errno.ENODATA, "none"), True, False),
                (OSError(errno.EOPNOTSUPP, "no POSIX ACLs"), True, True),
                (OSError(errno.EOPNOTSUPP, "no POSIX ACLs: NFSv4's own"), False, False),
                (OSError(errno.EIO, "torn"), False, True),
                (b"\x02\x00\x00\x00\x01", False, True),
                (acl(owner, group, other), True, True),  # the minimal ACL: the modes
                (acl(owner, group, other, version=3), False, True),
                (acl(other), False, True),  # no owner's or owning group's entry
                (acl(owner, group, group, other), False, True),
                (acl(owner, user, group, other), False, True),  # a named user without a mask
                (acl(owner, user, group, named_group, mask, other), True, True),
                (acl(owner, user, group, mask, mask, other), False, True),
                (acl(owner, group, (0x40, 4, 0), other), False, True),  # a tag the kernel has none of
                (acl(owner, (0x04, 0, 0), mask, other), False, True)):  # the owning group shut out
            answers[:] = [answer]
            assert access.everyone_may_read(root, b"f.png", posix_acls_only=posix_only) is everyone, answer
            # A caller whose groups are unknown is judged by the same reading: nothing it cannot judge grants.
            monkeypatch.setattr(access, "_posix_acls_only", lambda device, fd, only=posix_only: only)
            assert access._no_group_shuts_out(root, b"f.png", NOBODY, NOBODY, file.stat().st_ino) is everyone, \
                answer
        assert not access.everyone_may_read(root, b"../f.png", posix_acls_only=True)  # not a catalog's path
    finally:
        os.close(root)


def test_caller_groups_come_from_proc() -> None:
    assert access.caller_groups(os.getpid()) == os.getgroups() or set(access.caller_groups(os.getpid()) or []) \
        == set(os.getgroups())
    assert access.caller_groups(0) is None


@pytest.mark.needs_root("a chown to nobody")
def test_everyone_may_read_by_the_bits_for_others_alone(tmp_path: Path) -> None:
    """Asked as nobody, a file nobody owns would be judged by its owner's bits (an NFS server's squashed files):
    only the bits for others say whether everyone may read it."""
    source, file = _readable_by_all(tmp_path)
    root = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert access.everyone_may_read(root, b"d/f.png")
        file.chmod(0o604)  # its group shut out
        assert not access.everyone_may_read(root, b"d/f.png")
        file.chmod(0o644)
        os.chown(file, NOBODY, NOBODY)
        file.chmod(0o600)
        assert not access.everyone_may_read(root, b"d/f.png")
        file.chmod(0o644)
        (source / "d").chmod(0o750)
        assert not access.everyone_may_read(root, b"d/f.png")
        assert not access.everyone_may_read(root, b"d/missing.png")
    finally:
        os.close(root)


def test_everyone_may_search_above_walks_the_kernels_parents_up_to_the_root(reachable_tmp: Path) -> None:
    """Each directory above a source, up to /, as the kernel's .. finds it now: / itself has nothing above it;
    a source moved under a directory only its owner may enter is shut to others from then on."""
    asked: list[int] = []

    def kind(fd: int) -> bool:
        asked.append(fd)
        return True

    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert access.everyone_may_search_above(root, kind) and asked == []
    finally:
        os.close(root)
    (reachable_tmp / "src").mkdir()
    closed = reachable_tmp / "closed"
    closed.mkdir(mode=0o700)
    src = os.open(reachable_tmp / "src", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert access.everyone_may_search_above(src, kind)
        assert len(asked) == len(reachable_tmp.parts)  # reachable_tmp, /tmp, /
        (reachable_tmp / "src").rename(closed / "src")
        assert not access.everyone_may_search_above(src, kind)
    finally:
        os.close(src)



@NEEDS_ROOT
@pytest.mark.parametrize("switch", [True, False], ids=["kernel", "modes"])
def test_a_check_answers_the_inode_the_caller_may_read(tree: Path, switch: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What the open then serves, and only that: a file renamed over the one checked is another inode."""
    if not switch:
        monkeypatch.setattr(access, "can_switch", lambda: False)
    root_fd = open_dir(tree)
    try:
        assert access.readable_inode(root_fd, b"d/all.txt", NOBODY, NOBODY, None) == (tree / "d/all.txt").stat().st_ino
        assert access.readable_inode(root_fd, b"d/group.txt", NOBODY, NOBODY, None) is None
        # A file gone is ENOENT, as it is (it was EACCES: a permission the caller lacked)
        with pytest.raises(FileNotFoundError):
            access.readable_inode(root_fd, b"d/none.txt", NOBODY, NOBODY, None)
    finally:
        os.close(root_fd)


@NEEDS_ROOT
def test_a_check_refuses_where_taking_the_callers_ids_keeps_the_daemons_capabilities(
        tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under SECBIT_NO_SETUID_FIXUP (systemd's SecureBits=no-setuid-fixup) a daemon's fsuid change keeps its
    CAP_DAC_OVERRIDE: every open made as the caller passed, whatever the modes. Found (here, where the kernel
    drops them) and, where kept, every check refuses."""
    monkeypatch.setattr(access, "_DAC_CAPS_DROP", None)
    root_fd = open_dir(tree)
    try:
        assert access.readable_inode(root_fd, b"d/all.txt", NOBODY, NOBODY, None) is not None
        assert access._DAC_CAPS_DROP is True  # found at the first switch: dropped, as the kernel does by default
        monkeypatch.setattr(access, "_DAC_CAPS_DROP", False)  # as under no-setuid-fixup
        assert access.readable_inode(root_fd, b"d/all.txt", NOBODY, NOBODY, None) is None
    finally:
        os.close(root_fd)


class SwappedMidWalk:
    """A source whose root another user may write: ``d`` is private (0700, a public file in it), ``theirs`` a
    public directory of that user's with a file of the same name. ``swap`` exchanges the two names (as
    ``renameat2(RENAME_EXCHANGE)`` does in one step); ``hook`` makes a walk's first step through ``d`` swap them
    right after it, before the file is reached."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.source = source = tmp_path / "src"
        (source / "d").mkdir(parents=True)
        (source / "theirs").mkdir()
        for where in ("d", "theirs"):
            (source / where / "f.png").write_bytes(b"png")
            (source / where / "f.png").chmod(0o644)
        source.chmod(0o755)
        (source / "d").chmod(0o700)
        (source / "theirs").chmod(0o755)
        self.private = (source / "d" / "f.png").stat().st_ino
        self.monkeypatch = monkeypatch
        self.swaps = 0

    def swap(self) -> None:
        os.rename(self.source / "d", self.source / "x")
        os.rename(self.source / "theirs", self.source / "d")
        os.rename(self.source / "x", self.source / "theirs")
        self.swaps += 1

    def hook(self) -> None:
        """Every walk of access's (a prefix's or a name's at a time) swaps back once ``d`` has been reached."""
        for name in ("path_below", "stat_below"):
            real = getattr(access, name)

            def walking(dir_fd: int, rel: bytes, *args: object, _real=real, **kwargs: object) -> object:
                found = _real(dir_fd, rel, *args, **kwargs)
                if rel == b"d" and self.swaps == 1:
                    self.swap()
                return found

            self.monkeypatch.setattr(access, name, walking)


@NEEDS_ROOT
def test_everyone_may_read_judges_the_directories_the_file_is_reached_through(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer of the source's root swaps a private directory for a public one of theirs while the check runs:
    each directory judged is the one the walk goes on through, and the file judged must be the one the caller
    reads (its inode). A walk per prefix judged the public directory, then reached the private one's file: that
    file went to memcached in clear text."""
    tree = SwappedMidWalk(tmp_path, monkeypatch)
    root = os.open(tree.source, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert not access.everyone_may_read(root, b"d/f.png", inode=tree.private)  # as it is: private
        tree.swap()  # "d" is theirs, public, when it is judged
        tree.hook()
        assert not access.everyone_may_read(root, b"d/f.png", inode=tree.private)
        assert tree.swaps == 2
        monkeypatch.undo()
        (tree.source / "d").chmod(0o755)  # opened up: everyone's, and only the file asked of is that one
        assert access.everyone_may_read(root, b"d/f.png", inode=tree.private)
        assert not access.everyone_may_read(root, b"d/f.png", inode=tree.private + 1)
    finally:
        os.close(root)


@NEEDS_ROOT
def test_a_check_by_modes_answers_the_inode_reached_through_the_directories_judged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same swap against a daemon that cannot take the caller's ids (its modes judged): the inode answered,
    the only one the open then serves, is the file of the directory judged, never the private one's."""
    tree = SwappedMidWalk(tmp_path, monkeypatch)
    monkeypatch.setattr(access, "can_switch", lambda: False)
    root = os.open(tree.source, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert access.readable_inode(root, b"d/f.png", NOBODY, NOBODY, None) is None
        tree.swap()
        tree.hook()
        assert access.readable_inode(root, b"d/f.png", NOBODY, NOBODY, None) != tree.private
        assert tree.swaps == 2
    finally:
        os.close(root)


@NEEDS_ROOT
def test_a_root_daemon_that_cannot_take_ids_says_the_modes_alone_decide(
        tree: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An architecture whose setgroups(2) number this daemon does not know: ACLs are not read, and the log says
    so (once), rather than the guarantee of ACLs failing silently."""
    monkeypatch.setattr(access, "_SYS_SETGROUPS", None)
    monkeypatch.setattr(access, "_said_modes_only", False)
    root_fd = open_dir(tree)
    try:
        for _ in range(2):
            assert access.readable_inode(root_fd, b"d/all.txt", NOBODY, NOBODY, None) == \
                (tree / "d/all.txt").stat().st_ino
    finally:
        os.close(root_fd)
    assert caplog.text.count("judged by the modes alone") == 1


@pytest.mark.needs_root("a check as another user")
@pytest.mark.parametrize("switch", [True, False], ids=["kernel", "modes"])
def test_a_caller_whose_groups_are_unknown_gets_nothing_a_group_is_shut_out_of(tmp_path: Path, switch: bool,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """pid 0 (a caller in a PID namespace the daemon does not see: a sidecar's trainer) or a process gone: its
    groups were taken as none, so it got what others get where a chmod or an ACL since the scan shuts a group
    out (0604, group:5555:---), which the kernel refuses that group's members. Refused where some group is shut
    out of what others get; what no group can lose (others' bits shared by every group, the caller's own
    file, its primary group's, a named user's entry) is still granted."""
    if not switch:
        monkeypatch.setattr(access, "can_switch", lambda: False)
    user_obj, user, group_obj, group, mask, other = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
    source, file = _readable_by_all(tmp_path)
    os.chown(file, 0, 5555)
    root = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert access.may_read(root, b"d/f.png", NOBODY, NOBODY, None)  # 0644: every group may read
        file.chmod(0o604)
        assert access.may_read(root, b"d/f.png", NOBODY, NOBODY, [])  # in no group: others' read
        assert not access.may_read(root, b"d/f.png", NOBODY, NOBODY, [5555])  # the kernel's word for a member
        assert not access.may_read(root, b"d/f.png", NOBODY, NOBODY, None)  # unknown: it may be one
        assert not access.may_read(root, b"d/f.png", NOBODY, 5555, None)  # its primary group: the kernel's no
        os.chown(file, NOBODY, 5555)
        assert access.may_read(root, b"d/f.png", NOBODY, NOBODY, None)  # the owner: by the owner's bits
        os.chown(file, 0, 5555)
        file.chmod(0o644)
        (source / "d").chmod(0o745)  # a directory on the way the group may not search
        assert not access.may_read(root, b"d/f.png", NOBODY, NOBODY, None)
        (source / "d").chmod(0o755)
        if switch:  # ACLs are read where the kernel judges (the modes alone read none)
            _set_acl(file, [(user_obj, 6, None), (group_obj, 4, None), (group, 0, 7777), (mask, 4, None),
                            (other, 4, None)])
            assert access.may_read(root, b"d/f.png", NOBODY, NOBODY, [])
            assert not access.may_read(root, b"d/f.png", NOBODY, NOBODY, None)
            _set_acl(file, [(user_obj, 6, None), (user, 4, NOBODY), (group_obj, 4, None), (group, 0, 7777),
                            (mask, 4, None), (other, 4, None)])
            assert access.may_read(root, b"d/f.png", NOBODY, NOBODY, None)  # its own entry decides
    finally:
        os.close(root)


@pytest.mark.needs_root("a check as another user")
@pytest.mark.parametrize("fstype", ["nfs4", "ext4"])
def test_a_caller_whose_groups_are_unknown_is_judged_by_modes_only_where_no_other_acls_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fstype: str) -> None:
    """A filesystem without POSIX ACLs (EOPNOTSUPP) may have ACLs of its own (NFSv4, SMB), a group's deny among
    them, which no call here reads: there a caller whose groups are unknown is refused, as ``everyone_may_read``
    refuses; on one with no ACLs but POSIX ones, the modes say all."""
    source, _ = _readable_by_all(tmp_path)
    real = os.getxattr

    def no_posix_acls(path: object, name: str, *args: object, **kwargs: object) -> bytes:
        if name == "system.posix_acl_access":
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real(path, name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(access.os, "getxattr", no_posix_acls)
    monkeypatch.setattr(access, "filesystem_type_of", lambda fd: fstype)
    monkeypatch.setattr(access, "_POSIX_ONLY", {})
    root = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert access.may_read(root, b"d/f.png", NOBODY, NOBODY, [])
        assert access.may_read(root, b"d/f.png", NOBODY, NOBODY, None) is (fstype == "ext4")
    finally:
        os.close(root)
