"""The profile's decode measurements (``profile.decoders``) driven without a GPU: how busy they keep the threads."""

from __future__ import annotations

import io
import threading
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
    # Every decode waits for 7 others to be under way beside it, once: only 8 at once pass (2 at once never do)
    together = threading.Barrier(8, timeout=10)
    met = []
    real_open = Image.open

    def open_together(*args: Any, **kwargs: Any) -> Any:
        if not met:
            try:
                together.wait()
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", open_together)
    rate = decoders.measure_pil([buf.getvalue()] * 2, threads=8, seconds=0.3)
    assert met and met[0] and rate.images_per_s > 0, met
