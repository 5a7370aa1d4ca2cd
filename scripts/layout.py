"""docs/layout.md's table of the package, generated from the tree: each folder, each module's lines, its job (the
first sentence of its docstring) and where it is tested. ``python scripts/layout.py`` prints it; ``--write``
replaces the table in docs/layout.md (tests/unit/test_layout.py fails while the two differ)."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "liquidfs"
LAYOUT = REPO / "docs" / "layout.md"
BEGIN = "<!-- layout.py: generated from here -->"
END = "<!-- layout.py: generated to here -->"

#: The package's folders, top first: each imports only folders after it (tests/unit/test_imports.py checks it).
FOLDERS = ("cli", "profile", "prepare", "daemon", "fuse", "datapath", "held", "mix", "policy", "metrics", "stores",
           "expand", "catalog", "sysio")

#: Where a module without a unit test file of its own name (tests/unit/FOLDER/test_MODULE.py) is tested.
TESTED_IN = {
    "catalog/scan.py": "`unit/catalog/test_build.py`",
    "catalog/store_dir.py": "`unit/stores/test_writers.py`, `unit/catalog/test_schema.py`",
    "datapath/limits.py": "`unit/cli/test_light_commands.py` (imports nothing); `unit/daemon/test_config.py`",
    "mix/modes.py": "`unit/cli/test_light_commands.py` (imports nothing); `unit/cli/test_options.py`",
    "cli/__init__.py": "(re-exports ``main``, the console entry point) `unit/cli/test_errors.py`",
    "cli/main.py": "`unit/cli/test_errors.py`, `unit/cli/test_light_commands.py`, and every mount test through "
                   "the command",
    "cli/mount.py": "`unit/cli/test_errors.py`, `unit/daemon/test_config.py`; every mount test",
    "cli/prepare.py": "`unit/cli/test_errors.py`; `mount/test_prepare.py`",
    "cli/profile.py": "`unit/cli/test_errors.py`; `unit/profile/test_choose.py`",
    "daemon/serve.py": "`mount/test_mount.py`, `mount/test_faults.py`",
    "daemon/control.py": "`unit/cli/test_errors.py`; `mount/test_mount.py`",
    "daemon/spawn.py": "`unit/cli/test_errors.py`; `mount/test_mount.py`",
    "daemon/watchdog.py": "`mount/test_faults.py`",
    "daemon/loops.py": "`mount/test_loops.py`",
    "fuse/peers.py": "`unit/fuse/test_peers.py`; `mount/test_loops.py`",
    "datapath/shared_inodes.py": "`unit/datapath/test_shared_inodes.py`; `mount/test_loops.py`",
    "fuse/request_times.py": "`unit/fuse/test_operations.py`",
    "datapath/base.py": "`unit/datapath/test_daemon.py`, `unit/datapath/test_passthrough.py`",
    "datapath/backing.py": "`unit/datapath/test_passthrough.py`",
    "datapath/inodes.py": "`unit/fuse/test_operations.py`, `unit/datapath/test_daemon.py`",
    "datapath/storage_calls.py": "`unit/datapath/test_daemon.py`, `mount/test_faults.py`",
    "policy/epochs.py": "`unit/policy/test_epochs.py`, `unit/policy/test_next_epoch.py`",
    "policy/shared_budget.py": "`unit/policy/test_next_epoch.py`",
    "metrics/defs.py": "`unit/metrics/test_metrics.py`; `system/test_prometheus.py`",
    "metrics/server.py": "`unit/metrics/test_metrics.py`",
    "metrics/stats.py": "`unit/metrics/test_metrics.py`",
    "stores/__init__.py": "`unit/stores/test_stores.py`",
    "stores/base.py": "`unit/stores/test_stores.py`",
    "stores/local/__init__.py": "`unit/stores/test_stores.py`",
    "stores/s3/__init__.py": "`unit/stores/test_s3.py`",
    "stores/reader.py": "`unit/datapath/test_daemon.py`, `unit/datapath/test_passthrough.py`, "
                        "`unit/stores/test_whole_reads.py`",
    "stores/sample.py": "`unit/profile/test_choose.py`",
    "stores/local/store.py": "`unit/stores/test_stores.py`, `unit/stores/test_writers.py`, "
                             "`unit/stores/test_catalog_scans.py`",
    "stores/local/reader.py": "`unit/datapath/test_daemon.py`, `mount/test_trust.py`, "
                              "`unit/stores/test_whole_reads.py`",
    "stores/s3/client.py": "`unit/stores/test_s3.py`, `unit/stores/test_s3_checks.py`",
    "stores/s3/store.py": "`unit/stores/test_s3.py`; `system/test_s3.py`",
    "stores/s3/reader.py": "`unit/stores/test_s3_checks.py`; `system/test_s3.py`",
    "catalog/nodes.py": "`unit/catalog/test_catalog.py`, `unit/fuse/test_operations.py`",
    "catalog/identity.py": "`unit/stores/test_s3_checks.py`, `mount/test_trust.py`",
    "expand/expansion.py": "`unit/stores/test_writers.py`; `mount/test_prepare.py`",
    "expand/checks.py": "`unit/expand/test_formats.py` (through ``formats.expand``, every format)",
    "expand/png.py": "`unit/expand/test_formats.py` (through ``formats.expand``)",
    "expand/jpeg.py": "`unit/expand/test_formats.py` (through ``formats.expand``)",
    "expand/bmp.py": "`unit/expand/test_formats.py` (through ``formats.expand``: the BMP layouts, the round trip)",
    "expand/encoders.py": "`unit/expand/test_rawformats.py`, `unit/expand/test_formats.py`",
    "prepare/__init__.py": "`mount/test_prepare.py`",
    "profile/decoders.py": "`unit/profile/test_choose.py`",
    "sysio/directio.py": "`unit/datapath/test_daemon.py`",
    "sysio/locks.py": "`unit/stores/test_stores.py`",
    "sysio/privileges.py": "`unit/cli/test_doctor.py`",
    "sysio/home.py": "`unit/cli/test_errors.py`",
    "held/cluster_peers.py": "`unit/held/test_cluster.py`",
}


def job_of(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split())
    m = re.match(r"(.+?)\.(\s|$)", text)
    sentence = (m.group(1) if m else text).rstrip(":.")
    if len(sentence) > 160:
        sentence = sentence[:157].rsplit(" ", 1)[0] + " ..."
    return sentence.replace("|", "\\|")


def tested_in(rel: str) -> str:
    path = Path(rel)
    own = REPO / "tests" / "unit" / path.parent / f"test_{path.stem}.py"
    if path.stem != "__init__" and own.exists():
        return f"`unit/{own.relative_to(REPO / 'tests' / 'unit').as_posix()}`"
    return TESTED_IN.get(rel, "**nowhere: say where in scripts/layout.py's TESTED_IN**")


def table() -> str:
    rows = [BEGIN, "", "| folder | module | lines | its job | tested in (`tests/`) |", "|---|---|---|---|---|"]
    for folder in FOLDERS:
        first = True
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            rel = path.relative_to(PACKAGE).as_posix()
            if path.name == "__init__.py" and len(path.read_text().splitlines()) <= 3:
                continue  # a folder's docstring: shown as the folder's job below
            label = f"**`{folder}/`**" if first else ""
            first = False
            lines = len(path.read_text().splitlines())
            rows.append(f"| {label} | `{rel.removeprefix(folder + '/')}` | {lines} | {job_of(path)} | "
                        f"{tested_in(rel)} |")
    rows += ["", END]
    return "\n".join(rows)


def folders() -> str:
    """Each folder's job, from its __init__'s docstring."""
    return "\n".join(f"- `{f}/`: {job_of(PACKAGE / f / '__init__.py')}" for f in FOLDERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="replace the generated table in docs/layout.md")
    args = parser.parse_args()
    text = table()
    if not args.write:
        print(text)
        return
    doc = LAYOUT.read_text()
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    LAYOUT.write_text(doc[:start] + text + doc[end:])


if __name__ == "__main__":
    main()
