"""The ``liquidfs`` command: argument parsing and user-facing messages for every subcommand, one module each
(``mount``: mount, umount, stats; ``prepare``: prepare, verify; ``profile``; ``doctor``), every flag's value read
by ``options``, and ``main`` the entry point."""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
