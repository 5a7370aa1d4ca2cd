#!/usr/bin/env bash
# The whole test suite, install included (what .ci/run calls). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
LIQUIDFS_EXTRAS="test,torch" bash scripts/install.sh
set +e
.venv/bin/python -m pytest -rs "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
