"""Between a frontend and its tokenizer workers: API requests before tokenization, and the text
that streams back."""

from __future__ import annotations

import enum
from typing import Any

from shared.protocol.base import FinishReason, Message, RequestError
from shared.protocol.sampling import SamplingParams

# ------------------------------------------------------ frontend <-> tokenizer pool


class ToolCallMessage(Message, kw_only=True):
    """A call an assistant message made, as a conversation sends it back."""

    id: str
    name: str
    arguments: str  # JSON text


class ChatMessage(Message):
    role: str
    content: str
    name: str | None = None  # the participant's name, where the chat template uses it
    tool_calls: list[ToolCallMessage] = []  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ToolDefinition(Message, kw_only=True):
    """A function the model may call (OpenAI's `tools[i].function`)."""

    name: str
    description: str | None = None
    parameters: str = "{}"  # its JSON Schema, as JSON text


class ToolChoice(enum.StrEnum):
    """How a chat's tool calls are read from its output."""

    AUTO = "auto"  # the model may call: the --tool-call-parser reads its format
    REQUIRED = "required"  # the output is a JSON array of {"name", "parameters"} (a grammar)
    FUNCTION = "function"  # the output is the arguments of the one named function (a grammar)


class GenerateRequest(Message, tag=True, kw_only=True):
    """An API request before tokenization; exactly one of the prompt fields is set."""

    request_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    echo: bool = False  # return the prompt text (and its token ids) in the first delta
    arrival_time: float = 0.0
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    tools: list[ToolDefinition] | None = None  # given to the chat template
    tool_choice: ToolChoice | None = None  # None: the output is read as text only
    tool_name: str | None = None  # with ToolChoice.FUNCTION: the function called
    parallel_tool_calls: bool = True  # False: one call at most (later ones are dropped)
    # Echo with max_tokens 0: the engine computes one token, which is dropped: the answer is
    # the prompt (with its logprobs) alone.
    prompt_only: bool = False
    lora_id: int = 0  # the LoRA adapter it runs under (0: the base model)
    # Extra variables for the chat template (`{"enable_thinking": false}`), as the client sent
    # them; JSON values only.
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(Message, tag=True, kw_only=True):
    """/tokenize (text or messages -> ids), /detokenize (ids -> text) and /tokenizer_info."""

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool = True
    tools: list[ToolDefinition] | None = None  # given to the chat template with messages
    chat_template_kwargs: dict[str, Any] | None = None  # as a GenerateRequest's
    # /tokenizer_info: the answer's `text` is the tokenizer's configuration, as JSON text.
    info: bool = False


class TokenizeResult(Message, tag=True, kw_only=True):
    request_id: str
    token_ids: list[int] = []
    text: str = ""
    error: RequestError | None = None


class TopLogprob(Message, array_like=True):
    token_id: int
    token: str  # its text
    logprob: float


class TokenLogprob(Message, array_like=True):
    """A sampled token's logprob and rank with its text, and the top alternatives."""

    token_id: int
    token: str
    logprob: float
    rank: int  # 1 for the most likely token
    top: list[TopLogprob]


class ToolCallDelta(Message, kw_only=True, omit_defaults=True):
    """A piece of one tool call of a choice (OpenAI's `delta.tool_calls[i]`): the first piece
    of a call names it, the rest add to its arguments."""

    index: int  # the call's place in the choice's tool_calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""  # a piece of the arguments' JSON text


class PromptTokenLogprob(Message, array_like=True):
    """A prompt token with its text and, past the first token, its logprob and alternatives."""

    token_id: int
    token: str
    logprob: float | None  # None for the first token: nothing comes before it
    rank: int | None
    top: list[TopLogprob]


class TextDelta(Message, tag=True, kw_only=True):
    """New text for one request, from its tokenizer worker to the frontend."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = []
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_text: str | None = None  # first delta of an echo request
    prompt_token_ids: list[int] | None = None  # first delta of an echo request
    error: RequestError | None = None  # with finish_reason ERROR
    tool_calls: list[ToolCallDelta] = []  # `text` is then the content beside them
    prompt_logprobs: list[PromptTokenLogprob] | None = None  # the first delta, when asked
    stop_reason: str | None = None  # with finish_reason STOP: the stop string that ended it
    # With --reasoning-parser, a chat's thinking; `text` is then its answer alone.
    reasoning: str = ""
    # With --reasoning-parser: the output tokens so far that were thinking, <think> and
    # </think> included (OpenAI's reasoning_tokens).
    num_reasoning_tokens: int = 0
    embedding: list[float] | None = None  # the last delta of an embed request

    @classmethod
    def failure(cls, request_id: str, error: RequestError) -> TextDelta:
        """The last delta of a request that ended in an error."""
        return cls(
            request_id=request_id,
            text="",
            token_ids=[],
            finish_reason=FinishReason.ERROR,
            error=error,
        )


class TextDeltas(Message, tag=True):
    """One step's deltas for the requests a frontend sent one tokenizer worker: one message a
    step, not one a request, so a frontend that falls a few steps behind under hundreds of
    streams never fills the link (a full link stops its requests)."""

    deltas: list[TextDelta]
