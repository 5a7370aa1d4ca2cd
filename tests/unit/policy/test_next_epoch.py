"""The next-epoch policy simulated over many epochs of random permutations (no mount, fast)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from liquidfs.policy.budget import DatasetCost, ShareOfCost
from liquidfs.policy.next_epoch import WINDOW, NextEpochCache


def _dataset(n: int, rng: random.Random, spread: float = 0.3) -> dict[int, int]:
    # sizes like a PNG/BMP mix: 2.9 MB and 6.3 MB files, with spread
    return {i + 2: int(rng.choice([2.9e6, 6.3e6]) * rng.uniform(1 - spread, 1 + spread)) for i in range(n)}


def _run_epochs(cache: NextEpochCache, sizes: dict[int, int], epochs: int, rng: random.Random,
                max_held: list[int] | None = None) -> list[list[tuple[bool, int]]]:
    out = []
    files = list(sizes)
    for _ in range(epochs):
        rng.shuffle(files)
        events = []
        for f in files:
            d = cache.read(f, sizes[f])
            if d.same_epoch:  # the first read of an epoch may be taken for a retry (rarely): the next one opens it
                continue
            events.append((d.hit, sizes[f]))
            if max_held is not None:
                max_held.append(cache.held_bytes)
        out.append(events)
    return out


@pytest.mark.parametrize("share", [0.1, 0.3, 0.5])
def test_constant_hit_ratio_and_budget(share: float) -> None:
    rng = random.Random(int(share * 100))
    sizes = _dataset(2000, rng)
    total = sum(sizes.values())
    budget = int(share * total)
    cache = NextEpochCache(budget, total, len(sizes), max_id=max(sizes))
    held: list[int] = []
    epochs = _run_epochs(cache, sizes, 6, rng, held)
    assert max(held) <= budget
    assert cache.stats.same_epoch_reads <= 2
    assert all(not hit for hit, _ in epochs[0])
    bound = 1.25 * math.sqrt(share * (1 - share) / WINDOW)
    pooled: list[float] = []
    firsts: list[float] = []
    lasts: list[float] = []
    for events in epochs[1:]:
        byte_ratio = sum(s for h, s in events if h) / sum(s for _, s in events)
        assert abs(byte_ratio - share) <= 0.03, byte_ratio
        windows = [sum(h for h, _ in events[i:i + WINDOW]) / WINDOW
                   for i in range(0, len(events) - WINDOW + 1, WINDOW)]
        pooled += windows
        # one epoch has ~30 windows: its sd estimate alone is noisy; the bound is checked on all of them below
        assert statistics.pstdev(windows) <= 1.6 * bound, (statistics.pstdev(windows), bound)
        tenth = len(events) // 10
        firsts.append(sum(s for h, s in events[:tenth] if h) / sum(s for _, s in events[:tenth]))
        lasts.append(sum(s for h, s in events[-tenth:] if h) / sum(s for _, s in events[-tenth:]))
    # no drift within an epoch: first and last tenths agree (pooled over epochs: one tenth is 200 reads, whose
    # own sampling noise is ~0.035 at 50 %)
    assert abs(statistics.fmean(firsts) - statistics.fmean(lasts)) <= 0.05, (firsts, lasts)
    assert statistics.pstdev(pooled) <= bound, (statistics.pstdev(pooled), bound)
    summary = cache.summary()
    assert summary["window_hit_ratio_sd"] <= bound
    assert abs(summary["window_hit_ratio_mean"] - share) <= 0.03


def test_budget_larger_than_dataset_holds_everything() -> None:
    rng = random.Random(1)
    sizes = _dataset(300, rng)
    total = sum(sizes.values())
    cache = NextEpochCache(total * 2, total, len(sizes), max_id=max(sizes))
    epochs = _run_epochs(cache, sizes, 3, rng)
    assert all(hit for hit, _ in epochs[1]) and all(hit for hit, _ in epochs[2])


def test_zero_budget_holds_nothing() -> None:
    rng = random.Random(2)
    sizes = _dataset(200, rng)
    cache = NextEpochCache(0, sum(sizes.values()), len(sizes), max_id=max(sizes))
    epochs = _run_epochs(cache, sizes, 3, rng)
    assert not any(hit for e in epochs for hit, _ in e) and cache.held_bytes == 0


def test_same_epoch_reads_and_partial_reads_do_not_break_epochs() -> None:
    rng = random.Random(3)
    sizes = _dataset(1000, rng)
    total = sum(sizes.values())
    cache = NextEpochCache(int(0.3 * total), total, len(sizes), max_id=max(sizes))
    files = list(sizes)
    for epoch in range(1, 5):
        rng.shuffle(files)
        for i, f in enumerate(files):
            d = cache.read(f, sizes[f])
            if i == 0 and d.same_epoch:
                continue
            assert d.epoch == epoch and not d.same_epoch
            if i % 10 == 0:  # a header probe followed by the real read, or a retry
                again = cache.read(f, sizes[f])
                assert again.same_epoch and again.epoch == 0
    assert cache.newest_epoch == 4
    byte_ratio = cache.summary()["epochs"]["4"]["byte_hit_ratio"]
    assert abs(byte_ratio - 0.3) <= 0.03


@pytest.mark.parametrize("nodes", [1, 2, 4, 8])
def test_a_node_reading_a_new_random_shard_each_epoch_follows_the_epochs(nodes: int) -> None:
    """DistributedSampler reshuffled each epoch over several nodes: each node's mount reads a new random 1/nodes of
    the files each epoch, so few of its reads are files it read the epoch before. Its epochs still follow the
    job's, every read counted in one (a guard that asked the newest epoch for a share of the one before's reads
    before a file read again could open the next held these nodes back an epoch or more)."""
    rng = random.Random(11)
    files = list(range(2, 2002))
    sizes = {f: 1000 for f in files}
    cache = NextEpochCache(300 * len(files), 1000 * len(files), len(files), max_id=max(files))
    for epoch in range(1, 9):
        shard = rng.sample(files, len(files) // nodes)
        seen = [cache.read(f, sizes[f]) for f in shard]
        assert cache.newest_epoch == epoch, (nodes, epoch)
        assert sum(d.same_epoch for d in seen) <= 1


def test_a_reader_that_makes_an_epoch_every_few_reads_keeps_the_latest_epochs_counters_only() -> None:
    """Two files opened in turn: each read again opens an epoch. The per-epoch counters are kept for the latest
    EPOCHS_KEPT, not one more every two reads for as long as the mount lives (and sorted at every stats)."""
    from liquidfs.policy.epochs import EPOCHS_KEPT

    cache = NextEpochCache(10_000, 2_000, 2, max_id=3)
    for i in range(2_000):
        cache.read(1 + i % 2, 1_000)
    assert cache.newest_epoch > 100
    epochs = cache.summary()["epochs"]
    assert len(epochs) <= EPOCHS_KEPT and str(cache.newest_epoch) in epochs


def test_next_epoch_may_start_before_the_last_drains() -> None:
    """Two reader processes: one still finishing epoch e while the other starts e+1."""
    rng = random.Random(4)
    sizes = _dataset(1000, rng)
    total = sum(sizes.values())
    share = 0.3
    budget = int(share * total)
    cache = NextEpochCache(budget, total, len(sizes), max_id=max(sizes))
    files = list(sizes)
    orders = []
    for _ in range(6):
        rng.shuffle(files)
        orders.append(files[:])
    # interleave: the last 5 % of epoch e are read mixed with the first 5 % of epoch e+1
    stream: list[int] = []
    tail = int(0.05 * len(files))
    carry: list[int] = []
    for order in orders:
        head, body = order[:tail], order[tail:-tail]
        mixed = [x for pair in zip(carry, head) for x in pair] if carry else head
        stream += mixed + body
        carry = order[-tail:]
    stream += carry
    held = []
    hits_by_epoch: dict[int, list[bool]] = {}
    for f in stream:
        d = cache.read(f, sizes[f])
        if d.same_epoch:
            continue
        hits_by_epoch.setdefault(d.epoch, []).append(d.hit)
        held.append(cache.held_bytes)
    assert max(held) <= budget
    assert sorted(hits_by_epoch) == [1, 2, 3, 4, 5, 6]
    assert cache.stats.same_epoch_reads <= 3
    for e in range(2, 7):
        assert len(hits_by_epoch[e]) >= len(files) - 3
        ratio = sum(hits_by_epoch[e]) / len(files)
        assert abs(ratio - share) <= 0.05, (e, ratio)


def test_warmup_fills_the_budget_for_epoch_one() -> None:
    rng = random.Random(5)
    sizes = _dataset(1000, rng)
    total = sum(sizes.values())
    cache = NextEpochCache(int(0.3 * total), total, len(sizes), max_id=max(sizes))
    for f in cache.warmup_choice(list(sizes), list(sizes.values())):
        assert cache.hold(f, sizes[f])
    assert 0.27 * total <= cache.held_bytes <= 0.3 * total
    epochs = _run_epochs(cache, sizes, 2, rng)
    for events in epochs:
        ratio = sum(s for h, s in events if h) / sum(s for _, s in events)
        assert abs(ratio - 0.3) <= 0.03


def test_warmup_holds_the_share_of_small_files_that_cost_many_times_their_size() -> None:
    """Files of 512 bytes cost a whole page and a memfd's overhead each: the warm-up holds 30 % of them (30 % of
    the dataset's bytes, 30 % of its cost), not 30 % of the bytes counted in costs (a few % of the files)."""
    sizes = {i + 2: 512 for i in range(10_000)}
    total = sum(sizes.values())
    cache = NextEpochCache(ShareOfCost(0.3), total, len(sizes), max_id=max(sizes),
                           cost=DatasetCost(len(sizes), {1: total, 4096: 4096 * len(sizes)}))  # (the catalog's)
    cache.charge_files(page=4096, overhead=1024)
    chosen = cache.warmup_choice(list(sizes), list(sizes.values()))
    assert 0.29 * len(sizes) <= len(chosen) <= 0.3 * len(sizes)
    for f in chosen:
        assert cache.hold(f, sizes[f])
    assert cache.held_bytes <= cache.budget


# -- several jobs on one budget ------------------------------------------------------------------------------


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_jobs(paces: tuple[float, ...], share: float, rounds: int, n: int = 1500,
              seed: int = 3) -> tuple[NextEpochCache, list[list[bool]], int, int]:
    """``len(paces)`` jobs reading ``n`` equal files, each in its own random order per epoch at its pace (reads
    per second, with random gaps), until the slowest has read ``rounds`` epochs. Returns the cache, each job's
    hits (first epoch left out), and the storage reads and all reads after every job's first epoch."""
    rng = random.Random(seed)
    size = 1000
    clock = _Clock()
    cache = NextEpochCache(int(share * n * size), n * size, n, max_id=n + 1, clock=clock)
    orders = [rng.sample(range(1, n + 1), n) for _ in paces]
    position = [0] * len(paces)
    epoch = [0] * len(paces)
    at = [rng.random() for _ in paces]
    hits: list[list[bool]] = [[] for _ in paces]
    storage = reads = 0
    while min(epoch) < rounds:
        job = min(range(len(paces)), key=lambda j: at[j])
        clock.now = at[job]
        file = orders[job][position[job]]
        decision = cache.read(file, size, job)
        # (a first read of an epoch is taken for a retry now and then, ~2 %: the next one opens the epoch)
        if min(epoch) >= 1:
            reads += 1
            storage += not decision.hit
        if epoch[job] >= 1 and not decision.same_epoch:
            hits[job].append(decision.hit)
        assert cache.held_bytes <= cache.budget
        position[job] += 1
        at[job] += rng.expovariate(paces[job])
        if position[job] == n:
            position[job] = 0
            epoch[job] += 1
            orders[job] = rng.sample(range(1, n + 1), n)
    return cache, hits, storage, reads


@pytest.mark.parametrize("paces", [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.5, 3.0)],
                         ids=["same pace", "one twice as fast", "three paces"])
def test_several_jobs_each_hit_their_share_and_read_less_from_storage(paces: tuple[float, ...]) -> None:
    """Three jobs, one budget of 30 %: every job hits at least the budget's share (what a random choice of it
    gives each), and together they read clearly less from storage than three jobs each missing 70 % would."""
    share = 0.3
    cache, hits, storage, reads = _run_jobs(paces, share, rounds=4)
    for job, seen in enumerate(hits):
        ratio = sum(seen) / len(seen)
        assert ratio >= share + 0.03, (job, ratio)
    assert storage / reads <= 0.85 * (1 - share), storage / reads
    summary = cache.summary()
    jobs = summary["jobs"]
    assert isinstance(jobs, dict) and sorted(jobs) == ["0", "1", "2"]
    assert summary["jobs_reading"] == 3
    for job, seen in enumerate(hits):
        entry = jobs[str(job)]
        assert entry["epoch"] >= 4 and entry["window_hit_ratio_mean"] is not None
        assert entry["window_hit_ratio_mean"] >= share
    # the totals are every job's
    assert summary["cache_hits"] + summary["cache_misses"] == sum(
        e["reads"] for e in jobs.values())


def test_each_job_counts_its_own_epochs() -> None:
    """A second job reading every file once is its own first epoch, not the first job's second."""
    cache = NextEpochCache(0, 100, 10, max_id=11)
    for f in range(1, 11):
        assert cache.read(f, 10, 0).epoch == 1
    for f in range(1, 11):
        assert cache.read(f, 10, 1).epoch == 1
    assert cache.jobs[0].newest_epoch == 1 and cache.jobs[1].newest_epoch == 1
    for f in range(1, 11):
        assert cache.read(f, 10, 0).epoch == 2


def test_one_job_decides_as_before_whatever_its_id() -> None:
    """The single-job policy is unchanged: the same reads under job 0 or job 5 hold the same files."""
    rng = random.Random(9)
    sizes = _dataset(400, rng)
    total = sum(sizes.values())
    order = [rng.sample(list(sizes), len(sizes)) for _ in range(3)]
    decisions = []
    for job in (0, 5):
        cache = NextEpochCache(int(0.3 * total), total, len(sizes), max_id=max(sizes))
        decisions.append([(d.hit, d.hold) for epoch in order for f in epoch
                          for d in [cache.read(f, sizes[f], job)]])
    assert decisions[0] == decisions[1]


def test_an_idle_job_is_retired_and_its_counts_kept() -> None:
    clock = _Clock()
    cache = NextEpochCache(500, 1000, 10, max_id=11, clock=clock)
    for f in range(1, 11):
        cache.read(f, 100, 0)
    clock.now = 10.0
    for f in range(1, 11):
        cache.read(f, 100, 1)
    clock.now = 10.0 + 301  # job 0 idle past JOB_IDLE, job 1 too: a third job's first read retires both
    cache.read(1, 100, 2)
    assert list(cache.jobs) == [2]
    summary = cache.summary()
    assert summary["jobs_retired"] == 2
    assert summary["cache_hits"] + summary["cache_misses"] == 21
    assert cache.held_bytes <= 500 and all(entry.job == 2 for entry in cache.held.values())


def test_a_node_reading_its_shard_of_each_epoch_hits_the_budgets_share() -> None:
    """One node of four, each epoch a new permutation's quarter (DALI's shard_id over nodes): a file held is read
    in any later epoch as likely as in the next, so the files not read in the next stay until their room is
    wanted. The budget fills by a quarter of itself per epoch (C/D of the node's quarter), and once full the
    node's hits are C/D of what it reads (dropping them each epoch left it a quarter full: ~C/4D)."""
    rng = random.Random(12)
    sizes = _dataset(4000, rng)
    total = sum(sizes.values())
    share = 0.1
    cache = NextEpochCache(int(share * total), total, len(sizes), max_id=max(sizes))
    files = list(sizes)
    later: list[tuple[bool, int]] = []
    for epoch in range(14):
        rng.shuffle(files)
        for f in files[: len(files) // 4]:  # this node's shard
            d = cache.read(f, sizes[f])
            assert cache.held_bytes <= cache.budget
            if epoch >= 8 and not d.same_epoch:  # full by then
                later.append((d.hit, sizes[f]))
    ratio = sum(s for h, s in later if h) / sum(s for _, s in later)
    assert abs(ratio - share) <= 0.025, ratio
    assert cache.held_bytes >= 0.9 * cache.budget


def test_a_job_that_stopped_is_retired_while_another_reads_on() -> None:
    """A `cat` from a shell is a job of its own: once idle past JOB_IDLE it stops counting, without waiting for
    a new job to begin (the mount goes back to one job's policy)."""
    from liquidfs.policy.next_epoch import JOB_IDLE, RETIRE_EVERY

    clock = _Clock()
    cache = NextEpochCache(3000, 10_000, 100, max_id=101, clock=clock)
    cache.read(1, 100, 1)  # the cat
    for i in range(RETIRE_EVERY + 1):
        clock.now = JOB_IDLE + 1 + i * 0.001
        cache.read(1 + i % 100, 100, 0)
    assert list(cache.jobs) == [0] and cache.summary()["jobs_retired"] == 1


def test_new_jobs_of_another_user_never_retire_a_job_that_reads() -> None:
    """uid 65534 begins ten jobs (a `setsid cat` loop) while uid 1000's training pauses a few seconds between
    epochs: the training's job is not retired (its next epoch is its third, not a first), and the other user
    holds no more than its share of the job slots, its new jobs taking its own old ones' places."""
    clock = _Clock()
    cache = NextEpochCache(0, 1000, 10, max_id=11, clock=clock)
    owners = {1: 1000, **{job: 65534 for job in range(2, 12)}}
    cache.owner_of = owners.get
    for _ in range(2):
        for f in range(1, 11):
            cache.read(f, 100, 1)
    assert cache.jobs[1].newest_epoch == 2
    for job in range(2, 12):
        clock.now += 0.3
        cache.read(1, 100, job)
    assert 1 in cache.jobs
    from liquidfs.policy.next_epoch import JOBS_PER_USER

    assert sum(1 for state in cache.jobs.values() if state.owner == 65534) == JOBS_PER_USER
    assert cache.read(1, 100, 1).epoch == 3


def test_a_new_job_with_no_slot_it_may_take_is_counted_in_none_until_one_is_idle() -> None:
    """Every slot a user may take is held by other users' jobs that read: its new job is refused (its reads
    are served what is held, and count, move and hold nothing); once a job is idle past DISPLACE_IDLE, the new
    job takes its place."""
    from liquidfs.policy.next_epoch import DISPLACE_IDLE, JOBS_KEPT_BACK, JOBS_PER_USER, MAX_JOBS

    clock = _Clock()
    cache = NextEpochCache(10_000, 10_000, 100, max_id=101, clock=clock)
    users = [1001 + i // JOBS_PER_USER for i in range(MAX_JOBS - JOBS_KEPT_BACK)]
    owners = {job: uid for job, uid in enumerate(users, start=1)}
    late = len(owners) + 1
    owners[late] = 2000
    cache.owner_of = owners.get
    for job in range(1, late):
        cache.read(job, 100, job)
    assert len(cache.jobs) == MAX_JOBS - JOBS_KEPT_BACK
    held = next(iter(cache.held))
    refused = cache.read(held, 100, late)
    assert late not in cache.jobs and refused.epoch == 0 and refused.hit and refused.hold
    assert cache.summary()["jobs_refused"] == 1 and cache.summary()["jobs_uncounted_reads"] == 1
    cache.read(held, 100, late)  # the same job's next read: a read more, no job more
    assert cache.summary()["jobs_refused"] == 1 and cache.summary()["jobs_uncounted_reads"] == 2
    assert held in cache.held
    clock.now = DISPLACE_IDLE / 2
    for job in range(2, late):  # all read again but the first
        cache.read(50 + job, 100, job)
    clock.now = DISPLACE_IDLE + 1
    assert cache.read(99, 100, late).epoch == 1
    assert late in cache.jobs and 1 not in cache.jobs


def test_retiring_a_job_touches_only_its_own_held_files_a_slice_per_read() -> None:
    """A job that stopped hands its held files to another: only its files are touched (not every held file),
    and at most REOWN_SLICE of them per read, never all in one read on the FUSE loop."""
    from liquidfs.policy.next_epoch import JOB_IDLE, REOWN_SLICE

    clock = _Clock()
    many, few = 2000, 200
    files = many + few + 10
    cache = NextEpochCache(files * 100, files * 100, files, max_id=files + 1, clock=clock)
    for f in range(1, many + 1):  # job 1 holds 2,000 files
        cache.read(f, 100, 1)
    for f in range(many + 1, many + few + 1):  # job 2 holds 200
        cache.read(f, 100, 2)
    assert sum(1 for entry in cache.held.values() if entry.job == 2) == few
    clock.now = JOB_IDLE + 1
    cache.read(1, 100, 1)  # job 1 reads on
    cache.read(many + few + 1, 100, 3)  # job 3 begins: job 2, idle past JOB_IDLE, is retired
    assert 2 not in cache.jobs
    assert cache.files_reowned <= REOWN_SLICE
    for f in range(many + few + 2, files + 1):
        cache.read(f, 100, 3)
    assert cache.files_reowned == few  # job 2's files, each once; none of job 1's 2,000
    assert not any(entry.job == 2 for entry in cache.held.values())


def test_a_retired_job_that_reads_again_takes_its_files_back_a_slice_per_read() -> None:
    """A training paused past JOB_IDLE (a long evaluation), retired by a `cat` from a shell: a slice of its held
    files went to the heir at that read. When it read again, its first read handed all the rest over at once,
    on the FUSE loop (400,000 files: 1.45 s every request waited). The record that resumes is a new one: the
    old one's files go on a slice per read, told from the new record's own, whose counts they never touch."""
    from liquidfs.policy.next_epoch import JOB_IDLE, REOWN_SLICE

    clock = _Clock()
    many = 2000
    files = many + 10
    cache = NextEpochCache(files * 100, files * 100, files, max_id=files + 1, clock=clock)
    for f in range(1, many + 1):  # job 1 holds 2,000 files for its epoch 2
        cache.read(f, 100, 1)
    old = cache.jobs[1].serial
    clock.now = JOB_IDLE + 1
    cache.read(many + 1, 100, 2)  # a `cat`: job 2 begins, job 1 (idle) is retired
    assert 1 not in cache.jobs and cache.files_reowned <= REOWN_SLICE
    before = cache.files_reowned
    cache.read(many + 2, 100, 1)  # the training reads again
    assert cache.files_reowned - before <= REOWN_SLICE
    for f in range(1, 40):  # its epoch 2 begins: hits of what the old record held, now job 2's or not yet
        cache.read(f, 100, 1)
    for f in range(many + 3, files + 1):
        cache.read(f, 100, 2)
    for _ in range(many // REOWN_SLICE + 2):
        cache.read(many + 1, 100, 2)
    assert not cache._reowning and cache.files_reowned <= many  # each of the old record's files once at most
    assert cache.jobs[1].serial != old and not any(entry.serial == old for entry in cache.held.values())
    assert all(count >= 0 for job in cache.jobs.values() for count in job.kept_for.values())


def test_a_job_whose_owner_the_table_forgot_takes_no_privileged_slot() -> None:
    """uid 1000 pushes its own job out of the job table (256 `setsid cat`s) while its pid still names it: the job
    is nobody's, never the daemon's root's, and displaces none of root's jobs that read."""
    from liquidfs.policy.next_epoch import DISPLACE_IDLE, MAX_JOBS, UNKNOWN_OWNER

    clock = _Clock()
    cache = NextEpochCache(10_000, 10_000, 100, max_id=101, clock=clock)
    owners = {job: 0 for job in range(1, MAX_JOBS + 1)}  # root's trainings, all reading
    cache.owner_of = owners.get
    for job in owners:
        cache.read(job, 100, job)
    forgotten = MAX_JOBS + 1  # not in the table
    assert cache.read(50, 100, forgotten).epoch == 0 and forgotten not in cache.jobs
    assert sorted(cache.jobs) == sorted(owners) and cache.summary()["jobs_refused"] == 1
    clock.now = DISPLACE_IDLE / 2
    for job in range(2, MAX_JOBS + 1):
        cache.read(60 + job, 100, job)
    clock.now = DISPLACE_IDLE + 1  # job 1 idle past it: anyone's new job may take its place
    assert cache.read(51, 100, forgotten).epoch == 1
    assert cache.jobs[forgotten].owner == UNKNOWN_OWNER and 1 not in cache.jobs


def test_hits_corrected_to_misses_leave_the_windows_and_the_fair_share() -> None:
    """A predicted hit whose pages the kernel reclaimed is read from storage (``correct_miss``): the window's
    ratio, the steadiness it is exported as and the job's share of recent hits (the shared budget's weight) count
    it as the miss it was, as the hit counters do."""
    cache = NextEpochCache(10_000, 10_000, 100, max_id=101)
    for f in range(1, 101):
        cache.read(f, 100, 1)
    for f in range(1, 101):  # epoch 2: every file held, every read a hit, each corrected
        decision = cache.read(f, 100, 1)
        assert decision.hit and decision.epoch == 2
        cache.correct_miss(2, 100, 1)
    job = cache.jobs[1]
    st = job.stats
    assert st.hits == 0 and list(st.window_epochs) == [1, 2]  # a window of 64 closed in each epoch
    assert list(st.window_ratios) == list(st.window_byte_ratios) == [0.0, 0.0]
    assert job.window == [(False, 100)] * (100 - WINDOW)
    assert job.recent_hits == 0.0


def test_a_group_that_appears_as_another_empties_is_ranked_at_once() -> None:
    """The held files' groups were ranked again only when their count changed: a group that appeared as another
    emptied (the count the same) was in no ranking, its files no victim for up to RANK_EVERY reads."""
    from liquidfs.policy.epochs import Job
    from liquidfs.policy.shared_budget import WantedSoonest

    job = Job(1, 10)
    soonest = WantedSoonest(10)
    later, also_later, mine = ((1, 1),), ((1, 1), (2, 0)), ((1, 0),)  # job 2's pair: another group, as late
    soonest.add(1, later)
    assert soonest.victims(mine, 100, 0, lambda file: 100, [job], reads=0) == [1]  # ranked: file 1 a victim
    soonest.remove(1, later)
    soonest.add(2, also_later)
    assert soonest.victims(mine, 100, 0, lambda file: 100, [job], reads=1) == [2]


def test_the_mounts_own_figures_describe_the_job_that_reads_not_the_first() -> None:
    """A `cat` of one image before the training began was the first job: the mount's epoch, progress and
    window gauges described it (epoch 1, no window) for minutes, until it retired, while the training was in
    its third epoch. They describe the job that read last."""
    clock = _Clock()
    cache = NextEpochCache(5_000, 10_000, 100, max_id=101, clock=clock)
    cache.read(1, 100, 7)  # the `cat`
    for epoch in range(3):
        for f in range(1, 101):
            clock.now += 0.01
            cache.read(f, 100, 8)
    assert cache.newest_epoch == 3 and cache.summary()["epoch"] == 3
    assert cache.stats is cache.jobs[8].stats


def test_of_two_jobs_reading_at_once_the_figures_keep_to_the_one_that_read_most() -> None:
    """Two trainings reading at once: the mount's figures jumped between them at each read; they keep to the one
    that read most among those that read lately, and a job that stopped a while ago leaves them."""
    from liquidfs.policy.next_epoch import LEADING_WINDOW

    clock = _Clock()
    cache = NextEpochCache(5_000, 10_000, 100, max_id=101, clock=clock)
    for f in range(1, 101):  # job 8 a whole epoch first
        clock.now += 0.01
        cache.read(f, 100, 8)
    for f in range(1, 21):  # then both, in turn
        clock.now += 0.01
        cache.read(f, 100, 9)
        assert cache.stats is cache.jobs[8].stats
        cache.read(f, 100, 8)
        assert cache.stats is cache.jobs[8].stats
    clock.now += LEADING_WINDOW + 1
    cache.read(50, 100, 9)  # job 8 stopped a while ago
    assert cache.stats is cache.jobs[9].stats and cache.summary()["epoch"] == cache.jobs[9].newest_epoch
