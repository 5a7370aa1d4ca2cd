"""docs/layout.md describes the tree as it is: its table is what scripts/layout.py generates from the package
(folders, modules, line counts, where each is tested), and its folder order is the import test's."""

from __future__ import annotations

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
