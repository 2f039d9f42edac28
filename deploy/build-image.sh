#!/usr/bin/env bash
# Build the visionserve image(s) and print their size.
#
#   deploy/build-image.sh                 # the CPU image: visionserve:<version>-cpu
#   deploy/build-image.sh --target gpu    # the GPU image: visionserve:<version> (builds without a GPU)
#   deploy/build-image.sh --target all    # both
#
# On a normal machine this is `docker build` with the Dockerfile's own base image
# (ARG PYTHON_IMAGE, python:X.Y.Z-slim-...) and PyPI, nothing else. Two fallbacks, for build hosts
# that cannot reach an image registry or that reach PyPI only through their own CA:
#
#  - Base image. When the Dockerfile's base is neither present nor pullable (no registry), a base
#    with the same contract (python + venv on PATH, apt, Debian) is made from Debian packages:
#    `debootstrap --variant=minbase $DEBIAN_SUITE` + `docker import`, tagged
#    visionserve-base:python<X.Y>-<suite>. The suite's Python must be one the constraints file was
#    tested with (3.11 or 3.12): bookworm has 3.11. The rootfs tarball and the image are kept
#    (cache dir below, and the engine's image store), so this happens once per machine.
#  - pip's index and CA. What the host's pip is configured with (`pip config list`: cert,
#    index-url, extra-index-url, trusted-host; PIP_* variables included) is handed to the build as
#    BuildKit secrets (a pip.conf and the CA bundle), never as a layer or a build argument, so
#    neither ends up in the image or its history. file:// indexes and find-links of the host are
#    left out: those paths do not exist inside the build.
#
# pip downloads are cached by BuildKit's cache mount (/root/.cache/pip in the Dockerfile), so a
# rebuild after a code change reinstalls from that cache; a rebuild without changes is all layer
# cache hits.
#
# Options:
#   --target cpu|gpu|all    what to build (default cpu)
#   --tag NAME:TAG          image name for a single target (default visionserve:<version>[-cpu])
#   --base-only             make/find the base image, print it, build nothing else
#   --no-cache              rebuild every layer (the pip download cache is still used)
#   --record FILE           append one JSON line per built target (tag, id, size, layers, seconds)
# Environment:
#   PYTHON_IMAGE            use this base image, no detection
#   DEBIAN_SUITE            debootstrap suite for the fallback base (default bookworm)
#   DEBIAN_MIRROR           (default http://deb.debian.org/debian)
#   VISIONSERVE_BUILD_CACHE where the rootfs tarball is kept (default ~/.cache/visionserve-build)
#   PULL_TIMEOUT_S          how long to try pulling the usual base (default 60)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

TARGET=cpu TAG="" BASE_ONLY=0 NO_CACHE=() RECORD=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --target) TARGET=$2; shift 2 ;;
        --tag) TAG=$2; shift 2 ;;
        --base-only) BASE_ONLY=1; shift ;;
        --no-cache) NO_CACHE=(--no-cache); shift ;;
        --record) RECORD=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-image.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
case $TARGET in cpu|gpu|all) ;; *) echo "build-image.sh: --target cpu, gpu or all, not $TARGET" >&2; exit 2 ;; esac
if [[ -n $TAG && $TARGET == all ]]; then echo "build-image.sh: --tag names one target, not all" >&2; exit 2; fi

DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${VISIONSERVE_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/visionserve-build}
PULL_TIMEOUT_S=${PULL_TIMEOUT_S:-60}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
BASE_RECIPE=2                  # bump when debootstrap_base changes: older bases are then not reused
TESTED_PYTHONS="3.11 3.12"     # what requirements/constraints.txt was tested with (README)

log() { printf 'build-image: %s\n' "$*" >&2; }
die() { printf 'build-image: %s\n' "$*" >&2; exit 1; }

# --- the engine and a client that speaks BuildKit ---------------------------------------------
# The Dockerfile needs BuildKit (RUN --mount). Docker >= 23 builds with the buildx plugin; a client
# without it refuses DOCKER_BUILDKIT=1. Docker 20.10 (Debian bookworm's docker.io) has BuildKit
# built in. So: buildx where it is, else a client older than 23 (Debian's is /usr/bin/docker, which
# a newer static client in /usr/local/bin may shadow).
command -v docker >/dev/null || die "no docker client on PATH"
docker info >/dev/null 2>&1 || die "the Docker engine does not answer (is dockerd running? docker info)"
BUILD=()
if docker buildx version >/dev/null 2>&1; then
    BUILD=(docker buildx build --load)
else
    for client in docker /usr/bin/docker; do
        v=$("$client" version --format '{{.Client.Version}}' 2>/dev/null || true)
        if [[ -n $v && ${v%%.*} -lt 23 ]]; then BUILD=(env DOCKER_BUILDKIT=1 "$client" build); break; fi
    done
fi
[[ ${#BUILD[@]} -gt 0 ]] || die "no BuildKit: install the buildx plugin (docker-buildx) or use Docker 20.10-22"

# --- the base image ---------------------------------------------------------------------------
default_base() { sed -n 's/^ARG PYTHON_IMAGE=\(.*\)$/\1/p' Dockerfile | head -1; }

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# The fallback: Debian's own python3 in a minbase rootfs. python-is-python3 gives `python`, like
# the python:* images; python3-venv gives ensurepip for `python -m venv`; ca-certificates and
# LANG=C.UTF-8 as there. apt stays usable (the runtime stage installs tini with it).
debootstrap_base() {
    local suite=$1 tarball dir
    tarball="$CACHE/rootfs-$suite-r$BASE_RECIPE.tar"
    command -v debootstrap >/dev/null || die "no base image and no debootstrap to make one (apt-get install debootstrap)"
    mkdir -p "$CACHE"
    if [[ ! -s $tarball ]]; then
        dir=$(mktemp -d "$CACHE/rootfs.XXXXXX")
        log "debootstrap --variant=minbase $suite (a few minutes, once per machine)"
        debootstrap --variant=minbase \
            --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
            "$suite" "$dir" "$DEBIAN_MIRROR" >"$CACHE/debootstrap-$suite.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap-$suite.log" >&2; rm -rf "$dir"; die "debootstrap failed (log: $CACHE/debootstrap-$suite.log)"; }
        # security and point-release updates, as the python:* images carry them
        cat >"$dir/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR $suite main
deb $DEBIAN_MIRROR $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
EOF
        chroot "$dir" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -y -qq upgrade' \
            >>"$CACHE/debootstrap-$suite.log" 2>&1 || log "apt-get upgrade in the rootfs failed; base without updates"
        chroot "$dir" apt-get clean
        # what Debian's official images set (debuerreotype), so that `apt-get update && install`
        # in a Dockerfile leaves no package caches (~80 MB) in its layer, as on python:*-slim
        cat >"$dir/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT
        echo 'Acquire::Languages "none";' >"$dir/etc/apt/apt.conf.d/docker-no-languages"
        echo 'Acquire::GzipIndexes "true";' >"$dir/etc/apt/apt.conf.d/docker-gzip-indexes"
        echo 'APT::AutoRemove::SuggestsImportant "false";' >"$dir/etc/apt/apt.conf.d/docker-autoremove-suggests"
        rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/log/* "$dir"/tmp/* \
            "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/*
        tar -C "$dir" --numeric-owner -cf "$tarball.part" .
        mv "$tarball.part" "$tarball"
        rm -rf "$dir"
    fi
    local pyver
    pyver=$(tar -tf "$tarball" | sed -n 's|^\./usr/bin/python\(3\.[0-9]*\)$|\1|p' | head -1)
    [[ -n $pyver ]] || die "no python3 in $tarball"
    [[ " $TESTED_PYTHONS " == *" $pyver "* ]] \
        || die "$suite has Python $pyver; the constraints were tested with $TESTED_PYTHONS (DEBIAN_SUITE=bookworm)"
    BASE="visionserve-base:python$pyver-$suite"
    if [[ $(docker image inspect -f '{{index .Config.Labels "visionserve.base.recipe"}}' "$BASE" 2>/dev/null) != "$BASE_RECIPE" ]]; then
        log "docker import $tarball as $BASE"
        docker import \
            --change 'ENV LANG=C.UTF-8' \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'CMD ["python3"]' \
            --change "LABEL visionserve.base.recipe=$BASE_RECIPE" \
            --message "debootstrap --variant=minbase $suite + python3 (visionserve build-image.sh)" \
            "$tarball" "$BASE" >/dev/null
    fi
}

pick_base() {
    local usual
    usual=$(default_base)
    if [[ -n ${PYTHON_IMAGE:-} ]]; then BASE=$PYTHON_IMAGE; BASE_HOW="PYTHON_IMAGE"; return; fi
    if have_image "$usual"; then BASE=$usual; BASE_HOW="present"; return; fi
    log "pulling $usual (at most ${PULL_TIMEOUT_S} s)"
    if timeout "$PULL_TIMEOUT_S" docker pull -q "$usual" >/dev/null 2>&1; then
        BASE=$usual; BASE_HOW="pulled"; return
    fi
    log "$usual cannot be pulled: base from Debian packages ($DEBIAN_SUITE)"
    # a base made earlier on this machine: no tarball, no debootstrap needed
    local made
    made=$(docker image ls --filter "label=visionserve.base.recipe=$BASE_RECIPE" \
        --format '{{.Repository}}:{{.Tag}}' visionserve-base | grep -- "-$DEBIAN_SUITE\$" | head -1 || true)
    if [[ -n $made ]]; then BASE=$made; else debootstrap_base "$DEBIAN_SUITE"; fi
    BASE_HOW="debootstrap"
}

BASE="" BASE_HOW=""
pick_base
log "base image: $BASE ($BASE_HOW)"
if [[ $BASE_ONLY == 1 ]]; then echo "$BASE"; exit 0; fi

# --- pip's configuration for the build, as secrets ------------------------------------------------
SECRETS_DIR=$(mktemp -d)
trap 'rm -rf "$SECRETS_DIR"' EXIT
chmod 700 "$SECRETS_DIR"
SECRETS=()
PIP_CONFIG_LIST=$(command -v python3 >/dev/null && python3 -m pip config list 2>/dev/null || true)
pip_setting() {  # the host pip's effective value of one key (env beats files), empty if unset
    local key=$1
    printf '%s\n' "$PIP_CONFIG_LIST" | awk -v k="$key" '
        { split($0, kv, "="); name = kv[1]; sub(/^[^.]*\./, "", name);
          val = substr($0, length(kv[1]) + 2); gsub(/^'\''|'\''$/, "", val) }
        name == k { if ($0 ~ /^:env:/) env = val; else file = val }
        END { print (env != "" ? env : file) }'
}
{
    echo "[global]"
    cert=$(pip_setting cert)
    if [[ -n $cert && -r $cert ]]; then
        SECRETS+=(--secret "id=pip-ca,src=$cert")
        echo "cert = /run/secrets/pip-ca"
    fi
    index=$(pip_setting index-url)
    [[ -n $index && $index != file:* ]] && echo "index-url = $index"
    extra=$(pip_setting extra-index-url | tr ' ' '\n' | grep -v -e '^file:' -e '^$' | tr '\n' ' ' || true)
    [[ -n ${extra// /} ]] && echo "extra-index-url = $extra"
    trusted=$(pip_setting trusted-host)
    [[ -n $trusted ]] && echo "trusted-host = $trusted"
    timeout_s=$(pip_setting default-timeout)
    [[ -n $timeout_s ]] && echo "timeout = $timeout_s"
} >"$SECRETS_DIR/pip.conf"
SECRETS+=(--secret "id=pip.conf,src=$SECRETS_DIR/pip.conf")
log "pip for the build: $(grep -c . "$SECRETS_DIR/pip.conf") line(s) of pip.conf from the host's pip config$([[ -n ${cert:-} ]] && echo ", CA bundle $cert") (BuildKit secrets)"

# --- build ---------------------------------------------------------------------------------------
build_one() {
    local target=$1 tag=$2 t0 secs size layers id
    log "building --target $target -> $tag"
    t0=$(date +%s%N)
    "${BUILD[@]}" "${NO_CACHE[@]}" --target "$target" --tag "$tag" \
        --build-arg "PYTHON_IMAGE=$BASE" "${SECRETS[@]}" \
        --label "org.opencontainers.image.version=$VERSION" --label "visionserve.build=build-image.sh" \
        --label "org.opencontainers.image.base.name=$BASE" \
        --progress plain . >"$SECRETS_DIR/build-$target.log" 2>&1 \
        || { tail -40 "$SECRETS_DIR/build-$target.log" >&2; die "build of $target failed"; }
    secs=$(( ($(date +%s%N) - t0) / 100000000 ))        # tenths of a second
    secs="$((secs / 10)).$((secs % 10))"
    size=$(docker image inspect -f '{{.Size}}' "$tag")
    layers=$(docker image inspect -f '{{len .RootFS.Layers}}' "$tag")
    id=$(docker image inspect -f '{{.Id}}' "$tag")
    printf '%s\t%s MB\t%s layers\t%s s\t%s\n' "$tag" "$((size / 1000000))" "$layers" "$secs" "$id"
    if [[ -n $RECORD ]]; then
        printf '{"target": "%s", "tag": "%s", "id": "%s", "size_bytes": %s, "layers": %s, "seconds": %s, "base": "%s", "base_how": "%s"}\n' \
            "$target" "$tag" "$id" "$size" "$layers" "$secs" "$BASE" "$BASE_HOW" >>"$RECORD"
    fi
}

targets=$TARGET
[[ $TARGET == all ]] && targets="cpu gpu"
for t in $targets; do
    if [[ -n $TAG ]]; then tag=$TAG
    elif [[ $t == cpu ]]; then tag="visionserve:$VERSION-cpu"
    else tag="visionserve:$VERSION"; fi
    build_one "$t" "$tag"
done
log "Kubernetes (deploy/k8s, the GPU image): docker tag visionserve:$VERSION REGISTRY/visionserve:$VERSION,"
log "  docker push it, then in deploy/k8s: kustomize edit set image visionserve=REGISTRY/visionserve:$VERSION@DIGEST"
log "  (DIGEST: docker inspect -f '{{index .RepoDigests 0}}' REGISTRY/visionserve:$VERSION; deploy/README.md)"
# earlier builds of these tags, now untagged: only images with this project's label, never others
docker image prune -f --filter "label=visionserve.build=build-image.sh" >/dev/null 2>&1 || true
