"""The frontend process: uvicorn on uvloop serving the API, with a draining SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn
import uvloop

from services.frontend.app import InFlightCounter, create_app
from services.frontend.engine_client import EngineClient
from shared.config import Config
from shared.model_config import resolve_model_source

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: refuse new requests (503), let in-flight ones finish (up to
    --drain-timeout), then exit. A second signal exits at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: EngineClient,
        in_flight: InFlightCounter,
        drain_timeout: float,
    ) -> None:
        super().__init__(config)
        self.engine, self.in_flight, self.drain_timeout = engine, in_flight, drain_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self.loop is None:
            return super().handle_exit(sig, frame)
        self._draining = True
        self.in_flight.app.state.draining = True
        logger.info("draining: %d requests in flight", self.in_flight.count)
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.in_flight.count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight.count:
            logger.warning("drain timeout: %d requests still in flight", self.in_flight.count)
        self.should_exit = True


def run_frontend(config: Config) -> None:
    model_name = config.served_model_name or resolve_model_source(config.model).name
    engine = EngineClient(config)
    app = create_app(config, engine, model_name)
    in_flight = InFlightCounter(app)
    server = DrainingServer(
        uvicorn.Config(
            in_flight,
            host=config.host,
            port=config.port,
            loop="none",
            log_level="warning",
            timeout_graceful_shutdown=5,
        ),
        engine,
        in_flight,
        config.drain_timeout,
    )

    async def serve() -> None:
        server.loop = asyncio.get_running_loop()
        await engine.start()
        logger.info(
            "frontend listening on http://%s:%d (model %s)", config.host, config.port, model_name
        )
        await server.serve()
        engine.close()

    uvloop.run(serve())
