"""Deployment assets under mount/: the systemd unit (mount/systemd/liquidfs@.service) and its example
environment file: what the service runs, the hardening it has and the sandboxing it must not have (a private
mount namespace would hide the FUSE mount), and ``systemd-analyze verify``. The memcached beside a mount with
--cluster (liquidfs-memcached.service, and liquidfs-cluster.conf ordering the mount after it): bounded in
memory, reachable from loopback only until told otherwise, without privileges.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from deployhelpers import MOUNT_DIR, run, skip_or_fail

UNIT = MOUNT_DIR / "systemd" / "liquidfs@.service"
EXAMPLE_ENV = MOUNT_DIR / "systemd" / "example.env"
MEMCACHED_UNIT = MOUNT_DIR / "systemd" / "liquidfs-memcached.service"
CLUSTER_DROP_IN = MOUNT_DIR / "systemd" / "liquidfs-cluster.conf"


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


def _memcached_option(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"memcached {flag} given {argv.count(flag)} times: {argv}"
    return argv[argv.index(flag) + 1]


def _bytes(size: str) -> int:
    """A systemd size (K, M, G, T: powers of 1024, as systemd.resource-control(5) reads them)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    m = re.fullmatch(r"([0-9]+)([KMGT]?)", size)
    assert m, size
    return int(m.group(1)) * units[m.group(2)]


def test_memcached_unit_is_bounded_in_memory_reachable_from_loopback_only_and_unprivileged():
    d = _unit_directives(MEMCACHED_UNIT.read_text())
    (exec_start,) = d["Service.ExecStart"]
    argv = exec_start.split()
    assert argv[0] == "/usr/bin/memcached" and "-u" not in argv, "as root memcached needs -u; it is not root"
    items = int(_memcached_option(argv, "-m")) * 2**20
    (memory_max,) = d["Service.MemoryMax"]
    assert _bytes(memory_max) >= items * 1.05, "-m bounds the items only: the limit needs headroom beside them"
    assert _memcached_option(argv, "-U") == "0"
    assert _memcached_option(argv, "-I").endswith("m") and int(_memcached_option(argv, "-I")[:-1]) >= 8
    # The address to listen on: loopback unless the node's env file says otherwise.
    assert _memcached_option(argv, "-l") == "${LIQUIDFS_MEMCACHED_LISTEN}"
    assert d["Service.Environment"] == ["LIQUIDFS_MEMCACHED_LISTEN=127.0.0.1"]
    assert d["Service.EnvironmentFile"] == ["-/etc/liquidfs/memcached.env"], "optional, read after the default"
    # Whoever reaches it reads the dataset's bytes: every packet but loopback's dropped until a drop-in allows more.
    assert d["Service.IPAddressDeny"] == ["any"] and d["Service.IPAddressAllow"] == ["localhost"]
    # No privilege at all, and Debian's memcached.service (the same port) is stopped, not raced.
    assert d["Service.DynamicUser"] == ["yes"] and "Service.User" not in d
    assert d["Service.CapabilityBoundingSet"] == [""] and d["Service.NoNewPrivileges"] == ["yes"]
    assert d["Service.ProtectSystem"] == ["strict"] and d["Service.PrivateDevices"] == ["yes"]
    assert d["Service.RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX"]
    assert not any("@resources" in f for f in d["Service.SystemCallFilter"]), "memcached setrlimits to -c"
    assert d["Unit.Conflicts"] == ["memcached.service"]
    assert d["Install.WantedBy"] == ["multi-user.target"]


def test_a_cluster_mount_is_ordered_after_its_memcached_without_depending_on_it():
    """After= its memcached (its first epoch can give it its share), Wants= and not Requires=: a memcached down
    costs hits, never a read, so stopping it must not stop the mount."""
    d = _unit_directives(CLUSTER_DROP_IN.read_text())
    assert d["Unit.After"] == [MEMCACHED_UNIT.name] and d["Unit.Wants"] == [MEMCACHED_UNIT.name]
    for strong in ("Requires", "Requisite", "BindsTo", "PartOf"):
        assert f"Unit.{strong}" not in d, f"{strong}= would stop the mount with its memcached"
    text = EXAMPLE_ENV.read_text()
    assert "--cluster memcached://" in text and "--cluster-size" in text, "example.env shows the flags"


def test_a_cluster_mount_gets_the_cluster_key_as_a_credential():
    """The drop-in hands the key to the mount as a systemd credential (a directory of the service's own) and
    passes it by --cluster-key-file; its command is the unit's but for that flag, so the two cannot drift."""
    d = _unit_directives(CLUSTER_DROP_IN.read_text())
    ((name, _, source),) = [value.partition(":") for value in d["Service.LoadCredential"]]
    assert source.startswith("/etc/liquidfs/") and name
    unit_start = _unit_directives(UNIT.read_text())["Service.ExecStart"]
    assert d["Service.ExecStart"] == ["", unit_start[0] + f" --cluster-key-file ${{CREDENTIALS_DIRECTORY}}/{name}"]
    text = CLUSTER_DROP_IN.read_text()
    assert "head -c 32 /dev/urandom" in text and "chmod 0400" in text, "says how to make the key"


def test_systemd_analyze_verify_memcached_and_a_cluster_mount(tmp_path: Path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        skip_or_fail("systemd-analyze not installed (apt-get install systemd)")
    true = shutil.which("true")
    mount_unit = tmp_path / "liquidfs@verify.service"
    mount_unit.write_text(UNIT.read_text().replace("ExecStart=/usr/local/bin/liquidfs ", f"ExecStart={true} "))
    (tmp_path / "liquidfs@verify.service.d").mkdir()
    (tmp_path / "liquidfs@verify.service.d" / "cluster.conf").write_text(
        CLUSTER_DROP_IN.read_text().replace("ExecStart=/usr/local/bin/liquidfs ", f"ExecStart={true} "))
    memcached = tmp_path / MEMCACHED_UNIT.name
    # verify insists that the ExecStart binary exists (memcached may not be installed where this runs)
    memcached.write_text(MEMCACHED_UNIT.read_text().replace("ExecStart=/usr/bin/memcached ", f"ExecStart={true} "))
    assert memcached.read_text() != MEMCACHED_UNIT.read_text()
    proc = run([exe, "verify", str(mount_unit), str(memcached)], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("cluster.conf", MEMCACHED_UNIT.name, mount_unit.name):  # an unknown key is only a warning
        assert name not in proc.stderr, proc.stderr
