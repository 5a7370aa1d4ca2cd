"""Deployment assets under mount/: the systemd unit (mount/systemd/liquidfs@.service) and its example
environment file: what the service runs, the hardening it has and the sandboxing it must not have (a private
mount namespace would hide the FUSE mount), and ``systemd-analyze verify``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from deployhelpers import MOUNT_DIR, run, skip_or_fail

UNIT = MOUNT_DIR / "systemd" / "liquidfs@.service"
EXAMPLE_ENV = MOUNT_DIR / "systemd" / "example.env"


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
