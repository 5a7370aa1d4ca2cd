#!/usr/bin/env bash
# Issue 40's opens before and after a change, on a lent GPU host, as one prepared run of ~5 minutes: the package of
# an earlier commit (OLD: its tree, `git archive`d here into a folder git ignores) and this checkout's, each copied
# in turn into the interpreter's site-packages, where the daemon (`python -I -m liquidfs`) finds it: old, new, old,
# new. In each, bench_opens (this checkout's) over 192 raw 6.3 MB objects opened and closed by 16 readers
# (`opens`) and 3,000 files of 110 KB read whole (`small`), cold and warm, the mount at `--loops LOOPS` (default
# 8): a change's effect where many loops share 16 cores, which 2 cores cannot show. JSON and the log go to $OUT.
#
#   git archive REV liquidfs | (mkdir -p .gpuold && tar -x -C .gpuold)   # here (.gpuold in .git/info/exclude)
#   bash scripts/gpu/kit.sh                                               # here, once
#   bash scripts/gpu/ab.sh .gpuold                                        # there, carrying .gpukit and .gpuold
set -uo pipefail
source "$(dirname "$0")/common.sh"
old=${1:?usage: bash scripts/gpu/ab.sh OLD_TREE (a git archive of the earlier commit)}
[ -d "$old/liquidfs" ] || { echo "gpu ab: no liquidfs package in $old" >&2; exit 1; }
old=$(cd "$old" && pwd)
kit_setup > /tmp/kit-setup.log 2>&1 || { cat /tmp/kit-setup.log; exit 1; }
export PYTHONPATH=$repo/.gpukit/shim
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
use() {  # the daemon's package from tree $1, as scripts/gpu/setup.sh installs it
    rm -rf "$site/liquidfs" && cp -a "$1/liquidfs" "$site/liquidfs"
    find "$site/liquidfs" -name __pycache__ -prune -exec rm -rf {} +
}
{
echo "== host: $(nproc) cores, kernel $(uname -r); --loops ${LOOPS:-8}; liquidfs/*.py sha256 old" \
    "$(package_sum "$old") new $(package_sum)"
python3 scripts/gpu/dataset.py /tmp/bench-opens 192
for round in 1 2; do
    for which in old new; do
        if [ "$which" = old ]; then use "$old"; else use "$repo"; fi
        echo "== round $round: $which"
        timeout -s ABRT "${AB_SECONDS:-120}" python3 scripts/bench/bench_opens.py --shapes opens,small --small 3000 \
            --large 192 --readers 16 --repeats 3 --work /tmp/bench-opens --mount-options "--loops ${LOOPS:-8}" \
            --json "$out/ab-$which-$round.json" 2>&1 | grep -v '^reusing'
        fusermount3 -u -z /tmp/bench-opens/mnt 2>/dev/null
    done
done
use "$repo"
} 2>&1 | stamp | tee "$out/ab.log"
true
