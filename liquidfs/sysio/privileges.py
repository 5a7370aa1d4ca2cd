"""What this process may do: its effective capabilities, read from ``/proc/PID/status``."""

from __future__ import annotations

CAP_SYS_ADMIN = 21


def has_cap_sys_admin(status: str) -> bool:
    """Whether the effective capabilities in ``status`` (a /proc/PID/status) hold CAP_SYS_ADMIN."""
    eff = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("CapEff:")), 0)
    return bool(eff >> CAP_SYS_ADMIN & 1)
