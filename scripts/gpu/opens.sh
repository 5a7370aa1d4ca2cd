#!/usr/bin/env bash
# Issue 40's opens on a lent GPU host (16 cores, no network), as one prepared run: the kit installed
# (scripts/gpu/setup.sh), a Cityscapes-sized sample made on all cores, then bench_opens over the same raw objects
# with the opens in the reads' four threads (--open-threads 4: what every mount did before issue 40) and in their
# own pool (the default), cold and warm, 12 and 16 readers (READERS). JSON and the log go to $OUT (or out/gpu).
#
#   bash scripts/gpu/kit.sh            # here, once
#   bash scripts/gpu/opens.sh [IMAGES] # there (default 192 images)
set -euo pipefail
source "$(dirname "$0")/common.sh"
images=${1:-192}
kit_setup
export PYTHONPATH=$repo/.gpukit/shim
work=/tmp/bench-opens
nproc; free -g | head -2
python3 scripts/gpu/dataset.py "$work" "$images"
for threads in 4 64; do
    echo "== --open-threads $threads"
    python3 scripts/bench/bench_opens.py --shapes opens,large --readers ${READERS:-12,16} --large "$images" --repeats 3 \
        --work "$work" --json "$out/opens-threads$threads.json" --mount-options "--open-threads $threads --loops 1" 2>&1 \
        | grep -v '^reusing'
done
