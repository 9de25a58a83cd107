"""OpenAI response bodies and stream chunks, built from the tokenizer pool's text deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shared.protocol import (
    FinishReason,
    PromptTokenLogprob,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolChoice,
)


@dataclass
class ToolCall:
    """One tool call of a choice, put together from its pieces."""

    id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": "".join(self.arguments)}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class Choice:
    """What one sub-request (one prompt x one of n samples) has produced so far."""

    index: int
    # How its tool calls are read: AUTO and REQUIRED calls end it with "tool_calls", a named
    # function's with "stop", as vLLM and OpenAI answer.
    tool_choice: ToolChoice | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_text: str = ""
    num_deltas: int = 0  # a chat stream's first chunk of each choice names the role
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)  # by index
    prompt_logprobs: list[PromptTokenLogprob] | None = None
    stop_reason: str | None = None  # the stop string that ended it (vLLM's stop_reason)
    reasoning: list[str] = field(default_factory=list)  # with --reasoning-parser
    num_reasoning_tokens: int = 0  # with --reasoning-parser: of num_output_tokens
    embedding: list[float] | None = None  # an embed request's

    def absorb(self, delta: TextDelta) -> None:
        self.num_deltas += 1
        self.text.append(delta.text)
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        for piece in delta.tool_calls:
            call = self.tool_calls.get(piece.index)
            if call is None:
                call = self.tool_calls[piece.index] = ToolCall(piece.id or "", piece.name or "")
            call.arguments.append(piece.arguments)
        self.logprobs.extend(delta.logprobs)
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = delta.num_output_tokens or self.num_output_tokens
        self.num_reasoning_tokens = delta.num_reasoning_tokens or self.num_reasoning_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_text is not None:
            self.prompt_text = delta.prompt_text
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.finish_reason is not None:
            self.finish_reason = self._openai_reason(delta.finish_reason)
            self.stop_reason = delta.stop_reason

    def _openai_reason(self, reason: FinishReason) -> str:
        calls = self.tool_calls and self.tool_choice in (ToolChoice.AUTO, ToolChoice.REQUIRED)
        if reason is FinishReason.STOP and calls:
            return "tool_calls"
        return "stop" if reason is FinishReason.ABORT else reason.value

    def message(self) -> dict[str, Any]:
        """The whole assistant message: its content, and its tool calls if it made any."""
        content = "".join(self.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message.update(_reasoning_fields("".join(self.reasoning)))
        if self.tool_calls:
            message["content"] = content or None
            message["tool_calls"] = [
                self.tool_calls[i].as_openai() for i in sorted(self.tool_calls)
            ]
        return message


def _reasoning_fields(reasoning: str) -> dict[str, str]:
    """A chat's thinking under both of vLLM's names: `reasoning` (vLLM 0.26 and later) and
    `reasoning_content` (the older name, which DeepSeek's API and many clients read)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def usage(choices: list[Choice], num_prompts: int) -> dict[str, Any]:
    # Each prompt counts once, however many samples share it.
    per_prompt = {c.index // max(len(choices) // num_prompts, 1): c for c in choices}
    prompt_tokens = sum(c.num_prompt_tokens for c in per_prompt.values())
    completion_tokens = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in per_prompt.values())
    counted: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning_tokens := sum(c.num_reasoning_tokens for c in choices):
        counted["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counted


# ------------------------------------------------------------------ completions


def completion_logprobs(
    entries: list[TokenLogprob],
    offset: int,
    prompt: list[PromptTokenLogprob] | None = None,
) -> dict[str, Any]:
    """OpenAI's legacy logprobs; with `prompt` (echo), the prompt's tokens come first, the
    first of them with null logprobs."""
    tokens: list[PromptTokenLogprob | TokenLogprob] = [*(prompt or []), *entries]
    offsets = []
    for entry in tokens:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in tokens],
        "token_logprobs": [e.logprob for e in tokens],
        "top_logprobs": [
            None if e.logprob is None else {t.token: t.logprob for t in e.top} for e in tokens
        ],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(entries: list[PromptTokenLogprob] | None) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else its logprob and
    the top alternatives by token id."""
    if entries is None:
        return None
    out: list[Any] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        ranked = {e.token_id: {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for rank, top in enumerate(e.top, start=1):
            ranked.setdefault(
                top.token_id, {"logprob": top.logprob, "rank": rank, "decoded_token": top.token}
            )
        out.append(ranked)
    return out


def completion_body(
    request_id: str, model: str, choices: list[Choice], num_prompts: int, logprobs: bool
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.prompt_text + "".join(c.text),
                "logprobs": completion_logprobs(c.logprobs, 0, c.prompt_logprobs)
                if logprobs and c.prompt_text
                else completion_logprobs(c.logprobs, 0)
                if logprobs
                else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": vllm_prompt_logprobs(c.prompt_logprobs),
            }
            for c in choices
        ],
        "usage": usage(choices, num_prompts),
    }


def completion_chunk(
    request_id: str, model: str, choice: Choice, delta: TextDelta, logprobs: bool
) -> dict[str, Any]:
    text = (delta.prompt_text or "") + delta.text  # an echo request's first delta has the prompt
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": choice.index,
                "text": text,
                "logprobs": completion_logprobs(delta.logprobs, 0, _echoed(delta))
                if logprobs
                else None,
                "finish_reason": choice.finish_reason if delta.finish_reason else None,
            }
        ],
    }


def _echoed(delta: TextDelta) -> list[PromptTokenLogprob] | None:
    """The prompt's logprobs, on the first chunk of an echo request."""
    return delta.prompt_logprobs if delta.prompt_text is not None else None


# ------------------------------------------------------------------ chat


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode()),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                    for t in e.top
                ],
            }
            for e in entries
        ]
    }


def chat_body(
    request_id: str, model: str, choices: list[Choice], num_prompts: int, logprobs: bool
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": c.message(),
                "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ],
        "usage": usage(choices, num_prompts),
        # vLLM's: one prompt per chat, the same for each choice
        "prompt_logprobs": vllm_prompt_logprobs(choices[0].prompt_logprobs) if choices else None,
    }


def chat_chunk(
    request_id: str, model: str, choice: Choice, delta: TextDelta, logprobs: bool
) -> dict[str, Any] | None:
    """`delta` was the last absorbed into `choice`; the first of each choice names the role.
    None when it brings nothing to say (text held back: a possible stop string, or a tool
    call's JSON not complete yet), as OpenAI sends no empty chunk."""
    said = delta.text or delta.reasoning or delta.tool_calls or delta.logprobs
    if not (said or delta.finish_reason) and choice.num_deltas > 1:
        return None
    message: dict[str, Any] = {"role": "assistant"} if choice.num_deltas == 1 else {}
    # A piece of thinking alone has no content (null), as vLLM sends it.
    alone = delta.tool_calls or (delta.reasoning and not delta.text)
    message["content"] = delta.text if delta.text or not alone else None
    if delta.reasoning:
        message.update(_reasoning_fields(delta.reasoning))
    if delta.tool_calls:
        message["tool_calls"] = [_tool_call_chunk(piece) for piece in delta.tool_calls]
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": choice.index,
                "delta": message,
                "logprobs": chat_logprobs(delta.logprobs) if logprobs else None,
                "finish_reason": choice.finish_reason if delta.finish_reason else None,
            }
        ],
    }


def _tool_call_chunk(piece: ToolCallDelta) -> dict[str, Any]:
    """A call's first piece names it (OpenAI's id, type and function.name); the rest only
    add to its arguments."""
    function: dict[str, Any] = {"arguments": piece.arguments}
    chunk: dict[str, Any] = {"index": piece.index, "function": function}
    if piece.id is not None:
        chunk["id"] = piece.id
        chunk["type"] = "function"
    if piece.name is not None:
        function["name"] = piece.name
    return chunk


def usage_chunk(request_id: str, model: str, obj: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": body,
    }
