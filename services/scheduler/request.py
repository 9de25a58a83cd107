"""The scheduler's view of one request: its tokens, progress and block hashes."""

from __future__ import annotations

import enum

from shared.block_hashes import block_seed, hash_block
from shared.protocol import (
    EngineRequest,
    FinishReason,
    PromptLogprobs,
    SamplingParams,
    TokenLogprobs,
)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        engine_request: EngineRequest,
        max_tokens: int,
        block_size: int,
        arrival_index: int = 0,
    ) -> None:
        self.request_id = engine_request.request_id
        self.prompt_token_ids = list(engine_request.prompt_token_ids)
        self.sampling_params: SamplingParams = engine_request.sampling_params
        self.arrival_time = engine_request.arrival_time
        self.arrival_index = arrival_index  # the scheduler's count: breaks arrival-time ties
        self.priority = engine_request.priority
        self.lora_id = engine_request.lora_id
        self.max_tokens = max_tokens  # resolved against max_model_len
        self.all_token_ids = self.prompt_token_ids + list(engine_request.output_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is (or will be, this step) in the cache
        # Tokens that steps not yet reported may bring, at most (a row verifying d drafts: up
        # to d + 1): a pipelined engine schedules the next step before the last one's tokens
        # arrive, and the next step computes them. Counted down as each step is reported.
        self.num_pending_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_preemptions = 0
        # Read prefix blocks from the disk tier into the host tier for its next admission
        # (once: then it is admitted with what the host tier holds, even if it lost some)
        self.fetched_from_disk = False
        self.last_scheduled_step = 0  # the last plan that ran it
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_hashes: list[bytes] = []
        # LongRoPE: computed with the long set of frequencies (services/executor/layers/rotary.py)
        self.long_rope = False
        # Prefill/decode disaggregation (KVTransfer): a prefill engine's request ends after
        # its first token and hands its prompt's KV over; a decode engine's fetches it from
        # prefill replica `kv_source` at its first admission (-1: from nowhere, or done).
        transfer = engine_request.kv_transfer
        self.hands_over = transfer is not None and transfer.export and max_tokens > 1
        self.handed_over = False
        self.kv_source = -1 if transfer is None else transfer.source
        # Speculative decoding: whether it verifies drafts (set by the scheduler).
        self.speculates = False
        # Rows in a row whose drafts the proposer found none for, and the steps its rows get
        # no draft slots (run pipelined, not waiting for its tokens): note_proposal.
        self.spec_misses = 0
        self.spec_skip = 0
        # Prompt logprobs as the executor computes them, chunk by chunk; they go out with the
        # request's first output (take_prompt_logprobs).
        self.prompt_logprobs: list[TokenLogprobs] = []
        self._prompt_logprobs_sent = False
        self._block_size = block_size
        self._update_block_hashes()

    @property
    def _seed(self) -> bytes:
        return block_seed(self.lora_id, self.long_rope)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_scheduled_tokens_end(self) -> int:
        """Length of the sequence once every pending token arrives (at most: drafts in
        flight may be rejected)."""
        return len(self.all_token_ids) + self.num_pending_tokens

    def append_output(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def use_long_rope(self) -> None:
        """From now on it is computed with LongRoPE's long set, from its start: its blocks'
        keys say so."""
        self.long_rope = True
        self.block_hashes = []
        self._update_block_hashes()

    def add_prompt_logprobs(self, part: PromptLogprobs) -> None:
        """Keep the entries past those already held. NOTE: a request preempted in the middle of
        its prompt computes the prompt again from its start, and sends its first chunks twice."""
        skip = 1 + len(self.prompt_logprobs) - part.start  # entries of positions already held
        if not self._prompt_logprobs_sent and 0 <= skip < len(part.entries):
            self.prompt_logprobs.extend(part.entries[skip:])

    def take_prompt_logprobs(self) -> list[TokenLogprobs]:
        """The prompt's logprobs, once: for the request's first output."""
        if self._prompt_logprobs_sent:
            return []
        self._prompt_logprobs_sent = True
        taken, self.prompt_logprobs = self.prompt_logprobs, []
        return taken

    def _update_block_hashes(self) -> None:
        size = self._block_size
        for start in range(len(self.block_hashes) * size, self.num_tokens - size + 1, size):
            parent = self.block_hashes[-1] if self.block_hashes else self._seed
            self.block_hashes.append(hash_block(parent, self.all_token_ids[start : start + size]))
