#!/usr/bin/env bash
# The main job on an embedded sample, install included: make a realistic sample, prepare it, mount it, read it
# with an unmodified DALI pipeline and with Pillow, print what happened, unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python scripts/demo.py "$@"
