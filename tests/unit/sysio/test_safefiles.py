"""Files liquidfs writes for itself (``sysio.safefiles``): never through a link, and never into a file another
user made at the name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from liquidfs.sysio.safefiles import open_append


@pytest.mark.needs_root("a chown to another user")
def test_a_log_another_user_made_at_its_name_is_refused(tmp_path: Path) -> None:
    """A writer of the store (where root's mount log goes) makes ``mount.log`` first, as theirs: root would
    append its daemon's log to a file they read. Refused, naming the owner; one of this user's own is appended."""
    log = tmp_path / "mount.log"
    log.write_text("theirs\n")
    os.chown(log, 65534, 65534)
    with pytest.raises(PermissionError, match=f"uid 65534's file.*{log}"):
        open_append(log)
    assert log.read_text() == "theirs\n"
    os.chown(log, os.geteuid(), os.getegid())
    fd = open_append(log)
    try:
        os.write(fd, b"ours\n")
    finally:
        os.close(fd)
    assert log.read_text() == "theirs\nours\n"
    (tmp_path / "link").symlink_to(log)
    with pytest.raises(OSError, match="symbolic link"):
        open_append(tmp_path / "link")
