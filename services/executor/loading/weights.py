"""The walk of a checkpoint into a model: each tensor handed to the parameter it fills.

The walk knows no format and no cut. The model maps a checkpoint name to its parameter and the
piece it fills (`checkpoint_param`); the parameter's `weight_loader` cuts the rank's part,
reads it and puts it in place (services/executor/layers/weight_loader.py). A source yields
(Hugging Face name, tensor): whole tensors, `CheckpointSlice`s a rank reads only its part of,
or a GGUF method's `PackedWeight`s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from services.executor.layers.weight_loader import num_shards, weight_loader
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.eagle3 import Eagle3Head
from services.executor.parallel.shards import CheckpointTensor, PackedWeight


def load_weights(
    model: DecoderForCausalLM | Eagle3Head, weights: Iterable[tuple[str, CheckpointTensor]]
) -> None:
    """Load every tensor of `weights` into `model`; all its parameters must be filled, each
    fused one by all of its pieces."""
    params = dict(model.named_parameters())  # a tied lm_head is not listed twice
    num_loaded: Counter[str] = Counter()
    for hf_name, tensor in weights:
        target = model.checkpoint_param(hf_name)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            packed = f" ({tensor.qtype})" if isinstance(tensor, PackedWeight) else ""
            raise ValueError(f"unexpected weight {hf_name!r}{packed}")
        param = params[name]
        weight_loader(param)(param, tensor, shard, hf_name)
        num_loaded[name] += 1
    missing = [name for name, p in params.items() if num_loaded[name] != num_shards(p)]
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")
