"""The import graph of the package: acyclic (module-level and function-level imports alike), the phases blind to
the kind of storage, and each storage backend whole in its folder under ``stores/``, reached only through the map
of ``stores`` (``stores.BACKENDS``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "liquidfs"
#: The backends' folders, as modules of the package name them.
BACKENDS = ("stores.local", "stores.s3")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is None:  # from . import formats
            found.update("." * node.level + alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _resolve(importer: str, name: str) -> str | None:
    """The module of the package that ``importer`` names with ``name`` (relative or absolute), if any."""
    if not name.startswith("."):
        return name.removeprefix("liquidfs.") if name.startswith("liquidfs.") else None
    level = len(name) - len(name.lstrip("."))
    package = importer.split(".") if (PACKAGE / (importer.replace(".", "/") + "/__init__.py")).exists() \
        else importer.split(".")[:-1]
    base = package[:len(package) - (level - 1)] if level > 1 else package
    rest = name.lstrip(".")
    return ".".join([*base, rest] if rest else base) or None


def _graph() -> dict[str, set[str]]:
    """Each module of the package (``stores.s3.store``; a package by its own name) and the modules it imports."""
    modules = {p.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."): p
               for p in PACKAGE.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): p for name, p in modules.items()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {_resolve(name, imported) for imported in _imports(path)}
        # "from . import Job" names the package itself when Job is no module of it
        targets |= {t.rsplit(".", 1)[0] for t in targets if t and t not in modules and "." in t}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _in(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def test_the_package_has_no_import_cycle() -> None:
    """Module-level and function-level imports alike: the graph of the package is acyclic."""
    graph = _graph()
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> None:
        if node in done:
            return
        assert node not in visiting, f"import cycle: {' -> '.join(visiting[visiting.index(node):] + [node])}"
        visiting.append(node)
        for target in sorted(graph[node]):
            visit(target)
        visiting.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


@pytest.mark.parametrize("module", ["prepare", "profile", "mount"])
def test_the_phases_never_ask_which_kind_of_store(module: str) -> None:
    """They see storage through the Store interface alone: ``stores`` and ``stores.base``, no backend."""
    reached = {t for t in _graph()[module] if _in(t, "stores")}
    assert reached <= {"stores", "stores.base"}, reached
    assert "is_url" not in (PACKAGE / f"{module}.py").read_text()


def test_each_backend_is_whole_in_its_folder_and_reached_only_through_the_map() -> None:
    """No module outside a backend's folder imports it but ``stores`` (its ``BACKENDS`` map); a backend imports no
    other backend; and every module of the package that talks to a kind of storage lives in its backend's folder."""
    graph = _graph()
    for backend in BACKENDS:
        importers = {m for m, targets in graph.items()
                     if not _in(m, backend) and any(_in(t, backend) for t in targets)}
        assert importers == {"stores"}, (backend, importers)
    assert {m for m in graph if _in(m, "stores")} >= {"stores.s3.client", "stores.s3.store", "stores.s3.reader",
                                                      "stores.local.store"}
    assert not any("s3" in m for m in graph if not _in(m, "stores.s3")), "S3 code outside stores/s3/"


def test_the_fuse_layer_sees_one_data_path_interface_and_no_store() -> None:
    """fs holds one ``datapath.DataPath`` and never asks which serves: it imports neither data path, nor a
    store's reader; the data paths reach a reader only through the ``reader`` protocols."""
    graph = _graph()
    assert "datapath" in graph["fs"]
    assert not graph["fs"] & {"daemonpath", "passthrough", "backing", "assemble"}
    assert not any(_in(target, "stores") for target in graph["fs"])
    for path in ("daemonpath", "passthrough", "backing", "held", "inodes", "datapath"):
        assert not any(_in(target, "stores") for target in graph[path]), path
