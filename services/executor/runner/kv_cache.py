"""The paged KV cache: its layout, how many blocks fit, and its tensors.

On CUDA the cache takes what is left under --gpu-memory-utilization once the weights are
loaded and the largest step's activations are accounted for, measured by running one:

    total x utilization  =  in use (weights, context)  +  peak step  +  graph reserve  +  KV
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.executor.models.decoder import DecoderForCausalLM
from services.executor.runner.step_buffers import StepBuffers
from shared.config import Config
from shared.constants import CUDA_GRAPH_RESERVE_BYTES, DEFAULT_CPU_KV_BYTES
from shared.model_config import ModelConfig
from shared.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheLayout:
    """One tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]


def num_kv_blocks(
    config: Config,
    layout: KVCacheLayout,
    device: torch.device,
    step_peak: Callable[[], int],
    draft_bytes_per_block: int = 0,
) -> int:
    """How many blocks the cache gets: the override, the byte budget, or what memory allows.

    `step_peak` measures a largest step's activations; it runs only when memory decides. A
    draft model's cache has the same blocks: the budget pays for both (`draft_bytes_per_block`).
    """
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        reserve = 0 if config.enforce_eager else CUDA_GRAPH_RESERVE_BYTES
        budget = _cuda_budget(device, config.gpu_memory_utilization, step_peak() + reserve)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    num_blocks = budget // (layout.bytes_per_block + draft_bytes_per_block)
    if num_blocks < 1:
        raise RuntimeError("no memory left for the KV cache; raise --gpu-memory-utilization")
    return num_blocks


def _cuda_budget(device: torch.device, utilization: float, step_bytes: int) -> int:
    """What is left under `utilization` after what is in use and what a step needs."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, CUDA context, libraries
    budget = int(total * utilization) - used - step_bytes
    logger.info(
        "memory: %.1f GiB total, %.1f GiB in use, %.2f GiB for a step's activations and "
        "CUDA graphs, "
        "%.1f GiB left for the KV cache at --gpu-memory-utilization %.2f",
        total / 2**30,
        used / 2**30,
        step_bytes / 2**30,
        max(budget, 0) / 2**30,
        utilization,
    )
    return budget


@torch.inference_mode()
def profile_step_peak(
    model: DecoderForCausalLM, buffers: StepBuffers, layout: KVCacheLayout, max_model_len: int
) -> int:
    """Bytes one step of max_num_batched_tokens prompt tokens allocates beyond the weights."""
    num_tokens = buffers.max_tokens
    per_request = min(num_tokens, max_model_len)
    counts = [per_request] * (num_tokens // per_request)
    if num_tokens % per_request:
        counts.append(num_tokens % per_request)
    counts = counts[: buffers.max_reqs]
    tables, next_block = [], 0
    for count in counts:
        size = -(-count // layout.block_size)
        tables.append(list(range(next_block, next_block + size)))
        next_block += size
    device = buffers.device_buffer.device
    kv_caches = layout.allocate(next_block, device)
    token_ids = torch.randint(0, model.config.vocab_size, (sum(counts),)).tolist()
    num_samples = min(buffers.max_samples, len(token_ids))
    for row, block_ids in enumerate(tables):
        buffers.set_table_row(row, block_ids)
    buffers.write(token_ids, [0] * len(counts), counts, list(range(num_samples)))
    buffers.copy_to_device()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    view = buffers.view()
    # LoRA's temporaries too, where slots are attached (slot 0 for all: the fields are zero)
    hidden = model(view.input_ids, view.positions, kv_caches, view.meta, view.lora)
    logits = model.compute_logits(hidden[view.sample_rows]).float()  # [S, vocab]
    logits.sort(dim=-1)  # the sampler's top-k/top-p sort is its largest temporary
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - baseline
    del kv_caches, hidden, logits
    torch.cuda.empty_cache()
    return peak


def freed_window(config: Config, cfg: ModelConfig, spec: SpeculativeConfig | None) -> int | None:
    """The sliding window past which a request's blocks return to the pool while it runs
    (services/scheduler/kv_cache_manager.py), or None: where every layer attends in the window
    and nothing else reads the blocks behind it (a draft model's or EAGLE-3 head's cache
    follows the target's blocks and attends to all of them; a prefill replica hands a
    prompt's blocks over whole), unless --disable-hybrid-kv-cache-manager."""
    every_layer = cfg.sliding_window is not None and len(cfg.sliding_layers) == cfg.num_layers
    own_cache = spec is not None and spec.method in ("draft_model", "eagle3")
    keeps = config.disable_hybrid_kv_cache_manager or config.prefill_replicas > 0
    return cfg.sliding_window if every_layer and not own_cache and not keeps else None


def log_kv_cache(
    layout: KVCacheLayout, num_blocks: int, max_model_len: int, window: int | None = None
) -> None:
    num_tokens = num_blocks * layout.block_size
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s), %.1f sequences of %d%s",
        num_blocks,
        layout.block_size,
        num_tokens,
        num_blocks * layout.bytes_per_block / 2**30,
        str(layout.dtype).removeprefix("torch."),
        num_tokens / max_model_len,
        max_model_len,
        "" if window is None else f" (blocks behind the {window}-token window return to the pool)",
    )


def log_kv_scales(model: DecoderForCausalLM, kv_dtype: torch.dtype) -> None:
    """Say whether the checkpoint's calibrated KV cache scales are used (FP8 caches only)."""
    scales = [layer.self_attn.kv_scale_values for layer in model.layers]
    if not any(s != (1.0, 1.0) for s in scales):
        return
    if kv_dtype != torch.float8_e4m3fn:
        logger.warning(
            "the checkpoint's KV cache scales are not used: they apply to --kv-cache-dtype fp8"
        )
        return
    keys, values = zip(*scales, strict=True)
    logger.info(
        "KV cache scales from the checkpoint: keys %.3g..%.3g, values %.3g..%.3g",
        min(keys), max(keys), min(values), max(values),
    )  # fmt: skip
