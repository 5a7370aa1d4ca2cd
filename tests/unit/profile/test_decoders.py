"""The profile's decode measurements (``profile.decoders``) driven without a GPU: how busy they keep the threads."""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import numpy as np
import pytest
from PIL import Image

from liquidfs.profile import decoders


def test_pillow_is_timed_with_every_thread_busy_however_few_images_the_sample_has(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of the sample, each waited for whole: a sample of fewer images than threads (``--sample 2`` on 8
    cores) decoded two at a time, timing decoding at a quarter of what the loader's 8 threads reach."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "PNG")
    lock = threading.Lock()
    busy = [0, 0]  # now, most at once
    real_open = Image.open

    def open_counted(*args: Any, **kwargs: Any) -> Any:
        with lock:
            busy[0] += 1
            busy[1] = max(busy)
        time.sleep(0.01)  # (a decode long enough for the others to start beside it)
        with lock:
            busy[0] -= 1
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", open_counted)
    rate = decoders.measure_pil([buf.getvalue()] * 2, threads=8, seconds=0.3)
    assert busy[1] == 8 and rate.images_per_s > 0
