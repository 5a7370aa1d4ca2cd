#!/usr/bin/env bash
# Issue 40's end-to-end goal at 16 cores with several loops, as one short prepared run for a lent GPU host: the kit
# installed, then bench_train's torchvision loop over the BMP copy and a mount with --loops LOOPS (default 8), in
# both orders (a process that trains first on a node runs slower). IMAGES (default 256) keeps it in a few minutes.
#
#   bash scripts/gpu/kit.sh                  # here, once
#   bash scripts/gpu/train_loops.sh [IMAGES] # there
set -uo pipefail
source "$(dirname "$0")/common.sh"
images=${1:-256}
kit_setup > /dev/null || exit 1
for configs in direct-bmp,liquidfs liquidfs,direct-bmp; do
    timeout -s ABRT "${TRAIN_SECONDS:-100}" python3 scripts/bench/bench_train.py --loader torch --cores 16 --ratio 1 \
        --images "$images" --epochs 2 --configs "$configs" --mount-options "--loops ${LOOPS:-8}" \
        --work /tmp/bench-train --json "$out/train-loops-${configs%%,*}-first.json" 2>&1 | grep -v "^|\|^$" | stamp
done
