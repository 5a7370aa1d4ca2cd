"""The scripts of the benchmark suite (scripts/bench/) as modules, for tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


def load_script(name: str, folder: Path | None = None) -> ModuleType:
    """scripts/bench/NAME.py (or FOLDER/NAME.py), imported once per session (as ``bench_scripts.NAME``)."""
    module_name = f"bench_scripts.{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, (folder or BENCH) / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
