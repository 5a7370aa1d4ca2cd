"""The one builder of a mount: from a ``MountConfig`` to a finished set of parts (``Mount``): the catalog, the
store's reader, the levels of held bytes (memory, disk, cluster), the mix, and the ``fuse.operations.Operations``
over the data path that serves them. Each part is put on the caller's ``ExitStack`` the moment it exists, so
whatever fails later, and whichever close raises, every part made is closed, in reverse order.

``mount`` builds all of it for a daemon; ``operations`` builds the FUSE side over a reader and a catalog already
open (unit tests build through it). Either data path is built from the same ``Parts``: the daemon path keeps held
files in the daemon's memory, the passthrough path in memfds, with a daemon path beside it (holding nothing) for
the files that get no backing.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import trio

from ..catalog.catalog import Catalog
from ..catalog.nodes import Node
from ..datapath import passthrough
from ..datapath.daemon import DaemonPath
from ..datapath.notifier import Notifier
from ..datapath.passthrough import Kernel, PassthroughPath
from ..datapath.storage_calls import StorageCalls
from ..fuse.lookahead import MetadataAhead
from ..fuse.warm_helper import Walks
from ..fuse.open_budget import MAX_OPEN_FILES, OpenBudget
from ..fuse.operations import Operations, PerOpen
from ..held.base import PAGE, MemfdLevel, MemoryLevel, held_descriptors
from ..held.cluster import ClusterLevel, EveryoneReadsNow, call_timeout
from ..held.cluster_peers import CLUSTER_NEEDS_KEY, memcached_client
from ..held.disk import DiskLevel
from ..held.sealing import KeyFileError, Sealer, read_key_file
from ..metrics.stats import HasStatistics, MountStats
from ..mix.share import Mix
from ..policy.jobs import JobLookups, JobOf
from ..policy.budget import DatasetCost, ShareOfCost
from ..policy.next_epoch import NextEpochCache
from ..stores import Store
from ..stores.reader import ChecksCallers, LendsDescriptors, Reader
from .config import Amount, MountConfig, MountError, Share, bytes_of

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """What either data path is built from."""

    reader: Reader
    stats: MountStats
    calls: StorageCalls
    notifier: Notifier
    config: MountConfig
    policy: NextEpochCache | None = None  # the next-epoch cache's, if the mount has one
    #: Told of each passthrough open that found its metadata cold (the metadata read-ahead, where there is one).
    cold_open: Callable[[Node], None] | None = None
    #: Memfds the passthrough path's level may hold (``held.base.held_descriptors``; None: no cap).
    held_files: int | None = None

    def daemon_path(self, *, holds: bool = True) -> DaemonPath:
        """The daemon data path; ``holds``: it keeps the next-epoch cache's files (in this process)."""
        held = MemoryLevel(self.policy, self.stats) if holds and self.policy is not None else None
        return DaemonPath(self.reader, self.stats, self.calls, self.notifier, held=held,
                          page_cache=self.config.page_cache, max_open_bytes=self.config.open_bytes,
                          push_pages=self.config.push_pages)

    def passthrough_path(self, kernel: Kernel) -> PassthroughPath:
        """The passthrough data path over ``kernel``'s connection; the next-epoch cache's files in memfds."""
        held = MemfdLevel(self.policy, self.stats, self.held_files) if self.policy is not None else None
        return PassthroughPath(kernel, self.reader, self.stats, self.calls, ranges=self.daemon_path(holds=False),
                               held=held, verify_reads=self.config.verify_reads,
                               drop_served_pages=self.config.page_cache == "drop", on_cold_open=self.cold_open)


@dataclass
class Mount:
    """A mount's parts, built and owned by the stack ``mount`` was given."""

    config: MountConfig
    catalog: Catalog
    ops: Operations
    parts: Parts
    #: The parts that answer requests (the data path, the notifier, the read-ahead): ``serve`` moves them above
    #: the FUSE session on its stack, so they stop before the session closes.
    serving: ExitStack


def mount(config: MountConfig, store: Store, store_dir: Path, stack: ExitStack) -> Mount:
    """Every part of a mount of ``config`` over ``store`` (its catalog in ``store_dir``), each on ``stack``."""
    store.hold_for_mount(store_dir)
    catalog = Catalog.open(store_dir, readonly=True, immutable=True)
    stack.callback(catalog.close)
    if not catalog.has_listings:
        log.info("the catalog %s was built by an older liquidfs: its directories are listed from its rows, "
                 "without its packed listings (a `find` over ten million files 2-3x slower); mount --rescan "
                 "writes them", catalog.path)
    return over_catalog(config, store, catalog, stack)


def over_catalog(config: MountConfig, store: Store, catalog: Catalog, stack: ExitStack) -> Mount:
    """Every part of a mount but the catalog, over ``catalog`` already open (``mount``; each of ``--loops``
    after the first, over the connection it inherited: an immutable read-only one, which takes no lock, and the
    very file the first loop serves, where opening the path again could find a catalog a prepare put there
    since)."""
    stats = MountStats(source=config.source, store=store.label)
    # (asked by the opens' own pool and by --threads' reads at once: an object store keeps a connection for each)
    base_reader = store.reader(catalog, config.threads + config.open_threads, config.io_timeout)
    stack.callback(base_reader.close)
    totals = catalog.file_totals()  # one scan of the catalog serves every level
    policy = make_policy(catalog, totals, config.cache_size)
    disk = cluster = None
    if config.disk_cache is not None:
        disk = make_disk_level(totals, config, base_reader, policy)
        stack.callback(disk.close)
    if config.cluster:
        cluster = make_cluster_level(totals, catalog, config, disk or base_reader,
                                     getattr(base_reader, "root_fd", None))
        stack.callback(cluster.close)
    # A local store's metadata may be warmed ahead of the opens (a disk level in front still walks it at a miss).
    lender = base_reader if isinstance(base_reader, LendsDescriptors) and base_reader.inline_check else None
    warm = lender if config.lookahead else None
    serving = stack.enter_context(ExitStack())
    ops, parts = operations(config, catalog, cluster or disk or base_reader, stats, serving, policy=policy,
                            data_path="daemon" if daemon_only(config) else "at init",
                            mix=make_mix(catalog, config, store), descriptors=descriptor_budget(),
                            may_read=base_reader.readable_inode if isinstance(base_reader, ChecksCallers) else None,
                            levels=[level for level in (disk, cluster) if level is not None],
                            warm=warm.warm if warm else None, warm_walks=warm.warm_walks if warm else None,
                            warm_descriptors=warm.warm_descriptors if warm else ())
    return Mount(config, catalog, ops, parts, serving)


def operations(config: MountConfig, catalog: Catalog, reader: Reader, stats: MountStats, stack: ExitStack, *,
               policy: NextEpochCache | None = None, data_path: str = "daemon", kernel: Kernel | None = None,
               mix: Mix | None = None, descriptors: int | None = None,
               may_read: Callable[[Node, int, int, int], int | None] | None = None,
               levels: Sequence[HasStatistics] = (),
               warm: Callable[[Node], None] | None = None,
               warm_walks: Callable[[Node], Walks] | None = None,
               warm_descriptors: Sequence[int] = ()) -> tuple[Operations, Parts]:
    """The finished ``Operations`` of ``config`` over ``reader``, and the parts its data path is built from.
    ``data_path``: "daemon", "passthrough" (over ``kernel``), or "at init": chosen once the connection's INIT
    says whether the kernel grants passthrough (``serve.choose_data_path``). ``descriptors``: the files the
    mount may hold open (``descriptor_budget``; None: ``MAX_OPEN_FILES``, no memfds capped). ``warm``: a file's
    metadata read ahead (``fuse.lookahead``; None: none), by a helper process where ``warm_walks`` names its walks
    below ``warm_descriptors``."""
    why_not = daemon_only(config)
    # Held memfds are descriptors too: where passthrough may hold them, a share of the budget is theirs and open
    # files have the rest, so the two together never reach RLIMIT_NOFILE (an EMFILE for every open).
    held_files = held_descriptors(descriptors) if descriptors and policy is not None and not why_not else None
    lookahead = None
    if warm is not None:
        lookahead = MetadataAhead(catalog.path, warm, walks=warm_walks, descriptors=warm_descriptors,
                                  catalog_id=catalog.file_id)
        stack.callback(lookahead.stop)
    built: list[Operations] = []
    # The data path is chosen after INIT where passthrough may be granted: whichever serves by then is closed,
    # after the notifier has stopped (its queue may still name the path's files).
    stack.callback(_close_data_paths, built)
    notifier = Notifier()
    stack.callback(notifier.stop)
    calls = StorageCalls(reader, thread_limiter=trio.CapacityLimiter(config.threads), io_timeout=config.io_timeout,
                         open_threads=config.open_threads)
    parts = Parts(reader, stats, calls, notifier, config, policy, held_files=held_files,
                  cold_open=lookahead.went_cold if lookahead is not None else None)
    jobs = None
    if policy is not None:
        jobs = JobLookups(JobOf())
        policy.owner_of = jobs.job_of.owner  # a job's uid decides which slots it may take
    path: DaemonPath | PassthroughPath | None
    if data_path == "daemon":
        path = parts.daemon_path()
    elif data_path == "passthrough":
        if kernel is None:
            raise ValueError("the passthrough data path needs the kernel's connection")
        path = parts.passthrough_path(kernel)
    elif data_path == "at init":
        path = None
    else:
        raise ValueError(f"data_path must be 'daemon', 'passthrough' or 'at init', not {data_path!r}")
    budget = OpenBudget(MAX_OPEN_FILES if descriptors is None else descriptors - (held_files or 0))
    per_open = PerOpen(budget, mix, jobs, may_read if config.allow_other else None)
    ops = Operations(catalog, stats, calls, notifier, path, per_open=per_open, lookahead=lookahead,
                     levels=levels,
                     enable_passthrough=config.data_path != "daemon" and passthrough.built_in() is None,
                     time_requests=config.time_requests)
    built.append(ops)
    if why_not:
        stats.data_path_why = why_not
    return ops, parts


def _close_data_paths(built: list[Operations]) -> None:
    for ops in built:
        if ops.data_path is not None:
            ops.data_path.close()


def daemon_only(config: MountConfig) -> str | None:
    """Why the daemon path serves whatever the kernel offers, or None where passthrough is worth asking for."""
    if config.data_path == "daemon":
        return "--data-path daemon"
    if config.page_cache == "direct":
        return "--page-cache direct: every read is served by the daemon"
    return None


#: Descriptors kept for everything but open files: the catalog, sockets, worker threads' files, the watchdog.
_RESERVED_FDS = 1024


def descriptor_budget(ceiling: int = 1 << 20) -> int:
    """How many files may be open through the mount at once: RLIMIT_NOFILE raised as far as this process may
    (a loader such as DALI keeps its whole shuffle buffer open, and every open file may hold a descriptor),
    less a reserve for everything else."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        nr_open = hard
    for limit in (min(max(hard, ceiling), nr_open), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            soft = limit
            break
        except (OSError, ValueError):
            continue  # raising the hard limit needs CAP_SYS_RESOURCE: the soft one still goes up to it
    return max(64, soft - _RESERVED_FDS)


def make_mix(catalog: Catalog, config: MountConfig, store: Store) -> Mix | None:
    """``--mix``: None for "prepared" (every raw object served, nothing to decide per open)."""
    if config.mix == "prepared":
        return None
    try:
        prepared = float(catalog.meta("ratio") or 0.0)
        seed = int(catalog.meta("seed") or 0)
    except ValueError as exc:
        raise MountError(f"the store's catalog has an unreadable ratio or seed: {exc}") from exc
    start = store.profile_choice() if config.mix == "adaptive" else None
    try:
        mix = Mix(config.mix, prepared, seed=seed, start=start)
    except ValueError as exc:
        raise MountError(str(exc)) from exc
    log.info("mix: %s, raw share %.3f of the images (prepared %.3f): %s", mix.mode, mix.share, prepared, mix.reason)
    return mix


def make_cluster_level(totals: tuple[int, int, int, int], catalog: Catalog, config: MountConfig,
                      reader: Reader, source_root_fd: int | None = None) -> ClusterLevel:
    """The cluster level: the share of the raw objects the memcacheds of ``--cluster`` hold together; ``totals``
    are ``Catalog.file_totals()``; ``source_root_fd``: a local source's root (whether anyone may read a file
    is asked of the source as it is). A source without one (an object store's) has nothing everyone may read:
    its cluster needs the key (``cli.options.mount_config`` says so first)."""
    assert config.cluster
    if config.cluster_key_file is None and source_root_fd is None:
        raise MountError(CLUSTER_NEEDS_KEY)
    raw_bytes = catalog.raw_bytes()
    size: int | None = None
    if config.cluster_size is not None:
        size_from = "--cluster-size"
        size = bytes_of(config.cluster_size, totals[1])
    client = memcached_client(config.cluster, timeout=call_timeout(config.io_timeout))
    if size is None:
        size_from = "the memcacheds' stats"
        size = cluster_size_from_limits(client.limits(), raw_bytes)
        if size is None:
            client.close()
            raise MountError(f"--cluster {', '.join(f'{h}:{p}' for h, p in config.cluster)}: no memcached told its "
                             "size (stats: limit_maxbytes) in time; is it running? Or give --cluster-size")
    share = min(1.0, size / raw_bytes) if raw_bytes else 0.0
    log.info("cluster of %d memcached (%s): %d bytes (from %s) hold %.0f%% of the raw objects; %s",
             len(config.cluster), ", ".join(f"{host}:{port}" for host, port in config.cluster), size, size_from,
             100 * share,
             "values sealed under the cluster key" if config.cluster_key_file else
             "no --cluster-key-file: values in the clear, only of sources everyone may read")
    if config.cluster_key_file is not None:
        try:  # checked by the command that started this daemon; read again here, as the key never travels
            key = read_key_file(config.cluster_key_file)
        except KeyFileError as exc:
            client.close()
            raise MountError(str(exc)) from None
        return ClusterLevel(reader, client, share, sealer=Sealer(key), key_id=key.id, size=size, size_from=size_from)
    assert source_root_fd is not None
    return ClusterLevel(reader, client, share, public=EveryoneReadsNow(source_root_fd), size=size,
                        size_from=size_from)


#: Of what the memcacheds may hold (their ``-m``), what is counted on for values: memcached's slabs and item
#: headers take the rest (BENCHMARKS.md: 726 MiB allocated for 715 MiB of 5 MB values).
CLUSTER_USABLE = 0.95
#: How many times the lower median of the memcacheds' sizes one of them counts at most (``cluster_size_from_limits``).
CLUSTER_SPREAD = 4


def cluster_size_from_limits(limits: dict[str, int | None], raw_bytes: int) -> int | None:
    """``--cluster-size`` where none is given: the smaller of what the memcacheds that told their size hold
    together (less their own overhead) and the raw objects' bytes; None where none told it."""
    told = [limit for limit in limits.values() if limit is not None]
    if not told:
        return None
    silent = sorted(name for name, limit in limits.items() if limit is None)
    if silent:
        log.warning("cluster: %s did not tell their size; counting only the others'", ", ".join(silent))
    # Each counted at most as CLUSTER_SPREAD times the lower median of them: one peer (a lying one, one resolved
    # by a spoofed name) saying it holds a petabyte took the share to every raw object, and every open of them
    # to the cluster. (Honest memcacheds of other sizes, within that spread, count as they say.)
    most = CLUSTER_SPREAD * statistics.median_low(told)
    if max(told) > most:
        log.warning("cluster: a memcached says it holds more than %d times the others' (lower median) size: "
                    "counted as %d bytes", CLUSTER_SPREAD, most)
    return min(int(sum(min(limit, most) for limit in told) * CLUSTER_USABLE), raw_bytes)


def make_disk_level(totals: tuple[int, int, int, int], config: MountConfig, reader: Reader,
                   memory: NextEpochCache | None) -> DiskLevel:
    """The disk level sees what the memory level misses: its quota is of the dataset minus the memory budget."""
    assert config.disk_cache is not None and config.disk_cache_size is not None
    files, served, _, max_id = totals
    budget = bytes_of(config.disk_cache_size, served)
    reaching = max(1, served - (memory.budget if memory is not None else 0))
    log.info("disk cache budget %d bytes in %s", budget, config.disk_cache)
    policy = NextEpochCache(budget, reaching, files, max_id=max_id)
    held = (lambda node_id: node_id in memory.held) if memory is not None else (lambda node_id: False)
    return DiskLevel(reader, config.disk_cache, policy, memory_holds=held)


def make_policy(catalog: Catalog, totals: tuple[int, int, int, int],
               cache_size: Amount | None) -> NextEpochCache | None:
    """The memory level's policy; ``totals`` are ``Catalog.file_totals()``. A share is of what holding every file
    costs on the level that will hold them (its pages: ``policy.budget``), resolved once the data path is known."""
    if cache_size is None:
        return None
    files, served, _, max_id = totals
    budget = ShareOfCost(cache_size.fraction) if isinstance(cache_size, Share) else cache_size
    # Bytes in pages for the daemon's memory (1: the bytes themselves) and the memfds' (one scan for both).
    cost = DatasetCost(files, catalog.paged_bytes((1, PAGE)))
    return NextEpochCache(budget, served, files, max_id=max_id, cost=cost)
