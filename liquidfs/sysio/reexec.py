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

__all__ = ["helpers_off_cwd", "isolated_env", "python_words", "popen", "run", "users_env"]

#: ``PYTHONSAFEPATH`` as the user set it, once ``helpers_off_cwd`` changed it (``(None,)``: unset); None before.
_USERS_SAFEPATH: tuple[str | None] | None = None


def helpers_off_cwd() -> None:
    """The Python helpers that multiprocessing starts for this process (prepare's and verify's forkserver, its
    resource tracker) kept from importing from the working directory: they run as ``python -c ...``, whose
    import path starts with it, so root's prepare run in a directory a dataset's writer may write (the source,
    /tmp) took their ``multiprocessing`` from there. They inherit this process's environment, with
    ``PYTHONSAFEPATH`` set; a user's own command (``profile --run``) gets the user's (``users_env``)."""
    global _USERS_SAFEPATH
    if _USERS_SAFEPATH is None:
        _USERS_SAFEPATH = (os.environ.get("PYTHONSAFEPATH"),)
    os.environ["PYTHONSAFEPATH"] = "1"


def users_env() -> dict[str, str]:
    """This process's environment as the user gave it, for a command of the user's own (``profile --run``: a
    ``python train.py`` imports its own modules from its directory, which ``PYTHONSAFEPATH`` would hide)."""
    env = dict(os.environ)
    if _USERS_SAFEPATH is not None:
        users = _USERS_SAFEPATH[0]
        if users is None:
            env.pop("PYTHONSAFEPATH", None)
        else:
            env["PYTHONSAFEPATH"] = users
    return env


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
