"""The frontend's engine client with a real socket: a tokenizer worker stand-in joins it over
inproc, says the engine is up, and sees what the client sends."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from services.frontend.engine.client import IDLE, EngineClient, QueueFull, RequestTimeout
from shared.config import Config
from shared.ipc import Decoder, encode
from shared.protocol import (
    AbortRequests,
    FrontendToTokenizer,
    GenerateRequest,
    Heartbeat,
    SamplingParams,
    StatsSnapshot,
    TextDelta,
)
from tests.unit.snapshots import stats


class Peers:
    """The engine's side of the frontend's socket, each message from the socket the frontend
    takes it from: tokenizer-0's requests and answers, each component's heartbeat thread, the
    scheduler's stats."""

    def __init__(self, context: zmq.asyncio.Context, address: str) -> None:
        self.context, self.address = context, address
        self.sockets: dict[str, zmq.asyncio.Socket] = {}

    def socket(self, identity: str) -> zmq.asyncio.Socket:
        if identity not in self.sockets:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, identity.encode())
            socket.connect(self.address)
            self.sockets[identity] = socket
        return self.sockets[identity]

    async def send(self, message: Heartbeat | StatsSnapshot | TextDelta) -> None:
        if isinstance(message, Heartbeat):
            identity = f"{message.component}-heartbeat"
        else:
            identity = "scheduler" if isinstance(message, StatsSnapshot) else "tokenizer-0"
        await self.socket(identity).send(encode(message))

    async def recv(self) -> bytes:
        """What the frontend sent tokenizer-0."""
        return await self.socket("tokenizer-0").recv()

    async def poll(self, timeout_ms: int) -> int:
        return await self.socket("tokenizer-0").poll(timeout_ms)

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close()


async def ready_engine(address: str) -> tuple[EngineClient, Peers]:
    """A started client whose components all beat, and its peers (one tokenizer worker)."""
    engine = EngineClient(Config(frontend_address=address))
    await engine.start()
    worker = Peers(engine.context, address)
    worker.socket("tokenizer-0")  # connected before it beats: the frontend can answer it
    for component in [*engine.expected, "tokenizer-0"]:
        await worker.send(beat(component))
    await worker.send(stats())
    deadline = time.monotonic() + 10
    while engine.unavailable_reason() is not None:
        assert time.monotonic() < deadline, engine.unavailable_reason()
        await asyncio.sleep(0.01)
    return engine, worker


def beat(component: str, session: str = "s1", draining: bool = False) -> Heartbeat:
    return Heartbeat(
        component=component, pid=1, sent_at=time.time(), session=session, draining=draining
    )


def test_a_restarted_tokenizer_worker_fails_the_requests_it_held() -> None:
    """Its previous process took their detokenizers with it: they end with an error now,
    rather than wait forever, the engine is told to stop them (through a live worker), and
    the worker takes new requests."""

    async def scenario() -> tuple[list[TextDelta], object, object]:
        engine, worker = await ready_engine("inproc://engine-client-restart")
        decoder = Decoder(FrontendToTokenizer, "worker")
        try:
            request = GenerateRequest(request_id="r", sampling_params=SamplingParams(), prompt="x")
            deltas = []

            async def consume() -> None:
                async for delta in engine.generate([request]):
                    deltas.append(delta)

            consumer = asyncio.create_task(consume())
            assert isinstance(decoder.decode(await worker.recv()), GenerateRequest)
            await worker.send(beat("tokenizer-0", session="s2"))
            await asyncio.wait_for(consumer, 10)
            abort = decoder.decode(await asyncio.wait_for(worker.recv(), 10))
            after = GenerateRequest(request_id="r2", sampling_params=SamplingParams(), prompt="y")
            second = asyncio.create_task(anext(engine.generate([after])))
            received = decoder.decode(await asyncio.wait_for(worker.recv(), 10))
            second.cancel()
            return deltas, abort, received
        finally:
            worker.close()
            engine.close()

    deltas, abort, received = asyncio.run(scenario())
    [failure] = deltas
    assert failure.error is not None and "tokenizer-0 restarted" in failure.error.message
    assert abort == AbortRequests(["r"])
    assert isinstance(received, GenerateRequest) and received.request_id == "r2"


def test_a_draining_worker_finishes_its_requests_while_new_ones_are_refused() -> None:
    """The last worker draining (SIGTERM, a rolling update): nothing new can start, but what
    it holds runs to its end."""

    async def scenario() -> tuple[list[TextDelta], str | None]:
        engine, worker = await ready_engine("inproc://engine-client-drain")
        try:
            request = GenerateRequest(request_id="r", sampling_params=SamplingParams(), prompt="x")
            generator = engine.generate([request])
            first = asyncio.create_task(anext(generator))
            await worker.recv()
            await worker.send(beat("tokenizer-0", draining=True))
            deadline = time.monotonic() + 10
            while engine.unavailable_reason() is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.6)  # the watchdog runs every 0.25 s: it must leave "r" be
            done = TextDelta(request_id="r", text="y", token_ids=[5], finish_reason="length")
            await worker.send(done)
            deltas = [await asyncio.wait_for(first, 10)]
            deltas += [d async for d in generator]
            return deltas, engine.unavailable_reason()
        finally:
            worker.close()
            engine.close()

    deltas, reason = asyncio.run(scenario())
    assert [(d.text, d.finish_reason, d.error) for d in deltas] == [("y", "length", None)]
    assert reason is not None and "draining" in reason


def test_a_request_failed_by_the_frontend_is_aborted_in_the_engine() -> None:
    """The drain deadline (or a lost component) ends a request here while the engine may still
    run it: the engine is told to stop, as for a client that went away."""

    async def scenario() -> tuple[list[TextDelta], object]:
        engine, worker = await ready_engine("inproc://engine-client-abort")
        decoder = Decoder(FrontendToTokenizer, "worker")
        try:
            request = GenerateRequest(request_id="r", sampling_params=SamplingParams(), prompt="x")
            deltas: list[TextDelta] = []

            async def consume() -> None:
                async for delta in engine.generate([request]):
                    deltas.append(delta)

            consumer = asyncio.create_task(consume())
            assert isinstance(decoder.decode(await worker.recv()), GenerateRequest)
            engine.fail_in_flight("the server is shutting down")
            await asyncio.wait_for(consumer, 10)
            return deltas, decoder.decode(await asyncio.wait_for(worker.recv(), 10))
        finally:
            worker.close()
            engine.close()

    deltas, after = asyncio.run(scenario())
    [failure] = deltas
    assert failure.error is not None and "shutting down" in failure.error.message
    assert after == AbortRequests(["r"])


def test_a_request_that_finished_normally_is_not_aborted() -> None:
    async def scenario() -> list[object]:
        engine, worker = await ready_engine("inproc://engine-client-finish")
        decoder = Decoder(FrontendToTokenizer, "worker")
        try:
            request = GenerateRequest(request_id="r", sampling_params=SamplingParams(), prompt="x")
            generator = engine.generate([request])
            first = asyncio.create_task(anext(generator))
            assert isinstance(decoder.decode(await worker.recv()), GenerateRequest)
            done = TextDelta(request_id="r", text="y", token_ids=[5], finish_reason="length")
            await worker.send(done)
            assert (await asyncio.wait_for(first, 10)).finish_reason == "length"
            assert await anext(generator, None) is None
            return [decoder.decode(f) for f in await _drain(worker)]
        finally:
            worker.close()
            engine.close()

    assert asyncio.run(scenario()) == []  # nothing was sent after the request itself


async def _drain(socket: zmq.asyncio.Socket) -> list[bytes]:
    frames = []
    while await socket.poll(200):
        frames.append(await socket.recv())
    return frames


def test_past_its_deadline_a_call_ends_and_is_aborted_and_silence_yields_idle() -> None:
    """The worker never answers: the call yields IDLE while it waits, then RequestTimeout at
    its deadline, and the engine is told to stop the request."""

    async def scenario() -> tuple[list[object], object, object]:
        engine, worker = await ready_engine("inproc://engine-client-deadline")
        decoder = Decoder(FrontendToTokenizer, "worker")
        try:
            request = GenerateRequest(request_id="r", sampling_params=SamplingParams(), prompt="x")
            seen: list[object] = []
            deadline = asyncio.get_running_loop().time() + 0.5
            with pytest.raises(RequestTimeout):
                async for delta in engine.generate([request], deadline, idle_after=0.1):
                    seen.append(delta)
            sent = decoder.decode(await asyncio.wait_for(worker.recv(), 10))
            abort = decoder.decode(await asyncio.wait_for(worker.recv(), 10))
            return seen, sent, abort
        finally:
            worker.close()
            engine.close()

    seen, sent, abort = asyncio.run(scenario())
    assert seen and all(delta is IDLE for delta in seen)
    assert isinstance(sent, GenerateRequest)
    assert abort == AbortRequests(["r"])


def test_a_full_queue_is_refused_up_front() -> None:
    async def scenario() -> None:
        engine, worker = await ready_engine("inproc://engine-client-queue")
        try:
            engine.check_queue_room()  # room
            engine.snapshots[0] = stats(num_waiting=4, max_queued_requests=4)
            with pytest.raises(QueueFull, match="4 requests are waiting"):
                engine.check_queue_room()
        finally:
            worker.close()
            engine.close()

    asyncio.run(scenario())


def test_a_worker_whose_connection_closes_fails_its_requests_and_a_silent_one_keeps_them(
    tmp_path: Path,
) -> None:
    """Over ipc://, as `serve` runs it: tokenizer-1's process goes (its sockets close), and the
    request it held ends with an error once the reconnect grace is over; tokenizer-0, alive
    but silent all the while (a starved process), keeps its request, which then completes."""

    async def scenario() -> tuple[list[TextDelta], list[TextDelta], list[str]]:
        engine, peers = await ready_engine(f"ipc://{tmp_path}/frontend")
        engine.liveness.reconnect_grace = 0.3
        try:
            peers.socket("tokenizer-1")
            await peers.send(beat("tokenizer-1"))
            while len(engine.tokenizers.accepting) < 2:
                await asyncio.sleep(0.01)
            requests = [
                GenerateRequest(request_id=r, sampling_params=SamplingParams(), prompt="x")
                for r in ("r0", "r1")  # to tokenizer-0, then the less loaded tokenizer-1
            ]
            results: dict[str, list[TextDelta]] = {"r0": [], "r1": []}

            async def consume(request: GenerateRequest) -> None:
                async for delta in engine.generate([request]):
                    assert isinstance(delta, TextDelta)
                    results[request.request_id].append(delta)

            first = asyncio.create_task(consume(requests[0]))
            await peers.recv()
            second = asyncio.create_task(consume(requests[1]))
            await asyncio.wait_for(peers.socket("tokenizer-1").recv(), 10)
            for identity in ("tokenizer-1", "tokenizer-1-heartbeat"):  # the process exits
                peers.sockets.pop(identity).close(linger=0)
            await asyncio.wait_for(second, 10)
            assert not first.done()
            done = TextDelta(request_id="r0", text="y", token_ids=[5], finish_reason="length")
            await peers.send(done)
            await asyncio.wait_for(first, 10)
            return results["r0"], results["r1"], engine.tokenizers.names
        finally:
            peers.close()
            engine.close()

    kept, lost, pool = asyncio.run(scenario())
    assert [(d.finish_reason, d.error) for d in kept] == [("length", None)]
    [failure] = lost
    assert failure.error is not None
    assert failure.error.message.startswith("tokenizer-1 is gone (its connection closed")
    assert pool == ["tokenizer-0"]


def test_an_engine_component_whose_connection_closes_fails_health_until_it_beats_again(
    tmp_path: Path,
) -> None:
    """The executor's process goes: /health names it once the grace is over; a new process
    (a restarted container) beats on a new connection and the engine is alive again."""

    async def scenario() -> tuple[str | None, str | None, str | None]:
        engine, peers = await ready_engine(f"ipc://{tmp_path}/frontend")
        engine.liveness.reconnect_grace = 0.3
        try:
            before = engine.failure_reason()
            peers.sockets.pop("executor-0-heartbeat").close(linger=0)
            deadline = time.monotonic() + 10
            while (during := engine.failure_reason()) is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await peers.send(beat("executor-0", session="s2"))
            while engine.failure_reason() is not None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            return before, during, engine.failure_reason()
        finally:
            peers.close()
            engine.close()

    before, during, after = asyncio.run(scenario())
    assert before is None and after is None
    assert during is not None and during.startswith("executor-0 is gone (its connection closed")
