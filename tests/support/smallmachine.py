"""A machine with little memory, as prepare's worker plan sees it (``liquidfs.expand.workers``, faked in-process), and
two photo PNGs of which only the small one fits: tests/unit/test_resources.py and its mount test."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

from liquidfs.expand import workers as resources
from liquidfs.expand.workers import WORKER_BASE_BYTES, expansion_need
from sample import _photos, mosaic

MiB = 1 << 20


def fake_machine(monkeypatch: pytest.MonkeyPatch, available: int | None, cpus: int = 8) -> None:
    monkeypatch.setattr(resources, "available_memory", lambda *a, **k: available)
    monkeypatch.setattr(resources, "usable_cores", lambda: cpus)


def photo_png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    mosaic(width, height, random.Random(seed), _photos()).save(buf, format="PNG")
    return buf.getvalue()


def two_images(src: Path) -> tuple[Path, Path]:
    src.mkdir(parents=True)
    small, big = src / "small.png", src / "big.png"
    small.write_bytes(photo_png(64, 32, 3))
    big.write_bytes(photo_png(1024, 512, 4))  # 0.5 Mpx: ~13 MB to expand
    return small, big


def limit_for(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with 4 cores and room for one worker that fits ``small`` and not 1 MB more."""
    need = expansion_need(64 * 32, small.stat().st_size)
    fake_machine(monkeypatch, WORKER_BASE_BYTES + need + MiB, cpus=4)
    assert expansion_need(1024 * 512, 0) > need + MiB
