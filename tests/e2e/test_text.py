"""Text at the edges of characters, through a real `kvflow serve`.

max_tokens may end a completion inside a multi-byte character (Chinese, emoji). The client
must never see U+FFFD that the model did not produce, streamed or not, and both must agree.
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.e2e.server import Server

PIZZA_FIRST_BYTES = 10813  # SmolLM2's token for the first two bytes of "🍕" (F0 9F)
FORCE_IT = {str(PIZZA_FIRST_BYTES): 100.0}


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server  # shared with other modules (tests/e2e/conftest.py)


def test_max_tokens_inside_a_character_gives_no_replacement_character(server: Server) -> None:
    client = server.client()
    common = dict(
        model="SmolLM2-135M-Instruct",
        prompt="My favourite food:",
        max_tokens=1,
        temperature=0,
        logit_bias=FORCE_IT,
    )
    whole = client.completions.create(**common)
    assert whole.usage.completion_tokens == 1  # the token was generated ...
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("", "length")  # ... unseen
    streamed = client.completions.create(**common, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == ""
    chat = client.chat.completions.create(
        model=common["model"],
        messages=[{"role": "user", "content": "Draw a pizza"}],
        max_tokens=1,
        temperature=0,
        logit_bias=FORCE_IT,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == ""


def test_offline_generate_drops_the_cut_character_too(smollm2: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logit_bias={PIZZA_FIRST_BYTES: 100.0})
    [result] = smollm2.generate("My favourite food:", params)
    assert (result.token_ids, result.text, result.finish_reason) == (
        [PIZZA_FIRST_BYTES],
        "",
        "length",
    )
