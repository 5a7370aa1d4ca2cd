"""liquidfs's own re-execs of itself (the daemon, its watchdog, the profile's scratch mounts and built-in pipeline),
isolated from whoever started them.

liquidfs runs as root over directories others write. A ``python -m liquidfs`` started in such a directory would
import a ``liquidfs/__init__.py`` planted there (the cwd is first on ``sys.path``), and ``PYTHONPATH`` or
``PYTHONSTARTUP`` would do the same from the environment. So every re-exec runs ``python -I`` (no cwd, no user
site, no ``PYTHON*`` variables on the path), in ``/``, with the ``PYTHON*`` variables removed from its
environment too (its own children, a loader's worker processes, may not all be started with ``-I``). A user's
``--run`` command is the user's own and runs as given; only the words liquidfs itself writes come from here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["isolated_env", "python_words", "popen", "run"]


def python_words(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` of this very interpreter, isolated (``-I``)."""
    return [sys.executable, "-I", "-m", module, *args]


def isolated_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's environment by default) without the ``PYTHON*`` variables."""
    return {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("PYTHON")}


def popen(module: str, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``module`` started with ``args``, isolated and in ``/``; ``kwargs`` as ``subprocess.Popen`` takes them
    (not ``cwd`` nor ``env``: the isolation is not to be undone by a caller)."""
    return subprocess.Popen(python_words(module, *args), cwd="/", env=isolated_env(), **kwargs)


def run(module: str, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``module`` run to its end with ``args``, isolated and in ``/`` (``subprocess.run``'s ``kwargs``)."""
    return subprocess.run(python_words(module, *args), cwd="/", env=isolated_env(), **kwargs)
