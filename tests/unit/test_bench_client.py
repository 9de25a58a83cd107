"""`kvflow bench serve`'s client against a small SSE (and embeddings) server that misbehaves on
request: each bad reply fails its request (never the benchmark), and connections are reused."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from benchmarks.serve.client import (
    COMPLETIONS,
    EMBEDDINGS,
    RequestResult,
    embed_request,
    request_body,
    stream_request,
)
from benchmarks.serve.runner import session

PEERS = web.AppKey("peers", set)
GOOD = [
    {"choices": [{"text": "Hel"}]},
    {"choices": [{"text": "lo"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
]


async def sse(request: web.Request) -> web.StreamResponse:
    kind = (await request.json())["prompt"]
    request.app[PEERS].add(request.transport.get_extra_info("peername"))
    if kind == "http-error":
        return web.json_response({"error": {"message": "nope"}}, status=400)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    events = {
        "good": [json.dumps(e) for e in GOOD] + ["[DONE]"],
        "no-usage": [json.dumps(e) for e in GOOD[:2]] + ["[DONE]"],
        "malformed": [json.dumps(GOOD[0]), "{not json", "[DONE]"],
        "no-done": [json.dumps(e) for e in GOOD],
        "error-event": [json.dumps(GOOD[0]), json.dumps({"error": {"message": "boom"}})],
    }[kind]
    for event in events:
        await response.write(f"data: {event}\n\n".encode())
    # The body's last frame apart from [DONE], as uvicorn sends it: a client that stops
    # reading at [DONE] leaves the body unread and loses the connection.
    await asyncio.sleep(0.05)
    await response.write_eof()
    return response


async def embeddings(request: web.Request) -> web.Response:
    """Two vectors for two inputs, unless the model's name asks for a bad reply."""
    body = await request.json()
    request.app[PEERS].add(request.transport.get_extra_info("peername"))
    data = [{"index": i, "embedding": [0.6, 0.8]} for i in range(len(body["input"]))]
    reply = {"data": data, "usage": {"prompt_tokens": 5, "total_tokens": 5}}
    match body["model"]:
        case "http-error":
            return web.json_response({"error": {"message": "nope"}}, status=400)
        case "one-short":
            reply["data"] = data[:-1]
        case "malformed":
            return web.Response(text="{not json")
    return web.json_response(reply)


async def run(kinds: list[str], embed: bool = False) -> tuple[list[RequestResult], int]:
    app = web.Application()
    app[PEERS] = set()
    app.router.add_post(COMPLETIONS, sse)
    app.router.add_post(EMBEDDINGS, embeddings)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    endpoint = EMBEDDINGS if embed else COMPLETIONS
    url = f"http://127.0.0.1:{port}{endpoint}"
    results = []
    async with session() as http:
        for kind in kinds:  # one after another: each may reuse the last connection
            if embed:
                body = request_body(EMBEDDINGS, kind, [[1, 2], [3]], 0, False, {})
                results.append(await embed_request(http, url, body, {}))
            else:
                body = request_body(COMPLETIONS, "m", kind, 2, False, {})
                results.append(await stream_request(http, url, body, {}))
    await runner.cleanup()
    return results, len(app[PEERS])


def test_a_good_stream_is_timed_and_counted() -> None:
    (result,), _ = asyncio.run(run(["good"]))
    assert result.success and result.error == ""
    assert (result.prompt_tokens, result.completion_tokens) == (3, 2)
    assert len(result.chunk_times) == 2 and len(result.itl) == 1
    assert result.tpot is not None


def test_sequential_requests_share_one_connection() -> None:
    results, connections = asyncio.run(run(["good"] * 4))
    assert all(r.success for r in results)
    assert connections == 1


def test_each_bad_reply_fails_its_request_only() -> None:
    kinds = ["http-error", "no-usage", "malformed", "no-done", "error-event", "good"]
    results, _ = asyncio.run(run(kinds))
    errors = {kind: r.error for kind, r in zip(kinds, results, strict=True)}
    assert errors["http-error"].startswith("HTTP 400")
    assert errors["no-usage"].startswith("no usage chunk")
    assert errors["malformed"].startswith("bad reply: JSONDecodeError")
    assert errors["no-done"] == "the stream ended without [DONE]"
    assert errors["error-event"].startswith("error event")
    assert errors["good"] == "" and results[-1].success
    assert not any(r.success for r in results[:-1])


def test_embedding_requests_count_their_inputs_and_fail_on_bad_replies() -> None:
    kinds = ["good", "http-error", "one-short", "malformed", "good"]
    results, connections = asyncio.run(run(kinds, embed=True))
    errors = [r.error for r in results]
    assert errors[0] == errors[-1] == "" and results[0].success and results[-1].success
    assert (results[0].prompt_tokens, results[0].completion_tokens) == (5, 0)
    assert results[0].latency > 0 and results[0].tpot is None
    assert errors[1].startswith("HTTP 400")
    assert errors[2] == "1 embeddings for 2 inputs"
    assert errors[3].startswith("bad reply: JSONDecodeError")
    assert connections == 1
