"""The keys of full KV blocks, as the prefix cache files them and routers look them up.

A block's key is sha256 over its parent's key and its token ids, so it names the whole prefix
up to it; the first block's parent is its LoRA adapter's seed, so a prefix computed under one
adapter (or the base model) is never found under another, and, with LongRoPE, whether it was
computed with the long set of frequencies. The scheduler keys its cache with
these (services/scheduler/request.py) and publishes them (KvEventBatch); a router computes
the same keys for a prompt to see which engine holds how much of it.
"""

from __future__ import annotations

import hashlib
from array import array


def lora_seed(lora_id: int) -> bytes:
    """The parent key of a request's first block: its LoRA adapter's (b"" for the base)."""
    return b"" if lora_id == 0 else b"lora:" + lora_id.to_bytes(8, "little")


def block_seed(lora_id: int, long_rope: bool = False) -> bytes:
    """The parent key of a request's first block: its LoRA adapter's seed, marked where the
    request is computed with LongRoPE's long set (its KV then differs from the short set's)."""
    return lora_seed(lora_id) + (b"rope:long" if long_rope else b"")


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Key of a full block: sha256 over the parent's key and this block's token ids.

    NOTE: chaining the parent makes the key name the whole prefix, not just this block,
    and sha256 keeps clients from crafting two prefixes with one key.
    """
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def prefix_block_keys(token_ids: list[int], block_size: int, lora_id: int = 0) -> list[bytes]:
    """The keys of every full block of `token_ids`, first to last."""
    keys: list[bytes] = []
    parent = lora_seed(lora_id)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
