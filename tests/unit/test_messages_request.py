"""Anthropic's Messages request read as a chat completion."""

from __future__ import annotations

import msgspec
import pytest

from services.frontend.api.messages_request import MessagesRequest, chat_messages, to_chat
from services.frontend.api.openai_types import NamedToolChoice
from shared.protocol import ParameterError


def request(**fields: object) -> MessagesRequest:
    """A body as the route decodes it."""
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.convert(body, MessagesRequest)


def test_blocks_become_chat_messages() -> None:
    messages = chat_messages(
        [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "...", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be brief."),
        ("user", "Weather in Paris?"),
        ("assistant", "Checking."),
        ("tool", "sunny"),
        ("user", "And tomorrow?"),
    ]
    [call] = messages[2].tool_calls or []
    assert (call.id, call.function.name, call.function.arguments) == (
        "toolu_1",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert messages[3].tool_call_id == "toolu_1"


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
    ],
)
def test_tool_choices_map_onto_chats(choice: dict, expected: str, parallel: bool) -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    body = request(tools=tools, tool_choice=choice)
    chat = to_chat(body)
    assert (chat.tool_choice, chat.parallel_tool_calls) == (expected, parallel)


def test_a_named_tool_is_a_named_function_and_stop_sequences_are_stops() -> None:
    body = request(
        tools=[{"name": "f"}], tool_choice={"type": "tool", "name": "f"}, stop_sequences=["END"]
    )
    chat = to_chat(body)
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "f"
    assert (chat.stop, chat.max_tokens) == (["END"], 4)


@pytest.mark.parametrize(
    "turn",
    [
        {"role": "system", "content": "x"},
        {"role": "user", "content": [{"type": "image", "source": {}}]},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        {"role": "user", "content": 3},
    ],
)
def test_bad_turns_are_refused_naming_messages(turn: dict) -> None:
    with pytest.raises(ParameterError) as refused:
        chat_messages(None, [turn])
    assert refused.value.param == "messages"


def test_thinking_switches_the_templates_enable_thinking() -> None:
    assert to_chat(request()).chat_template_kwargs is None
    enabled = to_chat(request(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert enabled.chat_template_kwargs == {"enable_thinking": True}
    disabled = to_chat(request(thinking={"type": "disabled"}))
    assert disabled.chat_template_kwargs == {"enable_thinking": False}
