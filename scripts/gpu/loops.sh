#!/usr/bin/env bash
# Issue 40's opens with several loops (mount --loops) on a lent GPU host (16 cores, no network), as one prepared
# run, each step under a timeout: the kit installed (scripts/gpu/setup.sh), a Cityscapes-sized sample made on all
# cores, then bench_opens over the same raw objects with 1, 4 and 8 loops (LOOPS), 16 readers, opens only; then
# bench_train's torchvision loop at 16 cores over the BMP copy and a mount with TRAIN_LOOPS loops; then
# bench_loops, the mechanism alone (a bare passthrough mirror) at 1, 4, 8 loops. Lines are stamped; JSON and
# the log go to $OUT (or out/gpu).
#
#   bash scripts/gpu/kit.sh            # here, once
#   bash scripts/gpu/loops.sh [IMAGES] # there (default 192 images)
set -uo pipefail
source "$(dirname "$0")/common.sh"
images=${1:-192}
kit_setup || exit 1
export PYTHONPATH=$repo/.gpukit/shim
work=/tmp/bench-opens
nproc
python3 scripts/gpu/dataset.py "$work" "$images" 2>&1 | stamp
for loops in ${LOOPS:-1 4 8}; do
    echo "== --loops $loops" | stamp
    timeout -s ABRT "${OPENS_SECONDS:-70}" python3 scripts/bench/bench_opens.py --shapes opens --readers 16 \
        --large "$images" --repeats 3 --work "$work" --json "$out/opens-loops$loops.json" \
        --mount-options "--loops $loops" 2>&1 | grep -v '^reusing' | stamp
done
timeout -s ABRT "${TRAIN_SECONDS:-130}" python3 scripts/bench/bench_train.py --loader torch --cores 16 --ratio 1 \
    --images 512 --epochs 2 --configs liquidfs,direct-bmp --mount-options "--loops ${TRAIN_LOOPS:-4}" \
    --work /tmp/bench-train --json "$out/train-loops.json" 2>&1 | stamp
timeout -s ABRT "${MIRROR_SECONDS:-80}" python3 scripts/bench/bench_loops.py --files 4000 --readers 16 \
    --loops 1,4,8 --seconds 2 --repeats 2 --json "$out/loops-mirror.json" 2>&1 | stamp
