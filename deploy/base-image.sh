#!/bin/sh
# Build the base image of deploy/Dockerfile from Debian's packages alone: debootstrap a minimal bookworm root
# filesystem with Python 3.11, venv and tini, and `docker import` it. No image registry is needed.
#
#   deploy/base-image.sh [TAG]       (default nesa-node-base:bookworm; needs root, debootstrap and docker)
#
# Does nothing when TAG exists already: remove it (docker image rm TAG) to build it again.
# MIRROR chooses the Debian mirror (default http://deb.debian.org/debian).
set -eu

TAG=${1:-nesa-node-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
# python3-venv: the builder stage makes the venv; tini: PID 1 of the containers (forwards SIGTERM to nesa-node,
# which drains, and reaps what it leaves)
PACKAGES=python3.11,python3-venv,tini

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG exists"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "debootstrap needs root: run as root, or build $TAG elsewhere and load it" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

ROOTFS=$(mktemp -d "${TMPDIR:-/var/tmp}/nesa-node-rootfs.XXXXXX")
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE (minbase + $PACKAGES) from $MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
    tail -20 "$ROOTFS.log" >&2
    rm -f "$ROOTFS.log"
    exit 1
}
rm -f "$ROOTFS.log"

# what an image does not need: downloaded packages, package lists (an image that installs more runs apt-get update),
# documentation and manual pages, and the host's resolver configuration copied by debootstrap
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* \
    "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/etc/resolv.conf "$ROOTFS"/etc/hostname

echo "importing as $TAG"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $SUITE with $PACKAGES" \
    - "$TAG" >/dev/null
docker image ls "$TAG"
