# What the prepared runs here share (sourced by them, after their `set` line): the checkout as the working
# directory, $out for what comes back (OUT, or out/gpu), stamp (each line of a step prefixed with the time) and
# kit_setup (the kit installed by setup.sh, and the environment the benchmarks want on such a host).
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
out=${OUT:-out/gpu}
mkdir -p "$out"
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%T)" "$line"; done; }
kit_setup() {
    bash scripts/gpu/setup.sh .gpukit || return 1
    export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 LIQUIDFS_PHOTOS=$repo/.gpukit/shim/skimage/data
}
