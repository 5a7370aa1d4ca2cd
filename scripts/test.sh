#!/usr/bin/env bash
# The whole test suite, install included (what .ci/run calls). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
LIQUIDFS_EXTRAS="test,torch" bash scripts/install.sh
# Tools the deployment tests drive for real (container build and run, shell lint, unit verification).
tools=()
for t in podman:podman debootstrap:debootstrap runc:runc tini:tini shellcheck:shellcheck \
         systemd-analyze:systemd fincore:util-linux \
         swift-proxy-server:swift-proxy swift-account-server:swift-account \
         swift-container-server:swift-container swift-object-server:swift-object \
         swift-ring-builder:swift s3fs:s3fs rclone:rclone; do
    command -v "${t%%:*}" >/dev/null || tools+=("${t#*:}")
done
if [ ${#tools[@]} -gt 0 ]; then
    echo "installing ${tools[*]} with apt (test tools)" >&2
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${tools[@]}" >/dev/null
fi
set +e
.venv/bin/python -m pytest -rs "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
