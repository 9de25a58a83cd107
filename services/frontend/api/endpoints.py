"""What each generate route does differently, as data.

All run one flow (validation.py, routes/calls.py); an Endpoint says how its body is read
(prompts or messages, max_tokens, logprobs) and how its answers are shaped: a whole body, or
a stream's events (sse.py). Chat completions are the internal request the other chat APIs
(Responses, Messages) translate to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from services.frontend.api import responses as r
from services.frontend.api.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    template_kwargs,
)
from services.frontend.api.sse import ChunkBuilder, ChunkStream, StreamWriter
from services.frontend.api.structured import ToolRequest, structured_output, tool_request
from shared.protocol import (
    ChatMessage,
    GenerateRequest,
    ParameterError,
    SamplingParams,
    StructuredOutput,
)

Body = TypeVar("Body")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a call, in the form its endpoint takes: text, token ids or messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    echo: bool = False  # completions only: return the prompt before its completion
    tools: ToolRequest = field(default_factory=ToolRequest)  # chat only
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone comes back
    chat_template_kwargs: dict[str, Any] | None = None  # chat only

    def request(
        self, request_id: str, params: SamplingParams, arrival_time: float, priority: int
    ) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id,
            sampling_params=params,
            prompt=self.text,
            prompt_token_ids=self.token_ids,
            messages=self.messages,
            echo=self.echo,
            arrival_time=arrival_time,
            priority=priority,
            tools=self.tools.tools,
            tool_choice=self.tools.choice,
            tool_name=self.tools.name,
            parallel_tool_calls=self.tools.parallel,
            prompt_only=self.prompt_only,
            chat_template_kwargs=self.chat_template_kwargs,
        )


@dataclass(frozen=True)
class Inputs:
    """What a body asks for, read the endpoint's way."""

    prompts: list[Prompt]
    params: SamplingParams  # for one sample: fanned out to n sub-requests per prompt
    logprobs: bool  # whether the response carries logprobs
    priority: int = 0
    timeout: float | None = None  # seconds the call may run, as the body asks
    context: Any = None  # what the endpoint's answers repeat of the body (its own type)


@dataclass(frozen=True)
class Endpoint(Generic[Body]):
    """One generate route: everything it does its own way; the rest of the flow is shared."""

    body_type: type[Body]
    read: Callable[[Body], Inputs]  # raises ParameterError naming the bad parameter
    logprobs_param: str  # the body field that asks for top logprobs
    id_prefix: str  # of the call's request_id: "cmpl-..." or "chatcmpl-..."
    response_body: Callable[[CallPlan, list[r.Choice]], dict[str, Any]]
    stream_writer: Callable[[CallPlan], StreamWriter]
    read_embeds: bool = False  # its requests are embed requests (an embedding model's)


@dataclass(frozen=True)
class CallPlan:
    """A validated generate call."""

    request_id: str
    model: str  # the served model or LoRA adapter, as the response names it
    endpoint: Endpoint[Any]
    sub_requests: list[GenerateRequest]  # prompt p, sample j is sub-request p * n + j
    num_prompts: int
    stream: bool
    include_usage: bool  # streams end with a usage chunk
    logprobs: bool  # choices carry logprobs
    timeout: float | None  # seconds the call may run: the body's, within --request-timeout
    context: Any = None  # Inputs.context


def _read_completion(body: CompletionRequest) -> Inputs:
    prompts = body.prompts()
    # Echo with logprobs gives the prompt's logprobs too; with max_tokens 0, those alone.
    prompt_only = body.echo and body.max_tokens == 0
    echoed = body.logprobs if body.echo else None
    asked = [k for k in (echoed, body.prompt_logprobs) if k is not None]
    prompt_logprobs = max(asked, default=None)
    params = body.sampling_params(
        1 if prompt_only else body.max_tokens,
        body.logprobs,
        structured_output(body),
        prompt_logprobs,
    )
    return Inputs(
        prompts=[
            Prompt(text=p, echo=body.echo, prompt_only=prompt_only)
            if isinstance(p, str)
            else Prompt(token_ids=p, echo=body.echo, prompt_only=prompt_only)
            for p in prompts
        ],
        params=params,
        logprobs=body.logprobs is not None,
        priority=body.priority,
        timeout=body.timeout,
    )


def read_chat(body: ChatCompletionRequest) -> Inputs:
    body.check_unsupported()
    messages = body.chat_messages()
    max_tokens = body.max_completion_tokens
    if max_tokens is None:  # the older name; 0 in either is refused, not taken as unset
        max_tokens = body.max_tokens
    tools = tool_request(body)
    params = body.sampling_params(
        max_tokens, body.num_logprobs, _chat_constraint(body, tools), body.prompt_logprobs
    )
    return Inputs(
        prompts=[
            Prompt(
                messages=messages,
                tools=tools,
                chat_template_kwargs=template_kwargs(body.chat_template_kwargs),
            )
        ],
        params=params,
        logprobs=body.logprobs,
        priority=body.priority,
        timeout=body.timeout,
    )


def _chat_constraint(body: ChatCompletionRequest, tools: ToolRequest) -> StructuredOutput | None:
    """The grammar of a chat's reply: its structured output, or its required or named call's.

    A forced call makes the reply a call and nothing else, so `response_format` (the shape of
    a text reply) has nothing to shape and gives way to the call's grammar, as with OpenAI and
    vLLM: clients send both, e.g. the Agents SDK for an agent with an output_type and a
    tool_choice. vLLM's own fields ask for the output itself and are refused beside it."""
    spec = structured_output(body)  # validated (400 for a bad one) even where it gives way
    if tools.structured_output is None:
        return spec
    if spec is not None and spec.source != "response_format":
        raise ParameterError(spec.source, "cannot be combined with a required or named tool_choice")
    return tools.structured_output


def _chunks(chunk: ChunkBuilder, chunk_object: str) -> Callable[[CallPlan], StreamWriter]:
    def writer(plan: CallPlan) -> StreamWriter:
        return ChunkStream(
            chunk,
            chunk_object,
            plan.request_id,
            plan.model,
            plan.logprobs,
            plan.include_usage,
            plan.num_prompts,
        )

    return writer


COMPLETIONS = Endpoint(
    body_type=CompletionRequest,
    read=_read_completion,
    logprobs_param="logprobs",
    id_prefix="cmpl",
    response_body=lambda plan, choices: r.completion_body(
        plan.request_id, plan.model, choices, plan.num_prompts, plan.logprobs
    ),
    stream_writer=_chunks(r.completion_chunk, "text_completion"),
)
CHAT = Endpoint(
    body_type=ChatCompletionRequest,
    read=read_chat,
    logprobs_param="top_logprobs",
    id_prefix="chatcmpl",
    response_body=lambda plan, choices: r.chat_body(
        plan.request_id, plan.model, choices, plan.num_prompts, plan.logprobs
    ),
    stream_writer=_chunks(r.chat_chunk, "chat.completion.chunk"),
)
