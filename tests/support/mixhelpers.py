"""What the ``--mix`` mount tests share: pressure files the test sets, an adaptive mount steered by them, and a
read that checks its bytes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from fusehelpers import Mount
from liquidfs.catalog.catalog import Catalog
from liquidfs.prepare import prepare
from sample import make_sample

PSI = "some avg10={:.2f} avg60=0.00 avg300=0.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


class PressureFiles:
    """Pressure files as the kernel keeps them: ``set`` says which share of the time stalls, and a thread grows
    each file's ``total`` (microseconds stalled) at that rate, as the mount reads the growth per interval."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.shares = {"cpu": 0.02, "io": 0.02}
        self.totals = dict.fromkeys(self.shares, 0.0)
        self._stop = threading.Event()
        self._write(0.0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def set(self, cpu: float, io: float) -> None:
        self.shares = {"cpu": cpu, "io": io}

    def _write(self, seconds: float) -> None:
        for kind, share in self.shares.items():
            self.totals[kind] += share * seconds * 1e6
            tmp = self.where / f".{kind}"
            tmp.write_text(PSI.format(100 * share, int(self.totals[kind])))
            tmp.rename(self.where / kind)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.05):
            now = time.monotonic()
            self._write(now - last)
            last = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def prepared_all_raw(work: Path) -> tuple[Path, Path, dict[str, Path]]:
    """24 small images under ``work``, every one with a raw object (prepare --ratio 1): the source, the store and
    each image's object."""
    src = make_sample(work / "src", count=24, width=128, height=64, seed=5)
    store = work / "store"
    prepare(src, store, 1.0, progress=False)
    catalog = Catalog.open(store, readonly=True)
    objects = {os.fsdecode(n.path): store / str(n.object) for n in catalog.files() if n.served_raw}
    catalog.close()
    assert len(objects) == 24
    return src, store, objects


def adaptive_mount(src: Path, store: Path, mounter: Mount, psi: Path, request: pytest.FixtureRequest,
                   *extra: str) -> tuple[Path, PressureFiles]:
    """A ``--mix adaptive`` mount of ``store``, steered every 0.3 s by pressure files the test sets in ``psi``."""
    psi.mkdir()
    pressure = PressureFiles(psi)
    request.addfinalizer(pressure.stop)
    # As a cgroup v2 group's directory: its CPU use stays put (busy 0), so only the pressure files decide,
    # whatever else this machine runs meanwhile.
    (psi / "cpu.stat").write_text("usage_usec 1000\nuser_usec 600\nsystem_usec 400\n")
    mnt = mounter.mount(src, "--mix", "adaptive", "--mix-interval", "0.3", "--pressure-dir", str(psi), *extra,
                        store=store)
    return mnt, pressure


def read_checked(mnt: Path, rel: str, src: Path, raw_object: Path) -> bool:
    """Read one file as a loader does (open, fstat, read to the size fstat said); its bytes must be the source's
    or the raw object's, whole, and decode to the source's pixels. True when it was served raw."""
    with open(mnt / rel, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(size + 1)
    assert len(data) == size, f"{rel}: fstat said {size}, read {len(data)}"
    original, raw = (src / rel).read_bytes(), raw_object.read_bytes()
    assert data in (original, raw), f"{rel}: neither the source nor its raw object"
    return data == raw
