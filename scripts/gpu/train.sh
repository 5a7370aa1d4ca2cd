#!/usr/bin/env bash
# Issue 40's end-to-end goal and issue 41's GPU decoder on a lent GPU host, as one prepared run (each step under a
# timeout, so the session's device time is never overrun): the kit installed (scripts/gpu/setup.sh); nvImageCodec's
# lossless J2K check with the profile's own weighing (its wheels in KIT/nvwhl, fetched by hand: docs/install.md;
# J2K_SECONDS, 0 skips it); then bench_train's torchvision loop (ResNet-50) over a direct BMP copy and a mount at
# ratio 1 (its loops `auto`: one per 4 cores), every epoch cold, at each of CORES (a list, default 12). Every line is stamped with the time, and a step
# that runs out of time prints its Python stack (SIGABRT + faulthandler) before it ends.
#
#   bash scripts/gpu/kit.sh                # here, once (+ the nvImageCodec wheels into .gpukit/nvwhl)
#   bash scripts/gpu/train.sh [IMAGES]     # there (default 512 images)
set -uo pipefail
source "$(dirname "$0")/common.sh"
images=${1:-512}
kit_setup || exit 1
if [ "${J2K_SECONDS:-200}" != 0 ] && compgen -G ".gpukit/nvwhl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/nv .gpukit/nvwhl/*.whl
    PYTHONPATH=/tmp/nv timeout -s ABRT "${J2K_SECONDS:-200}" python3 scripts/gpu/nvimgcodec_check.py --images 16 \
        --seconds 3 --gpu-train-rate 3351 --json "$out/nvimgcodec.json" 2>&1 | grep -v -i nvtiff | stamp
fi
timeout -s ABRT "${TRAIN_SECONDS:-300}" python3 scripts/bench/bench_train.py --loader torch --cores "${CORES:-12}" \
    --ratio 1 --images "$images" --epochs 2 --configs direct-bmp,liquidfs --work /tmp/bench-train \
    --json /tmp/bench-train/out/train.json 2>&1 | stamp
cp /tmp/bench-train/out/train.json "$out/train-cores-$(echo "${CORES:-12}" | tr , -).json" 2>/dev/null
