"""The local backend's reader: what a mount serves from a source directory and a store directory, the raw object
when it is sound, else the original. Every name of the catalog is opened below a root held open since mount time,
without following links (``paths``); whole-file reads bypass the page cache (``directio``).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from ...catalog.identity import object_key, object_stamp
from ...catalog.nodes import Node
from ...sysio import access
from ...sysio.directio import POOL, read_span
from ...sysio.paths import (
    LOCAL_FILESYSTEMS,
    filesystem_type,
    filesystem_type_of,
    open_below,
    open_below_stat,
    open_dir,
    open_to_others,
    renamed_only_by_its_writer,
    stat_below,
)
from ...sysio.short import short_of_resources
from ..reader import (
    OBJECT_NAME,
    UNTRUSTED_REASON,
    WHOLE_FILE_LIMIT,
    Choice,
    Content,
    FallbackLog,
    check_raw,
    unfit_raw_row,
    read_settled,
    same_file,
    stamp,
)

log = logging.getLogger(__name__)


class StoreReader:
    """Opens the content of catalog nodes: the raw object when it is sound, the source otherwise."""

    def __init__(self, source_root: bytes, store_dir: Path, *, held: tuple[int, int] | None = None) -> None:
        """``held``: the (root, objects) descriptors of a reader of this mount made before (another loop's, of
        ``mount --loops``): the same directories, never the paths resolved again (duplicates of them, this
        reader's to close)."""
        self.source_root = source_root
        self.store_dir = store_dir
        self._objects_where = os.fsencode(store_dir / "objects")  # what an object's error names (once, not per open)
        self.root_fd = self.objects_fd = -1
        try:
            self._hold_directories(held)
            self._judge_directories()
        except BaseException:  # (an objects "directory" that is a file, EMFILE at a dup): none of them kept open
            self.close()
            raise

    def _judge_directories(self) -> None:
        """What the directories held say about serving from them: whether others may rename objects in, and
        whether a stat is the inode's own (a local filesystem)."""
        # Who may have put each object at its name (``may_serve``): where others may rename the objects
        # directory's subdirectories, nobody's object is trusted; else each subdirectory's stat, taken once.
        self._objects_open = self.objects_fd >= 0 and open_to_others(os.fstat(self.objects_fd))
        if self._objects_open:
            log.warning("%s: group or others may write it and rename what is in it: no raw object of it is "
                        "served, the originals are (chmod go-w, or +t, the directory)", self._objects_where)
        self._subdirs: dict[str, os.stat_result] = {}
        # An object's stamp (``catalog.identity.object_stamp``) vouches for it only where a stat is the inode's own, not
        # attributes a network or FUSE filesystem may have cached for seconds. Of the directories held, not of
        # their paths, which may name others by now (by path only where mountinfo shows no mount of the device
        # held: a btrfs subvolume's).
        objects_type = (filesystem_type_of(self.objects_fd) or filesystem_type(str(self.store_dir / "objects"))
                        ) if self.objects_fd >= 0 else None
        self.stamps_vouch = objects_type in LOCAL_FILESYSTEMS
        # Whether an error at an object may be its filesystem's server's own answer rather than this kernel's:
        # a FUSE server answers any errno it likes (EMFILE too), and so do virtiofs's and 9p's host daemons; an
        # NFS client's descriptors and memory are this node's. Unknown: taken as a server's.
        self._server_errnos = objects_type is None or objects_type.startswith(("fuse", "virtiofs", "9p"))
        self._fallbacks = FallbackLog(log)
        # check_source is one stat of a path looked up at the previous open: on a local filesystem it is
        # answered from the dentry cache, and a worker thread would cost more than the stat (~1/4 of a cache
        # hit's CPU). Anything else (NFS, FUSE) is checked in a worker thread, under --io-timeout. The raw objects
        # too are opened on the loop where this says so (``choose(cached_only=True)``): a cached lookup still
        # asks an NFS or FUSE filesystem at the open itself, so an objects directory elsewhere (a link to
        # another disk) must be local as well, or a server that stops answering holds every request.
        self.inline_check = (filesystem_type_of(self.root_fd) or filesystem_type(self.source_root)) \
            in LOCAL_FILESYSTEMS and (self.objects_fd < 0 or self.stamps_vouch)

    def _hold_directories(self, held: tuple[int, int] | None) -> None:
        """The source root and the objects directory, opened (or ``held``'s, duplicated)."""
        if held is not None:
            self.root_fd = os.dup(held[0])
            self.objects_fd = os.dup(held[1]) if held[1] >= 0 else -1
            return
        # Held from mount time: every path of the catalog is resolved below these, never through the paths
        # again (a root renamed or swapped for a link while the mount runs serves nothing else).
        self.root_fd = open_dir(self.source_root)
        # The objects directory as the store's owner set it up at mount time (it may be a link to another
        # disk); names below it are resolved without links.
        try:
            self.objects_fd = open_dir(self.store_dir / "objects")
        except FileNotFoundError:  # nothing prepared raw
            self.objects_fd = -1

    def open_source(self, node: Node, *, cached_only: bool = False) -> int:
        return open_below(self.root_fd, node.path, self.source_root, cached_only=cached_only)

    def open_object(self, node: Node, *, cached_only: bool = False) -> int:
        """The raw object's descriptor: a name prepare gives, a regular file below the store, no link."""
        return self.open_object_stat(node, cached_only=cached_only)[0]

    def open_object_stat(self, node: Node, *, cached_only: bool = False) -> tuple[int, os.stat_result]:
        """``open_object``, and the object's stat."""
        return open_below_stat(self.objects_fd, self._object_below(node), self._objects_where,
                               cached_only=cached_only)

    def _object_below(self, node: Node) -> bytes:
        """The path of ``node``'s raw object below the objects directory: a name prepare gives, this file's own
        (``unfit_raw_row``: a catalog writer pointing a row at another image's object, its size and checksum
        copied along, would have it served as this file)."""
        unfit = unfit_raw_row(node)
        if unfit is not None:
            raise OSError(errno.EIO, f"{unfit}: refused", os.fsdecode(node.path))
        if self.objects_fd < 0:
            raise FileNotFoundError(errno.ENOENT, "the store had no objects directory at mount", node.object)
        return os.fsencode(str(node.object)[len("objects/"):])

    def warm(self, node: Node) -> None:
        """Bring the dentries and inodes an open of ``node`` walks into the kernel's caches (the source's, and
        the raw object's), reading no byte of either: ``lookahead`` calls it ahead of the opens."""
        for dir_fd, rel in self.warm_walks(node):
            stat_below(dir_fd, rel)

    def warm_walks(self, node: Node) -> list[tuple[int, bytes]]:
        """The walks an open of ``node`` makes, each a directory held since mount and a path below it: what
        ``warm`` stats, and what a helper process given ``warm_descriptors`` stats instead (``fuse.warm_helper``).
        An object whose name an open would refuse is not walked."""
        walks = [(self.root_fd, node.path)]
        if node.served_raw and node.object is not None:
            try:
                walks.append((self.objects_fd, self._object_below(node)))
            except OSError:
                pass  # the open refuses it, and serves the original: its source is walked
        return walks

    @property
    def warm_descriptors(self) -> tuple[int, ...]:
        """The directories ``warm_walks`` names."""
        return tuple(fd for fd in (self.root_fd, self.objects_fd) if fd >= 0)

    def close(self) -> None:
        for fd in (self.root_fd, self.objects_fd):
            if fd >= 0:
                os.close(fd)
        self.root_fd = self.objects_fd = -1

    def readable_inode(self, node: Node, uid: int, gid: int, pid: int = 0) -> int | None:
        """The inode number of ``node``'s source as the caller (``uid``/``gid``, the groups of process ``pid``)
        may read it now, as the kernel would decide for them below the source root; None where they may not
        (``sysio.access.readable_inode``). The catalog's modes are those of the scan: a ``chmod 600`` or a
        denying ACL since then must bind other users of an --allow-other mount; and the open serves only that
        inode (a file swapped in after the check is not the one checked)."""
        return access.readable_inode(self.root_fd, node.path, uid, gid, access.caller_groups(pid))

    def choose(self, node: Node, *, cached_only: bool = False) -> Choice:
        """What an open of ``node`` serves, and how far a stat vouches for it: the one decision both data paths
        take (passthrough hands the chosen descriptor to the kernel, ``datapath.backing.vouched``; the daemon path reads
        it, ``open``, or defers its read, ``vouch``).

        The source is reached below the root without links and compared with the catalog (size, mtime, inode,
        ctime): stat-ed where a raw object may be served, opened where the original is. A node with a raw object is served raw while the source is unchanged and the object can be
        opened (a name prepare gives, a regular file below the objects directory, no link); ``sealed`` says
        whether a stat vouches for the object (its size, its inode unchanged since prepare sealed the store),
        else its BLAKE2b digest must be checked before any byte is served. Otherwise the original is served, and
        for a raw node ``fallback`` says why. ``cached_only``: BlockingIOError where an open would wait for the disk.
        """
        if node.served_raw and self.inline_check:
            # The source is only compared with the catalog here: on a local filesystem a stat of it (an O_PATH walk)
            # is the inode's own and cheaper than an open, which is made only where the original is served after
            # all. Elsewhere (NFS, FUSE) a stat may be answered from attributes cached for seconds, a file deleted
            # meanwhile included: the open asks the server.
            st = stat_below(self.root_fd, node.path, self.source_root, cached_only=cached_only)
            changed = self.check_source(node, st)
            if changed is None:
                raw = self._raw_choice(node, cached_only)
                if isinstance(raw, Choice):
                    return raw
                changed = raw
            self.warn_once(node, changed)
            # The original is served, judged by the stat of what was opened (it may have changed since the one
            # above); its size may differ from the catalog's (the caller corrects it).
            source, st = open_below_stat(self.root_fd, node.path, self.source_root, cached_only=cached_only)
            return Choice(source, st, raw=False, sealed=self.check_source(node, st) is None, fallback=changed)
        # The source opened (what the original of a file without a raw object serves, and elsewhere than a local
        # filesystem the check of a raw node's source).
        source, st = open_below_stat(self.root_fd, node.path, self.source_root, cached_only=cached_only)
        try:
            changed = self.check_source(node, st)
            why = changed
            if node.served_raw and changed is None:
                raw = self._raw_choice(node, cached_only)
                if isinstance(raw, Choice):
                    return raw
                why = raw
            if why is not None:
                self.warn_once(node, why)
            chosen = Choice(source, st, raw=False, sealed=changed is None, fallback=why if node.served_raw else None)
            source = -1  # the choice owns it now
            return chosen
        finally:
            if source >= 0:
                os.close(source)

    def _raw_choice(self, node: Node, cached_only: bool) -> Choice | str:
        """The raw object of ``node`` (its source checked), or why it cannot be served."""
        unfit = unfit_raw_row(node)
        if unfit is not None:
            return unfit
        try:
            obj, ost = self.open_object_stat(node, cached_only=cached_only)
        except BlockingIOError:
            raise
        except FileNotFoundError:
            return "raw object missing"
        except OSError as exc:
            if self._short_here(exc):
                raise
            return f"raw object unreadable ({exc.strerror})"
        if not self.may_serve(node, ost):
            os.close(obj)
            return UNTRUSTED_REASON
        return Choice(obj, ost, raw=True, sealed=self.object_sealed(node, ost))

    def _short_here(self, exc: OSError) -> bool:
        """Whether ``exc`` at a raw object's open or read says this daemon or node is out of descriptors or memory
        (``sysio.short``): the object may be sound. Served as its original, the open would supersede every open
        still reading the object (``datapath.daemon``) and count a fallback for a file nothing is wrong with: the
        open fails with that errno instead. Not where the objects' server may answer so itself (FUSE, virtiofs,
        9p): there the original is served."""
        return short_of_resources(exc) and not self._server_errnos

    def may_serve(self, node: Node, st: os.stat_result) -> bool:
        """Whether the raw object of ``node`` (``st``: its stat) can only have been put at its name by whoever
        wrote it. Its name binds it to its source (``catalog.identity.object_key``), but a user who may rename in
        the directory it is in can move there an object of an image they cannot read (root's prepare wrote it)
        under the name of one they can, and have its pixels served as that file. So the directory must be one
        nobody but root and the object's owner may write (``sysio.paths.renamed_only_by_its_writer``): a store
        prepared as another user and mounted by root serves their objects, never one of root's moved in."""
        if self._objects_open:
            return False
        sub = node.object[len("objects/"):len("objects/") + 2]  # type: ignore[index]  # a name checked at open
        if sub not in self._subdirs:
            # Taken once per subdirectory. Only the objects directory's owner (and root) may swap one for another
            # (``_objects_open``); a swapped one holds objects under the names they had, each its own file's.
            try:
                self._subdirs[sub] = os.stat(sub, dir_fd=self.objects_fd, follow_symlinks=False)
            except OSError:
                return False
        return renamed_only_by_its_writer(self._subdirs[sub], st.st_uid)

    def open(self, node: Node) -> Content:
        """What ``node`` serves, read whole: the raw object when sound (digest verified), else the source."""
        chosen = self.choose(node)
        try:
            if chosen.raw:
                problem, data = self._read_raw(node, chosen.fd, chosen.st, chosen.sealed)
                if data is not None:
                    return Content(size=len(data), raw=True, data=data, pooled=True)
                self.warn_once(node, problem)
                chosen.close()
                chosen = self._original(node, problem)
            if chosen.st.st_size > WHOLE_FILE_LIMIT:
                streamed = chosen.take()  # the content owns it now
                return Content(size=chosen.st.st_size, raw=False, fd=streamed, fallback=chosen.fallback,
                               version=chosen.version)
            data = read_settled(chosen.fd, chosen.st, os.fsdecode(node.path))
            return Content(size=len(data), raw=False, data=data, fallback=chosen.fallback, pooled=True,
                           version=chosen.version)
        finally:
            chosen.close()

    def vouch(self, node: Node, *, cached_only: bool = False) -> bool:
        """True when what ``node`` serves is known without reading it, so it may be read at its first read:
        the source unchanged, and a raw object as prepare left it (``choose``). Its checksum is still checked
        when it is read; a mismatch then fails that read with EIO (the original could not be served at the size
        promised) and the next open serves the original. ``cached_only``: as ``choose``."""
        chosen = self.choose(node, cached_only=cached_only)
        try:
            return chosen.sealed and chosen.fallback is None  # a fallback is read at open: its size may differ
        finally:
            chosen.close()

    def object_sealed(self, node: Node, st: os.stat_result) -> bool:
        """The raw object behind ``st`` is the one prepare wrote or last read whole and checked: its inode, ctime
        and size are those recorded then (``catalog.identity.object_stamp``; any write, truncation or replacement since
        changes one), and the size served. Evidence about this object alone: no later run vouches for it
        without reading it."""
        return (self.stamps_vouch and node.object_stamp is not None and st.st_size == node.served_size
                and object_stamp(st) == node.object_stamp)

    def check_source(self, node: Node, st: os.stat_result | None = None, *, cached_only: bool = False,
                     version: tuple[int, int, int, int] | None = None) -> str | None:
        """None while the source is the file the catalog describes (or, given ``version``, the changed source an
        earlier open was served: ``Content.version``); else what changed. The path is walked below
        the held root as every open walks it (``sysio.paths.stat_below``: no link, no other filesystem), never by a
        path ``stat``, which follows links on the way (a directory swapped for a link into the mount would make
        the daemon wait for itself). ``cached_only``: BlockingIOError where the walk would wait for the disk."""
        if st is None:
            st = stat_below(self.root_fd, node.path, self.source_root, cached_only=cached_only)
        if version is not None:
            return None if stamp(st) == version else "source changed again since an open read it"
        if not same_file(node, st):
            return "source changed since prepare" if node.served_raw else "source changed since the scan"
        return None

    def _read_raw(self, node: Node, fd: int, st: os.stat_result,
                  sealed: bool) -> tuple[str | None, memoryview | None]:
        """The raw object (``st``: its stat at the open) read whole and checked against its digest; else why not.
        ``sealed``: its stamp vouched for it before the read, and must still after it (``check_raw``: nobody wrote
        it in between). One of another size is refused unread, and no more than the size recorded is read: an
        object a store writer grew (a sparse file of 100 GB) never fills the daemon's memory."""
        if st.st_size != node.served_size:  # (its row checked by the choice: ``unfit_raw_row``)
            return f"raw object has {st.st_size} bytes, expected {node.served_size}", None
        try:
            data = read_span(fd, 0, node.served_size)
        except OSError as exc:
            if self._short_here(exc):
                raise
            return f"raw object unreadable ({exc.strerror})", None
        try:
            problem = check_raw(node, data, sealed=sealed and self.object_sealed(node, os.fstat(fd)))
        except BaseException:
            POOL.give(data)
            raise
        if problem:
            POOL.give(data)  # never served: the buffer may take the next file
            return problem, None
        return None, data

    def _original(self, node: Node, why: str | None) -> Choice:
        """The source, for a raw node whose object turned out unsound when read."""
        source = self.open_source(node)
        try:
            return Choice(source, os.fstat(source), raw=False, sealed=False, fallback=why)
        except BaseException:
            os.close(source)
            raise

    def read_span(self, node: Node, raw: bool, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of what ``node`` served (its raw object, or its source), for a read of part of
        a file whose bytes were let go; the caller checks them against the digests of what was served."""
        fd = self.open_object(node) if raw else self.open_source(node)
        try:
            return read_span(fd, start, end)
        finally:
            os.close(fd)

    def warn_once(self, node: Node, why: str | None) -> None:
        self._fallbacks.warn_once(node, os.fsdecode(node.path), why)

