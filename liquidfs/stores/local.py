"""A dataset in a local directory, its catalog and raw objects in a store directory (``Store``).

Layout of a store directory::

    catalog.sqlite            the catalog mounts read (replaced whole by prepare: ``catalog.WorkingCopy``)
    objects/ab/<hash>.bmp     raw objects (.jp2 for JPEG 2000), written to a temporary name, fsynced, renamed
    profile.json              what ``prepare --ratio auto`` measured: ``mount --mix adaptive`` starts there
    prepare.lock, mounts.lock prepares take turns; a running mount keeps prepare from deleting its objects
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import formats
from ..catalog import Catalog, Node, WorkingCopy, default_store_dir, open_or_build
from ..expansion import OBJECT_SUFFIXES, OBJECTS, expand_one, is_image, verify_one
from ..locks import MOUNTS_LOCK, PREPARE_LOCK, exclusive_lock, shared_lock
from ..paths import open_below, open_dir
from ..reader import Reader, StoreReader, same_file
from ..timedreads import ProfileError, Sample
from .base import Job, Preparation

log = logging.getLogger(__name__)

#: The profile ``prepare --ratio auto`` ran, kept in the store: the adaptive mix starts at its choice.
PROFILE_NAME = "profile.json"


class LocalStore:
    default_threads = 4
    raw_formats: tuple[str, ...] = ("j2k", "bmp")

    def __init__(self, source: Path, store_dir: Path | None = None) -> None:
        self.source = source
        self.store_dir = store_dir if store_dir is not None else default_store_dir(source)
        self.label = str(self.store_dir)

    @classmethod
    def prepared(cls, store_dir: Path) -> LocalStore:
        catalog = Catalog.open(store_dir, readonly=True)
        try:
            return cls(Path(os.fsdecode(catalog.source)), store_dir)
        finally:
            catalog.close()

    @property
    def source_label(self) -> str:
        return str(self.source)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.source)!r}, {str(self.store_dir)!r})"

    # -- prepare ---------------------------------------------------------------------------------------

    @contextmanager
    def preparing(self, progress: bool) -> Iterator[Preparation]:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        held = exclusive_lock(self.store_dir / PREPARE_LOCK, wait=False)
        if held is None:  # prepares of one store run one after another: the next reuses what the first did
            log.warning("another prepare of %s is running: waiting for it", self.store_dir)
            held = exclusive_lock(self.store_dir / PREPARE_LOCK)
        assert held is not None
        try:
            open_or_build(self.source, self.store_dir).close()
            work = WorkingCopy(self.store_dir)
            try:
                # After a failure the catalog is published all the same: the selection is unchanged, and what was
                # expanded is known to the next run.
                yield Preparation(work.catalog, work.publish, keep_after_failure=work.publish)
            finally:
                work.discard()  # after a publish: nothing left to do
        finally:
            os.close(held)

    def expansion_job(self, root: bytes, node: Node, obj: str, raw_formats: tuple[str, ...]) -> Job:
        return expand_one, (root, node.path, str(self.store_dir), obj, node.size, node.mtime_ns, node.etag,
                            raw_formats)

    def exists(self, obj: str) -> bool:
        return (self.store_dir / obj).exists()

    def delete(self, objs: list[str]) -> None:
        for obj in objs:
            (self.store_dir / obj).unlink(missing_ok=True)

    @contextmanager
    def deleting(self) -> Iterator[bool]:
        # Every mount of this store holds MOUNTS_LOCK shared from before it opens the catalog until it ends:
        # taken here, no mount runs, and none can start until the new catalog is in place.
        held = exclusive_lock(self.store_dir / MOUNTS_LOCK, wait=False)
        if held is None:
            log.info("a mount of %s is running: surplus objects are kept for it", self.store_dir)
        try:
            yield held is not None
        finally:
            if held is not None:
                os.close(held)

    def stray(self, kept: set[str]) -> list[str]:
        objects = self.store_dir / OBJECTS
        if not objects.is_dir():
            return []
        return [name for sub in objects.iterdir() for f in sub.iterdir()
                if (name := f"{OBJECTS}/{sub.name}/{f.name}") not in kept]

    # -- verify ----------------------------------------------------------------------------------------

    def verify_jobs(self) -> tuple[list[Node], Callable[[Node], Job]]:
        catalog = Catalog.open(self.store_dir, readonly=True)
        try:
            nodes = [n for n in catalog.files() if n.served_raw]
            root = catalog.source
        finally:
            catalog.close()

        def job(n: Node) -> Job:
            return verify_one, (root, n.path, str(self.store_dir / str(n.object)), str(n.checksum), n.size,
                                n.mtime_ns, n.etag)

        return nodes, job

    # -- profile ---------------------------------------------------------------------------------------

    def profile_sample(self, count: int, jobs: int, seed: int = 0, raw_format: str = "bmp") -> Sample:
        """Expanded into a ``profile-sample-*`` directory of this run's own inside the store, on its device."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        open_or_build(self.source, self.store_dir).close()
        catalog = Catalog.open(self.store_dir, readonly=True)
        try:
            root = catalog.source
            nodes = [n for n in catalog.files() if is_image(n.name)]
        finally:
            catalog.close()
        if not nodes:
            raise ProfileError("no PNG/JPEG images in the source")
        random.Random(seed).shuffle(nodes)
        # A directory of this run's own: profiles run at once on one store (a Job's pods) must not share or
        # delete each other's sample.
        scratch = Path(tempfile.mkdtemp(prefix="profile-sample-", dir=self.store_dir))
        sample = Sample([], [], scratch, cleanup=lambda: shutil.rmtree(scratch, ignore_errors=True))
        root_fd = open_dir(root)
        try:
            for node in nodes:
                if len(sample.raws) >= count:
                    break
                try:  # read as the mount reads: below the root, no link followed, the file the catalog recorded
                    fd = open_below(root_fd, node.path, root)
                    try:
                        if not same_file(node, os.fstat(fd)):
                            continue
                        with open(fd, "rb", closefd=False) as f:
                            data = f.read()
                    finally:
                        os.close(fd)
                except OSError as exc:
                    log.warning("profile: skipping %r: %s", node.path, exc)
                    continue
                result = formats.expand(data, to=raw_format)
                if result.data is None:
                    continue
                out = scratch / f"{node.id}{OBJECT_SUFFIXES[raw_format]}"
                out.write_bytes(result.data)
                # Timed where the mount will read it.  The timing reads discard what they read, so a path
                # swapped for a link since cannot carry anyone's bytes anywhere.
                sample.originals.append(Path(os.fsdecode(os.path.join(root, node.path))))
                sample.raws.append(out)
                sample.original_data.append(data)
                sample.raw_data.append(result.data)
        finally:
            os.close(root_fd)
        if not sample.raws:
            sample.cleanup()
            raise ProfileError("none of the sampled images can be expanded losslessly")
        return sample

    def keep_profile(self, text: str) -> None:
        (self.store_dir / PROFILE_NAME).write_text(text)

    def profile_choice(self) -> float | None:
        path = self.store_dir / PROFILE_NAME
        try:
            chosen = json.loads(path.read_text())["chosen"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s: unreadable (%s); the adaptive mix starts in the middle of the prepared range", path, exc)
            return None
        if not isinstance(chosen, (int, float)) or not 0 <= chosen <= 1:
            log.warning("%s: 'chosen' is not a share in [0, 1]; ignored", path)
            return None
        return float(chosen)

    # -- mount -----------------------------------------------------------------------------------------

    def mount_catalog(self, *, rescan: bool, progress: bool = True) -> Path:
        if not self.source.is_dir():
            raise NotADirectoryError(f"source {self.source} is not a directory")
        open_or_build(self.source, self.store_dir, rescan=rescan).close()
        return self.store_dir

    def found_catalog(self) -> Path:
        return self.store_dir

    def hold_for_mount(self, catalog_dir: Path) -> None:
        # Held until this process ends: prepare deletes no object while any mount of the store runs, so every
        # object the catalog opened next names stays (a new selection replaces the catalog file; this mount
        # keeps reading the one it opened).
        try:
            shared_lock(catalog_dir / MOUNTS_LOCK)
        except OSError as exc:
            log.warning("cannot lock %s (%s): a prepare of this store may delete objects this mount serves",
                        catalog_dir / MOUNTS_LOCK, exc.strerror)

    def reader(self, catalog: Catalog, threads: int, io_timeout: float) -> Reader:
        return StoreReader(catalog.source, self.store_dir, catalog.sealed_ns)
