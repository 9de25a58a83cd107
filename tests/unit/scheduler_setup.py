"""Building a scheduler core and adding requests to it, for the scheduler's unit tests."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from services.scheduler.scheduler_config import SchedulerConfig
from shared.protocol import EngineRequest, SamplingParams

EOS = 2


def make_scheduler(**overrides: object) -> Scheduler:
    config = dict(
        num_blocks=64,
        block_size=4,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        eos_token_ids=(EOS,),
    )
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))  # type: ignore[arg-type]


def add(scheduler: Scheduler, request_id: str, prompt: list[int], **params: object) -> None:
    params.setdefault("max_tokens", 4)
    scheduler.add_request(
        EngineRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=SamplingParams(**params)
        )
    )  # type: ignore[arg-type]
