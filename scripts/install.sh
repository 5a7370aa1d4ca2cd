#!/usr/bin/env bash
# Install everything liquidfs needs on a fresh Debian machine: fuse3 and the build deps of pyfuse3 (apt, only
# if missing), a virtualenv in .venv, and the package with the extras named in $LIQUIDFS_EXTRAS.  Then
# pyfuse3 is rebuilt with FUSE passthrough (scripts/passthrough/build.sh: libfuse 3.17.2 in .venv/libfuse)
# unless LIQUIDFS_PASSTHROUGH=0; if that fails, the stock pyfuse3 stays and liquidfs serves reads itself.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${LIQUIDFS_EXTRAS:-dali,sample}"
passthrough="${LIQUIDFS_PASSTHROUGH:-1}"
PY="${PYTHON:-python3}"

need=()
command -v fusermount3 >/dev/null || need+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need+=(libfuse3-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v gcc >/dev/null || need+=(gcc)
[ -e "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || need+=(python3-dev)
if [ "$passthrough" != 0 ]; then
    command -v patch >/dev/null || need+=(patch)
fi
if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]} with apt" >&2
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
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
