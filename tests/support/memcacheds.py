"""Debian's memcached for the tests that start real ones (the cluster level's, the soak's memcached writer)."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture
def memcached_binary() -> str:
    """The memcached binary: a skip where it is not installed, a failure in CI (scripts/test.sh installs it)."""
    binary = shutil.which("memcached") or shutil.which("memcached", path="/usr/bin:/usr/sbin")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("memcached not installed (scripts/test.sh installs it with apt)")
        pytest.skip("memcached not installed (apt-get install memcached)")
    return binary
