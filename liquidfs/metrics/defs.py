"""Every metric ``/metrics`` exports, declared once (name, kind, unit, help, the statistics it reads), and the
Prometheus text of a snapshot by that table. Mountpoint-S3's ``metrics/defs.rs`` is the model.

``fuse.operations.Operations.statistics()`` is one dict for the control file, ``liquidfs stats`` and this export;
its keys stay as they are (scripts read them), and each row here maps one or more of them to a name as
Prometheus' conventions want it: counters end in ``_total``, the unit ends the name (``_bytes``, ``_seconds``,
``_ratio`` for a share in [0, 1]), one metric with a label where keys are the same thing for different parts (the cache levels:
``level="memory"``/``"disk"``), a nested value by its path (``mix.share``: ``statistics()["mix"]["share"]``).
Each name is written out whole, so a grep for a name a dashboard queries lands on its row.

Every key statistics() produces has a row, or an entry in ``NOT_EXPORTED`` saying why not; the unit tests build
both data paths and fail on a key with neither. One that slips through anyway (a counter added without a row)
does not vanish: a number is exported untyped as ``liquidfs_<key>`` and named in the log once, anything else is
named in the log once and left out. Metrics carry numbers and the names of modes, never paths.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from .stats import SERVED_FROM

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "info"]
COUNTER: Kind = "counter"  # only grows while the mount lives; its name ends in _total
GAUGE: Kind = "gauge"      # a value now
INFO: Kind = "info"        # always 1, its labels the values of string keys (exported as a gauge)


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    kind: Kind
    unit: str                       # what the name ends with (before _total): "bytes", "seconds", "ratio"; "" a count
    keys: str | Mapping[str, str]   # the statistics() key; or {label value: key}; for INFO {label name: key}
    help: str
    label: str = ""                 # the label whose values tell the keys apart

    def sources(self) -> tuple[tuple[str, str], ...]:
        """(label value, key) for each sample; INFO: (label name, key) for each label."""
        return (("", self.keys),) if isinstance(self.keys, str) else tuple(self.keys.items())


_LEVEL = "level"
_MEM = "memory"
#: The request types ``fuse.operations.Operations`` times (its handlers: ``fuse.operations.REQUEST_TYPES``, which
#: the tests compare).
REQUESTS = ("lookup", "getattr", "readlink", "opendir", "readdir", "statfs", "open", "read", "release")


def _requests(field: str) -> dict[str, str]:
    """{request type: its ``field`` under statistics()["requests"]}."""
    return {request: f"requests.{request}.{field}" for request in REQUESTS}


METRICS: tuple[Metric, ...] = (
    # -- the mount ---------------------------------------------------------------------------------------------
    Metric("liquidfs_mount_info", INFO, "", {"data_path": "data_path", "mix_mode": "mix.mode", "warmup": "warmup",
                                              "dispatch": "dispatch"},
           "Always 1. data_path: passthrough or daemon; mix_mode: fixed or adaptive (absent: every raw object "
           "served); warmup: running, done or failed (absent without --warmup); dispatch: queued-first (pyfuse3 with "
           "liquidfs's patch) or stock."),
    Metric("liquidfs_start_time_seconds", GAUGE, "seconds", "started_at",
           "When the mount started, in seconds since the Unix epoch."),
    Metric("liquidfs_dataset_files", GAUGE, "", "files", "Files the mount serves."),
    Metric("liquidfs_dataset_bytes", GAUGE, "bytes", "dataset_bytes", "Bytes of every file, as served."),
    Metric("liquidfs_open_files", GAUGE, "", "open_files", "Files open now."),
    Metric("liquidfs_known_inodes", GAUGE, "", "known_inodes", "Inodes the kernel holds a lookup of now."),
    Metric("liquidfs_stuck_reads", GAUGE, "", "stuck_reads",
           "Storage reads stuck past their time limit now (storage not answering)."),
    Metric("liquidfs_opens_in_flight", GAUGE, "", "opens_in_flight",
           "Opens of files begun and not yet answered now (most of them waiting for storage)."),
    # -- opens ---------------------------------------------------------------------------------------------------
    Metric("liquidfs_opens_total", COUNTER, "", "opens", "Opens of files."),
    Metric("liquidfs_raw_opens_total", COUNTER, "", "opens_raw", "Opens that served a raw object."),
    Metric("liquidfs_refused_opens_total", COUNTER, "", "opens_refused",
           "Opens failed at once with EAGAIN: as many opens as the mount lets wait for storage were waiting, or "
           "as many of the opener's uid as one user may have."),
    Metric("liquidfs_refused_opens_share_total", COUNTER, "", "opens_refused_share",
           "Of the refused opens, those refused because their uid had its share (half) of the opens that may wait "
           "for storage (root's and the mount's own user's are never)."),
    Metric("liquidfs_deferred_opens_total", COUNTER, "", "deferred",
           "Opens whose file was read at its first read instead of at open."),
    Metric("liquidfs_cold_opens_total", COUNTER, "", "cold_opens",
           "Passthrough opens whose inodes were not in memory (opened in a worker thread)."),
    Metric("liquidfs_backings_recast_total", COUNTER, "", "backings_recast",
           "With several loops, first opens whose bytes were made the other kind of backing (a memfd, the file "
           "itself) to share another loop's open's backing of the same bytes."),
    Metric("liquidfs_passthrough_opens_total", COUNTER, "", "passthrough_opens",
           "Opens answered with a backing file: the kernel serves their reads."),
    Metric("liquidfs_backing_opens_total", COUNTER, "", {"source": "backing_source", "object": "backing_object",
                                                         "memfd": "backing_memfd", "disk": "backing_disk"},
           "First opens on the passthrough path by what backs them: the source file, a local raw object, a memfd "
           "(a cache hit, a download, a checked read), the disk cache level.", label="backing"),
    Metric("liquidfs_open_evictions_total", COUNTER, "", "open_evictions",
           "Open files whose bytes were let go to keep the open bytes under --open-bytes."),
    Metric("liquidfs_fallbacks_total", COUNTER, "", "fallbacks",
           "Files whose raw object was not served (missing, corrupt, stale source): served as their original."),
    Metric("liquidfs_errors_total", COUNTER, "", "errors", "Requests answered with an error other than ENOENT."),
    Metric("liquidfs_listed_entries_total", COUNTER, "",
           {"attributes": "listed_with_attributes", "bare": "listed_bare"},
           "Directory entries listed: with their attributes (each a lookup the kernel holds) or bare (name, inode "
           "number and type: a directory's files until lookups of them follow a listing, and plain READDIR "
           "pages).", label="kind"),
    Metric("liquidfs_listed_packed_entries_total", COUNTER, "", "listed_packed",
           "Entries listed bare from the catalog's packed listings (a local tree's build writes them; the other bare "
           "entries came from its rows)."),
    # -- bytes ---------------------------------------------------------------------------------------------------
    Metric("liquidfs_served_bytes_total", COUNTER, "bytes", SERVED_FROM,
           "Bytes of opened files by where they came from, on either data path: storage (the store or the "
           "source), memory (the next-epoch cache), disk (the disk cache level), cluster (a peer's memcached). "
           "Its rate is the throughput.",
           label=_LEVEL),
    Metric("liquidfs_daemon_read_bytes_total", COUNTER, "bytes", "bytes_read",
           "Bytes the daemon answered read requests with (none for files the kernel reads by passthrough)."),
    Metric("liquidfs_daemon_read_requests_total", COUNTER, "", "read_requests",
           "Read requests that reached the daemon."),
    Metric("liquidfs_open_bytes", GAUGE, "bytes", "open_bytes", "Bytes the daemon holds for open files now."),
    Metric("liquidfs_pushed_bytes_total", COUNTER, "bytes", "bytes_pushed",
           "Bytes handed to the kernel's page cache ahead of its reads."),
    Metric("liquidfs_lost_page_reads_total", COUNTER, "", "lost_page_reads",
           "Read requests for pages the kernel lost after the daemon let their file go."),
    Metric("liquidfs_lost_page_bytes_total", COUNTER, "bytes", "bytes_of_lost_pages",
           "Bytes the read requests for lost pages were answered with."),
    Metric("liquidfs_refetches_total", COUNTER, "", "refetches",
           "Storage reads taken to answer read requests for lost pages."),
    Metric("liquidfs_refetched_bytes_total", COUNTER, "bytes", "bytes_refetched",
           "Bytes read from storage to answer read requests for lost pages."),
    Metric("liquidfs_buffers_reused_total", COUNTER, "", "buffers_reused",
           "Reads into a buffer a closed file gave back, instead of a new one."),
    Metric("liquidfs_buffers_idle_bytes", GAUGE, "bytes", "buffers_idle_bytes", "Bytes of buffers idle now."),
    # -- the passthrough path's held files ---------------------------------------------------------------------
    Metric("liquidfs_passthrough_open_inodes", GAUGE, "", "passthrough_open_inodes",
           "Inodes open with a backing file now."),
    Metric("liquidfs_loop_requests_forwarded_total", COUNTER, "", "loop_requests_forwarded",
           "mount --loops: requests (releases, reads, statistics) sent to the loop that opened the file."),
    Metric("liquidfs_loop_requests_answered_total", COUNTER, "", "loop_requests_answered",
           "mount --loops: requests answered for another loop."),
    Metric("liquidfs_closes_pending", GAUGE, "", "closes_pending",
           "Served files released and not closed yet (their pages dropped and closed off the loop)."),
    Metric("liquidfs_memfd_files", GAUGE, "", "memfd_files", "Files the memory level holds in memfds now."),
    Metric("liquidfs_memfd_bytes", GAUGE, "bytes", "memfd_bytes", "Bytes the memory level holds in memfds now."),
    Metric("liquidfs_memfd_kept_total", COUNTER, "", "kept", "Files copied into memfds after being served."),
    Metric("liquidfs_memfd_max_files", GAUGE, "", "memfd_max_files",
           "Memfds the memory level may hold (its share of the daemon's descriptors; 0: no cap)."),
    Metric("liquidfs_memfd_keep_failures_total", COUNTER, "", "keep_failed",
           "Files the cache chose whose bytes could not be kept (released unread, copy failed)."),
    # -- the cache levels (memory: --cache-size, disk: --disk-cache) ---------------------------------------------
    Metric("liquidfs_cache_budget_bytes", GAUGE, "bytes",
           {_MEM: "cache_budget", "disk": "disk_budget", "cluster": "cluster_bytes"},
           "Bytes a cache level may hold.", label=_LEVEL),
    Metric("liquidfs_cache_budget_ratio", GAUGE, "ratio", {_MEM: "cache_share", "cluster": "cluster_share"},
           "A cache level's budget as a share of the dataset's bytes (C/D): its hit ratio by design (the cluster's: "
           "the share of the raw objects' bytes it holds).",
           label=_LEVEL),
    Metric("liquidfs_cache_held_bytes", GAUGE, "bytes", {_MEM: "cache_held_bytes", "disk": "disk_held_bytes"},
           "Bytes a cache level holds now, as its budget counts them: the memory's pages, the disk's blocks.",
           label=_LEVEL),
    Metric("liquidfs_cache_held_files", GAUGE, "", {_MEM: "cache_held_files", "disk": "disk_held_files"},
           "Files a cache level holds now.", label=_LEVEL),
    Metric("liquidfs_cache_hits_total", COUNTER, "", {_MEM: "cache_hits_predicted", "disk": "disk_hits",
                                                      "cluster": "cluster_hits"},
           "Reads of a file (one per epoch) a cache level held at the read; hits whose bytes were gone after all "
           "are counted again in liquidfs_cache_lost_hits_total: (hits - lost) / (hits + misses) is the hit "
           "ratio.", label=_LEVEL),
    Metric("liquidfs_cache_misses_total", COUNTER, "", {_MEM: "cache_misses_predicted", "cluster": "cluster_misses"},
           "Reads of a file (one per epoch) a cache level did not hold.", label=_LEVEL),
    Metric("liquidfs_cache_lost_hits_total", COUNTER, "", {_MEM: "cache_lost_hits"},
           "Hits whose held bytes were gone when read (read from storage after all): misses in the hit ratio.",
           label=_LEVEL),
    Metric("liquidfs_cache_hit_bytes_total", COUNTER, "bytes", {_MEM: "cache_hit_bytes_predicted",
                                                                "disk": "disk_hit_bytes",
                                                                "cluster": "cluster_hit_bytes"},
           "Bytes of a cache level's hits (lost hits included, as in liquidfs_cache_hits_total).", label=_LEVEL),
    Metric("liquidfs_cache_lost_hit_bytes_total", COUNTER, "bytes", {_MEM: "cache_lost_hit_bytes"},
           "Bytes of the hits whose held bytes were gone.", label=_LEVEL),
    Metric("liquidfs_cache_miss_bytes_total", COUNTER, "bytes", {_MEM: "cache_miss_bytes_predicted"},
           "Bytes of a cache level's misses (lost hits not included).", label=_LEVEL),
    Metric("liquidfs_cache_same_epoch_reads_total", COUNTER, "", {_MEM: "cache_same_epoch_reads"},
           "Reads taken for a retry within an epoch (neither hit nor miss).", label=_LEVEL),
    Metric("liquidfs_cache_reclaimed_total", COUNTER, "", {_MEM: "reclaimed"},
           "Hits whose held bytes were gone (dropped after a fallback), read again.", label=_LEVEL),
    Metric("liquidfs_cache_swapped_total", COUNTER, "", {_MEM: "held_swapped"},
           "Held originals let go because the mix now serves their files raw.", label=_LEVEL),
    Metric("liquidfs_cache_lost_total", COUNTER, "", {"disk": "disk_lost"},
           "Held files a cache level found gone or damaged when it served them.", label=_LEVEL),
    Metric("liquidfs_cache_write_errors_total", COUNTER, "", {"disk": "disk_write_errors"},
           "Files a cache level failed to write.", label=_LEVEL),
    Metric("liquidfs_cache_stored_total", COUNTER, "", {"cluster": "cluster_stored"},
           "Files a shared cache level (the cluster) was given by this node.", label=_LEVEL),
    Metric("liquidfs_cache_stored_bytes_total", COUNTER, "bytes", {"cluster": "cluster_stored_bytes"},
           "Bytes a shared cache level (the cluster) was given by this node.", label=_LEVEL),
    Metric("liquidfs_cache_rejected_total", COUNTER, "", {"cluster": "cluster_rejected"},
           "Values a shared cache level answered with that were not the file's bytes (never served).",
           label=_LEVEL),
    Metric("liquidfs_cache_unanswered_total", COUNTER, "", {"cluster": "cluster_unanswered"},
           "Fetches and stores a shared cache level's server did not answer in time (counted as misses).",
           label=_LEVEL),
    Metric("liquidfs_cache_skipped_total", COUNTER, "", {"cluster": "cluster_skipped"},
           "Fetches and stores not tried: the shared cache level's server failed repeatedly and is left out for a "
           "while (counted as misses).", label=_LEVEL),
    Metric("liquidfs_cache_refused_total", COUNTER, "", {"cluster": "cluster_refused"},
           "Stores a shared cache level's server refused (out of memory, or a value past its largest item), and "
           "opens of values as large as one past it, kept out of it for a while since.", label=_LEVEL),
    Metric("liquidfs_cache_private_total", COUNTER, "", {"cluster": "cluster_private"},
           "Opens kept out of a shared cache level without a cluster key: their source is not readable by "
           "everyone.", label=_LEVEL),
    Metric("liquidfs_cache_sealed", GAUGE, "", {"cluster": "cluster_sealed"},
           "1 where a shared cache level's values are sealed under a cluster key (--cluster-key-file), else 0.",
           label=_LEVEL),
    Metric("liquidfs_cache_jobs", GAUGE, "", "jobs_reading",
           "Jobs reading the mount now, each with its own epochs (openers told apart by cgroup and session)."),
    Metric("liquidfs_cache_jobs_retired_total", COUNTER, "", "jobs_retired",
           "Jobs that stopped reading (idle for five minutes, or displaced by a new job of their user's or, idle "
           "for a minute, of anyone's)."),
    Metric("liquidfs_cache_jobs_refused_total", COUNTER, "", "jobs_refused",
           "New jobs that found no job slot they could take (every slot held by other users' jobs that read)."),
    Metric("liquidfs_cache_uncounted_reads_total", COUNTER, "", "jobs_uncounted_reads",
           "Reads of openers refused a job: served what is held, counted in no job's epochs."),
    Metric("liquidfs_cache_epoch", GAUGE, "", {_MEM: "epoch"}, "The newest epoch the reads began.",
           label=_LEVEL),
    Metric("liquidfs_cache_epoch_progress_ratio", GAUGE, "ratio", {_MEM: "epoch_progress"},
           "Share of the dataset's files read in the newest epoch so far.", label=_LEVEL),
    Metric("liquidfs_cache_window_hit_mean_ratio", GAUGE, "ratio", {_MEM: "window_hit_ratio_mean"},
           "Mean hit ratio of the windows of reads since epoch 2, the latest 4,096 windows at most (absent before "
           "the first window).",
           label=_LEVEL),
    Metric("liquidfs_cache_window_hit_sd_ratio", GAUGE, "ratio", {_MEM: "window_hit_ratio_sd"},
           "Standard deviation of the windows' hit ratios since epoch 2, the latest 4,096 windows at most (absent "
           "before the second window).",
           label=_LEVEL),
    Metric("liquidfs_cache_window_sd_bound_ratio", GAUGE, "ratio", {_MEM: "window_sd_bound"},
           "The standard deviation of the windows' hit ratios a random choice of the budget's share would show.",
           label=_LEVEL),
    # -- the mix (mount --mix) -------------------------------------------------------------------------------------
    Metric("liquidfs_mix_raw_ratio", GAUGE, "ratio", "mix.share", "Share of the images served raw now."),
    Metric("liquidfs_mix_prepared_ratio", GAUGE, "ratio", "mix.prepared",
           "Share of the images prepare expanded: the most the mix can serve raw."),
    Metric("liquidfs_mix_decisions_total", COUNTER, "", "mix.decisions",
           "Decisions of the adaptive mix's controller."),
    Metric("liquidfs_mix_opens_total", COUNTER, "", {"raw": "mix.opens_raw", "original": "mix.opens_original"},
           "Opens of images with a raw object, by what the mix served.", label="served"),
    Metric("liquidfs_mix_switches_total", COUNTER, "", "mix.switches",
           "Opens that served another representation than the file's previous open."),
    # -- the FUSE loop's requests (fuse.request_times) -----------------------------------------------------------
    Metric("liquidfs_requests_total", COUNTER, "", _requests("count"), "FUSE requests answered, by type.",
           label="request"),
    Metric("liquidfs_request_seconds_total", COUNTER, "seconds", _requests("wall_s"),
           "Wall time of the FUSE requests answered, by type (waits included).", label="request"),
    Metric("liquidfs_request_cpu_seconds_total", COUNTER, "seconds", _requests("cpu_s"),
           "CPU time the FUSE requests cost the daemon's loop itself, by type (with mount --time-requests).",
           label="request"),
    Metric("liquidfs_lookahead_directories_total", COUNTER, "", "lookahead_directories",
           "Directories whose metadata was warmed ahead of their opens (mount --lookahead)."),
    Metric("liquidfs_lookahead_files_total", COUNTER, "", "lookahead_files",
           "Files whose source (and raw object) metadata was warmed ahead of their opens."),
    Metric("liquidfs_lookahead_helper", GAUGE, "", "lookahead_helper",
           "Loops whose metadata read-ahead warms in a helper process (the others' warm in their own threads)."),
    Metric("liquidfs_lookahead_rows_hit_total", COUNTER, "", "lookahead_rows_hit",
           "LOOKUPs answered from the catalog rows the metadata read-ahead had read, without a query."),
    Metric("liquidfs_lookahead_left_to_others_total", COUNTER, "", "lookahead_left_to_others",
           "Directories another of the mount's loops had claimed to warm (mount --loops): their rows read only."),
    # -- the warm-up (mount --warmup) -----------------------------------------------------------------------------
    Metric("liquidfs_warmup_files_total", COUNTER, "", "warmup_files", "Files the warm-up has put in the cache."),
    Metric("liquidfs_warmup_bytes_total", COUNTER, "bytes", "warmup_bytes",
           "Bytes of the files the warm-up has put in the cache."),
)

#: Keys statistics() produces that are not exported, and why (a dict's key covers everything under it).
NOT_EXPORTED: dict[str, str] = {
    "pid": "the control file's, to find the daemon: no measurement",
    "loops": "mount --loops: each loop's pid and opens, for the user (the counters are the loops' sums)",
    "loop": "mount --loops: which loop answered (0: the first, the mount's daemon)",
    "loop_pid": "mount --loops: the answering loop's own pid: no measurement",
    "cluster_size_from": "a word for the user (--cluster-size, or the memcacheds' stats): no measurement",
    "source": "a path: metrics carry no paths",
    "store": "a path: metrics carry no paths",
    "data_path_why": "a sentence for the user (stats and the log show it); data_path is liquidfs_mount_info's",
    "mix.reason": "a sentence that changes at every decision: as a label, a new series each time",
    "epochs": "one entry per epoch ever: a history, which Prometheus keeps of the counters itself",
    "disk_epochs": "one entry per epoch ever: a history, which Prometheus keeps of the counters itself",
    "window_hit_ratios": "the last windows' ratios: a history (their mean and deviation are exported)",
    "window_byte_hit_ratios": "the last windows' ratios: a history (their mean and deviation are exported)",
    "window_size": "a constant of the code: reads per window",
    "jobs": "one entry per job reading now, by an id the mount gives in order: as labels, a new series per job "
            "(liquidfs stats shows them; the count is exported)",
    "cache_hits": "net of lost hits, so a lost hit lowers it: exported as predicted hits and lost hits",
    "cache_misses": "net of lost hits: exported as predicted misses (liquidfs_cache_misses_total) and lost hits",
    "cache_hit_bytes": "net of lost hits: exported as predicted hit bytes and lost hit bytes",
    "cache_miss_bytes": "net of lost hits: exported as predicted miss bytes and lost hit bytes",
}

#: Every key a row reads.
EXPORTED_KEYS = frozenset(key for metric in METRICS for _, key in metric.sources())

_reported: set[str] = set()  # keys without a row, logged once each


def unlisted(values: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, object]]:
    """The keys of ``values`` (a statistics() snapshot; nested ones as ``mix.share``) with neither a row nor an
    entry in ``NOT_EXPORTED``, and their values."""
    for key, value in values.items():
        path = prefix + str(key)
        if path in EXPORTED_KEYS or path in NOT_EXPORTED:
            continue
        if isinstance(value, Mapping):
            yield from unlisted(value, path + ".")
        else:
            yield path, value


def prometheus_text(values: Mapping[str, object]) -> str:
    """``values`` (a statistics() snapshot) in Prometheus' text exposition format (version 0.0.4), by the table.
    A row whose keys are absent (a part the mount does not have) or None (not measured yet) is left out."""
    lines: list[str] = []
    for metric in METRICS:
        if metric.kind == INFO:
            labels = {name: str(v) for name, key in metric.sources()
                      if (v := _lookup(values, key)) is not None and v != ""}
            samples = [f"{metric.name}{_labels(labels)} 1"]
        else:
            samples = [f"{metric.name}{_labels({metric.label: value} if metric.label else {})} {number}"
                       for value, key in metric.sources() if (number := _number(_lookup(values, key))) is not None]
        if samples:
            kind = GAUGE if metric.kind == INFO else metric.kind
            lines += [f"# HELP {metric.name} {_escape(metric.help)}", f"# TYPE {metric.name} {kind}", *samples]
    names = {metric.name for metric in METRICS}
    for key, value in unlisted(values):
        number = _number(value)
        name = "liquidfs_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
        exported = number is not None and name not in names
        if key not in _reported:
            _reported.add(key)
            if exported:
                log.warning("metrics: %s has no row in metrics.defs.METRICS: exported untyped as %s", key, name)
            else:
                log.warning("metrics: %s has no row in metrics.defs.METRICS: not exported", key)
        if exported:
            names.add(name)  # two keys that read alike ("a.b", "a_b"): the first only
            lines += [f"# TYPE {name} untyped", f"{name} {number}"]
    return "\n".join(lines) + "\n"


def counters(values: Mapping[str, object]) -> dict[str, object]:
    """What the exported counters read of ``values`` (one loop's statistics), nested as there: what a loop that
    ended leaves in the mount's totals, so that no counter goes down (a scraper takes a drop for a reset: a jump
    of each rate); its gauges (files open now) end with it."""
    kept: dict[str, object] = {}
    for metric in METRICS:
        if metric.kind != COUNTER:
            continue
        for _, key in metric.sources():
            value = _lookup(values, key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                *path, last = key.split(".")
                into = kept
                for part in path:
                    nested = into.setdefault(part, {})
                    assert isinstance(nested, dict)
                    into = nested
                into[last] = value
    return kept


def _lookup(values: Mapping[str, object], key: str) -> object:
    """``values[key]``, a nested one by its path (``mix.share``); None where absent."""
    value: object = values
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _number(value: object) -> str | None:
    """A sample's value as the text format writes it; None for what is not a number."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return None


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{name}="{_escape(value, quote=True)}"' for name, value in labels.items()) + "}" \
        if labels else ""


def _escape(text: str, quote: bool = False) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text
