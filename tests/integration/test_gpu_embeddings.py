"""On a GPU in bfloat16, with CUDA graphs: `LLM.embed` agrees with transformers' pooled last
hidden states (float32, on the CPU) within bf16 rounding, whole prompts or chunked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow import LLM
from tests.integration.tiny_embedding import (
    make_tiny_embedding_model,
    reference_embeddings,
    save_tiny_embedding_model,
)
from tests.integration.tiny_models import make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_gpu_embeddings_match_transformers(tmp_path: Path, pooling: str, chunk: int | None) -> None:
    folder = save_tiny_embedding_model(tmp_path / pooling, pooling)
    prompts = make_prompts(384)
    model = make_tiny_embedding_model()  # float32 on the CPU: the reference
    expected = reference_embeddings(model, prompts, pooling, True)
    settings = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(
        str(folder), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=64 << 20, **settings
    )
    results = llm.embed(prompts)
    for result, want in zip(results, expected, strict=True):
        got = torch.tensor(result.embedding)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() >= 0.99
    assert llm.stats().kv_usage == 0.0
