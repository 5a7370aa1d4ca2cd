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

* ``cluster-writer``, ``lying-peer`` and ``job-hopper`` (issue 38's "Done means") together, on passthrough: the
  mount's cluster level on a real memcached (values sealed under a cluster key) that ``nobody`` rewrites over TCP,
  beside a fake memcached in the same ``--cluster`` list that lies to every call; and, on the same
  ``--allow-other`` mount, ``nobody`` starting short jobs in new sessions, a third of them under the readers' own
  ``LIQUIDFS_JOB``. 0 wrong bytes (the readers' and the hopper's), no hang, no read failed, the writer's values
  rejected (more rejections than the lying peer can account for), the peer asked, the readers' job never moved,
  and the daemon's peak RSS not risen by a flood behind a 1 TiB header.

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
from memcacheds import memcached_binary  # noqa: F401  (a fixture)

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


@pytest.mark.needs_root("the attackers drop to nobody (os.setuid) on an --allow-other mount")
def test_memcached_writer_lying_peer_and_job_hopper_serve_no_wrong_byte(tmp_path: Path, memcached_binary: str) -> None:
    # 12 s: the writer can rewrite only what the readers' reads put in memcached first, and on CI's loaded 2 cores
    # 8 s once ended before it had rewritten any
    rc, summary, text = run_soak(tmp_path, "--attacks", "cluster-writer,lying-peer,job-hopper", "--data-path",
                                 "passthrough", "--seconds", "12", "--count", "16", "--readers", "3", timeout=300)
    (row,) = summary["rows"]
    near, daemon = row["neighbours"], row["daemon"]
    writer, liar, hopper, job = near["cluster-writer"], near["lying-peer"], near["job-hopper"], near["readers_job"]
    assert summary["hangs"] == 0, [h["what"] for h in row["hangs"]]
    assert summary["wrong"] == 0, (row["wrong_reads"][:3], hopper["wrong"][:3])
    # nothing but the cluster and the jobs was attacked: a lie or a rewrite is a miss, never a failed read
    assert row["reads"] > 0 and row["errors"] == {} and daemon["errors"] == 0, (row["errors"], daemon)
    assert row["unexpected"] == [] and row["disconnected"] == 0 and row["watchdog"]["failures"] == []
    assert row["final"]["ok"] == 16, row["final"]
    # the writer, as nobody, rewrote sealed values; the mount refused more of them than the peer's lies that can
    # be refused (a 1 TiB header, a value of random bytes) could account for
    assert writer["uid"] == 65534 and writer["rewrites"] > 0 and near["sealed"], json.dumps(writer)  # all of it
    assert daemon["cluster_rejected"] > liar["rejectable_sent"], (daemon, liar)
    # the lying peer was placed a share of the keys (its port drawn so: CI once placed it none of 8), was asked,
    # and cost the readers nothing but time within the fetch's deadline
    assert liar["keys"] > 0 and liar["keys_placed"] >= liar["keys"] * soak.neighbours.LEAST_SHARE, liar
    assert liar["connections"] > 0, liar
    peak = near["daemon_memory"]
    assert peak["at_end"]["peak_rss_kib"] - peak["after_mount"]["peak_rss_kib"] < soak.neighbours.RSS_RISE_KIB, peak
    # nobody's jobs came and went; the readers' job kept its id, and its epochs and reads only counted up
    assert hopper["uid"] == 65534 and hopper["read"] > 0 and hopper["as_readers_job"] > 0, hopper
    assert job["nobody_jobs_at_most"] > 0, job
    # nobody's opens under the readers' LIQUIDFS_JOB were counted in a job of nobody's, never in the readers'
    assert job["nobody_had_the_name"] > 0, job
    assert job["unmoved"] and len(job["readers_job_ids"]) == 1 and job["samples"] > 3, job
    assert rc == 0, text
