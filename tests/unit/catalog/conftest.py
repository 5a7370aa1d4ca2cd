"""What the catalog's tests share: the helper processes a build started to write its rows, spied on."""

from __future__ import annotations

from pathlib import Path

import pytest

from liquidfs.catalog import build as build_module
from liquidfs.catalog.sink import ProcessSink


@pytest.fixture
def helpers(monkeypatch: pytest.MonkeyPatch) -> list[ProcessSink]:
    """Each ``ProcessSink`` the builds of the test start, as they start them."""
    started: list[ProcessSink] = []

    def helper(path: Path) -> ProcessSink:
        started.append(ProcessSink(path))
        return started[-1]

    monkeypatch.setattr(build_module, "ProcessSink", helper)
    return started
