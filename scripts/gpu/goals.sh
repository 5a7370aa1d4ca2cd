#!/usr/bin/env bash
# Issue 40's goals on a lent GPU host, as one prepared run of ~6 minutes (each step under a timeout, so the
# session's device time is never overrun; lines stamped):
#   1. opens: 192 raw 6.3 MB objects opened and closed by 16 readers, cold and warm, direct and through a mount at
#      --loops auto (the default: one loop per 4 cores) and at --loops 8 (the figures of "Several loops");
#   2. small files: 3,000 files of 110 KB read by 1, 8 and 16 readers directly, through the bare pyfuse3 mirror
#      (the ceiling of any pyfuse3 daemon on the host) and through the mount (its defaults);
#   3. training end to end: bench_train's torchvision loop (ResNet-50) over the BMP copy and the mount at ratio 1
#      (its defaults), 16 cores, every epoch cold, in both orders (a process that trains first on a node runs slower).
# JSON and the log go to $OUT (or out/gpu): at most 8 files come back from such a host, so the training's charts stay.
#
#   bash scripts/gpu/kit.sh                 # here, once
#   bash scripts/gpu/goals.sh [IMAGES]      # there (default 512 training images)
set -uo pipefail
source "$(dirname "$0")/common.sh"
images=${1:-512}
kit_setup > /tmp/kit-setup.log 2>&1 || { cat /tmp/kit-setup.log; exit 1; }
export PYTHONPATH=$repo/.gpukit/shim
{
echo "== host: $(nproc) cores, kernel $(uname -r), $(free -g | awk '/Mem/ {print $2}') GiB; liquidfs/*.py sha256" \
    "$(package_sum)"
python3 scripts/gpu/dataset.py /tmp/bench-opens 192
for loops in ${OPENS_LOOPS:-auto 8}; do
    echo "== opens, 16 readers, --loops $loops"
    timeout -s ABRT "${OPENS_SECONDS:-80}" python3 scripts/bench/bench_opens.py --shapes opens --readers 16 \
        --large 192 --repeats 5 --work /tmp/bench-opens --mount-options "--loops $loops" \
        --json "$out/opens-loops-$loops.json" 2>&1 | grep -v '^reusing'
    fusermount3 -u -z /tmp/bench-opens/mnt 2>/dev/null
done
echo "== small files: direct, the bare mirror, the mount"
timeout -s ABRT "${SMALL_SECONDS:-180}" python3 scripts/bench/bench_opens.py --shapes small --small 3000 \
    --large 0 --readers 1,8,16 --repeats 3 --mirror --work /tmp/bench-small --json "$out/small-mirror.json" 2>&1
fusermount3 -u -z /tmp/bench-small/mnt 2>/dev/null
fusermount3 -u -z /tmp/bench-small/mnt-mirror 2>/dev/null
for configs in direct-bmp,liquidfs liquidfs,direct-bmp; do
    echo "== training, 16 cores, $configs"
    timeout -s ABRT "${TRAIN_SECONDS:-120}" python3 scripts/bench/bench_train.py --loader torch --cores 16 --ratio 1 \
        --images "$images" --epochs 2 --configs "$configs" --work /tmp/bench-train \
        --json "/tmp/bench-train/out/train-${configs%%,*}-first.json" 2>&1 | grep -v "^|\|^$"
    cp "/tmp/bench-train/out/train-${configs%%,*}-first.json" "$out/" 2>/dev/null
done
} 2>&1 | stamp | tee "$out/goals.log"
true
