"""The kernel entry points the executor calls.

Only the torch references exist so far; Triton versions with the same signatures will be
picked here when the tensors live on CUDA.
"""

from kernels.activation import silu_and_mul_reference as silu_and_mul
from kernels.attention import paged_attention_reference as paged_attention
from kernels.cache import write_kv_reference as write_kv
from kernels.norm import fused_add_rms_norm_reference as fused_add_rms_norm
from kernels.norm import rms_norm_reference as rms_norm
from kernels.rotary import rotary_embedding_reference as rotary_embedding

__all__ = [
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]
