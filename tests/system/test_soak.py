"""scripts/attack/soak.py's dataset-writer attacks (issue 26), briefly, against real mounts.

* ``dirflip`` and ``fifo`` during reads, on each data path, with ``--cache-size 100%`` (re-opens of held files
  take the "has the source changed" check): a directory of the source exchanged (renameat2 RENAME_EXCHANGE) with
  a link into the mount itself, an image with a link to a FIFO. Every read must be the file's bytes or a clean
  error, and the soak's watchdog must get `ls MNT` and the mount's stats answered within 10 s throughout. On a
  daemon that stats a source path on its own loop (before the fix) the mount hangs within a second or two: the
  soak sees it, aborts the FUSE connection, and reports the hang, so this test fails in about 30 s and leaves no
  hung mount behind.
* ``profile``: ``liquidfs profile --quick`` while images are exchanged with links to a FIFO once it times reads of
  its sample: it must finish, or fail with a message, within 60 s (before the fix its threads wait in
  ``wait_for_partner`` for good; the soak kills it).

The soak runs as a child process in its own session; whatever happens, no mount is left under the test's
directory (aborted through /sys/fs/fuse/connections, as the soak itself does) and no process of it is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchscripts import BENCH, load_script
from fusehelpers import DATA_PATHS

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

SOAK = BENCH.parent / "attack" / "soak.py"
soak = load_script("soak", SOAK.parent)


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(prefix)]


def run_soak(tmp_path: Path, *args: str, timeout: float) -> tuple[int, dict[str, Any], str]:
    """The soak's exit status, its JSON summary and what it printed."""
    out = tmp_path / "soak.json"
    proc = subprocess.Popen([sys.executable, str(SOAK), *args, "--work", str(tmp_path), "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"the soak itself did not end within {timeout:.0f} s:\n{text}")
    finally:
        left = mounts_under(tmp_path)
        for mnt in left:  # the soak unmounts its own, hung or not; this only guards the machine
            soak.abort_mount(mnt)
    print(text)
    assert not left, f"the soak left mounts behind: {left}"
    assert out.exists(), f"no summary written (exit {proc.returncode}):\n{text}"
    return proc.returncode, json.loads(out.read_text()), text


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_directory_and_fifo_flips_during_reads(tmp_path: Path, data_path: str) -> None:
    rc, summary, text = run_soak(tmp_path, "--attacks", "dirflip,fifo", "--data-path", data_path, "--seconds", "8",
                                 "--count", "16", "--readers", "3", "--deadline", "10", timeout=400)
    (row,) = summary["rows"]
    # the attacks ran, with the cache holding files, and the watchdog asked the mount throughout
    assert row["attacks"]["dirflip"] > 0 and row["attacks"]["fifo"] > 0, row["attacks"]
    assert row["cache_size"] == "100%" and row["watchdog"]["probes"] > 0
    assert row["reads"] > 0
    assert summary["hangs"] == 0, [h["what"] for h in row["hangs"]]
    assert summary["wrong"] == 0, row["wrong_reads"][:3]
    assert row["unexpected"] == [] and row["disconnected"] == 0
    assert row["watchdog"]["failures"] == []
    assert row["final"]["ok"] == 16, row["final"]
    assert rc == 0, text


def test_profile_under_fifo_links_ends(tmp_path: Path) -> None:
    rc, summary, text = run_soak(tmp_path, "--attacks", "profile", "--count", "16", "--profile-deadline", "60",
                                 timeout=300)
    profile = summary["profile"]
    assert profile["attacks"]["started_at_s"] is not None, "the links were never swapped in: " + text
    assert profile["attacks"]["file_swaps"] + profile["attacks"]["dir_swaps"] > 0
    assert not profile["hung"], profile.get("threads")
    # finished, or failed saying why
    assert profile["rc"] == 0 or (profile["last_lines"] and "NO MESSAGE" not in profile["outcome"]), profile
    assert rc == 0, text
