"""`EngineFields`: the fields of the model an engine runs and how (the model, LoRA, parallel
and cache groups, in --help's order); `ConfigFields` (fields.py) adds the scheduler's, the
server's and the device's after them."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.options import option
from shared.quant_config import METHODS

# --quantization: the methods, then vLLM's names for its kernels (shared/config/validation.py)
QUANTIZATION_CHOICES = (*METHODS, "awq_marlin", "gptq_marlin")


@dataclass(frozen=True)
class EngineFields:
    """The model, LoRA, parallel and cache groups of `ConfigFields`."""

    # -- model
    model: str | None = option(
        None,
        "model",
        "HF folder (config.json + safetensors), a .gguf file, or a preset name "
        "for --load-format dummy. Default: the embedded SmolLM2-135M-Instruct GGUF.",
    )
    tokenizer: str | None = option(
        None, "model", "Tokenizer folder or .gguf; default: the model's."
    )
    cache_dir: str = option(
        "~/.cache/kvflow",
        "model",
        "Where kvflow keeps what it derives from a model once, so that later starts are "
        "faster: the tokenizer of a .gguf file, converted. An empty string keeps nothing.",
    )
    load_format: str = option(
        "auto", "model", "How to load weights.", ("auto", "safetensors", "gguf", "dummy")
    )
    dtype: str = option(
        "auto",
        "model",
        "Weight and activation dtype; auto is float32 on CPU, bfloat16 on CUDA. half and "
        "float (vLLM's other names) mean float16 and float32.",
        ("auto", "float32", "bfloat16", "float16", "half", "float"),
    )
    quantization: str | None = option(
        None,
        "model",
        "How the linear layers are quantized; default: as the checkpoint's quantization_config "
        "says (fp8; awq, gptq, compressed-tensors int4 W4A16 or FP8 dynamic), else float. "
        "fp8 on a float checkpoint: e4m3 weights made at load, a scale per output channel, "
        "activations quantized per token. The int4 methods also run on --load-format dummy. "
        "gguf: a .gguf file's blocks kept as they are (the default on CUDA; on CPU its weights "
        "are dequantized to float unless this is set). mxfp4: gpt-oss's MXFP4 experts kept "
        "as they are (the default for its checkpoints; also on --load-format dummy), the other "
        "layers float; fp8 on such a checkpoint dequantizes its experts and makes every layer "
        "FP8. awq_marlin and gptq_marlin (vLLM's names for its kernels) mean awq and gptq.",
        QUANTIZATION_CHOICES,
    )
    max_model_len: int | None = option(
        None, "model", "Longest prompt + output, in tokens; default: the model's context length."
    )
    task: str = option(
        "auto",
        "model",
        "What the model serves: generate (completions, chat) or embed (/v1/embeddings, "
        "LLM.embed: the prompt's pooled last hidden states). auto: embed for a folder with "
        "sentence-transformers modules (modules.json) or a bare ...Model architecture, else "
        "generate. vLLM's --runner pooling / --convert embed mean embed.",
        ("auto", "generate", "embed"),
    )
    # -- LoRA
    enable_lora: bool = option(
        False, "lora", "Serve LoRA adapters (PEFT format) beside the base model."
    )
    max_loras: int = option(
        1,
        "lora",
        "LoRA adapters resident on the device at once: one step runs requests of at most this "
        "many adapters (and of the base model).",
    )
    max_lora_rank: int = option(16, "lora", "Largest adapter rank accepted.")
    max_cpu_loras: int | None = option(
        None,
        "lora",
        "Adapters whose weights are kept in host memory (least recently used out; an adapter "
        "not kept is read from its files again when next used); default: --max-loras.",
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "lora",
        "Adapters to serve from the start, each name=path or a JSON object with name, path and"
        " base_model_name; a request names one as its `model`. Needs --enable-lora.",
    )
    allow_runtime_lora_updating: bool = option(
        False,
        "lora",
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key);"
        " with --data-parallel-size > 1 a load answers once every replica holds the adapter.",
    )
    seed: int = option(0, "model", "Random seed: dummy weights, sampling, `generate` prompts.")
    # -- parallel
    tensor_parallel_size: int = option(
        1,
        "parallel",
        "Split each layer over this many devices (one process each: NCCL on CUDA, gloo on "
        "CPU); the query heads must divide, and the KV heads divide or be divided.",
    )
    enable_expert_parallel: bool = option(
        False,
        "parallel",
        "A mixture of experts' experts whole, spread over the --tensor-parallel-size ranks (an "
        "Nth of them each, in order), instead of every expert's Nth part of the columns on "
        "each; attention and dense layers stay split by tensor parallelism. With "
        "--data-parallel-size, over every replica's ranks, the replicas' tokens exchanged in "
        "each expert layer.",
    )
    disable_custom_all_reduce: bool = option(
        False,
        "parallel",
        "With --tensor-parallel-size > 1 on GPUs: sum the ranks' parts and gather the logits"
        " with NCCL (and norm apart), instead of one-shot kernels that send the rows to the"
        " peers over symmetric memory (steps of up to 512 tokens; logits of up to 16 rows).",
    )
    pipeline_parallel_size: int = option(
        1, "parallel", "Only 1: kvflow splits a model by tensor parallelism, not by layers."
    )
    data_parallel_size: int = option(
        1,
        "parallel",
        "Engine replicas (a scheduler and its executor on --tensor-parallel-size devices of its "
        "own each) behind one frontend and tokenizer pool; each request goes to the replica "
        "whose prefix cache holds the most of its prompt, unless that one is much busier.",
    )
    data_parallel_routing: str = option(
        "prefix",
        "parallel",
        "How requests are spread over engine replicas: prefix (the replica whose prefix cache "
        "holds the most of the prompt, unless it is much busier than the least busy) or "
        "round-robin (in turn, whatever they hold).",
        ("prefix", "round-robin"),
    )
    prefill_replicas: int = option(
        0,
        "parallel",
        "Prefill/decode disaggregation: the first N engine replicas (of --data-parallel-size)"
        " compute prompts and their first tokens, then hand each prompt's KV over to one of the"
        " other replicas, which fetches it and generates the rest, so that long prompts do not"
        " stall the decode steps of others. 0: every replica does both.",
    )
    kv_buffer_device: str = option(
        "cpu",
        "parallel",
        "With --prefill-replicas: where a prefill replica holds the KV it hands over until a "
        "decode replica fetches it. cpu: pinned shared memory (/dev/shm), which decode "
        "replicas on the same host read; cuda: GPU memory (out of the KV cache's share where "
        "--gpu-memory-utilization sizes it, on top of --kv-cache-memory-bytes), "
        "which decode replicas copy device to device by CUDA IPC (the replicas `serve` starts "
        "see every GPU, their own first). Others get the bytes over the socket.",
        ("cpu", "cuda"),
    )
    kv_buffer_size: float = option(
        4.0,
        "parallel",
        "With --prefill-replicas: GiB a prefill replica's rank holds handed-over KV in "
        "(--kv-buffer-device); the oldest unfetched goes when it is full.",
    )
    # -- cache
    block_size: int = option(16, "cache", "Tokens per KV cache block.")
    kv_cache_dtype: str = option(
        "auto",
        "cache",
        "KV cache element type: auto (the model's dtype) or fp8 (e4m3, values saturating at "
        "+-448: twice the tokens in the same memory; scaled by the checkpoint's calibrated "
        "k_scale/v_scale where it has them, else by 1.0). fp8_e4m3, vLLM's other name for it, "
        "means fp8.",
        ("auto", "fp8", "fp8_e4m3"),
    )
    enable_prefix_caching: bool = option(True, "cache", "Reuse KV blocks of shared prefixes.")
    disable_hybrid_kv_cache_manager: bool = option(
        False,
        "cache",
        "One block table for every layer, each request keeping every KV block to its end (by"
        " default a model's sliding-window layers form groups of their own, whose blocks behind"
        " the window return to the pool as a request advances).",
    )
    gpu_memory_utilization: float = option(
        0.9, "cache", "Fraction of GPU memory kvflow may use (weights, activations, KV cache)."
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "cache",
        "KV cache size in bytes; overrides --gpu-memory-utilization. Default on CPU: 1 GiB.",
    )
    num_gpu_blocks_override: int | None = option(
        None, "cache", "Use exactly this many KV blocks (testing and experiments)."
    )
    kv_offloading_size: float | None = option(
        None,
        "cache",
        "GiB of host memory (pinned on CUDA, all tensor-parallel ranks together) for the prefix"
        " cache's host tier: blocks the GPU evicts are copied there and copied back on a later"
        " prefix hit instead of being recomputed. Needs prefix caching.",
    )
    kv_offloading_backend: str = option(
        "native",
        "cache",
        "Where --kv-offloading-size keeps blocks: native (kvflow's own host tier).",
        ("native",),
    )
    kv_offloading_disk_path: str | None = option(
        None,
        "cache",
        "A directory for the prefix cache's disk tier, behind the host tier: every block the"
        " host tier takes is also written there (a file a block, checksummed, written"
        " atomically), and read back into the host tier on a prefix hit; the files are reused"
        " after a restart when the model, dtype, block size and KV layout match. Needs"
        " --kv-offloading-size and --kv-offloading-disk-size.",
    )
    kv_offloading_disk_size: float | None = option(
        None,
        "cache",
        "GiB the disk tier (--kv-offloading-disk-path) may hold; the least recently used"
        " blocks are deleted beyond it.",
    )
