#!/bin/sh
# Makes the local base image the Dockerfiles build on (`--build-arg BASE=...`) from Debian packages: a bookworm
# root filesystem made by mmdebstrap, as the official python slim images are, with Debian's Python 3.11.
# No registry is needed, only a Debian mirror. Usage: images/base.sh TAG
set -eu
tag=${1:?usage: images/base.sh TAG}
shift
# The snapshot date pins every package: the same date gives the same files (SOURCE_DATE_EPOCH stamps them).
snapshot=${DEBIAN_SNAPSHOT:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mirror=""
if [ -n "$snapshot" ]; then
	mirror="http://snapshot.debian.org/archive/debian/$snapshot/"
	set -- --aptopt='Acquire::Check-Valid-Until "false"'
	SOURCE_DATE_EPOCH=$(date -u -d "$(echo "$snapshot" | sed 's/T.*//')" +%s)
	export SOURCE_DATE_EPOCH
fi
# pip installs into the image's own Python, as in the official images: drop Debian's PEP 668 marker.
# Docs, man pages and apt lists are not needed at run time (the slim images drop them too).
mmdebstrap "$@" --quiet --variant=minbase --components=main --aptopt='APT::Install-Recommends "false"' \
	--include=python3,python3-pip,python3-venv,python-is-python3,passwd,ca-certificates \
	--customize-hook='rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED' \
	--customize-hook='rm -rf "$1"/usr/share/doc/* "$1"/usr/share/man/* "$1"/usr/share/info/* "$1"/var/lib/apt/lists/*' \
	bookworm "$work/rootfs.tar" $mirror
podman import --quiet \
	--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	--change 'ENV LANG=C.UTF-8' \
	--change 'CMD ["python3"]' \
	"$work/rootfs.tar" "$tag" >/dev/null
echo "$tag: $(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
