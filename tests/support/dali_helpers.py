"""An unmodified DALI CPU pipeline, as a training script would write it (default reader options)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def dali_decode_all(file_root: Path, batch_size: int = 4, threads: int = 2,
                    shuffle: bool = False) -> dict[str, np.ndarray]:
    """Decode every image under ``file_root`` (class sub-directories) with fn.readers.file + fn.decoders.image."""
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None)
    def pipe():
        # random_shuffle: the reader fills a shuffle buffer first (opening and mapping up to 1,024 files)
        encoded, _ = fn.readers.file(file_root=str(file_root), name="reader", random_shuffle=shuffle)
        images = fn.decoders.image(encoded, device="cpu")
        return images, fn.get_property(encoded, key="source_info")

    p = pipe()
    p.build()
    total = p.reader_meta("reader")["epoch_size"]
    out: dict[str, np.ndarray] = {}
    while len(out) < total:
        images, infos = p.run()
        for i in range(len(images)):
            info = bytes(infos.at(i)).decode()
            # DALI reports the path as it listed it: relative to file_root in some versions, absolute in others
            name = os.path.relpath(info, file_root) if os.path.isabs(info) else os.path.normpath(info)
            out.setdefault(name, np.array(images.at(i)))
    return out
