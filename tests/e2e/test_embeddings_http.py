"""/v1/embeddings over HTTP with the official client: the same vectors as `LLM.embed` on the same
engine cores, in float and base64, batched, from text and token ids, and no KV held after;
and /tokenizer_info."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from kvflow import LLM
from tests.e2e.server import API_KEY, Server, start_server
from tests.integration.tiny_embedding import save_tiny_embedding_model

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is Paris.", "Embeddings " * 20, "short"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("embedder")
    return save_tiny_embedding_model(folder, matryoshka=True, tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    # Chunks of 16 tokens: the longer texts are pooled across steps.
    server = start_server(
        str(model_dir), "--max-num-batched-tokens", "16", "--enable-tokenizer-info-endpoint"
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20)


def close(got: list[float], want: list[float]) -> bool:
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(got), torch.tensor(want), dim=0)
    return cosine.item() >= 1 - 1e-4


def test_float_and_base64_batches_equal_llm_embed(server: Server, offline: LLM) -> None:
    client = server.client()
    expected = offline.embed(TEXTS)
    answer = client.embeddings.create(model=model_name(server), input=TEXTS)
    assert [d.index for d in answer.data] == [0, 1, 2]
    for data, want in zip(answer.data, expected, strict=True):
        assert close(data.embedding, want.embedding)
    num_tokens = sum(len(e.prompt_token_ids) for e in expected)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == num_tokens
    raw = httpx.post(
        f"{server.url}/v1/embeddings",
        headers=server.headers(),
        json={"input": TEXTS[0], "encoding_format": "base64"},
    ).json()
    encoded = base64.b64decode(raw["data"][0]["embedding"])
    vector = list(struct.unpack(f"<{len(encoded) // 4}f", encoded))
    assert close(vector, expected[0].embedding)
    assert server.wait_idle()["kv_cache_usage_perc"] == 0


def test_token_ids_and_dimensions(server: Server, offline: LLM) -> None:
    client = server.client()
    ids = [[5, 6, 7, 8], list(range(100, 140))]
    expected = offline.embed(ids, dimensions=16)
    answer = client.embeddings.create(model=model_name(server), input=ids, dimensions=16)
    for data, want in zip(answer.data, expected, strict=True):
        assert len(data.embedding) == 16 and close(data.embedding, want.embedding)


def test_generating_on_an_embedding_model_is_a_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings"):
        server.client().completions.create(model=model_name(server), prompt="hi")


def test_bench_serve_measures_batched_embedding_requests(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "embed.json"
    where = ["--base-url", server.url, "--api-key", API_KEY, "--output-json", str(out)]
    flags = ["--backend", "openai-embeddings", "--endpoint", "/v1/embeddings", "--disable-tqdm"]
    load = ["--random-input-len", "8", "--num-prompts", "7", "--random-batch-size", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "services", "bench", "serve", *where, *flags, *load],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [run] = json.loads(out.read_text())["runs"]
    assert (run["completed"], run["failed"]) == (3, 0)  # 7 prompts in requests of 3, 3 and 1
    assert (run["total_input_tokens"], run["total_output_tokens"]) == (7 * 8, 0)
    assert run["median_e2el_ms"] > 0 and "median_ttft_ms" not in run
    assert server.wait_idle()["kv_cache_usage_perc"] == 0


def test_tokenizer_info(server: Server, smollm2_tokenizer) -> None:
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401  # behind the key
    info = httpx.get(f"{server.url}/tokenizer_info", headers=server.headers()).json()
    assert info["tokenizer_class"] == type(smollm2_tokenizer).__name__
    assert info["eos_token"] == smollm2_tokenizer.eos_token
    assert info["chat_template"] == smollm2_tokenizer.chat_template


def model_name(server: Server) -> str:
    return server.client().models.list().data[0].id
