"""The ``Store`` interface every backend implements (``stores.local``, ``stores.s3``), and ``Backend``: what
``open_store`` asks of a backend's Store class."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..catalog.catalog import Catalog
from ..catalog.nodes import Node
from ..expand.rawformats import DEFAULT
from .sample import Sample

if TYPE_CHECKING:
    from .reader import Reader

#: What a worker process runs for one image: a picklable function and its arguments.
Job = tuple[Callable[..., Any], tuple[object, ...]]


def refused_unread(why: str) -> str:
    """A verify job's verdict, given before anything is read (a function a worker process can be sent): a row a
    mount would not serve raw, whatever its object holds."""
    return why


@dataclass
class Preparation:
    """The catalog a prepare writes its selection into, how the selection becomes the one mounts read, and what
    becomes of what it learnt when it stops with ``PrepareError`` (the selection then unchanged)."""

    catalog: Catalog
    publish: Callable[[], None]
    keep_after_failure: Callable[[], None]


class Store(Protocol):
    """A dataset's source and its store, of whatever kind."""

    #: The store, as messages name it (a directory, or s3://bucket/prefix).
    label: str
    #: The raw formats this store can hold (names of ``expand.rawformats.RAW_FORMATS``), in the order prepare
    #: tries them.
    raw_formats: tuple[str, ...]
    #: Storage reads a mount keeps in flight by default (``mount --threads``).
    default_threads: int
    #: Whether its objects carry a stamp that lets a stat vouch for them (``catalog.identity.object_stamp``): an object
    #: reused without one is read and checked again by its worker, so that it gains one.
    stamps_objects: bool
    #: Whether the source's own modes say who may read each file (a local directory's: a cluster without a key
    #: shares what everyone may read). An object store's files are read by whoever holds its credentials.
    shares_by_modes: bool

    @property
    def source_label(self) -> str:
        """The source, as messages name it."""

    # -- prepare ---------------------------------------------------------------------------------------

    def preparing(self, progress: bool) -> AbstractContextManager[Preparation]:
        """The catalog of the source as it is now, carrying what earlier prepares learnt, for one prepare of this
        store at a time. Changes not published when the block ends are dropped (after a ``PrepareError``, prepare
        calls ``keep_after_failure`` first)."""

    def expansion_job(self, root: bytes, node: Node, obj: str, raw_formats: tuple[str, ...]) -> Job:
        """The worker call that expands ``node`` into ``obj`` and returns its ``Outcome``."""

    def exists(self, obj: str, size: int | None = None, stamp: str | None = None) -> bool:
        """Whether ``obj`` is there to be reused unread: at its name, of ``size`` bytes and (a store that stamps
        its objects) with the ``stamp`` recorded when it was written or last checked. One changed since (a byte
        overwritten, a copy of the store: another inode) is made again by a worker, which keeps it where it
        holds exactly the expansion's bytes, and records its stamp anew."""
        ...

    def since_scan(self, node: Node) -> Node | None:
        """``node`` as its source is now, where the file was changed in place since the catalog's scan (a write,
        a truncation, its mtime put back: nothing its directory's mtime shows, so the catalog stays fresh); None
        where it is as the row says, or where only a new scan or listing can tell (gone, replaced, an object
        store's). Prepare refreshes the row and expands what the file holds now, in a prepare's block only."""

    def delete(self, objs: list[str]) -> None: ...

    def stray(self, kept: set[str]) -> list[str]:
        """Objects under ``OBJECTS/`` that ``kept`` does not name: leftovers of killed runs."""

    def deleting(self) -> AbstractContextManager[bool]:
        """Held while the surplus is deleted and the new selection published: True when objects may be deleted
        (no running mount's catalog can name them), False when they must be kept for now."""

    # -- verify ----------------------------------------------------------------------------------------

    def verify_jobs(self) -> tuple[list[Node], Callable[[Node], Job]]:
        """The raw files of the store's catalog and, per file, the worker call that checks it (None or what is
        wrong)."""

    # -- profile ---------------------------------------------------------------------------------------

    def profile_sample(self, count: int, jobs: int, seed: int = 0, raw_format: str = DEFAULT.name,
                       max_bytes: int | None = None) -> Sample:
        """``count`` random images expanded (to ``raw_format``, one of ``raw_formats``) where the mount will read
        them, fewer where their expansions reach ``max_bytes`` first, or the images the memory they may hold
        (``sample.Sample.full``), with the function
        that times reads of them, ``jobs`` at once; raises ``ProfileError`` when none can be."""

    def local_dirs(self) -> tuple[Path, Path] | None:
        """The source directory and the store's, where both are on this node (``profile``'s measured search
        copies a sample into the store's and mounts it); None where the dataset is not local."""

    def keep_profile(self, text: str) -> None:
        """Keep the profile's result (JSON) where ``profile_choice`` finds it."""

    def profile_choice(self) -> float | None:
        """The raw share the kept profile chose (``mount --mix adaptive`` starts there), if one is kept."""

    # -- mount -----------------------------------------------------------------------------------------

    def mount_catalog(self, *, rescan: bool, progress: bool = True) -> Path:
        """The directory on this node holding the catalog a mount serves: built, refreshed or fetched as
        needed (``rescan``: from a fresh scan or listing of the source)."""

    def found_catalog(self) -> Path:
        """The same directory, for a daemon whose parent ``mount`` has just made it ready: found, not fetched."""

    def hold_for_mount(self, catalog_dir: Path) -> None:
        """Called once by a mount before it opens the catalog: keeps prepare from deleting objects it names."""

    def reader(self, catalog: Catalog, threads: int, io_timeout: float) -> Reader:
        """The mount's reader of originals and objects (``stores.local.reader``, ``stores.s3.reader``); ``threads``:
        the storage calls it may be asked at once (the open pool's and --threads' together)."""


class Backend(Protocol):
    """A backend's Store class, as ``stores.BACKENDS`` names it for a URL scheme: a Store from what the user
    typed, or from a store's location alone."""

    def given(self, source: str | os.PathLike[str], store: str | os.PathLike[str] | None) -> Store:
        """The Store for a source and a store as the user gave them (None: the backend's default, if it has one);
        CatalogError for a pair it cannot serve."""

    def prepared(self, store: str | os.PathLike[str]) -> Store:
        """A store prepare has written, found by its location alone: the source is the one its catalog names."""
