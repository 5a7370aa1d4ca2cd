# What the prepared runs here share (sourced by them, after their `set` line): the checkout as the working
# directory, $out for what comes back (OUT, or out/gpu), stamp (each line of a step prefixed with the time) and
# kit_setup (the kit installed by setup.sh, and the environment the benchmarks want on such a host) and package_sum.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
out=${OUT:-out/gpu}
mkdir -p "$out"
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%T)" "$line"; done; }
kit_setup() {
    bash scripts/gpu/setup.sh .gpukit || return 1
    export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 LIQUIDFS_PHOTOS=$repo/.gpukit/shim/skimage/data
}
# The package of tree $1 (default: this checkout) by its content, for a run's first line: the checkout's .git
# travels stale to a lent host (its HEAD named an older commit than the files).
package_sum() { (cd "${1:-$repo}" && find liquidfs -name '*.py' | sort | xargs cat | sha256sum | cut -c1-16); }
