"""The scheduler and the executor joined in one process: the engine behind offline generation.

They meet only through the messages of `shared.protocol`, exactly as they do across
processes when serving.
"""

from __future__ import annotations

import logging

from services.executor.model_runner import ModelRunner
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.config import Config
from shared.model_config import (
    ModelConfig,
    ModelSource,
    derive_max_model_len,
    load_model_config,
    resolve_model_source,
)
from shared.protocol import EngineRequest, RequestOutput, SchedulerOutput, StatsSnapshot

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.source: ModelSource = resolve_model_source(config.model)
        self.model_config: ModelConfig = load_model_config(self.source)
        self.max_model_len = derive_max_model_len(config.max_model_len, self.model_config)
        self.runner = ModelRunner(config, self.source, self.model_config, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=config.block_size,
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
                enable_chunked_prefill=config.enable_chunked_prefill,
                eos_token_ids=self.model_config.eos_token_ids,
                vocab_size=self.model_config.vocab_size,
            )
        )
        self._in_flight: SchedulerOutput | None = None  # submitted, not yet collected
        logger.info(
            "engine ready: %s, max_model_len=%d, %d KV blocks",
            self.source.name,
            self.max_model_len,
            self.runner.num_blocks,
        )

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return self.scheduler.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One pipelined step: the next plan goes to the device, then the last one's outputs.

        The next plan is scheduled while the device runs the current one and queued behind it
        before the host waits for the current one's tokens (the device reads the decodes'
        input tokens from the step before), so the device never waits for the host while
        the host schedules, digests outputs and does the caller's work.
        """
        plan = self.scheduler.schedule()
        in_flight, self._in_flight = self._in_flight, plan
        if in_flight is None and not plan.num_scheduled_tokens and self.has_unfinished():
            raise RuntimeError("the scheduler could not schedule any waiting request")
        self.runner.submit(plan)
        if in_flight is None:
            return []
        return self.scheduler.update(in_flight, self.runner.collect())

    def stats(self) -> StatsSnapshot:
        return self.scheduler.stats()
