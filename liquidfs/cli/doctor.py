"""``liquidfs doctor``: what this machine offers the passthrough data path, checked one ingredient at a time.

The mount decides for itself after the connection's INIT (and logs one line saying which path and why); this
command says beforehand what is missing, without mounting anything.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..sysio.paths import filesystem_type
from ..sysio.privileges import has_cap_sys_admin
from .options import CommandParser

#: Linux gained FUSE passthrough (read, write, splice and mmap) in 6.9.
MIN_KERNEL = (6, 9)
MIN_LIBFUSE = (3, 17)
#: Filesystems that are themselves stacked: a backing file on one of them has a stack depth of 1, which the
#: mount allows (``max_backing_stack_depth = 1``); a backing on anything stacked deeper is refused.
_STACKED = frozenset({"overlay", "ecryptfs"})


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool | None  # None: could not tell
    found: str
    needed: str = ""


def kernel_check(release: str | None = None) -> Check:
    release = release or os.uname().release
    m = re.match(r"(\d+)\.(\d+)", release)
    version = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return Check("kernel", version >= MIN_KERNEL, release, ">= 6.9")


def _kernel_config() -> str | None:
    release = os.uname().release
    for path in (Path("/proc/config.gz"), Path(f"/boot/config-{release}")):
        try:
            data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        except (OSError, EOFError, zlib.error):  # unreadable, or a truncated or corrupt gzip
            continue
        return data.decode(errors="replace")
    return None


def kernel_config_check(config: str | None = None) -> Check:
    config = config if config is not None else _kernel_config()
    if config is None:
        return Check("CONFIG_FUSE_PASSTHROUGH", None, "no kernel config readable (the mount probes it at INIT)", "y")
    on = "CONFIG_FUSE_PASSTHROUGH=y" in config
    return Check("CONFIG_FUSE_PASSTHROUGH", on, "y" if on else "not set", "y")


def verity_check(config: str | None = None) -> Check:
    """fs-verity is not used on raw objects yet: no kernel this project was developed or tested on has it, so a
    verity path could not be exercised.  Say whether this kernel could, and what checks the objects instead."""
    config = config if config is not None else _kernel_config()
    kernel = ("unknown kernel config" if config is None else
              "kernel has CONFIG_FS_VERITY" if "CONFIG_FS_VERITY=y" in config else
              "kernel built without CONFIG_FS_VERITY")
    return Check("fs-verity on raw objects", None, f"not used ({kernel}): raw objects are checked by size and "
                 "their inode's seal at open, by checksum at prepare, in `verify` and with --verify-reads")


def libfuse_check() -> Check:
    """The libfuse this process's pyfuse3 is linked to (from the mapped library's file name)."""
    try:
        import pyfuse3  # noqa: F401  (maps libfuse3 into this process)
    except ImportError as exc:  # libfuse3.so missing: what doctor is run to find
        return Check("libfuse", False, f"pyfuse3 does not load: {exc}", ">= 3.17")

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return Check("libfuse", None, "cannot read /proc/self/maps", ">= 3.17")
    libs = sorted({line.split()[-1] for line in maps.splitlines() if "libfuse3.so" in line})
    for lib in libs:
        m = re.search(r"libfuse3\.so\.(\d+)\.(\d+)(?:\.(\d+))?", os.path.realpath(lib))
        if m:
            version = (int(m.group(1)), int(m.group(2)))
            return Check("libfuse", version >= MIN_LIBFUSE, f"{'.'.join(g for g in m.groups() if g)} ({lib})",
                         ">= 3.17")
    return Check("libfuse", None, ", ".join(libs) or "not found", ">= 3.17")


def pyfuse3_check() -> Check:
    try:
        import pyfuse3

        from ..datapath import passthrough  # (imported here: every other command's parser is built without it)
    except ImportError as exc:
        return Check("pyfuse3 passthrough patch", False, f"does not load: {exc}", "scripts/passthrough (install.sh)")

    missing = passthrough.built_in()
    version = getattr(pyfuse3, "__version__", "?")
    return Check("pyfuse3 passthrough patch", missing is None,
                 f"{version}, {'patched' if missing is None else 'stock'}", "scripts/passthrough (install.sh)")


def capability_check(status: str | None = None, uid_map: str | None = None) -> Check:
    """CAP_SYS_ADMIN in the initial user namespace: the kernel checks it at each backing registration."""
    try:
        status = status if status is not None else Path("/proc/self/status").read_text()
        uid_map = uid_map if uid_map is not None else Path("/proc/self/uid_map").read_text()
    except OSError as exc:
        return Check("CAP_SYS_ADMIN", None, str(exc), "in the initial user namespace")
    has = has_cap_sys_admin(status)
    initial = uid_map.split() == ["0", "0", "4294967295"]
    found = ("yes" if has else "no") + ("" if initial else ", in a user namespace (not the initial one)")
    return Check("CAP_SYS_ADMIN", has and initial, found, "in the initial user namespace (root, or a privileged "
                 "container)")


def _there(path: Path) -> bool:
    """Whether ``path`` is there, or cannot be told (a directory above it this user may not search)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def store_check(store: Path) -> Check:
    fstype = filesystem_type(str(store)) or "unknown"
    stacked = fstype in _STACKED
    # A store not made yet is made by prepare on the filesystem of the directory above it that is there: said as
    # that, never as a store found on it.
    # (a directory above that this user may not search: taken as there, never a PermissionError ending every
    # check)
    there = next((p for p in (store, *store.absolute().parents) if _there(p)), None)
    where = str(store) if there == store else f"{store} is not there yet: made on {there}'s"
    return Check("store filesystem", fstype != "unknown", f"{fstype} ({where})" + (
        ", stacked: depth 1, allowed" if stacked else ""), "a local filesystem; stack depth <= 1")


def checks(store: Path | None = None) -> list[Check]:
    found = [kernel_check(), kernel_config_check(), libfuse_check(), pyfuse3_check(), capability_check()]
    if store is not None:
        found.append(store_check(store))
    found.append(verity_check())
    return found


def verdict(found: list[Check]) -> str:
    blocking = [c for c in found if c.ok is False and c.name != "store filesystem"]
    if not blocking:
        return "passthrough: every ingredient is here; the mount logs which path it took"
    return "daemon path: " + "; ".join(f"{c.name} is {c.found} (needs {c.needed})" for c in blocking)


def add_arguments(sub: argparse._SubParsersAction[CommandParser],
                  add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    """The parser of ``doctor``."""
    d = sub.add_parser("doctor", help="say whether this machine can serve through FUSE passthrough, and why not",
                       description="Check each ingredient of the passthrough data path (kernel, its config, the "
                       "libfuse pyfuse3 is linked to, the pyfuse3 patch, CAP_SYS_ADMIN, the store's filesystem) "
                       "without mounting. A mount decides for itself at start and logs which path it took.")
    d.add_argument("--store", help="also check the filesystem of this store directory")
    d.add_argument("--json", action="store_true", help="print JSON")
    add_common(d)
    d.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    found = checks(Path(args.store) if args.store else None)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in found], "verdict": verdict(found)}, indent=1))
        return 0
    width = max(len(c.name) for c in found)
    for c in found:
        mark = {True: "ok", False: "NO", None: "?"}[c.ok]
        print(f"{mark:<3} {c.name:<{width}}  {c.found}" + (f"  (needs {c.needed})" if c.ok is False else ""))
    print(verdict(found))
    return 0
