"""An unmodified DALI CPU pipeline, as a training script would write it (default reader options): the package's
(liquidfs.profile.loaders.dali_pipeline), each image decoded and kept under its path."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def dali_decode_all(file_root: Path, batch_size: int = 4, threads: int = 2,
                    shuffle: bool = False) -> dict[str, np.ndarray]:
    """Decode every image under ``file_root`` (class sub-directories) with fn.readers.file + fn.decoders.image."""
    from liquidfs.profile.loaders import dali_batches, dali_pipeline, reader_epoch_size

    # random_shuffle: the reader fills a shuffle buffer first (opening and mapping up to 1,024 files)
    p = dali_pipeline(file_root=file_root, batch=batch_size, threads=threads, shuffle=shuffle, source_info=True)
    total = reader_epoch_size(p)
    out: dict[str, np.ndarray] = {}
    # Each epoch holds every image once: a second one without them all is a reader (or a mount) gone wrong, which
    # must fail the test rather than hang it
    for images, _, infos in dali_batches(p, 2 * total):
        for i in range(len(images)):
            info = bytes(infos.at(i)).decode()
            # DALI reports the path as it listed it: relative to file_root in some versions, absolute in others
            name = os.path.relpath(info, file_root) if os.path.isabs(info) else os.path.normpath(info)
            out.setdefault(name, np.array(images.at(i)))
        if len(out) >= total:
            return out
    raise AssertionError(f"two epochs of DALI's reader over {file_root} gave {len(out)} of its {total} images")
