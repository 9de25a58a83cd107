"""The executor's core: holds the model, the paged KV cache and per-request state, and turns
each step's plan into one forward pass and one batched sampling call."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.executor.attention_metadata import AttentionMetadata
from services.executor.sampler import Sampler, SamplingRow
from services.executor.weights import load_model
from shared.config import Config
from shared.model_config import ModelConfig, ModelSource
from shared.protocol import ModelRunnerOutput, NewRequestData, SamplingParams, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_ids: list[str]  # requests that sample a token this step
    sample_rows: torch.Tensor  # [S]: the flat index of each one's last token


@dataclass
class RequestState:
    """What the executor remembers of a request between steps."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int

    @classmethod
    def from_new(cls, data: NewRequestData) -> RequestState:
        return cls(
            params=data.sampling_params,
            token_ids=data.prompt_token_ids + data.output_token_ids,
            num_prompt_tokens=len(data.prompt_token_ids),
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
        )

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(
            self.params,
            self.token_ids[: self.num_prompt_tokens],
            self.token_ids[self.num_prompt_tokens :],
        )


class ModelRunner:
    def __init__(
        self, config: Config, source: ModelSource, model_config: ModelConfig, max_model_len: int
    ) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.model_config = model_config
        torch.manual_seed(config.seed)
        self.model = load_model(
            source,
            model_config,
            config.load_format,
            self.dtype,
            self.device,
            max_position=max_model_len,
            seed=config.seed,
        )
        self.num_blocks = self._num_kv_blocks(config)
        shape = (
            2,
            self.num_blocks,
            self.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(model_config.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self._bytes_per_block() / 2**30,
        )
        self.sampler = Sampler(
            model_config.vocab_size, model_config.eos_token_ids, self.device, config.seed
        )
        self.requests: dict[str, RequestState] = {}

    def _bytes_per_block(self) -> int:
        cfg = self.model_config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _num_kv_blocks(self, config: Config) -> int:
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * config.gpu_memory_utilization) - used
        else:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // self._bytes_per_block()
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache; raise --gpu-memory-utilization")
        return num_blocks

    # ------------------------------------------------------------------ a step

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_plan(plan)
        if not plan.num_scheduled_tokens:
            return ModelRunnerOutput(step=plan.step, sampled={})
        inputs = self._prepare_inputs(plan)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])  # [S, vocab]
        states = [self.requests[rid] for rid in inputs.sample_ids]
        result = self.sampler(logits, [s.sampling_row() for s in states])
        for state, token_id in zip(states, result.token_ids, strict=True):
            state.token_ids.append(token_id)
        pairs = zip(inputs.sample_ids, result.logprobs, strict=True)
        return ModelRunnerOutput(
            step=plan.step,
            sampled=dict(zip(inputs.sample_ids, result.token_ids, strict=True)),
            logprobs={rid: lp for rid, lp in pairs if lp is not None},
        )

    def _apply_plan(self, plan: SchedulerOutput) -> None:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for data in plan.new_requests:
            self.requests[data.request_id] = RequestState.from_new(data)
        for delta in plan.cached_requests:
            state = self.requests[delta.request_id]
            state.block_ids.extend(delta.new_block_ids)
            state.num_computed_tokens = delta.num_computed_tokens

    def _prepare_inputs(self, plan: SchedulerOutput) -> StepInputs:
        token_ids: list[int] = []
        starts, counts, seq_lens, tables = [], [], [], []
        sample_ids: list[str] = []
        sample_rows: list[int] = []
        for request_id, num_new in plan.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = state.num_computed_tokens
            token_ids.extend(state.token_ids[start : start + num_new])
            starts.append(start)
            counts.append(num_new)
            seq_lens.append(start + num_new)
            tables.append(state.block_ids)
            state.num_computed_tokens = start + num_new
            if start + num_new == len(state.token_ids):  # reached the end: sample the next
                sample_ids.append(request_id)
                sample_rows.append(len(token_ids) - 1)
        input_ids, positions, meta = self._tensors(token_ids, starts, counts, seq_lens, tables)
        rows = torch.tensor(sample_rows, device=self.device)
        return StepInputs(input_ids, positions, meta, sample_ids, rows)

    def _tensors(
        self,
        token_ids: list[int],
        starts: list[int],
        counts: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        device = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
        )  # [R, MB]
        count_t = torch.tensor(counts)  # [R]
        req_index = torch.repeat_interleave(torch.arange(len(counts)), count_t)  # [T]
        first = torch.cumsum(count_t, 0) - count_t  # [R] offset of each request's first token
        positions = (
            torch.tensor(starts)[req_index] + torch.arange(len(token_ids)) - first[req_index]
        )
        slots = block_tables[req_index, positions // self.block_size].long() * self.block_size
        slot_mapping = slots + positions % self.block_size  # [T]
        query_start_loc = torch.zeros(len(counts) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(count_t, 0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=query_start_loc.to(device),
            max_query_len=max(counts),
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.tensor(token_ids, device=device)
        return input_ids, positions.to(device), meta
