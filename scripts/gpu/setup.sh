#!/usr/bin/env bash
# Install the kit scripts/gpu/kit.sh made into this host's python3 (as root; no network): the wheels it lacks,
# libfuse 3.17.2 under /opt/liquidfs-libfuse, the patched pyfuse3 compiled against this Python's headers,
# fusermount3, and this checkout's liquidfs into the interpreter's own site-packages (the daemon runs
# `python -I -m liquidfs`, which ignores PYTHONPATH). Prints `liquidfs doctor` at the end.
#
#   usage: bash scripts/gpu/setup.sh KIT
#   then:  export PYTHONPATH=KIT/shim   (scripts/sample.py's photos; only the benchmark scripts need it)
set -euo pipefail
die() { echo "gpu setup: $*" >&2; exit 1; }
[ $# -eq 1 ] && [ -d "$1/whl" ] || die "usage: $0 KIT (made by scripts/gpu/kit.sh)"
kit=$(cd "$1" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
start=$SECONDS

missing=()
for whl in "$kit"/whl/*.whl; do
    name=$(basename "$whl" | cut -d- -f1)
    "$py" -m pip show -q "$name" > /dev/null 2>&1 || missing+=("$whl")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${#missing[@]} wheels: $(for w in "${missing[@]}"; do basename "$w" | cut -d- -f1; done | tr '\n' ' ')"
    "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "${missing[@]}" \
        || die "pip install of the kit's wheels failed"
fi

lib=/opt/liquidfs-libfuse
rm -rf "$lib" && cp -a "$kit/libfuse" "$lib"
install -m 4755 "$kit/fusermount3" /usr/local/bin/fusermount3
mkdir -p "$lib/bin" && ln -sf /usr/local/bin/fusermount3 "$lib/bin/fusermount3"

dest=$site/pyfuse3
rm -rf "$dest" && mkdir -p "$dest"
cp "$kit"/pyfuse3/pyfuse3/{_pyfuse3.py,asyncio.py,__init__.pyi,py.typed} "$dest/"
gcc -shared -fPIC -O2 -DFUSE_USE_VERSION=32 -I"$kit/pyfuse3/Include" -I"$kit/pyfuse3/pyfuse3" -I"$include" \
    -I"$lib/include/fuse3" "$kit/pyfuse3/pyfuse3/__init__.c" -o "$dest/__init__$suffix" \
    -L"$lib/lib" -Wl,-rpath,"$lib/lib" -lfuse3 -lpthread -lrt || die "compiling pyfuse3 failed"
"$py" -c 'import pyfuse3; pyfuse3.passthrough_open; pyfuse3.set_operations; assert pyfuse3.queued_requests_first and pyfuse3.plain_readdir; pyfuse3.readdir_reply_packed' \
    || die "the compiled pyfuse3 lacks the passthrough patches"

rm -rf "$site/liquidfs" && cp -a "$repo/liquidfs" "$site/liquidfs"
find "$site/liquidfs" -name __pycache__ -prune -exec rm -rf {} +
echo "installed in $((SECONDS - start)) s"
"$py" -m liquidfs doctor || true
