"""``--mix adaptive`` probes (issue 30): with no pressure binding, a real loader's rate through a real mount
carries the share to where that loader runs faster, both ways. One data path: the controller sits above them
(``test_mix_mount`` covers the mix on both)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fusehelpers import Mount, wait_for
from liquidfs.daemon.control import read_control
from mixhelpers import adaptive_mount, prepared_all_raw, read_checked

pytestmark = pytest.mark.fuse


def test_balanced_the_adaptive_mix_probes_toward_what_the_loader_draws_faster(mounter: Mount, tmp_path: Path,
                                                                             request: pytest.FixtureRequest) -> None:
    """No pressure binds (both low), so only the loader's rate can tell the shares apart (issue 30). A loader
    reading the mount in a loop, its per-image work set by the bytes it gets (a raw image 2 ms, a PNG 8 ms):
    the controller's probes carry the share from the middle to the top. Then raw images cost more (12 ms vs
    4 ms) and the probes carry it down. The mount's count of opens is the loader's own, and every read is whole."""
    src, store, objects = prepared_all_raw(tmp_path / "data")
    mnt, pressure = adaptive_mount(src, store, mounter, tmp_path / "psi", request)
    pressure.set(cpu=0.02, io=0.02)
    # The two costs far apart, so that one probe step (a tenth of the images) moves the rate well past the noise
    # of a 2-core CI machine (2 ms against 8 ms once took longer than the up phase's 120 s there).
    costs = {"raw": 0.001, "png": 0.016}
    rels = sorted(objects)
    stop = threading.Event()
    count = [0]
    problems: list[str] = []

    def loader() -> None:
        try:
            while not stop.is_set():
                for rel in rels:
                    raw = read_checked(mnt, rel, src, objects[rel])
                    count[0] += 1
                    time.sleep(costs["raw" if raw else "png"])
        except BaseException as exc:  # reported by the test, not lost in the thread
            problems.append(repr(exc))

    opens_before = read_control(mnt)["opens"]
    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    request.addfinalizer(lambda: (stop.set(), thread.join()))
    reasons: list[str] = []

    def share_is(test) -> bool:  # type: ignore[no-untyped-def]
        mix = read_control(mnt)["mix"]
        reasons.append(mix["reason"])
        assert not problems, problems
        return bool(test(mix["share"]))

    def until(test, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        try:
            wait_for(lambda: share_is(test), timeout, interval=0.2, what=what)
        except TimeoutError as exc:  # the controller's last reasons say why it did not go there
            raise AssertionError(f"{exc}; last reasons: {changes(reasons)[-12:]}") from None

    # Bounds on waits for a direction, not a speed: on CI's 2 cores the rate's noise (+-20 % an interval) has
    # undone enough probes to take past 120 s up and 180 s down (twice in one session), alone it takes ~60 s.
    until(lambda s: s >= 0.9, 300, "the probes to carry the share up")
    assert any(r.startswith("probe kept") for r in reasons), reasons[-20:]
    assert all("decode binds" not in r and "storage binds" not in r for r in reasons)  # the pressures never moved it
    costs.update(raw=0.02, png=0.002)
    until(lambda s: s <= 0.6, 300, "the probes to carry the share down")
    stop.set()
    thread.join()
    assert not problems, problems
    stats = read_control(mnt)
    assert stats["opens"] - opens_before == count[0]  # the rate the mount sees is the loader's
    assert stats["errors"] == 0


def changes(reasons: list[str]) -> list[str]:
    """The reasons, each run of the same one once."""
    return [r for i, r in enumerate(reasons) if i == 0 or r != reasons[i - 1]]
