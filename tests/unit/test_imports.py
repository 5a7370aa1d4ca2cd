"""The import graph of the package: acyclic (module-level and function-level imports alike), its folders in one
order (a folder imports only folders below it), the phases blind to the kind of storage, and each storage backend
whole in its folder under ``stores/``, reached only through the map of ``stores`` (``stores.BACKENDS``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from layout import FOLDERS  # scripts/layout.py: the order docs/layout.md draws

PACKAGE = Path(__file__).resolve().parents[2] / "liquidfs"
#: The backends' folders, as modules of the package name them.
BACKENDS = ("stores.local", "stores.s3")
#: Modules at the top of the package, outside every folder: the package itself and ``python -m liquidfs``.
TOP = ("__init__", "__main__")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is None:  # from . import formats
            found.update("." * node.level + alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + node.module)
            found.update("." * node.level + node.module + "." + alias.name for alias in node.names)
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
    if importer in TOP:
        package = []
    base = package[:len(package) - (level - 1)] if level > 1 else package
    rest = name.lstrip(".")
    return ".".join([*base, rest] if rest else base) or None


def _graph() -> dict[str, set[str]]:
    """Each module of the package (``stores.s3.store``; a package by its own name) and the modules it imports."""
    modules = {p.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."): p
               for p in PACKAGE.rglob("*.py")}
    modules = {name if name in TOP else name.removesuffix(".__init__"): p for name, p in modules.items()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {_resolve(name, imported) for imported in _imports(path)}
        # "from .x import Name" names x.Name, a module only where Name is one
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _in(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def _folder(module: str) -> str:
    return module.split(".")[0]


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


def test_every_module_lives_in_a_folder_of_the_order() -> None:
    """``ls liquidfs/`` shows the parts: no module beside the folders but the package's own two."""
    loose = {m for m in _graph() if m not in TOP and _folder(m) not in FOLDERS}
    assert not loose, f"modules outside the folders of FOLDERS: {sorted(loose)}"
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FOLDERS)


def test_a_folder_imports_only_folders_below_it() -> None:
    """Every import between two folders points down FOLDERS (imports inside functions included)."""
    upward = sorted(f"{m} -> {t}" for m, targets in _graph().items() for t in targets
                    if m not in TOP and t not in TOP and _folder(m) != _folder(t)
                    and FOLDERS.index(_folder(m)) > FOLDERS.index(_folder(t)))
    assert not upward, "imports that run up the folder order:\n" + "\n".join(upward)


@pytest.mark.parametrize("phase", ["prepare", "profile", "daemon"])
def test_the_phases_never_ask_which_kind_of_store(phase: str) -> None:
    """They see storage through the Store interface and the reader protocols alone, never a backend."""
    graph = _graph()
    for module in (m for m in graph if _in(m, phase)):
        reached = {t for t in graph[module] if any(_in(t, b) for b in BACKENDS)}
        assert not reached, (module, reached)
        path = PACKAGE / (module.replace(".", "/") + ".py")
        path = path if path.exists() else PACKAGE / module.replace(".", "/") / "__init__.py"
        assert "is_url" not in path.read_text(), module


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
    """The FUSE operations hold one ``datapath.base.DataPath`` and never ask which serves: they import neither
    data path, nor a store; the data paths and the held levels reach storage only through the reader protocols
    (``stores.reader``)."""
    graph = _graph()
    operations = graph["fuse.operations"]
    assert "datapath.base" in operations
    assert not operations & {"datapath.daemon", "datapath.passthrough", "datapath.backing", "daemon.build"}
    assert not {t for t in operations if _in(t, "stores")} - {"stores.reader"}
    for module in (m for m in graph if _in(m, "datapath") or _in(m, "held")):
        assert not {t for t in graph[module] if _in(t, "stores")} - {"stores.reader"}, module
