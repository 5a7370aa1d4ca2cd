#!/usr/bin/env bash
# Install everything liquidfs needs on a fresh Debian machine: fuse3 and the build deps of pyfuse3 (apt, only
# if missing), a virtualenv in .venv, and the package with the extras named in $LIQUIDFS_EXTRAS.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${LIQUIDFS_EXTRAS:-dali,sample}"

need=()
command -v fusermount3 >/dev/null || need+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need+=(libfuse3-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v gcc >/dev/null || need+=(gcc)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]} with apt" >&2
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[${extras}]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import liquidfs, pyfuse3" || { echo "install failed" >&2; exit 1; }
