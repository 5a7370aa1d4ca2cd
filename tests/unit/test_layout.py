"""docs/layout.md describes the tree as it is: its table is what scripts/layout.py generates from the package
(folders, modules, line counts, where each is tested), and its folder order is the import test's."""

from __future__ import annotations

import re
from pathlib import Path

import layout  # scripts/layout.py (tests/conftest.py puts scripts/ on the path)


def test_the_layout_doc_table_is_the_tree_as_it_is() -> None:
    doc = layout.LAYOUT.read_text()
    start, end = doc.index(layout.BEGIN), doc.index(layout.END) + len(layout.END)
    assert doc[start:end] == layout.table(), "docs/layout.md is stale: run python scripts/layout.py --write"


def test_every_module_says_where_it_is_tested() -> None:
    assert "nowhere" not in layout.table()


def test_the_layout_doc_draws_the_folder_order_of_the_import_test() -> None:
    doc = layout.LAYOUT.read_text()
    drawn = doc[doc.index("```\n", doc.index("## The import graph")):]
    drawn = drawn[4:drawn.index("```", 4)]
    order = [line.split()[0].rstrip("/") for line in drawn.splitlines() if line.strip()]
    assert tuple(order) == layout.FOLDERS


PACKAGE = layout.PACKAGE
#: Modules of the flat package before the folder move, whose names no module has now: a docstring naming one
#: (``fs.Operations``, ``cache.NextEpochCache``) points at code that moved.
FORMER_MODULES = frozenset({
    "assemble", "cache", "clusterpeers", "clustertier", "daemonpath", "decoderates", "disktier", "fs", "guard",
    "memcachedwire", "memtier", "metricdefs", "mixcontrol", "pipelines", "requesttimes", "resources", "runprofile",
    "soonest", "storage", "timedreads"})
#: Files being split by another branch now (their stale names go with that split).
BEING_SPLIT: tuple[str, ...] = ()  # files left out while another change moved them (none now)
_NAME = re.compile(r"``([A-Za-z_]\w*(?:\.\w+)*)(?:\([^`]*\))?``")  # a call's parentheses too
#: A file's name, not a module's attribute (``profile.json``); ``.py`` ones are checked as paths.
_FILE_SUFFIXES = {"json", "md", "toml", "yaml", "yml", "sh", "cc", "conf", "txt", "lock"}


def _module_file(parts: list[str]) -> Path | None:
    path = PACKAGE.joinpath(*parts)
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _names_in(path: Path, names: list[str]) -> bool:
    source = path.read_text()
    return all(re.search(rf"\b{re.escape(name)}\b", source) for name in names)


def _resolves(name: str) -> bool | None:
    """Whether a dotted name in a docstring names the package's code (None: not the package's to judge).

    ``liquidfs.X.Y`` and ``folder.module.Name`` must be a module and names in it; a module's short name (a
    sibling, ``reader.Content``) must be a module of that name holding the rest; a module gone since the folder
    move never resolves."""
    parts = name.split(".")
    if len(parts) == 1:  # a word: stale only where it is a module gone since the move (``disktier``)
        return False if name in FORMER_MODULES else None
    if parts[-1] in _FILE_SUFFIXES:
        return None
    if parts[-1] == "py":
        return _module_file(parts[:-1]) is not None or any(PACKAGE.rglob(".".join(parts[-2:])))
    if parts[0] == "liquidfs":
        parts = parts[1:]
    if parts[0] in FORMER_MODULES:
        return False
    if parts[0] in layout.FOLDERS or name.startswith("liquidfs."):
        for end in range(len(parts), 0, -1):
            found = _module_file(parts[:end])
            if found is not None:
                return _names_in(found, parts[end:])
        return False
    siblings = [p for p in PACKAGE.rglob(f"{parts[0]}.py")]
    if siblings:
        return any(_names_in(path, parts[1:]) for path in siblings)
    return None


def test_every_dotted_name_a_docstring_gives_the_package_is_there() -> None:
    """About a hundred docstrings named modules as they were before the folder move (``cache.X``, ``fs.``,
    ``disktier``): a reader who followed one found nothing. Every ``liquidfs.X.Y``, ``folder.module.Name`` or
    sibling ``module.Name`` between double backticks must be a module of the package and names in it."""
    stale = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(BEING_SPLIT):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            stale += [f"{rel}:{number}: ``{name}``" for name in _NAME.findall(line) if _resolves(name) is False]
    assert stale == [], "names of code that is not there:\n" + "\n".join(stale)
