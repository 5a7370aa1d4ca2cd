"""liquidfs: a read-only FUSE filesystem serving image datasets as a lossless original/raw mix."""

__version__ = "0.1.0"
