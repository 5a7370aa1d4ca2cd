"""Deployment assets under mount/: Kubernetes manifests, the fstab helper, systemd unit, Dockerfile.

Fast, static tests run everywhere.  Three tests touch the real system (run them as root):

* ``test_fstab_mount_real`` (``fuse``): installs mount/mount.fuse.liquidfs as /sbin/mount.fuse.liquidfs
  for the duration of the test and mounts a temp dir with ``mount -t fuse.liquidfs``.
* ``test_container_image`` (``slow``): debootstraps a bookworm base image (cached in podman as
  localhost/liquidfs-base), builds mount/Dockerfile with podman, runs prepare in it without capabilities,
  runs it privileged with /dev/fuse and a mount point shared back to the host (both with a read-only root,
  as the manifests' readOnlyRootFilesystem), reads through the mount, stops it with SIGTERM.  It may apt-get
  install podman, debootstrap and runc only when CI or LIQUIDFS_TEST_CONTAINER=1 is set.

With CI set, a FUSE test that cannot run fails instead of skipping, the container test included (it says the
exact step and reason); elsewhere it skips with them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MOUNT_DIR = REPO / "mount"
K8S_DIR = MOUNT_DIR / "kubernetes"
HELPER = MOUNT_DIR / "mount.fuse.liquidfs"
INSTALL_HOST = MOUNT_DIR / "install-host.sh"
UNIT = MOUNT_DIR / "systemd" / "liquidfs@.service"
EXAMPLE_ENV = MOUNT_DIR / "systemd" / "example.env"
DOCKERFILE = MOUNT_DIR / "Dockerfile"
DOCKERIGNORE = MOUNT_DIR / "Dockerfile.dockerignore"

IN_CI = bool(os.environ.get("CI"))

#: YAML files under mount/kubernetes that are not Kubernetes API objects (kustomize's own config).
K8S_NOT_API_OBJECTS = {"kustomization.yaml"}
K8S_WORKLOADS = {"pod-native-sidecar.yaml", "job-native-sidecar.yaml", "pod-classic-sidecar.yaml"}
#: What kustomization.yaml lists beside the one workload it deploys.
K8S_WITH_EVERY_WORKLOAD = {"networkpolicy.yaml"}
#: The container that mounts FUSE: the only one that may be privileged.
FUSE_CONTAINER = "liquidfs"
MOUNTPOINT_IN_POD = "/mnt/dataset"
METRICS_PORT = 9180


def skip_or_fail(reason: str) -> None:
    """Skip, except under CI where a FUSE test that cannot run is a failure."""
    if IN_CI:
        pytest.fail(f"{reason} (CI is set: this test may not skip)")
    pytest.skip(reason)


def run(cmd: list[str], *, timeout: float = 60, check: bool = False, **kw) -> subprocess.CompletedProcess:
    if "stdout" not in kw and "stderr" not in kw:
        kw["capture_output"] = True
    proc = subprocess.run(cmd, timeout=timeout, text=True, check=False, **kw)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


# ------------------------------------------------------------------------------------------------------
# mount table helpers (shared by the real FUSE tests)
# ------------------------------------------------------------------------------------------------------

def _unescape_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_at(path: Path) -> list[tuple[str, str]]:
    """(fstype, propagation tags) of every mount stacked on ``path``, bottom first."""
    target = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if _unescape_mountinfo(fields[4]) == target:
                found.append((right.split()[0], " ".join(fields[6:])))
    return found


def is_fuse_mounted(path: Path) -> bool:
    return any(fstype.startswith("fuse") for fstype, _ in mounts_at(path))


def force_unmount(path: Path) -> None:
    """Best-effort cleanup: lazily detach every FUSE mount on ``path``; never raises."""
    for _ in range(4):
        if not is_fuse_mounted(path):
            return
        with contextlib.suppress(Exception):
            subprocess.run(["fusermount3", "-u", "-z", str(path)], timeout=30, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if is_fuse_mounted(path):
            with contextlib.suppress(Exception):
                subprocess.run(["umount", "-l", str(path)], timeout=30, check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def make_source_tree(root: Path) -> dict[str, bytes]:
    """A small dataset: text, a binary blob and a PNG; returns {relative path: bytes}."""
    from PIL import Image  # runtime dependency of liquidfs

    (root / "train" / "cls0").mkdir(parents=True)
    files: dict[str, bytes] = {
        "labels.txt": b"cls0\ncls1\n",
        "train/blob.bin": os.urandom(300_000),
    }
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    png = root / "train" / "cls0" / "img0.png"
    Image.frombytes("RGB", (64, 48), bytes(range(256)) * 36).save(png)
    files["train/cls0/img0.png"] = png.read_bytes()
    return files


def assert_same_dataset(mounted: Path, files: dict[str, bytes]) -> None:
    # Nothing is prepared in these tests, so every file is served as its original bytes.
    for rel, data in files.items():
        got = (mounted / rel).read_bytes()
        assert got == data, f"{rel}: {len(got)} bytes through the mount differ from the {len(data)} source bytes"


# ------------------------------------------------------------------------------------------------------
# Kubernetes manifests
# ------------------------------------------------------------------------------------------------------

def _kubernetes_validate():
    try:
        import kubernetes_validate.utils as kv_utils
    except ImportError:
        pytest.fail("kubernetes-validate is a test dependency: pip install kubernetes-validate")
    return kv_utils


def _k8s_versions() -> list[str]:
    """1.29 (native sidecars on by default) and the newest version kubernetes-validate ships schemas for."""
    try:
        import kubernetes_validate.utils as kv_utils
    except ImportError:
        return ["1.29"]
    latest = kv_utils.latest_version()  # e.g. "1.37.0"
    versions = ["1.29"]
    if kv_utils.major_minor(latest) != "1.29":
        versions.append(kv_utils.major_minor(latest))
    return versions


def _load_yaml_all(path: Path) -> list[dict]:
    import yaml

    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _load_yaml(path: Path) -> dict:
    docs = _load_yaml_all(path)
    assert len(docs) == 1, f"{path.name}: expected one document"
    return docs[0]


def k8s_manifests() -> list[Path]:
    return sorted(p for p in K8S_DIR.glob("*.y*ml") if p.name not in K8S_NOT_API_OBJECTS)


def test_k8s_manifest_set():
    names = {p.name for p in k8s_manifests()}
    assert K8S_WORKLOADS <= names, f"missing manifests: {K8S_WORKLOADS - names}"
    for name in K8S_NOT_API_OBJECTS:
        assert (K8S_DIR / name).is_file()


@pytest.mark.parametrize("version", _k8s_versions())
@pytest.mark.parametrize("manifest", k8s_manifests(), ids=lambda p: p.name)
def test_k8s_manifest_validates_strict(manifest: Path, version: str):
    kv = _kubernetes_validate()
    docs = _load_yaml_all(manifest)
    assert docs, f"{manifest.name} is empty"
    for doc in docs:
        try:
            validated = kv.validate(doc, version, strict=True)
        except kv.SchemaNotFoundError as e:  # an unknown kind would otherwise pass with a mere warning
            pytest.fail(f"{manifest.name}: {e.message}")
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{manifest.name} invalid for Kubernetes {version}: {path}: {e.message}")
        assert validated == version


def test_k8s_validate_cli():
    """The same check as CI would run it by hand: kubernetes-validate --strict, no warnings."""
    _kubernetes_validate()
    cmd = [sys.executable, "-m", "kubernetes_validate", "--strict"]
    for v in _k8s_versions():
        cmd += ["-k", v]
    proc = run(cmd + [str(p) for p in k8s_manifests()])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "WARN" not in out and "ERROR" not in out, out
    documents = sum(len(_load_yaml_all(p)) for p in k8s_manifests())
    assert out.count("passed") == documents * len(_k8s_versions()), out


def test_k8s_misspelled_field_fails(tmp_path: Path):
    """Strict validation is really strict: a typo in a field name must be rejected."""
    kv = _kubernetes_validate()
    text = (K8S_DIR / "pod-native-sidecar.yaml").read_text()
    assert "mountPropagation: Bidirectional" in text
    bad = tmp_path / "pod-typo.yaml"
    bad.write_text(text.replace("mountPropagation: Bidirectional", "mountPropogation: Bidirectional"))
    for version in _k8s_versions():
        with pytest.raises(kv.ValidationError, match="mountPropogation"):
            kv.validate(_load_yaml(bad), version, strict=True)
    proc = run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", _k8s_versions()[-1], str(bad)])
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "mountPropogation" in proc.stdout + proc.stderr


def _kustomization() -> dict:
    return _load_yaml(K8S_DIR / "kustomization.yaml")


def _knobs() -> dict[str, str]:
    (gen,) = [g for g in _kustomization()["configMapGenerator"] if g["name"] == "liquidfs-config"]
    return dict(lit.split("=", 1) for lit in gen["literals"])


def _pod_spec(doc: dict) -> tuple[dict, dict]:
    """(pod metadata, pod spec) of a Pod or of a Job's template."""
    if doc["kind"] == "Pod":
        return doc["metadata"], doc["spec"]
    assert doc["kind"] == "Job", doc["kind"]
    return doc["spec"]["template"]["metadata"], doc["spec"]["template"]["spec"]


def _quantity_bytes(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, q
    return float(m.group(1)) * (units[m.group(2)] if m.group(2) else 1)


def test_kustomization_knobs():
    kz = _kustomization()
    assert kz["kind"] == "Kustomization"
    workloads = [res for res in kz["resources"] if res not in K8S_WITH_EVERY_WORKLOAD]
    assert len(workloads) == 1 and workloads[0] in K8S_WORKLOADS, f"kustomization lists {workloads}, not one workload"
    assert K8S_WITH_EVERY_WORKLOAD <= set(kz["resources"])
    knobs = _knobs()
    for key in ("LIQUIDFS_SOURCE", "LIQUIDFS_STORE", "LIQUIDFS_RATIO", "LIQUIDFS_CACHE_SIZE"):
        assert knobs.get(key), f"knob {key} missing from the configMapGenerator"
    assert not knobs["LIQUIDFS_CACHE_SIZE"].endswith("%"), "keep an absolute cache size in a pod"
    image_names = {i["name"] for i in kz["images"]}
    for manifest in K8S_WORKLOADS:
        _, spec = _pod_spec(_load_yaml(K8S_DIR / manifest))
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["name"].startswith("liquidfs"):
                assert c["image"].rsplit(":", 1)[0] in image_names, f"{manifest}/{c['name']}: image not a kustomize knob"


@pytest.mark.parametrize("manifest", sorted(K8S_WORKLOADS))
def test_k8s_workload_semantics(manifest: str):
    """What the schema cannot check: the FUSE sidecar wiring every workload must have."""
    doc = _load_yaml(K8S_DIR / manifest)
    meta, spec = _pod_spec(doc)
    inits = spec.get("initContainers", [])
    containers = spec["containers"]
    native = manifest != "pod-classic-sidecar.yaml"
    by_name = {c["name"]: c for c in inits + containers}
    sidecar, trainer = by_name["liquidfs"], by_name["trainer"]
    if native:
        assert sidecar in inits and sidecar.get("restartPolicy") == "Always", "native sidecar = restartable init container"
        assert [c["name"] for c in inits].index("liquidfs") == len(inits) - 1, "liquidfs must be the last init container"
    else:
        assert sidecar in containers and "restartPolicy" not in sidecar
    assert trainer in containers
    assert spec["restartPolicy"] == "Never"

    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in inits + containers:
        for vm in c.get("volumeMounts", []):
            assert vm["name"] in volumes, f"{c['name']} mounts undefined volume {vm['name']}"

    # /dev/fuse from the host, privileged (required by the API for Bidirectional propagation)
    assert volumes["dev-fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    sc_mounts = {vm["mountPath"]: vm for vm in sidecar["volumeMounts"]}
    assert sc_mounts["/dev/fuse"]["name"] == "dev-fuse"
    assert sidecar["securityContext"]["privileged"] is True
    assert sc_mounts[MOUNTPOINT_IN_POD]["mountPropagation"] == "Bidirectional"
    tr_mounts = {vm["mountPath"]: vm for vm in trainer["volumeMounts"]}
    assert tr_mounts[MOUNTPOINT_IN_POD]["mountPropagation"] == "HostToContainer"
    assert tr_mounts[MOUNTPOINT_IN_POD]["name"] == sc_mounts[MOUNTPOINT_IN_POD]["name"]
    assert trainer["securityContext"].get("privileged") is not True
    assert trainer["securityContext"]["allowPrivilegeEscalation"] is False

    # probes and clean shutdown
    for probe in ("startupProbe", "readinessProbe"):
        cmd = sidecar[probe]["exec"]["command"]
        assert cmd[:2] == ["liquidfs", "stats"] and "--probe" in cmd and cmd[-1] == MOUNTPOINT_IN_POD, cmd
    pre_stop = sidecar["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:2] == ["liquidfs", "umount"] and pre_stop[-1] == MOUNTPOINT_IN_POD, pre_stop
    assert spec["terminationGracePeriodSeconds"] >= 30

    # the mount command: ENTRYPOINT args (native) or the wrapper script (classic)
    argv = sidecar.get("command", []) + sidecar.get("args", [])
    text = " ".join(argv)
    assert MOUNTPOINT_IN_POD in text and "--allow-other" in text
    assert "--cache-size" in text and "--store" in text
    assert re.search(rf"--metrics-port[ \"',]+{METRICS_PORT}\b", text), text
    if not native:
        assert "liquidfs mount --foreground" in text

    # metrics: port + prometheus annotations
    ports = {p["name"]: p for p in sidecar["ports"]}
    assert ports["metrics"]["containerPort"] == METRICS_PORT
    ann = meta["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(METRICS_PORT)
    assert ann["prometheus.io/path"].startswith("/")

    # memory covers the cache budget (+ at least 1 GiB of daemon overhead), requests == limits
    cache = _quantity_bytes(_knobs()["LIQUIDFS_CACHE_SIZE"].replace("G", "Gi"))  # read 24G as GiB: the safe side
    res = sidecar["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"]
    assert _quantity_bytes(res["limits"]["memory"]) >= cache + 2**30

    # every $(VAR) / $VAR used is a knob, and the containers that use them get the ConfigMap
    knobs = _knobs()
    for c in inits + containers:
        used = set(re.findall(r"\$\(?(LIQUIDFS_[A-Z_]+)\)?", " ".join(c.get("command", []) + c.get("args", []))))
        assert used <= set(knobs), f"{c['name']} uses undefined {used - set(knobs)}"
        if used:
            refs = [e["configMapRef"]["name"] for e in c.get("envFrom", []) if "configMapRef" in e]
            assert refs == ["liquidfs-config"], f"{c['name']} uses knobs without envFrom liquidfs-config"


def _pod_documents() -> list[tuple[str, dict]]:
    """(file name, document) of every Pod and Job under mount/kubernetes."""
    return [(p.name, d) for p in k8s_manifests() for d in _load_yaml_all(p) if d["kind"] in ("Pod", "Job")]


def _secrets_of(container: dict) -> set[str]:
    names = {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
    names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
              if "secretKeyRef" in e.get("valueFrom", {})}
    return names


@pytest.mark.parametrize("manifest", sorted({name for name, _ in _pod_documents()}))
def test_k8s_container_hardening(manifest: str):
    """Every image is mounted read-only, with a /tmp of its own to write to; every container but the FUSE server
    also runs without privileges, capabilities or privilege escalation, under the runtime's seccomp profile."""
    _, spec = _pod_spec(_load_yaml(K8S_DIR / manifest))
    assert spec["automountServiceAccountToken"] is False, "nothing here talks to the Kubernetes API"
    volumes = {v["name"]: v for v in spec["volumes"]}
    tmp_volumes = []
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, f"{c['name']}: image writable"
        # liquidfs prepare's process pool does not start without a writable temporary directory
        tmp = {vm["mountPath"]: vm for vm in c.get("volumeMounts", [])}.get("/tmp")
        assert tmp and not tmp.get("readOnly") and "emptyDir" in volumes[tmp["name"]], f"{c['name']}: no /tmp"
        tmp_volumes.append(tmp["name"])
        if c["name"] == FUSE_CONTAINER:
            # required for Bidirectional propagation; the API rejects allowPrivilegeEscalation: false beside it
            assert sc["privileged"] is True and "allowPrivilegeEscalation" not in sc
            continue
        assert sc.get("privileged") is not True, f"{c['name']} is not the FUSE server"
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
    assert len(set(tmp_volumes)) == len(tmp_volumes), "each container its own /tmp"


def test_k8s_s3_separate_credentials():
    """The prepare Job writes the store; the mounts get other credentials and another ServiceAccount, and
    nothing in their pods can reach the writing key."""
    _, prepare = _pod_spec(_load_yaml(K8S_DIR / "s3-prepare-job.yaml"))
    _, train = _pod_spec(_load_yaml(K8S_DIR / "s3-train-job.yaml"))
    accounts = {d["metadata"]["name"]: d for d in _load_yaml_all(K8S_DIR / "s3-serviceaccounts.yaml")}
    for name, account in accounts.items():
        assert account["kind"] == "ServiceAccount" and account["automountServiceAccountToken"] is False, name
    assert {prepare["serviceAccountName"], train["serviceAccountName"]} <= set(accounts)
    assert prepare["serviceAccountName"] != train["serviceAccountName"]

    (writer,) = [_secrets_of(c) for c in prepare["containers"] if c["name"] == "prepare"]
    train_containers = {c["name"]: c for c in train.get("initContainers", []) + train["containers"]}
    reader = _secrets_of(train_containers[FUSE_CONTAINER])
    assert len(writer) == 1 and len(reader) == 1 and writer != reader, (writer, reader)
    assert _secrets_of(train_containers["trainer"]) == set(), "the trainer needs no object-store key"
    for c in train_containers.values():
        assert not _secrets_of(c) & writer, f"{c['name']} gets the writing key"
    assert not any(v.get("secret", {}).get("secretName") in writer for v in train["volumes"])
    assert not any(v.get("projected") for v in train["volumes"]), "no projected token or Secret"
    # the instructions create both, and the README says what each may do
    readme = (MOUNT_DIR / "README.md").read_text()
    config = (K8S_DIR / "s3-config.yaml").read_text()
    for name in writer | reader:
        assert f"kubectl create secret generic {name}" in config and f"kubectl create secret generic {name}" in readme
        assert readme.count(name) >= 2, f"README: what may {name} do?"


def _rule_opens(rule: dict, port: int, protocol: str = "TCP") -> bool:
    """Whether a NetworkPolicy ingress rule lets ``protocol`` traffic to ``port`` through (from its peers)."""
    if not rule.get("ports"):
        return True
    for p in rule["ports"]:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        if isinstance(p["port"], str):  # a named port
            if p["port"] == "metrics" and port == METRICS_PORT:
                return True
        elif p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def test_k8s_networkpolicy_guards_metrics():
    """The sidecars serve metrics on 0.0.0.0: only the labelled scraper may reach that port, every pod serving
    it is selected, and the trainer's own ports (distributed training) stay open."""
    policies = [(p.name, d) for p in k8s_manifests() for d in _load_yaml_all(p) if d["kind"] == "NetworkPolicy"]
    assert len(policies) == 1, policies
    name, policy = policies[0]
    assert name in _kustomization()["resources"]
    spec = policy["spec"]
    assert "Ingress" in spec["policyTypes"]
    assert set(spec["podSelector"]) == {"matchLabels"}
    selector = spec["podSelector"]["matchLabels"]
    assert selector

    serving = 0
    for manifest, doc in _pod_documents():
        meta, pod = _pod_spec(doc)
        containers = pod.get("initContainers", []) + pod["containers"]
        if any(port["containerPort"] == METRICS_PORT for c in containers for port in c.get("ports", [])):
            serving += 1
            assert selector.items() <= meta["labels"].items(), f"{manifest}: its pods are not selected"
            (sidecar,) = [c for c in containers if c["name"] == FUSE_CONTAINER]
            assert "0.0.0.0" in " ".join(sidecar.get("command", []) + sidecar.get("args", []))
    assert serving == len(K8S_WORKLOADS) + 1, "every workload and s3-train-job.yaml serve metrics"

    metrics_rules = [r for r in spec["ingress"] if _rule_opens(r, METRICS_PORT)]
    assert metrics_rules
    for rule in metrics_rules:
        assert rule.get("from"), "a rule without `from` opens the metrics port to everybody"
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector", "podSelector"}, f"the scraper's namespace AND pod: {peer}"
            assert peer["namespaceSelector"].get("matchLabels") and peer["podSelector"].get("matchLabels"), peer
    everybody = [r for r in spec["ingress"] if not r.get("from")]
    for port in (1, 22, 9179, 9181, 29500, 65535):
        assert any(_rule_opens(r, port) for r in everybody), f"TCP {port} closed: the trainer shares these pods"
    assert any(_rule_opens(r, 29500, "UDP") for r in everybody)


def test_kustomize_build(tmp_path: Path):
    """Optional: render with a real kustomize (standalone, or kubectl's built-in) when one is installed."""
    if shutil.which("kustomize"):
        cmd = [shutil.which("kustomize"), "build", str(K8S_DIR)]
    elif shutil.which("kubectl"):
        cmd = [shutil.which("kubectl"), "kustomize", str(K8S_DIR)]
    else:
        skip_or_fail("neither kustomize nor kubectl installed (the raw manifests are validated above)")
    proc = run(cmd, check=True)
    out = tmp_path / "rendered.yaml"
    out.write_text(proc.stdout)
    docs = _load_yaml_all(out)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Job", "NetworkPolicy"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert cm["data"] == _knobs()
    _, spec = _pod_spec(job)
    for c in spec["initContainers"] + spec["containers"]:
        for ref in c.get("envFrom", []):
            assert ref["configMapRef"]["name"] == cm["metadata"]["name"], "generated ConfigMap name not rewired"
    kv = _kubernetes_validate()
    for d in docs:
        for version in _k8s_versions():
            kv.validate(d, version, strict=True)


# ------------------------------------------------------------------------------------------------------
# fstab helper: option translation with a fake liquidfs
# ------------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_liquidfs(tmp_path: Path):
    """A fake `liquidfs` that records its argv (NUL-separated) and exits with $FAKE_RC."""
    record = tmp_path / "argv"
    fake = tmp_path / "fake-liquidfs"
    fake.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$FAKE_ARGV"\nexit "${FAKE_RC:-0}"\n')
    fake.chmod(0o755)

    def invoke(*args: str, liquidfs: str | None = None, rc: int = 0) -> tuple[subprocess.CompletedProcess, list[str] | None]:
        record.unlink(missing_ok=True)
        env = dict(os.environ, LIQUIDFS=liquidfs or str(fake), FAKE_ARGV=str(record), FAKE_RC=str(rc))
        proc = run([str(HELPER), *args], env=env, timeout=30)
        argv = record.read_bytes().decode().split("\0")[:-1] if record.exists() else None
        return proc, argv

    invoke.fake = fake
    return invoke


def test_helper_is_executable_posix_sh():
    assert os.access(HELPER, os.X_OK), "mount/mount.fuse.liquidfs must be executable (git mode 100755)"
    assert HELPER.read_text().startswith("#!/bin/sh\n")
    assert os.access(INSTALL_HOST, os.X_OK), "mount/install-host.sh must be executable"


@pytest.mark.parametrize(("opts", "expected"), [
    (["-o", ("store=/nvme/liquid,cache_size=30%,allow_other,ro,nofail,_netdev,x-systemd.automount,"
             "x-systemd.requires=network-online.target")],
     ["--store", "/nvme/liquid", "--cache-size", "30%", "--allow-other"]),
    (["-o", ("defaults,rw,auto,noauto,user,users,nouser,owner,group,user=alice,dev,nodev,suid,nosuid,exec,noexec,"
             "comment=x-gvfs-show,x-gvfs-name=data")],
     []),
    (["-o", "cache-size=24G,metrics_port=9180,log_level=debug,log_file=/var/log/liquidfs.log"],
     ["--cache-size", "24G", "--metrics-port", "9180", "--log-level", "debug", "--log-file", "/var/log/liquidfs.log"]),
    (["-o", "store=/a,fsname=imagenet,noatime", "-o", "allow_other,default_permissions"],  # -o given twice
     ["--store", "/a", "--allow-other", "-o", "fsname=imagenet,noatime,default_permissions"]),
    (["-o", "io_timeout=30,threads=8,warmup"], ["--io-timeout", "30", "--threads", "8", "--warmup"]),
    (["-ostore=/with space/x,,ro"], ["--store", "/with space/x"]),                       # attached -oOPTS
    (["-s", "-n", "-t", "fuse.liquidfs", "-o", "allow_other"], ["--allow-other"]),        # flags mount(8) passes
    (["-sn", "-tfuse.liquidfs"], []),
    ([], []),
])
def test_helper_translates_options(fake_liquidfs, opts: list[str], expected: list[str]):
    proc, argv = fake_liquidfs("/data/src", "/mnt/dst", *opts)
    assert proc.returncode == 0, proc.stderr
    assert argv == ["mount", "/data/src", "/mnt/dst", *expected]


def test_helper_source_forms(fake_liquidfs):
    proc, argv = fake_liquidfs("liquidfs#/data/it's here", "/mnt/x", "-o", "ro")  # old `-t fuse` spec form
    assert proc.returncode == 0, proc.stderr
    assert argv == ["mount", "/data/it's here", "/mnt/x"]
    proc, argv = fake_liquidfs("-o", "allow_other", "--", "/src", "/mnt/x")         # options first, then --
    assert proc.returncode == 0, proc.stderr
    assert argv == ["mount", "/src", "/mnt/x", "--allow-other"]


def test_helper_multiword_command_and_exit_status(fake_liquidfs):
    proc, argv = fake_liquidfs("/src", "/mnt/x", "-o", "allow_other", liquidfs=f"{fake_liquidfs.fake} --flag")
    assert proc.returncode == 0, proc.stderr
    assert argv == ["--flag", "mount", "/src", "/mnt/x", "--allow-other"]
    proc, _ = fake_liquidfs("/src", "/mnt/x", rc=32)
    assert proc.returncode == 32, "liquidfs's exit status must reach mount(8)"


def test_helper_fake_and_verbose(fake_liquidfs):
    proc, argv = fake_liquidfs("/s p", "/mnt/x", "-f", "-v", "-o", "store=/st,allow_other,nofail")
    assert proc.returncode == 0, proc.stderr
    assert argv is None, "-f must not run liquidfs"
    assert proc.stderr.strip() == f"{fake_liquidfs.fake} mount '/s p' /mnt/x --store /st --allow-other"
    proc, argv = fake_liquidfs("/src", "/mnt/x", "-fv")
    assert argv is None and "mount /src /mnt/x" in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    ([], "usage"),
    (["/src"], "usage"),
    (["/src", "/mnt/x", "/extra"], "unexpected argument"),
    (["/src", "/mnt/x", "-N", "/proc/1/ns/mnt"], "not supported"),
    (["/src", "/mnt/x", "-o", "store="], "needs a value"),
    (["/src", "/mnt/x", "-q"], "unknown flag"),
    (["/src", "/mnt/x", "-o"], "usage"),
])
def test_helper_rejects_bad_invocations(fake_liquidfs, args: list[str], message: str):
    proc, argv = fake_liquidfs(*args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert argv is None


def test_shell_scripts_shellcheck():
    if shutil.which("shellcheck") is None:
        skip_or_fail("shellcheck not installed (apt-get install shellcheck)")
    run(["shellcheck", "-s", "sh", str(HELPER), str(INSTALL_HOST)], check=True)


def test_install_host_destdir(tmp_path: Path):
    dest = tmp_path / "root"
    env = dict(os.environ, DESTDIR=str(dest), LIQUIDFS_BIN="/opt/liquidfs/bin/liquidfs")
    run(["sh", str(INSTALL_HOST)], env=env, check=True)
    helper = dest / "sbin" / "mount.fuse.liquidfs"
    unit = dest / "etc" / "systemd" / "system" / "liquidfs@.service"
    example = dest / "etc" / "liquidfs" / "example.env"
    assert helper.stat().st_mode & 0o777 == 0o755
    assert unit.stat().st_mode & 0o777 == 0o644
    assert "ExecStart=/opt/liquidfs/bin/liquidfs mount --foreground " in unit.read_text()
    # the installed helper runs the baked-in liquidfs
    proc = run([str(helper), "/src", "/mnt/x", "-fv", "-o", "allow_other"], env={"PATH": os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "/opt/liquidfs/bin/liquidfs mount /src /mnt/x --allow-other"
    # a second run never overwrites the admin's config
    example.write_text("LIQUIDFS_SOURCE=/mine\n")
    run(["sh", str(INSTALL_HOST)], env=env, check=True)
    assert example.read_text() == "LIQUIDFS_SOURCE=/mine\n"
    # systemd and mount(8) do not search the user's PATH
    proc = run(["sh", str(INSTALL_HOST)], env=dict(env, LIQUIDFS_BIN="liquidfs"))
    assert proc.returncode != 0 and "absolute" in proc.stderr


# ------------------------------------------------------------------------------------------------------
# systemd unit
# ------------------------------------------------------------------------------------------------------

def _unit_directives(text: str) -> dict[str, list[str]]:
    directives: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        directives.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return directives


#: Hardening in the unit: process flags and seccomp filters, none of which sets up a mount namespace.
UNIT_HARDENING = {
    "UMask": "0077",
    "NoNewPrivileges": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "SystemCallArchitectures": "native",
    "MemoryDenyWriteExecute": "yes",
}
#: Settings that run the service in a mount namespace of its own (systemd.exec(5): "these settings will
#: disconnect propagation of mounts from the unit's processes to the host"), where the FUSE mount would be
#: invisible to everybody else.
UNIT_MOUNT_NAMESPACE = (
    "PrivateTmp", "PrivateDevices", "PrivateMounts", "ProtectSystem", "ProtectHome", "ProtectKernelTunables",
    "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset",
    "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths", "TemporaryFileSystem",
    "BindPaths", "BindReadOnlyPaths", "RootDirectory", "RootImage", "MountAPIVFS", "MountFlags", "LogNamespace",
    "DynamicUser",
)
#: Settings that forbid mounting FUSE itself: no /dev/fuse (a DeviceAllow=, also implied by ProtectClock=, closes
#: the device policy), no CAP_SYS_ADMIN (a user namespace).
UNIT_NO_FUSE = ("DeviceAllow", "DevicePolicy", "ProtectClock", "PrivateUsers")


def test_systemd_unit():
    d = _unit_directives(UNIT.read_text())
    assert d["Service.Type"] == ["simple"], "liquidfs does not sd_notify: Type=notify would hang"
    assert d["Service.EnvironmentFile"] == ["/etc/liquidfs/%i.env"]
    assert d["Service.KillSignal"] == ["SIGTERM"]
    (exec_start,) = d["Service.ExecStart"]
    assert re.match(r"/\S+/liquidfs mount --foreground \$\{LIQUIDFS_SOURCE\} \$\{LIQUIDFS_MOUNTPOINT\}", exec_start)
    for sandboxing in UNIT_MOUNT_NAMESPACE:
        assert f"Service.{sandboxing}" not in d, f"{sandboxing}= would hide the FUSE mount in a private namespace"
    for setting in UNIT_NO_FUSE:
        assert f"Service.{setting}" not in d, f"{setting}= would keep the service from mounting FUSE"
    for setting, value in UNIT_HARDENING.items():
        assert d.get(f"Service.{setting}") == [value], f"{setting}={value} missing"
    assert "Service.User" not in d, "mounting for the whole machine needs root"
    for caps in d.get("Service.CapabilityBoundingSet", []):
        assert "CAP_SYS_ADMIN" in caps.split() and not caps.startswith("~"), "mounting needs CAP_SYS_ADMIN"
    assert d["Install.WantedBy"] == ["multi-user.target"]
    env = dict(line.split("=", 1) for line in EXAMPLE_ENV.read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    assert {"LIQUIDFS_SOURCE", "LIQUIDFS_MOUNTPOINT", "LIQUIDFS_ARGS"} <= set(env)


def test_systemd_analyze_verify(tmp_path: Path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        skip_or_fail("systemd-analyze not installed (apt-get install systemd)")
    unit = tmp_path / "liquidfs@verify.service"
    # verify insists that the ExecStart binary exists; the rest of the line is checked as written
    unit.write_text(UNIT.read_text().replace("ExecStart=/usr/local/bin/liquidfs ", f"ExecStart={shutil.which('true')} "))
    proc = run([exe, "verify", str(unit)], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "liquidfs@verify.service" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------------------------
# Dockerfile (static)
# ------------------------------------------------------------------------------------------------------

def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_structure():
    import json

    ins = _dockerfile_instructions()
    assert ins[0] == ("ARG", "BASE=python:3.11-slim-bookworm")
    froms = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    assert len(froms) == 2, "multi-stage: builder + final"
    assert ins[froms[0]][1] == "${BASE} AS builder" and ins[froms[1]][1] == "${BASE}"
    builder, final = ins[froms[0]:froms[1]], ins[froms[1]:]
    builder_runs = " ".join(rest for w, rest in builder if w == "RUN")
    final_runs = " ".join(rest for w, rest in final if w == "RUN")
    for pkg in ("libfuse3-dev", "pkg-config", "gcc"):
        assert pkg in builder_runs
        assert pkg not in final_runs, f"{pkg} must not be in the final image"
    assert re.search(r"\bfuse3\b", final_runs) and re.search(r"\btini\b", final_runs)
    assert any(w == "COPY" and rest.startswith("--from=builder") for w, rest in final)
    final_dict = {w: rest for w, rest in final}
    assert final_dict["STOPSIGNAL"] == "SIGTERM"
    entry = json.loads(final_dict["ENTRYPOINT"])  # exec form
    assert entry[0].endswith("tini") and entry[entry.index("--") + 1:] == ["liquidfs", "mount", "--foreground"]
    assert isinstance(json.loads(final_dict["CMD"]), list)
    assert final_dict.get("USER", "root") == "root"
    ignore = DOCKERIGNORE.read_text().split()
    assert "**" in ignore and "!liquidfs/" in ignore and "!pyproject.toml" in ignore


# ------------------------------------------------------------------------------------------------------
# Real FUSE: fstab helper through mount(8)
# ------------------------------------------------------------------------------------------------------

def _require_fuse_root() -> None:
    if os.geteuid() != 0:
        skip_or_fail("needs root (mount(8) helpers run from /sbin)")
    if not os.path.exists("/dev/fuse"):
        skip_or_fail("/dev/fuse is missing")
    for tool in ("mount", "umount", "fusermount3"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} not installed (apt-get install fuse3 util-linux)")


@pytest.fixture
def sbin_helper():
    """mount/mount.fuse.liquidfs as /sbin/mount.fuse.liquidfs for one test; restores what was there."""
    _require_fuse_root()
    target = Path("/sbin/mount.fuse.liquidfs")
    backup = target.with_name(f".mount.fuse.liquidfs.pytest-{uuid.uuid4().hex[:8]}")
    had = target.exists() or target.is_symlink()
    if had:
        os.rename(target, backup)
    try:
        shutil.copyfile(HELPER, target)
        target.chmod(0o755)
        yield target
    finally:
        target.unlink(missing_ok=True)
        if had:
            os.rename(backup, target)


@pytest.mark.fuse
def test_fstab_mount_real(sbin_helper: Path, tmp_path: Path):
    src, mnt, store = tmp_path / "src", tmp_path / "mnt", tmp_path / "store"
    for d in (src, mnt, store):
        d.mkdir()
    files = make_source_tree(src)
    env = dict(os.environ, LIQUIDFS=f"{sys.executable} -m liquidfs")  # this interpreter's liquidfs
    try:
        proc = run(["mount", "-t", "fuse.liquidfs", str(src), str(mnt), "-o",
                    f"store={store},allow_other,ro,nofail,_netdev,x-systemd.automount"], env=env, timeout=120)
        assert proc.returncode == 0, f"mount failed:\n{proc.stdout}{proc.stderr}"
        # liquidfs mount (no --foreground) returns only once the mount answers: no waiting here
        assert ("fuse.liquidfs", ) == tuple(t for t, _ in mounts_at(mnt))[-1:], mounts_at(mnt)
        assert_same_dataset(mnt, files)
        proc = run(["umount", str(mnt)], timeout=60)
        assert proc.returncode == 0, f"umount failed:\n{proc.stdout}{proc.stderr}"
        assert not is_fuse_mounted(mnt)
        assert not os.path.ismount(mnt)
    finally:
        force_unmount(mnt)


# ------------------------------------------------------------------------------------------------------
# Container image: debootstrap base -> podman build -> podman run --privileged -> SIGTERM
# ------------------------------------------------------------------------------------------------------

BASE_IMAGE = "localhost/liquidfs-base"
TEST_IMAGE = "localhost/liquidfs:test"
CONTAINER_TOOLS = {"podman": "podman", "debootstrap": "debootstrap"}


def _report(step: str, seconds: float, capsys) -> None:
    with capsys.disabled():
        print(f"\n[test_deploy] {step}: {seconds:.1f} s", flush=True)


def _debian_mirror() -> str:
    """The Debian mirror apt is configured with (bookworm main), for debootstrap."""
    sources = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            sources.append(path.read_text())
    for text in sources:
        for stanza in re.split(r"\n\s*\n", text):           # deb822 .sources
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", stanza, re.MULTILINE))
            if "bookworm" in fields.get("Suites", "").split() and "deb" in fields.get("Types", "").split():
                for uri in fields.get("URIs", "").split():
                    if "security" not in uri:
                        return uri
        for m in re.finditer(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+bookworm\s", text, re.MULTILINE):   # one-line style
            if "security" not in m.group(1):
                return m.group(1)
    return "http://deb.debian.org/debian"


def _ensure_container_tools() -> None:
    missing = [pkg for tool, pkg in CONTAINER_TOOLS.items() if shutil.which(tool) is None]
    if missing:
        if not (IN_CI or os.environ.get("LIQUIDFS_TEST_CONTAINER") == "1"):
            pytest.skip(f"step 'tools': {', '.join(missing)} not installed; set LIQUIDFS_TEST_CONTAINER=1 "
                        "(or CI) to let this test apt-get install them")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update"], env=env, timeout=600, check=True)
        # with recommends (netavark, buildah, ...), as verified; runc because crun refuses hybrid cgroups
        run(["apt-get", "install", "-y", "podman", "debootstrap", "runc"], env=env, timeout=900, check=True)


def _ensure_base_image(tmp_path: Path, capsys) -> None:
    if run(["podman", "image", "exists", BASE_IMAGE]).returncode == 0:
        return
    root = tmp_path / "rootfs"
    t0 = time.monotonic()
    proc = run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                "bookworm", str(root), _debian_mirror()], timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"step 'debootstrap' failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    _report("debootstrap", time.monotonic() - t0, capsys)
    # Trust the same extra CAs as this host (e.g. an egress proxy's) so pip in the build reaches PyPI.
    extra = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    if extra:
        for crt in extra:
            shutil.copy(crt, root / "usr/local/share/ca-certificates" / crt.name)
        run(["chroot", str(root), "update-ca-certificates"], check=True)
    run(["chroot", str(root), "apt-get", "clean"], check=True)
    t0 = time.monotonic()
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    try:
        imp = subprocess.run(["podman", "import", "-", BASE_IMAGE], stdin=tar.stdout, timeout=600,
                             capture_output=True, text=True, check=False)
    finally:
        tar.stdout.close()
        tar.wait()
    if imp.returncode != 0 or tar.returncode != 0:
        pytest.fail(f"step 'podman import' failed: {imp.stderr}")
    _report("podman import", time.monotonic() - t0, capsys)


def _podman_run_options(image: str) -> list[str]:
    """podman run options that work on this host, found by trying; skips with every error if none does.

    Known host quirks: crun refuses hybrid cgroup v1/v2 hosts ("cgroups in hybrid mode not supported"),
    where runc works; without CAP_SYS_RESOURCE, podman's default rlimits (nofile/nproc above the
    current hard limits) cannot be applied, so pass the current ones explicitly.
    """
    import resource

    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = 32768 if nproc in (resource.RLIM_INFINITY, -1) else min(nproc, 32768)
    ulimits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]
    runtimes: list[list[str]] = [[]]
    if shutil.which("runc"):
        runtimes.append(["--runtime", "runc"])
    errors = []
    for rt in runtimes:
        for ul in ([], ulimits):
            opts = rt + ul
            proc = run(["podman", "run", "--rm", "--network", "none", *opts, "--entrypoint", "liquidfs",
                        image, "--help"], timeout=120)
            if proc.returncode == 0:
                assert "mount" in proc.stdout
                return opts
            errors.append(f"podman run {' '.join(opts) or '(defaults)'}: {proc.stderr.strip()[-300:]}")
    skip_or_fail("step 'podman run': this host cannot run containers:\n" + "\n".join(errors))


@contextlib.contextmanager
def _shared_mountpoint(path: Path):
    """``path`` as a shared mount (needed for -v path:...:rshared); undone afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        run(["mount", "--make-shared", str(path)], check=True)
        yield path
    finally:
        force_unmount(path)
        run(["umount", "-l", str(path)])


@pytest.mark.slow
def test_container_image(tmp_path: Path, capsys):
    if os.geteuid() != 0:
        skip_or_fail("step 'preconditions': needs root (debootstrap, podman with --privileged)")
    if not os.path.exists("/dev/fuse"):
        skip_or_fail("step 'preconditions': /dev/fuse is missing on this host")
    _ensure_container_tools()
    _ensure_base_image(tmp_path, capsys)

    t0 = time.monotonic()
    proc = run(["podman", "build", "--isolation=chroot", "--build-arg", f"BASE={BASE_IMAGE}",
                "-f", str(DOCKERFILE), "--ignorefile", str(DOCKERIGNORE), "-t", TEST_IMAGE, str(REPO)],
               timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"step 'podman build' failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    _report("podman build", time.monotonic() - t0, capsys)

    # the final image carries no build tools
    opts = _podman_run_options(TEST_IMAGE)
    proc = run(["podman", "run", "--rm", "--network", "none", *opts, "--entrypoint", "sh", TEST_IMAGE, "-c",
                "! command -v gcc cc pkg-config && test -x /usr/bin/fusermount3 && test -x /usr/bin/tini"],
               timeout=120)
    assert proc.returncode == 0 and proc.stdout == "", f"compilers in the final image or fuse3/tini missing: {proc}"

    src, store, prepared = tmp_path / "src", tmp_path / "store", tmp_path / "prepared"
    for d in (src, store, prepared):
        d.mkdir()
    files = make_source_tree(src)
    # As the manifests run the image (readOnlyRootFilesystem): nothing writable but the volumes and /tmp.
    read_only = ["--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp"]

    # prepare as their init containers run it, also root without capabilities or privilege escalation
    proc = run(["podman", "run", "--rm", "--network", "none", *opts, *read_only, "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "-v", f"{src}:/data:ro", "-v", f"{prepared}:/store",
                "--entrypoint", "liquidfs", TEST_IMAGE, "prepare", "/data", "--store", "/store", "--ratio", "1",
                "--no-progress"], timeout=300)
    assert proc.returncode == 0, f"prepare in a read-only image failed:\n{proc.stdout}{proc.stderr}"
    assert (prepared / "catalog.sqlite").is_file(), proc.stdout
    assert any(f.is_file() for f in (prepared / "objects").rglob("*")), f"nothing expanded:\n{proc.stdout}"

    name = f"liquidfs-test-{uuid.uuid4().hex[:8]}"
    with _shared_mountpoint(tmp_path / "shared") as mnt:
        try:
            t0 = time.monotonic()
            # the unprepared store: every file is served as its source bytes
            proc = run(["podman", "run", "-d", "--name", name, "--privileged", "--device", "/dev/fuse",
                        "--network", "none", *opts, *read_only,
                        "-v", f"{src}:/data:ro", "-v", f"{store}:/store", "-v", f"{mnt}:{MOUNTPOINT_IN_POD}:rshared",
                        TEST_IMAGE, "/data", MOUNTPOINT_IN_POD, "--store", "/store"], timeout=120)
            assert proc.returncode == 0, f"podman run failed: {proc.stderr}"

            def running() -> bool:
                state = run(["podman", "inspect", "--format", "{{.State.Running}}", name]).stdout.strip()
                return state == "true"

            appeared = wait_until(lambda: is_fuse_mounted(mnt) or not running(), timeout=120)
            def logs() -> str:
                proc = run(["podman", "logs", name])
                return proc.stdout + proc.stderr

            assert appeared and is_fuse_mounted(mnt), f"the mount did not propagate to the host:\n{logs()}"
            _report("container start to mount visible on the host", time.monotonic() - t0, capsys)

            assert_same_dataset(mnt, files)  # read on the host, through the propagated mount
            proc = run(["podman", "exec", name, "sha256sum", f"{MOUNTPOINT_IN_POD}/train/blob.bin"], check=True)
            import hashlib
            assert proc.stdout.split()[0] == hashlib.sha256(files["train/blob.bin"]).hexdigest()
            proc = run(["podman", "exec", name, "liquidfs", "stats", "--probe", MOUNTPOINT_IN_POD])
            assert proc.returncode == 0, f"liquidfs stats --probe failed: {proc.stdout}{proc.stderr}"

            t0 = time.monotonic()
            run(["podman", "stop", "-t", "30", name], timeout=90, check=True)   # SIGTERM (STOPSIGNAL)
            _report("podman stop", time.monotonic() - t0, capsys)
            code = run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name]).stdout.strip()
            assert code == "0", f"exit code {code} after SIGTERM:\n{logs()}"
            assert wait_until(lambda: not is_fuse_mounted(mnt), timeout=10), "mount left behind after stop"
        finally:
            run(["podman", "rm", "-f", name], timeout=120)
