"""The tokenizer worker under --reasoning-parser: a chat's thinking goes out apart from its
answer, stop strings and tool calls read the answer alone, and chat_template_kwargs reach the
template. SmolLM2's tokenizer spells the tags as several tokens, which the text reading does
not mind."""

from __future__ import annotations

import copy

import pytest

from services.tokenizer.worker import TokenizerWorker
from shared.protocol import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    ParameterError,
    RequestOutput,
    SamplingParams,
    TextDelta,
    TokenizeRequest,
    ToolChoice,
    ToolDefinition,
)

# Qwen3's switch, cut down: thinking off writes an empty block into the prompt.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined %}<think>\n{% endif %}"
)


def make_worker(tokenizer, parser: str, **kwargs: object) -> TokenizerWorker:
    worker = TokenizerWorker(copy.copy(tokenizer), reasoning_parser=parser, **kwargs)  # type: ignore[arg-type]
    assert worker.tokenizer is not None
    worker.tokenizer.chat_template = THINKING_TEMPLATE
    return worker


def chat(request_id: str = "r", **fields: object) -> GenerateRequest:
    fields.setdefault("sampling_params", SamplingParams())
    fields.setdefault("messages", [ChatMessage("user", "What is 2+2?")])
    return GenerateRequest(request_id=request_id, **fields)  # type: ignore[arg-type]


def run(
    worker: TokenizerWorker, request_id: str, text: str, num_pieces: int = 5
) -> list[TextDelta]:
    """Stream `text`'s tokens in a few outputs, the last finishing the request."""
    assert worker.tokenizer is not None
    ids = worker.tokenizer.encode(text, add_special_tokens=False)
    size = max(1, -(-len(ids) // num_pieces))
    chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
    deltas = []
    for n, chunk in enumerate(chunks):
        last = n == len(chunks) - 1
        output = RequestOutput(
            request_id=request_id,
            new_token_ids=chunk,
            finish_reason=FinishReason.LENGTH if last else None,
        )
        deltas += worker.on_outputs([output])[0]
        if request_id not in worker.live:
            break
    return deltas


def reasoning_of(deltas: list[TextDelta]) -> str:
    return "".join(d.reasoning for d in deltas)


def text_of(deltas: list[TextDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_deepseek_r1_output_starts_in_the_thinking(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer, "deepseek_r1")
    worker.admit(chat())
    deltas = run(worker, "r", "Two and two.\n</think>\n\nIt is 4.")
    assert reasoning_of(deltas) == "Two and two.\n"
    assert text_of(deltas) == "It is 4."
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert any(d.reasoning for d in deltas[:-1])  # the thinking streamed before the end


def test_qwen3_with_thinking_off_is_all_answer(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer, "qwen3")
    worker.admit(chat(chat_template_kwargs={"enable_thinking": False}))
    deltas = run(worker, "r", "It is 4.")
    assert (reasoning_of(deltas), text_of(deltas)) == ("", "It is 4.")


def test_qwen3_reads_its_own_think_block(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer, "qwen3")
    worker.admit(chat())
    deltas = run(worker, "r", "<think>\nAdd them.\n</think>\n\nIt is 4.")
    assert (reasoning_of(deltas), text_of(deltas)) == ("\nAdd them.\n", "It is 4.")


def test_qwen3_after_a_template_that_opened_think(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer, "qwen3")
    worker.admit(chat(chat_template_kwargs={"open_think": True}))
    deltas = run(worker, "r", "Add them.\n</think>\n\nIt is 4.")
    assert (reasoning_of(deltas), text_of(deltas)) == ("Add them.\n", "It is 4.")


def test_stop_strings_end_the_answer_not_the_thinking(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer, "deepseek_r1")
    worker.admit(chat(sampling_params=SamplingParams(stop=["4"])))
    deltas = run(worker, "r", "Is it 4? Yes, 4.\n</think>\n\nIt is 4. Sure.", num_pieces=8)
    assert reasoning_of(deltas) == "Is it 4? Yes, 4.\n"
    assert text_of(deltas) == "It is "
    assert deltas[-1].finish_reason is FinishReason.STOP and "r" not in worker.live
    assert deltas[-1].stop_reason == "4"  # vLLM's stop_reason: the answer's stop string


def test_a_completion_is_not_read_for_thinking(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer, "deepseek_r1")
    worker.admit(GenerateRequest(request_id="c", sampling_params=SamplingParams(), prompt="Hi"))
    deltas = run(worker, "c", "a</think>b")
    assert (reasoning_of(deltas), text_of(deltas)) == ("", "a</think>b")


def test_tool_calls_are_read_from_the_answer_only(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer, "deepseek_r1", tool_call_parser="hermes")
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    tools = [ToolDefinition(name="f")]
    worker.admit(chat("a", tools=tools, tool_choice=ToolChoice.AUTO))
    deltas = run(worker, "a", f"Maybe {call}?</think>\n\nNo call.")
    assert reasoning_of(deltas) == f"Maybe {call}?"
    assert text_of(deltas) == "No call." and not any(d.tool_calls for d in deltas)
    worker.admit(chat("b", tools=tools, tool_choice=ToolChoice.AUTO))
    deltas = run(worker, "b", f"Call f.</think>\n\n{call}")
    assert [p.name for d in deltas for p in d.tool_calls if p.name] == ["f"]


def test_chat_template_kwargs_reach_the_template(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer, "qwen3")
    assert worker.tokenizer is not None
    off = worker.admit(chat("off", chat_template_kwargs={"enable_thinking": False}))
    on = worker.admit(chat("on"))
    assert worker.tokenizer.decode(off.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    assert not worker.tokenizer.decode(on.prompt_token_ids).endswith("</think>\n\n")
    messages = [ChatMessage("user", "What is 2+2?")]
    counted = worker.tokenize(
        TokenizeRequest(
            request_id="t", messages=messages, chat_template_kwargs={"enable_thinking": False}
        )
    )
    assert counted.token_ids == off.prompt_token_ids


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_chat_template_kwargs_may_not_replace_the_templates_own(
    smollm2_tokenizer, key: str
) -> None:
    worker = make_worker(smollm2_tokenizer, "qwen3")
    with pytest.raises(ParameterError, match=key) as error:
        worker.admit(chat(chat_template_kwargs={key: False}))
    assert error.value.param == "chat_template_kwargs"
    result = worker.tokenize(
        TokenizeRequest(
            request_id="t",
            messages=[ChatMessage("user", "x")],
            chat_template_kwargs={key: False},
        )
    )
    assert result.error is not None and result.error.param == "chat_template_kwargs"
    assert not worker.live


@pytest.mark.parametrize(
    ("parser", "kwargs", "text"),
    [
        ("qwen3", {}, "<think>\nAdd them.\n</think>\n\nIt is 4."),
        ("deepseek_r1", {}, "Two and two.\n</think>\n\nIt is 4."),
        ("qwen3", {"enable_thinking": False}, "It is 4."),
    ],
)
def test_the_thinking_tokens_are_counted_apart(
    smollm2_tokenizer, parser: str, kwargs: dict[str, object], text: str
) -> None:
    worker = make_worker(smollm2_tokenizer, parser)
    worker.admit(chat(chat_template_kwargs=kwargs or None))
    encoded = smollm2_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    deltas = run(worker, "r", text, num_pieces=len(encoded["input_ids"]))  # a token a piece
    # Every token that starts before the thinking's end: </think>'s own included.
    end = text.find("</think>") + len("</think>") if "</think>" in text else 0
    expected = sum(start < end for start, _ in encoded["offset_mapping"])
    assert deltas[-1].num_reasoning_tokens == expected
    assert 0 < expected < len(encoded["input_ids"]) or "</think>" not in text
    assert deltas[-1].num_output_tokens == len(encoded["input_ids"])


HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]


def test_openai_gptoss_reads_harmony_channels_from_special_tokens(smollm2_tokenizer) -> None:
    """gpt-oss's markers are special tokens, which decoding drops by default: under this
    parser the detokenizer keeps them for the reader, and neither part shows them."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    worker = make_worker(tokenizer, "openai_gptoss")
    worker.admit(chat())
    output = (
        "<|channel|>analysis<|message|>User asks 2+2.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 4."
    )
    deltas = run(worker, "r", output)
    assert reasoning_of(deltas) == "User asks 2+2."
    assert text_of(deltas) == "It is 4."


def test_openai_gptoss_with_the_openai_tool_parser_sends_harmony_calls(smollm2_tokenizer) -> None:
    """A message to a function becomes a tool call (its recipient the name, its body the
    arguments); a call the model only thought about (analysis) does not count."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    worker = make_worker(tokenizer, "openai_gptoss", tool_call_parser="openai")
    worker.admit(chat(tools=[ToolDefinition(name="add")], tool_choice=ToolChoice.AUTO))
    output = (
        "<|channel|>analysis<|message|>Call add.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json"
        '<|message|>{"a": 2, "b": 2}<|call|>'
    )
    deltas = run(worker, "r", output)
    assert reasoning_of(deltas) == "Call add."
    assert text_of(deltas) == ""
    calls = [p for d in deltas for p in d.tool_calls]
    assert [p.name for p in calls if p.name] == ["add"]
    assert "".join(p.arguments or "" for p in calls) == '{"a": 2, "b": 2}'
