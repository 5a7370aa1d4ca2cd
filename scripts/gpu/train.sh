#!/usr/bin/env bash
# Issue 40's end-to-end goal and issue 41's GPU decoder on a lent GPU host, as one prepared run (each step under a
# timeout, so the session's device time is never overrun): the kit installed (scripts/gpu/setup.sh), then
# bench_train's torchvision loop (ResNet-50, 12 cores) over a direct BMP copy and a mount at ratio 1, every epoch
# cold; then nvImageCodec's lossless J2K check (its wheels in KIT/nvwhl, fetched by hand: docs/install.md).
#
#   bash scripts/gpu/kit.sh                # here, once (+ the nvImageCodec wheels into .gpukit/nvwhl)
#   bash scripts/gpu/train.sh [IMAGES]     # there (default 512 images)
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
out=${OUT:-out/gpu}
images=${1:-512}
mkdir -p "$out"
bash scripts/gpu/setup.sh .gpukit || exit 1
export PYTHONUNBUFFERED=1 LIQUIDFS_PHOTOS=$repo/.gpukit/shim/skimage/data
timeout "${TRAIN_SECONDS:-240}" python3 scripts/bench/bench_train.py --loader torch --cores "${CORES:-12}" --ratio 1 \
    --images "$images" --epochs 2 --configs direct-bmp,liquidfs --work /tmp/bench-train \
    --json /tmp/bench-train/out/train.json
cp /tmp/bench-train/out/train.json "$out/" 2>/dev/null
if compgen -G ".gpukit/nvwhl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/nv .gpukit/nvwhl/*.whl
    PYTHONPATH=/tmp/nv timeout "${J2K_SECONDS:-100}" python3 scripts/gpu/nvimgcodec_check.py --images 16 \
        --seconds 3 --gpu-train-rate 3351 --json "$out/nvimgcodec.json"
fi
