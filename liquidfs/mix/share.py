"""Which representation each open of an image serves, at the raw share the mount runs with (``mount --mix``).

``prepare`` left a raw object for a share P of the images (``--ratio``); the mount may serve any share s <= P of
them raw and the rest as their originals, chosen per open (issue 16):

* ``prepared``: every raw object is served (s = P; what the mount did before ``--mix``);
* a number: that share, fixed;
* ``adaptive``: a ``MixController`` moves the share within [0, P] while the mount runs (``steer``).

Which images are raw at a share is a seeded random choice: each image has a fixed rank in [0, 1) (a hash of the
store's seed and its path), and is served raw while its rank is below s / P. A loader that shuffles therefore
carries the share in every batch in expectation, and a change of the share switches only the images whose rank
lies between the old and the new share. A file switches only while nobody has it open: an open of a file that is
open already serves what the first open served (one backing per inode, and no reader sees its size change under
it); the caller makes the kernel drop the attributes of a file whose size changed before the open is answered.

Plain Python, no mount: ``fuse.operations.Operations`` asks ``view_held`` at each open and reports releases.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio
import xxhash

from ..catalog.nodes import REPR_ORIGINAL, REPR_RAW, Node
from .controller import MixController, Observation
from .modes import STEER_INTERVAL
from .pressure import CpuBusy, Stalls

log = logging.getLogger(__name__)

_MIX_SALT = 0x6D6978  # "mix"
_SEED_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class MixStatistics:
    mode: str              # "prepared", "fixed" or "adaptive"
    share: float           # raw share of the images served now (of all images eligible, as prepare's ratio)
    prepared: float        # the share prepare expanded: the most that can be served raw
    reason: str            # why the share is what it is (the controller's last decision)
    decisions: int         # decisions taken (adaptive)
    opens_raw: int         # opens of images with a raw object, served raw ...
    opens_original: int    # ... and served as their original
    switches: int          # opens that served another representation than the file's previous open


class Holds(Protocol):
    """What the mix asks of the level that holds files for the next epoch (``held.base.HeldLevel``)."""

    def held_raw(self, node: Node) -> bool | None: ...

    def drop(self, file: int) -> None: ...


class Mix:
    """The raw share and the per-open choice of representation."""

    def __init__(self, mode: str | float, prepared: float, *, seed: int = 0, start: float | None = None) -> None:
        if not 0 <= prepared <= 1:
            raise ValueError(f"prepared share must be within [0, 1], not {prepared}")
        self.prepared = prepared
        self.seed = seed
        if isinstance(mode, float):
            if mode > prepared + 1e-9:
                raise ValueError(f"--mix {mode:g} is more than the store holds raw: prepare expanded "
                                 f"{prepared:g} of the images (run prepare with a higher --ratio)")
            self.mode, self.share, self.reason = "fixed", mode, f"fixed by --mix {mode:g}"
        elif mode == "adaptive":
            first = prepared / 2 if start is None else min(prepared, max(0.0, start))
            why = "the profile's choice" if start is not None else "the middle of the prepared range"
            self.mode, self.share, self.reason = "adaptive", first, f"start: {why}"
        elif mode == "prepared":
            self.mode, self.share, self.reason = "prepared", prepared, "every prepared raw object"
        else:
            raise ValueError(f"unknown mix mode {mode!r}")
        self.decisions = 0
        self._open: dict[int, list[int]] = {}  # inode -> [served raw (0/1), opens]
        # By inode: 1 where its last open served the original (a byte a file, ids are dense: a dict's entry took
        # 74 bytes, 740 MB a loop at ten million files)
        self._last_original = bytearray()
        self._opens_raw = 0
        self._opens_original = 0
        self._switches = 0

    def set_share(self, share: float, reason: str) -> None:
        """The controller's decision (adaptive): from the next first open of each file on."""
        self.share = min(self.prepared, max(0.0, share))
        self.reason = reason
        self.decisions += 1

    def rank(self, node: Node) -> float:
        """The image's fixed place in [0, 1): below share / prepared it is served raw."""
        # Not prepare's own rank (which chose the prepared images by its order): a second, independent draw.
        return xxhash.xxh3_64_intdigest(node.path, seed=(self.seed ^ _MIX_SALT) & _SEED_MASK) / 2.0 ** 64

    def wants_raw(self, node: Node) -> bool:
        if self.mode == "prepared" or self.share >= self.prepared:
            return True
        return self.prepared > 0 and self.rank(node) < self.share / self.prepared

    def view(self, node: Node, held_raw: bool | None = None) -> Node:
        """What this open of ``node`` serves: ``node`` itself (its raw object, as the catalog says), or ``node``
        as its original. ``held_raw``: the representation a cache holds the file in (a hit costs neither decode
        nor storage, so it is served as held). Count the open; ``release`` must follow."""
        if node.representation != REPR_RAW:
            return node
        opened = self._open.get(node.id)
        if opened is not None:
            raw = bool(opened[0])  # another open of it exists: same bytes, same size
            opened[1] += 1
        else:
            raw = held_raw if held_raw is not None else self.wants_raw(node)
            self._open[node.id] = [int(raw), 1]
            last = self._last_original
            if node.id >= len(last):
                last.extend(bytes(max(node.id + 1, 2 * len(last)) - len(last)))
            if last[node.id] == raw:  # (never opened: 0, as if served raw, what prepare chose)
                self._switches += 1
            last[node.id] = not raw
        if raw:
            self._opens_raw += 1
            return node
        self._opens_original += 1
        return as_original(node)

    def view_held(self, node: Node, held: Holds | None) -> tuple[Node, bool]:
        """``view`` of ``node`` as ``held`` holds it, and whether a held original was let go for it.

        Held as its original while the share has risen past it: a hit would still cost the loader a PNG decode,
        the very work the share rose to spare. The held original goes (and its place in the policy, which counted
        the original's size): this open reads the raw object, and the policy decides afresh, at the raw size,
        whether to hold that. Not while another open of it is served (that one's bytes stay what they are)."""
        held_raw = held.held_raw(node) if held is not None else None
        swapped = False
        if held is not None and held_raw is False and self.wants_raw(node) and not self.is_open(node.id):
            held.drop(node.id)
            held_raw, swapped = None, True
        return self.view(node, held_raw), swapped

    def is_open(self, inode: int) -> bool:
        """Whether an open of ``inode`` is being served (a new open then gets the same representation)."""
        return inode in self._open

    def release(self, inode: int) -> None:
        opened = self._open.get(inode)
        if opened is None:
            return
        opened[1] -= 1
        if opened[1] <= 0:
            del self._open[inode]

    def statistics(self) -> MixStatistics:
        return MixStatistics(mode=self.mode, share=round(self.share, 4), prepared=self.prepared,
                             reason=self.reason, decisions=self.decisions, opens_raw=self._opens_raw,
                             opens_original=self._opens_original, switches=self._switches)


def as_original(node: Node) -> Node:
    """``node`` served as its source file: no raw object, the source's size."""
    return dataclasses.replace(node, representation=REPR_ORIGINAL, served_size=None, object=None, checksum=None)


async def steer(mix: Mix, controller: MixController, counters: Callable[[], tuple[int, int]], *,
                interval: float = STEER_INTERVAL,
                pressure: Callable[[str], float | None] | None = None,
                busy: Callable[[], float | None] | None = None) -> None:
    """Feed ``controller`` what the node showed every ``interval`` seconds and apply its decisions to ``mix``,
    until cancelled. ``counters()``: the mount's opens and bytes read from storage so far; ``pressure(kind)``
    and ``busy()``: the CPU and IO pressure and the share of CPU time busy since their previous call (default:
    the node's, ``Stalls`` and ``CpuBusy``)."""
    pressure = pressure if pressure is not None else Stalls()
    busy = busy if busy is not None else CpuBusy()
    failed = False
    try:
        pressure("cpu"), pressure("io")  # the counters' starting point, as ``busy``'s was taken when it was made
    except Exception as exc:  # as an interval's, below: the first interval then compares with nothing
        log.warning("mix: the pressure could not be read (%s: %s)", type(exc).__name__, exc, exc_info=True)
        failed = True
    opens_before, bytes_before = counters()
    before = trio.current_time()
    while True:
        await trio.sleep(interval)
        opens, taken = counters()
        now = trio.current_time()
        elapsed = max(now - before, 1e-9)
        try:
            _observe(mix, controller, pressure, busy, (opens - opens_before) / elapsed,
                     (taken - bytes_before) / elapsed)
            failed = False
        except Exception as exc:
            # The steering runs in the mount's nursery: anything it raises would end the mount, every reader's
            # files with it, over what is only a choice of representation. The share holds; a warning (with
            # its traceback) where the previous interval was sound, and the reason in `liquidfs stats`.
            log.log(logging.DEBUG if failed else logging.WARNING, "mix: this interval could not be judged "
                    "(%s: %s); the share holds", type(exc).__name__, exc, exc_info=not failed)
            failed = True
            mix.set_share(mix.share, f"hold: the interval could not be judged ({type(exc).__name__})")
        log.info("mix: raw share %.3f: %s", mix.share, mix.reason)
        opens_before, bytes_before, before = opens, taken, now


def _observe(mix: Mix, controller: MixController, pressure: Callable[[str], float | None],
             busy: Callable[[], float | None], images_per_s: float, storage_bytes_per_s: float) -> None:
    """One interval of ``steer``: what the node showed, given to ``controller``, its decision applied to ``mix``."""
    cpu, io = pressure("cpu"), pressure("io")
    cpu_busy = busy()
    if cpu is None or io is None:
        where = getattr(pressure, "root", "/proc/pressure")  # (--pressure-dir's, where given)
        mix.set_share(mix.share, f"hold: no pressure stall information in {where}")
    elif images_per_s == 0:
        # Nobody reads: the node's pressure says nothing about this mount's balance.
        mix.set_share(mix.share, "hold: no opens in the last interval")
    else:
        seen = Observation(images_per_s=images_per_s, storage_bytes_per_s=storage_bytes_per_s,
                           cpu_pressure=cpu, io_pressure=io, cpu_busy=cpu_busy or 0.0)
        decision = controller.observe(seen)
        mix.set_share(decision.share, f"{decision.reason}; {seen.images_per_s:.1f} opens/s")
