"""Where a dataset is read and its raw objects and catalog live: one ``Store`` interface (``stores.base``), one
backend per kind of storage, each whole in its folder, and one map from the URL scheme of a location to its
backend's Store class (``BACKENDS``, as s3ql's ``backends/__init__.py``): another kind of storage (``gs://``) is a
folder and an entry there.

``prepare``, ``verify``, ``profile`` and ``mount`` take a Store and never ask which kind it is:

* ``stores.local`` (``LocalStore``): a source directory, and a store directory for the catalog and objects;
* ``stores.s3`` (``BucketStore``): a source prefix in an S3-compatible object store, and a store prefix there (the
  catalog every node mounts from is uploaded there; each node keeps its copy in a local work directory).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Final

from .base import Backend, Job, Preparation, Store


def _local() -> Backend:
    from .local import LocalStore

    return LocalStore


def _s3() -> Backend:
    from .s3 import BucketStore

    return BucketStore


#: Each backend's Store class by the URL scheme of the locations it serves ("" for a local path), imported when a
#: location of its scheme is opened: a local mount never loads the S3 backend.
BACKENDS: Final[Mapping[str, Callable[[], Backend]]] = {"": _local, "s3": _s3}


def scheme(location: str | os.PathLike[str]) -> str:
    """The scheme of ``location`` among ``BACKENDS`` ("s3" for ``s3://bucket/prefix``); "" for a local path (a
    path object is always one)."""
    if isinstance(location, str):
        for name in BACKENDS:
            if name and location.startswith(f"{name}://"):
                return name
    return ""


def open_store(source: str | os.PathLike[str], store: str | os.PathLike[str] | None) -> Store:
    """The Store for a source and a store as the user gave them: the backend of whichever of the two has a scheme
    (it refuses a pair of two kinds), else local directories (the store defaulting to this user's cache directory
    for the source)."""
    kind = scheme(source) or ("" if store is None else scheme(store))
    return BACKENDS[kind]().given(source, store)


def open_prepared(store: str | os.PathLike[str]) -> Store:
    """A store prepare has written, found by its location alone: the source is the one its catalog names."""
    return BACKENDS[scheme(store)]().prepared(store)


__all__ = ["BACKENDS", "Backend", "Job", "Preparation", "Store", "open_prepared", "open_store", "scheme"]
