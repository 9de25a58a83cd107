#!/usr/bin/env bash
# Issue 51 on one machine of N GPUs (N: the machine's count, or N=...): tensor, data and expert
# parallelism and prefill/decode disaggregation, kvflow on N GPUs against one (and against
# vLLM where its bundle was carried), then the ratios against the targets
# (sweeps/multi_gpu_summary.py).
#
#   PARTS="tp dp ep ep-dp pd" bash scripts/device_multi_gpu.sh   # kvflow's runs, then the summary
#   PARTS="tp-vllm ep-vllm summary" bash ...                # vLLM's, after its parts came
#   DRY_RUN=1 N=2 bash scripts/device_multi_gpu.sh          # print the commands only
#
# Carried as for scripts/device_serve.sh (its header): .whl/ and .peer/ in the first call; for
# vLLM the bundle's parts one call each while the machine stays warm (PARTS=stash with .peerV1
# .peerW1, then .peerV2 .peerW2; .peerM, vLLM's MoE library, for ep-vllm), vLLM's parts last.
# A call runs 10 minutes at most: tp, dp, ep and pd are a call each.
# Results: $OUT/multi-gpu/ (every JSON) and $OUT/multi-gpu/summary.txt.
set -uo pipefail
OUT=${OUT:-$PWD/bench-out}
RES=$OUT/multi-gpu
[ "${DRY_RUN:-0}" = 1 ] || mkdir -p "$RES"
N=${N:-$(nvidia-smi -L 2>/dev/null | wc -l)}
PARTS=${PARTS:-"tp dp ep ep-dp pd summary"}
MOE=Qwen3-30B-A3B
COMMON=(--load-format dummy --max-model-len 4096 --seed 0)
OFFLINE=(--num-prompts 256 --input-len 512 --output-len 256 --ignore-eos)
status=0

step() {
    echo "=== $*"
    [ "${DRY_RUN:-0}" = 1 ] && return 0
    "$@" || { echo "=== failed (exit $?): $*"; status=1; }
}

kvflow_moe() {  # NAME FLAGS...: Qwen3-30B-A3B's offline and batch-1 latency
    step python3 -m services bench throughput $MOE "${COMMON[@]}" "${OFFLINE[@]}" \
        --max-num-batched-tokens 16384 "${@:2}" --output-json "$RES/$1.json"
    step python3 -m services bench latency $MOE "${COMMON[@]}" --input-len 128 \
        --output-len 256 --batch-sizes 1 8 "${@:2}" --output-json "$RES/$1_latency.json"
}

vllm_family() {  # FAMILY TAG VLLM_ARGS: sweeps/engine_vllm.py through device_serve.sh
    step env OUT="$RES" FAMILY="$1" VLLM_TAG="$2" VLLM_ARGS="$3" PARTS=family-vllm \
        bash scripts/device_serve.sh
    [ "${DRY_RUN:-0}" = 1 ] || cp /tmp/serve-results/"$1"_vllm"$2".json "$RES/" 2>/dev/null
}

if [ "${DRY_RUN:-0}" != 1 ]; then
    ((N >= 2)) || { echo "issue 51 needs two GPUs or more; this machine has $N"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    [ -d /tmp/qwen3-8b ] || tar -xJf .peer/qwen3-8b.tar.xz -C /tmp || exit 1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for part in $PARTS; do
    case $part in
    tp)  # Llama-3.1-8B on one GPU and on N: batch-1 latency, offline, the all-reduce alone
        step env OUT="$RES" TP="$N" \
            PARTS="tp-tests allreduce latency latency-tp throughput throughput-tp" \
            bash scripts/device_bench.sh ;;
    dp)  # offline at 256 and 1,024 prompts on 1 and N replicas; serve, three saturating loads
        step env OUT="$RES" DP="$N" PARTS=throughput-dp bash scripts/device_bench.sh
        step env OUT="$RES" DP="$N" DP_LOADS="300 301 302" PARTS=dp-load \
            bash scripts/device_serve.sh
        [ "${DRY_RUN:-0}" = 1 ] || cp /tmp/serve-results/dp*_load*.json "$RES/" ;;
    ep)  # one GPU, then N with expert parallelism (its decode steps profiled: the all-reduce)
        kvflow_moe moe_tp1
        kvflow_moe "moe_ep$N" --tensor-parallel-size "$N" --enable-expert-parallel \
            --profile-steps 10 ;;
    ep-dp)  # N replicas, the experts over all of them (attention data parallel): offline only,
        # with CUDA graphs across the replicas and without (what the graphs give)
        for eager in "" --enforce-eager; do
            step python3 -m services bench throughput $MOE "${COMMON[@]}" "${OFFLINE[@]}" \
                --max-num-batched-tokens 16384 --data-parallel-size "$N" \
                --enable-expert-parallel $eager --output-json "$RES/moe_dpep$N${eager:+_eager}.json"
        done ;;
    pd)  # one prefill and one decode replica against two ordinary ones: long prompts and chats
        step python3 -m sweeps.disaggregation /tmp/qwen3-8b --baseline dp --long-fraction 0.25 \
            --long-len 10000 --long-range 0.6 --input-len 256 --max-model-len 20000 \
            --out "$RES/disaggregation.json" ;;
    tp-vllm) vllm_family Llama-3.1-8B "_tp$N" "--tensor-parallel-size $N" ;;
    ep-vllm)
        vllm_family $MOE _tp1 ""
        vllm_family $MOE "_ep$N" "--tensor-parallel-size $N --enable-expert-parallel" ;;
    summary)
        step python3 -m sweeps.multi_gpu_summary "$RES" --gpus "$N"
        [ "${DRY_RUN:-0}" = 1 ] || python3 -m sweeps.multi_gpu_summary "$RES" --gpus "$N" \
            >"$RES/summary.txt" ;;
    stash) ;;  # a call that only brings vLLM's parts (scripts/device_serve.sh copies them)
    *) echo "unknown part $part"; status=1 ;;
    esac
done
exit $status
