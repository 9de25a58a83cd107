"""One streamed request over HTTP/SSE, timed at the client: when each piece of text arrived.

Raw SSE over aiohttp rather than the `openai` client: with hundreds of streams in one event
loop the SDK's per-chunk object building adds client-side delay to every timestamp.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.serve import flags

COMPLETIONS = flags.COMPLETIONS
CHAT = flags.CHAT
EMBEDDINGS = flags.EMBEDDINGS


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds from its send."""

    output_len: int  # max_tokens asked for
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0  # to the first chunk with text
    latency: float = 0.0  # to the end of the stream
    chunk_times: list[float] = field(default_factory=list)  # each chunk with text
    prompt_tokens: int = 0  # from the usage chunk
    completion_tokens: int = 0
    usage_seen: bool = False

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive chunks with text."""
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a single token."""
        if self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


def request_body(
    endpoint: str,
    model: str,
    prompt: str | list[int] | list[list[int]],
    max_tokens: int,
    ignore_eos: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The JSON body of a streamed request that asks for a usage chunk at the end; of an
    embedding request, the prompt (or batch of them) as `input`."""
    if endpoint == EMBEDDINGS:
        return {"model": model, "input": prompt, **extra}
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's and kvflow's extension
    if endpoint == CHAT:
        if not isinstance(prompt, str):
            raise ValueError("chat requests need text prompts (the random datasets are ids)")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:  # chat
        delta = choice["delta"] or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


def failure(exc: Exception) -> str:
    """What failed a request: the connection (aiohttp, a timeout), or a malformed reply."""
    if isinstance(exc, aiohttp.ClientError | TimeoutError):
        return f"{type(exc).__name__}: {exc}"
    return f"bad reply: {type(exc).__name__}: {exc}"


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> RequestResult:
    """Send `body` to `url`, read its event stream to the end; a bad reply (HTTP error, error
    event, malformed data, no [DONE] or no usage) fails the request and never raises."""
    result = RequestResult(output_len=int(body["max_tokens"]))
    result.start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            done = await _read_events(response, result)
            result.latency = time.perf_counter() - result.start
            # To the end of the body (the chunked encoding's last frame may come apart from
            # [DONE]): a body left unread makes aiohttp close the connection instead of
            # reusing it, and every later request would pay a new handshake.
            async for _ in response.content.iter_any():
                pass
    except Exception as exc:  # a bad reply fails this request, not the benchmark
        result.error = failure(exc)
        return result
    if not result.chunk_times:
        result.ttft = result.latency  # no text at all (e.g. only special tokens)
    if not result.error and not done:
        result.error = "the stream ended without [DONE]"
    if not result.error and not result.usage_seen:
        result.error = "no usage chunk: the server ignored stream_options.include_usage"
    result.success = not result.error
    return result


async def _read_events(response: aiohttp.ClientResponse, result: RequestResult) -> bool:
    """Fill `result` from the SSE lines; True once `[DONE]` arrived."""
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, keep-alives
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        now = time.perf_counter() - result.start
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
            return False
        if usage := chunk.get("usage"):
            result.usage_seen = True
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            result.completion_tokens = int(usage.get("completion_tokens") or 0)
        if _chunk_text(chunk):
            if not result.chunk_times:
                result.ttft = now
            result.chunk_times.append(now)
    return False


async def embed_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> RequestResult:
    """Send an embedding request; it succeeds with one vector per input and the usage, and a
    bad reply fails it without raising. Its latency is its only time."""
    result = RequestResult(output_len=0)
    result.start = time.perf_counter()
    inputs = body["input"]
    expected = len(inputs) if inputs and isinstance(inputs[0], list) else 1
    try:
        async with session.post(url, json=body, headers=headers) as response:
            text = await response.text()
            result.latency = time.perf_counter() - result.start
        if response.status != 200:
            result.error = f"HTTP {response.status}: {text[:300]}"
            return result
        reply = json.loads(text)
        if len(reply.get("data") or []) != expected:
            result.error = f"{len(reply.get('data') or [])} embeddings for {expected} inputs"
            return result
        result.prompt_tokens = int(reply["usage"]["prompt_tokens"])
        result.usage_seen = True
    except Exception as exc:  # a bad reply fails this request, not the benchmark
        result.error = failure(exc)
        return result
    result.ttft = result.latency
    result.success = True
    return result
