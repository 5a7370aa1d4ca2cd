#!/usr/bin/env bash
# Where a warm open's microseconds go on a lent GPU host (issue 40), as one prepared run of ~3 minutes, each step
# under a timeout: the kit installed (scripts/gpu/setup.sh), then bench_loops.py --liquidfs at 1 and 16 readers
# with 1 and 8 loops (LOOPS): the bare pyfuse3 mirror and a liquidfs mount of the same 4 KB files side by side in
# each repeat, liquidfs's CPU per open split into its loops' own threads and its other threads, user and system;
# then bench_opens.py --mirror: 3,000 110 KB files read cold and warm by 16 readers directly, through the bare
# mirror (the ceiling of any pyfuse3 daemon on that host) and through the mount (~1 minute more).
# Lines are stamped; JSON and the log go to $OUT (or out/gpu).
#
#   bash scripts/gpu/kit.sh          # here, once
#   bash scripts/gpu/open_cost.sh    # there
set -uo pipefail
source "$(dirname "$0")/common.sh"
kit_setup || exit 1
export PYTHONPATH=$repo/.gpukit/shim
nproc
for readers in ${READERS:-1 16}; do
    echo "== $readers readers" | stamp
    timeout -s ABRT "${COST_SECONDS:-100}" python3 scripts/bench/bench_loops.py --files 4000 --readers "$readers" \
        --loops "${LOOPS:-1,8}" --seconds 2 --repeats 2 --liquidfs --work /tmp/bench-cost \
        --json "$out/open-cost-r$readers.json" 2>&1 | stamp
    # A pass cut short by its timeout leaves its mounts behind (SIGABRT runs no cleanup): never under the next.
    fusermount3 -u -z /tmp/bench-cost/mnt 2>/dev/null
    fusermount3 -u -z /tmp/bench-cost/mnt-liquidfs 2>/dev/null
done
echo "== small files: direct, the bare mirror, the mount" | stamp
timeout -s ABRT "${MIRROR_SECONDS:-150}" python3 scripts/bench/bench_opens.py --shapes small --small 3000 \
    --readers "${MIRROR_READERS:-16}" --repeats 3 --mirror --work /tmp/bench-mirror --json "$out/mirror-small.json" \
    2>&1 | stamp
fusermount3 -u -z /tmp/bench-mirror/mnt 2>/dev/null
fusermount3 -u -z /tmp/bench-mirror/mnt-mirror 2>/dev/null
true
