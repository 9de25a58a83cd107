"""The Responses API's request read as a chat completion, and the store's bound."""

from __future__ import annotations

import pytest

from services.frontend.api.response_store import ResponseStore
from services.frontend.api.responses_request import ResponsesRequest, chat_messages, to_chat
from shared.protocol import ParameterError


def test_items_become_chat_messages_with_calls_joined_to_the_assistant() -> None:
    messages = chat_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather in "},
                    {"type": "input_text", "text": "Paris?"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": "{}",
            },
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "reasoning", "summary": []},  # earlier thinking: not given back
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
    )
    assert [(m.role, m.content) for m in messages] == [
        ("user", "Weather in Paris?"),
        ("assistant", "Checking."),
        ("tool", "sunny"),
    ]
    calls = messages[1].tool_calls or []
    assert [(c.id, c.function.name) for c in calls] == [
        ("call_1", "get_weather"),
        ("call_2", "get_time"),
    ]
    assert messages[2].tool_call_id == "call_1"


def test_instructions_come_first_and_earlier_items_before_the_input() -> None:
    body = ResponsesRequest(input="Again?", instructions="Be brief.", max_output_tokens=5)
    chat = to_chat(body, [{"role": "user", "content": "Hi"}])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("user", "Again?"),
    ]
    assert chat.max_completion_tokens == 5


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ({"role": "tool", "content": "x"}, "role must be"),
        ({"role": "user", "content": [{"type": "input_file"}]}, "only text input"),
        ({"type": "web_search_call"}, "not served"),
        ({"type": "function_call", "name": "f"}, "needs a string 'call_id'"),
    ],
)
def test_bad_items_are_refused_naming_input(item: dict, why: str) -> None:
    with pytest.raises(ParameterError, match=why) as refused:
        chat_messages([item])
    assert refused.value.param == "input"


def test_the_store_keeps_the_newest_and_forgets_deleted() -> None:
    store = ResponseStore(2)
    for n in range(3):
        store.put({"id": f"resp_{n}"}, [{"role": "user", "content": str(n)}])
    assert store.response("resp_0") is None
    assert store.conversation("resp_2") == [{"role": "user", "content": "2"}]
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.response("resp_1") is None
    ResponseStore(0).put({"id": "resp_x"}, [])  # keeps nothing, fails nothing
