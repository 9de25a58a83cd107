#!/usr/bin/env bash
# The whole GPU run in one call (see docs/benchmarks.md): carried wheels, the GPU kernel tests,
# kvflow's benchmarks, the transformers peer on the same prompts, then the summary table.
#
#   bash scripts/device_bench.sh                      # every part
#   PARTS="tests latency" bash scripts/device_bench.sh
#
# Needs .whl/ with msgspec and gguf wheels for the device's Python (carried by the device tool).
set -uo pipefail
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
MODEL=${MODEL:-Llama-3.1-8B}
SMALL_MODEL=${SMALL_MODEL:-Qwen3-0.6B}
PARTS=${PARTS:-"tests floors latency throughput small attention throughput-2048 sweep peer"}
COMMON=(--load-format dummy --max-model-len 4096 --seed 0)
GGUF_FILE=${GGUF_FILE:-/tmp/llama-3.1-8b-q4_k_m.gguf}
FP8_BLOCK_MODEL=${FP8_BLOCK_MODEL:-/tmp/llama-3.1-8b-fp8-block}
FP8_STATIC_MODEL=${FP8_STATIC_MODEL:-/tmp/llama-3.1-8b-fp8-static}
LORA_DIR=${LORA_DIR:-/tmp/loras}
TP=${TP:-2}  # the tensor-parallel parts' ranks: one GPU each
DP=${DP:-2}  # the data-parallel part's engine replicas: one GPU each
status=0

run() {
    echo "=== $1: ${*:2}"
    "${@:2}" || { echo "=== $1 failed (exit $?)"; status=1; }
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for part in $PARTS; do
    case $part in
    tests)
        run tests python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider tests/kernels \
            tests/integration/test_gpu_parity.py ;;
    floors)
        run floors python3 -m services bench floors --output-json "$OUT/floors.json" ;;
    attention)
        run attention python3 -m services bench attention --output-json "$OUT/attention.json" ;;
    attention-fp8)  # the same with an e4m3 cache (issue 13), GB/s counted in FP8 bytes
        run attention-fp8 python3 -m services bench attention --kv-cache-dtype fp8 \
            --output-json "$OUT/attention_fp8.json" ;;
    latency-kv-fp8)  # --kv-cache-dtype fp8: the pool's size and the step time
        run latency-kv-fp8 python3 -m services bench latency "$MODEL" "${COMMON[@]}" \
            --kv-cache-dtype fp8 --input-len 128 --output-len 256 --profile-steps 20 \
            --output-json "$OUT/latency_kv_fp8.json" ;;
    attention-sweep)  # decode attention launch configs, bf16 and FP8 caches (issue 13)
        run attention-sweep python3 -m sweeps.attention_sweep \
            --out "$OUT/attention_sweep.json" ;;
    prefill-attention)  # prefill attention tiles against PyTorch's FlashAttention-2 and cuDNN
        run prefill-attention python3 -m sweeps.prefill_attention_sweep \
            --out "$OUT/prefill_attention_sweep.json" ;;
    overlap)  # decode attention and linear layers on two streams at once: do they overlap?
        run overlap python3 -m sweeps.overlap_probe --out "$OUT/overlap.json" ;;
    sweep)  # decode GEMV tiles against cuBLAS at the Llama-3.1-8B shapes, 1 to 64 rows
        run sweep python3 -m sweeps.linear_sweep --m 1 4 8 16 32 48 64 \
            --step-m 1 4 16 32 64 --out "$OUT/linear_sweep.json" ;;
    latency)
        run latency python3 -m services bench latency "$MODEL" "${COMMON[@]}" \
            --input-len 128 --output-len 256 --profile-steps 20 \
            --output-json "$OUT/latency.json" ;;
    throughput)  # an offline budget of 8192 tokens per step, as vLLM's LLM class uses
        run throughput python3 -m services bench throughput "$MODEL" "${COMMON[@]}" \
            --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
            --max-num-batched-tokens 8192 --output-json "$OUT/throughput.json" ;;
    tp-tests)  # two ranks against one on GPUs: the fused all-reduce and NCCL, inside CUDA graphs;
        # two replicas sharing the experts, in graphs and eagerly
        run tp-tests python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider \
            tests/integration/test_gpu_fused_all_reduce.py \
            tests/integration/test_gpu_tensor_parallel.py \
            tests/integration/test_gpu_expert_parallel_replicas.py ;;
    allreduce)  # one all-reduce between $TP GPUs: NCCL eager and in graphs, symmetric memory
        run allreduce python3 -m torch.distributed.run --nproc-per-node "$TP" \
            -m sweeps.allreduce_probe "$OUT/allreduce.json" ;;
    latency-tp)  # the latency part on $TP GPUs
        run latency-tp python3 -m services bench latency "$MODEL" "${COMMON[@]}" \
            --tensor-parallel-size "$TP" --input-len 128 --output-len 256 --profile-steps 20 \
            --output-json "$OUT/latency_tp$TP.json" ;;
    latency-tp-nccl)  # latency-tp with NCCL's all-reduce and the norm apart (no fused kernel)
        run latency-tp-nccl python3 -m services bench latency "$MODEL" "${COMMON[@]}" \
            --tensor-parallel-size "$TP" --disable-custom-all-reduce --input-len 128 \
            --output-len 256 --output-json "$OUT/latency_tp${TP}_nccl.json" ;;
    throughput-tp)  # the throughput part on $TP GPUs
        run throughput-tp python3 -m services bench throughput "$MODEL" "${COMMON[@]}" \
            --tensor-parallel-size "$TP" --num-prompts 256 --input-len 512 --output-len 256 \
            --ignore-eos --max-num-batched-tokens 8192 --output-json "$OUT/throughput_tp$TP.json" ;;
    throughput-dp)  # offline with one engine, then $DP replicas (a GPU each): the throughput
        # part's 256 prompts, then 1024 (each replica as full as one engine is at 512); and
        # one engine given one replica's share alone, which $DP replicas can at best multiply
        for prompts in 256 1024; do
            for dp in 1 "$DP"; do
                run "throughput-dp $dp x $prompts" timeout 300 python3 -m services bench \
                    throughput "$MODEL" "${COMMON[@]}" --data-parallel-size "$dp" \
                    --num-prompts $prompts --input-len 512 --output-len 256 --ignore-eos \
                    --max-num-batched-tokens 8192 --output-json "$OUT/throughput_dp${dp}_$prompts.json"
            done
            share=$((prompts / DP))
            run "throughput-dp 1 x $share" timeout 300 python3 -m services bench throughput \
                "$MODEL" "${COMMON[@]}" --num-prompts $share --input-len 512 --output-len 256 \
                --ignore-eos --max-num-batched-tokens 8192 --output-json "$OUT/throughput_dp1_$share.json"
        done ;;
    latency-fp8)  # --quantization fp8 (issue 13)
        run latency-fp8 python3 -m services bench latency "$MODEL" "${COMMON[@]}" \
            --quantization fp8 --input-len 128 --output-len 256 --profile-steps 20 \
            --output-json "$OUT/latency_fp8.json" ;;
    throughput-fp8)
        run throughput-fp8 python3 -m services bench throughput "$MODEL" "${COMMON[@]}" \
            --quantization fp8 --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
            --max-num-batched-tokens 8192 --output-json "$OUT/throughput_fp8.json" ;;
    latency-int4)  # int4 W4A16 (issue 13): AWQ's layout, dummy weights in groups of 128
        run latency-int4 python3 -m services bench latency "$MODEL" "${COMMON[@]}" \
            --quantization awq --input-len 128 --output-len 256 --profile-steps 20 \
            --output-json "$OUT/latency_int4.json" ;;
    throughput-int4)
        run throughput-int4 python3 -m services bench throughput "$MODEL" "${COMMON[@]}" \
            --quantization awq --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
            --max-num-batched-tokens 8192 --output-json "$OUT/throughput_int4.json" ;;
    lora-tests)  # LoRA kernels at real shapes, and adapters in CUDA graphs against peft
        run lora-tests python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider \
            tests/kernels/test_triton_lora.py tests/integration/test_lora.py \
            tests/kernels/test_triton_linear.py -k "lora or llama_shapes" ;;
    lora-adapters)  # 8 random rank-16 adapters on all seven projections (peft), outside the tree
        run lora-adapters python3 -m sweeps.lora_adapters "$MODEL" --num 8 --rank 16 \
            --out "$LORA_DIR" ;;
    latency-lora)  # every request under one adapter (issue 14); compare with `latency`
        run latency-lora python3 -m services bench latency "$MODEL" "${COMMON[@]}" \
            --enable-lora --max-lora-rank 16 --lora-paths "$LORA_DIR/adapter-0" \
            --input-len 128 --output-len 256 --profile-steps 20 \
            --output-json "$OUT/latency_lora.json" ;;
    throughput-lora)  # the requests spread evenly over the 8 adapters; compare with `throughput`
        run throughput-lora python3 -m services bench throughput "$MODEL" "${COMMON[@]}" \
            --enable-lora --max-loras 8 --max-lora-rank 16 --lora-paths "$LORA_DIR"/adapter-* \
            --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
            --max-num-batched-tokens 8192 --profile-steps ${LORA_PROFILE_STEPS:-0} \
            --output-json "$OUT/throughput_lora.json" ;;
    int4-sweep)  # int4 tiles at the Llama-3.1-8B shapes against bf16
        run int4-sweep python3 -m sweeps.int4_sweep --out "$OUT/int4_sweep.json" \
            --m ${INT4_M:-1 16 64 256} ;;
    fp8-sweep)  # FP8 skinny tiles at the Llama-3.1-8B shapes against bf16
        run fp8-sweep python3 -m sweeps.fp8_sweep --out "$OUT/fp8_sweep.json" \
            --m ${FP8_M:-1 4 16} ;;
    fp8-block-tests)
        run fp8-block-tests python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider \
            tests/kernels/test_fp8_block.py tests/kernels/test_fp8_linear.py ;;
    fp8-block-model)  # the Llama-3.1-8B preset as a block-scaled FP8 checkpoint's config.json
        mkdir -p "$FP8_BLOCK_MODEL"
        run fp8-block-model python3 -c "import json, sys; c = json.load(open(sys.argv[1])); \
c['quantization_config'] = {'quant_method': 'fp8', 'activation_scheme': 'dynamic', \
'weight_block_size': [128, 128]}; json.dump(c, open(sys.argv[2], 'w'))" \
            shared/presets/Llama-3.1-8B.json "$FP8_BLOCK_MODEL/config.json" ;;
    fp8-static-model)  # the Llama-3.1-8B preset as a static-activation FP8 (AutoFP8) config
        mkdir -p "$FP8_STATIC_MODEL"
        run fp8-static-model python3 -c "import json, sys; c = json.load(open(sys.argv[1])); \
c['quantization_config'] = {'quant_method': 'fp8', 'activation_scheme': 'static'}; \
json.dump(c, open(sys.argv[2], 'w'))" shared/presets/Llama-3.1-8B.json \
            "$FP8_STATIC_MODEL/config.json" ;;
    latency-fp8-static)  # dummy e4m3 weights, inputs scaled by a fixed input_scale
        run latency-fp8-static python3 -m services bench latency "$FP8_STATIC_MODEL" \
            "${COMMON[@]}" --input-len 128 --output-len 256 --profile-steps 20 \
            --output-json "$OUT/latency_fp8_static.json" ;;
    throughput-fp8-kv-fp8)  # FP8 weights and an FP8 KV cache: decode reads half the KV bytes
        run throughput-fp8-kv-fp8 python3 -m services bench throughput "$MODEL" "${COMMON[@]}" \
            --quantization fp8 --kv-cache-dtype fp8 --num-prompts 256 --input-len 512 \
            --output-len 256 --ignore-eos --max-num-batched-tokens 8192 \
            --output-json "$OUT/throughput_fp8_kv_fp8.json" ;;
    fp8-block-sweep)  # block-scaled FP8 tiles at the Llama-3.1-8B shapes against bf16
        run fp8-block-sweep python3 -m sweeps.fp8_block_sweep \
            --out "$OUT/fp8_block_sweep.json" --m ${FP8_BLOCK_M:-1 16 256 2048} ;;
    latency-fp8-block)  # dummy e4m3 weights with a scale per 128 x 128 block
        run latency-fp8-block python3 -m services bench latency "$FP8_BLOCK_MODEL" \
            "${COMMON[@]}" --input-len 128 --output-len 256 --profile-steps 20 \
            --output-json "$OUT/latency_fp8_block.json" ;;
    throughput-fp8-block)
        run throughput-fp8-block python3 -m services bench throughput "$FP8_BLOCK_MODEL" \
            "${COMMON[@]}" --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
            --max-num-batched-tokens 8192 --output-json "$OUT/throughput_fp8_block.json" ;;
    gguf-tests)  # GGUF kernels at Llama shapes (issue 13)
        run gguf-tests python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider tests/kernels/test_gguf.py ;;
    gguf-sweep)  # GGUF tiles at the Llama-3.1-8B shapes against bf16
        run gguf-sweep python3 -m sweeps.gguf_sweep --out "$OUT/gguf_sweep.json" \
            --types ${GGUF_TYPES:-Q4_K Q6_K Q8_0} --m ${GGUF_M:-1 4 16 64 256} ;;
    gguf-file)  # a Llama-3.1-8B-shaped Q4_K_M GGUF file of random blocks, outside the tree
        run gguf-file python3 -m sweeps.gguf_writer "$GGUF_FILE" ;;
    latency-gguf)  # that file, kept in its blocks (the default on CUDA)
        mkdir -p /tmp/no-tokenizer
        run latency-gguf python3 -m services bench latency "$GGUF_FILE" --max-model-len 4096 \
            --seed 0 --tokenizer /tmp/no-tokenizer --input-len 128 --output-len 256 \
            --profile-steps 20 --output-json "$OUT/latency_gguf.json" ;;
    throughput-gguf)
        mkdir -p /tmp/no-tokenizer
        run throughput-gguf python3 -m services bench throughput "$GGUF_FILE" \
            --max-model-len 4096 --seed 0 --tokenizer /tmp/no-tokenizer --num-prompts 256 \
            --input-len 512 --output-len 256 --ignore-eos --max-num-batched-tokens 8192 \
            --output-json "$OUT/throughput_gguf.json" ;;
    throughput-2048)  # the serving default budget
        run throughput-2048 python3 -m services bench throughput "$MODEL" "${COMMON[@]}" \
            --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
            --max-num-batched-tokens 2048 --output-json "$OUT/throughput_2048.json" ;;
    small)
        run small python3 -m services bench throughput "$SMALL_MODEL" "${COMMON[@]}" \
            --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --ignore-eos \
            --max-num-batched-tokens 8192 --profile-steps 30 --output-json "$OUT/small.json" ;;
    peer)
        run peer python3 -m sweeps.peer_transformers --model "$MODEL" --seed 0 \
            --num-prompts "${PEER_PROMPTS:-256}" --input-len 512 --output-len 256 \
            --out "$OUT/peer_transformers.json" ;;
    *) echo "unknown part $part"; status=1 ;;
    esac
done
python3 -m sweeps.summarize "$OUT" | tee "$OUT/summary.txt"
exit $status
