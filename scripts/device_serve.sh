#!/usr/bin/env bash
# The `serve` workload on a GPU machine (docs/benchmarks.md): kvflow and vLLM 0.26 side by side,
# measured by the same client (`kvflow bench serve`), Qwen3-8B shape with dummy weights.
#
#   PARTS="probe kvflow" bash scripts/device_serve.sh    # kvflow only
#   PARTS="vllm kvflow" bash scripts/device_serve.sh     # vLLM (installed from .peer/), then kvflow
#   PARTS="structured-kvflow structured-vllm" bash scripts/device_serve.sh
#   PARTS="embed-kvflow embed-vllm" bash scripts/device_serve.sh
#                                     # structured output and embeddings, kvflow and vLLM
#   PARTS="spec-kvflow spec-vllm" bash scripts/device_serve.sh   # speculative decoding
#   FAMILY=gemma-3-12b PARTS="family-kvflow family-vllm" bash scripts/device_serve.sh
#   PARTS=disk-tier bash scripts/device_serve.sh   # the disk tier behind the host tier
#   PARTS=stash bash scripts/device_serve.sh   # only bring what this call carries
#
# Carried: .whl/ and .vwhl/ (wheels the GPU machine lacks: bash scripts/device_wheels.sh),
# .peer/qwen3-8b.tar.xz and, for vLLM, the three vllm_bundle parts with SHA256SUMS and
# install_vllm.sh (copied from the steering repo's peer/ folder), and for MoE models vLLM's MoE
# library (.peerM/vllm_moe_C.tar.xz, about 40 MB: a call of its own). A call carries 64 MiB at most,
# the tree (15 MB) included: .whl/, .vwhl/ and .peer/ in the first call, then one part a call
# (.peerA/, .peerB/, .peerC/), in consecutive calls while the machine is warm; each call leaves
# what it brought in /tmp (/tmp/vwhl, /tmp/vllm-parts), and the first vLLM part installs vLLM
# once all three parts are there.
set -uo pipefail
OUT=${OUT:-$PWD/bench-out}  # gets serve-out.tgz (every JSON, log and plot) and summary.txt
RESULTS=/tmp/serve-results
mkdir -p "$OUT" "$RESULTS"
SITE=/tmp/site
PARTS=${PARTS:-"probe kvflow"}
NUM_PROMPTS=${NUM_PROMPTS:-500}
export PYTHONUNBUFFERED=1
status=0

mkdir -p /tmp/vllm-parts /tmp/vwhl /tmp/gguf-parts
cp .peer*/vllm_bundle.tar.xz.part* .peer*/vllm_moe_C.tar.xz .peer/SHA256SUMS .peer/install_vllm.sh \
    /tmp/vllm-parts/ 2>/dev/null
cp .vwhl/*.whl .peerW*/*.whl /tmp/vwhl/ 2>/dev/null  # .peerW*/: .vwhl/ in parts
cp .peer*/smollm2.gguf.* /tmp/gguf-parts/ 2>/dev/null  # speculative decoding's model, in parts
if [ ! -f "$SITE/.kvflow-wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        .whl/*.whl && touch "$SITE/.kvflow-wheels" || exit 1
fi
MODEL_DIR=/tmp/qwen3-8b
[ -d "$MODEL_DIR" ] || tar -xJf .peer/qwen3-8b.tar.xz -C /tmp || exit 1
export PYTHONPATH=$SITE:$PWD

run() {
    echo "=== $1: ${*:2}"
    "${@:2}" || { echo "=== $1 failed (exit $?)"; status=1; }
}

wait_healthy() {  # URL PID: URL answers 200 once the server is ready
    local start=$SECONDS
    until curl -sf "$1" >/dev/null; do
        kill -0 "$2" 2>/dev/null || { echo "server exited during startup"; return 1; }
        ((SECONDS - start < 400)) || { echo "not ready after 400 s"; return 1; }
        sleep 0.5
    done
    echo "ready after $((SECONDS - start)) s"
}

# The `serve` workload: 200 prompt tokens (random ids, fresh per run), 200 output tokens.
bench() {  # NAME PORT
    local common=(--port "$2" --tokenizer "$MODEL_DIR" --random-input-len 200
        --random-output-len 200 --ignore-eos --disable-tqdm)
    run "$1 first request" python3 -m services bench serve "${common[@]}" --num-prompts 1 \
        --num-warmups 0 --seed 100 --output-json "$RESULTS/$1_first.json"
    run "$1 single stream" python3 -m services bench serve "${common[@]}" --num-prompts 40 \
        --max-concurrency 1 --seed 200 --output-json "$RESULTS/$1_single.json"
    run "$1 load" python3 -m services bench serve "${common[@]}" --num-prompts "$NUM_PROMPTS" \
        --request-rate 16,inf --seed 300 --save-detailed --plot "$RESULTS/plots_$1" \
        --output-json "$RESULTS/$1_load.json"
}

# The `prefix` workload: one shared 2048-token prefix + 64 tokens of each request's own.
bench_prefix() {  # NAME PORT
    run "$1 prefix" python3 -m services bench serve --port "$2" --tokenizer "$MODEL_DIR" \
        --dataset-name prefix-repetition --prefix-repetition-prefix-len 2048 \
        --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 1 \
        --prefix-repetition-output-len 64 --num-prompts 200 --request-rate 8 --ignore-eos \
        --seed 400 --disable-tqdm --output-json "$RESULTS/$1_prefix.json"
}

serve_kvflow() {  # NAME WORKLOADS [FLAGS...]
    local start=$SECONDS
    python3 -m services serve "$MODEL_DIR" --load-format dummy --max-model-len 4096 \
        --port 8100 "${@:3}" >"$RESULTS/$1_serve.log" 2>&1 &
    local pid=$!
    if wait_healthy http://127.0.0.1:8100/ready $pid; then
        echo "$1 start to ready: $((SECONDS - start)) s"
        [[ $2 == *serve* ]] && bench "$1" 8100
        [[ $2 == *prefix* ]] && bench_prefix "$1" 8100
        [[ $2 == *structured* ]] && bench_structured "$1" 8100
    fi
    kill -INT $pid; wait $pid
}

# Structured output (issue 45): 160 requests of 200 random prompt tokens and at most 200 out,
# 32 in flight, temperature 1; plain (ignoring EOS), then with the 20-field JSON Schema of
# sweeps/grammar_bench.py as `response_format` (a constrained answer ends where its JSON
# closes), alternated twice; then 16 answers checked against the schema.
bench_structured() {  # NAME PORT
    local common=(--port "$2" --tokenizer "$MODEL_DIR" --random-input-len 200
        --random-output-len 200 --num-prompts 160 --max-concurrency 32 --temperature 1
        --disable-tqdm)
    local schema
    schema=$(python3 -c "import json; from sweeps.grammar_bench import extra_body; print(json.dumps(extra_body()))")
    for round in 1 2; do
        run "$1 plain $round" python3 -m services bench serve "${common[@]}" --ignore-eos \
            --seed "6$round" --output-json "$RESULTS/$1_structured_plain_$round.json"
        run "$1 json $round" python3 -m services bench serve "${common[@]}" --seed "7$round" \
            --extra-body "$schema" --output-json "$RESULTS/$1_structured_json_$round.json"
    done
    run "$1 schema check" python3 -m sweeps.grammar_bench --check "http://127.0.0.1:$2" \
        --out "$RESULTS/$1_structured_check.json"
}

# Embeddings (issue 45): a Qwen3-Embedding-0.6B-shaped model (last token, normalized), 256
# random tokens a prompt; one prompt a request (256 in flight), then 32 a request.
EMBED_DIR=/tmp/qwen3-embedding-0.6b
bench_embed() {  # NAME PORT
    local common=(--backend openai-embeddings --endpoint /v1/embeddings --port "$2"
        --tokenizer "$EMBED_DIR" --random-input-len 256 --disable-tqdm)
    for round in 1 2; do
        run "$1 embed single $round" python3 -m services bench serve "${common[@]}" \
            --num-prompts 8000 --max-concurrency 256 --seed "8$round" \
            --output-json "$RESULTS/$1_embed_single_$round.json"
        run "$1 embed batch $round" python3 -m services bench serve "${common[@]}" \
            --num-prompts 16000 --random-batch-size 32 --max-concurrency 16 --seed "9$round" \
            --output-json "$RESULTS/$1_embed_batch_$round.json"
    done
}

serve_embed_kvflow() {
    python3 -m sweeps.embedding_model "$MODEL_DIR" "$EMBED_DIR" || return 1
    local start=$SECONDS
    python3 -m services serve "$EMBED_DIR" --task embed --load-format dummy \
        --max-model-len 4096 --port 8100 >"$RESULTS/kvflow_embed_serve.log" 2>&1 &
    local pid=$!
    wait_healthy http://127.0.0.1:8100/ready $pid \
        && echo "kvflow embed start to ready: $((SECONDS - start)) s" && bench_embed kvflow 8100
    kill -INT $pid; wait $pid
}

triton_kernels() {  # each compiled Triton kernel in the cache: its name and constants, sorted
    python3 - <<'PY'
import json, os, pathlib
root = pathlib.Path(os.environ.get("TRITON_CACHE_DIR", pathlib.Path.home() / ".triton/cache"))
for path in root.glob("*/*.json"):
    if path.name.startswith("__grp__"):
        continue
    meta = json.loads(path.read_text())
    print(path.parent.name[:12], meta.get("name"), meta.get("num_warps"), meta.get("num_stages"))
PY
}

# Data parallelism (issue 16): REPLICAS engines, each on GPUs of its own, the `serve` load at
# full rate (all at once: one replica saturates) and the `prefix-many` workload (32 prefixes of
# 1024 tokens, so a replica holds only the prefixes routed to it), the server's prefix-cache
# counters read before and after.
serve_dp() {  # NAME REPLICAS ROUTING WORKLOADS
    local start=$SECONDS url=http://127.0.0.1:8100
    # SERVE_FLAGS: more serve flags, e.g. --api-server-count 4 (the same frontends for every
    # replica count; by default serve starts one frontend at DP=1 and two per replica above)
    # shellcheck disable=SC2086
    python3 -m services serve "$MODEL_DIR" --load-format dummy --max-model-len 4096 \
        --port 8100 --data-parallel-size "$2" --data-parallel-routing "$3" ${SERVE_FLAGS:-} \
        >"$RESULTS/$1_serve.log" 2>&1 &
    local pid=$!
    if wait_healthy $url/ready $pid; then
        echo "$1 start to ready: $((SECONDS - start)) s"
        local common=(--port 8100 --tokenizer "$MODEL_DIR" --ignore-eos --disable-tqdm)
        # Twice: the first load meets a fresh server (first-use compiles), the second not;
        # other prompts (seed), or the second would find them all in the prefix cache.
        # The Triton kernels each load compiled (first use), listed after it.
        # DP_LOADS: the loads' seeds (issue 51 asks for the mean of three: "300 301 302")
        for seed in ${DP_LOADS:-300 301}; do
            local load=load_$seed
            [[ $seed == 300 ]] && load=load
            [[ $seed == 301 ]] && load=load_again
            triton_kernels >"$RESULTS/$1_triton_before_$load.txt"
            # Each process's CPU share while the load runs: which one keeps the GPUs waiting.
            # Every request's timings too (--save-detailed): which requests start late.
            top -b -c -d 1 -n 30 -w 300 | grep -E --line-buffered "^top -|python" \
                >"$RESULTS/$1_top_$load.txt" &
            local top_pid=$!
            [[ $4 == *serve* ]] && run "$1 $load" timeout 240 python3 -m services bench serve \
                "${common[@]}" --random-input-len 200 --random-output-len 200 \
                --num-prompts "$NUM_PROMPTS" --request-rate inf --seed $seed --save-detailed \
                --output-json "$RESULTS/$1_$load.json"
            kill $top_pid 2>/dev/null
            # prompt tokens each replica has taken so far: the router's split, load by load
            curl -s $url/metrics | grep "prefix_cache_queries_total{" | tee "$RESULTS/$1_split_$load.txt"
            triton_kernels | comm -13 "$RESULTS/$1_triton_before_$load.txt" - \
                | tee "$RESULTS/$1_triton_compiled_$load.txt"
        done
        curl -s $url/metrics >"$RESULTS/$1_metrics_before.txt"
        [[ $4 == *prefix* ]] && run "$1 prefix-many" timeout 120 python3 -m services bench \
            serve "${common[@]}" --dataset-name prefix-repetition --prefix-repetition-prefix-len 1024 \
            --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 32 \
            --prefix-repetition-output-len 32 --num-prompts 256 --request-rate 16 --seed 500 \
            --output-json "$RESULTS/$1_prefix_many.json"
        curl -s $url/metrics >"$RESULTS/$1_metrics_after.txt"
        grep -E "prefix_cache_(hits|queries)_total\{" "$RESULTS/$1_metrics_after.txt"
    fi
    kill -INT $pid; wait $pid
    tar -czf "$OUT/serve-out.tgz" -C "$RESULTS" .  # the logs too, should a later run hang
}

install_vllm() {
    if [ ! -f "$SITE/vllm_env.sh" ]; then
        # vLLM's dependencies that neither the machine nor the bundle has (.vwhl/, kept in
        # /tmp/vwhl by an earlier call), first: install_vllm.sh must come last (a later
        # pip --target would drop its bin/vllm).
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            /tmp/vwhl/*.whl || return 1
        (cd /tmp/vllm-parts && VLLM_SKIP_SMOKE=1 bash install_vllm.sh "$SITE") || return 1
    fi
    # vLLM's MoE library, which the three parts leave out (the steering repo's
    # peer/make_moe_part.sh writes it; carried alone as .peerM/, kept in /tmp/vllm-parts)
    if [ -f /tmp/vllm-parts/vllm_moe_C.tar.xz ] && [ ! -f "$SITE/vllm/_moe_C_stable_libtorch.abi3.so" ]; then
        tar -xJf /tmp/vllm-parts/vllm_moe_C.tar.xz -C "$SITE" || return 1
    fi
    (cd /tmp && PYTHONPATH=$SITE python3 -c "import vllm.entrypoints.openai.api_server")
}

vllm_part() {  # NAME MODEL WORKLOAD_FUNCTION [SERVE FLAGS...]: one vLLM server, its workload
    install_vllm || return 1
    local start=$SECONDS
    # Its own working directory and Python path: it must not import kvflow's packages.
    (cd /tmp && source "$SITE/vllm_env.sh" && PYTHONPATH=$SITE exec vllm serve "$2" \
        --load-format dummy --max-model-len 4096 --served-model-name m --port 8200 "${@:4}" \
        >"$RESULTS/$1_serve.log" 2>&1) &
    local pid=$!
    # vLLM has no /ready: /health answers once its engine is up
    wait_healthy http://127.0.0.1:8200/health $pid \
        && echo "$1 start to ready: $((SECONDS - start)) s" && "$3" vllm 8200
    kill -INT $pid; wait $pid
    sleep 5
}

# Speculative decoding (issue 46) on a real model: the embedded SmolLM2-135M-Instruct GGUF,
# carried in parts (.peerG*/smollm2.gguf.part*, with smollm2.gguf.sha256) and written out as a
# bf16 folder; the prompts of sweeps/spec_acceptance.py (2 x SPEC_PROMPTS), one at a time and
# 16 at a time.
SPEC_MODEL=/tmp/smollm2-bf16
spec_model() {
    [ -d $SPEC_MODEL ] && return 0
    cat /tmp/gguf-parts/smollm2.gguf.part* >/tmp/smollm2.gguf
    (cd /tmp && sha256sum -c gguf-parts/smollm2.gguf.sha256) || return 1
    python3 -m sweeps.smollm2_folder $SPEC_MODEL --gguf /tmp/smollm2.gguf
}

spec_kvflow() {  # n-gram with 4 and 8 drafts, suffix, and the GGUF drafting its bf16 folder
    spec_model || return 1
    local ngram='{"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2'
    run spec-kvflow python3 -m sweeps.spec_acceptance $SPEC_MODEL --batch 1 --batch 16 \
        --num-prompts "${SPEC_PROMPTS:-24}" --prompts-out "$RESULTS/spec_prompts.json" \
        --config "$ngram, \"num_speculative_tokens\": 4}" \
        --config "$ngram, \"num_speculative_tokens\": 8}" \
        --config '{"method": "suffix", "num_speculative_tokens": 8}' \
        --config '{"method": "draft_model", "model": "/tmp/smollm2.gguf", "num_speculative_tokens": 4}' \
        --out "$RESULTS/spec_kvflow.json"
}

spec_vllm() {  # the same prompts (spec_kvflow's file), from outside the checkout
    install_vllm && spec_model || return 1
    local script=$PWD/sweeps/spec_acceptance_vllm.py
    # No suffix config: vLLM's needs arctic-inference, which its bundle lacks.
    local ngram='{"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2'
    (cd /tmp && source "$SITE/vllm_env.sh" && PYTHONPATH=$SITE python3 "$script" $SPEC_MODEL \
        "$RESULTS/spec_prompts.json" --batch 1 --batch 16 --out "$RESULTS/spec_vllm.json" \
        --config "$ngram, \"num_speculative_tokens\": 4}" \
        --config "$ngram, \"num_speculative_tokens\": 8}")
}

# A model family against vLLM (issue 50): FAMILY's preset (shared/presets/), dummy weights,
# batch-1 latency (128 in / 256 out) and `offline` (256 x 512 / 256), each engine at its
# default --gpu-memory-utilization; vLLM reads the preset as a folder's config.json, with the
# Qwen3-8B folder's tokenizer (random token ids, no detokenisation).
FAMILY=${FAMILY:-gemma-3-12b}
VLLM_ARGS=${VLLM_ARGS:-}  # more sweeps/engine_vllm.py flags, e.g. --tensor-parallel-size 2
VLLM_TAG=${VLLM_TAG:-}  # a suffix of its result's name, for several runs of one family
family_kvflow() {
    local common=(--load-format dummy --max-model-len 4096 --seed 0)
    run "$FAMILY latency" python3 -m services bench latency "$FAMILY" "${common[@]}" \
        --input-len 128 --output-len 256 --profile-steps 20 \
        --output-json "$RESULTS/${FAMILY}_latency_kvflow.json"
    run "$FAMILY offline" python3 -m services bench throughput "$FAMILY" "${common[@]}" \
        --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
        --max-num-batched-tokens 16384 --output-json "$RESULTS/${FAMILY}_offline_kvflow.json"
}

family_vllm() {
    install_vllm || return 1
    local dir=/tmp/$FAMILY script=$PWD/sweeps/engine_vllm.py
    mkdir -p "$dir" && cp "shared/presets/$FAMILY.json" "$dir/config.json"
    cp "$MODEL_DIR"/tokenizer*.json "$dir/"
    local name=${FAMILY}_vllm$VLLM_TAG
    # shellcheck disable=SC2086
    (cd /tmp && source "$SITE/vllm_env.sh" && PYTHONPATH=$SITE python3 "$script" "$dir" \
        $VLLM_ARGS --out "$RESULTS/$name.json" >"$RESULTS/$name.log" 2>&1)
    local rc=$?
    grep -E "KV cache size|Maximum concurrency|Error|error" "$RESULTS/$name.log" | head -20
    tail -3 "$RESULTS/$name.log"
    return $rc
}

# The disk tier behind the host tier (issue 48): `kvflow bench multi-turn` with a host tier too
# small for the histories (4 GiB, some 28,000 Qwen3-8B tokens of the ~100,000 the last turn
# resends), without and then with a disk tier behind it. The device's page cache holds the
# files: reads measure the path through files, not the disk's own speed.
disk_tier() {
    local common=(--load-format dummy --max-model-len 8192 --num-gpu-blocks-override 2000
        --conversations 32 --turns 5 --first-len 2000 --turn-len 200 --output-len 64
        --kv-offloading-size 4)
    run "multi-turn host 4 GiB" python3 -m services bench multi-turn Qwen3-8B "${common[@]}" \
        --output-json "$RESULTS/multi_turn_host4.json"
    rm -rf /tmp/kv-disk
    run "multi-turn host 4 GiB + disk" python3 -m services bench multi-turn Qwen3-8B \
        "${common[@]}" --kv-offloading-disk-path /tmp/kv-disk --kv-offloading-disk-size 32 \
        --output-json "$RESULTS/multi_turn_host4_disk.json"
    du -sh /tmp/kv-disk
}

bench_serve_and_prefix() {  # NAME PORT
    bench "$1" "$2" && bench_prefix "$1" "$2"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in $PARTS; do
    case $part in
    tests)  # -n 0: one process (three on one GPU: one met a device-side assert, 2026-12-05)
        run tests python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider tests/kernels \
            tests/integration/test_gpu_parity.py tests/integration/test_gpu_graphs.py \
            tests/integration/test_pipelined_engine.py tests/integration/test_kv_handover_cuda.py \
            tests/integration/test_eagle3.py tests/integration/test_gpu_speculative.py \
            tests/integration/test_sliding_window_kv.py ;;
    probe)
        run probe python3 -m sweeps.step_mix Qwen3-8B --batch 32 --prompt-len 200 \
            --output-json "$RESULTS/step_mix.json" ;;
    kvflow) serve_kvflow kvflow serve,prefix ;;
    grammar)  # the host's cost of the 20-field schema: check, matcher start, a step's masks
        run grammar python3 -m sweeps.grammar_bench "$MODEL_DIR" --out "$RESULTS/grammar.json" ;;
    structured-kvflow) serve_kvflow kvflow structured ;;
    embed-kvflow) serve_embed_kvflow ;;
    # Structured output and embeddings on vLLM, each a part of its own: a vLLM start on a
    # fresh machine compiles for a minute or two, and both in one call pass a call's 10 minutes.
    structured-vllm) vllm_part vllm_structured "$MODEL_DIR" bench_structured ;;
    embed-vllm)
        python3 -m sweeps.embedding_model "$MODEL_DIR" "$EMBED_DIR" || { status=1; continue; }
        vllm_part vllm_embed "$EMBED_DIR" bench_embed --runner pooling --convert embed ;;
    dp)  # one replica, then DP replicas routed by prefix, then DP replicas in turn
        serve_dp dp1 1 prefix serve,prefix
        serve_dp "dp${DP:-2}" "${DP:-2}" prefix serve,prefix
        serve_dp "dp${DP:-2}_round_robin" "${DP:-2}" round-robin prefix ;;
    dp-prefix)  # the prefix-many load alone: DP replicas by prefix, then in turn
        serve_dp "dp${DP:-2}" "${DP:-2}" prefix prefix
        serve_dp "dp${DP:-2}_round_robin" "${DP:-2}" round-robin prefix ;;
    dp-load)  # the serve load alone: one replica, then DP replicas
        serve_dp dp1 1 prefix serve
        serve_dp "dp${DP:-2}" "${DP:-2}" prefix serve ;;
    kvflow-no-prefix-cache) serve_kvflow kvflow_nocache prefix --no-enable-prefix-caching ;;
    vllm) vllm_part vllm "$MODEL_DIR" bench_serve_and_prefix ;;
    offline-kvflow)  # 256 x 512 in / 256 out, all at once; then prompts only (the prefill share)
        for budget in 8192 16384; do
            run "offline-kvflow $budget" python3 -m services bench throughput "$MODEL_DIR" \
                --load-format dummy --max-model-len 4096 --seed 0 --num-prompts 256 \
                --input-len 512 --output-len 256 --ignore-eos --max-num-batched-tokens $budget \
                --profile-steps 20 --output-json "$RESULTS/offline_kvflow_$budget.json"
        done
        run "offline-kvflow prompts only" python3 -m services bench throughput "$MODEL_DIR" \
            --load-format dummy --max-model-len 4096 --seed 0 --num-prompts 256 \
            --input-len 512 --output-len 1 --ignore-eos --max-num-batched-tokens 8192 \
            --output-json "$RESULTS/offline_kvflow_prompts_only.json" ;;
    offline-vllm)  # the same; vLLM's bench samples at temperature 1 and always ignores EOS
        install_vllm || { status=1; continue; }
        (cd /tmp && source "$SITE/vllm_env.sh" && PYTHONPATH=$SITE vllm bench throughput \
            --model "$MODEL_DIR" --load-format dummy --max-model-len 4096 --num-prompts 256 \
            --dataset-name random --random-input-len 512 --random-output-len 256 \
            --output-json "$RESULTS/offline_vllm.json" >"$RESULTS/offline_vllm.log" 2>&1)
        tail -5 "$RESULTS/offline_vllm.log" ;;
    sweep-qwen3)  # the decode linear layers at 1..64 rows: Triton tiles against cuBLAS
        run sweep-qwen3 python3 -m sweeps.linear_sweep --model qwen3 --m 1 16 32 48 64 \
            --step-m 32 64 --out "$RESULTS/linear_sweep_qwen3.json" ;;
    offline-long-kvflow)  # 1000 requests, lengths U[100, 1024] in and out: KV pressure
        for seqs in 256 1024; do  # kvflow's default, and vLLM's offline default on an H100
            run "offline-long-kvflow $seqs" python3 -m services bench throughput "$MODEL_DIR" \
                --load-format dummy --max-model-len 4096 --seed 0 --num-prompts 1000 \
                --input-len 100:1024 --output-len 100:1024 --ignore-eos \
                --max-num-batched-tokens 16384 --max-num-seqs $seqs \
                --output-json "$RESULTS/offline_long_kvflow_$seqs.json"
        done ;;
    offline-long-vllm)  # the same distribution: 562 +- 82.2 %
        install_vllm || { status=1; continue; }
        (cd /tmp && source "$SITE/vllm_env.sh" && PYTHONPATH=$SITE vllm bench throughput \
            --model "$MODEL_DIR" --load-format dummy --max-model-len 4096 --num-prompts 1000 \
            --dataset-name random --random-input-len 562 --random-output-len 562 \
            --random-range-ratio 0.822 --output-json "$RESULTS/offline_long_vllm.json" \
            >"$RESULTS/offline_long_vllm.log" 2>&1)
        tail -5 "$RESULTS/offline_long_vllm.log" ;;
    stash) ;;  # a call that only brings parts (kept in /tmp while the machine stays warm)
    install-vllm) run install-vllm install_vllm ;;  # once all three parts are in /tmp
    family-kvflow) family_kvflow ;;
    family-vllm) run family-vllm family_vllm ;;
    disk-tier) disk_tier ;;
    disaggregation-cuda)  # the handed-over KV in GPU memory, read by CUDA IPC, against one engine
        run disaggregation-cuda python3 -m sweeps.disaggregation "$MODEL_DIR" --num-prompts 24 \
            --kv-buffer-devices cuda --out "$RESULTS/disaggregation_cuda.json" ;;
    spec-kvflow) spec_kvflow || status=1 ;;
    spec-vllm) run spec-vllm spec_vllm ;;
    *) echo "unknown part $part"; status=1 ;;
    esac
    tar -czf "$OUT/serve-out.tgz" -C "$RESULTS" .  # after each part: a cut-off call keeps it
done
{
python3 - "$RESULTS" <<'PY'
import json, pathlib, sys
def ms(run, key):  # a run whose requests all failed has no latencies; embeddings no TTFT
    return "-" if run.get(key) is None else f"{run[key]:.1f}"
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    data = json.loads(path.read_text())
    runs = data.get("runs") if isinstance(data, dict) else None
    for run in runs if isinstance(runs, list) else []:  # bench serve's files only
        print(f"{path.stem:16} rate={run['request_rate']!s:5} ok={run['completed']} "
              f"fail={run['failed']} req/s={run['request_throughput']:.2f} "
              f"TTFT med/p99={ms(run, 'median_ttft_ms')}/{ms(run, 'p99_ttft_ms')} "
              f"TPOT med/p99={ms(run, 'median_tpot_ms')}/{ms(run, 'p99_tpot_ms')} "
              f"ITL p99={ms(run, 'p99_itl_ms')} E2EL med={ms(run, 'median_e2el_ms')} "
              f"tok/s={run['total_token_throughput']:.0f}")
PY
} | tee "$OUT/summary.txt"
tar -czf "$OUT/serve-out.tgz" -C "$RESULTS" .
exit $status
