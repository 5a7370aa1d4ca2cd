"""One dataset, many readers on one node (issue 29): the ranks of one distributed job read disjoint shares of
each epoch through one mount, and the next-epoch cache counts their union as the epoch.

Real loaders: ``torchrun`` (gloo, CPU) with ``DistributedSampler`` over an ``ImageFolder`` on the mount, and DALI's
file reader with ``shard_id``/``num_shards``, four ranks each. At the epochs' seams the first ranks (and DALI's
read-ahead) read the next epoch while the last finish theirs: the cache keeps the draining epoch's share and its
files held (``cache.NextEpochCache._drain_reserve``, ``epochs.Job.has_passed``), and a DALI reopen waits for the
memfd its last release is still filling (passthrough).

What is checked is the mount's own account (``liquidfs stats``): every file read once per epoch across the ranks, and the byte hit ratio of each epoch after
the first at the cache's share, as for one reader (``test_cache_mount.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusehelpers import Mount
from trees import noise_pngs
from liquidfs.daemon.control import read_control

pytestmark = pytest.mark.fuse

RANKS = 4
EPOCHS = 3
FILES = 256  # a multiple of RANKS x the batch: no rank pads its share with another's files
SHARE = 0.3

TORCH_RANK = r"""
import sys
import torch
import torch.distributed as dist
from torchvision import datasets

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
root, epochs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dataset = datasets.ImageFolder(root)  # PIL images, decoded: every file opened and read once per sample
sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                                          seed=7)
loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=0,
                                     collate_fn=lambda batch: batch)
samples = 0
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for batch in loader:
        samples += sum(1 for image, _ in batch if image.size[0] > 0)
    dist.barrier()  # the ranks of a training job step together
with open(f"{out}.{rank}", "w") as f:
    f.write(str(samples))
dist.destroy_process_group()
"""

DALI_RANK = r"""
import os
import sys
import time
from nvidia.dali import fn, pipeline_def

root, rank, ranks, epochs, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 8, sys.argv[5]

@pipeline_def(batch_size=batch, num_threads=1, device_id=None, seed=rank + 1, prefetch_queue_depth=1)
def pipe():
    # DALI's sharding as a training script writes it: shard_id/num_shards, shuffled. Each rank keeps its shard
    # (stick_to_shard, DALI's advice where data is cached): with the shards rotating per epoch (the default), a
    # rank's read-ahead (its shuffle buffer, a prefetched batch) reads files of its next shard before the rank
    # reading that shard this epoch has, and the cache, which infers epochs per file, counts one of the two reads
    # as a retry (up to 23 of 256 here): how-it-works says so. A shuffle buffer smaller than a shard, as on a real
    # dataset (DALI's 1,024 against Cityscapes' 2,975): one larger than these 64 files reads the shard over and
    # over before the first batch.
    encoded, label = fn.readers.file(file_root=root, shard_id=rank, num_shards=ranks, random_shuffle=True,
                                     initial_fill=16, stick_to_shard=True, name="reader")
    return encoded, label

def barrier(epoch):
    # The ranks of a training job step together (an allreduce per step); these wait for each other per epoch.
    open(f"{out}.e{epoch}.{rank}", "w").close()
    deadline = time.monotonic() + 300
    while not all(os.path.exists(f"{out}.e{epoch}.{r}") for r in range(ranks)):
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: the others never finished epoch {epoch}")
        time.sleep(0.01)

p = pipe()
p.build()
shard = p.reader_meta("reader")["epoch_size"] // ranks
samples = 0
for epoch in range(epochs):
    for _ in range(shard // batch):
        encoded, _ = p.run()
        samples += len(encoded)
    barrier(epoch)
with open(f"{out}.{rank}", "w") as f:
    f.write(str(samples))
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FILES small PNGs of noise in 4 classes, 3-43 KB each (sizes vary, so bytes and files differ)."""
    return noise_pngs(tmp_path_factory.mktemp("ranks") / "train", count=FILES, classes=4, seed=29, sides=(32, 120))



def _ranks_read(out: Path) -> list[int]:
    return [int(Path(f"{out}.{rank}").read_text()) for rank in range(RANKS)]


#: Reads per epoch the cache may count elsewhere: where one rank's last file of an epoch is another's first of
#: the next (the shuffle spans the ranks), the second read can come too soon after the first to be told from a
#: retry (``cache.NextEpochCache``'s gap rule), as for one reader (``test_cache_mount``: 298 of 300).
AT_THE_SEAMS = 8


def _check_union_epochs(mnt: Path) -> dict:
    """Each complete epoch is every file read once across the ranks, hit at the cache's share after the first."""
    st = read_control(mnt)
    epochs = st["epochs"]
    for e in range(1, EPOCHS + 1):
        # a rank's reads not counted in the union would leave an epoch short by a share (64 files here)
        assert epochs[str(e)]["reads"] >= FILES - AT_THE_SEAMS, epochs
    assert st["cache_same_epoch_reads"] <= AT_THE_SEAMS, st
    assert epochs["1"]["byte_hit_ratio"] == 0
    for e in range(2, EPOCHS + 1):
        assert abs(epochs[str(e)]["byte_hit_ratio"] - SHARE) <= 0.07, epochs
    assert st["cache_held_bytes"] <= st["cache_budget"]
    return st


def test_torchrun_ranks_with_a_distributed_sampler(dataset: Path, mounter: Mount, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
    assert torch.__version__
    mnt = mounter.mount(dataset, "--cache-size", f"{SHARE:.0%}")
    script = tmp_path / "rank.py"
    script.write_text(TORCH_RANK)
    out = tmp_path / "samples"
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={RANKS}", str(script), str(mnt),
                           str(EPOCHS), str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert _ranks_read(out) == [EPOCHS * FILES // RANKS] * RANKS
    st = _check_union_epochs(mnt)
    assert st["opens"] == EPOCHS * FILES  # each sample one open: the union, nothing read twice
    # torchrun's ranks share its session and cgroup: one job, whose epochs are the union (test_jobs_mount: jobs
    # in sessions of their own are told apart)
    assert st["jobs_reading"] == 1, st["jobs"]


def test_dali_shards(dataset: Path, mounter: Mount, tmp_path: Path) -> None:
    mnt = mounter.mount(dataset, "--cache-size", f"{SHARE:.0%}")
    script = tmp_path / "shard.py"
    script.write_text(DALI_RANK)
    out = tmp_path / "samples"
    ranks = [subprocess.Popen([sys.executable, str(script), str(mnt), str(rank), str(RANKS), str(EPOCHS), str(out)],
                              stderr=subprocess.PIPE, text=True) for rank in range(RANKS)]
    for proc in ranks:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    assert _ranks_read(out) == [EPOCHS * FILES // RANKS] * RANKS
    st = _check_union_epochs(mnt)
    assert st["jobs_reading"] == 1 and st["cache_lost_hits"] == 0, st
