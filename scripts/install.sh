#!/usr/bin/env bash
# Install everything liquidfs needs on a fresh Debian machine: fuse3 and the build deps of pyfuse3 (apt, only
# if missing), a virtualenv in .venv, and the package with the extras named in $LIQUIDFS_EXTRAS.  Then
# pyfuse3 is rebuilt with FUSE passthrough (scripts/passthrough/build.sh: libfuse 3.17.2 in .venv/libfuse)
# unless LIQUIDFS_PASSTHROUGH=0; if that fails, the stock pyfuse3 stays and liquidfs serves reads itself.
# Without root that build is skipped (one line says so) unless LIQUIDFS_PASSTHROUGH=1: a mount serves through
# passthrough only with CAP_SYS_ADMIN, so a user's mounts take the daemon path whatever pyfuse3 is installed.
# Without root, apt runs through sudo; without sudo either, the install stops naming what to install.
set -euo pipefail
cd "$(dirname "$0")/.."
# Tools that live in sbin (fuse3's and util-linux's helpers, debootstrap) are off an ordinary user's PATH.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
extras="${LIQUIDFS_EXTRAS:-dali,sample}"
PY="${PYTHON:-python3}"
passthrough="${LIQUIDFS_PASSTHROUGH:-}"
if [ -z "$passthrough" ]; then
    if [ "$(id -u)" -eq 0 ]; then
        passthrough=1
    else
        passthrough=0
        echo "liquidfs: FUSE passthrough build skipped: passthrough needs root (CAP_SYS_ADMIN), a non-root mount" \
             "serves reads through the daemon (LIQUIDFS_PASSTHROUGH=1 builds it anyway)" >&2
    fi
fi

# apt_install WHAT PACKAGE...: apt-get install as root, or through sudo; with neither, stop and say what to install.
apt_install() {
    local what=$1 sudo=()
    shift
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null; then
            echo "install failed: $what missing ($*), and apt needs root: run as root or install $*" >&2
            exit 1
        fi
        sudo=(sudo)
    fi
    echo "installing $* with apt ($what)" >&2
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

need=()
command -v fusermount3 >/dev/null || need+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need+=(libfuse3-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v gcc >/dev/null || need+=(gcc)
[ -e "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || need+=(python3-dev)
# Debian's python3 leaves out ensurepip, without which `python3 -m venv` makes a venv with no pip in it.
"$PY" -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if [ "$passthrough" != 0 ]; then
    command -v patch >/dev/null || need+=(patch)
fi
if [ ${#need[@]} -gt 0 ]; then
    apt_install "build dependencies" "${need[@]}"
fi

# A venv an earlier run left without pip (made before python3-venv was there) is made again.
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    echo "liquidfs: .venv has no pip (an interrupted install?): making it again" >&2
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# pip's own failures must stop the install: a half-installed venv (CI once ran with boto3 missing) fails later
# and far from the cause.  One retry covers a registry hiccup; the log says what went wrong.
pip_log=.venv/pip-install.log
pip_install() {
    local try
    for try in 1 2; do
        if .venv/bin/python -m pip install -q --no-cache-dir "$@" > "$pip_log" 2>&1; then
            return 0
        fi
        echo "pip install $* failed (try $try of 2):" >&2
        grep -v "^WARNING: Location" "$pip_log" | tail -n 15 >&2
    done
    echo "install failed: pip could not install $* (full log: $pip_log; free disk: $(df -h --output=avail . | tail -n 1))" >&2
    exit 1
}
pip_install --upgrade pip
pip_install -e ".[${extras}]"
# From outside the checkout, so the source tree next to us cannot stand in for the installed package.
.venv/bin/python -m pip check >&2 || { echo "install failed: broken requirements in .venv" >&2; exit 1; }
(cd / && "$OLDPWD/.venv/bin/python" -c "import liquidfs, liquidfs.cli, pyfuse3, trio, PIL, numpy, tqdm, xxhash, boto3") \
    || { echo "install failed: liquidfs or a dependency does not import" >&2; exit 1; }

if [ "$passthrough" != 0 ]; then
    log=.venv/passthrough-build.log
    if bash scripts/passthrough/build.sh .venv > "$log" 2>&1; then
        tail -n 1 "$log" >&2
    else
        echo "liquidfs: FUSE passthrough unavailable: $(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | sed 's/^passthrough build failed: //')" \
             "(stock pyfuse3 kept, reads go through the daemon; full log: $log)" >&2
        .venv/bin/python -c "import pyfuse3" || { echo "install failed: pyfuse3 broken" >&2; exit 1; }
    fi
fi
