#!/usr/bin/env bash
# A Docker engine for the `docker` tests (tests/docker), on a development or CI machine.
#
#   bash tests/tools/docker_engine.sh start    # exit 0 once `docker info` answers, else 1 + why
#   bash tests/tools/docker_engine.sh stop     # stops the dockerd that `start` started, if any
#
# start: an engine that already answers is used as it is. Otherwise, as root, Debian's docker.io
# (and debootstrap, for deploy/build-image.sh's base image) is installed when dockerd is missing
# and apt-get is there (DOCKER_ENGINE_INSTALL=0 skips that), then dockerd is started in the
# background, its log in $DOCKER_ENGINE_DIR/dockerd.log, and given DOCKER_ENGINE_WAIT_S (60) to
# answer. Nothing here is fatal to the caller: it prints one line saying what happened.
set -uo pipefail

DIR=${DOCKER_ENGINE_DIR:-/tmp/visionserve-docker-engine}
WAIT_S=${DOCKER_ENGINE_WAIT_S:-60}
mkdir -p "$DIR"

answers() { timeout 20 docker info >/dev/null 2>&1; }

case ${1:-start} in
start)
    if command -v docker >/dev/null && answers; then
        echo "docker engine: already running ($(docker info --format '{{.ServerVersion}}' 2>/dev/null))"
        exit 0
    fi
    if ! command -v dockerd >/dev/null; then
        if [[ ${DOCKER_ENGINE_INSTALL:-1} == 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
            echo "docker engine: installing docker.io and debootstrap (apt-get)"
            { timeout 120 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 300 \
                apt-get install -y -qq --no-install-recommends docker.io debootstrap; } \
                >"$DIR/apt.log" 2>&1 || { echo "docker engine: not available: apt-get install docker.io failed ($DIR/apt.log)"; exit 1; }
        else
            echo "docker engine: not available: no dockerd, and not root with apt-get to install docker.io"
            exit 1
        fi
    fi
    if [[ $(id -u) != 0 ]]; then
        echo "docker engine: not available: dockerd is installed but not running, and starting it needs root"
        exit 1
    fi
    setsid dockerd >"$DIR/dockerd.log" 2>&1 < /dev/null &
    echo $! >"$DIR/dockerd.pid"
    for _ in $(seq "$WAIT_S"); do
        if answers; then
            echo "docker engine: started dockerd (pid $(cat "$DIR/dockerd.pid"), log $DIR/dockerd.log)"
            exit 0
        fi
        if ! kill -0 "$(cat "$DIR/dockerd.pid")" 2>/dev/null; then
            echo "docker engine: not available: dockerd exited: $(tail -1 "$DIR/dockerd.log")"
            rm -f "$DIR/dockerd.pid"
            exit 1
        fi
        sleep 1
    done
    echo "docker engine: not available: dockerd did not answer within ${WAIT_S} s: $(tail -1 "$DIR/dockerd.log")"
    kill "$(cat "$DIR/dockerd.pid")" 2>/dev/null
    rm -f "$DIR/dockerd.pid"
    exit 1
    ;;
stop)
    if [[ -s $DIR/dockerd.pid ]]; then
        pid=$(cat "$DIR/dockerd.pid")
        kill "$pid" 2>/dev/null && for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        rm -f "$DIR/dockerd.pid"
        echo "docker engine: stopped dockerd (pid $pid)"
    fi
    ;;
*) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
