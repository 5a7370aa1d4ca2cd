"""Deployment assets under mount/: the Kubernetes manifests (mount/kubernetes), validated strictly against the
API's schemas, and what the schemas cannot check (the FUSE sidecar's wiring, hardening, credentials, the
NetworkPolicies, the kustomization's knobs, the memcacheds of a cache across nodes). Static: they run everywhere.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from deployhelpers import MOUNT_DIR, MOUNTPOINT_IN_POD, run, skip_or_fail

K8S_DIR = MOUNT_DIR / "kubernetes"

#: YAML files under mount/kubernetes that are not Kubernetes API objects (kustomize's own config).
K8S_NOT_API_OBJECTS = {"kustomization.yaml"}
K8S_WORKLOADS = {"pod-native-sidecar.yaml", "job-native-sidecar.yaml", "pod-classic-sidecar.yaml",
                 "job-cluster-sidecar.yaml"}
#: What kustomization.yaml lists beside the one workload it deploys.
K8S_WITH_EVERY_WORKLOAD = {"networkpolicy.yaml"}
#: The workload of a cache across nodes (``mount --cluster``), and what is deployed with it: a memcached on every
#: node, the headless Service its --cluster names, who may reach them.
K8S_CLUSTER_WORKLOAD = "job-cluster-sidecar.yaml"
K8S_CLUSTER_ASSETS = {"memcached-daemonset.yaml", "memcached-service.yaml", "memcached-networkpolicy.yaml"}
MEMCACHED_PORT = 11211
#: The container that mounts FUSE: the only one that may be privileged.
FUSE_CONTAINER = "liquidfs"
METRICS_PORT = 9180


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
    """(pod metadata, pod spec) of a Pod or of a Job's or DaemonSet's template."""
    if doc["kind"] == "Pod":
        return doc["metadata"], doc["spec"]
    assert doc["kind"] in ("Job", "DaemonSet"), doc["kind"]
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
    policies = [(p.name, d) for p in k8s_manifests() for d in _load_yaml_all(p) if d["kind"] == "NetworkPolicy"
                and d["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == "liquidfs"]
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


# -- a cache across nodes: memcached beside the mounts ------------------------------------------------------


def _memcached() -> tuple[dict, dict, dict]:
    """(DaemonSet, its pod spec, its memcached container)."""
    daemonset = _load_yaml(K8S_DIR / "memcached-daemonset.yaml")
    assert daemonset["kind"] == "DaemonSet"
    _, spec = _pod_spec(daemonset)
    (container,) = spec["containers"]
    return daemonset, spec, container


def _memcached_option(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"memcached {flag} given {args.count(flag)} times: {args}"
    return args[args.index(flag) + 1]


def test_memcached_runs_on_every_node_bounded_in_memory_and_without_privileges():
    """memcached's -m (MiB of items) fits in its memory limit with headroom (the hash table and connection
    buffers come on top: a container over its limit loses the node's whole share), it listens on TCP only, in the
    pod network, and runs as nobody in particular: non-root, read-only image, no capability."""
    daemonset, spec, c = _memcached()
    assert c["image"].startswith("memcached:1.6")
    args = c.get("command", []) + c.get("args", [])
    items = int(_memcached_option(args, "-m")) * 2**20
    limit = _quantity_bytes(c["resources"]["limits"]["memory"])
    assert limit >= items * 1.05, f"memory limit {limit} leaves no room beside -m {items}"
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    assert _quantity_bytes(_memcached_option(args, "-I").replace("m", "Mi")) >= 8 * 2**20, "a raw image is MBs"
    assert _memcached_option(args, "-U") == "0", "UDP is an amplifier and unused"
    assert _memcached_option(args, "-p") == str(MEMCACHED_PORT)
    assert _memcached_option(args, "-l") == "0.0.0.0"  # the pod's own address: the NetworkPolicy guards it
    assert spec.get("hostNetwork", False) is False, "on the node's network no NetworkPolicy guards it"
    ports = {p["name"]: p for p in c["ports"]}
    assert ports["memcached"]["containerPort"] == MEMCACHED_PORT and "hostPort" not in ports["memcached"]
    assert c["readinessProbe"]["tcpSocket"]["port"] in ("memcached", MEMCACHED_PORT)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and isinstance(sc["runAsUser"], int) and sc["runAsUser"] > 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc.get("privileged") is not True
    assert spec["automountServiceAccountToken"] is False
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert labels.get("app.kubernetes.io/name") != "liquidfs", "networkpolicy.yaml opens those pods' other ports"
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_memcached_service_is_headless_over_the_daemonset():
    """A headless Service: its name resolves to every ready memcached (liquidfs spreads the objects over them);
    a ClusterIP would hide them behind one address and send each connection to any of them."""
    service = _load_yaml(K8S_DIR / "memcached-service.yaml")
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False, "a memcached not ready is a dead one"
    daemonset, _, c = _memcached()
    assert service["spec"]["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == MEMCACHED_PORT and port.get("protocol", "TCP") == "TCP"
    assert port["targetPort"] in {p["name"] for p in c["ports"]} | {MEMCACHED_PORT}


def test_the_cluster_sidecar_names_the_memcached_service():
    """job-cluster-sidecar.yaml's sidecar mounts with --cluster naming the headless Service by its DNS name (a
    URL liquidfs accepts) and a --cluster-size the memcacheds of its nodes can hold."""
    from liquidfs.held.cluster_peers import parse_cluster

    _, spec = _pod_spec(_load_yaml(K8S_DIR / K8S_CLUSTER_WORKLOAD))
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == FUSE_CONTAINER]
    args = sidecar["args"]
    assert args[args.index("--cluster") + 1] == "$(LIQUIDFS_CLUSTER)"
    assert args[args.index("--cluster-size") + 1] == "$(LIQUIDFS_CLUSTER_SIZE)"
    knobs = _knobs()
    service = _load_yaml(K8S_DIR / "memcached-service.yaml")
    ((host, port),) = parse_cluster(knobs["LIQUIDFS_CLUSTER"])
    name, namespace, *rest = host.split(".")
    assert name == service["metadata"]["name"] and rest == ["svc", "cluster", "local"] and namespace, host
    assert port == service["spec"]["ports"][0]["port"]
    # --cluster-size is what the memcacheds hold together: no more than -m on each of the job's nodes, less 5 %
    _, _, memcached = _memcached()
    per_node = int(_memcached_option(memcached["args"], "-m")) * 2**20
    nodes = _load_yaml(K8S_DIR / K8S_CLUSTER_WORKLOAD)["spec"]["parallelism"]
    size = _quantity_bytes(knobs["LIQUIDFS_CLUSTER_SIZE"].replace("G", "Gi"))  # read 60G as GiB: the safe side
    assert size <= 0.95 * nodes * per_node, (size, nodes, per_node)


def test_the_cluster_sidecar_gets_the_cluster_key_from_a_secret_of_its_own():
    """--cluster-key-file names a file of a Secret volume mounted read-only into the sidecar alone, mode 0400
    (root's: no fsGroup), required; the manifest and the kustomization say how to make the key and the Secret."""
    job = _load_yaml(K8S_DIR / K8S_CLUSTER_WORKLOAD)
    _, spec = _pod_spec(job)
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == FUSE_CONTAINER]
    key_file = sidecar["args"][sidecar["args"].index("--cluster-key-file") + 1]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [vm for vm in sidecar["volumeMounts"] if key_file.startswith(vm["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True
    secret = volumes[mount["name"]]["secret"]
    assert secret.get("optional", False) is False, "a pod without the key must not start"
    modes = [secret["defaultMode"], *(item["mode"] for item in secret.get("items", []) if "mode" in item)]
    assert all(mode & 0o077 == 0 for mode in modes) and secret["defaultMode"] == 0o400
    assert "fsGroup" not in spec.get("securityContext", {}), "the key's files would be the group's"
    for c in spec.get("initContainers", []) + spec["containers"]:
        if c is not sidecar:
            assert mount["name"] not in {vm["name"] for vm in c.get("volumeMounts", [])}, f"{c['name']} sees the key"
    name = secret["secretName"]
    for text in ((K8S_DIR / K8S_CLUSTER_WORKLOAD).read_text(), (K8S_DIR / "kustomization.yaml").read_text()):
        assert "head -c 32 /dev/urandom" in text and f"kubectl create secret generic {name}" in text


def test_only_the_cluster_pods_reach_memcached():
    """memcached answers anyone who reaches it: one NetworkPolicy selects its pods and lets only the pods that
    mount with --cluster in, at its port alone; no other policy opens that port on them."""
    daemonset, _, _ = _memcached()
    pods = daemonset["spec"]["template"]["metadata"]["labels"]
    policies = [d for p in k8s_manifests() for d in _load_yaml_all(p) if d["kind"] == "NetworkPolicy"]
    selecting = [d for d in policies if d["spec"]["podSelector"]["matchLabels"].items() <= pods.items()]
    assert [d["metadata"]["name"] for d in selecting] == ["memcached"], "exactly one policy, memcached's"
    (policy,) = selecting
    assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["spec"]["ingress"]
    meta, _ = _pod_spec(_load_yaml(K8S_DIR / K8S_CLUSTER_WORKLOAD))
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "a rule without `from` lets anyone in"
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"pods of this namespace only, no namespace or ipBlock: {peer}"
            assert peer["podSelector"]["matchLabels"].items() <= meta["labels"].items(), "the cluster job's pods"
            assert "app.kubernetes.io/name" not in peer["podSelector"]["matchLabels"], "every liquidfs pod"
        assert rule["ports"] == [{"protocol": "TCP", "port": MEMCACHED_PORT}]
    # The other pods that mount do not carry the label: only the cluster's clients are let in.
    for manifest, doc in _pod_documents():
        if manifest != K8S_CLUSTER_WORKLOAD:
            labels = _pod_spec(doc)[0]["labels"]
            assert not any(peer["podSelector"]["matchLabels"].items() <= labels.items()
                           for rule in policy["spec"]["ingress"] for peer in rule["from"]), manifest


def test_kustomization_says_how_to_deploy_the_cluster():
    """The cluster's files are a choice made in kustomization.yaml, like the workload: its comment names them all
    and its knobs hold what job-cluster-sidecar.yaml reads."""
    text = (K8S_DIR / "kustomization.yaml").read_text()
    for name in K8S_CLUSTER_ASSETS | {K8S_CLUSTER_WORKLOAD}:
        assert name in text, f"kustomization.yaml does not say to deploy {name}"
    assert {"LIQUIDFS_CLUSTER", "LIQUIDFS_CLUSTER_SIZE"} <= set(_knobs())
    assert K8S_CLUSTER_ASSETS <= {p.name for p in k8s_manifests()}


def test_kustomize_build_of_the_cluster(tmp_path: Path):
    """Optional, as test_kustomize_build: the kustomization with the cluster's files selected renders, every
    document validates, and the Job's pods get the generated ConfigMap."""
    tool = shutil.which("kustomize") or shutil.which("kubectl")
    if tool is None:
        skip_or_fail("neither kustomize nor kubectl installed (the raw manifests are validated above)")
    import yaml

    copy = tmp_path / "kubernetes"
    shutil.copytree(K8S_DIR, copy)
    kz = _kustomization()
    kz["resources"] = [K8S_CLUSTER_WORKLOAD, *sorted(K8S_WITH_EVERY_WORKLOAD | K8S_CLUSTER_ASSETS)]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kz))
    cmd = [tool, "build", str(copy)] if tool.endswith("kustomize") else [tool, "kustomize", str(copy)]
    out = tmp_path / "rendered.yaml"
    out.write_text(run(cmd, check=True).stdout)
    docs = _load_yaml_all(out)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "DaemonSet", "Job", "NetworkPolicy", "NetworkPolicy",
                                               "Service"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    _, spec = _pod_spec(job)
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == FUSE_CONTAINER]
    assert [ref["configMapRef"]["name"] for ref in sidecar["envFrom"]] == [cm["metadata"]["name"]]
    kv = _kubernetes_validate()
    for d in docs:
        for version in _k8s_versions():
            kv.validate(d, version, strict=True)
