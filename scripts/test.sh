#!/usr/bin/env bash
# The whole test suite, install included (what .ci/run calls). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Tools that live in sbin (debootstrap, runc, mount helpers) are off an ordinary user's PATH: look there too.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
LIQUIDFS_EXTRAS="test,torch" bash scripts/install.sh
# Tools the deployment tests drive for real (container build and run, shell lint, unit verification).
tools=()
for t in podman:podman debootstrap:debootstrap runc:runc tini:tini shellcheck:shellcheck \
         systemd-analyze:systemd fincore:util-linux \
         swift-proxy-server:swift-proxy swift-account-server:swift-account \
         swift-container-server:swift-container swift-object-server:swift-object \
         swift-ring-builder:swift s3fs:s3fs rclone:rclone prometheus:prometheus memcached:memcached; do
    command -v "${t%%:*}" >/dev/null || tools+=("${t#*:}")
done
if [ ${#tools[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
        # Not fatal: the rest of the suite still runs; each test that drives a missing tool names it.
        echo "test tools missing (${tools[*]}), and apt needs root: run as root or install ${tools[*]}" \
             "(running the tests without them: those that drive them skip or fail naming the tool)" >&2
    else
        SUDO=(); [ "$(id -u)" -eq 0 ] || SUDO=(sudo)
        echo "installing ${tools[*]} with apt (test tools)" >&2
        "${SUDO[@]}" apt-get update -qq
        "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${tools[@]}" >/dev/null
    fi
fi
set +e
# The slowest tests named at the end: the suite must stay well under 20 minutes on CI's 2 cores.
.venv/bin/python -m pytest -rs --durations=15 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
