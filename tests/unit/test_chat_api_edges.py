"""The Responses and Messages APIs' answers built from a choice's deltas: their streams of
events and their whole bodies agree, thinking first, then text, then calls."""

from __future__ import annotations

import json
from typing import Any

from services.frontend.api import responses as r
from services.frontend.api.messages_output import MessagesCall, MessagesStream, message_body
from services.frontend.api.responses_output import ResponsesCall, ResponsesStream, output_items
from services.frontend.api.responses_request import ResponsesRequest
from shared.protocol import FinishReason, TextDelta, ToolCallDelta, ToolChoice

DELTAS = [
    TextDelta(request_id="r", text="", token_ids=[1], reasoning="Let me "),
    TextDelta(request_id="r", text="", token_ids=[2], reasoning="think."),
    TextDelta(request_id="r", text="Paris", token_ids=[3]),
    TextDelta(
        request_id="r",
        text="",
        token_ids=[4],
        tool_calls=[
            ToolCallDelta(index=0, id="call_ab", name="f"),
            ToolCallDelta(index=0, arguments='{"x": 1}'),
        ],
        finish_reason=FinishReason.STOP,
        num_prompt_tokens=5,
        num_output_tokens=4,
    ),
]


def payloads(chunks: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(c.split(b"data: ", 1)[1]) for c in chunks]


def streamed(writer: Any) -> tuple[list[dict[str, Any]], r.Choice]:
    choice = r.Choice(0, ToolChoice.AUTO)
    chunks = writer.opening()
    for delta in DELTAS:
        choice.absorb(delta)
        chunks += writer.on_delta(choice, delta)
    return payloads(chunks + writer.closing([choice])), choice


def test_a_responses_stream_opens_and_closes_items_in_order() -> None:
    call = ResponsesCall(ResponsesRequest(input="Hi"))
    events, choice = streamed(ResponsesStream(call, "m"))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me think."
    assert final["output"][2]["arguments"] == '{"x": 1}'
    assert final["output"] == output_items(call, choice)  # as a whole body gives them


def test_a_messages_stream_gives_thinking_text_then_tool_use() -> None:
    call = MessagesCall()
    events, choice = streamed(MessagesStream(call, "m"))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "thinking_delta", "text_delta", "input_json_delta"]
    [said] = [e for e in events if e["type"] == "message_delta"]
    assert said["delta"]["stop_reason"] == "tool_use"
    body = message_body(call, "m", choice)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2]["input"] == {"x": 1}
    assert body["content"][2]["id"] == "toolu_ab"
