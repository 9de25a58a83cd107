#!/usr/bin/env bash
# Issue 47's table on one GPU machine: Qwen3-30B-A3B (dummy weights) in kvflow and vLLM 0.26,
# bf16 and FP8, batch-1 and batch-8 latency and `offline`; one layer of each engine's experts
# side by side; gpt-oss-20b `offline` with MXFP4 and bf16 experts; the MoE kernel tests; each
# engine's kernel times over FP8 `offline` (kvflow-profile, vllm-profile).
#
#   PARTS=stash bash scripts/device_moe.sh             # a call that only brings vLLM's parts
#   PARTS="tests kvflow" FORMATS="bf16 fp8" bash scripts/device_moe.sh
#   PARTS="install-vllm vllm layer" bash scripts/device_moe.sh   # once all of vLLM is there
#   PARTS="kvflow-profile vllm-profile" bash scripts/device_moe.sh   # each engine's FP8 kernels
#   PARTS=vllm-routing bash scripts/device_moe.sh      # the experts vLLM's decode steps chose
#   PARTS=gpt-oss bash scripts/device_moe.sh
#   PARTS="b1-profile gemv-sweep" bash scripts/device_moe.sh   # batch 1's kernels; GEMV tiles
#   DRY_RUN=1 bash scripts/device_moe.sh               # print the commands only
#
# Carried as for scripts/device_serve.sh (its header): .whl/ and .peer/ first, then one of
# vLLM's parts a call (.peerV0-2, .vwhl in parts as .peerW1-2), then vLLM's MoE library
# (.peerM/vllm_moe_C.tar.xz, about 40 MB: with nothing else but the tree), in consecutive calls
# while the machine stays warm; each call's stash keeps them in /tmp. A call runs 10 minutes
# at most: kvflow's two formats take about 4, vLLM's two about 5.
# Results: $OUT/moe/ (every JSON and log).
set -uo pipefail
OUT=${OUT:-$PWD/bench-out}
RES=$OUT/moe
[ "${DRY_RUN:-0}" = 1 ] || mkdir -p "$RES"
PARTS=${PARTS:-"tests kvflow"}
FORMATS=${FORMATS:-"bf16 fp8"}
MOE=Qwen3-30B-A3B
COMMON=(--load-format dummy --max-model-len 4096 --seed 0)
OFFLINE=(--num-prompts 256 --input-len 512 --output-len 256 --ignore-eos
    --max-num-batched-tokens 16384)
# vLLM's own dummy weights route a decode step's tokens to a few experts (docs/benchmarks.md,
# mixture of experts): its timed MoE runs draw them as kvflow does, unless VLLM_DUMMY says
# otherwise; vllm-routing reports the experts a step chose with either kind of dummy weights.
VLLM_DUMMY=${VLLM_DUMMY-"--dummy-weights normal"}
status=0

step() {  # LOG COMMAND...: run it, its output to $RES/LOG
    echo "=== $(date +%T) ${*:2}"
    [ "${DRY_RUN:-0}" = 1 ] && return 0
    "${@:2}" >"$RES/$1" 2>&1 || { echo "=== failed (exit $?)"; tail -20 "$RES/$1"; status=1; }
}

format_flags() {  # FORMAT: the engines' flags for it
    [ "$1" = fp8 ] && echo --quantization fp8
}

if [ "${DRY_RUN:-0}" != 1 ]; then
    # Stage what this call carries (and the wheels, once): scripts/device_serve.sh's stash.
    OUT=/tmp/moe-stage PARTS=stash bash scripts/device_serve.sh >/dev/null 2>&1 || exit 1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for part in $PARTS; do
    case $part in
    stash) ;;
    tests)
        step kernel_tests.log python3 -m pytest -q -n 0 -p no:cacheprovider \
            tests/kernels/test_triton_moe.py tests/kernels/test_triton_moe_int4.py \
            tests/kernels/test_triton_moe_mxfp4.py
        [ "${DRY_RUN:-0}" = 1 ] || tail -3 "$RES/kernel_tests.log" ;;
    kvflow)
        for format in $FORMATS; do
            read -ra flags <<<"$(format_flags "$format")"
            step "latency_$format.log" python3 -m services bench latency $MOE "${COMMON[@]}" \
                "${flags[@]}" --input-len 128 --output-len 256 --batch-sizes 1 8 \
                --output-json "$RES/latency_$format.json"
            step "offline_$format.log" python3 -m services bench throughput $MOE \
                "${COMMON[@]}" "${OFFLINE[@]}" "${flags[@]}" --output-json "$RES/offline_$format.json"
        done ;;
    install-vllm)
        step install_vllm.log env OUT=/tmp/moe-stage PARTS=install-vllm bash scripts/device_serve.sh ;;
    vllm)  # sweeps/engine_vllm.py: batch 1, then `offline`, in one engine start
        for format in $FORMATS; do
            step "vllm_$format.log" env OUT="$RES" FAMILY=$MOE VLLM_TAG="_$format" \
                VLLM_ARGS="$(format_flags "$format") $VLLM_DUMMY" PARTS=family-vllm \
                bash scripts/device_serve.sh
            [ "${DRY_RUN:-0}" = 1 ] || cp /tmp/serve-results/${MOE}_vllm_"$format".* "$RES/"
        done ;;
    vllm-profile)  # vLLM's FP8 `offline` timed, then once more under its torch profiler
        [ "${DRY_RUN:-0}" = 1 ] || rm -rf /tmp/vllm-profile
        step vllm_profile.log env OUT="$RES" FAMILY=$MOE VLLM_TAG=_fp8_profiled \
            VLLM_ARGS="--quantization fp8 --skip-latency --profile-dir /tmp/vllm-profile $VLLM_DUMMY" \
            PARTS=family-vllm bash scripts/device_serve.sh
        [ "${DRY_RUN:-0}" = 1 ] || cp /tmp/serve-results/${MOE}_vllm_fp8_profiled.* \
            /tmp/vllm-profile/profiler_out_*.txt "$RES/" || status=1 ;;
    vllm-routing)  # the experts a decode step chose, FP8, vLLM's dummy weights and kvflow's
        for weights in vllm normal; do
            step "vllm_routing_$weights.log" env OUT="$RES" FAMILY=$MOE \
                VLLM_TAG="_fp8_routing_$weights" PARTS=family-vllm VLLM_ARGS="--quantization fp8 \
                --skip-latency --routing-report --dummy-weights $weights" bash scripts/device_serve.sh
            [ "${DRY_RUN:-0}" = 1 ] ||
                cp /tmp/serve-results/${MOE}_vllm_fp8_routing_"$weights".* "$RES/" || status=1
        done ;;
    kvflow-profile)  # kvflow's FP8 `offline`, profiled without PDL (each kernel's own time)
        step offline_fp8_profile.log python3 -m services bench throughput $MOE "${COMMON[@]}" \
            "${OFFLINE[@]}" --quantization fp8 --disable-pdl --profile-steps 10 --profile-run \
            --output-json "$RES/offline_fp8_profile.json" ;;
    b1-profile)  # batch 1's decode steps, each kernel's own time (no PDL), both formats
        for format in $FORMATS; do
            read -ra flags <<<"$(format_flags "$format")"
            step "latency_b1_${format}_profile.log" python3 -m services bench latency $MOE \
                "${COMMON[@]}" "${flags[@]}" --input-len 128 --output-len 256 --batch-sizes 1 \
                --disable-pdl --profile-steps 20 --output-json "$RES/latency_b1_${format}_profile.json"
        done ;;
    gemv-sweep)  # the MoE GEMV kernels' tiles at 1-4 tokens, FP8 and bf16 experts
        step gemv_sweep_fp8.log python3 -m sweeps.moe_gemv_sweep --fp8 --batch-sizes 1 2 4 \
            --out "$RES/gemv_sweep_fp8.json"
        step gemv_sweep_bf16.log python3 -m sweeps.moe_gemv_sweep --batch-sizes 1 2 4 \
            --out "$RES/gemv_sweep_bf16.json" ;;
    layer)  # one layer's routing and experts, both engines, bf16 and FP8 (vLLM importable)
        step layer.log python3 -m services bench moe --peer vllm \
            --fp8 --batch-sizes 1 8 64 256 1024 4096 16384 --output-json "$RES/layer.json" ;;
    gpt-oss)
        for flags in "" "--quantization mxfp4"; do
            name=offline_gpt_oss_$([ -n "$flags" ] && echo mxfp4 || echo bf16)
            # shellcheck disable=SC2086
            step "$name.log" python3 -m services bench throughput gpt-oss-20b "${COMMON[@]}" \
                "${OFFLINE[@]}" $flags --output-json "$RES/$name.json"
        done ;;
    *) echo "unknown part $part"; status=1 ;;
    esac
done
exit $status
