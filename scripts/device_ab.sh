#!/usr/bin/env bash
# Two trees side by side on one GPU machine, in one call: `kvflow bench latency` and
# `throughput` on dummy weights, alternating the trees (A B A B) so that drift hits both.
#
#   OLD=.peer-old PARTS="tests latency throughput" bash scripts/device_ab.sh
#
# OLD: a folder holding the other tree (e.g. `git archive <commit> | tar -x -C .peer-old`);
# the tree this runs in is the new one. Needs .whl/ (scripts/device_wheels.sh).
# FLAGS: more bench flags for both trees (e.g. "--quantization awq"); BATCH_SIZES: latency's.
set -uo pipefail
OUT=${OUT:-$PWD/ab-out}
OLD=${OLD:-.peer-old}
MODEL=${MODEL:-Qwen3-8B}
PARTS=${PARTS:-"tests latency throughput"}
ROUNDS=${ROUNDS:-2}
read -ra FLAGS <<<"${FLAGS:-}"
read -ra BATCH_SIZES <<<"${BATCH_SIZES:-1 8 32}"
COMMON=(--load-format dummy --max-model-len 4096 --seed 0 "${FLAGS[@]}")
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
NEW=$PWD
status=0

bench() {  # TREE LABEL ARGS...: one `kvflow bench` run of a tree, JSON to $OUT/LABEL.json
    local tree=$1 label=$2
    echo "=== $label"
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD python3 -m services bench "${@:3}" \
        --output-json "$OUT/$label.json") >"$OUT/$label.log" 2>&1 \
        || { echo "=== $label failed"; tail -20 "$OUT/$label.log"; status=1; }
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for part in $PARTS; do
    case $part in
    tests)  # the new tree's GPU kernel and parity tests
        PYTHONPATH=/tmp/site:$NEW python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider \
            tests/kernels tests/integration/test_gpu_parity.py 2>&1 | tail -5 ;;
    latency)
        for round in $(seq "$ROUNDS"); do
            for tree in old new; do
                dir=$([ $tree = old ] && echo "$OLD" || echo "$NEW")
                bench "$dir" "latency_${tree}_$round" latency "$MODEL" "${COMMON[@]}" \
                    --input-len 128 --output-len 256 --batch-sizes "${BATCH_SIZES[@]}"
            done
        done ;;
    throughput)
        for round in $(seq "$ROUNDS"); do
            for tree in old new; do
                dir=$([ $tree = old ] && echo "$OLD" || echo "$NEW")
                bench "$dir" "throughput_${tree}_$round" throughput "$MODEL" "${COMMON[@]}" \
                    --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
                    --max-num-batched-tokens 8192
            done
        done ;;
    esac
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    data = json.loads(path.read_text())
    if data.get("benchmark") not in ("latency", "throughput"):
        continue  # another script's output in the same folder
    if data["benchmark"] == "latency":
        figures = {f"itl_ms_b{r['batch_size']}": r["itl_ms_median"] for r in data["results"]}
    else:
        figures = {k: data[k] for k in ("output_tok_per_s", "total_tok_per_s", "seconds")}
    print(path.stem, figures)
EOF
exit $status
