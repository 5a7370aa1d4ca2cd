"""Where a dataset is read and its raw objects and catalog live: one ``Store`` interface, one implementation per
kind of storage, and ``open_store`` that picks it from what the user typed (as s3ql maps a storage URL's scheme
to its backend class).

``prepare``, ``verify``, ``profile`` and ``mount`` take a Store and never ask which kind it is:

* ``LocalStore`` (``stores.local``): a source directory, and a store directory for the catalog and objects;
* ``BucketStore`` (``stores.bucket``): a source prefix in an object store, and a store prefix there (the catalog
  every node mounts from is uploaded there; each node keeps its copy in a local work directory).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..s3 import is_url
from .base import Job, Preparation, Store


def open_store(source: str | os.PathLike[str], store: str | os.PathLike[str] | None) -> Store:
    """The Store for a source and a store as the user gave them: an s3:// pair, or local directories (the store
    defaulting to this user's cache directory for the source)."""
    if is_url(str(source)) or (store is not None and is_url(str(store))):
        from .bucket import BucketStore

        return BucketStore.from_urls(str(source), None if store is None else str(store))
    from .local import LocalStore

    return LocalStore(Path(source).absolute(), None if store is None else Path(store).absolute())


def open_prepared(store: str | os.PathLike[str]) -> Store:
    """A store prepare has written, found by its location alone: the source is the one its catalog names."""
    if is_url(str(store)):
        from .bucket import BucketStore

        return BucketStore.prepared(str(store))
    from .local import LocalStore

    return LocalStore.prepared(Path(store).absolute())


__all__ = ["Job", "Preparation", "Store", "open_prepared", "open_store"]
