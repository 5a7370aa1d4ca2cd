"""What a mount is asked to be: ``liquidfs mount``'s options as parsed values (``MountConfig``), the same in the
command that parsed them and in the daemon it starts, which gets them as JSON (``to_json``/``from_json``).

A size given as a share of the dataset (``--cache-size 30%``) stays a ``Share`` until the catalog is open: only
the daemon knows the dataset's bytes, and it turns the share into bytes without parsing any text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..datapath.limits import IO_TIMEOUT, MAX_OPEN_BYTES, OPEN_THREADS, PAGE_CACHE_MODES
from ..mix.modes import MIX_MODES, STEER_INTERVAL


class MountError(Exception):
    """A mount that cannot be made; the message is for the user."""


#: What only one loop can hold or decide across opens (``mount --loops``: each loop has its own memory), as
#: ``mount``'s flag, and whether a mount's settings ask for it: the command's parsed arguments or a
#: ``MountConfig``, whose fields have the same names. The command refuses several loops with any of them, and the
#: daemon a config that has them (``MountConfig.check``); "auto" picks one loop.
ONE_LOOP_ONLY: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("--cache-size", lambda s: s.cache_size is not None),
    ("--disk-cache", lambda s: bool(s.disk_cache)),  # (an empty --cluster "$CLUSTER" is none, as the command takes it)
    ("--cluster", lambda s: bool(s.cluster)),
    ("--mix adaptive", lambda s: s.mix == "adaptive"),
    ("--warmup", lambda s: bool(s.warmup) and s.cache_size is not None),  # (dropped without a cache to warm)
    ("--data-path daemon", lambda s: s.data_path == "daemon"),
    ("--page-cache direct", lambda s: s.page_cache == "direct"),
    ("--verify-reads", lambda s: bool(s.verify_reads)),
)


def one_loop_only(settings: Any) -> list[str]:
    """The flags of ``ONE_LOOP_ONLY`` that ``settings`` ask for."""
    return [flag for flag, asks in ONE_LOOP_ONLY if asks(settings)]


@dataclass(frozen=True)
class Share:
    """A share of the dataset as served (``30%``), in [0, 1]: bytes once the dataset's size is known."""

    fraction: float

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:  # NaN too
            raise ValueError(f"a share of the dataset is 0% to 100%, not {self.fraction:g}")

    def __str__(self) -> str:
        return f"{100 * self.fraction:g}%"


#: A size option's value: bytes, or a share of the dataset as served.
Amount = int | Share


def bytes_of(amount: Amount, dataset_bytes: int) -> int:
    """The bytes ``amount`` stands for in a dataset of ``dataset_bytes`` served."""
    return int(amount.fraction * dataset_bytes) if isinstance(amount, Share) else amount


#: ``mount --data-path``: passthrough where available (auto), passthrough or no mount, every byte by the daemon.
DATA_PATHS = ("auto", "passthrough", "daemon")
#: ``mount --readahead-kb``: 1 MiB reads instead of the kernel's 128 KiB (``serve.set_readahead``).
READAHEAD_KB = 1024
#: ``mount --metrics-address``: this host only unless the deployment says otherwise (a pod's IP).
METRICS_ADDRESS = "127.0.0.1"
#: ``mount --pressure-dir``: the node's pressure stall information.
PRESSURE_DIR = Path("/proc/pressure")
#: Mount options liquidfs sets itself: the mount is read-only, and umount and stats know it by its type.
OWN_FUSE_OPTIONS = ("rw", "subtype")
#: Bounds of the mount's numeric tuning flags: past them a value is a typo, never a setting (a thread per
#: storage read by the hundred million; a readahead the kernel refuses, said only at info level).
MAX_THREADS = 4096
MAX_READAHEAD_KB = 1 << 20
MIN_SECONDS = 0.01


@dataclass(frozen=True)
class MountConfig:
    """Every option of ``liquidfs mount``, parsed and checked (``cli.options.mount_config``)."""

    source: str  # the source as the store names it (a directory or an s3:// URL): to open it, and for messages
    mountpoint: Path
    store: str  # the store as ``stores.open_store`` opens it (``Store.label``)
    #: (device, inode) of the mount point when the command checked it (``control.check_mountpoint``), which the
    #: daemon mounts on only if it is still that directory (``control.still_the_mount_point``); () unchecked.
    mountpoint_seen: tuple[int, ...] = ()
    allow_other: bool = False
    fuse_options: tuple[str, ...] = ()
    threads: int = 4
    open_threads: int = OPEN_THREADS
    #: ``mount --loops``: processes answering the one FUSE connection, each its own loop (``daemon.loops``).
    loops: int = 1
    metrics_port: int | None = None
    metrics_address: str = METRICS_ADDRESS
    cache_size: Amount | None = None
    warmup: bool = False
    readahead_kb: int = READAHEAD_KB
    io_timeout: float = IO_TIMEOUT
    page_cache: str = PAGE_CACHE_MODES[0]
    open_bytes: int = MAX_OPEN_BYTES
    push_pages: bool = True
    disk_cache: Path | None = None
    disk_cache_size: Amount | None = None
    #: ``mount --cluster``: the memcacheds of the nodes reading this dataset, and what they hold together.
    cluster: tuple[tuple[str, int], ...] | None = None
    cluster_size: Amount | None = None
    #: ``mount --cluster-key-file``: checked by the command, read again by the daemon (the key never travels).
    cluster_key_file: Path | None = None
    data_path: str = DATA_PATHS[0]
    #: ``mount --verify-reads``: every file read whole and checked before its first byte is served.
    verify_reads: bool = False
    #: ``mount --time-requests``: the loop CPU of each request type too (``fuse.request_times``).
    time_requests: bool = False
    #: ``mount --lookahead`` (default on): warm a directory's metadata when a lookup shows it cold.
    lookahead: bool = True
    #: ``mount --mix``: "prepared", "adaptive" or a fixed raw share in [0, 1].
    mix: str | float = MIX_MODES[0]
    #: ``--mix adaptive``: seconds between decisions, and where the pressure stall information is read.
    mix_interval: float = STEER_INTERVAL
    pressure_dir: Path = PRESSURE_DIR

    def to_json(self) -> str:
        return json.dumps({f.name: _encode(getattr(self, f.name)) for f in fields(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MountConfig:
        """The config ``to_json`` wrote; ValueError for anything else (a field missing, unknown or of the wrong
        type: the daemon serves nothing it was not meant to)."""
        values = json.loads(text)
        if not isinstance(values, dict) or set(values) != {f.name for f in fields(cls)}:
            raise ValueError("a mount config names every field of MountConfig and nothing else")
        config = cls(**{name: _DECODE[name](value) for name, value in values.items()})
        config.check()
        return config

    def check(self) -> None:
        """ValueError where a value breaks what ``liquidfs mount`` checks (``cli.options.mount_config``): a config
        written by hand for the daemon (``--daemon-config``, which a sudo rule for ``liquidfs mount`` lets through)
        gets no mount the command would refuse. ``allow_other`` given as a FUSE option, say, opened the mount to
        every user without the check of each one's open against the source."""
        from ..datapath.shared_inodes import MAX_LOOPS

        if any("," in option or "\\" in option for option in self.fuse_options):
            # libfuse splits each on its commas (a backslash escapes one): "fsname=x,allow_other" opened the mount
            # to every user past the check below. The command gives one option each.
            raise ValueError("a mount config FUSE option holding a comma or a backslash: one option each")
        given = {option.split("=", 1)[0] for option in self.fuse_options} & {"allow_other", *OWN_FUSE_OPTIONS}
        if given:
            raise ValueError(f"FUSE options {sorted(given)} are liquidfs's own to set (allow_other is the "
                             "allow_other field)")
        for name, value, low, high in (("loops", self.loops, 1, MAX_LOOPS), ("threads", self.threads, 1, MAX_THREADS),
                                       ("open_threads", self.open_threads, 1, MAX_THREADS),
                                       ("readahead_kb", self.readahead_kb, 0, MAX_READAHEAD_KB),
                                       ("metrics_port", 0 if self.metrics_port is None else self.metrics_port, 0,
                                        65535)):
            if not low <= value <= high:
                raise ValueError(f"a mount config {name} of {value}, outside {low}..{high}")
        if self.io_timeout < MIN_SECONDS or self.mix_interval < MIN_SECONDS:
            raise ValueError("a mount config io_timeout or mix_interval under the shortest a mount takes")
        if not self.mountpoint.is_absolute():
            raise ValueError("a mount config whose mount point is not absolute")
        if self.loops > 1 and one_loop_only(self):
            raise ValueError(f"a mount config of several loops with what one loop must hold or decide "
                             f"({', '.join(one_loop_only(self))})")


def _encode(value: object) -> Any:
    if isinstance(value, Share):
        return {"share": value.fraction}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


def _typed(kind: type, *, none: bool = False) -> Any:
    def decode(value: object) -> Any:
        if value is None and none:
            return None
        # bool is an int to Python: a flag's true must not become one thread
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise ValueError(f"a mount config value of type {type(value).__name__}, not {kind.__name__}")
        if kind is float and not math.isfinite(float(value)):  # type: ignore[arg-type]
            raise ValueError("a mount config number that is not finite")
        return float(value) if kind is float else value  # type: ignore[arg-type]
    return decode


def _path(*, none: bool = False) -> Any:
    text = _typed(str, none=none)
    return lambda value: None if value is None and none else Path(text(value))


def _amount(value: object) -> Amount | None:
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"share"}:
        return Share(_typed(float)(value["share"]))
    size: int = _typed(int)(value)
    if size < 0:
        raise ValueError(f"a mount config size of {size} bytes")
    return size


def _strings(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError("a mount config list that is not one")
    return tuple(_typed(str)(item) for item in value)


def _identity(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) not in (0, 2):
        raise ValueError("a mount config identity that is not [device, inode]")
    return tuple(_typed(int)(item) for item in value)


def _cluster(value: object) -> tuple[tuple[str, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(peer, list) and len(peer) == 2 for peer in value):
        raise ValueError("a mount config cluster that is not a list of [host, port]")
    return tuple((_typed(str)(host), _typed(int)(port)) for host, port in value)


def _choice(choices: tuple[str, ...]) -> Any:
    def decode(value: object) -> str:
        if value not in choices:
            raise ValueError(f"a mount config value {value!r} outside {', '.join(choices)}")
        return str(value)
    return decode


def _mix(value: object) -> str | float:
    if value in MIX_MODES:
        return str(value)
    share: float = _typed(float)(value)
    if not 0 <= share <= 1:
        raise ValueError(f"a mount config mix share of {share}")
    return share


_DECODE: dict[str, Any] = {
    "source": _typed(str), "mountpoint": _path(), "mountpoint_seen": _identity, "store": _typed(str), "allow_other": _typed(bool),
    "fuse_options": _strings, "threads": _typed(int), "open_threads": _typed(int), "loops": _typed(int), "metrics_port": _typed(int, none=True),
    "metrics_address": _typed(str), "cache_size": _amount, "warmup": _typed(bool), "readahead_kb": _typed(int),
    "io_timeout": _typed(float), "page_cache": _choice(PAGE_CACHE_MODES), "open_bytes": _typed(int),
    "push_pages": _typed(bool),
    "disk_cache": _path(none=True), "disk_cache_size": _amount, "cluster": _cluster, "cluster_size": _amount,
    "cluster_key_file": _path(none=True), "data_path": _choice(DATA_PATHS), "verify_reads": _typed(bool),
    "time_requests": _typed(bool), "lookahead": _typed(bool), "mix": _mix, "mix_interval": _typed(float),
    "pressure_dir": _path(),
}
