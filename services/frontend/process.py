"""The frontend process: uvicorn on uvloop serving the API, with a draining SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from pathlib import Path
from types import FrameType

import uvicorn
import uvloop
from starlette.types import ASGIApp, Receive, Scope, Send

from services.frontend.app import create_app
from services.frontend.engine.client import EngineClient
from services.frontend.metrics.request_log import PROBE_PATHS
from services.frontend.routes.state import FrontendState
from shared.config import Config
from shared.constants import DRAIN_ERROR_GRACE_S
from shared.gc_heap import freeze_startup_heap
from shared.model_config import resolve_model_source
from shared.pooling import served_pooling

logger = logging.getLogger(__name__)


class InFlightCounter:
    """Counts HTTP requests from their first byte to their response's last (streams too), so
    a draining server waits for requests not yet registered with the engine as well."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.count = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            return await self.app(scope, receive, send)
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


class DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: refuse new requests (503), let in-flight ones finish (up to
    --drain-timeout), fail those still running (an error event ends each stream), then exit.
    A second signal exits at once."""

    def __init__(
        self, config: uvicorn.Config, state: FrontendState, in_flight: InFlightCounter
    ) -> None:
        super().__init__(config)
        self.state, self.in_flight = state, in_flight
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self.loop is None:
            return super().handle_exit(sig, frame)
        self.state.draining = True
        logger.info("draining: %d requests in flight", self.in_flight.count)
        loop = self.loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        await self._wait_in_flight(self.state.config.drain_timeout)
        if self.in_flight.count:
            logger.warning(
                "drain timeout: failing the %d requests still in flight", self.in_flight.count
            )
            # Through the engine client, so each ends the way it would if the engine were
            # lost (a 503, or an error event and [DONE]), not cut off by a cancelled task.
            self.state.engine.fail_in_flight("the server is shutting down")
            await self._wait_in_flight(DRAIN_ERROR_GRACE_S)
        self.should_exit = True

    async def _wait_in_flight(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.in_flight.count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def until_ready(state: FrontendState) -> None:
    """Until this frontend takes requests, or drains."""
    while state.not_ready_reason() is not None and not state.draining:
        await asyncio.sleep(0.2)


async def say_ready(state: FrontendState, path: Path) -> None:
    """Create --ready-file once this frontend takes requests (`serve` waits for every
    frontend's: a probe through the shared port reaches only one)."""
    await until_ready(state)
    if not state.draining:
        path.touch()


def run_frontend(config: Config) -> None:
    model_name = config.served_model_name or resolve_model_source(config.model).name
    if config.ready_file is not None:  # one left by a previous process is not true now
        Path(config.ready_file).unlink(missing_ok=True)
    engine = EngineClient(config)
    app = create_app(config, engine, model_name, served_pooling(config.task, config.model))
    state: FrontendState = app.state.frontend
    in_flight = InFlightCounter(app)
    server = DrainingServer(
        uvicorn.Config(
            in_flight,
            host=config.host,
            port=config.port,
            loop="none",
            # Named, not "auto": without httptools uvicorn would fall back to its pure-Python
            # parser (h11) unannounced, a third more CPU per streamed chunk.
            http="httptools",
            log_level="warning",
            timeout_graceful_shutdown=5,
        ),
        app.state.frontend,
        in_flight,
    )

    async def serve() -> None:
        server.loop = asyncio.get_running_loop()
        await engine.start()
        freeze_startup_heap()
        tasks = []
        if state.metrics_share is not None:
            figures = lambda: state.metrics.figures(len(engine.queues))  # noqa: E731
            tasks.append(asyncio.create_task(state.metrics_share.run(figures)))
        if config.ready_file is not None:
            tasks.append(asyncio.create_task(say_ready(state, Path(config.ready_file))))
        sockets = None
        if config.listen_fd is not None:
            # Side by side on serve's port, a frontend takes connections from its own socket
            # only once it takes requests: until then that socket's queue holds them.
            stops = (signal.SIGTERM, signal.SIGINT)  # until uvicorn's handlers come with serve
            for sig in stops:
                server.loop.add_signal_handler(sig, lambda: setattr(state, "draining", True))
            await until_ready(state)
            for sig in stops:
                server.loop.remove_signal_handler(sig)
            sockets = [socket.socket(fileno=config.listen_fd)]
        if not state.draining:
            logger.info(
                "frontend listening on http://%s:%d (model %s)",
                config.host, config.port, model_name,
            )  # fmt: skip
            await server.serve(sockets)
        for task in tasks:
            task.cancel()
        if state.metrics_share is not None:  # its last figures, none in flight, stay counted
            state.metrics_share.write(state.metrics.figures(0))
        engine.close()

    uvloop.run(serve())
