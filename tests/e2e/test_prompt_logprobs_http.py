"""Over HTTP with the official client: echo with logprobs (what lm-eval's log-likelihood tasks
send) equals a full-prompt forward pass of the reference; /v1/models/{id}; 404s in OpenAI's
shape."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
import transformers

from tests.e2e.server import Server
from tests.integration.test_prompt_logprobs import reference_logprobs

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is Paris, and the capital of Germany is"


@pytest.fixture(scope="module")
def server(tool_server: Server) -> Server:
    """The tool chat model's server, which test_structured_output.py shares (tests/e2e/conftest.py):
    tool parsing and its 64 KV blocks change nothing for these short prompts."""
    return tool_server


@pytest.fixture(scope="module")
def expected(tool_chat_model_dir: Path, smollm2_tokenizer) -> tuple[list[int], torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tool_chat_model_dir, dtype=torch.float32
    ).eval()
    token_ids = smollm2_tokenizer.encode(PROMPT)
    return token_ids, reference_logprobs(model, token_ids)


def test_echo_with_max_tokens_0_scores_the_prompt(server: Server, expected) -> None:
    token_ids, reference = expected
    answer = server.client().completions.create(
        model=None, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
    )
    choice = answer.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(token_ids)
    assert "".join(logprobs.tokens) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = reference.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), want, atol=1e-4, rtol=0)
    # lm-eval's is_greedy: whether each token is its position's most likely one.
    for position, top in enumerate(logprobs.top_logprobs[1:]):
        assert len(top) == 1
        (value,) = top.values()
        assert value == pytest.approx(reference[position].max().item(), abs=1e-4)
    assert logprobs.text_offset == [
        len("".join(logprobs.tokens[:i])) for i in range(len(token_ids))
    ]


def test_echo_with_output_puts_the_prompt_first(server: Server, expected) -> None:
    token_ids, _ = expected
    client = server.client()
    answer = client.completions.create(
        model=None, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0.0
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(token_ids) + 3
    assert answer.choices[0].text.startswith(PROMPT)
    streamed = client.completions.create(
        model=None, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0.0, stream=True
    )
    tokens = [t for chunk in streamed for t in (chunk.choices[0].logprobs.tokens or [])]
    assert tokens == logprobs.tokens


def test_vllm_prompt_logprobs_field(server: Server, expected) -> None:
    token_ids, reference = expected
    answer = server.client().completions.create(
        model=None, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    entries = answer.model_dump()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(token_ids)
    for position, (token_id, entry) in enumerate(zip(token_ids[1:], entries[1:], strict=True)):
        assert entry[str(token_id)]["logprob"] == pytest.approx(
            reference[position, token_id].item(), abs=1e-4
        )
        assert len(entry) in (2, 3)  # the token and the top 2 (it may be one of them)


def test_model_by_id_and_openai_shaped_404s(server: Server) -> None:
    client = server.client()
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    missing = httpx.get(f"{server.url}/v1/models/no-such-model", headers=server.headers())
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    for method, path in (("GET", "/v1/nothing"), ("GET", "/v2/models"), ("DELETE", "/v1/models")):
        answer = httpx.request(method, f"{server.url}{path}", headers=server.headers())
        assert answer.status_code in (404, 405)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
