#!/bin/sh
# Install liquidfs's host integration: the mount(8) helper (fstab / mount -t fuse.liquidfs) and the
# systemd template unit liquidfs@.service.  liquidfs itself must already be installed (pip install).
#
#   sudo mount/install-host.sh                         # liquidfs found on PATH
#   sudo LIQUIDFS_BIN=/opt/liquidfs/bin/liquidfs mount/install-host.sh
#   DESTDIR=/tmp/pkgroot LIQUIDFS_BIN=/usr/bin/liquidfs mount/install-host.sh     # staging, no root
#
# Variables: DESTDIR (staging root, default none), SBINDIR (/sbin: where mount(8) looks for
# mount.<type> helpers), UNITDIR (/etc/systemd/system), CONFDIR (/etc/liquidfs), LIQUIDFS_BIN (the
# liquidfs command baked into the helper and the unit; default: `command -v liquidfs`),
# and FUSERMOUNT (default: `command -v fusermount3`, else /usr/bin/fusermount3; only checked).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
DESTDIR=${DESTDIR:-}
SBINDIR=${SBINDIR:-/sbin}
UNITDIR=${UNITDIR:-/etc/systemd/system}
CONFDIR=${CONFDIR:-/etc/liquidfs}

die() {
    printf 'install-host.sh: %s\n' "$*" >&2
    exit 1
}

if [ -z "${LIQUIDFS_BIN:-}" ]; then
    LIQUIDFS_BIN=$(command -v liquidfs) || die "liquidfs not found on PATH; pip install it first or set LIQUIDFS_BIN"
fi
# plain_path NAME VALUE: an absolute path (systemd and mount(8) do not use your PATH or directory) that the
# helper and the unit take as one word: a blank split it (ExecStart= ran the path's first word), % is a systemd
# specifier, $ a variable to both, and ' \ & | would break the sed that writes it in.
plain_path() {
    case $2 in
        /*) ;;
        *) die "$1 must be an absolute path (systemd and mount(8) do not use your PATH): $2" ;;
    esac
    case $2 in
        *[\'\\\&\|%\$\ \	]*) die "$1 may not contain blanks, ' \\ & | % or \$: $2" ;;
    esac
}
plain_path LIQUIDFS_BIN "$LIQUIDFS_BIN"
plain_path CONFDIR "$CONFDIR"
if [ -z "${FUSERMOUNT:-}" ]; then
    FUSERMOUNT=$(command -v fusermount3) || FUSERMOUNT=/usr/bin/fusermount3
fi
if [ -z "$DESTDIR" ] && [ ! -x "$FUSERMOUNT" ]; then
    echo "install-host.sh: warning: $FUSERMOUNT not found; install the fuse3 package" >&2
fi

helper=$DESTDIR$SBINDIR/mount.fuse.liquidfs
unit=$DESTDIR$UNITDIR/liquidfs@.service
conf=$DESTDIR$CONFDIR
dropin=$conf/liquidfs-cluster.conf

mkdir -p "$DESTDIR$SBINDIR" "$DESTDIR$UNITDIR" "$conf"

tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT

sed "s|^LIQUIDFS_DEFAULT=.*|LIQUIDFS_DEFAULT='$LIQUIDFS_BIN'|" "$here/mount.fuse.liquidfs" > "$tmp"
grep -q "^LIQUIDFS_DEFAULT='$LIQUIDFS_BIN'\$" "$tmp" || die "could not set the liquidfs command in the helper"
install -m 0755 "$tmp" "$helper"

# The unit and the drop-in read their configuration from CONFDIR: where it is installed, not /etc/liquidfs
# whatever CONFDIR said (the unit's ConditionPathExists then skipped it, silently).
sed -e "s|^ExecStart=/usr/local/bin/liquidfs |ExecStart=$LIQUIDFS_BIN |" -e "s|/etc/liquidfs/|$CONFDIR/|g" \
    "$here/systemd/liquidfs@.service" > "$tmp"
grep -q "^ExecStart=$LIQUIDFS_BIN mount --foreground " "$tmp" || die "could not set the liquidfs command in the unit"
install -m 0644 "$tmp" "$unit"

# The --cluster drop-in repeats the unit's command (with the key's flag): the same liquidfs, or a venv's install
# ran /usr/local/bin/liquidfs there and the unit restarted for good (203/EXEC). Copied from here by the admin.
sed -e "s|^ExecStart=/usr/local/bin/liquidfs |ExecStart=$LIQUIDFS_BIN |" -e "s|/etc/liquidfs/|$CONFDIR/|g" \
    "$here/systemd/liquidfs-cluster.conf" > "$tmp"
grep -q "^ExecStart=$LIQUIDFS_BIN mount --foreground " "$tmp" || die "could not set the liquidfs command in the drop-in"
install -m 0644 "$tmp" "$dropin"

# An example configuration; never overwrite a real one.
if [ ! -e "$conf/example.env" ]; then
    install -m 0644 "$here/systemd/example.env" "$conf/example.env"
fi

echo "installed $helper"
echo "installed $unit"
echo "installed $dropin (for a mount with --cluster: see its head)"
echo "example config in $conf/example.env"

if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ] && command -v systemctl > /dev/null; then
    systemctl daemon-reload
fi
cat << EOF

next steps:
  fstab:   SOURCE MOUNTPOINT fuse.liquidfs store=DIR,cache_size=30%,allow_other,nofail,_netdev 0 0
  systemd: cp $CONFDIR/example.env $CONFDIR/NAME.env; edit it; systemctl enable --now liquidfs@NAME
EOF
