"""A tiny random-weight Qwen3 embedding model, saved as Qwen3-Embedding is: the bare decoder
(`AutoModel`: no lm_head) beside sentence-transformers' pooling and normalizing modules."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tests.integration.tiny_models import FAMILIES, TINY

ST_FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens"}


def make_tiny_embedding_model(vocab_size: int | None = None) -> transformers.PreTrainedModel:
    """The bare tiny Qwen3 decoder, float32, random weights (norms too) from seed 0; with
    `vocab_size` (a real tokenizer's), a context of 2,048."""
    config_cls, extra = FAMILIES["qwen3"]
    torch.manual_seed(0)
    sized = {} if vocab_size is None else dict(vocab_size=vocab_size, max_position_embeddings=2048)
    config = config_cls(**{**TINY, **extra, **sized})
    model = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms, or the final norm would be tested at 1.0 only
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(mean=1.0, std=0.2)
    return model


def save_tiny_embedding_model(
    folder: Path,
    pooling: str = "last",
    normalize: bool = True,
    matryoshka: bool = False,
    tokenizer: transformers.PreTrainedTokenizerBase | None = None,
) -> Path:
    """Save the model to `folder` with sentence-transformers files for `pooling` (and the
    tokenizer, whose vocabulary the model then takes)."""
    model = make_tiny_embedding_model(None if tokenizer is None else len(tokenizer))
    if matryoshka:
        model.config.matryoshka_dimensions = [16, 32, 64]
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    settings = {
        "word_embedding_dimension": TINY["hidden_size"],
        **dict.fromkeys(ST_FLAGS.values(), False),
    }
    settings[ST_FLAGS[pooling]] = True
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    return folder


def reference_embeddings(
    model: transformers.PreTrainedModel, prompts: list[list[int]], pooling: str, normalize: bool
) -> list[torch.Tensor]:
    """transformers' last hidden state of each prompt alone, pooled as sentence-transformers
    pools it."""
    vectors = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]  # [n, hidden]
            vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            if normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            vectors.append(vector)
    return vectors
