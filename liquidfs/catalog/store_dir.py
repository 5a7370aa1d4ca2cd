"""Whether a local store's directory may hold a catalog this process takes, or one it writes: by who else may put
names in it.

The daemon and prepare run as root and name their files in the store by path: SQLite opens a catalog, a
catalog in the making and its journal by name, and follows a link there. Whoever else may make or rename
entries in the directory could put a link at such a name once they see it (a catalog in the making is listed
with its lock), or a journal SQLite would take as one to roll back into the catalog, and root would write where
they chose. So nothing is taken from a directory group or others may write, sticky bit or not (the sticky bit
keeps them from renaming root's entries, not from making new ones at the names SQLite will open); and nothing
is written into one whose owner is someone else than root and this user (its owner may do all of that).
A store another user prepared can still be read by root's mount: reading takes their catalog on its checks
(``stores.local.store``), and the mount writes there only where its catalog must be scanned again.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .schema import CatalogError


def check_store_dir(store: Path, *, writing: bool) -> None:
    """CatalogError where a catalog in ``store`` may not be taken (``writing`` False) or written (True), naming
    the directory and the fix; nothing to check where it does not exist yet (this process makes it, under its
    umask). The directory as named: a link to it is its user's choice."""
    why = refusal(store, writing=writing)
    if why is not None:
        raise CatalogError(why)


def refusal(store: Path, *, writing: bool) -> str | None:
    """Why ``check_store_dir`` would refuse, or None (also where the directory is not there or cannot be looked
    at by this user: what is done with it next fails with its own error, naming it)."""
    try:
        st = os.stat(store)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    except OSError as exc:  # ESTALE, EIO: not known, so not written
        return f"{store}: {exc.strerror}: cannot tell who may make names in it"
    if not stat.S_ISDIR(st.st_mode):
        return f"{store}: not a directory (--store names a directory)"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        return (f"{store}: group or others may write it (mode {mode:o}) and make names in it that would be written "
                "through: no catalog is written there, nor taken from it; chmod go-w it")
    if writing and st.st_uid not in (0, os.geteuid()):
        return (f"{store}: owned by uid {st.st_uid}, who may make names in it that this process (uid "
                f"{os.geteuid()}) would write through: it writes no catalog there (a mount without --rescan uses one "
                "only behind the source as it stands); run this as that user, or chown -R the store to this one")
    return moved_refusal(store, st) if writing else None


def make_store_dir(path: Path, advice: str = "give a --store where only root and this user may write") -> None:
    """``path`` made, with the levels missing above it, where ``making_refusal`` has nothing against making them
    (CatalogError saying why otherwise); nothing where it is there (its own check is ``check_store_dir``'s)."""
    if not path.exists():
        refused = making_refusal(path, advice)
        if refused is not None:
            raise CatalogError(refused)
    path.mkdir(parents=True, exist_ok=True)


def making_refusal(path: Path, advice: str = "put it where only root and this user may write", *,
                   modes: bool = True) -> str | None:
    """Why this process may not make ``path`` (missing) and the levels missing above it, or None: the deepest
    level there is belongs to someone else than root and this user, or they may write it (unless it is sticky:
    what this process makes there stays its own), or may move it or one above it (``moved_refusal``). Asked
    before anything is made: where it leads through a link that someone else may point elsewhere, root would
    make directories, and change modes, where they chose. ``modes`` False: only who owns them counts (a
    directory of root's that others may write, a pod's emptyDir, is taken)."""
    existing = next(p for p in Path(os.path.abspath(path)).parents if os.path.lexists(p))
    try:
        st = os.stat(existing)
    except OSError as exc:
        return f"{path}: {existing}: {exc.strerror}: cannot tell who may make names in it"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (0, os.geteuid()):
        why = f"{existing} is owned by uid {st.st_uid}"
    elif modes and mode & 0o022 and not mode & stat.S_ISVTX:
        why = f"group or others may write {existing} (mode {mode:o})"
    else:
        return moved_refusal(existing, st, "it", f"{path} is not made; {advice}", modes=modes)
    return (f"{path}: {why}, who may put a link where this process (uid {os.geteuid()}) would make it: not made; "
            f"{advice}")


def moved_refusal(store: Path, st: os.stat_result, what: str = "the store",
                  then: str = "it writes no catalog there; put the store where only root and this user may "
                              "rename it", *, modes: bool = True) -> str | None:
    """Why the directories above ``store`` (``st``) let someone else than root and this user move it away and
    put a directory of theirs at its name, between a check of it and the names SQLite opens there: one that
    owns one of them, or may write one that is not sticky (a sticky one keeps others from renaming what root or
    this user owns in it: /tmp). None where no one else can. ``what`` and ``then``: how the message names the
    directory, and what this process does not do there. ``modes`` False: only who owns them counts."""
    trusted = (0, os.geteuid())
    # The directories above the path as named too (a link on the way: whoever may rename it in its directory
    # may point it elsewhere), each with what is below it there, and those above where it leads.
    named, real = Path(os.path.abspath(store)), Path(os.path.realpath(store))
    for path in dict.fromkeys((named, real)):
        below = os.lstat(path) if path == named else st
        for above in path.parents:
            try:
                up = os.stat(above)
            except OSError as exc:
                return f"{store}: {above}: {exc.strerror}: cannot tell who may move the store"
            mode = stat.S_IMODE(up.st_mode)
            if stat.S_ISLNK(below.st_mode) and below.st_uid not in trusted:
                # A link of someone else's on the way: wherever it lies, it is theirs to have put there (in a
                # directory they may write, or a sticky one, whatever ``modes`` says of it).
                why = f"a link of uid {below.st_uid}'s is on the way, below {above}"
            elif up.st_uid not in trusted:
                why = f"{above} is owned by uid {up.st_uid}"
            elif modes and mode & 0o022 and not (mode & stat.S_ISVTX and below.st_uid in trusted):
                why = f"group or others may write {above} (mode {mode:o})"
            else:
                below = os.lstat(above)
                continue
            return (f"{store}: {why}, who may move {what} away and put a directory of theirs at its name, "
                    f"which this process (uid {os.geteuid()}) would write through: {then}")
    return None
