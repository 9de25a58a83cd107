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
from shared.kv_groups import KVGroups, kv_groups
from shared.model_config import ModelConfig
from shared.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheLayout:
    """One tensor per slot: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]; a layer
    reads and writes its slot's (shared/kv_groups.py: every layer its own slot, unless the
    layers are grouped)."""

    layer_slots: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(
        cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, groups: KVGroups | None = None
    ) -> KVCacheLayout:
        slots = groups.layer_slots if groups is not None else tuple(range(cfg.num_layers))
        return cls(slots, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slots) + 1

    @property
    def bytes_per_block(self) -> int:
        per_token = 2 * self.num_slots * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """Each layer's tensor (the layers of one slot share it)."""
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        slots = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_slots)]
        return [slots[slot] for slot in self.layer_slots]


def num_kv_blocks(
    config: Config,
    layout: KVCacheLayout,
    device: torch.device,
    step_peak: Callable[[], int],
    draft_bytes_per_block: int = 0,
    reserved_bytes: int = 0,
) -> int:
    """How many blocks the cache gets: the override, the byte budget, or what memory allows.

    `step_peak` measures a largest step's activations; it runs only when memory decides. A
    draft model's cache has the same blocks: the budget pays for both (`draft_bytes_per_block`).
    Where memory decides, `reserved_bytes` more stay free (a prefill replica's handover slots).
    """
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        reserve = 0 if config.enforce_eager else CUDA_GRAPH_RESERVE_BYTES
        budget = _cuda_budget(
            device, config.gpu_memory_utilization, step_peak() + reserve + reserved_bytes
        )
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
        "memory: %.1f GiB total, %.1f GiB in use, %.2f GiB set aside (a step's activations, "
        "CUDA graphs, handover slots), "
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
        # Every layer group's table the same blocks: the groups' layers share slots' tensors
        blocks = range(next_block, next_block + size)
        tables.append([block for block in blocks for _ in range(buffers.num_groups)])
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


def kv_groups_for(config: Config, cfg: ModelConfig, spec: SpeculativeConfig | None) -> KVGroups:
    """The model's layer groups (shared/kv_groups.py): sliding layers apart, their blocks
    behind the window returned to the pool, unless something reads every block by the one
    table of all layers (a draft model's or EAGLE-3 head's cache follows the target's blocks;
    a prefill replica hands a prompt's blocks over whole; the disk tier chains one key a
    block) or --disable-hybrid-kv-cache-manager."""
    own_cache = spec is not None and spec.method in ("draft_model", "eagle3")
    keeps = config.disable_hybrid_kv_cache_manager or config.prefill_replicas > 0 or own_cache
    groups = kv_groups(cfg, split=not keeps)
    if groups.num_groups > 1 and config.kv_offloading_disk_path is not None:
        return kv_groups(cfg, split=False)
    return groups


def set_kv_groups(model: DecoderForCausalLM, groups: KVGroups) -> None:
    """Each attention layer's group: the block table it attends with."""
    for layer, group in zip(model.layers, groups.layer_groups, strict=True):
        layer.self_attn.kv_group = group


def log_kv_cache(
    layout: KVCacheLayout, num_blocks: int, max_model_len: int, groups: KVGroups
) -> None:
    per_sequence = groups.blocks_per_sequence(max_model_len, layout.block_size)
    logger.info(
        "KV cache: %d blocks x %d tokens (%.2f GiB, %s), %.1f sequences of %d%s",
        num_blocks,
        layout.block_size,
        num_blocks * layout.bytes_per_block / 2**30,
        str(layout.dtype).removeprefix("torch."),
        num_blocks / per_sequence,
        max_model_len,
        _groups_note(groups),
    )


def _groups_note(groups: KVGroups) -> str:
    windows = [window for window in groups.windows if window is not None]
    if not windows:
        return ""
    return (
        f"; {groups.num_groups} layer groups of {groups.num_slots} layers, {len(windows)} of"
        f" them returning blocks behind their {windows[0]}-token window to the pool"
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
