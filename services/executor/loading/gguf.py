"""GGUF files as a stream of (Hugging Face name, tensor): llama.cpp's names and q/k row order
translated back, each tensor read (and dequantized) only for the part a rank takes."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import EllipsisType

import gguf
import numpy as np
import torch

from kernels.gguf import GGUF_TYPES, dequantize_gguf_reference
from services.executor.parallel.shards import CheckpointSlice, PackedWeight
from shared.gguf_file import read_gguf
from shared.model_config import ModelConfig

logger = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's names differ from Llama's
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused
    "olmo2": {  # norms after each sublayer only
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel's)
_ROPE_PERMUTED = ("llama", "granite")
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (interleaved RoPE pairs) back to rotate-half order."""
    # llama.cpp stores each head's rows as (pairs, 2); the checkpoint had (2, pairs).
    pairs = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, pairs, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def iter_gguf(
    path: Path, cfg: ModelConfig, keep_blocks: bool = False
) -> Iterator[tuple[str, CheckpointSlice | PackedWeight]]:
    """The file's tensors unread (a tensor-parallel rank reads and dequantizes only its part),
    as float32; with `keep_blocks`, the projections' weights as `PackedWeight`s instead:
    their blocks as stored, or float for the types without a kernel (and F16/F32), which are
    counted in a warning."""
    file = read_gguf(path)
    arch = file.fields["general.architecture"]
    dequantized: Counter[str] = Counter()
    for tensor in file.tensors:
        if tensor.name.startswith(("rope_freqs.", "rope_factors_")):  # read with the config
            continue
        name = _hf_name(tensor.name, arch)
        qtype = tensor.qtype.name
        packed = keep_blocks and name.endswith("_proj.weight")
        blocks = packed and qtype in GGUF_TYPES
        if packed and not blocks and qtype not in ("F32", "F16", "BF16"):
            dequantized[qtype] += 1
        # llama.cpp's q/k row order; a row permutation moves whole rows of blocks as well.
        rope_rows = arch in _ROPE_PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight"))
        # llama.cpp stores Gemma's norms as 1 + w, the multiplier itself; kvflow's are w.
        offset = 1.0 if arch.startswith("gemma") and name.endswith("norm.weight") else 0.0
        rope_head_dim = cfg.head_dim if rope_rows else 0
        part = _GgufPart(tensor.data, tensor.qtype, blocks, rope_head_dim, offset)
        weight = CheckpointSlice(part)
        yield name, (PackedWeight(_packed_type(qtype), weight) if packed else weight)
    if dequantized:
        logger.warning(
            "GGUF types without a kernel, dequantized to float at load (more memory): %s",
            ", ".join(f"{count} {qtype}" for qtype, count in sorted(dequantized.items())),
        )


class _GgufPart:
    """A GGUF tensor in its memory-mapped file, as `CheckpointSlice` reads one: its shape, and
    the part an index takes, read then (blocks as stored, or dequantized to float32). Columns
    are values of a dequantized tensor (the blocks holding them are read) or bytes of a blocks
    one. `rope_head_dim`: llama.cpp's q/k rows, put back in rotate-half order as read (a cut
    takes whole heads, so each head is unpermuted alone). `offset`: taken off every value."""

    def __init__(
        self,
        data: np.ndarray,
        qtype: gguf.GGMLQuantizationType,
        blocks: bool,
        rope_head_dim: int,
        offset: float = 0.0,
    ) -> None:
        self.data, self.qtype, self.blocks = data, qtype, blocks
        self.rope_head_dim, self.offset = rope_head_dim, offset
        # Each stored row is blocks of `elems` values in `width` entries (bytes, or one typed
        # value for F32/F16/BF16).
        elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        self.elems, self.width = (1, 1) if blocks else (elems, nbytes // data.itemsize)

    def get_shape(self) -> list[int]:
        shape = list(self.data.shape)
        shape[-1] = shape[-1] // self.width * self.elems
        return shape

    def __getitem__(self, index: tuple[slice, ...] | EllipsisType) -> torch.Tensor:
        view, columns = self.data, slice(None)
        if isinstance(index, tuple):
            *rows, columns = index if len(index) == view.ndim else (*index, slice(None))
            view = view[tuple(rows)]
        start, stop, _ = columns.indices(self.get_shape()[-1])
        if self.blocks:  # bytes of whole blocks: what a rank cuts is the method's to check
            weight = torch.from_numpy(np.array(view[..., start:stop], dtype=np.uint8))
        else:  # the whole blocks holding the columns, dequantized, then the columns
            first, last = start // self.elems, -(-stop // self.elems)
            stored = np.ascontiguousarray(view[..., first * self.width : last * self.width])
            offset = first * self.elems
            weight = _dequantized(stored, self.qtype)[..., start - offset : stop - offset]
        if self.rope_head_dim:
            weight = _unpermute_rope(weight, weight.shape[0] // self.rope_head_dim)
        return weight - self.offset if self.offset else weight


def _dequantized(stored: np.ndarray, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """Rows of whole blocks as float32 (a tensor of its own): by the kernels' torch reference
    where it knows the type (the same values, in half of gguf's time: a server's start reads
    every weight so), else by gguf's."""
    known = GGUF_TYPES.get(qtype.name)
    if known is not None:  # rows of any leading shape (an expert stack's too), as one matrix
        rows = np.array(stored.view(np.uint8)).reshape(-1, stored.shape[-1])  # a writable copy
        k = rows.shape[1] // known.block_bytes * known.block_elems
        values = dequantize_gguf_reference(torch.from_numpy(rows), qtype.name, k)
        return values.reshape(*stored.shape[:-1], k)
    return torch.from_numpy(np.array(gguf.quants.dequantize(stored, qtype), dtype=np.float32))


def _packed_type(qtype: str) -> str:
    return qtype if qtype in GGUF_TYPES else "float"


def _hf_name(gguf_name: str, arch: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch, {})}
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} in a {arch} file")
    _, layer, piece, suffix = parts
    return f"model.layers.{layer}.{names[piece]}.{suffix}"
