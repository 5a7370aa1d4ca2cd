"""One Store interface: ``open_store`` picks the implementation from what the user typed, and the code that
uses a store (prepare, verify, profile, mount) never asks which kind it is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from liquidfs.catalog import CatalogError
from liquidfs.stores import open_prepared, open_store
from liquidfs.stores.bucket import BucketStore
from liquidfs.stores.local import LocalStore

PACKAGE = Path(__file__).resolve().parents[2] / "liquidfs"


def test_a_directory_pair_is_a_local_store(tmp_path: Path) -> None:
    store = open_store(tmp_path / "data", tmp_path / "store")
    assert isinstance(store, LocalStore)
    assert store.label == str(tmp_path / "store") and store.source_label == str(tmp_path / "data")
    assert "j2k" in store.raw_formats


def test_a_local_store_defaults_to_this_users_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = open_store(tmp_path / "data", None)
    assert store.label.startswith(str(tmp_path / "cache" / "liquidfs"))


def test_an_s3_pair_is_a_bucket_store_and_holds_bmp_only() -> None:
    store = open_store("s3://src/data", "s3://dst/data.liquid")
    assert isinstance(store, BucketStore)
    assert store.label == "s3://dst/data.liquid" and store.source_label == "s3://src/data"
    assert store.raw_formats == ("bmp",)


@pytest.mark.parametrize("source, store", [("s3://b/data", None), ("s3://b/data", "/local/store"),
                                           ("/local/data", "s3://b/store"), ("s3://b/data", "s3://b/data/store")])
def test_a_mixed_or_nested_pair_is_refused(source: str, store: str | None) -> None:
    with pytest.raises(CatalogError):
        open_store(source, store)


def test_a_prepared_local_store_is_found_by_its_directory_alone(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="no catalog"):
        open_prepared(tmp_path / "empty")


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


@pytest.mark.parametrize("module", ["prepare.py", "profile.py", "mount.py"])
def test_the_phases_never_ask_which_kind_of_store(module: str) -> None:
    imported = _imports(PACKAGE / module)
    assert not any(name.endswith(("s3", "s3store", "s3reader", "stores.bucket", "stores.local")) for name in imported)
    assert "is_url" not in (PACKAGE / module).read_text()


def test_the_package_has_no_import_cycle() -> None:
    """Module-level and function-level imports alike: the graph of the package is acyclic."""
    modules = {p.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."): p
               for p in PACKAGE.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): p for name, p in modules.items()}

    def resolve(importer: str, name: str) -> str | None:
        if not name.startswith("."):
            return name.removeprefix("liquidfs.") if name.startswith("liquidfs.") else None
        level = len(name) - len(name.lstrip("."))
        package = importer.split(".") if (PACKAGE / (importer.replace(".", "/") + "/__init__.py")).exists() \
            else importer.split(".")[:-1]
        base = package[:len(package) - (level - 1)] if level > 1 else package
        rest = name.lstrip(".")
        return ".".join([*base, rest] if rest else base) or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {resolve(name, imported) for imported in _imports(path)}
        # "from . import Job" names the package itself when Job is no module of it
        targets |= {t.rsplit(".", 1)[0] for t in targets if t and t not in modules and "." in t}
        graph[name] = {t for t in targets if t in modules and t != name}
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


def test_the_adaptive_mix_starts_at_the_share_the_kept_profile_chose(tmp_path: Path) -> None:
    store = open_store(tmp_path / "data", tmp_path / "store")
    (tmp_path / "store").mkdir()
    assert store.profile_choice() is None  # none kept: the mix starts mid-range
    store.keep_profile('{"chosen": 0.93, "table": []}')
    assert store.profile_choice() == 0.93
    for bad in ('{"chosen": 1.5}', '{"chosen": "0.9"}', '{"other": 1}', "not json"):
        store.keep_profile(bad)
        assert store.profile_choice() is None, bad
    assert open_store("s3://src/data", "s3://dst/data.liquid").profile_choice() is None
