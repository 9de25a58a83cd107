#!/usr/bin/env bash
# Issue 49's table on one GPU machine: kvflow and vLLM 0.26 on the same workloads in one run,
# Qwen3-8B shape with dummy weights, in each weight format; then the ratios against the targets
# (python3 -m sweeps.speed_table).
#
#   PARTS="kvflow vllm" FORMATS="bf16 fp8 fp8kv int4" bash scripts/device_speed.sh
#
# Per format: batch-1 decode (128 in / 256 out: the inter-token latency) and `offline` (256
# prompts of 512 in / 256 out, all at once): kvflow's `bench latency` and `bench throughput`,
# vLLM's through sweeps/engine_vllm.py (both workloads in one engine start). The `serve` row
# comes from scripts/device_serve.sh (PARTS="kvflow vllm"). Formats: bf16; fp8 (W8A8 with
# dynamic activation scales: each engine's `--quantization fp8`, each with its own scale
# granularity); fp8kv (bf16 weights,
# `--kv-cache-dtype fp8`); int4 (W4A16 in AWQ's layout, groups of 128: kvflow's
# `--quantization awq` on the bf16 folder, vLLM's on a folder whose config says AWQ).
# Carried as for scripts/device_serve.sh (.whl/, .vwhl/ or .peerW*/, .peer/ and the vLLM parts,
# which device_serve.sh stages and installs).
set -uo pipefail
OUT=${OUT:-$PWD/bench-out}
RESULTS=/tmp/speed-results
mkdir -p "$OUT" "$RESULTS"
PARTS=${PARTS:-"kvflow vllm"}
FORMATS=${FORMATS:-"bf16 fp8 fp8kv int4"}
SITE=/tmp/site
MODEL_DIR=/tmp/qwen3-8b
export PYTHONUNBUFFERED=1
status=0
stage=install-vllm
[[ $PARTS == *vllm* ]] || stage=stash
# The wheels and parts staged (and vLLM installed): a failed install drops vLLM's part only.
if ! OUT=/tmp/speed-stage PARTS=$stage bash scripts/device_serve.sh >"$RESULTS/stage.log" 2>&1; then
    tail -20 "$RESULTS/stage.log"
    [ -f "$SITE/.kvflow-wheels" ] || exit 1
    echo "=== vLLM's install failed: kvflow alone"
    PARTS=${PARTS//vllm/}
    status=1
fi
export PYTHONPATH=$SITE:$PWD

kvflow_flags() {  # FORMAT: kvflow's flags for it
    case $1 in
    bf16) ;;
    fp8) echo --quantization fp8 ;;
    fp8kv) echo --kv-cache-dtype fp8 ;;
    int4) echo --quantization awq ;;
    esac
}

vllm_model() {  # FORMAT: the folder vLLM loads (int4: the config names AWQ's layout)
    [ "$1" = int4 ] || { echo "$MODEL_DIR"; return; }
    local dir=/tmp/qwen3-8b-awq
    mkdir -p $dir && cp "$MODEL_DIR"/* $dir/ || return 1
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); \
c['quantization_config'] = {'quant_method': 'awq', 'bits': 4, 'group_size': 128, \
'zero_point': True, 'version': 'gemm'}; json.dump(c, open(sys.argv[1], 'w'))" $dir/config.json \
        || return 1
    echo $dir
}

kvflow_format() {  # FORMAT
    local flags common=(--load-format dummy --max-model-len 4096 --seed 0)
    read -ra flags <<<"$(kvflow_flags "$1")"
    echo "=== kvflow $1"
    rm -f "$RESULTS/speed_$1_latency_kvflow.json" "$RESULTS/speed_$1_offline_kvflow.json"
    python3 -m services bench latency "$MODEL_DIR" "${common[@]}" "${flags[@]}" \
        --input-len 128 --output-len 256 --batch-sizes 1 \
        --output-json "$RESULTS/speed_$1_latency_kvflow.json" >"$RESULTS/speed_$1_kvflow.log" 2>&1 \
        && python3 -m services bench throughput "$MODEL_DIR" "${common[@]}" "${flags[@]}" \
            --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
            --max-num-batched-tokens 16384 --output-json "$RESULTS/speed_$1_offline_kvflow.json" \
            >>"$RESULTS/speed_$1_kvflow.log" 2>&1 \
        || { echo "=== kvflow $1 failed"; tail -20 "$RESULTS/speed_$1_kvflow.log"; status=1; }
}

vllm_format() {  # FORMAT
    local model args=() script=$PWD/sweeps/engine_vllm.py
    rm -f "$RESULTS/speed_$1_vllm.json"  # a warm machine's earlier run is not this one's
    model=$(vllm_model "$1") || { echo "=== vllm $1: no model folder"; status=1; return; }
    [ "$1" = fp8 ] && args=(--quantization fp8)
    [ "$1" = fp8kv ] && args=(--kv-cache-dtype fp8)
    echo "=== vllm $1"
    # Its own working directory and Python path: it must not import kvflow's packages.
    (cd /tmp && source "$SITE/vllm_env.sh" && PYTHONPATH=$SITE python3 "$script" "$model" \
        "${args[@]}" --out "$RESULTS/speed_$1_vllm.json" >"$RESULTS/speed_$1_vllm.log" 2>&1) \
        || { echo "=== vllm $1 failed"; status=1; }
    grep -E "quantization|KV cache size|Error" "$RESULTS/speed_$1_vllm.log" | head -5
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in $PARTS; do
    for format in $FORMATS; do
        case $part in
        kvflow) kvflow_format "$format" ;;
        vllm) vllm_format "$format" ;;
        *) echo "unknown part $part"; status=1 ;;
        esac
        tar -czf "$OUT/speed-out.tgz" -C "$RESULTS" .  # after each run: a cut-off call keeps it
    done
done
python3 -m sweeps.speed_table "$RESULTS" | tee "$OUT/speed_table.txt"
exit $status
