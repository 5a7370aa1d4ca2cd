"""Where liquidfs keeps this user's local state when no path is given: ``$XDG_CACHE_HOME/liquidfs``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """This user's directory for liquidfs's local state (``$XDG_CACHE_HOME/liquidfs``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "liquidfs"
