"""The FUSE layer: kernel requests translated to plain calls (operations), and what only it needs (metadata read
ahead, request timing)."""
