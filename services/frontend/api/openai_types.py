"""OpenAI request bodies, decoded and validated with msgspec, and their sampling parameters.

Unknown fields are ignored, as OpenAI clients send more than any server uses; wrong types
and out-of-range values become a 400 that names the parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec

from shared.protocol import (
    ChatMessage,
    ParameterError,
    SamplingParams,
    StructuredOutput,
    ToolCallMessage,
)

T = TypeVar("T")

# A completions prompt: decoded as anything, so prompts() can name `prompt` in its error; its
# JSON Schema (the OpenAPI document's) says what prompts() takes.
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
PromptValue = Annotated[
    Any,
    msgspec.Meta(
        extra_json_schema={
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                {
                    "type": "array",
                    "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                    "minItems": 1,
                },
            ]
        }
    ),
]
# Every integer a body holds goes to the other processes as msgpack, which carries 64 bits:
# larger ones are refused here (400), not met when encoding (500). OpenAI's seed is an int64;
# the n samples of a request use seed + k, which must still fit.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Seed = Int64


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: one kind of constraint (checked in structured.py)."""

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


class GenerateBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    seed: Seed | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    priority: Int64 = 0  # with --scheduling-policy priority: lower runs first
    timeout: float | None = None  # seconds this request may run (at most --request-timeout)
    # Structured output (structured.py reads them): OpenAI's, then vLLM's names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: Int64 | None = None  # vLLM's: the prompt tokens' logprobs, this many top

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured_output: StructuredOutput | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        params = SamplingParams(
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=None if self.top_k in (None, 0, -1) else self.top_k,
            min_p=_default(self.min_p, 0.0),
            seed=self.seed,
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            logit_bias=_logit_bias(self.logit_bias),
            logprobs=logprobs,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            skip_special_tokens=self.skip_special_tokens,
            n=self.n,
            structured_output=structured_output,
            prompt_logprobs=prompt_logprobs,
        )
        params.validate()
        if self.timeout is not None and not self.timeout > 0:
            raise ParameterError("timeout", "must be > 0 seconds")
        return params


class CompletionRequest(GenerateBody, kw_only=True):
    prompt: PromptValue = None  # checked in prompts()
    suffix: str | None = None
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    best_of: Int64 | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of texts or token-id lists."""
        if self.suffix is not None:
            raise ParameterError("suffix", "suffix is not supported")
        if self.best_of not in (None, self.n):
            raise ParameterError("best_of", "best_of must equal n (or be omitted)")
        return read_prompts(self.prompt, "prompt")


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallBody(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCallBody(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallBody


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: no parameters
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class ChatCompletionRequest(GenerateBody, kw_only=True):
    messages: list[Message]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    chat_template: str | None = None  # vLLM takes one; refused here (see chat_messages)
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required" or named
    parallel_tool_calls: bool = True
    # vLLM's: extra variables for the chat template (`{"enable_thinking": false}`); the
    # tokenizer worker refuses those that would replace the template's own arguments.
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI fields this server does not serve: refused by name (check_unsupported), never
    # ignored, as their answers would silently differ from what was asked.
    functions: Any = None  # the legacy form of tools
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: list[str] | None = None

    def check_unsupported(self) -> None:
        for name, hint in (
            ("functions", "use tools"),
            ("function_call", "use tool_choice"),
            ("prediction", "predicted outputs are not supported"),
            ("audio", "audio output is not supported"),
        ):
            if getattr(self, name) is not None:
                raise ParameterError(name, f"not supported: {hint}")
        if self.modalities not in (None, ["text"]):
            raise ParameterError("modalities", "only text output is supported")

    def chat_messages(self) -> list[ChatMessage]:
        if self.chat_template is not None:
            # A template is Jinja code that runs in the tokenizer pool: it comes from the model
            # or the operator, never from a client.
            raise ParameterError(
                "chat_template", "this server takes chat templates from the model, not requests"
            )
        if not self.messages:
            raise ParameterError("messages", "must be a non-empty list")
        return [chat_message(message) for message in self.messages]

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ParameterError("top_logprobs", "needs logprobs=true")
            return None
        return self.top_logprobs or 0


class TokenizeBody(msgspec.Struct, kw_only=True):
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None  # shown to the chat template, as a chat request's are
    chat_template_kwargs: dict[str, Any] | None = None  # as a chat request's
    add_special_tokens: bool = True

    def chat_messages(self) -> list[ChatMessage] | None:
        """The messages read as a chat request's, so both count the same prompt."""
        if self.messages is None:
            return None
        return [chat_message(m) for m in self.messages]


class DetokenizeBody(msgspec.Struct, kw_only=True):
    tokens: list[Int64]

    def token_ids(self) -> list[int]:
        if not all(_is_token_id(t) for t in self.tokens):
            raise ParameterError("tokens", "token ids must be in [0, 2**31)")
        return self.tokens


class LoadLoraAdapterBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/unload_lora_adapter (vLLM's body; an id given must be the named adapter's)."""

    lora_name: str
    lora_int_id: Int64 | None = None


def chat_message(message: Message) -> ChatMessage:
    if message.role not in ("system", "user", "assistant", "developer", "tool"):
        raise ParameterError("messages", f"unsupported role {message.role!r}")
    if message.role == "tool" and message.tool_call_id is None:
        raise ParameterError("messages", "a tool message needs its tool_call_id")
    if message.tool_calls and message.role != "assistant":
        raise ParameterError("messages", "only assistant messages carry tool_calls")
    calls = [
        ToolCallMessage(id=c.id, name=c.function.name, arguments=c.function.arguments)
        for c in message.tool_calls or []
    ]
    return ChatMessage(
        message.role, _text_of(message.content), message.name, calls, message.tool_call_id
    )


def _text_of(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != "text" for part in content):
        raise ParameterError("messages", "only text content parts are supported")
    return "".join(part.text or "" for part in content)


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` that the wire to the tokenizer pool (msgpack) can carry: JSON
    allows integers of any size, msgpack 64 bits."""
    if kwargs is not None:
        try:
            msgspec.msgpack.encode(kwargs)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ParameterError("chat_template_kwargs", f"cannot be passed on: {exc}") from None
    return kwargs


def decode_body(body: bytes, kind: type[T]) -> T:
    """Decode and type-check a JSON body, raising ParameterError naming the bad field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ParameterError(_field_of(str(exc)), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ParameterError("body", f"invalid JSON: {exc}") from None


def _field_of(message: str) -> str:
    # msgspec says "... - at `$.temperature`" or "Object missing required field `messages`".
    if "`$." in message:
        return message.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    if "field `" in message:
        return message.split("field `", 1)[1].split("`", 1)[0]
    return "body"


def read_prompts(prompt: Any, param: str) -> list[str | list[int]]:
    """A PromptValue (completions' `prompt`, embeddings' `input`) as a list of texts or
    token-id lists; ParameterError naming `param` for any other shape."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise ParameterError(
        param,
        "must be a non-empty string, list of strings, list of token ids, "
        "or list of lists of token ids",
    )


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _is_token_id_text(text: str) -> bool:
    # Ten digits at most: int() of a long string is slow, then refused (ValueError).
    return text.isascii() and text.isdigit() and len(text) <= 10 and _is_token_id(int(text))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    # Token ids only: not whatever int() reads (" 1", "-1", "1_0"), nor one too large for the
    # wire to the engine (which would fail there as an internal error).
    if not all(_is_token_id_text(k) for k in bias):
        raise ParameterError("logit_bias", "keys must be token ids")
    parsed = {int(k): float(v) for k, v in bias.items()}
    if any(not -100.0 <= v <= 100.0 for v in parsed.values()):
        raise ParameterError("logit_bias", "values must be in [-100, 100]")
    return parsed
