"""Whether the process behind a FUSE request may read a source file, decided by the kernel for that caller.

An ``--allow-other`` mount is entered by other users, and the daemon that opens files for them runs as root. The
catalog holds the modes of the scan; what decides now is the source as it is, judged as the kernel would judge a
direct open by that caller: owner, group and other bits, supplementary groups and POSIX ACLs. Rather than
re-implement that judgement (ACL masks, group lists, the filesystem's own rules), the check opens the file below
the source root with the caller's filesystem credentials: ``setfsuid``/``setfsgid`` and ``setgroups`` change only
the calling thread on Linux when made as raw system calls (glibc's ``setgroups`` would change every thread), and a
non-zero fsuid drops the thread's file capabilities, so the kernel's own permission walk answers.

Where the daemon cannot take another user's credentials (it does not run as root), the modes are compared
instead: owner, group (the caller's primary and supplementary groups) or other bits; ACLs then grant nothing and
deny nothing beyond the bits (``docs/guarantees.md``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import platform
import stat
import struct
from collections.abc import Callable, Generator

from .paths import catalog_parts, filesystem_type_of, open_below, path_below, stat_below

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.setfsuid.restype = ctypes.c_int
_libc.setfsgid.restype = ctypes.c_int
#: setgroups(2) as a raw system call: per thread. The number differs by architecture (the generic table's, 159, is
#: aarch64's, riscv64's and loongarch64's); elsewhere the modes decide, and a root daemon says so once.
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159, "riscv64": 159, "loongarch64": 159}.get(platform.machine())
_said_modes_only = False


def caller_groups(pid: int) -> list[int] | None:
    """The supplementary groups of process ``pid`` as /proc shows them; None where it cannot be read (a process
    gone, or one the daemon's PID namespace does not see: the request then names pid 0)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return [int(g) for g in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def _setgroups(groups: list[int]) -> None:
    assert _SYS_SETGROUPS is not None
    array = (ctypes.c_uint * max(len(groups), 1))(*groups)
    if _libc.syscall(ctypes.c_long(_SYS_SETGROUPS), ctypes.c_size_t(len(groups)), array) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def can_switch() -> bool:
    """Whether this process can take another user's filesystem credentials (root, or CAP_SETUID and CAP_SETGID)."""
    return _SYS_SETGROUPS is not None and os.geteuid() == 0


def may_read(root_fd: int, rel: bytes, uid: int, gid: int, groups: list[int] | None) -> bool:
    """Whether ``uid``/``gid`` (with supplementary ``groups``; None where unknown: judged as in none, and refused
    where some group is shut out of what that gives, ``_no_group_shuts_out``) may open ``rel`` below
    ``root_fd`` for reading now: every directory on the way searchable and the file readable, as the kernel
    decides for that caller. Blocks: run it in a worker thread. Links and other filesystems are never crossed."""
    return uid == 0 or readable_inode(root_fd, rel, uid, gid, groups) is not None


def readable_inode(root_fd: int, rel: bytes, uid: int, gid: int, groups: list[int] | None) -> int | None:
    """The inode number of the file at ``rel`` below ``root_fd`` that ``uid``/``gid`` may open for reading now
    (``may_read``), None where they may not. The caller serves that inode's bytes only: a check and an open that
    are two walks of a path let a user who may rename in a directory swap another's file in between (an open of
    their own file, checked; then the other's, served). The directories above the root are not the dataset's:
    an --allow-other mount shares its root wherever it lies (a home only root may enter, a kubelet's volume
    directory), and only the modes below it bind."""
    if uid == 0:
        try:
            return stat_below(root_fd, rel).st_ino
        except OSError:
            return None
    catalog_parts(rel)
    if not can_switch():
        global _said_modes_only
        if _SYS_SETGROUPS is None and os.geteuid() == 0 and not _said_modes_only:
            _said_modes_only = True
            log.warning("other users' opens are judged by the modes alone, ACLs not read: this daemon does not know "
                        "setgroups(2)'s number on %s", platform.machine())
        found = _modes_permit(root_fd, rel, uid, gid, groups or [])
    else:
        found = _open_as(root_fd, rel, uid, gid, groups or [])
    if found is not None and groups is None and not _no_group_shuts_out(root_fd, rel, uid, gid, found):
        _say_groups_unknown(uid)
        return None
    return found


_said_groups_unknown = False


def _say_groups_unknown(uid: int) -> None:
    global _said_groups_unknown
    if not _said_groups_unknown:
        _said_groups_unknown = True
        log.warning("an open by uid %d was refused: its process's groups cannot be read (another PID namespace: "
                    "share the pod's process namespace with the mount's), and a group it may be in may be shut "
                    "out of the file or a directory on its way (its modes or POSIX ACL say so, or the filesystem "
                    "has ACLs of its own, NFSv4's or SMB's, which are not read; said once)", uid)


def _no_group_shuts_out(root_fd: int, rel: bytes, uid: int, gid: int, inode: int) -> bool:
    """For a caller whose supplementary groups are unknown (its process is in a PID namespace the daemon does not
    see, or gone: the request names pid 0), judged as in none: whether being in some group could take away what
    that judgement gave, at any step (each directory's search, the file's read, the file being ``inode``). Judged
    as in none, they were given what others get where a chmod or ACL since the scan shuts a group out (0604,
    ``group:interns:---``), which the kernel, knowing their groups, refuses its members."""
    parts = catalog_parts(rel)
    try:
        with contextlib.closing(_each_step(root_fd, parts)) as steps:
            for depth, fd in enumerate(steps):
                if depth < len(parts):
                    if not _groups_cannot_deny(fd, uid, gid, stat.S_IXOTH):
                        return False
                else:
                    return os.fstat(fd).st_ino == inode and _groups_cannot_deny(fd, uid, gid, stat.S_IROTH)
    except OSError:
        pass
    return False


def _groups_cannot_deny(fd: int, uid: int, gid: int, bit: int) -> bool:
    """Whether, for ``uid`` with primary group ``gid``, being in further groups cannot refuse ``bit`` (S_IROTH or
    S_IXOTH) of the file held at ``fd`` where being in none grants it. The kernel judges the owner by the owner's
    bits, a named user by that entry; anyone else in the owning group or a named group by those entries alone
    (one of them granting grants: more groups only add), and only the rest by others' bits. So only a caller
    who would be judged as others can lose by a group: where others are granted and some group is not."""
    st = os.fstat(fd)
    if st.st_uid == uid:
        return True
    entries = _access_acl(fd, _posix_acls_only(st.st_dev, fd))
    if entries is None:
        return False
    if not entries:  # no ACL: the mode's bits say it all
        group_grants, other_grants = bool(st.st_mode & bit << 3), bool(st.st_mode & bit)
        return st.st_gid == gid or group_grants or not other_grants
    if any(tag == _USER and ident == uid for tag, _, ident in entries):
        return True
    mask = next((perm for tag, perm, _ in entries if tag == _MASK), 7)
    groups = [(perm & mask, st.st_gid if tag == _GROUP_OBJ else ident) for tag, perm, ident in entries
              if tag in (_GROUP_OBJ, _GROUP)]
    if any(ident == gid for _, ident in groups):
        return True  # judged by a group's entries already: more groups only add
    other = next((perm for tag, perm, _ in entries if tag == _OTHER), 0)
    return not other & bit or all(perm & bit for perm, _ in groups)


def _open_as(root_fd: int, rel: bytes, uid: int, gid: int, groups: list[int]) -> int | None:
    saved_groups = os.getgroups()
    _setgroups(groups)
    try:
        previous_gid = _libc.setfsgid(gid)
        try:
            previous_uid = _libc.setfsuid(uid)
            try:
                if _libc.setfsuid(-1) != uid or _libc.setfsgid(-1) != gid:  # -1: asks without changing
                    log.warning("cannot take uid %d's credentials to check an open: refused", uid)
                    return None
                if not _dac_caps_dropped():
                    return None
                fd = open_below(root_fd, rel)
            except OSError as exc:
                if exc.errno in _REFUSALS:
                    return None
                raise  # the file gone (ENOENT), the daemon out of descriptors: said as what it is, not EACCES
            else:
                try:
                    return os.fstat(fd).st_ino
                finally:
                    os.close(fd)
            finally:
                _libc.setfsuid(previous_uid)
        finally:
            _libc.setfsgid(previous_gid)
    finally:
        _setgroups(saved_groups)
        if _libc.setfsuid(-1) != os.geteuid() or _libc.setfsgid(-1) != os.getegid():
            # Never seen; but a worker thread left with a user's credentials would serve others with them.
            log.critical("a worker thread kept another user's credentials: stopping the daemon")
            os.abort()


#: Errors of a caller's check that refuse the open (EACCES): the caller may not, or the walk met a link or another
#: filesystem on the way (which no walk of the source crosses: ELOOP or EXDEV, or ENOTDIR where a kernel without
#: openat2 walks a name at a time). Any other is the open's error as it is: a file deleted meanwhile is ENOENT, a
#: daemon out of descriptors EMFILE, never a permission the caller lacks.
_REFUSALS = frozenset({errno.EACCES, errno.EPERM, errno.ELOOP, errno.EXDEV, errno.ENOTDIR})

#: Whether taking a user's filesystem ids drops the capabilities that override file modes (found once, in the
#: first check: the process's secure bits decide it, and they do not change). None: not found yet.
_DAC_CAPS_DROP: bool | None = None
#: CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, as bits of /proc's CapEff.
_DAC_CAPS = (1 << 1) | (1 << 2)


def _dac_caps_dropped() -> bool:
    """With a user's fsuid taken (the caller's thread): whether the kernel dropped CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH, as it does unless the process's secure bits say otherwise (SECBIT_NO_SETUID_FIXUP,
    systemd's SecureBits=no-setuid-fixup): kept, every open made as the caller passed, whatever the modes."""
    global _DAC_CAPS_DROP
    if _DAC_CAPS_DROP is None:
        try:
            with open("/proc/thread-self/status") as status:
                line = next(line for line in status if line.startswith("CapEff:"))
            effective = int(line.split()[1], 16)
        except (OSError, StopIteration, ValueError, IndexError) as exc:  # asked again at the next check
            log.warning("cannot read this thread's capabilities (%s): an --allow-other open refused", exc)
            return False
        _DAC_CAPS_DROP = not effective & _DAC_CAPS
        if not _DAC_CAPS_DROP:
            log.critical("taking a user's filesystem ids keeps this daemon's capabilities over file modes "
                         "(secure bits no-setuid-fixup?): every --allow-other open by another user is refused")
    return _DAC_CAPS_DROP


def everyone_may_read(root_fd: int, rel: bytes, *, posix_acls_only: bool = False, inode: int | None = None) -> bool:
    """Whether every user may open ``rel`` below ``root_fd`` for reading now, by the bits for others and for the
    group: each directory on the way searchable (o+x, g+x) and the file readable (o+r, g+r), and by the entries
    of any extended POSIX ACL among them (``_acl_grants_all``). Asking as some user (nobody) would be answered
    by the owner's bits where that user owns the file (an NFS server's squashed files, a container's unmapped
    ids). ``posix_acls_only``: the filesystem has no ACLs but POSIX ones (``POSIX_ACLS_ONLY``), so one that
    supports none has none; elsewhere (an NFSv4 or SMB mount has ACLs of its own, which these calls do not
    read) nothing is everyone's unless it has a POSIX ACL to read. ``inode``: the file judged must be this one
    (the source the caller reads). Blocks: a worker thread's.

    One walk, a component at a time from the directory judged last: each step judged is the one the next is
    reached through. A walk per prefix judged one directory and reached the file through another: a writer of
    a directory on the way swapped a private subdirectory for a public one of theirs between the two walks
    (``renameat2(RENAME_EXCHANGE)``), and a file of the private one was judged everyone's."""
    # The group's bits too: a group whose bits lack what others have (0604) is shut out, so not everyone may.
    search, read = stat.S_IXOTH | stat.S_IXGRP, stat.S_IROTH | stat.S_IRGRP
    try:
        parts = catalog_parts(rel)
        with contextlib.closing(_each_step(root_fd, parts)) as steps:
            for depth, fd in enumerate(steps):
                if depth < len(parts):
                    if not _grants_all(fd, search, stat.S_ISDIR, posix_acls_only):
                        return False
                else:
                    return _grants_all(fd, read, stat.S_ISREG, posix_acls_only) and (
                        inode is None or os.fstat(fd).st_ino == inode)
    except OSError:  # gone, a link on the way, another filesystem, a path the catalog should not hold
        pass
    return False


def _each_step(root_fd: int, parts: list[bytes]) -> Generator[int, None, None]:
    """``root_fd``, then a descriptor (O_PATH) of each of ``parts`` in turn, each reached from the one before it
    by its name alone (``path_below``: no link, never onto another filesystem), and closed once the next is had:
    what the caller judges at each step is what the walk goes on through."""
    fd = root_fd
    try:
        yield fd
        for part in parts:
            step = path_below(fd, part)
            if fd != root_fd:
                os.close(fd)
            fd = step
            yield fd
    finally:
        if fd != root_fd:
            os.close(fd)


def everyone_may_search_above(root_fd: int, posix_acls_only: Callable[[int], bool]) -> bool:
    """Whether every user may search each directory above the one ``root_fd`` holds, up to /, now (the bits for
    others and the group, and any POSIX ACL, as ``everyone_may_read`` judges the directories below it): a source
    below a directory only its owner may enter (``/home/alice``, 0700) is nobody else's, whatever its own modes.
    Each step is the kernel's ``..`` of the last, so the directories are the ones the source is in now (moved or
    not). ``posix_acls_only(fd)``: whether ``fd``'s filesystem has no ACLs but POSIX ones (``POSIX_ACLS_ONLY``).
    Blocks: a worker thread's."""
    search = stat.S_IXOTH | stat.S_IXGRP
    try:
        fd = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return False
    try:
        below = os.fstat(root_fd)
        while True:
            here = os.fstat(fd)
            if (here.st_dev, here.st_ino) == (below.st_dev, below.st_ino):  # / is its own ..
                return True
            if not _grants_all(fd, search, stat.S_ISDIR, posix_acls_only(fd)):
                return False
            parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd, below = parent, here
    except OSError:
        return False
    finally:
        os.close(fd)


#: Filesystems with no ACLs but POSIX ones (or none at all): where one answers that it supports no POSIX ACL,
#: the modes say all. Not overlay (its lower layer may be an NFSv4 one) nor ZFS (NFSv4 ACLs where built so).
POSIX_ACLS_ONLY = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "ramfs"})


def _grants_all(fd: int, bits: int, kind: Callable[[int], bool], posix_acls_only: bool) -> bool:
    """Whether what ``fd`` holds is of ``kind`` and its mode has ``bits``, and its ACL shuts nobody out."""
    mode = os.fstat(fd).st_mode
    return kind(mode) and mode & bits == bits and _acl_grants_all(fd, bits & stat.S_IRWXO, posix_acls_only)


#: The extended access ACL of a file, in the kernel's format (none where its mode bits say it all).
_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")  # tag, permission bits (r 4, w 2, x 1), uid or gid
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
#: The entries a caller who is not the owner may be judged by before others' entry: a named user, the owning
#: group, a named group. The mask and others' entry are the mode's group and other bits.
_ACL_DECIDING = frozenset({_USER, _GROUP_OBJ, _GROUP})


def _acl_grants_all(fd: int, bit: int, posix_acls_only: bool) -> bool:
    """Whether the extended ACL of the file held at ``fd`` gives ``bit`` in each of its named users' and groups'
    and its owning group's entries; True where it has none. A user named with ``---`` cannot read a file others
    may: an ACL that shuts anyone out is not everyone's, nor one that cannot be judged (``_access_acl``)."""
    entries = _access_acl(fd, posix_acls_only)
    return entries is not None and all(perm & bit for tag, perm, _ in entries if tag in _ACL_DECIDING)


def _access_acl(fd: int, posix_acls_only: bool) -> list[tuple[int, int, int]] | None:
    """The (tag, permission bits, id) entries of the extended access ACL of the file held at ``fd`` (O_PATH: read
    through /proc, as fgetxattr refuses one); [] where it has none, so its mode says all. None where it cannot be
    judged, which every caller takes as shutting someone out: an ACL that cannot be read; no POSIX ACL on a
    filesystem that has ACLs of another kind (``posix_acls_only`` False: an NFSv4 or SMB mount's, which these
    calls do not read); one the kernel would not have made (an unknown tag, an entry of the owner, the owning
    group or others missing or twice, named entries without a mask)."""
    try:
        value = os.getxattr(f"/proc/self/fd/{fd}", _ACL_XATTR)
    except OSError as exc:
        return [] if exc.errno == errno.ENODATA or (exc.errno == errno.EOPNOTSUPP and posix_acls_only) else None
    entries = _acl_entries(value)
    if entries is None:
        return None
    tags = [tag for tag, _, _ in entries]
    masks, named = tags.count(_MASK), tags.count(_USER) + tags.count(_GROUP)
    if (not set(tags) <= {_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER}
            or any(tags.count(tag) != 1 for tag in (_USER_OBJ, _GROUP_OBJ, _OTHER))
            or masks > 1 or (named and not masks)):
        return None
    return entries


#: ``_posix_acls_only`` by device: the mount table read once a device, not at every step of every open.
_POSIX_ONLY: dict[int, bool] = {}


def _posix_acls_only(device: int, fd: int) -> bool:
    """Whether the filesystem of device ``device`` (the file held at ``fd`` is on it) has no ACLs but POSIX ones
    (``POSIX_ACLS_ONLY``)."""
    known = _POSIX_ONLY.get(device)
    if known is None:
        if len(_POSIX_ONLY) > 1024:  # (devices come and go: bounded)
            _POSIX_ONLY.clear()
        known = _POSIX_ONLY[device] = filesystem_type_of(fd) in POSIX_ACLS_ONLY
    return known


def _acl_entries(value: bytes) -> list[tuple[int, int, int]] | None:
    """The (tag, permission bits, id) entries of an access ACL's value in the kernel's format; None where it is
    not one (its length, its version)."""
    if len(value) < _ACL_VERSION.size or (len(value) - _ACL_VERSION.size) % _ACL_ENTRY.size \
            or _ACL_VERSION.unpack_from(value)[0] != 2:
        return None
    return list(_ACL_ENTRY.iter_unpack(value[_ACL_VERSION.size:]))


def _modes_permit(root_fd: int, rel: bytes, uid: int, gid: int, groups: list[int]) -> int | None:
    """The owner, group or other bits of every directory on the way (search) and of the file (read): its inode
    number where they permit."""
    parts = catalog_parts(rel)
    mine = {gid, *groups}

    def permits(st: os.stat_result, bit: int) -> bool:
        shift = 6 if uid == st.st_uid else 3 if st.st_gid in mine else 0
        return bool(st.st_mode >> shift & bit)

    try:  # one walk, as ``everyone_may_read``'s: each directory judged is the one the file is reached through
        with contextlib.closing(_each_step(root_fd, parts)) as steps:
            for depth, fd in enumerate(steps):
                st = os.fstat(fd)
                if depth < len(parts):
                    if not (stat.S_ISDIR(st.st_mode) and permits(st, 1)):
                        return None
                elif stat.S_ISREG(st.st_mode) and permits(st, 4):
                    return st.st_ino
    except OSError as exc:
        if exc.errno not in _REFUSALS:
            raise  # as ``_open_as``
    return None
