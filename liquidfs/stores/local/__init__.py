"""The local backend: a dataset in a directory, its catalog and raw objects in a store directory (``store``).

The mount's reader of such a store is ``reader.StoreReader``: the ``Reader`` that also lends descriptors to the
passthrough path and checks the callers of an --allow-other mount.
"""

from __future__ import annotations

from .store import PROFILE_NAME, LocalStore

__all__ = ["LocalStore", "PROFILE_NAME"]
