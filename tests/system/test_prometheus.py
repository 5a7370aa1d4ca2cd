"""A real Prometheus (Debian's ``prometheus``) scraping a real mount's ``/metrics`` every second: PromQL reads the
cache's hit ratio from its counters and the mix's share as the mount's own control file states them, the scrape
passes ``promtool check metrics``, and every query of the shipped Grafana dashboard runs and returns data.

One mount and one Prometheus for the module: a store of a few small PNGs prepared whole (``--ratio 1``) and served
half raw (``--mix 0.5``), with the memory cache at half the dataset and a disk cache level, read for three epochs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from fusehelpers import Mount, fuse_available, wait_for
from ports import free_port
from liquidfs.metrics.defs import METRICS, unlisted

DASHBOARD = Path(__file__).resolve().parents[2] / "mount" / "grafana" / "liquidfs-dashboard.json"
FILES = 12
EPOCHS = 3
SCRAPE = "1s"
RATE_INTERVAL = "15s"  # what the dashboard's $__rate_interval stands for here: a window reaching back to the reads


def _cannot(why: str) -> None:
    """What this module needs and is not here: a failure in CI (scripts/test.sh installs it), a skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        _cannot(f"{name} not installed (apt-get install prometheus; scripts/test.sh installs it)")
    assert path is not None
    return path



@dataclass
class Scraped:
    prometheus: str            # its base URL
    metrics_port: int
    control: dict[str, Any]    # the mount's control file once the reads were done

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result: the vector (or a scalar as a one-sample vector); fails on any error."""
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                answer = json.load(reply)
        except urllib.error.HTTPError as exc:  # 400 for a query that does not parse, 422 for one that fails
            raise AssertionError(f"{promql}: {exc.read().decode()}") from None
        assert answer["status"] == "success", (promql, answer)
        data = answer["data"]
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]

    def value(self, promql: str) -> float:
        result = self.query(promql)
        assert len(result) == 1, (promql, result)
        return float(result[0]["value"][1])


def _images(root: Path) -> None:
    rng = np.random.default_rng(7)
    for i in range(FILES):
        d = root / f"city{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(d / f"img{i:02d}.png")


def _prometheus(tmp: Path, target_port: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: {SCRAPE}\n  evaluation_interval: {SCRAPE}\n"
                      f"scrape_configs:\n  - job_name: liquidfs\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{target_port}']\n")
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([_tool("prometheus"), f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"prometheus exited with {proc.returncode}: {log.read_text()}")
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _control(mnt: Path) -> dict[str, Any]:
    return dict(json.loads((mnt / ".__liquidfs__").read_bytes()))


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    # Before the conftest's FUSE gate (a function's fixture, which runs after this module's).
    if (problem := fuse_available()) is not None:
        _cannot(f"FUSE unavailable: {problem}")
    _tool("promtool")
    tmp = tmp_path_factory.mktemp("prometheus")
    src, store = tmp / "src", tmp / "store"
    _images(src)
    run_cli("prepare", str(src), "--store", str(store), "--ratio", "1", "--no-progress")
    metrics_port = free_port()
    proc, url = _prometheus(tmp, metrics_port)  # starts while the mount does
    mounts = Mount(tmp)
    try:
        mnt = mounts.mount(src, "--mix", "0.5", "--cache-size", "50%", "--disk-cache", str(tmp / "disk"),
                           "--disk-cache-size", "100%", "--metrics-port", str(metrics_port), store=store)
        wait_for(lambda: _ready(proc, url, tmp / "prometheus.log"), 60, what="prometheus ready")
        scraped = Scraped(url, metrics_port, {})
        # A first sample before any read, so the rates of the dashboard see the reads as an increase.
        wait_for(lambda: [s["value"][1] for s in scraped.query('up{job="liquidfs"}')] == ["1"], 30,
                 what="a first scrape of the mount")
        files = sorted(p.relative_to(src) for p in src.rglob("*.png"))
        for _ in range(EPOCHS):  # the same order each epoch: every file's next read is a new epoch's
            for rel in files:
                (mnt / rel).read_bytes()
        scraped.control = control = _control(mnt)
        assert control["opens"] == EPOCHS * FILES and control["cache_hits"] > 0 and control["disk_hits"] > 0

        def caught_up() -> bool:  # a scrape after the last read: Prometheus holds the control file's counters
            return all(scraped.query(f"{name} == {control[key]}") for name, key in (
                ("liquidfs_opens_total", "opens"),
                ('liquidfs_cache_hits_total{level="memory"}', "cache_hits_predicted"),
                ('liquidfs_cache_misses_total{level="memory"}', "cache_misses_predicted")))

        wait_for(caught_up, 30, what="a scrape after the reads")
        yield scraped
    finally:
        proc.kill()  # its database is a temporary directory: nothing to shut down cleanly
        proc.wait()
        mounts.cleanup()


@pytest.mark.fuse
def test_promql_reads_the_hit_ratio_and_the_mix_share_the_mount_reports(scraped: Scraped) -> None:
    control = scraped.control
    ratio = scraped.value('(liquidfs_cache_hits_total{level="memory"} - liquidfs_cache_lost_hits_total{level="memory"})'
                          ' / (liquidfs_cache_hits_total{level="memory"} + liquidfs_cache_misses_total{level="memory"})')
    assert ratio == pytest.approx(control["cache_hits"] / (control["cache_hits"] + control["cache_misses"]))
    assert 0 < ratio < 1
    assert scraped.value("liquidfs_mix_raw_ratio") == control["mix"]["share"] == 0.5
    assert scraped.value('liquidfs_mix_opens_total{served="raw"}') == control["mix"]["opens_raw"] > 0
    assert scraped.value('liquidfs_cache_hits_total{level="disk"}') == control["disk_hits"]
    served = {s["metric"]["level"]: float(s["value"][1]) for s in scraped.query("liquidfs_served_bytes_total")}
    assert served == {"storage": control["bytes_from_storage"], "memory": control["bytes_from_memory"],
                      "disk": control["bytes_from_disk"], "cluster": control["bytes_from_cluster"]}
    info = scraped.query("liquidfs_mount_info")
    assert len(info) == 1 and info[0]["metric"]["data_path"] == control["data_path"]
    assert info[0]["metric"]["mix_mode"] == "fixed" and info[0]["metric"]["dispatch"] == control["dispatch"]


@pytest.mark.fuse
def test_the_scrape_passes_promtool_and_every_key_of_the_mount_has_a_row(scraped: Scraped) -> None:
    with socket.create_connection(("127.0.0.1", scraped.metrics_port), timeout=10) as conn:
        conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    body = reply.partition(b"\r\n\r\n")[2]
    lint = subprocess.run([_tool("promtool"), "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint
    assert b"untyped" not in body
    assert list(unlisted(scraped.control)) == []


def _dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:  # a collapsed row holds its panels
            for target in inner.get("targets", []):
                yield inner, target


def test_the_dashboard_is_json_over_a_datasource_variable_and_names_only_declared_metrics() -> None:
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${datasource}"}
    assert variables["instance"]["datasource"] == source
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    declared = {metric.name for metric in METRICS}
    panels = set()
    for panel, target in _targets(dashboard):
        panels.add(panel["id"])
        assert panel["datasource"] == source and target["datasource"] == source, panel["title"]
        assert set(re.findall(r"liquidfs_\w+", target["expr"])) <= declared, target["expr"]
    assert len(panels) >= 10
    exprs = " ".join(target["expr"] for _, target in _targets(dashboard))
    for name in ("liquidfs_served_bytes_total", "liquidfs_opens_total", "liquidfs_cache_hits_total",
                 "liquidfs_cache_misses_total", "liquidfs_mix_raw_ratio", "liquidfs_mix_decisions_total",
                 "liquidfs_cache_held_bytes", "liquidfs_errors_total", "liquidfs_fallbacks_total"):
        assert name in exprs


def _as_grafana_sends(expr: str) -> str:
    """``expr`` with the dashboard's variables replaced as Grafana does (every mount selected)."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$instance", ".+")


@pytest.mark.fuse
def test_every_query_of_the_dashboard_runs_and_returns_data(scraped: Scraped) -> None:
    dashboard = _dashboard()
    for panel, target in _targets(dashboard):
        result = scraped.query(_as_grafana_sends(target["expr"]))
        assert result, f"{panel['title']}: no data for {target['expr']}"
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "instance")
    match = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"])
    assert match is not None and variable["query"]["query"] == variable["definition"]
    url = (f"{scraped.prometheus}/api/v1/label/{match[2]}/values?"
           + urllib.parse.urlencode({"match[]": match[1]}))
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert json.load(reply)["data"] == [f"127.0.0.1:{scraped.metrics_port}"]
