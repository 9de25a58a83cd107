"""What a request must satisfy to be queued: parameters it can be served with, and room in the
waiting queue."""

from __future__ import annotations

from services.scheduler.kv_cache_manager import blocks_for, window_blocks
from services.scheduler.scheduler_config import SchedulerConfig
from services.scheduler.waiting_queue import WaitingQueue
from shared.protocol import EngineRequest, ParameterError, QueueFullError


def check_queue_room(cfg: SchedulerConfig, waiting: WaitingQueue, num_prompt_tokens: int) -> None:
    """Raise QueueFullError if the waiting queue cannot take one more request.

    NOTE: an empty queue takes any request, so the token bound never makes a prompt that
    fits the model unservable; requests already queued (preempted ones too) stay.
    """
    if cfg.max_queued_requests is not None and len(waiting) >= cfg.max_queued_requests:
        raise QueueFullError(
            f"{len(waiting)} requests are waiting (--max-queued-requests {cfg.max_queued_requests})"
        )
    limit = cfg.max_queued_tokens
    if limit is not None and waiting and waiting.num_tokens + num_prompt_tokens > limit:
        raise QueueFullError(
            f"{waiting.num_tokens} prompt tokens are waiting and this request brings "
            f"{num_prompt_tokens} (--max-queued-tokens {limit})"
        )


def admissible_max_tokens(cfg: SchedulerConfig, engine_request: EngineRequest) -> int:
    """The request's max_tokens, resolved against max_model_len; raises ParameterError when
    the request can never be served."""
    params = engine_request.sampling_params
    params.validate(cfg.vocab_size)
    if engine_request.priority != 0 and cfg.scheduling_policy != "priority":
        raise ParameterError("priority", "needs --scheduling-policy priority (this server is fcfs)")
    num_prompt = len(engine_request.prompt_token_ids)
    if num_prompt == 0:
        raise ParameterError("prompt", "the prompt is empty")
    if cfg.vocab_size is not None and not all(
        0 <= t < cfg.vocab_size for t in engine_request.prompt_token_ids
    ):
        raise ParameterError("prompt", f"token ids must be in [0, {cfg.vocab_size})")
    room = cfg.max_model_len - num_prompt
    if params.embed and room >= 0:
        return 1  # an embedding computes its prompt and nothing past it
    if room < 1:
        raise ParameterError(
            "prompt",
            f"the prompt has {num_prompt} tokens; max_model_len is "
            f"{cfg.max_model_len}, which leaves no room to generate",
        )
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise ParameterError(
            "max_tokens",
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) "
            f"exceeds max_model_len ({cfg.max_model_len})",
        )
    if not cfg.enable_chunked_prefill and num_prompt > cfg.max_num_batched_tokens:
        raise ParameterError(
            "prompt",
            f"the prompt has {num_prompt} tokens, more than "
            f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) without chunked prefill",
        )
    if _peak_blocks(cfg, num_prompt + max_tokens) > _usable_blocks(cfg):
        raise ParameterError(
            "max_tokens",
            f"prompt + max_tokens ({num_prompt + max_tokens} tokens) needs "
            f"more KV blocks than the whole cache holds ({cfg.num_blocks})",
        )
    return max_tokens


def _peak_blocks(cfg: SchedulerConfig, num_tokens: int) -> int:
    """The most blocks a request of `num_tokens` holds at once, over every layer group: all
    of a full group's, and those a step's queries read of a sliding one's (a step computes at
    most the budget's tokens)."""
    blocks = blocks_for(num_tokens, cfg.block_size)
    step = min(cfg.max_num_batched_tokens, num_tokens)
    return sum(
        blocks if window is None else min(blocks, window_blocks(window, step, cfg.block_size))
        for window in cfg.kv_windows
    )


def _usable_blocks(cfg: SchedulerConfig) -> int:
    """The cache's blocks less the null block a window's freed places hold."""
    return cfg.num_blocks - any(window is not None for window in cfg.kv_windows)
