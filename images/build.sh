#!/bin/sh
# Builds the images named on the command line (operator env trainer | trainer-gpu rollout) with buildah: no
# daemon, chroot isolation (no user namespaces or runtime needed inside a build), offline from a wheelhouse.
# Tags are the chart's defaults (ghcr.io/rljob/<image>:<version>). Variables: BASE (the local base image, made by
# images/base.sh when missing), WHEELHOUSE (wheels for the CPU images), WHEELHOUSE_GPU (for trainer-gpu and
# rollout: `make images-gpu` makes it), VERSION, REGISTRY.
set -eu
cd "$(dirname "$0")/.."
export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/images/containers.conf}"
REGISTRY=${REGISTRY:-ghcr.io/rljob}
VERSION=${VERSION:?set VERSION (rljob.__version__)}
BASE=${BASE:-localhost/rljob-base:bookworm}
WHEELHOUSE=${WHEELHOUSE:-$PWD/build/wheelhouse}
WHEELHOUSE_GPU=${WHEELHOUSE_GPU:-$PWD/build/wheelhouse-gpu}
# Every build installs offline from a wheelhouse: build steps may not reach a registry (a proxy that intercepts
# TLS, no network). All are checked before anything is built, the base included.
for image in "$@"; do
	case $image in
	operator | env | trainer) wheels=$WHEELHOUSE make=images ;;
	trainer-gpu | rollout) wheels=$WHEELHOUSE_GPU make=images-gpu ;;
	*) echo "unknown image $image (operator, env, trainer, trainer-gpu, rollout)" >&2 && exit 2 ;;
	esac
	if [ ! -d "$wheels" ]; then
		echo "no wheelhouse at $wheels for $image: \`make $make\` makes it" >&2 && exit 2
	fi
done
podman image exists "$BASE" || images/base.sh "$BASE"
# Reproducible from a commit: the commit's time stamps every layer and the image; the commit names the revision.
revision=$(git rev-parse HEAD)
epoch=$(git log -1 --format=%ct)
for image in "$@"; do
	set -- --build-arg BASE="$BASE" --build-arg RLJOB_VERSION="$VERSION" --build-arg VCS_REF="$revision" \
		--build-arg SOURCE_DATE_EPOCH="$epoch"
	case $image in
	operator) file=operator/Dockerfile wheels=$WHEELHOUSE ;;
	env) file=env_image/Dockerfile wheels=$WHEELHOUSE ;;
	trainer) file=trainer_image/Dockerfile wheels=$WHEELHOUSE && set -- "$@" --build-arg CONSTRAINTS=constraints/cpu.txt ;;
	trainer-gpu) file=trainer_image/Dockerfile wheels=$WHEELHOUSE_GPU ;;
	rollout) file=rollout_image/Dockerfile wheels=$WHEELHOUSE_GPU && set -- "$@" --build-arg WHEEL_BASE="$BASE" ;;
	esac
	set -- "$@" --volume "$wheels:/wheelhouse:ro" --build-arg PIP_FIND_LINKS=/wheelhouse --build-arg PIP_NO_INDEX=1
	tag="$REGISTRY/${image%-gpu}:$VERSION"
	start=$(date +%s)
	buildah bud --quiet --isolation chroot --timestamp "$epoch" -f "$file" "$@" -t "$tag" . >/dev/null
	size=$(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')
	echo "$tag: $size, built in $(($(date +%s) - start)) s"
done
