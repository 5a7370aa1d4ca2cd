#!/usr/bin/env bash
# Install pyfuse3 with FUSE passthrough into a virtualenv: pyfuse3 3.5.0 from its PyPI sdist with
# pyfuse3-passthrough.patch applied (FileInfo.backing_id, Operations.enable_passthrough,
# pyfuse3.passthrough_enabled/open/close), pyfuse3-queued-requests.patch (its main loop takes a request
# already queued on /dev/fuse without two trips through trio's scheduler: ~70 us less daemon CPU per
# small file opened, BENCHMARKS.md), pyfuse3-clone.patch (pyfuse3.handle_init/device_fd/set_operations: INIT
# answered before main(), so processes forked after it serve clones of the one connection) and
# pyfuse3-readdir.patch (plain READDIR answered, ReaddirToken.plus, READDIRPLUS_AUTO for operations that ask: a
# listing no lookup follows costs the daemon no attributes and the kernel no inode per entry; and
# readdir_reply_packed: a catalog's packed listing added to a reply in C), built against
# libfuse >= 3.17 -- the system's when it has one, else libfuse 3.17.2 built from Debian trixie's source package into VENV/libfuse (library,
# headers and pkg-config file only; mounting still uses the system's fusermount3 when it needs it).
#
#   usage: bash scripts/passthrough/build.sh VENV
#
# Needs a C compiler, pkg-config, patch, the Python headers, apt (only without a system libfuse
# >= 3.17) and PyPI. Idempotent: exits at once when VENV's pyfuse3 already has both patches.
# On failure the last line on stderr says why. The patched pyfuse3 is built as a wheel and its link
# checked with ldd (libfuse3 from VENV/libfuse/lib) before it replaces VENV's previous pyfuse3.
set -euo pipefail

LIBFUSE_VERSION=3.17.2
LIBFUSE_SHA256=3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f  # fuse3_3.17.2.orig.tar.gz
PYFUSE3_VERSION=3.5.0
JOBS=2

die() { echo "passthrough build failed: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 VENV"
[ -x "$1/bin/python" ] || die "$1 is not a virtualenv (no $1/bin/python)"
venv=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
py="$venv/bin/python"

PATCHED_CHECK='import pyfuse3; pyfuse3.passthrough_open; pyfuse3.set_operations; assert pyfuse3.queued_requests_first and pyfuse3.plain_readdir; pyfuse3.readdir_reply_packed'
if "$py" -c "$PATCHED_CHECK" 2>/dev/null; then
    echo "pyfuse3 with passthrough already installed in $venv"
    exit 0
fi

# pip, silent unless it fails.
pip_quiet() {
    local out
    out=$("$venv/bin/pip" --disable-pip-version-check "$@" 2>&1) || { printf '%s\n' "$out" >&2; return 1; }
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

# The Debian archive this machine already uses (deb822 or one-line format), for the trixie deb-src.
debian_uri() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] || continue
        awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) print $i }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -e "$f" ] || continue
        awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/ && $i !~ /=/) { print $i; break } }' "$f"
    done
}

# libfuse 3.17.2 from Debian trixie's source package, fetched with apt in a private state (our own
# sources list, lists and cache under $tmp), checked against the pinned sha256, built with
# meson + ninja from PyPI: the library only, into $prefix.
build_libfuse() {
    local prefix=$1 uri keyring="" apt_opts src tarball sum
    uri=$(debian_uri | grep -v -- '-security' | head -n 1 || true)
    [ -n "$uri" ] || die "no Debian archive URI in /etc/apt/sources.list{,.d/} to fetch the libfuse source from"
    [ -r /usr/share/keyrings/debian-archive-keyring.gpg ] \
        && keyring="[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
    mkdir -p "$tmp/apt/lists/partial" "$tmp/apt/cache/archives/partial" "$tmp/src"
    echo "deb-src ${keyring}${uri} trixie main" > "$tmp/apt/sources.list"
    apt_opts=(-q -o "Dir::Etc::SourceList=$tmp/apt/sources.list" -o Dir::Etc::SourceParts=-
              -o "Dir::State::Lists=$tmp/apt/lists" -o "Dir::Cache=$tmp/apt/cache"
              -o APT::Sandbox::User=root)
    echo "fetching libfuse $LIBFUSE_VERSION source (Debian trixie fuse3) from $uri"
    apt-get "${apt_opts[@]}" update > "$tmp/apt.log" 2>&1 \
        || { cat "$tmp/apt.log" >&2; die "apt-get update of the trixie deb-src index failed"; }
    (cd "$tmp/src" && apt-get "${apt_opts[@]}" source --download-only fuse3/trixie) >> "$tmp/apt.log" 2>&1 \
        || { cat "$tmp/apt.log" >&2; die "apt-get source fuse3/trixie failed"; }
    tarball="$tmp/src/fuse3_$LIBFUSE_VERSION.orig.tar.gz"
    [ -f "$tarball" ] || die "trixie's fuse3 is no longer libfuse $LIBFUSE_VERSION (got: $(cd "$tmp/src" && echo *.orig.*))"
    sum=$(sha256sum "$tarball" | cut -d' ' -f1)
    [ "$sum" = "$LIBFUSE_SHA256" ] || die "sha256 mismatch for $(basename "$tarball"): got $sum, expected $LIBFUSE_SHA256"
    tar -xzf "$tarball" -C "$tmp/src"
    src="$tmp/src/fuse-$LIBFUSE_VERSION"

    echo "building libfuse $LIBFUSE_VERSION into $prefix"
    pip_quiet install -q meson ninja || die "pip install meson ninja failed"
    rm -rf "$prefix"
    (
        export PATH="$venv/bin:$PATH"
        meson setup "$src/build" "$src" --prefix "$prefix" --libdir lib -Dbuildtype=release \
            -Dexamples=false -Dutils=false -Dtests=false
        ninja -C "$src/build" -j"$JOBS"
        meson install -C "$src/build" --quiet
    ) > "$tmp/meson.log" 2>&1 || { tail -n 30 "$tmp/meson.log" >&2; die "libfuse $LIBFUSE_VERSION build failed"; }
    # libfuse runs $prefix/bin/fusermount3 (its compile-time path) and then fusermount3 from $PATH
    # when it cannot mount(2) itself: point the former at the system's setuid helper.
    if command -v fusermount3 > /dev/null; then
        mkdir -p "$prefix/bin"
        ln -sf "$(command -v fusermount3)" "$prefix/bin/fusermount3"
    fi
}

prefix=""
if pkg-config --atleast-version=3.17 fuse3 2>/dev/null; then
    echo "using the system's libfuse $(pkg-config --modversion fuse3)"
else
    prefix="$venv/libfuse"
    if PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --exact-version="$LIBFUSE_VERSION" fuse3 2>/dev/null \
        && [ -e "$prefix/lib/libfuse3.so" ]; then
        echo "reusing libfuse $LIBFUSE_VERSION in $prefix"
    else
        build_libfuse "$prefix"
    fi
fi

# Where EXT (pyfuse3's extension module) loads libfuse3 from, checked with ldd before anything imports
# it, so a wrong link is reported as such rather than as an ImportError (an undefined
# fuse_session_new_versioned: 3.17 headers, an older library).
check_linkage() {
    local ext=$1 soname path
    read -r soname path < <(ldd "$ext" | awk '$1 ~ /^libfuse3\.so/ { print $1, $3; exit }') || true
    [ -n "${soname:-}" ] || die "$ext does not link libfuse3 at all"
    if [ "$path" = "not" ] || [ ! -e "$path" ]; then
        die "$ext needs $soname, which the loader cannot find (no rpath to it?)"
    fi
    if [ -n "$prefix" ] && [ "$(dirname "$path")" != "$prefix/lib" ]; then
        die "$ext was linked against $(readlink -f "$path") ($soname) instead of $prefix/lib/libfuse3.so" \
            "(libfuse $LIBFUSE_VERSION): the linker found another libfuse3.so first on its -L path"
    fi
    libfuse=$(readlink -f "$path")
}

echo "building pyfuse3 $PYFUSE3_VERSION with $(basename "$here")/pyfuse3-{passthrough,queued-requests,clone,readdir}.patch"
# --no-binary pyfuse3, not :all: -- the latter also builds the sdist's build requirements (Cython: minutes of
# compiling) from source just to read its metadata, where their wheels do as well (times: docs/install.md).
pip_quiet download -q --no-deps --no-binary pyfuse3 -d "$tmp/sdist" "pyfuse3==$PYFUSE3_VERSION" \
    || die "pip download pyfuse3==$PYFUSE3_VERSION failed"
tar -xzf "$tmp/sdist/pyfuse3-$PYFUSE3_VERSION.tar.gz" -C "$tmp/sdist"
pysrc="$tmp/sdist/pyfuse3-$PYFUSE3_VERSION"
patch -d "$pysrc" -p1 --forward --quiet < "$here/pyfuse3-passthrough.patch" \
    || die "pyfuse3-passthrough.patch does not apply to pyfuse3 $PYFUSE3_VERSION"
patch -d "$pysrc" -p1 --forward --quiet < "$here/pyfuse3-queued-requests.patch" \
    || die "pyfuse3-queued-requests.patch does not apply to pyfuse3 $PYFUSE3_VERSION with passthrough"
patch -d "$pysrc" -p1 --forward --quiet < "$here/pyfuse3-clone.patch" \
    || die "pyfuse3-clone.patch does not apply to pyfuse3 $PYFUSE3_VERSION with the other two"
patch -d "$pysrc" -p1 --forward --quiet < "$here/pyfuse3-readdir.patch" \
    || die "pyfuse3-readdir.patch does not apply to pyfuse3 $PYFUSE3_VERSION with the other three"
rm -f "$pysrc/src/pyfuse3/__init__.c"  # generated from the unpatched .pyx: make Cython regenerate it
(
    if [ -n "$prefix" ]; then
        export PKG_CONFIG_PATH="$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
        # -L here too, not only in pkg-config's --libs: pyfuse3's build backend passes those as
        # extra_link_args, which end the link line, while setuptools puts Python's LIBDIR on the
        # library path before them when Python is built with --enable-shared -- on Debian's python3
        # that is /usr/lib/x86_64-linux-gnu, whose libfuse3.so (libfuse3-dev, 3.14) ld would then take
        # for -lfuse3.  LDFLAGS come right after the linker command, ahead of every other -L.
        export LDFLAGS="-L$prefix/lib -Wl,-rpath,$prefix/lib${LDFLAGS:+ $LDFLAGS}"
    fi
    # A local version label, so `pip show pyfuse3` tells this build from the stock one.
    export SETUPTOOLS_SCM_PRETEND_VERSION="$PYFUSE3_VERSION+passthrough.queued"
    # A wheel first (never from or into pip's cache), checked below before it replaces anything.
    pip_quiet wheel -q --no-deps --no-cache-dir -w "$tmp/wheel" "$pysrc"
) || die "building the patched pyfuse3 failed"
wheels=("$tmp"/wheel/pyfuse3-*.whl)
[ -f "${wheels[0]}" ] || die "pip wheel left no pyfuse3 wheel in $tmp/wheel"
"$py" -m zipfile -e "${wheels[0]}" "$tmp/unpacked" || die "cannot unpack ${wheels[0]}"
exts=("$tmp"/unpacked/pyfuse3/__init__*.so)
[ -f "${exts[0]}" ] || die "the pyfuse3 wheel has no extension module"
check_linkage "${exts[0]}"

pip_quiet install -q --no-deps --force-reinstall --no-cache-dir "${wheels[0]}" \
    || die "installing the patched pyfuse3 wheel failed"
ext=$("$py" -c 'import importlib.util; print(importlib.util.find_spec("pyfuse3").origin)')
check_linkage "$ext"
"$py" -c "$PATCHED_CHECK" || die "the installed pyfuse3 lacks passthrough_open, queued_requests_first, set_operations or plain_readdir"
echo "pyfuse3 $PYFUSE3_VERSION+passthrough.queued installed in $venv (libfuse: $libfuse) in $((SECONDS - start))s"
