"""System I/O the rest builds on: link-free opens below a root, files written owner-only, page-cache-free reads,
locks, permission checks."""
