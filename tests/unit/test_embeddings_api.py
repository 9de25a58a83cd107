"""/v1/embeddings' body read into embed sub-requests, and its answer (pure: no app)."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from services.frontend.api.embeddings import embeddings_body, plan_embeddings
from services.frontend.api.endpoints import COMPLETIONS
from services.frontend.api.errors import APIError
from services.frontend.api.limits import RequestLimits
from services.frontend.api.responses import Choice
from services.frontend.api.validation import Served, plan_call
from shared.config import Config
from shared.pooling import PoolingConfig

LIMITS = RequestLimits.of(Config())
EMBEDDER = Served("embedder", LIMITS, pooling=PoolingConfig(num_dimensions=4))
MATRYOSHKA = Served("embedder", LIMITS, pooling=PoolingConfig(matryoshka=True, num_dimensions=4))
GENERATOR = Served("generator", LIMITS)


def plan(body: dict[str, object], served: Served = EMBEDDER):
    return plan_embeddings(json.dumps(body).encode(), served, "embd-1", 0.0)


def refusal(body: dict[str, object], served: Served = EMBEDDER) -> tuple[int, str | None]:
    with pytest.raises(APIError) as caught:
        plan(body, served)
    return caught.value.status, caught.value.param


@pytest.mark.parametrize(
    ("value", "num"),
    [("one", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1, 2], [3]], 2)],
)
def test_every_input_shape_is_one_embed_request_per_input(value: object, num: int) -> None:
    call = plan({"input": value, "model": "embedder"})
    assert len(call.sub_requests) == num == call.num_prompts
    for request in call.sub_requests:
        params = request.sampling_params
        assert params.embed and params.max_tokens == 1


def test_bad_bodies_are_400_naming_the_field() -> None:
    assert refusal({"input": []}) == (400, "input")
    assert refusal({"input": "x", "encoding_format": "int8"})[1] == "encoding_format"
    assert refusal({"input": "x", "dimensions": 2}) == (400, "dimensions")  # not Matryoshka
    assert refusal({"input": "x", "dimensions": 5}, MATRYOSHKA) == (400, "dimensions")
    assert refusal({"input": "x", "model": "other"})[0] == 404
    plan({"input": "x", "dimensions": 4})  # its own length is always fine
    plan({"input": "x", "dimensions": 2}, MATRYOSHKA)


def test_each_model_refuses_the_other_api() -> None:
    assert refusal({"input": "x"}, GENERATOR) == (400, "model")
    with pytest.raises(APIError) as caught:
        plan_call(COMPLETIONS, b'{"prompt": "x"}', EMBEDDER, "cmpl-1", 0.0)
    assert caught.value.status == 400 and "/v1/embeddings" in caught.value.message


def finished(index: int, vector: list[float], num_tokens: int) -> Choice:
    choice = Choice(index)
    choice.embedding, choice.num_prompt_tokens = vector, num_tokens
    return choice


def answer(choices: list[Choice], encoding_format: str = "float", **body: object):
    call = plan(
        {"input": [[1]] * len(choices), "encoding_format": encoding_format, **body}, MATRYOSHKA
    )
    return embeddings_body(call, choices)


def test_the_answer_in_float_base64_and_fewer_dimensions() -> None:
    choices = [finished(0, [0.6, 0.8, 0.0, 0.0], 3), finished(1, [0.0, 0.0, 1.0, 0.0], 5)]
    body = answer(choices)
    assert body["object"] == "list" and body["model"] == "embedder"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][0] == {"object": "embedding", "index": 0, "embedding": [0.6, 0.8, 0, 0]}
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    encoded = answer(choices, "base64")
    raw = base64.b64decode(encoded["data"][1]["embedding"])
    assert struct.unpack("<4f", raw) == (0.0, 0.0, 1.0, 0.0)
    assert answer(choices, dimensions=1)["data"][0]["embedding"] == [1.0]
