"""A read-only FUSE passthrough that injects storage faults: the failing disk or hung NFS server of the tests.

    python tests/support/faultfs.py ROOT MOUNTPOINT RULES.json

serves ROOT at MOUNTPOINT and, for every file whose path (relative to ROOT) contains one of the substrings of a
rule, answers reads as broken storage would. RULES.json is read again whenever it changes, so a test switches
faults on and off while the mount runs:

    {"eio": ["a/b.bmp"], "eio_after": 32768, "hang": ["c.png"]}

* ``eio``: bytes before ``eio_after`` are served (a read crossing it is cut short there), any read at or past it
  fails with EIO: a medium error in the middle of a file.
* ``hang``: reads block until the rule is removed: a server that stopped answering (the request stays in the
  kernel, so the reading thread cannot be interrupted, exactly like NFS hard mounts).
* ``hang_open``: opens block the same way: a cold open of a file whose server stopped answering.
* ``fail_open``: opens fail with ``open_errno`` (a name, ``"ENFILE"``: the system out of open files; EIO unless
  given).

Device-mapper (a linear + error table over a loop device) would be the classic way to get EIO, but it is not in
every kernel (not in this CI's), and it cannot hang. This is a test helper, not part of liquidfs.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from typing import Any

import pyfuse3
import trio
from pyfuse3 import FUSEError

_INODE_BASE = 1 << 32  # our inode = the real one + this, so that the real one can never be ROOT_INODE


class FaultFS(pyfuse3.Operations):
    def __init__(self, root: bytes, rules_path: str) -> None:
        super().__init__()
        self.root = root
        self.rules_path = rules_path
        self._rules: dict[str, Any] = {}
        self._rules_mtime = -1
        self.paths: dict[int, bytes] = {pyfuse3.ROOT_INODE: b""}
        self.open_paths: dict[int, bytes] = {}

    def rules(self) -> dict[str, Any]:
        try:
            mtime = os.stat(self.rules_path).st_mtime_ns
        except FileNotFoundError:
            return {}
        if mtime != self._rules_mtime:
            with open(self.rules_path) as f:
                text = f.read()
            try:
                self._rules = json.loads(text) if text.strip() else {}
                self._rules_mtime = mtime
            except ValueError:  # caught half-written: keep the old rules, read it again next time
                pass
        return self._rules

    def _matches(self, kind: str, rel: bytes) -> bool:
        return any(os.fsencode(s) in rel for s in self.rules().get(kind, ()))

    def _real(self, inode: int) -> bytes:
        try:
            rel = self.paths[inode]
        except KeyError:
            raise FUSEError(errno.ENOENT) from None
        return os.path.join(self.root, rel) if rel else self.root

    def _attrs(self, st: os.stat_result, inode: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns",
                     "st_ctime_ns"):
            setattr(entry, name, getattr(st, name))
        entry.st_ino = inode
        entry.st_blksize = 4096
        entry.st_blocks = st.st_blocks
        entry.entry_timeout = 1
        entry.attr_timeout = 1
        return entry

    def _stat(self, rel: bytes) -> tuple[os.stat_result, int]:
        path = os.path.join(self.root, rel) if rel else self.root
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        inode = pyfuse3.ROOT_INODE if not rel else st.st_ino + _INODE_BASE
        self.paths[inode] = rel
        return st, inode

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self.paths.get(parent_inode)
        if parent is None:
            raise FUSEError(errno.ENOENT)
        st, inode = self._stat(os.path.join(parent, name) if parent else name)
        return self._attrs(st, inode)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode not in self.paths:
            raise FUSEError(errno.ENOENT)
        st, _ = self._stat(self.paths[inode])
        return self._attrs(st, inode)

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return os.readlink(self._real(inode))

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not stat.S_ISDIR(os.lstat(self._real(inode)).st_mode):
            raise FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        parent = self.paths[fh]
        names = sorted(os.listdir(self._real(fh)))
        for i, name in enumerate(names[start_id:], start_id):
            st, inode = self._stat(os.path.join(parent, name) if parent else name)
            if not pyfuse3.readdir_reply(token, name, self._attrs(st, inode), i + 1):
                return

    async def releasedir(self, fh: int) -> None:
        return None

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise FUSEError(errno.EROFS)
        while self._matches("hang_open", self.paths.get(inode, b"")):
            await trio.sleep(0.05)
        if self._matches("fail_open", self.paths.get(inode, b"")):
            raise FUSEError(getattr(errno, str(self.rules().get("open_errno", "EIO"))))
        try:
            fd = os.open(self._real(inode), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        self.open_paths[fd] = self.paths[inode]
        # no page cache here: every read reaches the rules, like a network filesystem without caching
        return pyfuse3.FileInfo(fh=fd, direct_io=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        rel = self.open_paths[fh]
        while self._matches("hang", rel):
            await trio.sleep(0.05)
        if self._matches("eio", rel):
            after = int(self.rules().get("eio_after", 0))
            if off >= after:
                raise FUSEError(errno.EIO)
            size = min(size, after - off)
        return os.pread(fh, size, off)

    async def release(self, fh: int) -> None:
        self.open_paths.pop(fh, None)
        os.close(fh)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        out = pyfuse3.StatvfsData()
        vfs = os.statvfs(self.root)
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                     "f_favail", "f_namemax"):
            setattr(out, name, getattr(vfs, name))
        return out


def main() -> int:
    root, mountpoint, rules = sys.argv[1:4]
    ops = FaultFS(os.fsencode(os.path.abspath(root)), rules)
    pyfuse3.init(ops, mountpoint, {"fsname=faultfs", "ro", "default_permissions"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
